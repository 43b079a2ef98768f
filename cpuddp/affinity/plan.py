"""The pure pinning planner: which CPUs and how many threads one local rank gets.

:func:`plan_pinning` is a pure function of a :class:`~cpuddp.topology.Topology` (the rules
are in :mod:`cpuddp.affinity`'s docstring); :class:`PinPlan` is its answer and
:class:`PinWarning` a thing the user should know about it, as a record with a stable
``code`` (``cpuddp doctor`` reads the records; logs show their text).  Nothing here reads the
environment or touches the machine: :func:`cpuddp.affinity.plan_for` does the reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional, Union

from cpuddp.topology.model import Topology, format_cpulist

from .ccl_workers import WORKER_AFFINITY_VAR, WORKER_COUNT_VAR, worker_affinity

__all__ = ["PinWarning", "PinPlan", "plan_pinning", "KMP_AFFINITY", "KMP_BLOCKTIME", "WARNING_CODES"]

#: Exported for Intel OpenMP (libiomp5) in child processes: one thread per CPU of the mask,
#: in order.  GNU OpenMP (PyPI torch) ignores the KMP_* variables.
KMP_AFFINITY = "granularity=fine,compact,1,0"
#: Intel OpenMP: spin 1 ms after a parallel region instead of 200 ms (IPEX's launcher default).
KMP_BLOCKTIME = "1"

#: The planner's warning codes (stable: ``cpuddp doctor`` and users may match on them).
WARNING_CODES = {
    "hyperthreads-shared": "more local ranks than physical cores: ranks get hyperthread siblings",
    "oversubscribed": "more local ranks than logical CPUs: ranks share CPUs",
    "unequal-shares": "the cores do not divide evenly among the local ranks",
    "ccl-workers-unreserved": "CCL_WORKER_COUNT above 1 leaves no CPU for oneCCL's workers: they share "
                              "the compute CPUs (never for the default of 1, which cannot go lower)",
    "threads-exceed-cpus": "the user asked for more threads than the rank has CPUs",
    "other": "a warning made from plain text (PinPlan(warnings=[\"...\"]))",
}


@dataclass(frozen=True)
class PinWarning:
    """One thing the user should know about a plan: a stable ``code`` (see
    :data:`WARNING_CODES`), the ``message``, and the ``fix`` (empty when there is none).

    ``str(w)`` is the text logged and shown: ``"<message>. Fix: <fix>"``, or the message alone.
    """

    code: str
    message: str
    fix: str = ""

    @property
    def text(self) -> str:
        return f"{self.message}. Fix: {self.fix}" if self.fix else self.message

    def __str__(self) -> str:
        return self.text

    def as_dict(self) -> dict[str, str]:
        """Plain data: ``{"code", "message", "fix"}``."""
        return {"code": self.code, "message": self.message, "fix": self.fix}

    @classmethod
    def coerce(cls, value: Union["PinWarning", str, Mapping[str, str]]) -> "PinWarning":
        """A record from a record, its :meth:`as_dict`, or plain text (code ``"other"``)."""
        if isinstance(value, PinWarning):
            return value
        if isinstance(value, Mapping):
            return cls(str(value["code"]), str(value["message"]), str(value.get("fix") or ""))
        return cls("other", str(value))


@dataclass(frozen=True)
class PinPlan:
    """Where one local rank runs.

    ``cpus``: logical CPUs for compute (the affinity mask).  ``num_threads``: torch / OpenMP
    threads.  ``ccl_worker_cpus``: CPUs reserved for oneCCL's workers.  ``reason``: how the
    plan was reached, in one line.  ``warnings``: what the user should know (logged once), as
    :class:`PinWarning` records (plain strings given here become records of code ``"other"``).
    ``env``: variables to export.  ``replace_env``: those among them whose current value
    came from a launcher's default, not the user, and may be overwritten.
    """

    local_rank: int
    cpus: tuple[int, ...]
    num_threads: int
    ccl_worker_cpus: tuple[int, ...] = ()
    reason: str = ""
    warnings: tuple[PinWarning, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    replace_env: tuple[str, ...] = ()
    local_world_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpus", tuple(sorted(self.cpus)))
        object.__setattr__(self, "ccl_worker_cpus", tuple(self.ccl_worker_cpus))
        object.__setattr__(self, "warnings", tuple(PinWarning.coerce(w) for w in self.warnings))
        object.__setattr__(self, "replace_env", tuple(self.replace_env))
        object.__setattr__(self, "env", dict(self.env))  # a plain dict pickles; a proxy does not

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON and logs: ``warnings`` as their text, ``warning_records`` as
        ``{"code", "message", "fix"}``."""
        return {
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "cpus": list(self.cpus),
            "cpulist": format_cpulist(self.cpus),
            "num_threads": self.num_threads,
            "ccl_worker_cpus": list(self.ccl_worker_cpus),
            "reason": self.reason,
            "warnings": [w.text for w in self.warnings],
            "warning_records": [w.as_dict() for w in self.warnings],
            "env": dict(self.env),
            "replace_env": list(self.replace_env),
        }


