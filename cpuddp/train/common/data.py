"""Sharding data over ranks, and where a pass over it stands: :func:`shard` and :class:`ShardedLoader`.

``shard(dataset, batch_size=...)`` gives each rank its part of every epoch through a
``DistributedSampler`` (padded by repetition when uneven, as torch does); the epoch moves on
by itself when a pass runs to the end, so every pass reshuffles identically on every rank.

**The data position.**  :meth:`ShardedLoader.state_dict` says where the current pass stands:
its epoch and how many of the epoch's samples the ranks have consumed together (each rank's
batches x the batch size x the world size: DDP steps every rank in lockstep).
:meth:`ShardedLoader.load_state_dict` makes the next pass continue that epoch after those
samples.  The epoch's order does not depend on the world size (the seed and the epoch fix
it), so the rest of the epoch can be dealt over another number of ranks: no sample is
repeated or skipped.  At the same world size the resumed pass yields exactly the batches the
interrupted one would have.  Creating the resumed pass leaves torch's random state as it was,
so a restored random state continues as it would have (the DataLoader otherwise draws a
seed from it for every pass).

A DataLoader that :func:`shard` only wraps (one that already has a ``DistributedSampler``, or
any DataLoader at world size 1) is resumed by skipping the consumed batches, when its order
can be repeated (its own ``DistributedSampler`` at the same world size, or no shuffling);
otherwise its epoch restarts, with a warning naming the fix.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from cpuddp.affinity import pin as affinity
from cpuddp.errors import CheckpointError, PrepareError, warn
from cpuddp.ranks import group_rank_world as _rank_world
from cpuddp.ranks import require_group

__all__ = ["ShardedLoader", "shard"]


class _ResumableSampler(DistributedSampler):
    """torch's ``DistributedSampler``, whose next pass can start after the first ``skip``
    positions of the epoch's order (the consumed samples), dealing the rest over this world.

    The rest is padded to equal shares as torch pads: from the start of the order at the
    world size that saved the position (so the pass is the one that was interrupted), from
    the rest itself at another (so no sample consumed before the save comes back)."""

    skip = 0
    pad_from_rest = False

    def _order(self) -> list[int]:
        """The epoch's order over the whole dataset, as ``DistributedSampler`` draws it."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def _rest(self) -> list[int]:
        order = self._order()
        rest = order[self.skip:]
        source = list(rest) if self.pad_from_rest and rest else order
        short = -len(rest) % self.num_replicas
        while short > 0:  # torch's padding: from the start of ``source``, repeated if needed
            rest += source[:short]
            short = -len(rest) % self.num_replicas
        return rest

    def __iter__(self) -> Iterator[int]:
        if not self.skip:
            return super().__iter__()
        rest = self._rest()
        self.skip = 0  # one pass only
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self) -> int:
        if not self.skip:
            return super().__len__()
        return max(0, math.ceil((len(self.dataset) - self.skip) / self.num_replicas))  # type: ignore[arg-type]


