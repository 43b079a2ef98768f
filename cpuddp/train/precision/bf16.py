"""Precision for :func:`cpuddp.prepare`: does this CPU compute bf16 natively, the (pure)
precision decision, and the hooks that run a module's forward under bf16 autocast.

The CPU is probed through ``torch.cpu._is_amx_tile_supported()`` /
``torch.cpu._is_avx512_bf16_supported()``; when torch lacks both, the instruction-set flags
come from :func:`cpuddp.topology.read_topology` (``/proc/cpuinfo``) and are named by
:func:`cpuddp.topology.cpu_features`, the one place that spells them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

import torch
from torch import nn

from cpuddp.errors import PrepareError

__all__ = ["cpu_bf16_support", "check_mixed_precision", "decide_precision", "add_autocast", "PRECISIONS"]

#: ``mixed_precision`` value -> the autocast dtype (None: fp32).
PRECISIONS: dict[Optional[str], Optional[torch.dtype]] = {
    None: None,
    "no": None,
    "fp32": None,
    "bf16": torch.bfloat16,
    "auto": torch.bfloat16,  # a candidate: the trial (precision_trial.py) keeps it or fp32
}

_BF16_FEATURES = ("amx", "avx512_bf16")


def cpu_bf16_support() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (AMX tiles or AVX512-BF16), and how we know."""
    flags = _torch_probes()
    if any(v is not None for v in flags.values()):
        return bf16_from_flags(flags, "torch.cpu probes")
    return bf16_from_flags(_cpuinfo_flags(), "/proc/cpuinfo")


def _torch_probes() -> dict[str, Optional[bool]]:
    """``torch.cpu``'s own probes (None for a probe that exists but cannot run)."""
    flags: dict[str, Optional[bool]] = {}
    cpu = getattr(torch, "cpu", None)
    for name, probe in (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        fn = getattr(cpu, probe, None)
        if fn is not None:
            try:
                flags[name] = bool(fn())
            except Exception:  # pragma: no cover - a probe that cannot run says nothing
                flags[name] = None
    return flags


def _cpuinfo_flags() -> dict[str, Optional[bool]]:
    """The same two answers from the CPU's flag list (None each when it cannot be read)."""
    from cpuddp.topology.model import cpu_features
    from cpuddp.topology.read import read_topology

    try:
        flags = read_topology().flags
    except (OSError, ValueError):
        flags = frozenset()
    if not flags:
        return {name: None for name in _BF16_FEATURES}
    return features_to_bf16_flags(cpu_features(flags))


def features_to_bf16_flags(features: Mapping[str, bool]) -> dict[str, Optional[bool]]:
    """:func:`cpuddp.topology.cpu_features` keys -> the two flags :func:`bf16_from_flags` reads."""
    return {"amx": bool(features.get("amx_bf16")), "avx512_bf16": bool(features.get("avx512_bf16"))}


def bf16_from_flags(flags: Mapping[str, Optional[bool]], source: str) -> tuple[bool, str]:
    """Pure: native bf16 from ``{"amx": ..., "avx512_bf16": ...}`` (True/False/None: unknown)."""
    have = [name for name in _BF16_FEATURES if flags.get(name)]
    if have:
        return True, f"CPU has {' and '.join(have)} ({source})"
    if all(flags.get(n) is None for n in _BF16_FEATURES):
        return False, f"could not tell whether the CPU has AMX or AVX512-BF16 ({source})"
    return False, f"CPU has neither AMX nor AVX512-BF16 ({source}); bf16 would be emulated and slower than fp32"


def check_mixed_precision(mixed_precision: Any) -> None:
    """Raise :class:`PrepareError` unless ``mixed_precision`` names a precision of :data:`PRECISIONS`."""
    if mixed_precision not in PRECISIONS:
        raise PrepareError(
            f"mixed_precision must be one of {sorted(k for k in PRECISIONS if k)} or None. "
            f"Got {mixed_precision!r} instead.",
            fix='pass mixed_precision="auto" (the faster of the two, measured), None (fp32) or "bf16"',
        )


def decide_precision(
    mixed_precision: Optional[str], *, strict: bool, cpu_bf16: bool, reason: str
) -> tuple[Optional[torch.dtype], str]:
    """Pure decision: the autocast dtype (or None for fp32) and a sentence saying why.

    ``mixed_precision="bf16"`` on a CPU without native bf16 falls back to fp32 with a
    warning, or raises :class:`PrepareError` when ``strict`` is true.  ``"auto"`` is bf16 as
    a candidate where the CPU has it (the first steps then measure both:
    :mod:`cpuddp.train.precision.precision_trial`), else fp32 without measuring.
    """
    check_mixed_precision(mixed_precision)
    dtype = PRECISIONS[mixed_precision]
    if dtype is None:
        return None, "fp32 requested"
    if mixed_precision == "auto":
        if cpu_bf16:
            return dtype, f"auto; {reason}"
        return None, f"auto: fp32, not measured: {reason}"
    if cpu_bf16:
        return dtype, f"bf16 requested; {reason}"
    if strict:
        raise PrepareError(
            f'mixed_precision="bf16" with strict=True, but {reason}.',
            fix='run on a CPU with AMX or AVX512-BF16, or pass strict=False to fall back to fp32',
        )
    return None, f"bf16 requested but {reason}: staying in fp32"


# --------------------------------------------------------------------------- autocast hooks


def to_fp32(obj: Any) -> Any:
    """bf16/fp16 tensors -> fp32, also inside dicts (in place), tuples, named tuples and lists."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.bfloat16, torch.float16) else obj
    if isinstance(obj, MutableMapping):
        for k in list(obj.keys()):
            obj[k] = to_fp32(obj[k])
        return obj
    if isinstance(obj, tuple):
        items = [to_fp32(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [to_fp32(x) for x in obj]
    return obj


class AutocastHooks:
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
            return to_fp32(output)
        return None

    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "output_fp32": self.output_fp32}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["dtype"], state["output_fp32"])


def add_autocast(module: nn.Module, dtype: torch.dtype, output_fp32: bool) -> None:
    """Run ``module``'s forward under ``torch.autocast("cpu", dtype)``, left even when it raises."""
    hooks = AutocastHooks(dtype, output_fp32)
    module.register_forward_pre_hook(hooks.pre)
    module.register_forward_hook(hooks.post, always_call=True)