# --------------------------------------------------------------------------- the pure planner


class _Unit(NamedTuple):
    """What gets dealt to ranks: a physical core (or one logical CPU when sharing cores)."""

    socket: int
    numa: int
    cpus: tuple[int, ...]


def _units(topo: Topology, logical: bool, with_siblings: bool) -> list[_Unit]:
    out: list[_Unit] = []
    for siblings in topo.cores().values():
        first = topo.cpu(siblings[0])
        if logical:
            out.extend(_Unit(first.socket, first.numa, (c,)) for c in siblings)
        else:
            out.append(_Unit(first.socket, first.numa, siblings if with_siblings else siblings[:1]))
    return out


def _n(count: int, plural: str) -> str:
    """``_n(1, "cores")`` -> ``"1 core"``; ``_n(1, "logical CPUs")`` -> ``"1 logical CPU"``."""
    return f"{count} {plural[:-1] if count == 1 and plural.endswith('s') else plural}"


def _deal(sizes: list[int], n: int) -> list[int]:
    """Deal ``n >= len(sizes)`` ranks to groups: one each, then each extra rank to the group
    whose cores per rank would stay highest (ties: the first group)."""
    counts = [1] * len(sizes)
    for _ in range(n - len(sizes)):
        i = max(range(len(sizes)), key=lambda i: (sizes[i] / (counts[i] + 1), -i))
        counts[i] += 1
    return counts


def _by(units: list[_Unit], key: str) -> list[list[_Unit]]:
    groups: dict[int, list[_Unit]] = {}
    for u in units:
        groups.setdefault(getattr(u, key), []).append(u)
    return [groups[k] for k in groups]  # insertion order = (socket, numa, core) order


def _share(units: list[_Unit], n: int, slot: int, levels: tuple[str, ...] = ("socket", "numa")) -> tuple[list[_Unit], str]:
    """Slot ``slot`` of ``n``'s units: split by ``levels[0]`` when there are at least as many
    ranks as groups (and more than one group), then recurse; else contiguous blocks."""
    if levels:
        groups = _by(units, levels[0])
        if 1 < len(groups) <= n:
            counts = _deal([len(g) for g in groups], n)
            start = 0
            for g, c in zip(groups, counts):
                if slot < start + c:
                    mine, how = _share(g, c, slot - start, levels[1:])
                    return mine, f"split by {'socket' if levels[0] == 'socket' else 'NUMA node'}" + (
                        f", {how}" if how.startswith("split") else ""
                    )
                start += c
        return _share(units, n, slot, levels[1:])
    q, rem = divmod(len(units), n)
    start = slot * q + min(slot, rem)
    return units[start : start + q + (1 if slot < rem else 0)], "contiguous blocks"

