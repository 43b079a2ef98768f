"""The ``shard=`` string turned into its strategy (:func:`strategy_for`: the one lookup), and a
model's strategy asked back (:func:`strategy_of`).

:func:`cpuddp.prepare` keeps the strategy it chose on the user's module; everything that gets a
model later (``no_sync``, ``clip_grad_norm_``, ``prepared_info``, the checkpoints) asks
:func:`strategy_of`.  A model cpuddp did not prepare (the user's own DDP or ``fully_shard``) has
none: :func:`fallback_strategy` then guesses it from what the model is -- the only place that
looks.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from cpuddp.errors import PrepareError

from .base import STRATEGY_ATTR, Strategy, outer_of, unwrap
from .ddp import DdpStrategy
from .fsdp import FsdpStrategy
from .zero import ZeroStrategy

__all__ = ["STRATEGIES", "SHARD_MODES", "strategy_for", "strategy_of", "fallback_strategy"]

#: ``shard=``'s values and their strategies.
STRATEGIES: dict[Optional[str], type[Strategy]] = {None: DdpStrategy, "optimizer": ZeroStrategy, "full": FsdpStrategy}
SHARD_MODES = tuple(STRATEGIES)


def strategy_for(shard: Any) -> Strategy:
    """The strategy of ``shard=`` (:class:`PrepareError` for a value that is no mode)."""
    if shard not in SHARD_MODES:  # a tuple: an unhashable value is refused too, not a TypeError
        raise PrepareError(f"shard must be None, 'optimizer' or 'full'. Got {shard!r} instead.",
                           fix="pass shard='optimizer' (ZeRO-2: optimizer state and gradients sharded) or "
                               "shard='full' (FSDP2: parameters sharded too)")
    return STRATEGIES[shard]()


def strategy_of(model: nn.Module) -> Strategy:
    """The strategy :func:`cpuddp.prepare` chose for ``model`` (the prepared model, or any wrapper
    or module inside it); for a model it did not prepare, :func:`fallback_strategy`."""
    kept = unwrap(model).__dict__.get(STRATEGY_ATTR)
    return kept if isinstance(kept, Strategy) else fallback_strategy(model)


def fallback_strategy(model: nn.Module) -> Strategy:
    """For a model cpuddp did not prepare (or a copy of one, which drops its strategy): FSDP2's
    strategy when ``fully_shard`` was applied to it or its parameters are DTensors (then saving
    and loading are collective), else DDP's (which leaves a model without a wrapper alone).  The
    one place that rediscovers a mode from the model itself."""
    return FsdpStrategy() if _is_fsdp(outer_of(model)) or _has_dtensors(unwrap(model)) else DdpStrategy()


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return False
    return isinstance(model, FSDPModule)


def _has_dtensors(core: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return any(isinstance(p, DTensor) for p in core.parameters())
