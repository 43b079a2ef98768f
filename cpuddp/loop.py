"""Helpers for a plain training loop: sharding data, autocast, metrics, rank 0 I/O.

Every helper works with or without an initialized process group (then the world is one
process), so the same script runs as ``python train.py``, under ``torchrun`` and under
``mpiexec``::

    loader = cpuddp.shard(dataset, batch_size=16)          # per-rank batch, set_epoch handled
    for epoch in range(epochs):
        for batch in loader: ...
        loss = cpuddp.reduce_mean(running_loss)             # the same value on every rank
        if cpuddp.is_main_process():
            print(epoch, loss)
    cpuddp.save_state_dict(model, "model.pt")               # rank 0 writes, every rank waits
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .errors import CpuddpError, PrepareError
from .preparation import prepared_info, unwrap

__all__ = [
    "ShardedLoader",
    "shard",
    "autocast",
    "reduce_mean",
    "is_main_process",
    "barrier",
    "save_state_dict",
    "load_state_dict",
]

Number = Union[int, float]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world(group: Any = None) -> tuple[int, int]:
    if _initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def is_main_process() -> bool:
    """True on global rank 0, and in a process with no process group."""
    return _rank_world()[0] == 0


def barrier() -> None:
    """Wait for every rank; a no-op without a process group or at world size 1."""
    if _initialized() and dist.get_world_size() > 1:
        dist.barrier()


# --------------------------------------------------------------------------- sharding


class ShardedLoader:
    """A DataLoader over this rank's shard that calls ``sampler.set_epoch`` on each pass.

    Each ``iter()`` uses the current epoch and then advances it, so every epoch reshuffles
    (identically on every rank) with no call from the user; :meth:`set_epoch` overrides it
    (e.g. when resuming).  Attributes not defined here come from the wrapped DataLoader.
    """

    def __init__(self, loader: DataLoader, sampler: Optional[Any], epoch: int = 0) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "sampler", "epoch"):  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)


_LOADER_ATTRS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
    "multiprocessing_context", "generator", "persistent_workers",
)


def shard(
    data: Union[Dataset, DataLoader],
    *,
    batch_size: Optional[int] = None,
    shuffle: Optional[bool] = None,
    seed: int = 0,
    drop_last: Optional[bool] = None,
    num_replicas: Optional[int] = None,
    rank: Optional[int] = None,
    **loader_kwargs: Any,
) -> ShardedLoader:
    """Split ``data`` (a map-style Dataset or a DataLoader) across ranks.

    Each rank gets ``len(data) / world`` samples through a ``DistributedSampler`` (padded by
    repetition when uneven, as torch does); ``batch_size`` is per rank.  For a Dataset,
    ``shuffle`` defaults to True and ``batch_size`` to 1; ``loader_kwargs`` go to the
    DataLoader.  For a DataLoader, its batch size, collate function, workers etc. are kept
    and its shuffle is read from its sampler; at world size 1 it is only wrapped.
    ``seed`` must be the same on every rank.  ``drop_last`` drops the last partial batch.
    """
    r, w = _rank_world()
    rank = r if rank is None else rank
    world = w if num_replicas is None else num_replicas

    if isinstance(data, DataLoader):
        loader = data
        if isinstance(loader.dataset, IterableDataset):
            raise PrepareError(
                "cannot shard a DataLoader over an IterableDataset by sampling.",
                fix="shard the iterable yourself (skip items where index % world_size != rank)",
            )
        if isinstance(loader.sampler, RandomSampler):
            loader_shuffle = True
        elif isinstance(loader.sampler, SequentialSampler):
            loader_shuffle = False
        elif isinstance(loader.sampler, DistributedSampler):
            return ShardedLoader(loader, loader.sampler)
        else:
            raise PrepareError(
                f"the DataLoader uses a custom sampler ({type(loader.sampler).__name__}); "
                "replacing it with a DistributedSampler would change what it samples.",
                fix="pass the Dataset to cpuddp.shard(), or build the DataLoader with a DistributedSampler yourself",
            )
        if loader.batch_size is None:
            raise PrepareError(
                "the DataLoader uses a custom batch_sampler; cpuddp cannot shard it.",
                fix="pass the Dataset to cpuddp.shard(dataset, batch_size=...)",
            )
        if world == 1 and shuffle is None and batch_size is None and drop_last is None and not loader_kwargs:
            return ShardedLoader(loader, None)
        kwargs = {a: getattr(loader, a) for a in _LOADER_ATTRS if hasattr(loader, a)}
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs.update(loader_kwargs)
        dataset = loader.dataset
        batch_size = loader.batch_size if batch_size is None else batch_size
        shuffle = loader_shuffle if shuffle is None else shuffle
        drop_last = loader.drop_last if drop_last is None else drop_last
    else:
        if isinstance(data, IterableDataset):
            raise PrepareError(
                "cannot shard an IterableDataset by sampling.",
                fix="shard the iterable yourself (skip items where index % world_size != rank)",
            )
        dataset = data
        kwargs = dict(loader_kwargs)
        batch_size = 1 if batch_size is None else batch_size
        shuffle = True if shuffle is None else shuffle
        drop_last = False if drop_last is None else drop_last

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
    return ShardedLoader(loader, sampler)


# --------------------------------------------------------------------------- autocast


def autocast(
    model: Optional[nn.Module] = None, *, enabled: Optional[bool] = None, dtype: torch.dtype = torch.bfloat16
) -> torch.autocast:
    """``torch.autocast("cpu", dtype=bf16)``; with a prepared ``model``, on iff prepare chose bf16.

    Use it for code outside the prepared module's forward (e.g. evaluating
    ``cpuddp.unwrap(model)``, or a loss that needs the same precision).
    """
    if enabled is None:
        if model is not None:
            info = prepared_info(model)
            enabled = info is not None and info.mixed_precision == "bf16"
        else:
            enabled = True
    return torch.autocast("cpu", dtype=dtype, enabled=enabled)


# --------------------------------------------------------------------------- metrics


def _as_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise PrepareError(f"reduce_mean takes scalars; got a tensor of shape {tuple(v.shape)}.",
                               fix="reduce a scalar (e.g. loss.detach()), or call torch.distributed.all_reduce yourself")
        return float(v.detach().item())
    return float(v)


def reduce_mean(value: Any, *, weight: Optional[Number] = None, group: Any = None) -> Any:
    """The mean of a scalar metric (or a mapping of them) over ranks, the same on every rank.

    ``weight`` (e.g. this rank's sample count) gives a weighted mean:
    ``sum(value * weight) / sum(weight)``.  Numbers come back as floats, scalar tensors as
    float tensors, mappings as dicts with the same keys (in one collective).  Without a
    process group it returns the value (as a float / float tensor).
    """
    if isinstance(value, Mapping):
        keys = sorted(value)
        means = _reduce([_as_float(value[k]) for k in keys], weight, group)
        return {k: _like(value[k], m) for k, m in zip(keys, means)}
    (mean,) = _reduce([_as_float(value)], weight, group)
    return _like(value, mean)


def _reduce(values: list[float], weight: Optional[Number], group: Any) -> list[float]:
    w = 1.0 if weight is None else float(weight)
    _, world = _rank_world(group)
    if world == 1:
        return list(values) if weight is None or w != 0 else [float("nan")] * len(values)
    buf = torch.tensor([v * w for v in values] + [w], dtype=torch.float64)
    dist.all_reduce(buf, group=group)
    total = buf[-1].item()
    if total == 0:
        return [float("nan")] * len(values)
    return [x / total for x in buf[:-1].tolist()]


def _like(original: Any, mean: float) -> Any:
    if isinstance(original, torch.Tensor):
        dtype = original.dtype if original.is_floating_point() else torch.float32
        return torch.tensor(mean, dtype=dtype)
    return mean


# --------------------------------------------------------------------------- checkpoints


def save_state_dict(model: nn.Module, path: Union[str, os.PathLike], *, group: Any = None) -> None:
    """Rank 0 writes ``unwrap(model).state_dict()`` to ``path`` (atomically); every rank waits.

    The file is a plain state dict: ``model.load_state_dict(torch.load(path))`` reads it
    without cpuddp.
    """
    rank, world = _rank_world(group)
    if rank == 0:
        state = unwrap(model).state_dict()
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".cpuddp-", suffix=".pt", dir=directory)
        os.close(fd)
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if world > 1:
        dist.barrier(group)


def load_state_dict(
    model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True, group: Any = None
) -> Any:
    """Rank 0 reads ``path`` into ``unwrap(model)`` and broadcasts it to the other ranks.

    Only rank 0 needs the file (no shared file system assumed).  Returns the
    ``missing_keys``/``unexpected_keys`` result on every rank; an error on rank 0 is
    raised on every rank, so none is left waiting.
    """
    core = unwrap(model)
    rank, world = _rank_world(group)
    if world == 1:
        return core.load_state_dict(torch.load(os.fspath(path), map_location="cpu", weights_only=True), strict=strict)
    status: list[Any] = [None]
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
            result = core.load_state_dict(state, strict=strict)
            status[0] = ("ok", list(result.missing_keys), list(result.unexpected_keys))
        except Exception as exc:  # reported to every rank below
            error = exc
            status[0] = ("error", f"{type(exc).__name__}: {exc}")
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(status, src=src, group=group)
    if status[0][0] == "error":
        if error is not None:
            raise error
        raise CpuddpError(f"loading {os.fspath(path)!r} failed on rank 0: {status[0][1]}",
                          fix="fix the checkpoint on rank 0; every rank stopped")
    # Broadcast rank 0's (loaded) state dict, then load it on the other ranks.  Loading,
    # rather than relying on the tensors sharing storage with the parameters, also covers
    # modules whose state_dict() returns copies (IPEX's prepacked weights).
    state = core.state_dict()
    with torch.no_grad():
        for tensor in state.values():
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.is_contiguous():
                dist.broadcast(tensor, src=src, group=group)
            else:
                tmp = tensor.contiguous()
                dist.broadcast(tmp, src=src, group=group)
                tensor.copy_(tmp)
        if rank != 0:
            core.load_state_dict(state, strict=strict)
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(status[0][1], status[0][2])
