"""A shm group's legs between nodes, formed over its leg's transport: the cross group (the ranks
of one local rank on every node: the hierarchy's leg) and the world group (every rank of the
group: all_to_all and send/recv across nodes, and every collective of a group whose nodes run one
rank each, or different numbers).

* gloo, or oneCCL: the leg backend's object forms each group
  (:meth:`~cpuddp.backends.types.BackendSpec.create_group`); the world group is gloo's.
* MPI (mpi4py, :mod:`cpuddp.launchers.mpi`): the ranks agree through the group's store, twice --
  that each found an MPI library (before any rank starts MPI: a rank that starts it waits for
  every rank of the job), then that each started it, that its world is the launcher's and that it
  takes calls from any thread -- and then both groups are MPI communicators of the job's world
  (:class:`~cpuddp.backends.shm.cross.mpi_group.MpiGroup`).  Where some rank cannot, every rank
  takes gloo and the log says why; where the user required MPI (``CPUDDP_SHM_INTER=mpi``), every
  rank stops with that reason.  What the store says can only take a group to gloo, whose sockets
  the job uses anyway; it never chooses a peer, a path or a size (docs/security.md).  A group
  that is not the job's whole world uses MPI only where its world group started it.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch.distributed as dist

from cpuddp.errors import BackendError
from cpuddp.launchers import hosts
from cpuddp.launchers import mpi as mpi_world

from ...types import backend_for
from ..protocol.node import GroupName, NodePlan
from .hierarchy import SumThenDivide
from .mpi_comm import MpiComm
from .mpi_group import MpiGroup

__all__ = ["Legs", "form_legs", "MPI_LEG"]

log = logging.getLogger("cpuddp.shm")

MPI_LEG = "mpi"
_OK = "ok"
_NO = "no:"
_THREADS = ("serialized", "multiple")


@dataclass(frozen=True)
class Legs:
    """``cross``: the cross group (None where the group needs none); ``world``: every rank's
    group; ``leg``: what carries them (``"gloo"``, ``"ccl"``, ``"mpi"``); ``text``: the leg in
    words for the log and the job's header (``MPI (MPICH Version: 5.0.2)``, ``gloo (MPI: why
    not)``)."""

    cross: Any
    world: Any
    leg: str
    text: str


def form_legs(store: Any, plan: NodePlan, name: GroupName, rank: int, size: int, timeout: datetime.timedelta,
              inter: str, *, required: bool = False) -> Legs:
    """The group's legs (see the module docstring); ``store``: the group's own (prefixed)."""
    why = ""
    if inter == MPI_LEG:
        mpi, why = _agree_mpi(store, name, rank, size, timeout)
        if mpi is not None:
            return _mpi_legs(mpi, plan, name, rank, timeout)
        if required:
            raise BackendError(f"rank {rank}: the shm group's node-to-node leg must be MPI (CPUDDP_SHM_INTER=mpi), "
                               f"but {why}", fix="fix MPI as the message says (docs/multinode.md), or set "
                                                 "CPUDDP_SHM_INTER=gloo, or unset it")
        log.warning("cpuddp.shm: between nodes gloo, not MPI: %s", why)
        inter = "gloo"
    cross = None
    if plan.whole_gloo is None and plan.nodes > 1:
        cross = backend_for(inter).create_group(dist.PrefixStore(f"cross/{plan.local_rank}", store), plan.node,
                                                plan.nodes, timeout)
    world = SumThenDivide(dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout), size)
    text = {"gloo": "gloo", "ccl": "oneCCL"}.get(inter, inter)
    return Legs(cross, world, inter, f"{text} (not MPI: {why})" if why else text)


def _agree_mpi(store: Any, name: GroupName, rank: int, size: int,
               timeout: datetime.timedelta) -> Tuple[Optional[Any], str]:
    """``(mpi4py's MPI, "")`` where every rank of the group can take MPI, else ``(None, why)``."""
    whole = name.members == tuple(range(name.world))
    if whole:
        found = mpi_world.find_library()
        mine = _OK if found.ok else _NO + found.reason
    else:
        mine = _OK if mpi_world.started() else _NO + "MPI was not started for the job's world group"
    said = hosts.exchange(store, "mpi/found", rank, size, mine[:300], timeout, what="MPI leg")
    why = _first_no(said)
    if why:
        return None, why
    try:
        mpi = mpi_world.start()
    except (ImportError, RuntimeError) as exc:  # found a moment ago: say what changed
        mpi, mine = None, _NO + f"mpi4py did not start MPI: {str(exc).splitlines()[0][:200]}"
    else:
        mine = _check_started(mpi, name, rank)
    said = hosts.exchange(store, "mpi/started", rank, size, mine[:300], timeout, what="MPI leg")
    why = _first_no(said)
    return (mpi, "") if not why else (None, why)


def _check_started(mpi: Any, name: GroupName, rank: int) -> str:
    """This rank's verdict on the MPI it started: ``"ok"`` or ``"no:<why>"``."""
    world = mpi.COMM_WORLD
    size, mine = int(world.Get_size()), int(world.Get_rank())
    if (size, mine) != (name.world, name.members[rank]):
        return (_NO + f"MPI's world has {size} rank(s) and calls rank {name.members[rank]} rank {mine}: mpi4py's "
                "MPI is not the launcher's (pair mpi4py with the MPI whose mpiexec started the job; under srun pass "
                "--mpi=pmi2 or --mpi=pmix)")
    level = mpi_world.thread_level(mpi)
    if level not in _THREADS:
        return _NO + f"MPI gave thread level {level}; the leg needs serialized or multiple"
    return _OK


def _first_no(said: Any) -> str:
    """The first rank's reason in an exchange of verdicts ("" when every rank said ok)."""
    for r, v in enumerate(said):
        if v != _OK:
            return f"rank {r}: {v[len(_NO):] if v.startswith(_NO) else 'an unreadable verdict'}"
    return ""


def _mpi_legs(mpi: Any, plan: NodePlan, name: GroupName, rank: int, timeout: datetime.timedelta) -> Legs:
    """The group's communicators over MPI's world: the group's members (group rank = MPI rank),
    and the cross group split from it (cross rank = node)."""
    world = mpi.COMM_WORLD
    if name.members == tuple(range(name.world)):
        comm = world.Dup()
    else:
        comm = world.Create_group(world.Get_group().Incl(list(name.members)))
    seconds = timeout.total_seconds()
    group = MpiGroup(MpiComm(mpi, comm, seconds, plan.spin, "group's MPI leg"))
    cross = None
    if plan.whole_gloo is None and plan.nodes > 1:
        cross = MpiGroup(MpiComm(mpi, comm.Split(plan.local_rank, plan.node), seconds, plan.spin,
                                 f"cross group of local rank {plan.local_rank}"))
    library = mpi.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
    return Legs(cross, group, MPI_LEG, f"MPI ({' '.join(library.split())})")
