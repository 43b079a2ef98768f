"""Gradient helpers that work the same for every ``shard=`` mode of :func:`cpuddp.prepare`.

torch's calls differ between the wrappers: DDP has ``no_sync()``, FSDP2 has
``set_requires_gradient_sync(False)``; ``torch.nn.utils.clip_grad_norm_`` works for DDP and
FSDP2 (its DTensor gradients give the global norm) but not for ``shard="optimizer"``, whose
reduced gradients live in the optimizer's shares, not in the model's ``.grad``.  So::

    for i, batch in enumerate(loader):
        last = (i + 1) % accumulate == 0
        with contextlib.nullcontext() if last else cpuddp.no_sync(model):
            model(**batch)["loss"].backward()
        if last:
            cpuddp.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .sharding.distribute import unwrap
from .sharding.shard import is_fsdp
from .sharding.zero import zero_state

__all__ = ["clip_grad_norm_", "no_sync"]


def _outer(model: nn.Module) -> nn.Module:
    """``model`` without ``torch.compile``'s wrapper (DDP and FSDP2 stay)."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod  # type: ignore[assignment]
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes in this block accumulate gradients on each rank without communicating;
    the next backward outside it reduces the sum.  DDP (``shard=None``/``"optimizer"``):
    ``model.no_sync()``; FSDP2 (``shard="full"``): ``set_requires_gradient_sync(False)`` (which
    keeps whole gradients until that backward: more memory).  Without a wrapper: nothing."""
    from torch.nn.parallel import DistributedDataParallel

    outer = _outer(model)
    if isinstance(outer, DistributedDataParallel):
        with outer.no_sync():
            yield
        return
    if is_fsdp(outer):
        outer.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            outer.set_requires_gradient_sync(True)  # type: ignore[operator]
        return
    yield


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a prepared model to a total norm of ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does, whatever its ``shard=`` mode; returns the total
    norm of the reduced gradients (the same on every rank).  Call it after backward, before
    ``optimizer.step()``."""
    zero = zero_state(unwrap(model))
    if zero is not None:  # shard="optimizer", sharded or not yet: its own norm (bit-identical resumes)
        return zero.clip_grad_norm_(float(max_norm), float(norm_type))
    params = [p for p in unwrap(model).parameters() if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    full = getattr(total, "full_tensor", None)  # FSDP2: a DTensor
    return full() if callable(full) else total
