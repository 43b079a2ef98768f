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
4. ``compile=True`` (or a dict of ``torch.compile`` keyword arguments) compiles the result.
5. With bf16 active, the returned module's forward runs under
   ``torch.autocast("cpu", dtype=torch.bfloat16)`` (a forward pre-hook and an
   ``always_call`` forward hook), and floating outputs come back as fp32
   (``output_fp32=True``) so a loss computed outside the model is computed in fp32.

Calling prepare again on a prepared model (or on the module inside it) with the same
arguments returns the prepared model unchanged; with different arguments it raises
:class:`~cpuddp.errors.PrepareError`.  It never wraps twice.  :func:`prepared_info` tells
what was decided and why; :func:`unwrap` returns the user's module.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .errors import PrepareError

__all__ = [
    "prepare",
    "PrepareInfo",
    "prepared_info",
    "unwrap",
    "cpu_bf16_support",
    "decide_precision",
    "bf16_allreduce_supported",
    "bf16_allreduce_hook",
]

_log = logging.getLogger("cpuddp.prepare")

_PRECISIONS: dict[Optional[str], Optional[torch.dtype]] = {
    None: None,
    "no": None,
    "fp32": None,
    "bf16": torch.bfloat16,
}
_COMM_HOOKS = (None, "fp16", "bf16")
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
    notes: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

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


# --------------------------------------------------------------------------- unwrap / info


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


def _record(model: nn.Module) -> Optional[_Record]:
    rec = model.__dict__.get(_RECORD_ATTR)
    if rec is None:
        rec = unwrap(model).__dict__.get(_RECORD_ATTR)
    return rec if isinstance(rec, _Record) else None


def prepared_info(model: nn.Module) -> Optional[PrepareInfo]:
    """The :class:`PrepareInfo` of a model returned by :func:`prepare` (or its inner module), else None."""
    rec = _record(model)
    return rec.info if rec is not None else None


# --------------------------------------------------------------------------- precision


def cpu_bf16_support() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (AMX tiles or AVX512-BF16), and how we know."""
    flags: dict[str, Optional[bool]] = {}
    cpu = getattr(torch, "cpu", None)
    for name, probe in (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        fn = getattr(cpu, probe, None)
        if fn is not None:
            try:
                flags[name] = bool(fn())
            except Exception:  # pragma: no cover - a probe that cannot run says nothing
                flags[name] = None
    if flags and any(v is not None for v in flags.values()):
        source = "torch.cpu probes"
    else:
        flags = _cpuinfo_flags()
        source = "/proc/cpuinfo"
    return _bf16_from_flags(flags, source)


def _cpuinfo_flags() -> dict[str, Optional[bool]]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    words = set(line.split(":", 1)[1].split())
                    return {"amx": "amx_bf16" in words, "avx512_bf16": "avx512_bf16" in words}
    except OSError:
        pass
    return {"amx": None, "avx512_bf16": None}


def _bf16_from_flags(flags: Mapping[str, Optional[bool]], source: str) -> tuple[bool, str]:
    have = [name for name in ("amx", "avx512_bf16") if flags.get(name)]
    if have:
        return True, f"CPU has {' and '.join(have)} ({source})"
    if all(flags.get(n) is None for n in ("amx", "avx512_bf16")):
        return False, f"could not tell whether the CPU has AMX or AVX512-BF16 ({source})"
    return False, f"CPU has neither AMX nor AVX512-BF16 ({source}); bf16 would be emulated and slower than fp32"


def decide_precision(
    mixed_precision: Optional[str], *, strict: bool, cpu_bf16: bool, reason: str
) -> tuple[Optional[torch.dtype], str]:
    """Pure decision: the autocast dtype (or None for fp32) and a sentence saying why.

    ``mixed_precision="bf16"`` on a CPU without native bf16 falls back to fp32 with a
    warning, or raises :class:`PrepareError` when ``strict`` is true.
    """
    if mixed_precision not in _PRECISIONS:
        raise PrepareError(
            f"mixed_precision must be one of {sorted(k for k in _PRECISIONS if k)} or None. "
            f"Got {mixed_precision!r} instead.",
            fix='pass mixed_precision=None (fp32) or mixed_precision="bf16"',
        )
    dtype = _PRECISIONS[mixed_precision]
    if dtype is None:
        return None, "fp32 requested"
    if cpu_bf16:
        return dtype, f"bf16 requested; {reason}"
    if strict:
        raise PrepareError(
            f'mixed_precision="bf16" with strict=True, but {reason}.',
            fix='run on a CPU with AMX or AVX512-BF16, or pass strict=False to fall back to fp32',
        )
    return None, f"bf16 requested but {reason}: staying in fp32"


# --------------------------------------------------------------------------- autocast hooks


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.bfloat16, torch.float16) else obj
    if isinstance(obj, MutableMapping):
        for k in list(obj.keys()):
            obj[k] = _to_fp32(obj[k])
        return obj
    if isinstance(obj, tuple):
        items = [_to_fp32(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_to_fp32(x) for x in obj]
    return obj


class _AutocastHooks:
    """Forward pre-hook + always-called forward hook running forward under CPU autocast."""

    def __init__(self, dtype: torch.dtype, output_fp32: bool) -> None:
        self.dtype = dtype
        self.output_fp32 = output_fp32
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def pre(self, module: nn.Module, args: Any) -> None:
        ctx = torch.autocast("cpu", dtype=self.dtype)
        ctx.__enter__()
        self._stack().append(ctx)

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        stack = self._stack()
        if stack:
            stack.pop().__exit__(None, None, None)
        if self.output_fp32 and output is not None:
            return _to_fp32(output)
        return None

    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "output_fp32": self.output_fp32}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["dtype"], state["output_fp32"])


def _add_autocast(module: nn.Module, dtype: torch.dtype, output_fp32: bool) -> None:
    hooks = _AutocastHooks(dtype, output_fp32)
    module.register_forward_pre_hook(hooks.pre)
    module.register_forward_hook(hooks.post, always_call=True)


# --------------------------------------------------------------------------- optimizer


def _fuse_optimizer(optimizer: torch.optim.Optimizer) -> tuple[bool, str]:
    """Switch a stock Adam/AdamW to the fused CPU kernel in place, when safe."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False, f"{type(optimizer).__name__} has no fused CPU kernel we switch to"
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        if "cpu" not in _get_fused_kernels_supported_devices():
            return False, f"torch {torch.__version__} has no fused CPU Adam"
    except ImportError:
        return False, f"torch {torch.__version__} has no fused CPU Adam"
    if optimizer.state:
        return False, "the optimizer has already stepped; left as it is"
    for group in optimizer.param_groups:
        if "fused" not in group:
            return False, "this torch's Adam has no 'fused' option"
        if group["fused"] is not None:
            return False, f"fused={group['fused']} set by the user; respected"
        if group.get("foreach") is not None or group.get("capturable") or group.get("differentiable"):
            return False, "foreach/capturable/differentiable set by the user; left unfused"
        for p in group["params"]:
            if p.device.type != "cpu" or not torch.is_floating_point(p) or p.is_sparse:
                return False, f"a parameter is {p.dtype} on {p.device}; the fused kernel needs real floating CPU tensors"
    for group in optimizer.param_groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # as Adam.__init__ does for fused=True
    return True, "switched to the fused CPU kernel"


