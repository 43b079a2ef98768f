"""The backend decision of ``init_distributed(backend=...)``, in one pass: :func:`decide_backend`.

In: the backend asked for, and the layout every rank proved (:func:`cpuddp.launchers.proof.prove_node`
ran before).  Out: a frozen :class:`BackendPlan` -- the backend and its node-to-node leg that
every rank agreed on, why, the pinning plan for it and the settings to export -- which
:func:`cpuddp.backends.start.start_backend` carries out (export, load, pin, form, prove).

The pass, in order:

1. **Choose** (:func:`cpuddp.backends.registry.resolve_backend`): this rank's own choice, from
   the proven layout ("auto" takes shm only when every node runs 2+ ranks).
2. **Plan** for that choice, asking the backend's object (:class:`~cpuddp.backends.types.BackendSpec`)
   what is its own: the user's variables that change the choice (shm's ``CPUDDP_SHM_INTER``),
   the worker cores to keep free in the pinning plan (:func:`cpuddp.affinity.pin.plan_for`),
   and the settings to export (:func:`cpuddp.backends.settings.backend_env`, only what the user
   has not set).  Pure: nothing is carried out before step 3 has passed.
3. **Agree** (:func:`cpuddp.backends.agreement.agree_backend`), last: every rank's choice through the job's store.  Each
   rank keeps the choice it made itself: what the store says of the others' can stop the job,
   never change its backend; ranks that disagree -- under ``"auto"`` too -- are a
   :class:`~cpuddp.errors.BackendError` naming each rank's choice (the store is
   unauthenticated: a neighbour who rewrote a rank's choice to ``gloo`` would otherwise move
   the job onto sockets it can reach; docs/security.md).  shm's node-to-node leg is agreed the
   same way, where a difference means gloo between nodes (the leg changes no plan of step 2:
   only the group's options, which its backend's object builds from the agreed plan).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Tuple

from cpuddp.affinity.pin import plan_for
from cpuddp.topology import here

from . import agreement, registry
from .settings import backend_env
from .types import BackendChoice

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.affinity.plan import PinPlan
    from cpuddp.launchers.env import DistEnv
    from cpuddp.launchers.hosts import Layout, Share

__all__ = ["BackendPlan", "decide_backend"]


@dataclass(frozen=True)
class BackendPlan:
    """What init does with the backend, decided once by :func:`decide_backend`.

    ``choice``: the backend every rank agreed on (``name``, ``inter``: shm's node-to-node leg,
    ``reason``, and the module its object loads); ``pin_plan``: this rank's pinning plan for it
    (None with ``pin=False``); ``env``: the backend's settings to export to ``os.environ`` (only
    those the user has not set).  The group's options follow from these
    (:meth:`~cpuddp.backends.types.BackendSpec.group_options`)."""

    choice: BackendChoice
    pin_plan: Optional["PinPlan"]
    env: Mapping[str, str]

    @property
    def name(self) -> str:
        return self.choice.name

    @property
    def comm_thread(self) -> bool:
        """Whether the plan leaves the rank a CPU beyond its compute threads: the communication
        thread's (shm's ``async_comm``)."""
        return self.pin_plan is not None and len(self.pin_plan.cpus) > self.pin_plan.num_threads

    @property
    def compute_cpus(self) -> Optional[Tuple[int, ...]]:
        """The rank's pinned CPUs (None unpinned): its NUMA node holds its shm slots and level."""
        return tuple(self.pin_plan.cpus) if self.pin_plan is not None else None


def decide_backend(requested: str, env: "DistEnv", layout: Optional["Layout"], share: Optional["Share"], key: str,
                   environ: Mapping[str, str], *, pin: bool) -> BackendPlan:
    """The whole decision for ``requested`` on this rank (see the module docstring).

    ``layout``: the node layout the ranks proved (None for a world of one, with ``share``);
    ``share``: this rank's exchange over the job's store (:func:`cpuddp.launchers.hosts.sharing`);
    ``key``: its exchange for the choices (the leg's is ``key/inter``); ``environ``: the mapping
    init reads (the user's settings).  Raises
    :class:`~cpuddp.errors.BackendError` when the ranks disagree, naming ranks and choices:
    nothing of the plan has been carried out then."""
    local_cpus = layout.local_cpus if layout is not None else None
    node_cpus = len(frozenset().union(*local_cpus)) if local_cpus else (len(here.allowed_cpus()) or None)
    smallest = min(len(n) for n in layout.nodes) if layout is not None else None
    own = registry.resolve_backend(requested, env, environ=environ, node_cpus=node_cpus,
                                   smallest_node=smallest)  # through the module: tests replace it
    own = own.backend.with_user_settings(own, environ)  # before the agreement: the ranks compare what each forms
    workers = own.backend.worker_cores(own, environ)  # oneCCL's worker cores, for shm's oneCCL leg too
    pin_plan = plan_for(env, workers=workers, environ=environ, local_cpus=local_cpus) if pin else None
    settings = backend_env(env, own, pin_plan, os.environ)
    return BackendPlan(agreement.agree_backend(own, requested, env, share, key), pin_plan, settings)
