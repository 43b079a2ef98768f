"""``prepare(model, optimizer)``: optimize a model for the CPU, then wrap it in DDP.

Usage::

    env = cpuddp.init_distributed()            # optional; without it the world size is 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model = cpuddp.prepare(model, optimizer, mixed_precision="bf16")
    for batch in loader:                         # the loop needs no other change
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()                          # the object you created keeps working
        optimizer.zero_grad()

What it does, in order:

1. **Precision.**  ``mixed_precision="bf16"`` asks for bf16 autocast.  The CPU is probed
   (AMX or AVX512-BF16, through ``torch.cpu._is_amx_tile_supported()`` /
   ``torch.cpu._is_avx512_bf16_supported()``, else ``/proc/cpuinfo``).  Without either,
   bf16 runs emulated and slower than fp32, so prepare warns and stays in fp32 -- or, with
   ``strict=True``, raises :class:`cpuddp.errors.PrepareError`.
2. **Optimization**, one of two paths:

   * *IPEX*, when ``intel_extension_for_pytorch`` is installed and its major.minor equals
     torch's (probed with :mod:`importlib.metadata` before importing it, because IPEX exits
     the interpreter on a mismatch): ``ipex.optimize(model, optimizer=..., dtype=...,
     inplace=True)``.  ``ipex=False`` skips it, ``ipex=True`` demands it.
   * *stock PyTorch* otherwise: a ``torch.optim.Adam``/``AdamW`` the user left at
     ``fused=None`` is switched to the fused CPU kernel (same object; only when it is safe:
     no steps taken yet, every parameter a real floating tensor on the CPU, ``foreach``,
     ``capturable`` and ``differentiable`` unset).

3. **DDP**, when the world size is above 1 (from ``torch.distributed`` if initialized,
   else 1): no ``device_ids``, ``gradient_as_bucket_view=True``; ``bucket_cap_mb``,
   ``static_graph``, ``find_unused_parameters``, ``broadcast_buffers`` (only when given:
   torch 2.13 deprecates it) and ``ddp_kwargs`` pass through.
   ``comm_hook="fp16"`` compresses gradients to fp16 (gloo supports it);
   ``comm_hook="bf16"`` first probes that the backend all-reduces bf16 correctly (gloo
   failed to in some torch versions, pytorch issue 111131) and then registers cpuddp's own
   bf16 hook (torch refuses its ``bf16_compress_hook`` on CPU by the hook's name).
   ``shard="optimizer"`` keeps the DDP wrap with a reduce-scatter hook and shards the
   optimizer (:mod:`cpuddp.train.sharding.zero`); ``shard="full"`` shards the model with FSDP2 instead
   (:mod:`cpuddp.train.sharding.shard`: blocks, HSDP mesh, bf16 policy, the optimizer rebound).
   Each mode is a strategy (:mod:`cpuddp.train.strategies`), chosen here once from ``shard=``.
4. ``compile=True`` (or a dict of ``torch.compile`` keyword arguments) compiles the result.
5. With bf16 active, the returned module's forward runs under
   ``torch.autocast("cpu", dtype=torch.bfloat16)`` (a forward pre-hook and an
   ``always_call`` forward hook), and floating outputs come back as fp32
   (``output_fp32=True``) so a loss computed outside the model is computed in fp32.

Calling prepare again on a prepared model (or on the module inside it) with the same
arguments returns the prepared model unchanged; with different arguments it raises
:class:`~cpuddp.errors.PrepareError`.  It never wraps twice.  :func:`prepared_info` tells
what was decided and why; :func:`~cpuddp.train.strategies.base.unwrap` returns the user's module.

:func:`prepare` reads its keyword arguments once, into a frozen
:class:`~cpuddp.train.strategies.options.PrepareOptions` (the one place they are checked), and hands that
down whole.  The steps are small functions in this module, called in order by :func:`prepare` (each
testable alone); the parts with their own subject live beside it: :mod:`cpuddp.train.precision.bf16`
(bf16 probe, precision decision, autocast hooks), :mod:`cpuddp.train.precision.optim` (fused-Adam
decision, ``ipex.optimize``), :mod:`cpuddp.train.common.comm` (``comm_hook``, the bf16 hook) and
:mod:`cpuddp.train.strategies` (the ``shard=`` mode's strategy: its checks, the DDP wrap or FSDP2,
the gradient hook; ``no_sync``, clipping and the checkpoints ask the model's strategy later).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import PrepareError, warn
from cpuddp.ranks import get_rank, require_group

from .common.comm import bf16_allreduce_hook, bf16_allreduce_supported
from .precision.bf16 import cpu_bf16_support, decide_precision
from .precision.optim import fuse_optimizer, ipex_optimize
from .precision.precision_trial import add_precision_hooks
from .strategies.base import Strategy, unwrap
from .strategies.modes import strategy_for, strategy_of
from .strategies.options import Precision, PrepareOptions, Shard, ShardScope

__all__ = [
    "prepare",
    "PrepareInfo",
    "prepared_info",
    "cpu_bf16_support",
    "decide_precision",
    "bf16_allreduce_supported",
    "bf16_allreduce_hook",
]

_log = logging.getLogger("cpuddp.prepare")

_RECORD_ATTR = "_cpuddp_prepared"


@dataclass(frozen=True)
class PrepareInfo:
    """What :func:`prepare` decided for one model, and why."""

    path: str  # "ipex" or "stock"
    mixed_precision: Optional[str]  # "bf16" when the forward runs under bf16 autocast
    requested_precision: Optional[str]
    precision_reason: str
    fused_optimizer: bool
    ddp: bool
    world_size: int
    comm_hook: Optional[str]
    compiled: bool
    ipex_version: Optional[str] = None
    shard: Optional[str] = None  # "optimizer" or "full" when the model is sharded
    #: The optimizer step (1: this process's first) from which the optimizer state is sharded; None
    #: while it is not (shard=None, or shard="optimizer" before DDP's buckets settle: see ``notes``).
    sharded_since_step: Optional[int] = None
    notes: tuple[str, ...] = ()
    options: Optional[PrepareOptions] = field(default=None, compare=False, repr=False)  # the arguments as given

    @property
    def optimizer_sharded(self) -> bool:
        """Is the optimizer state sharded now (each rank holding its share only)?"""
        return self.sharded_since_step is not None

    def as_dict(self) -> dict[str, Any]:
        """Plain data for logs and JSON (without ``options``, which may hold process groups)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        out["notes"] = list(self.notes)
        return out


