"""Every rank's backend choice, checked through the job's store: :func:`agree_backend`, the last
step of the decision (:mod:`cpuddp.backends.decide`).

A rank keeps the choice it made itself: what the store says of the others' choices can stop
the job, never change its backend (the store is unauthenticated: a neighbour who rewrote a
rank's choice to ``gloo`` would otherwise move the job onto sockets it can reach;
docs/security.md).  Only shm's node-to-node leg follows the others: gloo where not every rank
has working oneCCL bindings -- between nodes both legs are TCP a network peer can reach.

Store keys: ``<name>/<rank>`` (the choices), ``<name>/inter/<rank>`` (the legs), each read
through :func:`cpuddp.launchers.store_values.backend_name`.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Optional

from cpuddp.errors import BackendError
from cpuddp.launchers import hosts, store_values

from .shm.api import INTER_VAR
from .types import BackendChoice

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

    from cpuddp.launchers.env import DistEnv

__all__ = ["agree_backend"]

#: Marks a leg the user set (CPUDDP_SHM_INTER) in the legs exchange.
SET = "_set"

log = logging.getLogger("cpuddp")


def agree_backend(choice: BackendChoice, requested: str, env: "DistEnv", store: Optional["Store"], name: str,
                  td: datetime.timedelta) -> BackendChoice:
    """``choice`` (this rank's own, for ``requested``), checked against every other rank's through
    the store under exchange ``name`` (step 3 of :mod:`cpuddp.backends.decide`): the same choice, or an
    error naming each rank's.  shm's node-to-node leg (exchange ``name/inter``): oneCCL only
    when every rank has working bindings, else gloo (a warning names each rank's leg).  Between
    nodes both legs are plain TCP that a network peer can reach (docs/security.md), so the store
    choosing gloo there exposes nothing new; within a node the store chooses nothing."""
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
        mine = choice.inter + (SET if choice.inter_set else "")
        said = hosts.exchange(store, f"{name}/inter", env.rank, env.world_size, mine, td, what="backend")
        said = [store_values.backend_name(f"{name}/inter/{r}", n) for r, n in enumerate(said)]
        legs = [n[:-len(SET)] if n.endswith(SET) else n for n in said]
        if len(set(legs)) != 1 and any(n.endswith(SET) for n in said):
            _legs_differ(env.rank, legs, said)
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


def _legs_differ(rank: int, legs: list[str], said: list[str]) -> None:
    """Some rank set the leg itself and the ranks' legs differ: they would form mismatched
    node-to-node groups (and hang there), so stop now naming each rank's."""
    shown = ", ".join(f"rank {r}: {leg}" + (f" ({INTER_VAR})" if s.endswith(SET) else " (the rule)")
                      for r, (leg, s) in enumerate(zip(legs, said)) if r == rank or leg != legs[rank])
    shown = shown if len(shown) <= 400 else shown[:397] + "..."
    raise BackendError(f"rank {rank}: the ranks' shm node-to-node legs differ: {shown}",
                       fix=f"set the same {INTER_VAR} (gloo or ccl) on every node, or unset it everywhere")
