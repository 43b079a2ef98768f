"""``shard=None``: DDP (every rank holds and steps everything), with its gradient hook.

:func:`ddp_kwargs` is the ``DistributedDataParallel`` call's keyword arguments: cpuddp's CPU
defaults, then the user's; :func:`wrap_ddp` makes the wrapper (``shard="optimizer"`` wraps with
it too).  :class:`DdpStrategy` wraps when prepare decided to and registers ``comm_hook``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import PrepareError

from ..common.comm import register_hook
from ..common.layout import gather_places
from .base import Options, Strategy

__all__ = ["DdpStrategy", "ddp_kwargs", "wrap_ddp", "DDP_OPTIONS", "ddp_options_set"]

#: prepare() options that configure DDP, which shard="full" does not use.
DDP_OPTIONS = ("bucket_cap_mb", "static_graph", "find_unused_parameters", "broadcast_buffers", "ddp_kwargs", "comm_hook")


def ddp_options_set(options: Options) -> list[str]:
    """The DDP options (:data:`DDP_OPTIONS`) given other values than their defaults."""
    defaults = {"static_graph": False, "find_unused_parameters": False}
    return [k for k in DDP_OPTIONS if getattr(options, k) not in (None, {}, defaults.get(k, None))]


def ddp_kwargs(options: Options) -> dict[str, Any]:
    """``DistributedDataParallel`` keyword arguments: cpuddp's CPU defaults, then the user's."""
    kw: dict[str, Any] = dict(
        device_ids=None,
        gradient_as_bucket_view=True,
        static_graph=options.static_graph,
        find_unused_parameters=options.find_unused_parameters,
        process_group=options.process_group,
    )
    if options.broadcast_buffers is not None:  # deprecated in torch 2.13; pass only when chosen
        kw["broadcast_buffers"] = options.broadcast_buffers
    if options.bucket_cap_mb is not None:
        kw["bucket_cap_mb"] = options.bucket_cap_mb
    kw.update(options.ddp_kwargs)
    return kw


def wrap_ddp(core: nn.Module, options: Options) -> nn.Module:
    """``core`` in ``DistributedDataParallel`` (:func:`ddp_kwargs`); refused without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise PrepareError(
            "ddp=True, but torch.distributed is not initialized.",
            fix="call cpuddp.init_distributed() before cpuddp.prepare()",
        )
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(core, **ddp_kwargs(options))


class DdpStrategy(Strategy):
    """``shard=None`` (and any mode at world size 1): DDP when prepare wraps, with ``comm_hook``."""

    def check_request(self, options: Options) -> None:
        if options.shard_blocks is not None or options.shard_scope is not None:
            raise PrepareError("shard_blocks/shard_scope were given, but shard=None.", fix="pass shard='full'")

    def wrap(self, core: nn.Module, optimizer: Optional[torch.optim.Optimizer], do_ddp: bool, bf16_params: bool,
             options: Options, notes: list[str]) -> tuple[nn.Module, Optional[str]]:
        if not do_ddp:
            if options.comm_hook is not None:
                notes.append("comm_hook ignored: no DDP wrap at world size 1")
            return core, None
        outer = wrap_ddp(core, options)
        hook_name = register_hook(outer, options.comm_hook, options.process_group, options.strict, notes)
        gather_places(options.process_group)  # each rank's CPUs and threads, for Progress's header (layout.py)
        return outer, hook_name
