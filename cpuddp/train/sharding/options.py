"""``prepare()``'s arguments, typed and frozen: :class:`PrepareOptions`.

:func:`cpuddp.prepare` builds one :class:`PrepareOptions` from its keyword arguments, once, and
passes it down whole (the precision step, the optimizer step, the DDP wrap or FSDP2): nothing
below reads the keyword arguments, and no step renames one.  Building it is the one place the
arguments are checked (:meth:`PrepareOptions.__post_init__`): the precision name
(:func:`~cpuddp.train.precision.bf16.check_mixed_precision`), the hook (:func:`~cpuddp.train.common.comm.check_comm_hook`)
and the ``shard=`` request against the others (:func:`check_shard_request`), each a
:class:`~cpuddp.errors.PrepareError` naming the argument, its value and the fix.  What needs the
model and the optimizer is checked when prepare has them (:func:`cpuddp.train.sharding.shard.check_shardable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

from cpuddp.errors import PrepareError

from ..common.comm import check_comm_hook
from ..precision.bf16 import check_mixed_precision

__all__ = ["PrepareOptions", "Shard", "Precision", "ShardScope", "SHARD_MODES", "DDP_OPTIONS", "check_shard_request"]

#: ``shard=``: None (DDP), ``"optimizer"`` (ZeRO-2: :mod:`cpuddp.train.sharding.zero`) or ``"full"`` (FSDP2).
Shard = Literal["optimizer", "full"]
SHARD_MODES = (None, "optimizer", "full")
#: ``mixed_precision=``: None, "no" and "fp32" are fp32; "auto" times both (:mod:`cpuddp.train.precision.precision_trial`).
Precision = Literal["no", "fp32", "bf16", "auto"]
#: ``shard_scope=`` with ``shard="full"``: shard within each node (HSDP across nodes), or across every rank.
ShardScope = Literal["node", "world"]
#: prepare() options that configure DDP, which shard="full" does not use.
DDP_OPTIONS = ("bucket_cap_mb", "static_graph", "find_unused_parameters", "broadcast_buffers", "ddp_kwargs", "comm_hook")


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


def _ddp_options_set(options: PrepareOptions) -> list[str]:
    defaults = {"static_graph": False, "find_unused_parameters": False}
    return [k for k in DDP_OPTIONS if getattr(options, k) not in (None, {}, defaults.get(k, None))]


def _check_shard_mode(options: PrepareOptions) -> None:
    """The value of ``shard`` itself, and the arguments that only go with one mode of it."""
    shard = options.shard
    if shard not in SHARD_MODES:
        raise PrepareError(f"shard must be None, 'optimizer' or 'full'. Got {shard!r} instead.",
                           fix="pass shard='optimizer' (ZeRO-2: optimizer state and gradients sharded) or "
                               "shard='full' (FSDP2: parameters sharded too)")
    if shard is None and (options.shard_blocks is not None or options.shard_scope is not None):
        raise PrepareError("shard_blocks/shard_scope were given, but shard=None.", fix="pass shard='full'")


def check_shard_request(options: PrepareOptions) -> None:
    """Pure: raise :class:`PrepareError` for a ``shard=`` request that cannot be met as asked."""
    _check_shard_mode(options)
    shard = options.shard
    if shard is None:
        return
    if options.ipex is True:
        raise PrepareError(f"ipex=True with shard={shard!r}: IPEX's fused optimizer steps whole parameters "
                           "of its own copy and cannot be sharded.", fix="pass ipex=None (or False) with shard=")
    if options.ddp is False:
        raise PrepareError(f"ddp=False with shard={shard!r}: sharding is data parallel.", fix="drop ddp=False")
    if options.compile:
        raise PrepareError(f"compile={options.compile!r} with shard={shard!r}: torch.compile over the sharded "
                           "model is not tested by cpuddp yet.", fix="pass compile=False with shard=")
    if shard == "optimizer" and options.ddp_kwargs.get("gradient_as_bucket_view", True) is False:
        raise PrepareError("ddp_kwargs={'gradient_as_bucket_view': False} with shard='optimizer': the sharding "
                           "reads the gradients from DDP's buckets, where clip_grad_norm_ scales them.",
                           fix="drop gradient_as_bucket_view from ddp_kwargs")
    if shard == "optimizer" and options.comm_hook is not None:
        raise PrepareError(f"comm_hook={options.comm_hook!r} with shard='optimizer': the sharding is the "
                           "gradient hook.", fix="drop comm_hook, or use shard=None")
    if shard == "full":
        given = _ddp_options_set(options)
        if given:
            raise PrepareError(f"{given[0]}={getattr(options, given[0])!r} configures DDP, which shard='full' "
                               "(FSDP2) does not use.", fix=f"drop {given[0]}, or use shard='optimizer'")
    if options.shard_blocks is not None and shard != "full":
        raise PrepareError(f"shard_blocks with shard={shard!r}: blocks are FSDP2's unit.", fix="pass shard='full'")
    scope = options.shard_scope
    if scope not in (None, "node", "world") or (scope is not None and shard != "full"):
        raise PrepareError(f"shard_scope must be None, 'node' or 'world' with shard='full'. Got {scope!r} "
                           f"with shard={shard!r}.", fix="drop shard_scope (default: within each node, HSDP across nodes)")
