"""torch's object collectives on an install without numpy (README's install: torch and cpuddp).

cpuddp's own collectives send bytes as ``uint8`` tensors (:mod:`cpuddp.train.common.rank0`), never
torch's ``all_gather_object``/``broadcast_object_list``/``gather_object``/``scatter_object_list``:
each rank that *receives* an object turns the tensor back into bytes with ``tensor.numpy()``
(``_tensor_to_object`` in ``torch.distributed.distributed_c10d``), so without numpy it raises
``RuntimeError: Numpy is not available`` -- on the receiving ranks only, and the others wait
in the next collective until the timeout.

``torch.distributed.checkpoint`` (DCP) cannot do without them: its save and load plan through
``gather_object``/``scatter_object_list``/``broadcast_object_list``.  :func:`without_numpy`
gives torch a ``_tensor_to_object`` that copies the bytes through a ``bytearray`` instead,
where numpy is missing (and only there: with numpy, torch is left as it is).  The sharded
paths of :func:`cpuddp.prepare` install it, so a sharded model's checkpoint (DCP) saves and
loads on the bare install.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["numpy_missing", "without_numpy"]

_MARK = "_cpuddp_without_numpy"


def numpy_missing() -> bool:
    """Does ``Tensor.numpy()`` fail here (numpy not installed, or not importable)?"""
    try:
        torch.zeros(1).numpy()
    except (RuntimeError, ImportError):
        return True
    return False


def _tensor_to_object(tensor: torch.Tensor, tensor_size: Any, group: Any = None, weights_only: bool = False) -> Any:
    """torch's ``_tensor_to_object`` (torch 2.8 to 2.14's signature) with the bytes copied into a
    ``bytearray`` through ``torch.frombuffer`` instead of ``tensor.numpy().tobytes()``."""
    import torch.distributed.distributed_c10d as c10d

    n = int(tensor_size)
    buf = bytearray(n)
    if n:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(tensor.detach().cpu().reshape(-1)[:n])
    if weights_only:
        return torch.load(io.BytesIO(buf), weights_only=True)
    return getattr(c10d, "_unpickler", pickle.Unpickler)(io.BytesIO(buf)).load()


setattr(_tensor_to_object, _MARK, True)


def without_numpy() -> bool:
    """Where numpy is missing, make torch's object collectives work without it (once per
    process); whether cpuddp's version is in place."""
    import torch.distributed.distributed_c10d as c10d

    current = getattr(c10d, "_tensor_to_object", None)
    if current is None or getattr(current, _MARK, False):
        return current is not None
    if not numpy_missing():
        return False
    c10d._tensor_to_object = _tensor_to_object  # type: ignore[attr-defined]
    return True
