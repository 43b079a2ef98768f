"""Every rank's backend choice, checked through the job's store: :func:`agree_backend`, the last
step of the decision (:mod:`cpuddp.backends.decide`).  The store belongs to init: the agreement
is handed this rank's exchange over it (:data:`cpuddp.launchers.hosts.Share`), None in a world
of one.

A rank keeps the choice it made itself: what the store says of the others' choices can stop
the job, never change its backend (the store is unauthenticated: a neighbour who rewrote a
rank's choice to ``gloo`` would otherwise move the job onto sockets it can reach;
docs/security.md).  What else a backend's ranks must share it agrees itself
(:meth:`~cpuddp.backends.types.BackendSpec.agree`; shm's node-to-node leg:
:meth:`cpuddp.backends.shm.backend.ShmBackend.agree`).

Store keys: ``<name>/<rank>`` (the choices), read through
:func:`cpuddp.launchers.store_values.backend_name`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from cpuddp.errors import BackendError
from cpuddp.launchers import store_values

from .types import BackendChoice

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv
    from cpuddp.launchers.hosts import Share

__all__ = ["agree_backend"]

log = logging.getLogger("cpuddp")


def agree_backend(choice: BackendChoice, requested: str, env: "DistEnv", share: Optional["Share"],
                  name: str) -> BackendChoice:
    """``choice`` (this rank's own, for ``requested``), checked against every other rank's through
    ``share`` under exchange ``name`` (step 3 of :mod:`cpuddp.backends.decide`): the same choice, or an
    error naming each rank's.  Then what else of the choice the backend has the ranks share
    (:meth:`~cpuddp.backends.types.BackendSpec.agree`: shm's node-to-node leg)."""
    if share is not None:
        names = share(name, choice.name, "backend")
        names = [store_values.backend_name(f"{name}/{r}", n) for r, n in enumerate(names)]
        if len(set(names)) != 1:
            differ = [r for r, n in enumerate(names) if n != choice.name]
            shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names) if r == env.rank or n != choice.name)
            shown = shown if len(shown) <= 400 else shown[:397] + "..."
            asked = f" (backend={requested!r} on this rank)" if choice.named else ""
            raise BackendError(
                f"rank {env.rank}: the ranks' backend choices differ{asked}: {shown}; {len(differ)} rank(s) differ "
                f"from this rank's {choice.name!r}",
                fix="if every rank runs the same code and software, something other than this job's ranks writes to "
                    "its rendezvous store (docs/security.md); otherwise make the nodes alike (the same packages, "
                    "CPUDDP_SHM, ranks per node) or pass the same explicit backend= on every rank, e.g. "
                    "backend='gloo'",
            )
    if share is not None:  # what else of the choice the ranks must share (shm: its node-to-node leg)
        choice = choice.backend.agree(choice, env, share, name)
    if env.is_main:
        log.info("cpuddp: backend %s (%s)", choice.name, choice.reason)
    return choice