def plan_pinning(
    topo: Topology,
    local_rank: int,
    local_world_size: int,
    *,
    ccl_workers: int = 0,
    omp_num_threads: Optional[int] = None,
    use_hyperthreads: bool = False,
    bound_by: Optional[str] = None,
) -> PinPlan:
    """The plan for ``local_rank`` of ``local_world_size`` on ``topo`` (pure).

    ``omp_num_threads``: the user's explicit thread count (wins over the core count).
    ``bound_by``: name of the launcher that already bound this rank to ``topo.allowed``; the
    plan then uses that whole set (see :mod:`cpuddp.affinity`).  Raises ValueError for a
    local rank outside ``[0, local_world_size)`` or an empty usable set.
    """
    L, r = int(local_world_size), int(local_rank)
    _check_args(topo, local_rank, local_world_size, ccl_workers, omp_num_threads)
    warnings: list[PinWarning] = []
    ranks, slot = (1, 0) if bound_by else (L, r)
    units, kind = _choose_units(topo, ranks, L, use_hyperthreads, warnings)
    mine, how = _my_share(units, kind, ranks, slot, L, topo, warnings)
    if bound_by:
        how = f"inside the set {bound_by} bound this rank to"
    compute, ccl = _reserve_ccl(mine, ccl_workers, r, kind, warnings)
    cpus = tuple(sorted(c for u in compute for c in u.cpus))
    ccl_cpus = tuple(u.cpus[0] for u in ccl)
    notes = [f"local rank {r} of {L}: {_n(len(compute), kind)} ({how})"]
    if ccl_cpus:
        notes.append(f"{len(ccl_cpus)} reserved for oneCCL workers (CPUs {format_cpulist(ccl_cpus)})")
    if not use_hyperthreads and kind == "cores" and len(topo.usable) > len(topo.cores()):
        notes.append("hyperthread siblings unused")
    threads = _threads(topo, cpus, L, r, bound_by, omp_num_threads, notes, warnings)
    return PinPlan(
        local_rank=r,
        cpus=cpus,
        num_threads=threads,
        ccl_worker_cpus=ccl_cpus,
        reason="; ".join(notes),
        warnings=tuple(warnings),
        env=_plan_env(threads, ccl_cpus, L),
        local_world_size=L,
    )


def _check_args(topo: Topology, local_rank: int, local_world_size: int, ccl_workers: int,
                omp_num_threads: Optional[int]) -> None:
    L, r = int(local_world_size), int(local_rank)
    if L < 1 or not 0 <= r < L:
        raise ValueError(f"local_rank={local_rank} and local_world_size={local_world_size}: need 0 <= local_rank < local_world_size")
    if ccl_workers < 0:
        raise ValueError(f"ccl_workers={ccl_workers}: must be >= 0")
    if omp_num_threads is not None and omp_num_threads < 1:
        raise ValueError(f"omp_num_threads={omp_num_threads}: must be >= 1")
    if not topo.usable:
        raise ValueError(
            f"no usable CPUs: allowed {format_cpulist(topo.allowed)!r} and online "
            f"{format_cpulist(topo.online)!r} do not overlap"
        )


def _choose_units(topo: Topology, ranks: int, L: int, use_hyperthreads: bool,
                  warnings: list[PinWarning]) -> tuple[list[_Unit], str]:
    """Physical cores, or logical CPUs when there are more ranks than cores."""
    units = _units(topo, logical=False, with_siblings=use_hyperthreads)
    usable = topo.usable
    if ranks > len(units) and len(usable) > len(units):
        warnings.append(PinWarning(
            "hyperthreads-shared",
            f"{L} local ranks but only {len(topo.cores())} physical cores in CPUs {format_cpulist(usable)}: "
            f"using hyperthread siblings, so ranks share cores"))
        return _units(topo, logical=True, with_siblings=False), "logical CPUs"
    return units, "cores"


