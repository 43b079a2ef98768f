"""affinity: which CPUs and how many threads each local rank gets, and applying that.

Owns: the planner, pure (:mod:`.plan`), a whole job's plan -- ranks per node, each rank's CPUs
and threads, as ``cpuddp run`` launches it and ``cpuddp doctor`` shows it -- (:mod:`.job`),
oneCCL's worker threads (:mod:`.ccl_workers`), and applying, reading and restoring a plan in
this process (:mod:`.pin`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.topology`,
:mod:`cpuddp.launchers`.

This package is public: the names below are importable from ``cpuddp.affinity``; none of them
imports torch, so they are plain imports (docs/code.md, "Lazy names").
"""

from __future__ import annotations

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

__all__ = [
    "PinPlan",
    "PinWarning",
    "WARNING_CODES",
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
