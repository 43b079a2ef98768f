"""What the session asks of the shm backend, without importing torch: the group's options and
the lifecycle hooks registered with the backend (:func:`cpuddp.backends.registry.register_backend`).

* :class:`ShmOptions` travel as ``pg_options`` (``init_process_group("shm", pg_options=...)``,
  ``new_group(backend="shm", pg_options=...)``): the node-to-node leg, whether this rank has a
  CPU its compute threads leave free (for the communication thread), and how many ranks the
  launcher said run on this node (checked against the store, docs/security.md).  A group made
  without them reads ``CPUDDP_SHM_INTER``, ``CPUDDP_SHM_ASYNC`` and the launcher's
  ``LOCAL_WORLD_SIZE`` itself.
* :func:`leave_all` (``cpuddp.shutdown`` calls it before torch's teardown: peers waiting for
  this rank stop at once) and :func:`abort_all` (the watchdog calls it when the rank raises:
  peers stop while this rank still reports its error) act on every live group of the process.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

__all__ = ["ShmOptions", "leave_all", "abort_all", "track", "watch_lost", "lost", "INTER_VAR", "LEGS", "user_leg"]

INTER_VAR = "CPUDDP_SHM_INTER"
#: The node-to-node legs: gloo and oneCCL (their backend objects form the groups, with
#: ``create_group``) and MPI through mpi4py (:mod:`cpuddp.backends.shm.cross.legs`).
LEGS = ("gloo", "ccl", "mpi")

#: The live groups of this process (each has ``leave()`` and ``abort_peers(why)``).
_groups: "weakref.WeakSet[Any]" = weakref.WeakSet()


@dataclass(frozen=True)
class ShmOptions:
    """A shm group's options.  ``inter``: the node-to-node leg (``"gloo"``, ``"ccl"`` or ``"mpi"``);
    ``require_leg``: the user named the leg (``CPUDDP_SHM_INTER``): a leg that cannot form is an
    error, not gloo;
    ``async_comm``: this rank has a CPU its compute threads leave free, so large collectives
    may run on a communication thread (None: no); ``local_size``: the ranks on this node as the
    launcher said (None: unknown), a floor for what the store may claim; ``cpus``: this rank's
    compute CPUs (the pinning plan's) -- the group forms on them, so the rank's slots are
    allocated on their NUMA node, and they place the rank in the node's NUMA plan
    (:mod:`cpuddp.backends.shm.python.levels`); None: the forming thread's own CPUs."""

    inter: str = "gloo"
    require_leg: bool = False
    async_comm: Optional[bool] = None
    local_size: Optional[int] = None
    cpus: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.inter not in LEGS:
            from cpuddp.errors import BackendError

            raise BackendError(f"the shm group's node-to-node leg {self.inter!r} is not one of {', '.join(LEGS)}",
                               fix=f"set {INTER_VAR} to one of {', '.join(LEGS)} (or ShmOptions(inter=...)), or unset it")

    @classmethod
    def from_environ(cls, size: int, environ: Mapping[str, str] = os.environ) -> "ShmOptions":
        """The options of a group made without them (plain ``init_process_group("shm")``, and the
        subgroups torch makes with ``new_group``): the leg the user set, else the one of this
        process's live world group (a subgroup keeps its job's leg), else gloo."""
        leg = user_leg(environ)
        inter = leg or (_world_leg[0] if _world_leg else LEGS[0])
        local = environ.get("LOCAL_WORLD_SIZE", "")
        world = environ.get("WORLD_SIZE", "")
        spans_world = world.strip().isdigit() and int(world) == size
        return cls(inter=inter, require_leg=leg is not None,
                   local_size=int(local) if local.strip().isdigit() and spans_world else None)


def user_leg(environ: Mapping[str, str]) -> Optional[str]:
    """The node-to-node leg the user set in ``CPUDDP_SHM_INTER`` (None: unset), checked: the one
    place the variable is parsed."""
    raw = environ.get(INTER_VAR)
    if raw is None or not raw.strip():
        return None
    leg = raw.strip().lower()
    if leg not in LEGS:
        from cpuddp.errors import BackendError

        raise BackendError(f"{INTER_VAR}={raw!r}: the shm group's node-to-node leg is one of {', '.join(LEGS)}",
                           fix=f"set {INTER_VAR} to one of {', '.join(LEGS)}, or unset it (the rule then picks)")
    return leg


#: The node-to-node leg of this process's live world group, for the groups made without options.
_world_leg: list = []


def track(group: Any, world_leg: Optional[str] = None) -> None:
    """Keep ``group`` for :func:`leave_all`/:func:`abort_all`; ``world_leg``: its leg, when it is
    the job's world group (the subgroups made later keep it)."""
    _groups.add(group)
    if world_leg is not None:
        _world_leg[:] = [world_leg]


#: The lost-rank check a long wait asks (the watchdog's, while it runs): ``check() -> text or None``.
_lost_check: list = []


def watch_lost(check: Optional[Callable[[], Optional[str]]]) -> None:
    """Register the check a long wait of the node-to-node leg asks every second (None: none)."""
    _lost_check[:] = [check] if check is not None else []


def lost() -> Optional[str]:
    """The registered check's answer: a rank of the job known lost, in words, or None."""
    for check in list(_lost_check):
        said = check()
        if said:
            return said
    return None


def leave_all() -> None:
    """Mark every shm group of this process as left (local peers waiting for it stop at once)."""
    for group in list(_groups):
        group.leave()


def abort_all(why: str) -> None:
    """Set the abort word of every shm group of this process: local peers waiting for this rank
    raise at once ("local rank N gave up")."""
    for group in list(_groups):
        group.abort_peers(why)