class ShardedLoader:
    """A DataLoader over this rank's shard that calls ``sampler.set_epoch`` on each pass.

    The epoch moves on when a pass **runs to the end**, so a full ``for batch in loader`` per
    epoch reshuffles (identically on every rank) with no call from the user, while a pass
    left early -- ``next(iter(loader))`` to peek at a batch, a ``break`` -- changes nothing:
    every rank keeps the same epoch whatever it peeked at.  :meth:`set_epoch` sets the epoch
    of the next pass, as ``DistributedSampler.set_epoch`` does; call it at the top of each
    epoch when your epochs end early (a step limit).  ``epoch`` is the epoch the next pass
    uses.  :meth:`state_dict`/:meth:`load_state_dict` save and restore the position inside an
    epoch (the module doc); :func:`cpuddp.save_checkpoint` does it for you.  Attributes not
    defined here come from the wrapped DataLoader.
    """

    def __init__(self, loader: DataLoader, sampler: Optional[Any], epoch: int = 0) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = epoch
        self._pass: Optional[_Pass] = None
        self._resume = 0  # samples of self.epoch the next pass skips
        self._resume_world = 0  # the world size that consumed them

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (it seeds the shuffle; the same on every rank)."""
        if int(epoch) != self.epoch:
            self._resume = 0
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        skip, self._resume = self._resume, 0
        self._pass = _Pass(self, self.epoch, skip)
        return self._pass

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "sampler", "epoch", "_pass", "_resume", "_resume_world"):  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    # ----------------------------------------------------------------- the position

    def _world(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1) or 1)

    def state_dict(self) -> dict[str, Any]:
        """Where the data stands: the epoch of the current pass and the samples of that epoch
        consumed by all ranks together (0 between epochs); plain data."""
        p = self._pass
        if p is None or p.done or p.epoch != self.epoch:
            epoch, consumed = self.epoch, self._resume
        else:
            epoch, consumed = p.epoch, p.skip + p.batches * (self.loader.batch_size or 1) * self._world()
        return {"epoch": epoch, "consumed": consumed, "world_size": self._world(),
                "batch_size": self.loader.batch_size, "samples": _length(self.loader.dataset),
                "seed": getattr(self.sampler, "seed", None), "shuffle": _shuffles(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at ``state`` (from :meth:`state_dict`): the next pass is that epoch's rest."""
        _check_same_data(self, state)
        self.epoch = int(state["epoch"])
        self._pass = None
        consumed = int(state.get("consumed", 0))
        if consumed and not isinstance(self.sampler, _ResumableSampler):
            consumed = _skip_by_batches(self, state, consumed)
        self._resume = consumed
        self._resume_world = int(state.get("world_size", self._world()))


def _length(dataset: Any) -> Optional[int]:
    try:
        return len(dataset)
    except TypeError:
        return None


def _shuffles(loader: ShardedLoader) -> bool:
    s = loader.sampler if loader.sampler is not None else loader.loader.sampler
    return bool(getattr(s, "shuffle", isinstance(s, RandomSampler)))


def _check_same_data(loader: ShardedLoader, state: Mapping[str, Any]) -> None:
    """The saved position means something only over the same data in the same order."""
    now = loader.state_dict()
    for key, what in (("samples", "samples"), ("seed", "seed"), ("shuffle", "shuffle")):
        if key in state and state[key] != now[key]:
            raise CheckpointError(
                f"the checkpoint's data position was taken over a loader with {what}={state[key]!r}; "
                f"this loader has {what}={now[key]!r}, so its order differs",
                fix="resume with the same dataset, seed and shuffle setting as the saved run")


def _skip_by_batches(loader: ShardedLoader, state: Mapping[str, Any], consumed: int) -> int:
    """A loader shard() only wraps: the batches to drop, when its order repeats; else 0 and a warning."""
    same_world = int(state.get("world_size", 1)) == loader._world()
    repeatable = (isinstance(loader.sampler, DistributedSampler)
                  or isinstance(loader.loader.sampler, SequentialSampler))
    if same_world and repeatable:
        return consumed
    warn(
        f"cpuddp: epoch {loader.epoch} restarts from its beginning: this DataLoader's order cannot be "
        "repeated " + ("at another world size" if not same_world else "(it shuffles with torch's global "
                       "random state)") + "; build the loader with cpuddp.shard(dataset, batch_size=...) "
        "to resume mid-epoch")
    return 0


