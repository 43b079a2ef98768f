"""``shard="optimizer"``: DDP whose gradient hook reduce-scatters, each rank stepping its share
of the optimizer (ZeRO-2).  The machinery is :mod:`cpuddp.train.sharding.zero`
(:class:`~cpuddp.train.sharding.zero.ZeroStep`); this is the mode's glue: its checks, its wrap,
its gradient norm and its live ``sharded_since_step``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from cpuddp.errors import PrepareError

from ..common.layout import gather_places
from ..sharding.shard import check_elementwise, check_shardable
from ..sharding.zero import UNFUSED_WHY, ZeroStep, zero_state
from .base import Options
from .ddp import wrap_ddp
from .sharded import ShardedStrategy, scope_error

__all__ = ["ZeroStrategy"]


class ZeroStrategy(ShardedStrategy):
    """``shard="optimizer"``: gradients and optimizer state sharded, parameters whole."""

    name = "optimizer"
    unfused_why = UNFUSED_WHY

    def check_mode_options(self, options: Options) -> None:
        if options.ddp_kwargs.get("gradient_as_bucket_view", True) is False:
            raise PrepareError("ddp_kwargs={'gradient_as_bucket_view': False} with shard='optimizer': the sharding "
                               "reads the gradients from DDP's buckets, where clip_grad_norm_ scales them.",
                               fix="drop gradient_as_bucket_view from ddp_kwargs")
        if options.comm_hook is not None:
            raise PrepareError(f"comm_hook={options.comm_hook!r} with shard='optimizer': the sharding is the "
                               "gradient hook.", fix="drop comm_hook, or use shard=None")
        if options.shard_blocks is not None:
            raise PrepareError(f"shard_blocks with shard={self.name!r}: blocks are FSDP2's unit.",
                               fix="pass shard='full'")
        if options.shard_scope is not None:
            raise scope_error(options.shard_scope, self.name)

    def check_objects(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        check_shardable(model, optimizer, self.name)
        check_elementwise(model, optimizer)

    def wrap(self, core: nn.Module, optimizer: Optional[torch.optim.Optimizer], do_ddp: bool, bf16_params: bool,
             options: Options, notes: list[str]) -> tuple[nn.Module, Optional[str]]:
        self.note_numpy(notes)
        if not do_ddp:
            return core, None
        outer = wrap_ddp(core, options)
        assert optimizer is not None  # check_elementwise
        ZeroStep(outer, optimizer, options.process_group)
        notes.append("shard='optimizer': gradients reduce-scattered, optimizer state sharded (from the step after "
                     "DDP's bucket layout settles; the steps before run as DDP)")
        gather_places(options.process_group)  # each rank's CPUs and threads, for Progress's header (layout.py)
        return outer, "reduce_scatter"

    def live_info(self, info: Any, core: nn.Module) -> Any:
        zero = zero_state(core)
        if zero is None:
            return info
        waiting = (f"shard='optimizer': not sharded yet after {zero.steps} step(s): {zero.waiting}",)
        return dataclasses.replace(info, sharded_since_step=zero.sharded_at,
                                   notes=info.notes + (waiting if zero.waiting else ()))

    def clip_grad_norm_(self, core: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        zero = zero_state(core)
        if zero is None:  # not wrapped (no parameter requires grad): nothing sharded
            return super().clip_grad_norm_(core, max_norm, norm_type)
        # sharded or not yet: its own norm (bit-identical resumes)
        return zero.clip_grad_norm_(float(max_norm), float(norm_type))
