"""``prepare()``'s arguments, typed and frozen: :class:`PrepareOptions`.

:func:`cpuddp.prepare` builds one :class:`PrepareOptions` from its keyword arguments, once, and
passes it down whole (the precision step, the optimizer step, the strategy's wrap): nothing
below reads the keyword arguments, and no step renames one.  Building it is the one place the
arguments are checked (:meth:`PrepareOptions.__post_init__`): the precision name
(:func:`~cpuddp.train.precision.bf16.check_mixed_precision`), the hook (:func:`~cpuddp.train.common.comm.check_comm_hook`)
and the ``shard=`` request against the others (:func:`check_shard_request`: the mode's strategy
checks them), each a :class:`~cpuddp.errors.PrepareError` naming the argument, its value and the
fix.  What needs the model and the optimizer is checked when prepare has them (the strategy's
``check_objects``: :func:`cpuddp.train.sharding.shard.check_shardable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

from ..common.comm import check_comm_hook
from ..precision.bf16 import check_mixed_precision
from .ddp import DDP_OPTIONS
from .modes import SHARD_MODES, strategy_for

__all__ = ["PrepareOptions", "Shard", "Precision", "ShardScope", "SHARD_MODES", "DDP_OPTIONS", "check_shard_request"]

#: ``shard=``: None (DDP), ``"optimizer"`` (ZeRO-2: :mod:`cpuddp.train.sharding.zero`) or ``"full"`` (FSDP2).
Shard = Literal["optimizer", "full"]
#: ``mixed_precision=``: None, "no" and "fp32" are fp32; "auto" times both (:mod:`cpuddp.train.precision.precision_trial`).
Precision = Literal["no", "fp32", "bf16", "auto"]
#: ``shard_scope=`` with ``shard="full"``: shard within each node (HSDP across nodes), or across every rank.
ShardScope = Literal["node", "world"]


@dataclass(frozen=True)
class PrepareOptions:
    """The keyword arguments of :func:`cpuddp.prepare` (its docstring and docs/prepare.md say what
    each does), checked when built.  ``ddp_kwargs`` is kept as a plain dict copy (None: empty)."""

    mixed_precision: Optional[Precision] = None
    strict: bool = False
    ipex: Optional[bool] = None
    fused_optimizer: bool = True
    compile: Union[bool, Mapping[str, Any]] = False
    ddp: Optional[bool] = None
    shard: Optional[Shard] = None
    shard_blocks: Any = None  # cpuddp.train.sharding.shard.BlockSpec: classes, class names or (name, module) -> bool
    shard_scope: Optional[ShardScope] = None
    bucket_cap_mb: Optional[float] = None
    static_graph: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: Optional[bool] = None
    comm_hook: Union[None, Literal["fp16", "bf16"], Callable[..., Any], tuple] = None
    output_fp32: bool = True
    process_group: Optional[Any] = None
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ddp_kwargs", dict(self.ddp_kwargs or {}))
        check_comm_hook(self.comm_hook)
        check_shard_request(self)
        check_mixed_precision(self.mixed_precision)


def check_shard_request(options: PrepareOptions) -> None:
    """Pure: raise :class:`PrepareError` for a ``shard=`` request that cannot be met as asked
    (the value itself, then the mode's strategy's checks of the other options)."""
    strategy_for(options.shard).check_request(options)
