"""This rank's random state, as a training checkpoint keeps it: Python's, torch's and numpy's.

:func:`capture` returns plain data that ``torch.load(..., weights_only=True)`` reads back
(tuples, ints, tensors); :func:`restore` puts it back.  numpy's global state is kept when
numpy is already imported (a script that uses it has imported it), and never imports numpy
itself.  A DataLoader worker seeds itself from torch's state when its pass starts, so
restoring torch's state also repeats the workers' seeds of the passes that follow.
"""

from __future__ import annotations

import io
import random
import sys
from typing import Any, Mapping

import torch

__all__ = ["capture", "restore", "to_bytes", "from_bytes"]


def capture() -> dict[str, Any]:
    """This process's random state: ``python``, ``torch`` and, when numpy is loaded, ``numpy``."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.tensor(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def restore(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture` returned (numpy's part only when numpy is loaded)."""
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    np = sys.modules.get("numpy")
    if np is not None and state.get("numpy") is not None:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_tuple(value: Any) -> Any:
    """``random.setstate`` needs tuples; a checkpoint may hold lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def to_bytes(state: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
