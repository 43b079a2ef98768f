"""Gradient helpers that work the same for every ``shard=`` mode of :func:`cpuddp.prepare`.

torch's calls differ between the wrappers: DDP has ``no_sync()``, FSDP2 has
``set_requires_gradient_sync(False)``; ``torch.nn.utils.clip_grad_norm_`` works for DDP and
FSDP2 (its DTensor gradients give the global norm) but not for ``shard="optimizer"``, whose
reduced gradients live in the optimizer's shares, not in the model's ``.grad``.  Each asks the
model's strategy (:func:`cpuddp.train.strategies.modes.strategy_of`), which knows.  So::

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

from .strategies.base import outer_of, unwrap
from .strategies.modes import strategy_of

__all__ = ["clip_grad_norm_", "no_sync"]


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes in this block accumulate gradients on each rank without communicating;
    the next backward outside it reduces the sum.  DDP (``shard=None``/``"optimizer"``):
    ``model.no_sync()``; FSDP2 (``shard="full"``): ``set_requires_gradient_sync(False)`` (which
    keeps whole gradients until that backward: more memory).  Without a wrapper: nothing.
    The model's strategy does it (:mod:`cpuddp.train.strategies`)."""
    with strategy_of(model).no_sync(outer_of(model)):
        yield


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a prepared model to a total norm of ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does, whatever its ``shard=`` mode; returns the total
    norm of the reduced gradients (the same on every rank).  Call it after backward, before
    ``optimizer.step()``.  The model's strategy does it (``shard="optimizer"``: its own norm)."""
    return strategy_of(model).clip_grad_norm_(unwrap(model), max_norm, norm_type)
