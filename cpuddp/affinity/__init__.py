"""affinity: which CPUs and how many threads each local rank gets, and applying that.

Owns: the planner, pure (:mod:`.plan`), oneCCL's worker threads (:mod:`.ccl`), and applying,
reading and restoring a plan in this process (:mod:`.pin`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.topology`, :mod:`cpuddp.launchers`.

This package is public: the names below are importable from ``cpuddp.affinity``.
"""

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

__all__ = ["PinPlan", "PinWarning", "WARNING_CODES", "PinState", "plan_pinning", "plan_for", "apply_plan",
           "restore", "pinned", "current_plan", "thread_affinity", "thread_ids", "launcher_binding",
           "KMP_AFFINITY", "KMP_BLOCKTIME"]
