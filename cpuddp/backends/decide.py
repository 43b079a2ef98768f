"""The backend decision of ``init_distributed(backend=...)``, in one pass: :func:`decide_backend`.

In: the backend asked for, and the layout every rank proved (:func:`cpuddp.launchers.proof.prove_node`
ran before).  Out: a frozen :class:`BackendPlan` -- the backend and its node-to-node leg that
every rank agreed on, why, the pinning plan for it, the settings to export and the group's
options -- which the session only executes (export, load, pin, form, prove).

The pass, in order:

1. **Choose** (:func:`cpuddp.backends.registry.resolve_backend`): this rank's own choice, from
   the proven layout ("auto" takes shm only when every node runs 2+ ranks).
2. **Agree** (:func:`agree_backend`): every rank's choice through the job's store.  Each rank
   keeps the choice it made itself: what the store says of the others' can stop the job, never
   change its backend; ranks that disagree -- under ``"auto"`` too -- are a
   :class:`~cpuddp.errors.BackendError` naming each rank's choice (the store is
   unauthenticated: a neighbour who rewrote a rank's choice to ``gloo`` would otherwise move
   the job onto sockets it can reach; docs/security.md).  shm's node-to-node leg is agreed the
   same way, where a difference means gloo between nodes.
3. **Plan**: the pinning plan for that backend (:func:`cpuddp.affinity.pin.plan_for`), the
   settings to export (:func:`cpuddp.backends.settings.backend_env`, only what the user has not
   set) and the group's options (:func:`cpuddp.backends.settings.shm_options` for shm).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from cpuddp.affinity.pin import plan_for
from cpuddp.errors import BackendError
from cpuddp.launchers import hosts, store_values
from cpuddp.topology import here

from . import registry
from .settings import backend_env, shm_options
from .types import BackendChoice

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

    from cpuddp.affinity.plan import PinPlan
    from cpuddp.launchers.env import DistEnv
    from cpuddp.launchers.hosts import Layout

__all__ = ["BackendPlan", "decide_backend", "agree_backend"]

log = logging.getLogger("cpuddp")


@dataclass(frozen=True)
class BackendPlan:
    """What init does with the backend, decided once by :func:`decide_backend`.

    ``choice``: the backend every rank agreed on (``name``, ``inter``: shm's node-to-node leg,
    ``reason``, and the module :func:`cpuddp.backends.registry.load_backend` imports);
    ``pin_plan``: this rank's pinning plan for it (None with ``pin=False``); ``env``: the
    backend's settings to export to ``os.environ`` (only those the user has not set);
    ``options``: the group's ``pg_options`` (the shm group's
    :class:`~cpuddp.backends.shm.api.ShmOptions`; None for the others)."""

    choice: BackendChoice
    pin_plan: Optional["PinPlan"]
    env: Mapping[str, str]
    options: Any

    @property
    def name(self) -> str:
        return self.choice.name


def decide_backend(requested: str, env: "DistEnv", layout: Optional["Layout"], store: Optional["Store"], key: str,
                   td: datetime.timedelta, environ: Mapping[str, str], *, pin: bool) -> BackendPlan:
    """The whole decision for ``requested`` on this rank (see the module docstring).

    ``layout``: the node layout the ranks proved (None for a world of one, with ``store``);
    ``key``: the store's exchange for the choices (the leg's is ``key/inter``); ``environ``:
    the mapping init reads (the user's settings).  Raises
    :class:`~cpuddp.errors.BackendError` when the ranks disagree, naming ranks and choices."""
    local_cpus = layout.local_cpus if layout is not None else None
    node_cpus = len(frozenset().union(*local_cpus)) if local_cpus else (len(here.allowed_cpus()) or None)
    smallest = min(len(n) for n in layout.nodes) if layout is not None else None
    choice = agree_backend(requested, env, store, key, td, environ, node_cpus, smallest)
    pin_plan = plan_for(env, backend=choice.name, environ=environ, local_cpus=local_cpus) if pin else None
    settings = backend_env(env, choice, pin_plan, os.environ)
    options = None
    if choice.name == "shm":  # a spare CPU in the plan is the communication thread's
        spare = pin_plan is not None and len(pin_plan.cpus) > pin_plan.num_threads
        cpus = tuple(pin_plan.cpus) if pin_plan is not None else None  # the rank's NUMA node: its slots, its level
        options = shm_options(choice, os.environ, async_comm=spare, local_size=env.local_world_size, cpus=cpus)
    return BackendPlan(choice, pin_plan, settings, options)


def agree_backend(requested: str, env: "DistEnv", store: Optional["Store"], name: str, td: datetime.timedelta,
                  environ: Mapping[str, str], node_cpus: Optional[int] = None,
                  smallest_node: Optional[int] = None) -> BackendChoice:
    """This rank's backend choice, checked against every other rank's through the store under
    exchange ``name`` (steps 1 and 2 of the module docstring): the choice is this rank's own, or
    an error naming each rank's.  shm's node-to-node leg (exchange ``name/inter``): oneCCL only
    when every rank has working bindings, else gloo (a warning names each rank's leg).  Between
    nodes both legs are plain TCP that a network peer can reach (docs/security.md), so the store
    choosing gloo there exposes nothing new; within a node the store chooses nothing."""
    choice = registry.resolve_backend(requested, env, environ=environ, node_cpus=node_cpus,
                                      smallest_node=smallest_node)  # through the module: tests replace it
    if store is not None:
        names = hosts.exchange(store, name, env.rank, env.world_size, choice.name, td, what="backend")
        names = [store_values.backend_name(f"{name}/{r}", n) for r, n in enumerate(names)]
        if len(set(names)) != 1:
            differ = [r for r, n in enumerate(names) if n != choice.name]
            shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names) if r == env.rank or n != choice.name)
            shown = shown if len(shown) <= 400 else shown[:397] + "..."
            asked = "" if requested.strip().lower() == "auto" else f" (backend={requested!r} on this rank)"
            raise BackendError(
                f"rank {env.rank}: the ranks' backend choices differ{asked}: {shown}; {len(differ)} rank(s) differ "
                f"from this rank's {choice.name!r}",
                fix="if every rank runs the same code and software, something other than this job's ranks writes to "
                    "its rendezvous store (docs/security.md); otherwise make the nodes alike (the same packages, "
                    "CPUDDP_SHM, ranks per node) or pass the same explicit backend= on every rank, e.g. "
                    "backend='gloo'",
            )
    if store is not None and choice.inter is not None:  # every rank chose shm across the same nodes
        legs = hosts.exchange(store, f"{name}/inter", env.rank, env.world_size, choice.inter, td, what="backend")
        legs = [store_values.backend_name(f"{name}/inter/{r}", n) for r, n in enumerate(legs)]
        if len(set(legs)) != 1:
            if env.is_main:
                log.warning("cpuddp: between nodes gloo, not %s: not every rank has working oneCCL bindings (%s)",
                            choice.inter, ", ".join(f"rank {r}: {n}" for r, n in enumerate(legs)
                                                    if n != choice.inter)[:400])
            choice = BackendChoice(choice.name, f"{choice.reason}; between nodes gloo after all: not every rank has "
                                   f"working oneCCL bindings ({', '.join(sorted(set(legs)))})", choice.module,
                                   choice.requested, choice.version, choice.distribution, choice.verified, "gloo")
    if env.is_main:
        log.info("cpuddp: backend %s (%s)", choice.name, choice.reason)
    return choice
