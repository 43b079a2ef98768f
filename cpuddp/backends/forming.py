"""Forming the process group init decided on (:mod:`cpuddp.backends.decide`), and proving it works:
the last steps of :func:`cpuddp.backends.start.start_backend`.

:func:`form_group` calls torch's ``init_process_group`` with the job's store and the group's
options the backend's object built from the agreed plan (an error naming the rendezvous and
the interface fix when the ranks cannot connect); :func:`first_collective` runs one small
all_reduce, so a backend that forms a group but cannot communicate fails at init with its
explanation (:mod:`cpuddp.backends.failure`), not in the first training step.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import TYPE_CHECKING, Any

from cpuddp.errors import BackendError, CpuddpError, RendezvousError, first_line
from cpuddp.launchers.store_values import stall_cause

from .types import BackendChoice

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

__all__ = ["form_group", "first_collective"]

log = logging.getLogger("cpuddp.backends")


def form_group(env: "DistEnv", backend: str, options: Any, store: Any, td: datetime.timedelta) -> None:
    """``init_process_group`` for ``backend`` with the group's ``options`` (its ``pg_options``,
    :meth:`~cpuddp.backends.types.BackendSpec.group_options`: the shm group's
    :class:`~cpuddp.backends.shm.api.ShmOptions`, None for torch's defaults) and the job's store
    (a HashStore for a world of one)."""
    import torch.distributed as dist

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


def first_collective(env: "DistEnv", choice: BackendChoice) -> None:
    """One small all_reduce: a backend that formed a group but cannot communicate (a oneCCL
    transport that fails to initialise) fails here, with its explanation and fix
    (:meth:`~cpuddp.backends.types.BackendSpec.explain_failure`), not in the first step."""
    if env.world_size == 1:
        return
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    try:
        dist.all_reduce(t)
    except Exception as exc:
        raise choice.backend.explain_failure(os.environ, exc) from exc
    if t.item() != env.world_size:
        raise BackendError(
            f"rank {env.rank}: the {choice.name} group's first all_reduce gave {t.item()}, not {env.world_size}",
            fix="the backend is broken on this machine: pass backend='gloo'",
        )
