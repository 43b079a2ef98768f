"""The backend's part of :func:`cpuddp.init_distributed`, from the request to a proven group:
:func:`start_backend`, which the session calls once.

The session meets the other ranks and proves the layout (:mod:`cpuddp.distributed`, steps 2-3);
then it hands the ``backend=`` request here with the job as plain values and its own steps as
callables (:class:`InitJob`), and gets back the plan, carried out.  This area never sees the
session: the store's exchange, the undo log of exports and pinning, saying "ready" and the CPUs
the group forms on stay with init.  The steps, in order:

1. **Decide** (:func:`cpuddp.backends.decide.decide_backend`): choose, plan (pure), agree last;
   then the group's options, which the agreed backend's object builds from the plan
   (:meth:`~cpuddp.backends.types.BackendSpec.group_options`).
2. **Export** the rank's and the backend's variables (``job.export``), before the backend's
   module reads them; **load** that module (:meth:`~cpuddp.backends.types.BackendSpec.load`);
   **pin** the compute threads (``job.pin_compute``).  Steps 1-2 run inside
   ``job.until_ready()``: a failure there is published, so the other ranks stop at once naming
   this one, and at its end the ranks say "ready".
3. **Form** the group and **prove** it with one small all_reduce (:mod:`cpuddp.backends.forming`),
   inside ``job.forming()``: this thread on every CPU the process was given, so the backend's
   communication threads start there.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Optional

from .decide import BackendPlan, decide_backend
from .forming import first_collective, form_group

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.affinity.plan import PinPlan
    from cpuddp.launchers.env import DistEnv
    from cpuddp.launchers.hosts import Layout, Share

__all__ = ["InitJob", "start_backend"]


@dataclass(frozen=True)
class InitJob:
    """What :func:`start_backend` takes from the session: the job as its ranks proved it, and the
    steps init takes itself, as callables.

    ``env``: this rank, placed by the proven layout; ``layout``: that layout; ``store``: the job's
    store, which the group forms over; ``share``: this rank's exchange over it
    (:func:`cpuddp.launchers.hosts.sharing`) -- all three None for a world of one; ``key``: the
    exchange of the backend choices; ``td``: the timeout; ``environ``: the mapping init reads
    (the user's settings); ``pin``: whether to pin.

    ``export(settings)`` exports the rank's variables and then the backend's ``settings``, and
    ``pin_compute(plan)`` pins the compute threads: the session undoes both when init fails or
    at shutdown.  ``until_ready()``: a failure inside is published to the other ranks; at its end
    the ranks say "ready".  ``forming()``: where the group forms, and what starts once it has."""

    env: "DistEnv"
    layout: Optional["Layout"]
    store: Any
    share: Optional["Share"]
    key: str
    td: datetime.timedelta
    environ: Mapping[str, str]
    pin: bool
    export: Callable[[Mapping[str, str]], None]
    pin_compute: Callable[["PinPlan"], None]
    until_ready: Callable[[], ContextManager[None]]
    forming: Callable[[], ContextManager[None]]


def start_backend(requested: str, job: InitJob) -> BackendPlan:
    """The backend for ``requested``, decided and carried out to a group that its first collective
    proved (see the module docstring); returns the plan.  An error stops at the step that raised
    it: what was exported and pinned before is in init's undo log."""
    with job.until_ready():
        plan = decide_backend(requested, job.env, job.layout, job.share, job.key, job.environ, pin=job.pin)
        options = plan.choice.backend.group_options(job.env, plan)  # pure: built from the agreed plan
        job.export(plan.env)  # before the backend's module reads them
        plan.choice.backend.load(plan.choice)
        if plan.pin_plan is not None:
            job.pin_compute(plan.pin_plan)
    with job.forming():
        form_group(job.env, plan.name, options, job.store, job.td)
        first_collective(job.env, plan.choice)
    return plan
