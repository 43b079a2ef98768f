"""Core pinning: which CPUs and how many threads each local rank gets, and applying that.

Usage::

    plan = cpuddp.affinity.plan_for(cpuddp.env.detect(os.environ))   # decide, change nothing
    print(plan.as_dict())
    with cpuddp.affinity.pinned(plan):                                # apply, then restore
        train()

:func:`cpuddp.init_distributed` does ``plan_for`` + ``apply_plan`` by default (``pin=False``
opts out) and puts the plan in ``DistEnv.pin_plan``; :func:`current_plan` returns the plan
in force.

The rules (:func:`plan_pinning`, a pure function of a :class:`~cpuddp.topology.Topology`):

- Each local rank gets whole physical cores from the usable set (allowed ∩ online ∩ cgroup
  cpuset), disjoint from every other local rank's.  Placement depends only on (topology,
  local rank, local world size), so the ranks of a node agree without talking.
- With at least as many local ranks as sockets, no rank straddles a socket: ranks are dealt
  to sockets in proportion to their core counts (each socket gets one or more), and likewise
  to the NUMA nodes inside a socket.  Fewer ranks than sockets: contiguous blocks of cores
  in (socket, NUMA node, core) order.
- Hyperthread siblings go unused (``use_hyperthreads=True`` uses them), unless there are
  more local ranks than physical cores; then one logical CPU per rank.  More ranks than
  logical CPUs: ranks share CPUs, one thread each, and a warning gives the numbers.
- Backend ``ccl``: the first ``CCL_WORKER_COUNT`` (default 1) cores of each rank's share go
  to oneCCL's workers (``CCL_WORKER_AFFINITY``), when the share has more than that; else
  the workers share the compute cores, with a warning.
- Threads = CPUs in the plan, capped by the rank's part of a cgroup CPU quota.

The user wins (:func:`plan_for`):

- If the launcher already bound this rank (Intel MPI pins by default; Open MPI binds by
  default; MPICH ``-bind-to``; Slurm ``--cpu-bind``; MVAPICH2) and its allowed set is
  narrower than the node's, the plan stays inside that set and uses all of it; when the set
  is bigger than the rank's share of the node (other ranks may share it), the thread count
  is capped at that share.  A set narrowed with no launcher binding (``taskset``/``numactl``
  around the whole job) is split among the local ranks.
- ``CPUDDP_NUM_THREADS`` wins over everything, then an explicit ``OMP_NUM_THREADS``.
  ``OMP_NUM_THREADS=1`` under torchrun with several local ranks is torchrun's own default,
  not the user's choice: the plan replaces it (``CPUDDP_NUM_THREADS=1`` keeps 1 thread).

Environment variables read: ``CPUDDP_NUM_THREADS``, ``OMP_NUM_THREADS``,
``CCL_WORKER_COUNT``, and the binding signs ``I_MPI_PIN``, ``I_MPI_PIN_MAPPING``,
``I_MPI_PIN_DOMAIN``, ``I_MPI_PIN_PROCESSOR_LIST``, ``HYDRA_USER_PROVIDED_BINDING``,
``SLURM_CPU_BIND``, ``SLURM_CPU_BIND_TYPE``, ``MV2_ENABLE_AFFINITY``.  Written by
:func:`apply_plan`, only where unset (or set by a launcher's default): ``OMP_NUM_THREADS``,
``KMP_AFFINITY``, ``KMP_BLOCKTIME`` and, for ccl, ``CCL_WORKER_COUNT``,
``CCL_WORKER_AFFINITY``.  A value the user set and the plan would change is kept and logged.

Applying sets the affinity of every thread of the process (threads started earlier, e.g.
gloo's, included) and ``torch.set_num_threads``; failing to set the affinity (a sandbox
may refuse) is a warning, not an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, MutableMapping, NamedTuple, Optional, Sequence

from .errors import LauncherEnvError
from .hosts import pairwise_disjoint
from .topology import Topology, format_cpulist, read_topology

if TYPE_CHECKING:  # pragma: no cover
    from .env import DistEnv

__all__ = [
    "PinPlan",
    "PinState",
    "plan_pinning",
    "plan_for",
    "apply_plan",
    "restore",
    "pinned",
    "current_plan",
    "thread_affinity",
    "thread_ids",
    "launcher_binding",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
]

log = logging.getLogger("cpuddp.affinity")

#: Exported for Intel OpenMP (libiomp5) in child processes: one thread per CPU of the mask,
#: in order.  GNU OpenMP (PyPI torch) ignores the KMP_* variables.
KMP_AFFINITY = "granularity=fine,compact,1,0"
#: Intel OpenMP: spin 1 ms after a parallel region instead of 200 ms (IPEX's launcher default).
KMP_BLOCKTIME = "1"

_OFF = ("0", "off", "no", "disable", "disabled", "false")


@dataclass(frozen=True)
class PinPlan:
    """Where one local rank runs.

    ``cpus``: logical CPUs for compute (the affinity mask).  ``num_threads``: torch / OpenMP
    threads.  ``ccl_worker_cpus``: CPUs reserved for oneCCL's workers.  ``reason``: how the
    plan was reached, in one line.  ``warnings``: what the user should know (logged once).
    ``env``: variables to export.  ``replace_env``: those among them whose current value
    came from a launcher's default, not the user, and may be overwritten.
    """

    local_rank: int
    cpus: tuple[int, ...]
    num_threads: int
    ccl_worker_cpus: tuple[int, ...] = ()
    reason: str = ""
    warnings: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    replace_env: tuple[str, ...] = ()
    local_world_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpus", tuple(sorted(self.cpus)))
        object.__setattr__(self, "ccl_worker_cpus", tuple(self.ccl_worker_cpus))
        object.__setattr__(self, "warnings", tuple(self.warnings))
        object.__setattr__(self, "replace_env", tuple(self.replace_env))
        object.__setattr__(self, "env", dict(self.env))  # a plain dict pickles; a proxy does not

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON and logs."""
        return {
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "cpus": list(self.cpus),
            "cpulist": format_cpulist(self.cpus),
            "num_threads": self.num_threads,
            "ccl_worker_cpus": list(self.ccl_worker_cpus),
            "reason": self.reason,
            "warnings": list(self.warnings),
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
    plan then uses that whole set (see the module docstring).  Raises ValueError for a
    local rank outside ``[0, local_world_size)`` or an empty usable set.
    """
    L, r = int(local_world_size), int(local_rank)
    if L < 1 or not 0 <= r < L:
        raise ValueError(f"local_rank={local_rank} and local_world_size={local_world_size}: need 0 <= local_rank < local_world_size")
    if ccl_workers < 0:
        raise ValueError(f"ccl_workers={ccl_workers}: must be >= 0")
    if omp_num_threads is not None and omp_num_threads < 1:
        raise ValueError(f"omp_num_threads={omp_num_threads}: must be >= 1")
    usable = topo.usable
    if not usable:
        raise ValueError(
            f"no usable CPUs: allowed {format_cpulist(topo.allowed)!r} and online "
            f"{format_cpulist(topo.online)!r} do not overlap"
        )
    warnings: list[str] = []
    ncores = len(topo.cores())
    ranks, slot = (1, 0) if bound_by else (L, r)
    kind = "cores"
    units = _units(topo, logical=False, with_siblings=use_hyperthreads)
    if ranks > len(units) and len(usable) > len(units):
        units = _units(topo, logical=True, with_siblings=False)
        kind = "logical CPUs"
        warnings.append(
            f"{L} local ranks but only {ncores} physical cores in CPUs {format_cpulist(usable)}: "
            f"using hyperthread siblings, so ranks share cores"
        )

    if ranks > len(units):
        mine, how = [units[slot % len(units)]], "oversubscribed: ranks share CPUs round-robin"
        warnings.append(
            f"oversubscribed: {L} local ranks on {len(units)} {kind} (CPUs {format_cpulist(usable)}): "
            f"ranks share CPUs, 1 thread each. Fix: start at most {len(units)} ranks per node, or give the job more CPUs"
        )
        shares = [1]
    else:
        mine, how = _share(units, ranks, slot)
        shares = [len(_share(units, ranks, s)[0]) for s in range(ranks)]
        if min(shares) * 1.25 < max(shares):
            warnings.append(
                f"local ranks get unequal shares ({min(shares)} to {max(shares)} {kind}): {len(units)} {kind} "
                f"in {len(_by(units, 'socket'))} socket(s) do not divide evenly among {ranks} ranks; "
                f"DDP runs at the pace of the smallest. Fix: use a rank count that divides each socket's cores"
            )
    if bound_by:
        how = f"inside the set {bound_by} bound this rank to"

    compute, ccl = mine, []
    if ccl_workers:
        if len(mine) > ccl_workers:
            ccl, compute = mine[:ccl_workers], mine[ccl_workers:]
        else:
            warnings.append(
                f"CCL_WORKER_COUNT={ccl_workers} but local rank {r} has only {len(mine)} {kind}: "
                f"no CPUs reserved for oneCCL workers, they share the compute CPUs. "
                f"Fix: fewer ranks per node, or CCL_WORKER_COUNT below the cores per rank"
            )
    cpus = tuple(sorted(c for u in compute for c in u.cpus))
    ccl_cpus = tuple(u.cpus[0] for u in ccl)
    threads = len(cpus)
    notes = [f"local rank {r} of {L}: {_n(len(compute), kind)} ({how})"]
    if ccl_cpus:
        notes.append(f"{len(ccl_cpus)} reserved for oneCCL workers (CPUs {format_cpulist(ccl_cpus)})")
    if not use_hyperthreads and kind == "cores" and len(usable) > ncores:
        notes.append("hyperthread siblings unused")

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
    if omp_num_threads is not None:
        threads = omp_num_threads
        notes.append(f"{_n(threads, 'threads')} as the user asked")
        if threads > len(cpus):
            warnings.append(
                f"{threads} threads asked for local rank {r}, which is pinned to {len(cpus)} CPUs "
                f"({format_cpulist(cpus)}): threads will share CPUs"
            )
    else:
        notes.append(_n(threads, "threads"))

    env = {"OMP_NUM_THREADS": str(threads), "KMP_AFFINITY": KMP_AFFINITY, "KMP_BLOCKTIME": KMP_BLOCKTIME}
    if ccl_cpus:
        env["CCL_WORKER_COUNT"] = str(len(ccl_cpus))
        # oneCCL reads one list for all local workers (worker i of local rank r takes entry
        # r * count + i) and rejects other lengths; each process reads only its own slots, so
        # this rank's CPUs fill every slot (the same string cpuddp.backends.ccl_env writes).
        env["CCL_WORKER_AFFINITY"] = ",".join(map(str, ccl_cpus * L))
    return PinPlan(
        local_rank=r,
        cpus=cpus,
        num_threads=threads,
        ccl_worker_cpus=ccl_cpus,
        reason="; ".join(notes),
        warnings=tuple(warnings),
        env=env,
        local_world_size=L,
    )


# --------------------------------------------------------------------------- the user wins


def launcher_binding(environ: Mapping[str, str], launcher: str) -> Optional[str]:
    """Name the launcher binding this rank by itself, or None (pure).

    Only a launcher that started this very process counts: under torchrun a binding applies
    to the agent, hence to all its ranks together.
    """
    if launcher == "hydra":
        if environ.get("I_MPI_PIN", "").strip().lower() not in _OFF:
            for var in ("I_MPI_PIN_DOMAIN", "I_MPI_PIN_PROCESSOR_LIST", "I_MPI_PIN_MAPPING"):
                if environ.get(var):
                    return f"Intel MPI ({var}={environ[var]})"
        if environ.get("HYDRA_USER_PROVIDED_BINDING", "").strip() not in ("", "0"):
            return "MPICH (mpiexec -bind-to)"
    elif launcher in ("openmpi", "pmix"):
        return "Open MPI (binds each rank by default; --bind-to)"
    elif launcher == "slurm":
        bind = environ.get("SLURM_CPU_BIND_TYPE") or environ.get("SLURM_CPU_BIND") or ""
        if bind and "none" not in bind.lower():
            return f"Slurm (--cpu-bind, SLURM_CPU_BIND_TYPE={bind})"
    elif launcher == "mvapich":
        if environ.get("MV2_ENABLE_AFFINITY", "1").strip().lower() not in _OFF:
            return "MVAPICH2 (MV2_ENABLE_AFFINITY)"
    return None


def _positive_int(environ: Mapping[str, str], var: str, *, minimum: int = 1) -> int:
    raw = environ[var]
    text = raw.split(",")[0].strip()  # OMP_NUM_THREADS may list nested levels: "8,2"
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise LauncherEnvError(
            f"{var} must be an integer >= {minimum} for core pinning",
            variable=var,
            value=raw,
            fix=f"set {var} to an integer >= {minimum}, or unset it to let cpuddp choose",
        )
    return value


def plan_for(
    env: "DistEnv",
    *,
    backend: str = "gloo",
    environ: Optional[Mapping[str, str]] = None,
    topology: Optional[Topology] = None,
    use_hyperthreads: bool = False,
    local_cpus: Optional[Sequence[frozenset[int]]] = None,
) -> PinPlan:
    """The plan for this process: :func:`plan_pinning` on the real topology (or
    ``topology``), with the user-wins rules of the module docstring applied from ``environ``
    (default ``os.environ``, only read) and ``env.launcher``.

    ``local_cpus``: the allowed CPU sets of every rank on this node, in local-rank order, as
    gathered at init.  Pairwise disjoint sets mean something already bound each rank
    (``numactl``, ``srun --cpu-bind``, ``mpirun --bind-to``): the plan stays inside this
    rank's own set and does not split it again."""
    environ = os.environ if environ is None else environ
    topo = read_topology() if topology is None else topology
    L = env.local_world_size
    notes: list[str] = []
    replace: list[str] = []

    omp: Optional[int] = None
    if environ.get("CPUDDP_NUM_THREADS", "").strip():
        omp = _positive_int(environ, "CPUDDP_NUM_THREADS")
    elif environ.get("OMP_NUM_THREADS", "").strip():
        if env.launcher == "torchrun" and environ["OMP_NUM_THREADS"].strip() == "1" and L > 1:
            # torchrun sets OMP_NUM_THREADS=1 itself when it is unset and nproc_per_node > 1
            # (torch/distributed/run.py), so "1" there is torchrun's choice, not the user's.
            replace.append("OMP_NUM_THREADS")
            notes.append("OMP_NUM_THREADS=1 taken as torchrun's default and replaced (CPUDDP_NUM_THREADS=1 keeps it)")
        else:
            omp = _positive_int(environ, "OMP_NUM_THREADS")

    ccl_workers = 0
    if backend in ("ccl", "oneccl"):
        ccl_workers = _positive_int(environ, "CCL_WORKER_COUNT", minimum=0) if environ.get("CCL_WORKER_COUNT", "").strip() else 1

    bound_by = None
    if L > 1 and local_cpus is not None and len(local_cpus) == L and pairwise_disjoint(local_cpus):
        who = launcher_binding(environ, env.launcher) or "the launcher or a wrapper (numactl/taskset per rank)"
        bound_by = f"{who}: the {L} local ranks' allowed CPU sets are disjoint (this rank: CPUs {format_cpulist(topo.usable)})"
    elif topo.usable < topo.base:
        bound_by = launcher_binding(environ, env.launcher)
        if bound_by:
            bound_by = f"{bound_by} (CPUs {format_cpulist(topo.usable)})"
        else:
            notes.append(
                f"allowed CPUs {format_cpulist(topo.usable)} narrower than the node's "
                f"{format_cpulist(topo.base)} with no per-rank binding (taskset/numactl around the job?): split among local ranks"
            )
    plan = plan_pinning(
        topo,
        env.local_rank,
        L,
        ccl_workers=ccl_workers,
        omp_num_threads=omp,
        use_hyperthreads=use_hyperthreads,
        bound_by=bound_by,
    )
    reason = "; ".join([plan.reason, *notes]) + f"; launcher {env.launcher}"
    return dataclasses.replace(plan, reason=reason, replace_env=tuple(replace))


# --------------------------------------------------------------------------- applying it

_current: Optional[PinPlan] = None
_warned: set[str] = set()


def current_plan() -> Optional[PinPlan]:
    """The plan :func:`apply_plan` put in force in this process, or None."""
    return _current


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("cpuddp: %s", msg)


def thread_ids() -> frozenset[int]:
    """The ids of this process's threads now (empty where /proc cannot say)."""
    try:
        return frozenset(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return frozenset()


def _set_affinity(cpus: Iterable[int], threads: Optional[Iterable[int]] = None) -> Optional[str]:
    """Set the affinity of the calling thread and of ``threads`` (default: every thread of
    this process); return an error text or None."""
    mask = set(cpus)
    try:
        os.sched_setaffinity(0, mask)
    except (OSError, ValueError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    tids = thread_ids() if threads is None else threads
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended meanwhile, or is not ours to move
        except OSError as exc:
            log.debug("cpuddp: could not set the affinity of thread %d: %s", tid, exc)
    return None


def _torch_threads(n: Optional[int] = None) -> Optional[int]:
    """Set torch's intra-op threads to ``n`` (if given); return the previous count, or None
    without torch."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    prev = torch.get_num_threads()
    if n is not None and n != prev:
        torch.set_num_threads(n)
    return prev


@dataclass
class PinState:
    """What :func:`apply_plan` changed, for :func:`restore`.  Also a context manager."""

    plan: PinPlan
    environ: MutableMapping[str, str]
    prev_affinity: Optional[frozenset[int]]
    prev_threads: Optional[int]
    prev_env: dict[str, Optional[str]]
    prev_plan: Optional[PinPlan]
    affinity_applied: bool = True
    restored: bool = False

    def __enter__(self) -> "PinState":
        return self

    def __exit__(self, *exc: Any) -> None:
        restore(self)


def apply_plan(
    plan: PinPlan,
    environ: Optional[MutableMapping[str, str]] = None,
    *,
    threads: Optional[Iterable[int]] = None,
) -> PinState:
    """Pin this process to ``plan.cpus``, set torch's thread count, export ``plan.env`` where
    unset (or set by a launcher's default, see ``plan.replace_env``); log each conflict and
    each plan warning once.  Returns the :class:`PinState` that :func:`restore` takes.

    ``threads``: the thread ids to pin besides the calling thread (default: every thread).
    :func:`cpuddp.init_distributed` passes the threads that existed before it started, so it
    pins the compute threads (the main thread, OpenMP's pool) and never re-pins a backend's
    communication threads; threads started later inherit the mask of the thread that starts
    them."""
    global _current
    environ = os.environ if environ is None else environ
    for msg in plan.warnings:
        _warn_once(msg)
    prev_aff = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    err = _set_affinity(plan.cpus, threads) if plan.cpus else "empty plan"
    if err:
        _warn_once(f"could not pin local rank {plan.local_rank} to CPUs {format_cpulist(plan.cpus)} ({err}); only the thread count is set")
    prev_threads = _torch_threads(plan.num_threads)
    prev_env: dict[str, Optional[str]] = {}
    for key, value in plan.env.items():
        old = environ.get(key)
        if old == value:
            continue
        if old is None or key in plan.replace_env:
            if old is not None:
                log.info("cpuddp: replacing %s=%r (a launcher default) with %r", key, old, value)
            prev_env[key] = old
            environ[key] = value
        else:
            log.info("cpuddp: keeping the user's %s=%r (the pinning plan would set %r)", key, old, value)
    state = PinState(plan, environ, prev_aff, prev_threads, prev_env, _current, affinity_applied=err is None)
    _current = plan
    log.info("cpuddp: pinned to CPUs %s with %d threads (%s)", format_cpulist(plan.cpus), plan.num_threads, plan.reason)
    return state


def restore(state: PinState) -> None:
    """Undo :func:`apply_plan`: affinity, thread count, and the variables it exported (unless
    changed since).  Safe to call twice."""
    global _current
    if state.restored:
        return
    state.restored = True
    if state.affinity_applied and state.prev_affinity is not None:
        err = _set_affinity(state.prev_affinity)
        if err:
            log.warning("cpuddp: could not restore the affinity to CPUs %s: %s", format_cpulist(state.prev_affinity), err)
    if state.prev_threads is not None:
        _torch_threads(state.prev_threads)
    for key, old in state.prev_env.items():
        if state.environ.get(key) != state.plan.env.get(key):
            continue  # changed by someone else since: leave it
        if old is None:
            state.environ.pop(key, None)
        else:
            state.environ[key] = old
    _current = state.prev_plan


@contextlib.contextmanager
def thread_affinity(cpus: Optional[Iterable[int]]) -> Iterator[None]:
    """Run the block with the calling thread (only) allowed on ``cpus``, then put its mask
    back.  Threads started inside the block inherit ``cpus``: :func:`cpuddp.init_distributed`
    forms the process group in such a block, so the backend's communication threads may run
    on every CPU the process was given while compute stays on the rank's own cores.  None, or
    a platform without affinity, runs the block unchanged."""
    before = None
    if cpus is not None and hasattr(os, "sched_getaffinity"):
        with contextlib.suppress(OSError, ValueError):
            before = frozenset(os.sched_getaffinity(0))
            os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(0, before)


@contextlib.contextmanager
def pinned(plan: Optional[PinPlan] = None, *, environ: Optional[MutableMapping[str, str]] = None) -> Iterator[PinPlan]:
    """``with pinned(plan): ...`` applies ``plan`` (default: :func:`plan_for` this process)
    and restores affinity, threads and variables on exit, even on error."""
    environ = os.environ if environ is None else environ
    if plan is None:
        from .env import detect

        plan = plan_for(detect(environ), environ=environ)
    state = apply_plan(plan, environ)
    try:
        yield plan
    finally:
        restore(state)