class _Record:
    """Kept on the prepared module(s): the info, the outermost wrapper, the optimizer."""

    def __init__(self, info: PrepareInfo, outer: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        self.info = info
        self.outer = weakref.ref(outer)
        self.optimizer = weakref.ref(optimizer) if optimizer is not None else None

    def __deepcopy__(self, memo: dict) -> "_Record":
        # A deep copy of a prepared model is a plain model again: drop the record.
        return None  # type: ignore[return-value]

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


# --------------------------------------------------------------------------- info


def _record(model: nn.Module) -> Optional[_Record]:
    rec = model.__dict__.get(_RECORD_ATTR)
    if rec is None:
        rec = unwrap(model).__dict__.get(_RECORD_ATTR)
    return rec if isinstance(rec, _Record) else None


def prepared_info(model: nn.Module) -> Optional[PrepareInfo]:
    """The :class:`PrepareInfo` of a model returned by :func:`prepare` (or its inner module), else None."""
    rec = _record(model)
    if rec is None:
        return None
    return strategy_of(model).live_info(rec.info, unwrap(model))  # shard="optimizer": sharded since when


# --------------------------------------------------------------------------- the steps
# Each step is called once by prepare(), directly or through one helper (_prepared_again,
# _optimize, _precision_hooks); a warning names the user's line (cpuddp.errors.warn).


def _already_prepared(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], options: PrepareOptions
) -> Optional[nn.Module]:
    """Idempotency: the prepared model when ``model`` was prepared with the same arguments,
    None when it was never prepared; :class:`PrepareError` for other arguments/optimizer."""
    rec = _record(model)
    if rec is None:
        return None
    prev_opt = rec.optimizer() if rec.optimizer is not None else None
    if (optimizer is not None and optimizer is not prev_opt) or rec.info.options != options:
        raise PrepareError(
            "this model was already prepared with other arguments (or another optimizer); "
            "cpuddp never optimizes or wraps a model twice.",
            fix="call cpuddp.prepare() once per model; use cpuddp.unwrap(model) to get the bare module",
        )
    _log.info("model already prepared; returning it unchanged")
    return rec.outer() or model


