"""affinity: which CPUs and how many threads each local rank gets, and applying that.

Owns: the planner, pure (:mod:`.plan`), a whole job's plan -- ranks per node, each rank's CPUs
and threads, as ``cpuddp run`` launches it and ``cpuddp doctor`` shows it -- (:mod:`.job`),
oneCCL's worker threads (:mod:`.ccl_workers`), and applying, reading and restoring a plan in
this process (:mod:`.pin`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._package`, :mod:`cpuddp.topology`,
:mod:`cpuddp.launchers`.

This package is public: the names below are importable from ``cpuddp.affinity``, each loaded from
its module on first use (importing one module of the area never imports the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpuddp._package import lazy_names

# public name -> module of this package that defines it (loaded on first use)
_EXPORTS = {
    "PinPlan": "plan",
    "PinWarning": "plan",
    "WARNING_CODES": "plan",
    "PinState": "pin",
    "plan_pinning": "plan",
    "plan_for": "pin",
    "apply_plan": "pin",
    "restore": "pin",
    "pinned": "pin",
    "current_plan": "pin",
    "thread_affinity": "pin",
    "thread_ids": "pin",
    "launcher_binding": "pin",
    "KMP_AFFINITY": "plan",
    "KMP_BLOCKTIME": "plan",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

if TYPE_CHECKING:  # pragma: no cover  # noqa: F401 (names for type checkers)
    from .pin import (
        PinState,
        apply_plan,
        current_plan,
        launcher_binding,
        pinned,
        plan_for,
        restore,
        thread_affinity,
        thread_ids,
    )
    from .plan import KMP_AFFINITY, KMP_BLOCKTIME, WARNING_CODES, PinPlan, PinWarning, plan_pinning