class _Pass:
    """One pass over a ShardedLoader; moves its epoch on when the pass runs to the end, and
    counts its batches (the data position)."""

    def __init__(self, owner: ShardedLoader, epoch: int, skip: int = 0) -> None:
        self._owner = owner
        self.epoch = epoch
        self.skip = skip
        self.batches = 0
        self.done = False
        if not skip:
            self._batches = iter(owner.loader)
            return
        state = torch.get_rng_state()  # the DataLoader draws a seed per pass: not for a resumed one
        try:
            if isinstance(owner.sampler, _ResumableSampler):
                owner.sampler.skip = skip
                owner.sampler.pad_from_rest = owner._resume_world != owner._world()
                self._batches = iter(owner.loader)
            else:  # a wrapped loader whose order repeats: drop the consumed batches
                self._batches = iter(owner.loader)
                for _ in range(skip // ((owner.loader.batch_size or 1) * owner._world())):
                    next(self._batches, None)
        finally:
            torch.set_rng_state(state)

    def __iter__(self) -> "_Pass":
        return self

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        try:
            batch = next(self._batches)
        except StopIteration:
            self.done = True
            if self._owner.epoch == self.epoch:  # once per epoch, and not over a set_epoch()
                self._owner.epoch = self.epoch + 1
            raise
        self.batches += 1
        return batch


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
            affinity.set_affinity(self.cpus)  # a refusal (sandbox) leaves the inherited mask
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
    if num_replicas is None:
        require_group("cpuddp.shard()")
    r, w = _rank_world()
    rank = r if rank is None else rank
    world = w if num_replicas is None else num_replicas

    if isinstance(data, DataLoader):
        settings = _from_loader(data, world, batch_size, shuffle, drop_last, loader_kwargs)
        if isinstance(settings, ShardedLoader):
            return settings
    else:
        settings = _from_dataset(data, batch_size, shuffle, drop_last, loader_kwargs)
    dataset, kwargs, batch_size, shuffle, drop_last = settings

    if worker_threads is not None and kwargs.get("num_workers", 0) > 0:
        plan = affinity.current_plan()
        kwargs["worker_init_fn"] = _WorkerLimits(plan.cpus if plan else (), worker_threads, kwargs.get("worker_init_fn"))
    sampler = _ResumableSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
    return ShardedLoader(loader, sampler)


class _Settings(NamedTuple):
    """What :func:`shard` builds its DataLoader from."""

    dataset: Dataset
    kwargs: dict[str, Any]
    batch_size: int
    shuffle: bool
    drop_last: bool


def _from_loader(loader: DataLoader, world: int, batch_size: Optional[int], shuffle: Optional[bool],
                 drop_last: Optional[bool], overrides: Mapping[str, Any]) -> Union[ShardedLoader, _Settings]:
    """``loader`` wrapped, when it needs no new sampler (it has a ``DistributedSampler``, or
    nothing changes at world size 1); else the settings of its rebuild, its own where the
    caller gave none."""
    loader_shuffle = _loader_shuffle(loader)
    if loader_shuffle is None:  # it already samples with a DistributedSampler
        return ShardedLoader(loader, loader.sampler)
    if loader.batch_size is None:
        raise PrepareError(
            "the DataLoader uses a custom batch_sampler; cpuddp cannot shard it.",
            fix="pass the Dataset to cpuddp.shard(dataset, batch_size=...)",
        )
    if world == 1 and shuffle is None and batch_size is None and drop_last is None and not overrides:
        return ShardedLoader(loader, None)
    return _Settings(
        loader.dataset, _loader_kwargs(loader, overrides),
        loader.batch_size if batch_size is None else batch_size,
        loader_shuffle if shuffle is None else shuffle,
        loader.drop_last if drop_last is None else drop_last,
    )


def _from_dataset(dataset: Dataset, batch_size: Optional[int], shuffle: Optional[bool],
                  drop_last: Optional[bool], overrides: Mapping[str, Any]) -> _Settings:
    """The settings for a map-style ``dataset``: one sample a batch, shuffled, the last partial
    batch kept, where the caller gave none."""
    if isinstance(dataset, IterableDataset):
        raise PrepareError(
            "cannot shard an IterableDataset by sampling.",
            fix="shard the iterable yourself (skip items where index % world_size != rank)",
        )
    return _Settings(
        dataset, dict(overrides),
        1 if batch_size is None else batch_size,
        True if shuffle is None else shuffle,
        False if drop_last is None else drop_last,
    )


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

