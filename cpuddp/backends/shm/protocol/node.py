"""Which ranks of a shm group share a node: each rank's record, its check, and the node plan.

Each rank publishes its :class:`~cpuddp.launchers.hosts.HostRecord` through the group's store
(:func:`whoami`: host identity, allowed CPUs, pid, PID namespace), the JSON record the ranks
exchange at init; :func:`parse_who` checks each record it reads with the same
:func:`~cpuddp.launchers.hosts.parse_record` (a malformed one is an error naming its key), and
:func:`plan_node` (pure) places this rank with the same :func:`~cpuddp.launchers.hosts.layout`
and adds what only the shm group needs: the peers' pids, whether to spin, whether the whole group
runs on gloo.  Which node each member is on is not the store's to say: where the job's layout was proven
(at init, or by the world's shm group), :func:`pin_hosts` takes each member's host from it,
so no record written while a group forms can move a member off its node (and the group off
shared memory).  A plan that puts a rank on this node is proved by the hand-over
(:mod:`cpuddp.backends.shm.protocol.handover` checks the peer's credentials and its job identity), and
a plan with fewer local ranks than the launcher said is refused (:func:`check_local_size`).

:class:`GroupName` is what tells one group's formation from another's, from the process's own
facts: its key prefix in the store (a count this process keeps, which no one else can move)
and the group part of its :class:`~cpuddp.launchers.identity.JobIdentity`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from cpuddp.errors import BackendError, RendezvousError
from cpuddp.launchers import identity
from cpuddp.launchers.hosts import HostRecord, layout, parse_record
from cpuddp.launchers.store_values import STORE_FIX, stall_cause

__all__ = ["NodePlan", "GroupName", "group_name", "whoami", "gather_who", "parse_who", "pin_hosts", "plan_node",
           "check_local_size"]

#: (store endpoint, group) -> how many times this process formed that group on that store.
_formed: "collections.Counter[Tuple[str, str]]" = collections.Counter()


@dataclass(frozen=True)
class GroupName:
    """One formation of a group: ``members`` its global ranks in group-rank order, ``world`` the
    job's size, ``prefix`` its keys' prefix in the group's store, ``identity`` what its ranks
    state to each other."""

    members: Tuple[int, ...]
    world: int
    prefix: str
    identity: identity.JobIdentity


def group_name(store: Any, group_id: str, global_ranks: Sequence[int], size: int, world: Optional[int],
               environ: Any = os.environ) -> GroupName:
    """This process's name for the group forming now (``global_ranks`` empty: the world; ``world``:
    the job's size, None when this is the world)."""
    members = tuple(global_ranks) or tuple(range(size))
    endpoint = identity.store_endpoint(store)
    digest = hashlib.sha256(",".join(map(str, members)).encode()).hexdigest()[:16]
    group = f"{group_id or '-'}/{len(members)}:{digest}"
    _formed[(endpoint, group)] += 1
    n = _formed[(endpoint, group)]
    world = world or size
    job = identity.JobIdentity(endpoint, identity.launcher_job(environ), world, f"{group}/{n}")
    return GroupName(members, world, f"shm/{n}", job)



@contextlib.contextmanager
def _as_backend_error() -> Iterator[None]:
    """A malformed record is the shm set-up's error: a :class:`BackendError` with the same text."""
    try:
        yield
    except RendezvousError as exc:
        raise BackendError(exc.msg, fix=exc.fix) from None


def whoami(rank: int) -> HostRecord:
    """Group rank ``rank``'s record: host identity, allowed CPUs, pid, PID namespace."""
    return HostRecord.here(rank, None, None, process=True)


def gather_who(store: Any, rank: int, size: int, timeout: Any, name: GroupName) -> List[HostRecord]:
    """Every group rank's :func:`whoami` record from the group's ``store``, checked, waited for
    up to the group's ``timeout`` (a ``timedelta``).  A rank whose record never came is cpuddp's
    stall error, naming the group, the ranks not there, the likely causes and the fix -- not the
    store's bare "wait timeout"."""
    keys = [f"who/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError as exc:  # torch's DistStoreError; a wait that ran out says "timeout"
        if "timeout" not in str(exc).lower():
            raise
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise _stalled(rank, missing, timeout, name) from None
    return [parse_who(store.get(key), key, r, size) for r, key in enumerate(keys)]


def _stalled(rank: int, missing: List[int], timeout: Any, name: GroupName) -> BackendError:
    where = name.identity.store
    absent = [name.members[r] for r in missing]
    return BackendError(
        f"rank {rank}: the shm group of ranks {list(name.members)} did not form: group rank(s) {missing} (rank(s) "
        f"{absent} of the job) did not reach the rendezvous store at {where} within the group timeout "
        f"({timeout.total_seconds():g} s)",
        fix=("the ranks may create their subgroups in different orders: every rank must call dist.new_group (and "
             "init_device_mesh) for every group, in the same order, also the ranks outside the group (torch tells "
             "groups apart by that count); or " + stall_cause(where)))


def parse_who(raw: bytes, key: str, rank: int, size: int) -> HostRecord:
    """Group rank ``rank``'s :func:`whoami` record, read under ``key`` in a group of ``size``,
    every field checked (:func:`~cpuddp.launchers.hosts.parse_record`)."""
    with _as_backend_error():
        return parse_record(key, raw, rank, size, process=True)


def pin_hosts(who: Sequence[HostRecord], name: GroupName, mine: HostRecord) -> List[HostRecord]:
    """``who`` (a group's records, in group-rank order) with each member's host from the job's
    proven layout where there is one, and this rank's record its own, not the store's copy."""
    proven = identity.proven_hosts(name.identity.store, name.world)
    out = [mine if w.rank == mine.rank else w for w in who]
    if proven is None:
        return out
    return [dataclasses.replace(w, host=proven[name.members[w.rank]]) for w in out]


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
