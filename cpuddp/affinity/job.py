"""A job's plan: how many ranks per node, which CPUs and how many threads each (pure).

``cpuddp run`` launches it and ``cpuddp doctor`` shows it (the plan a job of N ranks would
get here); :func:`rank_cpus_line` is the one-line form of where each rank runs, which the
run plan, :class:`cpuddp.Progress`'s header and the example's summary print.

:func:`plan_run` is a pure function of one node's :class:`~cpuddp.topology.Topology` and the
request (``--ranks-per-node`` / ``--cores-per-rank``, the node count, Slurm's CPUs per task,
an ``OMP_NUM_THREADS`` already set).  The rules (docs/run.md has worked examples):

- Ranks per node: ``--ranks-per-node N``; else ``usable cores / --cores-per-rank C`` (C must
  divide the usable cores); else the CPUs Slurm granted divided by its CPUs per task; else
  one rank per NUMA node that has usable CPUs (the topology reader falls back to one per
  socket where the kernel reports no NUMA).
- Each rank's CPUs are the in-rank planner's (:func:`cpuddp.affinity.plan.plan_pinning`):
  whole physical cores of the usable set (affinity mask ∩ online ∩ cgroup cpuset), disjoint,
  dealt to sockets and NUMA nodes so no rank straddles one when there are at least as many
  ranks.  With ``--cores-per-rank`` every rank gets exactly C cores: when NUMA boundaries do
  not allow that, contiguous blocks of C cores, and a warning names the straddling ranks.
- Threads per rank = the physical cores it gets, capped by its part of a cgroup CPU quota.
- Refused before anything starts (:class:`RunPlanError`, naming the value and the fix): more
  ranks than usable physical cores, C that does not divide them, fewer CPUs than one rank
  needs, and an ``OMP_NUM_THREADS`` that differs from the plan's threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .plan import plan_pinning
from cpuddp.errors import CpuddpError
from cpuddp.topology.model import Topology, format_cpulist

__all__ = ["RunPlanError", "RankSlot", "RunPlan", "RankPlace", "plan_run", "plan_table", "rank_cpus_line"]


class RunPlanError(CpuddpError, ValueError):
    """A ``cpuddp run`` request that cannot be met; ``fix`` says what to ask for instead."""


@dataclass(frozen=True)
class RankSlot:
    """One local rank of a node: its logical CPUs (for the affinity mask) and threads."""

    local_rank: int
    cpus: tuple[int, ...]
    cores: int
    threads: int


@dataclass(frozen=True)
class RunPlan:
    """The whole job: ``nodes`` x ``ranks_per_node`` ranks, each node laid out as ``slots``.

    ``cpus_known``: False when the CPUs are not this machine's (``cpuddp run`` in a Slurm
    allocation from a login node): the launcher binds each rank to ``cpus_per_rank`` CPUs and
    the table shows counts, not CPU ids.
    """

    nodes: int
    ranks_per_node: int
    slots: tuple[RankSlot, ...]
    cpus_per_rank: int
    reason: str
    warnings: tuple[str, ...] = ()
    cpus_known: bool = True
    hosts: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def threads(self) -> int:
        """The smallest rank's thread count (all ranks' when the shares are equal)."""
        return min(s.threads for s in self.slots)

    @property
    def cores_per_rank(self) -> int:
        return min(s.cores for s in self.slots)

    def rank_cpus_env(self) -> str:
        """``CPUDDP_RANK_CPUS``: each local rank's CPU list, ``;``-separated, local rank order."""
        return ";".join(format_cpulist(s.cpus) for s in self.slots)

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "world_size": self.world_size,
            "cpus_per_rank": self.cpus_per_rank, "cpus_known": self.cpus_known, "hosts": list(self.hosts),
            "slots": [{"local_rank": s.local_rank, "cpus": format_cpulist(s.cpus), "cores": s.cores,
                       "threads": s.threads} for s in self.slots],
            "reason": self.reason, "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- the planner


