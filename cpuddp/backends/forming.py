"""Forming the process group init decided on (:mod:`cpuddp.backends.decide`), and proving it works.

:func:`form_group` calls torch's ``init_process_group`` with the job's store and the group's
options built from the agreed plan (:func:`group_options`; an error naming the rendezvous and
the interface fix when the ranks cannot connect); :func:`first_collective` runs one small
all_reduce, so a backend that forms a group but cannot communicate fails at init with its
explanation (:mod:`cpuddp.backends.failure`), not in the first training step.

Environment variables read: ``CPUDDP_SHM_INTER`` (the user's node-to-node leg for shm, which
wins over the rule's).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import TYPE_CHECKING, Any, Optional, Tuple

from cpuddp.errors import BackendError, CpuddpError, RendezvousError, first_line
from cpuddp.launchers.store_values import stall_cause

from .shm.api import ShmOptions
from .types import BackendChoice

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

    from .decide import BackendPlan

__all__ = ["form_group", "group_options", "shm_options", "first_collective"]

log = logging.getLogger("cpuddp.backends")


def group_options(env: "DistEnv", plan: "BackendPlan") -> Any:
    """The group's ``pg_options`` for the agreed ``plan``: the shm group's
    :class:`~cpuddp.backends.shm.api.ShmOptions` (the agreed node-to-node leg, the communication
    thread on a spare CPU of the plan, the launcher's local size, the rank's CPUs), None for the
    others."""
    if plan.name != "shm":
        return None
    return shm_options(plan.choice, async_comm=plan.comm_thread, local_size=env.local_world_size,
                       cpus=plan.compute_cpus)


def shm_options(choice: BackendChoice, *, async_comm: Optional[bool] = None, local_size: Optional[int] = None,
                cpus: Optional[Tuple[int, ...]] = None) -> ShmOptions:
    """The shm group's options (``pg_options``): the agreed node-to-node leg (the rule's, or the
    user's ``CPUDDP_SHM_INTER``: :func:`cpuddp.backends.decide.user_leg`, read before the
    agreement); ``async_comm``, ``local_size`` and ``cpus`` as :class:`~cpuddp.backends.shm.api.ShmOptions`."""
    return ShmOptions(inter=choice.inter or "gloo", async_comm=async_comm, local_size=local_size, cpus=cpus)


def form_group(env: "DistEnv", plan: "BackendPlan", store: Any, td: datetime.timedelta) -> None:
    """``init_process_group`` for ``plan`` with the job's store (a HashStore for a world of one)."""
    import torch.distributed as dist

    backend, options = plan.name, group_options(env, plan)

    if store is None:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td,
                                pg_options=options)
        return
    try:
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=td,
                                pg_options=options)
    except Exception as exc:
        raise _forming_error(env, backend, exc) from exc


def _forming_error(env: "DistEnv", backend: str, exc: Exception) -> RendezvousError:
    """Why the group did not form: the backend's own words and fix where it has them (the shm
    group's), a wait at the store that ran out (naming the store), else the interface fix."""
    import torch.distributed as dist

    where = f"{env.master_addr}:{env.master_port}"
    said = f"rank {env.rank}: forming the {backend} group of {env.world_size} failed"
    if isinstance(exc, CpuddpError):
        return RendezvousError(f"{said}: {type(exc).__name__}: {exc.msg}", fix=exc.fix)
    text = first_line(exc)
    if isinstance(exc, dist.DistStoreError) or "timeout" in text.lower():
        return RendezvousError(f"{said}: {type(exc).__name__}: {text} (waiting for the other ranks at the "
                               f"rendezvous store {where})", fix=stall_cause(where))
    return RendezvousError(
        f"{said}: {type(exc).__name__}: {text}",
        fix=f"every rank reached the rendezvous at {where}, but they could not connect to each other: "
        "set GLOO_SOCKET_IFNAME to the interface the hosts share, and check firewalls between them")


def first_collective(env: "DistEnv", backend: str) -> None:
    """One small all_reduce: a backend that formed a group but cannot communicate (a oneCCL
    transport that fails to initialise) fails here, with the fix, not in the first step."""
    if env.world_size == 1:
        return
    import torch
    import torch.distributed as dist

    from .failure import explain_collective_failure

    t = torch.ones(1)
    try:
        dist.all_reduce(t)
    except Exception as exc:
        raise explain_collective_failure(backend, os.environ, exc) from exc
    if t.item() != env.world_size:
        raise BackendError(
            f"rank {env.rank}: the {backend} group's first all_reduce gave {t.item()}, not {env.world_size}",
            fix="the backend is broken on this machine: pass backend='gloo'",
        )
