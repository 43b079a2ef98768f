"""Agreeing on the backend, forming the process group init chose, and proving it works.

:func:`agree_backend` is this rank's choice checked against every other rank's through the
job's store (:func:`agree_inter` does the same for shm's node-to-node leg), so the ranks
never form mismatched groups.  :func:`group_options` is what the chosen backend gets as ``pg_options`` (the shm group's
:class:`~cpuddp.backends.shm.api.ShmOptions`); :func:`form_group` calls torch's
``init_process_group`` with the job's store (an error naming the rendezvous and the interface
fix when the ranks cannot connect); :func:`first_collective` runs one small all_reduce, so a
backend that forms a group but cannot communicate fails at init with its explanation
(:mod:`cpuddp.backends.failure`), not in the first training step.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

from cpuddp.errors import BackendError, RendezvousError, first_line

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

    from cpuddp.affinity.plan import PinPlan
    from cpuddp.launchers.env import DistEnv

    from .types import BackendChoice

__all__ = ["agree_backend", "agree_inter", "group_options", "form_group", "first_collective"]

log = logging.getLogger("cpuddp")


def agree_backend(requested: str, env: "DistEnv", store: Optional["Store"], name: str, td: datetime.timedelta,
                  environ: Mapping[str, str], node_cpus: Optional[int] = None,
                  smallest_node: Optional[int] = None) -> "BackendChoice":
    """This rank's backend choice, checked against every other rank's through the store.

    Each rank keeps its own choice: what the store says of the others' can stop the job, never
    change its backend.  Ranks that disagree -- under ``"auto"`` too -- are an error naming each
    rank's choice (the store is unauthenticated: a neighbour who rewrote a rank's choice to
    ``gloo`` would otherwise move the job onto sockets it can reach; docs/security.md)."""
    from . import registry as backends  # through the module: tests replace resolve_backend there

    choice = backends.resolve_backend(requested, env, environ=environ, node_cpus=node_cpus,
                                      smallest_node=smallest_node)
    if store is not None:
        _agree(env, store, name, td, choice.name, requested, "backend")
        if choice.inter is not None:  # every rank chose shm across the same nodes
            choice = agree_inter(choice, env, store, f"{name}/inter", td)
    if env.is_main:
        log.info("cpuddp: backend %s (%s)", choice.name, choice.reason)
    return choice


def agree_inter(choice: "BackendChoice", env: "DistEnv", store: "Store", name: str,
                td: datetime.timedelta) -> "BackendChoice":
    """shm's node-to-node leg: oneCCL only when every rank has working bindings, else gloo (a
    warning names each rank's leg).  Between nodes both legs are plain TCP that a network peer
    can reach (docs/security.md), so the store choosing gloo there exposes nothing new; within a
    node the store chooses nothing."""
    from cpuddp.launchers import hosts, store_values

    legs = hosts.exchange(store, name, env.rank, env.world_size, str(choice.inter), td, what="backend")
    legs = [store_values.backend_name(f"{name}/{r}", n) for r, n in enumerate(legs)]
    if len(set(legs)) == 1:
        return choice
    if env.is_main:
        log.warning("cpuddp: between nodes gloo, not %s: not every rank has working oneCCL bindings (%s)",
                    choice.inter, ", ".join(f"rank {r}: {n}" for r, n in enumerate(legs) if n != choice.inter)[:400])
    return dataclasses.replace(choice, inter="gloo", reason=f"{choice.reason}; between nodes gloo after all: "
                               f"not every rank has working oneCCL bindings ({', '.join(sorted(set(legs)))})")


def _agree(env: "DistEnv", store: "Store", name: str, td: datetime.timedelta, mine: str, requested: str,
           what: str) -> None:
    """Publish this rank's ``mine`` under exchange ``name``; raise unless every rank's is the same."""
    from cpuddp.launchers import hosts, store_values

    names = hosts.exchange(store, name, env.rank, env.world_size, mine, td, what="backend")
    names = [store_values.backend_name(f"{name}/{r}", n) for r, n in enumerate(names)]
    if len(set(names)) == 1:
        return
    differ = [r for r, n in enumerate(names) if n != mine]
    shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names) if r == env.rank or n != mine)
    if len(shown) > 400:
        shown = shown[:397] + "..."
    asked = "" if requested.strip().lower() == "auto" else f" (backend={requested!r} on this rank)"
    raise BackendError(
        f"rank {env.rank}: the ranks' {what} choices differ{asked}: {shown}; {len(differ)} rank(s) differ from "
        f"this rank's {mine!r}",
        fix="if every rank runs the same code and software, something other than this job's ranks writes to its "
            "rendezvous store (docs/security.md); otherwise make the nodes alike (the same packages, "
            "CPUDDP_SHM, ranks per node) or pass the same explicit backend= on every rank, e.g. backend='gloo'",
    )


def group_options(choice: "BackendChoice", plan: Optional["PinPlan"], local_size: Optional[int]) -> Any:
    """The process-group options for ``choice`` (the shm group's: its node-to-node leg, whether
    the plan leaves this rank a CPU for a communication thread, and ``local_size``: the ranks on
    this node as init proved them, below which the group refuses the store's records)."""
    if choice.name != "shm":
        return None
    from .settings import shm_options

    spare = plan is not None and len(plan.cpus) > plan.num_threads
    return shm_options(choice, os.environ, async_comm=spare, local_size=local_size)


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