# --------------------------------------------------------------------------- IPEX


def _adopt_optimizer(user: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Make the user's optimizer object behave as ``new`` (IPEX built a copy).

    Both then share the same param_groups, state and (patched) step.
    """
    if type(new) is not type(user):
        user.__class__ = type(new)
    user.__dict__ = new.__dict__


def _ipex_optimize(
    ipex: Any,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    dtype: Optional[torch.dtype],
    notes: list[str],
) -> nn.Module:
    if optimizer is None and model.training:
        model.eval()
        notes.append("IPEX without an optimizer optimizes for inference: model.eval() was called")
    kwargs: dict[str, Any] = {"dtype": dtype if dtype is not None else torch.float32, "inplace": True}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    result = ipex.optimize(model, **kwargs)
    if optimizer is not None:
        new_model, new_opt = result
        if new_opt is not optimizer:
            _adopt_optimizer(optimizer, new_opt)
            notes.append("IPEX returned a new optimizer; the user's object now shares its state and step")
    else:
        new_model = result
    return new_model


# --------------------------------------------------------------------------- DDP, comm hooks


def bf16_allreduce_supported(group: Optional[Any] = None) -> tuple[bool, str]:
    """Collective probe: does the backend all-reduce bf16 correctly?  Every rank must call it."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    ok, why = True, "bf16 all_reduce returned the right sum"
    t = torch.full((8,), float(rank + 1), dtype=torch.bfloat16)
    try:
        dist.all_reduce(t, group=group)
        expected = world * (world + 1) / 2
        if not torch.all(t.float() == expected):
            ok, why = False, f"bf16 all_reduce returned {t.float().tolist()[:2]}, expected {expected}"
    except RuntimeError as exc:  # gloo: "Invalid scalar type" (pytorch issue 111131)
        ok, why = False, f"bf16 all_reduce failed: {str(exc).splitlines()[0]}"
    # Agree across ranks, so that no rank registers a hook the others do not.
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if ok and not flag.item():
        ok, why = False, "bf16 all_reduce failed on another rank"
    return ok, f"{why} (backend {dist.get_backend(group)})"


def bf16_allreduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: all-reduce gradients in bf16, then copy back into the fp32 bucket.

    The same algorithm as torch's ``bf16_compress_hook``, under a name torch does not refuse
    on CPU (torch checks the hook's ``__name__`` against CUDA/NCCL).  No annotations: DDP
    compares them with ``dist.GradBucket`` and would reject this module's string
    annotations (``from __future__ import annotations``).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: "torch.futures.Future") -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(f.value()[0])
        return out

    return fut.then(decompress)


def _check_comm_hook(comm_hook: Any) -> None:
    if comm_hook in _COMM_HOOKS or callable(comm_hook):
        return
    if isinstance(comm_hook, tuple) and len(comm_hook) == 2 and callable(comm_hook[1]):
        return
    raise PrepareError(
        f"comm_hook must be None, 'fp16', 'bf16', a hook or a (state, hook) pair. Got {comm_hook!r} instead.",
        fix="pass comm_hook='fp16' for fp16 gradient compression",
    )


def _register_hook(ddp: nn.Module, comm_hook: Any, group: Any, strict: bool, notes: list[str]) -> Optional[str]:
    if comm_hook is None:
        return None
    if comm_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return "fp16"
    if comm_hook == "bf16":
        ok, why = bf16_allreduce_supported(group)
        if not ok:
            if strict:
                raise PrepareError(f'comm_hook="bf16" requested, but {why}.', fix='use comm_hook="fp16" or None')
            msg = f'comm_hook="bf16" requested, but {why}: gradients are all-reduced in fp32'
            warnings.warn(msg, stacklevel=3)
            notes.append(msg)
            return None
        ddp.register_comm_hook(group, bf16_allreduce_hook)
        return "bf16"
    if isinstance(comm_hook, tuple) and len(comm_hook) == 2 and callable(comm_hook[1]):
        state, hook = comm_hook
        ddp.register_comm_hook(state, hook)
        return getattr(hook, "__name__", "custom")
    _check_comm_hook(comm_hook)
    ddp.register_comm_hook(group, comm_hook)
    return getattr(comm_hook, "__name__", "custom")


def _world_size(group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


# --------------------------------------------------------------------------- prepare


def prepare(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    mixed_precision: Optional[str] = None,
    strict: bool = False,
    ipex: Optional[bool] = None,
    fused_optimizer: bool = True,
    compile: Union[bool, Mapping[str, Any]] = False,
    ddp: Optional[bool] = None,
    bucket_cap_mb: Optional[float] = None,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    broadcast_buffers: Optional[bool] = None,
    comm_hook: Union[None, str, Callable[..., Any], tuple] = None,
    output_fp32: bool = True,
    process_group: Optional[Any] = None,
    ddp_kwargs: Optional[Mapping[str, Any]] = None,
) -> nn.Module:
    """Optimize ``model`` (and ``optimizer``, in place) for the CPU and wrap it in DDP.

    Returns the module to train.  ``optimizer`` may be omitted (inference, evaluation).
    ``mixed_precision``: None/"fp32" or "bf16".  ``strict``: raise
    :class:`PrepareError` instead of warning when bf16 (or a bf16 comm hook) cannot be had.
    ``ipex``: None uses IPEX when a matching one is installed, True requires it, False
    never uses it.  ``ddp``: None wraps when the world size is above 1 and a parameter
    requires grad.  See the module docstring for the rest.
    """
    options = dict(
        mixed_precision=mixed_precision, strict=strict, ipex=ipex, fused_optimizer=fused_optimizer,
        compile=compile, ddp=ddp, bucket_cap_mb=bucket_cap_mb, static_graph=static_graph,
        find_unused_parameters=find_unused_parameters, broadcast_buffers=broadcast_buffers,
        comm_hook=comm_hook, output_fp32=output_fp32, process_group=process_group,
        ddp_kwargs=dict(ddp_kwargs or {}),
    )
    if not isinstance(model, nn.Module):
        raise PrepareError(f"prepare() needs a torch.nn.Module. Got {type(model).__name__} instead.")

    # -- already prepared: same arguments -> unchanged; different -> error; never wrap twice
    rec = _record(model)
    if rec is not None:
        outer = rec.outer() or model
        prev_opt = rec.optimizer() if rec.optimizer is not None else None
        if (optimizer is not None and optimizer is not prev_opt) or rec.info.options != options:
            raise PrepareError(
                "this model was already prepared with other arguments (or another optimizer); "
                "cpuddp never optimizes or wraps a model twice.",
                fix="call cpuddp.prepare() once per model; use cpuddp.unwrap(model) to get the bare module",
            )
        _log.info("model already prepared; returning it unchanged")
        return outer
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
    _check_comm_hook(comm_hook)

    notes: list[str] = []
    world = _world_size(process_group)

    # -- path
    from . import _ipex

    probe = _ipex.probe() if ipex is not False else None
    if ipex is True and not probe.usable:  # type: ignore[union-attr]
        raise PrepareError(
            f"ipex=True, but IPEX cannot be used: {probe.reason}.",  # type: ignore[union-attr]
            fix="pip install intel-extension-for-pytorch matching torch's major.minor, or pass ipex=None",
        )
    use_ipex = probe is not None and probe.usable
    if probe is not None and not probe.usable and probe.ipex_version is not None:
        notes.append(f"IPEX not used: {probe.reason}")

    # -- precision
    cpu_bf16, cpu_reason = cpu_bf16_support() if mixed_precision == "bf16" else (False, "")
    dtype, precision_reason = decide_precision(mixed_precision, strict=strict, cpu_bf16=cpu_bf16, reason=cpu_reason)
    if mixed_precision == "bf16" and dtype is None:
        warnings.warn(f"cpuddp.prepare: {precision_reason}", stacklevel=2)
    _log.info("precision: %s", precision_reason)

    # -- optimize
    fused = False
    wants_grad = any(p.requires_grad for p in model.parameters())
    do_ddp = (world > 1 and wants_grad) if ddp is None else bool(ddp)
    if do_ddp and not wants_grad:
        raise PrepareError("ddp=True, but no parameter requires grad.", fix="pass ddp=None for evaluation-only models")
    if use_ipex:
        ipex_mod = _ipex.load()
        weight_dtype = dtype
        if dtype is not None:
            ok, why = _ipex.bf16_weights(ipex_mod)
            if not ok:
                weight_dtype = None
                notes.append(f"IPEX bf16 weights not used ({why}); fp32 weights under bf16 autocast")
        if weight_dtype is not None and do_ddp and world > 1:
            # IPEX's bf16 keeps bf16 weights (fp32 master copies in the optimizer), so DDP
            # all-reduces bf16 gradients: the backend must support that.
            ok, why = bf16_allreduce_supported(process_group)
            if not ok:
                weight_dtype = None
                notes.append(f"IPEX bf16 weights not used ({why}); fp32 weights under bf16 autocast")
        model = _ipex_optimize(ipex_mod, model, optimizer, weight_dtype, notes)
        _log.info("IPEX %s: ipex.optimize(dtype=%s) applied", probe.ipex_version, weight_dtype)  # type: ignore[union-attr]
    elif optimizer is not None and fused_optimizer:
        fused, why = _fuse_optimizer(optimizer)
        notes.append(f"optimizer: {why}")
        _log.info("optimizer: %s", why)
    core = model

    # -- DDP
    hook_name: Optional[str] = None
    outer: nn.Module = core
    if do_ddp:
        if not (dist.is_available() and dist.is_initialized()):
            raise PrepareError(
                "ddp=True, but torch.distributed is not initialized.",
                fix="call cpuddp.init_distributed() before cpuddp.prepare()",
            )
        from torch.nn.parallel import DistributedDataParallel

        kw: dict[str, Any] = dict(
            device_ids=None,
            gradient_as_bucket_view=True,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            process_group=process_group,
        )
        if broadcast_buffers is not None:  # deprecated in torch 2.13; pass only when chosen
            kw["broadcast_buffers"] = broadcast_buffers
        if bucket_cap_mb is not None:
            kw["bucket_cap_mb"] = bucket_cap_mb
        kw.update(ddp_kwargs or {})
        outer = DistributedDataParallel(core, **kw)
        hook_name = _register_hook(outer, comm_hook, process_group, strict, notes)
    elif comm_hook is not None:
        notes.append("comm_hook ignored: no DDP wrap at world size 1")

    # -- compile
    compiled = False
    if compile:
        ckw = dict(compile) if isinstance(compile, Mapping) else {}
        outer = torch.compile(outer, **ckw)  # type: ignore[assignment]
        compiled = True

    # -- autocast
    if dtype is not None:
        _add_autocast(outer, dtype, output_fp32)

    info = PrepareInfo(
        path="ipex" if use_ipex else "stock",
        mixed_precision="bf16" if dtype is not None else None,
        requested_precision=mixed_precision,
        precision_reason=precision_reason,
        fused_optimizer=fused,
        ddp=do_ddp,
        world_size=world,
        comm_hook=hook_name,
        compiled=compiled,
        ipex_version=probe.ipex_version if use_ipex else None,  # type: ignore[union-attr]
        notes=tuple(notes),
        options=options,
    )
    record = _Record(info, outer, optimizer)
    for m in {id(core): core, id(outer): outer}.values():
        m.__dict__[_RECORD_ATTR] = record
    _log.info("prepared: %s", info.as_dict())
    return outer
