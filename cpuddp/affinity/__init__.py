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

from . import pin, plan
from .pin import *  # noqa: F401,F403  -- pin.__all__ and plan.__all__ are the one list of each
from .plan import *  # noqa: F401,F403

__all__ = [*plan.__all__, *pin.__all__]
