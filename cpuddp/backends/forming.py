"""Forming the process group init decided on (:mod:`cpuddp.backends.decide`), and proving it works.

:func:`form_group` calls torch's ``init_process_group`` with the job's store and the plan's
``pg_options`` (an error naming the rendezvous and the interface fix when the ranks cannot
connect); :func:`first_collective` runs one small all_reduce, so a backend that forms a group
but cannot communicate fails at init with its explanation (:mod:`cpuddp.backends.failure`),
not in the first training step.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any

from cpuddp.errors import BackendError, RendezvousError, first_line

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

__all__ = ["form_group", "first_collective"]

def form_group(env: "DistEnv", backend: str, store: Any, td: datetime.timedelta, options: Any = None) -> None:
    """``init_process_group`` with the job's store (a HashStore for a world of one)."""
    import torch.distributed as dist

    if store is None:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td,
                                pg_options=options)
        return
    try:
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=td,
                                pg_options=options)
    except Exception as exc:
        where = f"{env.master_addr}:{env.master_port}"
        raise RendezvousError(
            f"rank {env.rank}: forming the {backend} group of {env.world_size} failed: "
            f"{type(exc).__name__}: {first_line(exc)}",
            fix=f"every rank reached the rendezvous at {where}, but they could not connect to each other: "
            "set GLOO_SOCKET_IFNAME to the interface the hosts share, and check firewalls between them",
        ) from exc


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