def _check_bare_cpu_module(model: nn.Module) -> None:
    """Not wrapped yet (prepare wraps itself) and every parameter on the CPU."""
    if unwrap(model) is not model:
        raise PrepareError(
            f"the model is already wrapped ({type(model).__name__}); prepare() would wrap it twice.",
            fix="pass the bare module; prepare() adds DDP (and torch.compile with compile=True) itself",
        )
    for name, p in model.named_parameters():
        if p.device.type != "cpu":
            raise PrepareError(
                f"parameter {name!r} is on {p.device}; cpuddp trains on the CPU.",
                fix="call model.to('cpu') before prepare()",
            )


def _world_size(group: Any) -> int:
    """The group's size; 1 without a process group, unless the launcher says there are more ranks
    (then the user forgot ``init_distributed()``: an error, never a model trained alone)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    if group is None:
        require_group("cpuddp.prepare()")
    return 1


def _choose_path(ipex: Optional[bool], notes: list[str], strategy: Optional[Strategy] = None) -> Optional[Any]:
    """The IPEX probe when the IPEX path is taken, else None (the stock path; always when ``strategy`` shards)."""
    if ipex is False:
        return None
    from .precision import ipex as _ipex

    probe = _ipex.probe()
    if ipex is True and not probe.usable:
        raise PrepareError(
            f"ipex=True, but IPEX cannot be used: {probe.reason}.",
            fix="pip install intel-extension-for-pytorch matching torch's major.minor, or pass ipex=None",
        )
    if not probe.usable and probe.ipex_version is not None:
        notes.append(f"IPEX not used: {probe.reason}")
    if probe.usable and strategy is not None and strategy.shards:
        notes.append(f"IPEX not used: shard={strategy.name!r} steps torch's own optimizer")
        return None
    return probe if probe.usable else None


def _strategy(shard: Optional[Shard], world: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
              notes: list[str]) -> Strategy:
    """The strategy in effect (``shard=``'s; DDP's at world size 1, with one log line), the model
    and optimizer checked for it."""
    strategy = strategy_for(shard).in_world(world, notes)
    strategy.check_objects(model, optimizer)
    return strategy


def _choose_precision(mixed_precision: Optional[str], strict: bool) -> tuple[Optional[torch.dtype], str]:
    """The autocast dtype and why; warns when bf16 was asked for but fp32 it is."""
    cpu_bf16, cpu_reason = cpu_bf16_support() if mixed_precision in ("bf16", "auto") else (False, "")
    dtype, reason = decide_precision(mixed_precision, strict=strict, cpu_bf16=cpu_bf16, reason=cpu_reason)
    if mixed_precision == "bf16" and dtype is None and get_rank() == 0:  # once per job, not per rank
        warn(f"cpuddp.prepare: {reason}")
    _log.info("precision: %s", reason)
    return dtype, reason


def decide_ddp(ddp: Optional[bool], *, world_size: int, wants_grad: bool) -> bool:
    """Pure: wrap in DDP?  ``ddp=None``: when the world is above 1 and a parameter requires
    grad; ``ddp=True`` without a parameter requiring grad is a :class:`PrepareError`."""
    do_ddp = (world_size > 1 and wants_grad) if ddp is None else bool(ddp)
    if do_ddp and not wants_grad:
        raise PrepareError("ddp=True, but no parameter requires grad.", fix="pass ddp=None for evaluation-only models")
    return do_ddp


def _ipex_weight_dtype(ipex_mod: Any, dtype: Optional[torch.dtype], all_reduces: bool, group: Any,
                       notes: list[str]) -> Optional[torch.dtype]:
    """bf16 weights for ``ipex.optimize`` when bf16 is on, IPEX has them and (with DDP across
    several ranks) the backend all-reduces bf16; else fp32 weights under bf16 autocast."""
    if dtype is None:
        return None
    from .precision import ipex as _ipex

    ok, why = _ipex.bf16_weights(ipex_mod)
    if ok and all_reduces:
        # IPEX's bf16 keeps bf16 weights (fp32 master copies in the optimizer), so DDP
        # all-reduces bf16 gradients: the backend must support that.
        ok, why = bf16_allreduce_supported(group)
    if not ok:
        notes.append(f"IPEX bf16 weights not used ({why}); fp32 weights under bf16 autocast")
        return None
    return dtype


def _optimize_with_ipex(probe: Any, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                        dtype: Optional[torch.dtype], all_reduces: bool, group: Any, notes: list[str]) -> nn.Module:
    from .precision import ipex as _ipex

    ipex_mod = _ipex.load()
    weight_dtype = _ipex_weight_dtype(ipex_mod, dtype, all_reduces, group, notes)
    model = ipex_optimize(ipex_mod, model, optimizer, weight_dtype, notes)
    _log.info("IPEX %s: ipex.optimize(dtype=%s) applied", probe.ipex_version, weight_dtype)
    return model


def _fuse_step(optimizer: Optional[torch.optim.Optimizer], fused_optimizer: bool, strategy: Strategy,
               notes: list[str]) -> bool:
    """The stock path: the fused-Adam switch, when there is an optimizer and it is wanted (not when
    the strategy says why not: shard="optimizer", :data:`cpuddp.train.sharding.zero.UNFUSED_WHY`)."""
    if optimizer is None or not fused_optimizer:
        return False
    if strategy.unfused_why is not None:
        notes.append(f"optimizer: left unfused with shard={strategy.name!r}: {strategy.unfused_why}")
        return False
    fused, why = fuse_optimizer(optimizer)
    notes.append(f"optimizer: {why}")
    _log.info("optimizer: %s", why)
    return fused


def _optimize(probe: Any, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], dtype: Optional[torch.dtype],
              options: PrepareOptions, all_reduces: bool, strategy: Strategy,
              notes: list[str]) -> tuple[nn.Module, bool]:
    """The IPEX path when ``probe`` says so, else the stock one: ``(model, fused optimizer?)``."""
    if probe is None:
        return model, _fuse_step(optimizer, options.fused_optimizer, strategy, notes)
    ipex_dtype = dtype if options.mixed_precision == "bf16" else None  # "auto" measures fp32 too: fp32 weights
    model = _optimize_with_ipex(probe, model, optimizer, ipex_dtype, all_reduces, options.process_group, notes)
    return model, False


def _precision_hooks(outer: nn.Module, core: nn.Module, dtype: Optional[torch.dtype], reason: str, measure: bool,
                     options: PrepareOptions) -> tuple[Optional[str], str]:
    """The forward under autocast when bf16 is on (the trial first, when ``measure``): the
    precision in force and why."""
    if dtype is None:
        return None, reason
    # "auto" and "bf16" measure both precisions first (precision_trial.py)
    precision, why = add_precision_hooks(outer, dtype, options.output_fp32, requested=options.mixed_precision,
                                         group=options.process_group, measure=measure,
                                         on_decide=lambda bf16, decided: _decided(core, bf16, decided))
    return precision, why or reason


def _remember(info: PrepareInfo, strategy: Strategy, core: nn.Module, outer: nn.Module,
              optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Put the record on the user's module and on the outermost wrapper (for idempotency), and the
    strategy on the user's module (for everything that gets the model later)."""
    strategy.attach(core)
    record = _Record(info, outer, optimizer)
    for m in {id(core): core, id(outer): outer}.values():
        m.__dict__[_RECORD_ATTR] = record
    _log.info("prepared: %s", info.as_dict())


