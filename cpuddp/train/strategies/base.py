"""The interface every ``shard=`` mode's strategy implements (:class:`Strategy`), and
:func:`unwrap`, the undoing of the wraps (DDP, ``torch.compile``).

A strategy is chosen once, by :func:`cpuddp.prepare` (:func:`cpuddp.train.strategies.modes.strategy_for`),
and kept on the prepared module; the code that gets a model later asks for it
(:func:`cpuddp.train.strategies.modes.strategy_of`) instead of comparing the mode again.  A
strategy holds no state of its own (a model's state stays on the model: DDP, FSDP2, the
:class:`~cpuddp.train.sharding.zero.ZeroStep`): copying or pickling a prepared model drops it, as
it drops prepare's record.

The defaults here are DDP's (every rank holds whole parameters): :class:`~.ddp.DdpStrategy` is
this class with its wrap, and the sharded strategies override what differs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

__all__ = ["Strategy", "unwrap", "outer_of", "STRATEGY_ATTR", "Options"]

#: The attribute of the user's module that holds its strategy.
STRATEGY_ATTR = "_cpuddp_strategy"

#: :class:`~cpuddp.train.strategies.options.PrepareOptions`, which imports the strategies (they
#: check its ``shard=`` request), so they name its type without importing it.
Options = Any


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


def outer_of(model: nn.Module) -> nn.Module:
    """``model`` without ``torch.compile``'s wrapper (DDP and FSDP2 stay)."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod  # type: ignore[assignment]
    return model


def _none() -> None:
    return None


class Strategy:
    """One ``shard=`` mode: its option checks, its wrap, ``no_sync``, gradient clipping, what
    :func:`cpuddp.prepared_info` says, and how its model's whole state is read and written.

    Class attributes, read by prepare and the checkpoint code:

    * ``name``: the ``shard=`` value (None, ``"optimizer"``, ``"full"``).
    * ``shards``: state is spread over the ranks (IPEX and ``torch.compile`` refused, DCP's notes).
    * ``shards_parameters``: each rank holds a shard of the parameters (DTensors), so saving and
      loading are collective and a checkpoint is a DCP directory every rank writes.
    * ``wraps_in_ddp``: the wrap is DDP (``PrepareInfo.ddp``).
    * ``sharded_from_step``: ``PrepareInfo.sharded_since_step`` at prepare (a live value may replace it).
    * ``unfused_why``: why prepare leaves the optimizer unfused (None: it may fuse it).
    """

    name: Optional[str] = None
    shards = False
    shards_parameters = False
    wraps_in_ddp = True
    sharded_from_step: Optional[int] = None
    unfused_why: Optional[str] = None

    # ------------------------------------------------------------------ prepare

    def check_request(self, options: Options) -> None:
        """Raise :class:`~cpuddp.errors.PrepareError` for options this mode cannot take (pure)."""

    def in_world(self, world: int, notes: list[str]) -> "Strategy":
        """The strategy in effect at world size ``world`` (a sharded one: DDP's at world size 1)."""
        return self

    def check_objects(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Raise :class:`~cpuddp.errors.PrepareError` when ``model``/``optimizer`` cannot be prepared
        this way as they are."""

    def bf16_parameters(self, dtype: Optional[torch.dtype], options: Options) -> bool:
        """Are the parameters themselves cast to bf16 (rather than bf16 autocast over fp32 ones)?"""
        return False

    def wrap(self, core: nn.Module, optimizer: Optional[torch.optim.Optimizer], do_ddp: bool, bf16_params: bool,
             options: Options, notes: list[str]) -> tuple[nn.Module, Optional[str]]:
        """The outer module to train and the name of its gradient hook."""
        raise NotImplementedError

    def live_info(self, info: Any, core: nn.Module) -> Any:
        """``info`` (a :class:`~cpuddp.train.prepare.PrepareInfo`) with what has changed since prepare."""
        return info

    # ------------------------------------------------------------------ the loop

    @contextlib.contextmanager
    def no_sync(self, outer: nn.Module) -> Iterator[None]:
        """Backward passes in this block accumulate gradients without communicating: DDP's
        ``no_sync()``; without a wrapper, nothing."""
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(outer, DistributedDataParallel):
            with outer.no_sync():
                yield
            return
        yield

    def clip_grad_norm_(self, core: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over ``core``'s gradients; the total norm."""
        params = [p for p in core.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    # ------------------------------------------------------------------ state

    def whole_model_state(self, core: nn.Module) -> Optional[dict[str, Any]]:
        """The model's state dict as whole tensors when they must be gathered first (a collective:
        every rank calls it); None when ``core.state_dict()`` is whole already."""
        return None

    def load_whole_model_state(self, core: nn.Module, state: dict[str, Any], strict: bool) -> Any:
        """Load a whole state dict (read on rank 0 only) into a model whose parameters are sharded."""
        raise NotImplementedError(f"shard={self.name!r} keeps whole parameters")

    # ------------------------------------------------------------------ kept on the model

    def attach(self, core: nn.Module) -> None:
        """Keep this strategy on the user's module, where :func:`~.modes.strategy_of` finds it."""
        core.__dict__[STRATEGY_ATTR] = self

    def __deepcopy__(self, memo: dict) -> None:
        # A deep copy of a prepared model is a plain model again: drop the strategy.
        return None

    def __reduce__(self):
        return (_none, ())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shard={self.name!r})"