def plan_run(
    topo: Topology,
    *,
    nodes: int = 1,
    ranks_per_node: Optional[int] = None,
    ranks_source: str = "--ranks-per-node",
    cores_per_rank: Optional[int] = None,
    slurm_cpus_per_task: Optional[int] = None,
    omp_num_threads: Optional[str] = None,
    cpus_known: bool = True,
    hosts: Sequence[str] = (),
) -> RunPlan:
    """The plan for ``nodes`` nodes laid out like ``topo`` (pure; the module doc has the rules).

    ``slurm_cpus_per_task``: ``SLURM_CPUS_PER_TASK`` of the allocation (sets the rank count when
    neither option does).  ``omp_num_threads``: the caller's ``OMP_NUM_THREADS`` (None: unset).
    Raises :class:`RunPlanError` for a request that cannot be met.
    """
    if ranks_per_node is not None and cores_per_rank is not None:
        raise RunPlanError(f"--ranks-per-node {ranks_per_node} and --cores-per-rank {cores_per_rank} both given",
                           fix="give one of them: the other follows from the cores of the node")
    cores = topo.cores()
    ncores = len(cores)
    if ncores == 0:
        raise RunPlanError(f"no usable CPUs: allowed {format_cpulist(topo.allowed)!r}, online {format_cpulist(topo.online)!r}",
                           fix="run where this process may use at least one online CPU")
    n, why = _rank_count(topo, ncores, ranks_per_node, cores_per_rank, slurm_cpus_per_task, ranks_source)
    slots, warnings = _slots(topo, n, cores_per_rank)
    _check_omp(omp_num_threads, slots)
    per_rank = min(len(s.cpus) for s in slots)
    if topo.usable != topo.online:
        why += f"; usable CPUs {format_cpulist(topo.usable)} (cpuset/affinity) of {format_cpulist(topo.online)}"
    if topo.quota is not None:
        why += f"; cgroup quota {topo.quota:g} CPUs"
    return RunPlan(nodes=nodes, ranks_per_node=n, slots=tuple(slots), cpus_per_rank=per_rank, reason=why,
                   warnings=tuple(warnings), cpus_known=cpus_known, hosts=tuple(hosts))


def _rank_count(topo: Topology, ncores: int, ranks_per_node: Optional[int], cores_per_rank: Optional[int],
                slurm_cpus_per_task: Optional[int], source: str = "--ranks-per-node") -> tuple[int, str]:
    """Ranks per node and the rule that chose it."""
    where = f"{ncores} usable physical core{'s' if ncores != 1 else ''} (CPUs {format_cpulist(topo.usable)})"
    if ranks_per_node is not None:
        if ranks_per_node < 1:
            raise RunPlanError(f"{source} {ranks_per_node}: must be at least 1", fix="--ranks-per-node 1 or more")
        if ranks_per_node > ncores:
            raise RunPlanError(
                f"{source} {ranks_per_node} is more ranks than the node's {where}: ranks would share cores",
                fix=f"--ranks-per-node {ncores} or fewer (or give the job more CPUs)")
        return ranks_per_node, f"{source} {ranks_per_node} on {where}"
    if cores_per_rank is not None:
        return _from_cores_per_rank(cores_per_rank, ncores, where)
    if slurm_cpus_per_task is not None:
        n = len(topo.usable) // slurm_cpus_per_task
        if n < 1:
            raise RunPlanError(
                f"SLURM_CPUS_PER_TASK={slurm_cpus_per_task} (salloc/sbatch -c) is more than the "
                f"{len(topo.usable)} CPUs each node has in this allocation",
                fix=f"ask Slurm for -c {len(topo.usable)} or fewer, or pass --ranks-per-node")
        n = min(n, ncores)
        return n, f"{len(topo.usable)} CPUs per node / SLURM_CPUS_PER_TASK={slurm_cpus_per_task}: {n} rank(s) per node"
    numa = sorted({topo.cpu(c).numa for c in topo.usable})
    n = min(len(numa), ncores)
    if topo.source == "synthetic-slurm":
        return n, (f"one rank per node: the nodes' NUMA layout is unknown from this host (--ranks-per-node "
                   f"or salloc/sbatch -c set it); {len(topo.usable)} CPU(s) per node granted")
    return n, f"one rank per NUMA node ({len(numa)}) on {where}"


def _from_cores_per_rank(c: int, ncores: int, where: str) -> tuple[int, str]:
    if c < 1:
        raise RunPlanError(f"--cores-per-rank {c}: must be at least 1", fix="--cores-per-rank 1 or more")
    if c > ncores:
        raise RunPlanError(f"--cores-per-rank {c} is more than the node's {where}",
                           fix=f"--cores-per-rank {ncores} or fewer")
    if ncores % c:
        divisors = [d for d in range(1, ncores + 1) if ncores % d == 0]
        raise RunPlanError(
            f"--cores-per-rank {c} does not divide the node's {where}: {ncores % c} core(s) would idle",
            fix=f"--cores-per-rank one of {', '.join(map(str, divisors))}, or --ranks-per-node N")
    return ncores // c, f"--cores-per-rank {c} on {where}: {ncores // c} rank(s) per node"