def _decided(core: nn.Module, bf16: bool, reason: str) -> None:
    """The precision trial's outcome, into the record :func:`prepared_info` reads."""
    rec = _record(core)
    if rec is not None:
        rec.info = dataclasses.replace(rec.info, mixed_precision="bf16" if bf16 else None, precision_reason=reason)


def compile_model(module: nn.Module, compile: Union[bool, Mapping[str, Any]]) -> tuple[nn.Module, bool]:
    """``module`` through ``torch.compile`` (``compile`` a dict: its keyword arguments) when
    ``compile`` is set; whether it was."""
    if not compile:
        return module, False
    ckw = dict(compile) if isinstance(compile, Mapping) else {}
    return torch.compile(module, **ckw), True  # type: ignore[return-value]


def _check_module(model: Any) -> None:
    """The first check: prepare takes a module (before its arguments are checked)."""
    if not isinstance(model, nn.Module):
        raise PrepareError(f"prepare() needs a torch.nn.Module. Got {type(model).__name__} instead.")


def _prepared_again(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    options: PrepareOptions) -> Optional[nn.Module]:
    """The checks before any step: the prepared model when ``model`` was prepared with these
    arguments (None when it was not); :class:`PrepareError` for a model prepare cannot take."""
    again = _already_prepared(model, optimizer, options)
    if again is not None:
        return again
    _check_bare_cpu_module(model)
    return None


