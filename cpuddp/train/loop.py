"""Helpers for a plain training loop: sharding data, autocast, metrics, rank 0 I/O.

Every helper works with or without an initialized process group (then the world is one
process), so the same script runs as ``python train.py``, under ``torchrun`` and under
``mpiexec``::

    loader = cpuddp.shard(dataset, batch_size=16)          # per-rank batch; each full pass reshuffles
    for epoch in range(epochs):
        for batch in loader: ...
        loss = cpuddp.reduce_mean(running_loss)             # the same value on every rank
        if cpuddp.is_main_process():
            print(epoch, loss)
    cpuddp.save_state_dict(model, "model.pt")               # rank 0 writes, every rank waits
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from cpuddp.affinity import pin as affinity
from cpuddp.errors import CpuddpError, PrepareError
from cpuddp.ranks import group_rank_world as _rank_world

from . import prepare as preparation
from .checkpoint import write_atomically
from .prepare import prepared_info, unwrap

__all__ = [
    "ShardedLoader",
    "shard",
    "autocast_for",
    "reduce_mean",
    "is_main_process",
    "barrier",
    "save_state_dict",
    "load_state_dict",
]

Number = Union[int, float]


def is_main_process() -> bool:
    """True on global rank 0, and in a process with no process group.

    (Before ``init_distributed()`` every rank has no group yet; :func:`cpuddp.get_rank` gives
    the launcher's rank then.)
    """
    return _rank_world()[0] == 0


def barrier() -> None:
    """Wait for every rank; a no-op without a process group or at world size 1."""
    if _rank_world()[1] > 1:
        dist.barrier()


# --------------------------------------------------------------------------- sharding


class ShardedLoader:
    """A DataLoader over this rank's shard that calls ``sampler.set_epoch`` on each pass.

    The epoch moves on when a pass **runs to the end**, so a full ``for batch in loader`` per
    epoch reshuffles (identically on every rank) with no call from the user, while a pass
    left early -- ``next(iter(loader))`` to peek at a batch, a ``break`` -- changes nothing:
    every rank keeps the same epoch whatever it peeked at.  :meth:`set_epoch` sets the epoch
    of the next pass, as ``DistributedSampler.set_epoch`` does; call it at the top of each
    epoch when your epochs end early (a step limit), or when resuming.  ``epoch`` is the
    epoch the next pass uses.  Attributes not defined here come from the wrapped DataLoader.
    """

    def __init__(self, loader: DataLoader, sampler: Optional[Any], epoch: int = 0) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (it seeds the shuffle; the same on every rank)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        return _Pass(self, self.epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "sampler", "epoch"):  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)


class _Pass:
    """One pass over a ShardedLoader; moves its epoch on when the pass runs to the end."""

    def __init__(self, owner: ShardedLoader, epoch: int) -> None:
        self._owner = owner
        self._epoch = epoch
        self._batches = iter(owner.loader)

    def __iter__(self) -> "_Pass":
        return self

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        try:
            return next(self._batches)
        except StopIteration:
            if self._owner.epoch == self._epoch:  # once per epoch, and not over a set_epoch()
                self._owner.epoch = self._epoch + 1
            raise


class _WorkerLimits:
    """``worker_init_fn`` of the DataLoaders :func:`shard` builds: bound each worker, then call the user's.

    A DataLoader worker is a process of its own that inherits the rank's affinity and its
    ``OMP_NUM_THREADS``; torch gives it 1 intra-op thread, but the BLAS under numpy and
    whatever the worker starts or loads later size their pools from what it inherited, so
    ``num_workers`` workers can run ``num_workers x`` the rank's threads on the rank's cores.
    Each worker therefore runs on its rank's compute CPUs (``cpus``, from the pinning plan;
    never the other ranks' cores: DDP runs at the pace of the slowest rank) with ``threads``
    threads in every pool it can reach: torch, ``OMP_NUM_THREADS`` for what comes later,
    and -- when threadpoolctl is installed -- BLAS/OpenMP libraries already loaded.  The
    user's ``worker_init_fn`` runs last, so it can change any of this.
    """

    def __init__(self, cpus: tuple[int, ...], threads: int, then: Optional[Callable[[int], None]] = None) -> None:
        self.cpus = tuple(cpus)
        self.threads = int(threads)
        self.then = then

    def __call__(self, worker_id: int) -> None:
        if self.cpus:
            affinity._set_affinity(self.cpus)  # a refusal (sandbox) leaves the inherited mask
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        torch.set_num_threads(self.threads)
        if importlib.util.find_spec("threadpoolctl") is not None:
            from threadpoolctl import threadpool_limits

            threadpool_limits(self.threads)
        if self.then is not None:
            self.then(worker_id)


def _worker_threads(value: Optional[int]) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PrepareError(
            f"worker_threads={value!r} is not a positive int.",
            fix="pass worker_threads=1 (the default), another count, or None to leave the workers as torch starts them",
        )
    return value


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
    worker_threads: Optional[int] = 1,
    **loader_kwargs: Any,
) -> ShardedLoader:
    """Split ``data`` (a map-style Dataset or a DataLoader) across ranks.

    Each rank gets ``len(data) / world`` samples through a ``DistributedSampler`` (padded by
    repetition when uneven, as torch does); ``batch_size`` is per rank.  For a Dataset,
    ``shuffle`` defaults to True and ``batch_size`` to 1; ``loader_kwargs`` go to the
    DataLoader.  For a DataLoader, its batch size, collate function, workers etc. are kept
    and its shuffle is read from its sampler; at world size 1 it is only wrapped.
    ``seed`` must be the same on every rank.  ``drop_last`` drops the last partial batch.
    With ``num_workers > 0``, each worker runs on the rank's pinned CPUs with
    ``worker_threads`` threads (:class:`_WorkerLimits`); ``None`` leaves the workers as torch
    starts them.
    """
    worker_threads = _worker_threads(worker_threads)
    r, w = _rank_world()
    rank = r if rank is None else rank
    world = w if num_replicas is None else num_replicas

    if isinstance(data, DataLoader):
        loader_shuffle = _loader_shuffle(data)
        if loader_shuffle is None:  # it already samples with a DistributedSampler
            return ShardedLoader(data, data.sampler)
        if data.batch_size is None:
            raise PrepareError(
                "the DataLoader uses a custom batch_sampler; cpuddp cannot shard it.",
                fix="pass the Dataset to cpuddp.shard(dataset, batch_size=...)",
            )
        if world == 1 and shuffle is None and batch_size is None and drop_last is None and not loader_kwargs:
            return ShardedLoader(data, None)
        dataset, kwargs = data.dataset, _loader_kwargs(data, loader_kwargs)
        batch_size = data.batch_size if batch_size is None else batch_size
        shuffle = loader_shuffle if shuffle is None else shuffle
        drop_last = data.drop_last if drop_last is None else drop_last
    else:
        if isinstance(data, IterableDataset):
            raise PrepareError(
                "cannot shard an IterableDataset by sampling.",
                fix="shard the iterable yourself (skip items where index % world_size != rank)",
            )
        dataset, kwargs = data, dict(loader_kwargs)
        batch_size = 1 if batch_size is None else batch_size
        shuffle = True if shuffle is None else shuffle
        drop_last = False if drop_last is None else drop_last

    if worker_threads is not None and kwargs.get("num_workers", 0) > 0:
        plan = affinity.current_plan()
        kwargs["worker_init_fn"] = _WorkerLimits(plan.cpus if plan else (), worker_threads, kwargs.get("worker_init_fn"))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
    return ShardedLoader(loader, sampler)


def _loader_shuffle(loader: DataLoader) -> Optional[bool]:
    """Whether ``loader`` shuffles, read from its sampler; None when it already uses a
    DistributedSampler.  Raises for what cannot be sharded by sampling."""
    if isinstance(loader.dataset, IterableDataset):
        raise PrepareError(
            "cannot shard a DataLoader over an IterableDataset by sampling.",
            fix="shard the iterable yourself (skip items where index % world_size != rank)",
        )
    if isinstance(loader.sampler, RandomSampler):
        return True
    if isinstance(loader.sampler, SequentialSampler):
        return False
    if isinstance(loader.sampler, DistributedSampler):
        return None
    raise PrepareError(
        f"the DataLoader uses a custom sampler ({type(loader.sampler).__name__}); "
        "replacing it with a DistributedSampler would change what it samples.",
        fix="pass the Dataset to cpuddp.shard(), or build the DataLoader with a DistributedSampler yourself",
    )


def _loader_kwargs(loader: DataLoader, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``loader`` a rebuilt DataLoader keeps (workers, collate, ...), then ``overrides``."""
    kwargs = {a: getattr(loader, a) for a in _LOADER_ATTRS if hasattr(loader, a)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    kwargs.update(overrides)
    return kwargs


# --------------------------------------------------------------------------- autocast


def autocast_for(
    model: Optional[nn.Module] = None, *, enabled: Optional[bool] = None, dtype: torch.dtype = torch.bfloat16
) -> torch.autocast:
    """``torch.autocast("cpu", dtype=dtype)``, on when bf16 pays: as prepare chose for ``model``,
    else as this CPU allows.

    With a prepared ``model``: on iff :func:`~cpuddp.prepare` chose bf16 for it.  Without one,
    for bf16: on iff the CPU computes bf16 natively (AMX or AVX512-BF16, the probe
    ``prepare(mixed_precision="bf16")`` uses), else off, with the warning prepare gives when it
    stays in fp32.  ``enabled=`` overrides both; another ``dtype`` is on unless ``enabled=False``.
    Use it for code outside the prepared module's forward (evaluating
    ``cpuddp.unwrap(model)``, a loss that needs the same precision).
    """
    if enabled is None:
        if model is not None:
            info = prepared_info(model)
            enabled = info is not None and info.mixed_precision == "bf16"
        elif dtype == torch.bfloat16:
            enabled = _cpu_runs_bf16()
        else:
            enabled = True
    return torch.autocast("cpu", dtype=dtype, enabled=enabled)


def _cpu_runs_bf16() -> bool:
    """prepare's bf16 decision for this CPU, with its fp32 fall-back warning."""
    ok, why = preparation.cpu_bf16_support()
    dtype, reason = preparation.decide_precision("bf16", strict=False, cpu_bf16=ok, reason=why)
    if dtype is None:
        warnings.warn(f"cpuddp.autocast_for: {reason}", stacklevel=3)
    return dtype is not None


def autocast(
    model: Optional[nn.Module] = None, *, enabled: Optional[bool] = None, dtype: torch.dtype = torch.bfloat16
) -> torch.autocast:
    """Deprecated alias of :func:`autocast_for` (its name shadowed ``torch.autocast``)."""
    warnings.warn("cpuddp.autocast is deprecated (it shadows torch.autocast); use cpuddp.autocast_for",
                  DeprecationWarning, stacklevel=2)
    return autocast_for(model, enabled=enabled, dtype=dtype)


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


def _global_rank0(group: Any) -> int:
    """The global rank of ``group``'s rank 0 (collectives name their source globally)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def _broadcast_text(text: str, src: int, group: Any) -> str:
    """Broadcast ``text`` from global rank ``src``: its length, then its UTF-8 bytes, as
    tensors (torch's object collectives need numpy, which cpuddp does not require)."""
    data = text.encode() if text else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size.item()), dtype=torch.uint8)
    if int(size.item()):
        dist.broadcast(buf, src=src, group=group)
    return bytes(buf.tolist()).decode()


def _on_rank0(action: Callable[[], Any], what: str, fix: str, group: Any) -> Any:
    """Run ``action()`` on rank 0 and give its (JSON-able) result to every rank.

    Every rank waits for rank 0 in one broadcast.  An error on rank 0 is raised there as it
    is, and on every other rank as a :class:`CpuddpError` naming it -- so no rank is left
    waiting in a later collective until the timeout.
    """
    rank, _ = _rank_world(group)
    status = ""
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            status = json.dumps(["ok", action()])
        except Exception as exc:  # reported to every rank below
            error = exc
            status = json.dumps(["error", f"{type(exc).__name__}: {exc}"])
    kind, value = json.loads(_broadcast_text(status, _global_rank0(group), group))
    if kind == "error":
        if error is not None:
            raise error
        raise CpuddpError(f"{what} failed on rank 0: {value}", fix=fix)
    return value


def save_state_dict(model: nn.Module, path: Union[str, os.PathLike], *, group: Any = None) -> None:
    """Rank 0 writes ``unwrap(model).state_dict()`` to ``path`` (atomically); every rank waits.

    The file is a plain state dict: ``model.load_state_dict(torch.load(path))`` reads it
    without cpuddp.  An error on rank 0 (a full disk, a missing permission) is raised on
    every rank, so none is left waiting.  A crash or kill at any moment leaves the previous
    checkpoint or the new one, never a mix; the file is fsynced before the rename and the
    directory after it, and is readable by this user only (mode 0600).  A failed save removes
    its temporary file (``.cpuddp-<name>.*.pt``); the next save removes those of saves that
    were killed (:mod:`cpuddp.train.checkpoint`).
    """
    path = os.fspath(path)

    def write() -> None:
        state = unwrap(model).state_dict()
        write_atomically(path, lambda f: torch.save(state, f))

    if _rank_world(group)[1] == 1:
        write()
        return
    _on_rank0(write, f"saving {path!r}",
              f"make {path!r} writable on rank 0's host (free space, permissions, every parent a directory); "
              "every rank stopped", group)


def load_state_dict(
    model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True, group: Any = None
) -> Any:
    """Rank 0 reads ``path`` into ``unwrap(model)`` and broadcasts it to the other ranks.

    Only rank 0 needs the file (no shared file system assumed).  Returns the
    ``missing_keys``/``unexpected_keys`` result on every rank; an error on rank 0 is
    raised on every rank, so none is left waiting.
    """
    core = unwrap(model)
    path = os.fspath(path)
    rank, world = _rank_world(group)
    if world == 1:
        return core.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=strict)

    def read() -> tuple[list[str], list[str]]:
        result = core.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=strict)
        return list(result.missing_keys), list(result.unexpected_keys)

    missing, unexpected = _on_rank0(read, f"loading {path!r}", "fix the checkpoint on rank 0; every rank stopped", group)
    src = _global_rank0(group)
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

    return _IncompatibleKeys(missing, unexpected)
