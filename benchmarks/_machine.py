"""What every benchmark's result names: the machine it ran on.

A VM's CPU often calls itself only ``AMD EPYC`` or ``Intel Xeon Processor``; the family and
model numbers and the vector instructions say which generation it is, and those decide most of
what a benchmark measures (AVX2 or AVX-512 kernels, bf16 in hardware or emulated).
"""

from __future__ import annotations

import os
import platform
from typing import Optional

#: AMD family 25 (0x19): its model ranges per generation (Zen 3: Milan, Vermeer, Rembrandt,
#: Cezanne; Zen 4: Genoa, Raphael, Phoenix, Bergamo).
_AMD_FAMILY_25_ZEN4 = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def zen_generation(vendor: str, family: int, model: int) -> Optional[str]:
    """``"Zen 3"`` etc. for an AMD family and model; None for another vendor or an unknown one."""
    if vendor != "AuthenticAMD":
        return None
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen"
    if family == 0x19:
        return "Zen 4" if any(model in r for r in _AMD_FAMILY_25_ZEN4) else "Zen 3"
    if family == 0x1A:
        return "Zen 5"
    return None


def isa(flags: set[str]) -> str:
    """The vector instructions that matter here, e.g. ``"AVX-512 with AVX512-BF16"`` or ``"AVX2"``."""
    if "avx512f" in flags:
        out = "AVX-512 with AVX512-BF16" if "avx512_bf16" in flags else "AVX-512"
    elif "avx2" in flags:
        out = "AVX2"
    else:
        out = "no AVX2"
    return out + (", AMX" if "amx_tile" in flags else "")


def cpu_model() -> str:
    """The CPU's model name, generation, vector instructions and this machine's CPU count, e.g.
    ``"AMD EPYC (Zen 3, AVX2), 2 vCPUs"``."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or "unknown CPU"
    try:
        gen = zen_generation(info.get("vendor_id", ""), int(info.get("cpu family", "")), int(info.get("model", "")))
    except ValueError:
        gen = None
    detail = ", ".join(x for x in (gen, isa(set(info.get("flags", "").split())) if info else None) if x)
    return f"{name}{f' ({detail})' if detail else ''}, {os.cpu_count()} vCPUs"