def _info(options: PrepareOptions, probe: Any, world: int, strategy: Strategy, ddp: bool, *,
          precision: Optional[str], precision_reason: str, fused: bool, hook_name: Optional[str], compiled: bool,
          notes: list[str]) -> PrepareInfo:
    """What prepare decided, for :func:`prepared_info` (``strategy``: the mode in effect)."""
    return PrepareInfo(
        path="ipex" if probe is not None else "stock",
        mixed_precision=precision,
        requested_precision=options.mixed_precision,
        precision_reason=precision_reason,
        fused_optimizer=fused,
        ddp=ddp and strategy.wraps_in_ddp,
        world_size=world,
        comm_hook=hook_name,
        compiled=compiled,
        ipex_version=probe.ipex_version if probe is not None else None,
        shard=strategy.name,
        sharded_since_step=strategy.sharded_from_step,  # shard="optimizer": the live value, prepared_info
        notes=tuple(notes),
        options=options,
    )


# --------------------------------------------------------------------------- prepare


def prepare(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    mixed_precision: Optional[Precision] = None,
    strict: bool = False,
    ipex: Optional[bool] = None,
    fused_optimizer: bool = True,
    compile: Union[bool, Mapping[str, Any]] = False,
    ddp: Optional[bool] = None,
    shard: Optional[Shard] = None,
    shard_blocks: Any = None,
    shard_scope: Optional[ShardScope] = None,
    bucket_cap_mb: Optional[float] = None,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    broadcast_buffers: Optional[bool] = None,
    comm_hook: Union[None, str, Callable[..., Any], tuple] = None,
    output_fp32: bool = True,
    process_group: Optional[Any] = None,
    ddp_kwargs: Optional[Mapping[str, Any]] = None,
) -> nn.Module:
    """Optimize ``model`` (and ``optimizer``, in place) for the CPU and wrap it in DDP (or shard it).

    Returns the module to train.  ``optimizer`` may be omitted (inference, evaluation).
    ``mixed_precision``: None/"fp32", "bf16", or "auto" (the faster, timed on the first steps:
    :mod:`cpuddp.train.precision.precision_trial`).  ``strict``: raise
    :class:`PrepareError` instead of warning when bf16 (or a bf16 comm hook) cannot be had.
    ``ipex``: None uses IPEX when a matching one is installed, True requires it, False
    never uses it.  ``ddp``: None wraps when the world size is above 1 and a parameter
    requires grad.  ``shard``: None (DDP), "optimizer" (gradients and optimizer state
    sharded) or "full" (FSDP2; ``shard_blocks`` names the blocks, ``shard_scope`` "node"
    or "world"): each mode a strategy (:mod:`cpuddp.train.strategies`).  See the module docstring for the rest.
    """
    _check_module(model)
    options = PrepareOptions(  # the one place the arguments are read and checked; passed down whole
        mixed_precision=mixed_precision, strict=strict, ipex=ipex, fused_optimizer=fused_optimizer, compile=compile,
        ddp=ddp, shard=shard, shard_blocks=shard_blocks, shard_scope=shard_scope, bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph, find_unused_parameters=find_unused_parameters, broadcast_buffers=broadcast_buffers,
        comm_hook=comm_hook, output_fp32=output_fp32, process_group=process_group, ddp_kwargs=ddp_kwargs,
    )
    if (again := _prepared_again(model, optimizer, options)) is not None:
        return again

    notes: list[str] = []
    world = _world_size(options.process_group)
    strategy = _strategy(options.shard, world, model, optimizer, notes)  # the mode in effect: DDP's at world size 1
    probe = _choose_path(options.ipex, notes, strategy)
    dtype, precision_reason = _choose_precision(options.mixed_precision, options.strict)  # may warn: called from here
    do_ddp = decide_ddp(options.ddp, world_size=world, wants_grad=any(p.requires_grad for p in model.parameters()))
    core, fused = _optimize(probe, model, optimizer, dtype, options, do_ddp and world > 1, strategy, notes)
    bf16_params = strategy.bf16_parameters(dtype, options)
    outer, hook_name = strategy.wrap(core, optimizer, do_ddp, bf16_params, options, notes)
    outer, compiled = compile_model(outer, options.compile)
    measure = (probe is None or options.mixed_precision == "auto") and not bf16_params
    precision, precision_reason = _precision_hooks(outer, core, dtype, precision_reason, measure, options)
    info = _info(options, probe, world, strategy, do_ddp, precision=precision, precision_reason=precision_reason,
                 fused=fused, hook_name=hook_name, compiled=compiled, notes=notes)
    _remember(info, strategy, core, outer, optimizer)
    return outer
