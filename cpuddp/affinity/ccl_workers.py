"""oneCCL's worker threads: ``CCL_WORKER_COUNT`` read once, ``CCL_WORKER_AFFINITY`` built once.

Both the pinning planner (:mod:`cpuddp.affinity`, which reserves CPUs for the workers) and
the backend's settings (:mod:`cpuddp.backends.settings`, which exports the variables before
``init_process_group``) use these two functions, so they cannot disagree.

The rule is oneCCL's own: ``CCL_WORKER_COUNT`` is a whole number of at least 1 (oneCCL
throws ``incorrect CCL_WORKER_COUNT 0`` at start otherwise; ``src/common/env/env.cpp``).
Unset means oneCCL's default, 1.  A value that is set but empty, zero, negative or not a
number is a :class:`~cpuddp.errors.LauncherEnvError` naming the variable.

``CCL_WORKER_AFFINITY`` is one list for *all* local ranks: oneCCL pins worker ``i`` of local
rank ``r`` to entry ``r * count + i`` and rejects a list of any other length.  Each process
reads only its own slots, from its own environment, so a rank's CPUs fill every slot.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from cpuddp.launchers.parsers import positive_int

__all__ = ["WORKER_COUNT_VAR", "WORKER_AFFINITY_VAR", "DEFAULT_WORKERS", "worker_count", "worker_affinity"]

WORKER_COUNT_VAR = "CCL_WORKER_COUNT"
WORKER_AFFINITY_VAR = "CCL_WORKER_AFFINITY"
#: oneCCL's default worker count, and the one cpuddp exports.
DEFAULT_WORKERS = 1


def worker_count(environ: Mapping[str, str]) -> int:
    """``CCL_WORKER_COUNT`` from ``environ`` (default 1); raises for a value oneCCL would reject."""
    raw = environ.get(WORKER_COUNT_VAR)
    if raw is None:
        return DEFAULT_WORKERS
    return positive_int(
        raw, WORKER_COUNT_VAR,
        why=f"{WORKER_COUNT_VAR} must be a whole number of oneCCL worker threads per rank, at least 1",
        fix=f"export {WORKER_COUNT_VAR}=1 (the usual value), or unset it",
    )


def worker_affinity(cpus: Sequence[int], local_world_size: int) -> str:
    """The ``CCL_WORKER_AFFINITY`` string for a rank whose workers run on ``cpus`` (one CPU per
    worker): those CPUs repeated once per local rank (see the module docstring)."""
    return ",".join(str(int(c)) for c in tuple(cpus) * max(int(local_world_size), 1))