def _slots(topo: Topology, n: int, cores_per_rank: Optional[int]) -> tuple[list[RankSlot], list[str]]:
    """Each local rank's CPUs: the in-rank planner's placement, or C-core blocks."""
    plans = [plan_pinning(topo, r, n) for r in range(n)]
    warnings: list[str] = []
    for w in plans[0].warnings:
        warnings.append(w.text)
    slots = [RankSlot(r, p.cpus, len(topo.cores(p.cpus)), p.num_threads) for r, p in enumerate(plans)]
    if cores_per_rank is not None and any(s.cores != cores_per_rank for s in slots):
        slots, straddle = _blocks(topo, n, cores_per_rank)
        warnings = [w for w in warnings if "unequal" not in w]
        if straddle:
            warnings.append(f"with --cores-per-rank {cores_per_rank}, local rank(s) {', '.join(map(str, straddle))} "
                            f"span two NUMA nodes or sockets (cross-node memory traffic); --ranks-per-node "
                            f"{len({topo.cpu(c).numa for c in topo.usable})} keeps every rank inside one")
    return slots, warnings


def _blocks(topo: Topology, n: int, c: int) -> tuple[list[RankSlot], list[int]]:
    """``n`` contiguous blocks of ``c`` physical cores in (socket, NUMA node, core) order."""
    groups = list(topo.cores().values())
    slots, straddle = [], []
    cap = max(1, int(topo.quota // n)) if topo.quota is not None else c
    for r in range(n):
        mine = groups[r * c:(r + 1) * c]
        cpus = tuple(g[0] for g in mine)
        if len({(topo.cpu(x).socket, topo.cpu(x).numa) for x in cpus}) > 1:
            straddle.append(r)
        slots.append(RankSlot(r, cpus, c, min(c, cap)))
    return slots, straddle


def _check_omp(omp: Optional[str], slots: Sequence[RankSlot]) -> None:
    """An ``OMP_NUM_THREADS`` the plan contradicts is refused (each rank sets its own)."""
    if omp is None or not omp.strip():
        return
    threads = sorted({s.threads for s in slots})
    try:
        value = int(omp.split(",")[0])
    except ValueError:
        value = None
    if value is not None and threads == [value]:
        return
    plan = f"{threads[0]}" if len(threads) == 1 else f"{threads[0]} to {threads[-1]}"
    raise RunPlanError(
        f"OMP_NUM_THREADS={omp} contradicts the plan: {len(slots)} rank(s) per node with {plan} thread(s) each "
        f"(one per physical core of the rank)",
        fix=f"unset OMP_NUM_THREADS (cpuddp run sets it for each rank), or choose the ranks so each gets "
            f"{omp} cores: --cores-per-rank {omp}")


# --------------------------------------------------------------------------- the table


def plan_table(plan: RunPlan, hosts: Sequence[str] = ()) -> str:
    """The plan as text: one row per rank (node, rank, local rank, CPUs, threads)."""
    names = list(hosts) or [f"node{i}" for i in range(plan.nodes)]
    rows = [("node", "rank", "local", "CPUs", "threads")]
    for i, name in enumerate(names[:plan.nodes]):
        for s in plan.slots:
            cpus = format_cpulist(s.cpus) if plan.cpus_known else f"{plan.cpus_per_rank} CPUs (bound by the launcher)"
            rows.append((name, str(i * plan.ranks_per_node + s.local_rank), str(s.local_rank), cpus, str(s.threads)))
    widths = [max(len(r[k]) for r in rows) for k in range(5)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    head = f"# {plan.world_size} rank(s): {plan.nodes} node(s) x {plan.ranks_per_node}; {plan.reason}"
    return "\n".join([head, *lines, *(f"# warning: {w}" for w in plan.warnings)])


# --------------------------------------------------------------------------- one line per job


@dataclass(frozen=True)
class RankPlace:
    """Where one rank of a running job runs: its host, its CPUs (affinity) and its threads."""

    rank: int
    host: str
    cpus: tuple[int, ...]
    threads: int


#: Ranks named in full on :func:`rank_cpus_line`; beyond it, the first and last few.
LINE_RANKS = 8


def _place_text(p: RankPlace) -> str:
    word = "CPU" if len(p.cpus) == 1 else "CPUs"
    return f"rank {p.rank} {word} {format_cpulist(p.cpus) or '?'} ({p.threads} thread{'s' if p.threads != 1 else ''})"


def rank_cpus_line(places: Sequence[RankPlace]) -> str:
    """Each rank's CPUs and threads on one line (hosts named when there are several), e.g.
    ``rank 0 CPU 0 (1 thread), rank 1 CPU 1 (1 thread)``; long jobs show their first and
    last ranks with the count between."""
    places = sorted(places, key=lambda p: p.rank)
    hosts = list(dict.fromkeys(p.host for p in places))
    shown: list[Optional[RankPlace]] = list(places)
    if len(places) > LINE_RANKS:
        half = LINE_RANKS // 2
        shown = [*places[:half], None, *places[-half:]]
    parts, host = [], None
    for p in shown:
        if p is None:
            parts.append(f"... {len(places) - 2 * (LINE_RANKS // 2)} more ...")
            continue
        text = _place_text(p)
        if len(hosts) > 1 and p.host != host:
            text, host = f"on {p.host}: {text}", p.host
        parts.append(text)
    return ", ".join(parts)
