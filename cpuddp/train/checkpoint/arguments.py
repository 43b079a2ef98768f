"""The arguments :func:`~cpuddp.train.checkpoint.save.save_checkpoint` and
:func:`~cpuddp.train.checkpoint.load.load_checkpoint` both take, each checked to be what its
name says (:func:`check_args`), and the format tag both write and read (:data:`FORMAT`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from cpuddp.errors import CheckpointError

from ..common.data import ShardedLoader

__all__ = ["FORMAT", "check_args"]

FORMAT = "cpuddp-checkpoint/1"


def _kind(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_args(fn: str, directory: Any, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
                loader: Any) -> str:
    """The objects a checkpoint takes, each what its name says; the directory as a str."""
    if not isinstance(directory, (str, os.PathLike)):
        raise CheckpointError(f"cpuddp.{fn}(): the directory must be a str or os.PathLike; got {_kind(directory)}",
                              fix=f"cpuddp.{fn}('checkpoints', model=model, ...)")
    path = os.fspath(directory)
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"cpuddp.{fn}(): model= must be a torch.nn.Module; got {_kind(model)}",
                              fix=f"cpuddp.{fn}(directory, model=model, optimizer=optimizer, ...)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"cpuddp.{fn}(): optimizer= must be a torch.optim.Optimizer; got {_kind(optimizer)}",
                              fix="pass the optimizer you step (or leave optimizer= out)")
    for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and not (callable(getattr(obj, "state_dict", None))
                                    and callable(getattr(obj, "load_state_dict", None))):
            raise CheckpointError(f"cpuddp.{fn}(): {name}= needs state_dict() and load_state_dict(); "
                                  f"got {_kind(obj)}", fix=f"pass the {name} object itself (or leave {name}= out)")
    if loader is not None and not isinstance(loader, ShardedLoader):
        raise CheckpointError(
            f"cpuddp.{fn}(): loader= must be the loader cpuddp.shard() returned; got {_kind(loader)}, "
            "whose position in the epoch cannot be read",
            fix="loader = cpuddp.shard(dataset_or_dataloader, batch_size=...), or leave loader= out")
    return path