def _my_share(units: list[_Unit], kind: str, ranks: int, slot: int, L: int, topo: Topology,
              warnings: list[PinWarning]) -> tuple[list[_Unit], str]:
    """This slot's units, with a warning for oversubscription or unequal shares."""
    if ranks > len(units):
        warnings.append(PinWarning(
            "oversubscribed",
            f"oversubscribed: {L} local ranks on {len(units)} {kind} (CPUs {format_cpulist(topo.usable)}): "
            f"ranks share CPUs, 1 thread each",
            f"start at most {len(units)} ranks per node, or give the job more CPUs"))
        return [units[slot % len(units)]], "oversubscribed: ranks share CPUs round-robin"
    mine, how = _share(units, ranks, slot)
    shares = [len(_share(units, ranks, s)[0]) for s in range(ranks)]
    if min(shares) * 1.25 < max(shares):
        warnings.append(PinWarning(
            "unequal-shares",
            f"local ranks get unequal shares ({min(shares)} to {max(shares)} {kind}): {len(units)} {kind} "
            f"in {len(_by(units, 'socket'))} socket(s) do not divide evenly among {ranks} ranks; "
            f"DDP runs at the pace of the smallest",
            "use a rank count that divides each socket's cores"))
    return mine, how


def _reserve_ccl(mine: list[_Unit], ccl_workers: int, r: int, kind: str,
                 warnings: list[PinWarning]) -> tuple[list[_Unit], list[_Unit]]:
    """``(compute, ccl)``: the first ``ccl_workers`` units go to oneCCL's workers when the share
    has more than that."""
    if not ccl_workers:
        return mine, []
    if len(mine) > ccl_workers:
        return mine[ccl_workers:], mine[:ccl_workers]
    if ccl_workers > 1:  # only a user's setting is above oneCCL's default of 1: say what would fit
        fits = max(1, len(mine) - 1)
        warnings.append(PinWarning(
            "ccl-workers-unreserved",
            f"{WORKER_COUNT_VAR}={ccl_workers} but local rank {r} has only {len(mine)} {kind}: "
            f"no CPUs reserved for oneCCL workers, they share the compute CPUs",
            f"{WORKER_COUNT_VAR}={fits}" + (" (oneCCL's default; it refuses 0)" if fits == 1 else "")
            + ", or fewer ranks per node"))
    # One worker (oneCCL's default, the least it accepts) and one unit per rank: the worker
    # shares the rank's CPU, as shm's communication thread does -- nothing to fix, no warning.
    return mine, []


def _threads(topo: Topology, cpus: tuple[int, ...], L: int, r: int, bound_by: Optional[str],
             omp_num_threads: Optional[int], notes: list[str], warnings: list[PinWarning]) -> int:
    """Threads = CPUs in the plan, capped by a shared bound set and the cgroup quota; the
    user's explicit count wins."""
    threads = len(cpus)
    if bound_by:
        node_cores = len(topo.cores(topo.base))
        fair = max(1, node_cores // L)
        if threads > fair:
            threads = fair
            notes.append(
                f"the bound set has more cores than this rank's share of the node "
                f"({node_cores} cores / {L} ranks) and may be shared: {_n(fair, 'threads')}"
            )
    if topo.quota is not None:
        cap = max(1, math.floor(topo.quota / L + 1e-9))
        if threads > cap:
            threads = cap
            notes.append(f"cgroup quota {topo.quota:g} CPUs / {L} ranks: {_n(cap, 'threads')}")
    if omp_num_threads is None:
        notes.append(_n(threads, "threads"))
        return threads
    notes.append(f"{_n(omp_num_threads, 'threads')} as the user asked")
    if omp_num_threads > len(cpus):
        warnings.append(PinWarning(
            "threads-exceed-cpus",
            f"{omp_num_threads} threads asked for local rank {r}, which is pinned to {len(cpus)} CPUs "
            f"({format_cpulist(cpus)}): threads will share CPUs"))
    return omp_num_threads


def _plan_env(threads: int, ccl_cpus: tuple[int, ...], L: int) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(threads), "KMP_AFFINITY": KMP_AFFINITY, "KMP_BLOCKTIME": KMP_BLOCKTIME}
    if ccl_cpus:
        env[WORKER_COUNT_VAR] = str(len(ccl_cpus))
        env[WORKER_AFFINITY_VAR] = worker_affinity(ccl_cpus, L)
    return env
