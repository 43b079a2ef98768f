"""Core pinning: which CPUs and how many threads each local rank gets, and applying that.

Usage::

    plan = cpuddp.affinity.plan_for(cpuddp.detect(os.environ))       # decide, change nothing
    print(plan.as_dict())
    with cpuddp.affinity.pinned(plan):                                # apply, then restore
        train()

:func:`cpuddp.init_distributed` does ``plan_for`` + ``apply_plan`` by default (``pin=False``
opts out) and keeps the plan in its session (``cpuddp.get_session().pin_plan``);
:func:`current_plan` returns the plan in force.

The rules (:func:`plan_pinning`, a pure function of a :class:`~cpuddp.topology.Topology`,
in :mod:`cpuddp.affinity.plan` with :class:`~cpuddp.affinity.plan.PinPlan` and its
:class:`~cpuddp.affinity.plan.PinWarning` records):

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
- A backend with worker threads (oneCCL, for the ccl backend and for shm's oneCCL leg: the
  backend's object says how many, :meth:`cpuddp.backends.types.BackendSpec.worker_cores`, from
  ``CCL_WORKER_COUNT``, default 1, read by :func:`cpuddp.affinity.ccl_workers.worker_count`,
  which refuses what oneCCL refuses, e.g. 0): the first ``workers`` cores of each rank's share
  go to them (``CCL_WORKER_AFFINITY``), when the share has more than that; else the workers
  share the compute cores, with a warning.
- Threads = CPUs in the plan, capped by the rank's part of a cgroup CPU quota.

The user wins (:func:`plan_for`):

- If the launcher already bound this rank (Intel MPI pins by default; Open MPI binds by
  default; MPICH ``-bind-to``; Slurm ``--cpu-bind``; MVAPICH2) and its allowed set is
  narrower than the node's, the plan stays inside that set and uses all of it; when the set
  is bigger than the rank's share of the node (other ranks may share it), the thread count
  is capped at that share.  A set narrowed with no launcher binding (``taskset``/``numactl``
  around the whole job) is split among the local ranks.
- ``CPUDDP_RANK_CPUS`` (set by ``cpuddp run`` on one node: each local rank's CPU list,
  ``;``-separated) wins over the rules above: the rank's set is its entry (within the usable
  CPUs), used whole.  A list that does not match the local world size is ignored with a warning.
- ``CPUDDP_NUM_THREADS`` wins over everything, then an explicit ``OMP_NUM_THREADS``.
  ``OMP_NUM_THREADS=1`` under torchrun with several local ranks is torchrun's own default,
  not the user's choice: the plan replaces it (``CPUDDP_NUM_THREADS=1`` keeps 1 thread).

Environment variables read: ``CPUDDP_RANK_CPUS``, ``CPUDDP_NUM_THREADS``, ``OMP_NUM_THREADS``,
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
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, MutableMapping, Optional, Sequence

from cpuddp.launchers.hosts import pairwise_disjoint
from cpuddp.launchers.parsers import positive_int
from cpuddp.topology import here
from cpuddp.topology.model import Topology, format_cpulist, parse_cpulist
from cpuddp.topology.read import read_topology

from .plan import PinPlan, plan_pinning

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

#: What ``cpuddp.affinity`` hands on from here (its ``__init__`` reads this list; ``set_affinity``
#: is for train's loader workers, not the public door).
__all__ = [
    "PinState",
    "plan_for",
    "apply_plan",
    "restore",
    "pinned",
    "current_plan",
    "thread_affinity",
    "thread_ids",
    "launcher_binding",
]

log = logging.getLogger("cpuddp.affinity")

_OFF = ("0", "off", "no", "disable", "disabled", "false")


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


def _positive_int(environ: Mapping[str, str], var: str) -> int:
    return positive_int(environ[var], var, first_of_list=True,
                        why=f"{var} must be an integer >= 1 for core pinning",
                        fix=f"set {var} to an integer >= 1, or unset it to let cpuddp choose")


def _user_threads(env: "DistEnv", environ: Mapping[str, str], notes: list[str], replace: list[str]) -> Optional[int]:
    """The user's thread count: ``CPUDDP_NUM_THREADS``, else ``OMP_NUM_THREADS`` unless it is
    torchrun's own default (then it goes in ``replace``); None when neither applies."""
    if environ.get("CPUDDP_NUM_THREADS", "").strip():
        return _positive_int(environ, "CPUDDP_NUM_THREADS")
    if not environ.get("OMP_NUM_THREADS", "").strip():
        return None
    if env.launcher == "torchrun" and environ["OMP_NUM_THREADS"].strip() == "1" and env.local_world_size > 1:
        # torchrun sets OMP_NUM_THREADS=1 itself when it is unset and nproc_per_node > 1
        # (torch/distributed/run.py), so "1" there is torchrun's choice, not the user's.
        replace.append("OMP_NUM_THREADS")
        notes.append("OMP_NUM_THREADS=1 taken as torchrun's default and replaced (CPUDDP_NUM_THREADS=1 keeps it)")
        return None
    return _positive_int(environ, "OMP_NUM_THREADS")


