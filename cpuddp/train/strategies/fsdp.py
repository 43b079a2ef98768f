"""``shard="full"``: FSDP2 (``fully_shard``), parameters, gradients and optimizer state sharded.
The machinery is :mod:`cpuddp.train.sharding.shard` (blocks, mesh, :func:`~cpuddp.train.sharding.shard.apply_full`);
this is the mode's glue: its checks, its wrap, ``no_sync``, the gradient norm and the whole
state dict gathered from (or loaded into) the shards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from cpuddp.errors import PrepareError

from ..common.layout import gather_places
from ..sharding.shard import apply_full, check_shardable
from .base import Options
from .ddp import ddp_options_set
from .sharded import ShardedStrategy, scope_error

__all__ = ["FsdpStrategy"]


class FsdpStrategy(ShardedStrategy):
    """``shard="full"``: FSDP2 over this node's ranks (HSDP across nodes), the optimizer rebound."""

    name = "full"
    shards_parameters = True
    wraps_in_ddp = False
    sharded_from_step = 1

    def check_mode_options(self, options: Options) -> None:
        given = ddp_options_set(options)
        if given:
            raise PrepareError(f"{given[0]}={getattr(options, given[0])!r} configures DDP, which shard='full' "
                               "(FSDP2) does not use.", fix=f"drop {given[0]}, or use shard='optimizer'")
        if options.shard_scope not in (None, "node", "world"):
            raise scope_error(options.shard_scope, self.name)

    def check_objects(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        check_shardable(model, optimizer, self.name)

    def bf16_parameters(self, dtype: Optional[torch.dtype], options: Options) -> bool:
        """FSDP2's bf16 MixedPrecisionPolicy for an explicit "bf16" (not trialled: FSDP2 cannot turn
        it off after a trial); "auto" keeps fp32 parameters under the trial's autocast."""
        return dtype is not None and options.mixed_precision == "bf16"

    def wrap(self, core: nn.Module, optimizer: Optional[torch.optim.Optimizer], do_ddp: bool, bf16_params: bool,
             options: Options, notes: list[str]) -> tuple[nn.Module, Optional[str]]:
        from cpuddp.ranks import get_local_rank, get_local_world_size, get_node_rank

        self.note_numpy(notes)
        outer = apply_full(core, optimizer, blocks=options.shard_blocks, scope=options.shard_scope,
                           group=options.process_group, bf16=bf16_params, notes=notes,
                           node_of=lambda: (get_node_rank(), get_local_rank(), get_local_world_size()))
        gather_places(options.process_group)  # each rank's CPUs and threads, for Progress's header (layout.py)
        return outer, None

    @contextlib.contextmanager
    def no_sync(self, outer: nn.Module) -> Iterator[None]:
        """FSDP2's ``set_requires_gradient_sync(False)`` (whole gradients kept until the next
        synchronized backward: more memory).  A model with DTensor parameters but no FSDP2 root
        (the fallback's guess, e.g. tensor parallel): nothing, as before."""
        if not callable(getattr(outer, "set_requires_gradient_sync", None)):
            yield
            return
        outer.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            outer.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_grad_norm_(self, core: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        total = super().clip_grad_norm_(core, max_norm, norm_type)
        full = getattr(total, "full_tensor", None)  # a DTensor, unless no gradient was there to clip
        return full() if callable(full) else total

    def whole_model_state(self, core: nn.Module) -> Optional[dict[str, Any]]:
        """Whole, plain CPU tensors on rank 0 (empty elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(core, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_whole_model_state(self, core: nn.Module, state: dict[str, Any], strict: bool) -> Any:
        """Rank 0's whole tensors broadcast, each rank keeping its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        return set_model_state_dict(core, state, options=options)
