"""Which ranks of a shm group share a node: each rank's line, its check, and the node plan.

Each rank publishes one line through the group's store (:func:`whoami`: host identity, pid,
PID namespace, allowed CPUs); :func:`parse_who` checks each line it reads (a malformed one is an
error naming its key), and :func:`plan_node` (pure) turns every rank's line into this rank's
:class:`NodePlan`.  Nothing here is trusted for safety: a plan that puts a rank on this node is
proved by the hand-over (:mod:`cpuddp.backends.shm.handover` checks the peer's credentials),
and a plan with fewer local ranks than the launcher said is refused
(:func:`check_local_size`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from cpuddp.errors import BackendError
from cpuddp.topology.here import allowed_cpus, host_identity, pid_namespace

__all__ = ["NodePlan", "whoami", "parse_who", "plan_node", "check_local_size"]

_STORE_FIX = "give the job a store only it uses (its own MASTER_PORT), and see docs/security.md"


def whoami() -> str:
    """This rank's line: host identity, pid, PID namespace, allowed CPUs (tab-separated)."""
    cpus = ",".join(str(c) for c in allowed_cpus())
    return f"{host_identity()}\t{os.getpid()}\t{pid_namespace()}\t{cpus}"


def parse_who(raw: bytes, key: str) -> List[str]:
    """One rank's :func:`whoami` line, checked: 4 tab-separated fields, a positive pid, CPU numbers."""
    try:
        text: Optional[str] = raw.decode()
    except UnicodeDecodeError:
        text = None
    fields = text.split("\t") if text is not None else []
    ok = len(fields) == 4 and bool(fields[0]) and fields[1].isdigit() and int(fields[1]) > 0 and bool(fields[2])
    ok = ok and all(c.isdigit() for c in fields[3].split(",") if fields[3])
    if not ok:
        raise BackendError(f"store key {key} holds {raw[:80]!r}, not a rank's 'host<TAB>pid<TAB>pid-namespace"
                           "<TAB>cpus' line: something else writes to this job's rendezvous store", fix=_STORE_FIX)
    return fields


@dataclass(frozen=True)
class NodePlan:
    """This rank's place among the ranks of its group, from every rank's :func:`whoami` line.

    ``grid[node][local_rank]`` is a group rank; ``local`` is this node's row."""

    local: Tuple[int, ...]
    local_rank: int
    node: int
    grid: Tuple[Tuple[int, ...], ...]
    peer_pids: dict = field(default_factory=dict)  # group rank -> pid (same PID namespace only)
    spin: bool = True  # the node's ranks have at least a CPU each: yield-spin before sleeping
    whole_gloo: Optional[str] = None  # why every collective runs on gloo, else None

    @property
    def local_size(self) -> int:
        return len(self.local)

    @property
    def nodes(self) -> int:
        return len(self.grid)


def plan_node(who: Sequence[Sequence[str]], rank: int) -> NodePlan:
    """Pure: ``who[r]`` is group rank r's :func:`whoami` line split at tabs."""
    hosts = list(dict.fromkeys(w[0] for w in who))
    grid = tuple(tuple(r for r in range(len(who)) if who[r][0] == h) for h in hosts)
    node = hosts.index(who[rank][0])
    local = grid[node]
    cpus = set().union(*(who[r][3].split(",") for r in local)) - {""}
    whole_gloo = None
    if len(local) == 1 and len(who) > 1:
        whole_gloo = "gloo for every collective: one rank per node"
    elif len({len(row) for row in grid}) != 1:
        whole_gloo = ("gloo for every collective: nodes run different numbers of ranks "
                      f"({', '.join(str(len(row)) for row in grid)})")
    return NodePlan(
        local=local,
        local_rank=local.index(rank),
        node=node,
        grid=grid,
        peer_pids={r: int(who[r][1]) for r in local if r != rank and who[r][2] == who[rank][2]},
        spin=bool(cpus) and len(cpus) >= len(local),
        whole_gloo=whole_gloo,
    )


def check_local_size(plan: NodePlan, expected: Optional[int], rank: int) -> None:
    """Refuse a plan with fewer ranks on this node than the launcher said (``expected``): the
    store that says so was written by something else, and believing it would send the node's
    traffic through gloo's sockets, which any local user can reach (docs/security.md)."""
    if expected is not None and plan.local_size < expected:
        raise BackendError(
            f"rank {rank}: the launcher says {expected} ranks run on this node, but the rendezvous store "
            f"shows {plan.local_size} ({list(plan.local)}): something else writes to this job's store; "
            "refusing to send this node's collectives anywhere but shared memory", fix=_STORE_FIX)