def _bound_by(env: "DistEnv", environ: Mapping[str, str], topo: Topology,
              local_cpus: Optional[Sequence[frozenset[int]]], notes: list[str]) -> Optional[str]:
    """Who already bound this rank (the plan then stays inside its set), or None."""
    L = env.local_world_size
    if L > 1 and local_cpus is not None and len(local_cpus) == L and pairwise_disjoint(local_cpus):
        who = launcher_binding(environ, env.launcher) or "the launcher or a wrapper (numactl/taskset per rank)"
        return f"{who}: the {L} local ranks' allowed CPU sets are disjoint (this rank: CPUs {format_cpulist(topo.usable)})"
    if not topo.usable < topo.base:
        return None
    bound_by = launcher_binding(environ, env.launcher)
    if bound_by:
        return f"{bound_by} (CPUs {format_cpulist(topo.usable)})"
    notes.append(
        f"allowed CPUs {format_cpulist(topo.usable)} narrower than the node's "
        f"{format_cpulist(topo.base)} with no per-rank binding (taskset/numactl around the job?): split among local ranks"
    )
    return None


def _run_plan_cpus(env: "DistEnv", environ: Mapping[str, str], topo: Topology) -> Optional[frozenset[int]]:
    """This local rank's CPUs from ``CPUDDP_RANK_CPUS`` (``cpuddp run``'s plan, ``;``-separated
    in local-rank order) within the usable set; None when unset, when the list does not match
    the local world size, or when none of its CPUs is usable (then the usual rules apply)."""
    raw = environ.get("CPUDDP_RANK_CPUS", "").strip()
    parts = raw.split(";")
    if not raw or len(parts) != env.local_world_size:
        if raw:
            _warn_once(f"CPUDDP_RANK_CPUS={raw!r} has {len(parts)} entries for {env.local_world_size} local ranks: ignored")
        return None
    try:
        cpus = parse_cpulist(parts[env.local_rank]) & topo.usable
    except ValueError as exc:
        _warn_once(f"CPUDDP_RANK_CPUS={raw!r}: {exc}: ignored")
        return None
    return frozenset(cpus) or None


def plan_for(
    env: "DistEnv",
    *,
    workers: int = 0,
    environ: Optional[Mapping[str, str]] = None,
    topology: Optional[Topology] = None,
    use_hyperthreads: bool = False,
    local_cpus: Optional[Sequence[frozenset[int]]] = None,
) -> PinPlan:
    """The plan for this process: :func:`plan_pinning` on the real topology (or
    ``topology``), with the user-wins rules of the module docstring applied from ``environ``
    (default ``os.environ``, only read) and ``env.launcher``.

    ``workers``: the cores of each rank the backend's worker threads need (what its object's
    ``worker_cores`` says: oneCCL's ``CCL_WORKER_COUNT``; 0 for gloo, and for shm without a oneCCL leg).
    ``local_cpus``: the allowed CPU sets of every rank on this node, in local-rank order, as
    gathered at init.  Pairwise disjoint sets mean something already bound each rank
    (``numactl``, ``srun --cpu-bind``, ``mpirun --bind-to``): the plan stays inside this
    rank's own set and does not split it again."""
    environ = os.environ if environ is None else environ
    topo = read_topology() if topology is None else topology
    L = env.local_world_size
    notes: list[str] = []
    replace: list[str] = []

    omp = _user_threads(env, environ, notes, replace)
    run_cpus = _run_plan_cpus(env, environ, topo)
    if run_cpus is not None:  # `cpuddp run` planned this rank's CPUs: they win over the split
        topo = dataclasses.replace(topo, allowed=run_cpus)
        bound_by = f"cpuddp run's plan (CPUDDP_RANK_CPUS: CPUs {format_cpulist(run_cpus)})"
    else:
        bound_by = _bound_by(env, environ, topo, local_cpus, notes)
    plan = plan_pinning(
        topo,
        env.local_rank,
        L,
        ccl_workers=workers,
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


def set_affinity(cpus: Iterable[int], threads: Optional[Iterable[int]] = None) -> Optional[str]:
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
    for warning in plan.warnings:
        _warn_once(str(warning))
    prev_aff = frozenset(here.allowed_cpus()) or None
    err = set_affinity(plan.cpus, threads) if plan.cpus else "empty plan"
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
        err = set_affinity(state.prev_affinity)
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
    before = None if cpus is None else frozenset(here.allowed_cpus()) or None
    if before is not None:
        with contextlib.suppress(OSError, ValueError):
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
        from cpuddp.launchers.registry import detect

        plan = plan_for(detect(environ), environ=environ)
    state = apply_plan(plan, environ)
    try:
        yield plan
    finally:
        restore(state)
