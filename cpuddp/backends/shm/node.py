"""Which ranks of a shm group share a node: each rank's record, its check, and the node plan.

Each rank publishes its :class:`~cpuddp.launchers.hosts.HostRecord` through the group's store
(:func:`whoami`: host identity, allowed CPUs, pid, PID namespace), the JSON record the ranks
exchange at init; :func:`parse_who` checks each record it reads with the same
:func:`~cpuddp.launchers.hosts.parse_record` (a malformed one is an error naming its key), and
:func:`plan_node` (pure) places this rank with the same :func:`~cpuddp.launchers.hosts.layout`
and adds what only the shm group needs: the peers' pids, whether to spin, whether the whole group
runs on gloo.  Nothing here is trusted for safety: a plan that puts a rank on this node is
proved by the hand-over (:mod:`cpuddp.backends.shm.handover` checks the peer's credentials),
and a plan with fewer local ranks than the launcher said is refused
(:func:`check_local_size`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Tuple

from cpuddp.errors import BackendError, RendezvousError
from cpuddp.launchers.hosts import HostRecord, layout, parse_record
from cpuddp.launchers.store_values import STORE_FIX

__all__ = ["NodePlan", "whoami", "parse_who", "plan_node", "check_local_size"]



@contextlib.contextmanager
def _as_backend_error() -> Iterator[None]:
    """A malformed record is the shm set-up's error: a :class:`BackendError` with the same text."""
    try:
        yield
    except RendezvousError as exc:
        raise BackendError(exc.msg, fix=exc.fix) from None


def whoami(rank: int) -> str:
    """Group rank ``rank``'s record as JSON: host identity, allowed CPUs, pid, PID namespace."""
    return HostRecord.here(rank, None, None, process=True).to_json()


def parse_who(raw: bytes, key: str, rank: int, size: int) -> HostRecord:
    """Group rank ``rank``'s :func:`whoami` record, read under ``key`` in a group of ``size``,
    every field checked (:func:`~cpuddp.launchers.hosts.parse_record`)."""
    with _as_backend_error():
        return parse_record(key, raw, rank, size, process=True)


@dataclass(frozen=True)
class NodePlan:
    """This rank's place among the ranks of its group, from every rank's :func:`whoami` record.

    ``grid[node][local_rank]`` is a group rank; ``local`` is this node's row."""

    local: Tuple[int, ...]
    local_rank: int
    node: int
    grid: Tuple[Tuple[int, ...], ...]
    peer_pids: dict = field(default_factory=dict)  # group rank -> pid (same PID namespace only)
    spin: bool = True  # the node's ranks have at least a CPU each: yield-spin before sleeping
    whole_gloo: Optional[str] = None  # why every collective runs on gloo, else None
    local_cpus: Tuple[frozenset, ...] = ()  # each local rank's allowed CPUs, in local-rank order

    @property
    def local_size(self) -> int:
        return len(self.local)

    @property
    def nodes(self) -> int:
        return len(self.grid)


def plan_node(who: Sequence[HostRecord], rank: int) -> NodePlan:
    """Pure: ``who`` holds every group rank's record (:func:`parse_who`), one per rank."""
    with _as_backend_error():
        lay = layout(who, rank)
    by_rank = {w.rank: w for w in who}
    local = lay.nodes[lay.node_rank]
    cpus = frozenset().union(*lay.local_cpus)
    whole_gloo = None
    if len(local) == 1 and len(who) > 1:
        whole_gloo = "gloo for every collective: one rank per node"
    elif len({len(row) for row in lay.nodes}) != 1:
        whole_gloo = ("gloo for every collective: nodes run different numbers of ranks "
                      f"({', '.join(str(len(row)) for row in lay.nodes)})")
    me = by_rank[rank]
    return NodePlan(
        local=local,
        local_rank=lay.local_rank,
        node=lay.node_rank,
        grid=lay.nodes,
        peer_pids={r: by_rank[r].pid for r in local
                   if r != rank and by_rank[r].pid is not None and by_rank[r].pid_ns == me.pid_ns},
        spin=bool(cpus) and len(cpus) >= len(local),
        whole_gloo=whole_gloo,
        local_cpus=tuple(lay.local_cpus),
    )


def check_local_size(plan: NodePlan, expected: Optional[int], rank: int) -> None:
    """Refuse a plan with fewer ranks on this node than the launcher said (``expected``): the
    store that says so was written by something else, and believing it would send the node's
    traffic through gloo's sockets, which any local user can reach (docs/security.md)."""
    if expected is not None and plan.local_size < expected:
        raise BackendError(
            f"rank {rank}: the launcher says {expected} ranks run on this node, but the rendezvous store "
            f"shows {plan.local_size} ({list(plan.local)}): something else writes to this job's store; "
            "refusing to send this node's collectives anywhere but shared memory", fix=STORE_FIX)
