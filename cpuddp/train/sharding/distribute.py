"""The last steps of :func:`cpuddp.prepare`: shard the model (FSDP2) or wrap it in DDP with its
gradient communication, then ``torch.compile`` it when asked.

:func:`distribute` takes what prepare decided (the shard mode in effect, whether to wrap, bf16
parameters) and prepare's :class:`~cpuddp.train.sharding.options.PrepareOptions`; it returns the outer module and the name of the
gradient hook.  :func:`ddp_kwargs` is the ``DistributedDataParallel`` call's keyword arguments:
cpuddp's CPU defaults, then the user's.  :func:`compile_model` applies ``compile=``.
:func:`unwrap` undoes the wrap: the user's module inside DDP and ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import PrepareError

from ..common.comm import register_hook
from ..common.layout import gather_places
from ..common.objects import without_numpy
from .options import PrepareOptions, Shard
from .shard import apply_full
from .zero import ZeroStep

__all__ = ["distribute", "ddp_kwargs", "compile_model", "unwrap", "is_sharded"]


def ddp_kwargs(options: PrepareOptions) -> dict[str, Any]:
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


def _wrap_ddp(core: nn.Module, options: PrepareOptions) -> nn.Module:
    if not (dist.is_available() and dist.is_initialized()):
        raise PrepareError(
            "ddp=True, but torch.distributed is not initialized.",
            fix="call cpuddp.init_distributed() before cpuddp.prepare()",
        )
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(core, **ddp_kwargs(options))


def _shard_full(core: nn.Module, optimizer: Optional[torch.optim.Optimizer], options: PrepareOptions,
                bf16_params: bool, notes: list[str]) -> nn.Module:
    """shard="full": FSDP2 over this node's ranks (HSDP across nodes), the optimizer rebound;
    ``bf16_params``: FSDP2's bf16 MixedPrecisionPolicy (an explicit "bf16": not trialled, as FSDP2
    cannot turn it off after a trial; "auto" keeps fp32 parameters under the trial's autocast)."""
    from cpuddp.ranks import get_local_rank, get_local_world_size, get_node_rank

    return apply_full(core, optimizer, blocks=options.shard_blocks, scope=options.shard_scope,
                      group=options.process_group, bf16=bf16_params, notes=notes,
                      node_of=lambda: (get_node_rank(), get_local_rank(), get_local_world_size()))


def _gradient_hook(ddp: nn.Module, optimizer: Optional[torch.optim.Optimizer], shard: Optional[Shard],
                   options: PrepareOptions, notes: list[str]) -> Optional[str]:
    """The DDP model's gradient communication: shard="optimizer"'s reduce-scatter, or ``comm_hook``."""
    if shard == "optimizer":
        assert optimizer is not None  # check_shardable
        ZeroStep(ddp, optimizer, options.process_group)
        notes.append("shard='optimizer': gradients reduce-scattered, optimizer state sharded (from the step after "
                     "DDP's bucket layout settles; the steps before run as DDP)")
        return "reduce_scatter"
    return register_hook(ddp, options.comm_hook, options.process_group, options.strict, notes)


def compile_model(module: nn.Module, compile: Union[bool, Mapping[str, Any]]) -> tuple[nn.Module, bool]:
    """``module`` through ``torch.compile`` (``compile`` a dict: its keyword arguments) when
    ``compile`` is set; whether it was."""
    if not compile:
        return module, False
    ckw = dict(compile) if isinstance(compile, Mapping) else {}
    return torch.compile(module, **ckw), True  # type: ignore[return-value]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and ``torch.compile`` wrappers (any nesting)."""
    from torch.nn.parallel import DistributedDataParallel

    seen = 0
    while seen < 16:
        seen += 1
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(getattr(model, "_orig_mod"), nn.Module):
            model = model._orig_mod  # torch._dynamo OptimizedModule
        else:
            break
    return model


def distribute(core: nn.Module, optimizer: Optional[torch.optim.Optimizer], shard: Optional[Shard], do_ddp: bool,
               bf16_params: bool, options: PrepareOptions, notes: list[str]) -> tuple[nn.Module, Optional[str]]:
    """Shard (FSDP2) or wrap in DDP (with its gradient hook) as decided: ``(outer module, hook name)``;
    ``shard``: the mode in effect (None at world size 1 whatever ``options.shard`` asked)."""
    outer, hook_name = core, None
    if shard is not None and without_numpy():  # DCP's object collectives, for a sharded model's checkpoint
        notes.append("numpy not installed: torch's object collectives (DCP's) copy their bytes without it")
    if shard == "full":
        outer = _shard_full(core, optimizer, options, bf16_params, notes)
    elif do_ddp:
        outer = _wrap_ddp(core, options)
        hook_name = _gradient_hook(outer, optimizer, shard, options, notes)
    elif options.comm_hook is not None:
        notes.append("comm_hook ignored: no DDP wrap at world size 1")
    if shard == "full" or do_ddp:
        gather_places(options.process_group)  # each rank's CPUs and threads, for Progress's header (layout.py)
    return outer, hook_name


def is_sharded(core: nn.Module) -> bool:
    """Are some parameters DTensors (``fully_shard``)?  Then saving and loading are collective:
    every rank holds a shard of them."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return any(isinstance(p, DTensor) for p in core.parameters())
