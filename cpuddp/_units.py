"""Byte sizes for people: ``"64M"`` -> 67108864 and back (pure; no torch).

Units K, M and G (also KB/KiB, ...) are powers of 1024, as in nccl-tests.  Used by
``cpuddp bench`` (``-b``/``-e``), the shared-memory backend's size checks and their messages.
"""

from __future__ import annotations

__all__ = ["parse_size", "format_size"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864.  Units K, M, G (also KB/KiB...) are powers of 1024, as in nccl-tests."""
    s = str(text).strip().upper().replace(" ", "")
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i], s[i:]
    if unit not in _UNITS or not num:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit K, M or G (e.g. 1K, 64M)")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit K, M or G (e.g. 1K, 64M)") from None
    out = int(value * _UNITS[unit])
    if out <= 0 or value * _UNITS[unit] != out:
        raise ValueError(f"size {text!r} must be a positive whole number of bytes")
    return out


def format_size(nbytes: float) -> str:
    """1048576 -> ``"1 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(nbytes)} B"
