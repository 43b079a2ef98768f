"""Helpers for a plain training loop: autocast, metrics, rank 0 I/O (sharding: :mod:`.common.data`).

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

``save_state_dict``/``load_state_dict`` keep the model's weights only; a run that should
resume where it stopped saves everything with :func:`cpuddp.save_checkpoint`
(:mod:`.checkpoint.save`, :mod:`.checkpoint.load`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import CheckpointError, PrepareError, warn
from cpuddp.ranks import get_rank
from cpuddp.ranks import group_rank_world as _rank_world

from .checkpoint.atomic import write_atomically
from .checkpoint.paths import open_own_file, state_nbytes
from .checkpoint.state_io import load_tensors
from .common.data import ShardedLoader, shard
from .common.rank0 import global_rank0, on_rank0
from .precision import bf16 as precision
from .prepare import prepared_info
from .strategies.base import Strategy, unwrap
from .strategies.modes import strategy_of

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
    ok, why = precision.cpu_bf16_support()
    dtype, reason = precision.decide_precision("bf16", strict=False, cpu_bf16=ok, reason=why)
    if dtype is None and get_rank() == 0:  # once per job, not per rank
        warn(f"cpuddp.autocast_for: {reason}")
    return dtype is not None


def autocast(
    model: Optional[nn.Module] = None, *, enabled: Optional[bool] = None, dtype: torch.dtype = torch.bfloat16
) -> torch.autocast:
    """Deprecated alias of :func:`autocast_for` (its name shadowed ``torch.autocast``)."""
    warn("cpuddp.autocast is deprecated (it shadows torch.autocast); use cpuddp.autocast_for", DeprecationWarning)
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


def check_model_and_path(fn: str, model: Any, path: Any) -> str:
    """``save_state_dict``/``load_state_dict``'s arguments: a module and a file path (as str)."""
    if isinstance(model, (str, os.PathLike)) and isinstance(path, nn.Module):
        raise CheckpointError(f"cpuddp.{fn}(path, model): the arguments are swapped",
                              fix=f"call cpuddp.{fn}(model, {os.fspath(model)!r})")
    if not isinstance(model, nn.Module):
        kind = type(model).__module__ + "." + type(model).__qualname__
        more = ""
        if isinstance(model, torch.optim.Optimizer) or hasattr(model, "state_dict"):
            more = ("; the optimizer, LR scheduler, step and data position go into a training checkpoint: "
                    "cpuddp.save_checkpoint(directory, model=model, optimizer=optimizer, ...) and "
                    "cpuddp.load_checkpoint(directory, model=model, optimizer=optimizer, ...)")
        raise CheckpointError(f"cpuddp.{fn}() takes the model (a torch.nn.Module) first; got {kind}",
                              fix=f"pass the model: cpuddp.{fn}(model, path){more}")
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"cpuddp.{fn}(): path must be a str or os.PathLike; got {type(path).__name__} {path!r}",
                              fix=f"pass the file's path: cpuddp.{fn}(model, 'model.pt')")
    text = os.fspath(path)
    if os.path.isdir(text):
        raise CheckpointError(f"cpuddp.{fn}(): {text!r} is a directory; these functions read and write one file",
                              path=text, fix=f"name a file inside it, e.g. {os.path.join(text, 'model.pt')!r}")
    return text


def save_state_dict(model: nn.Module, path: Union[str, os.PathLike], *, group: Any = None,
                    check_permissions: bool = True) -> None:
    """Rank 0 writes ``unwrap(model).state_dict()`` to ``path`` (atomically); every rank waits.

    The file is a plain state dict: ``model.load_state_dict(torch.load(path))`` reads it
    without cpuddp -- also for a ``shard="full"`` model, whose shards every rank gathers into
    whole, plain tensors first (a collective: call it on every rank).  An error on rank 0 (a full disk, a missing permission) is raised on
    every rank, so none is left waiting.  A crash or kill at any moment leaves the previous
    checkpoint or the new one, never a mix; the file is fsynced before the rename and the
    directory after it, and is readable by this user only (mode 0600).  A failed save removes
    its temporary file (``.cpuddp-<name>.*.pt``); the next save removes those of saves that
    were killed (:mod:`cpuddp.train.checkpoint.atomic`).  A directory another user can change is
    refused (``check_permissions=False``: a warning instead; :mod:`cpuddp.train.checkpoint.paths`); a
    full disk says "no space left", with the path and the size.  The model only: the
    optimizer, scheduler, step and data position go in :func:`cpuddp.save_checkpoint`.
    """
    path = check_model_and_path("save_state_dict", model, path)
    core = unwrap(model)
    whole = strategy_of(model).whole_model_state(core)  # every rank: a sharded model's gather is collective

    def write() -> None:
        state = whole if whole is not None else core.state_dict()
        write_atomically(path, lambda f: torch.save(state, f), needed=state_nbytes(state),
                         check_permissions=check_permissions)

    if _rank_world(group)[1] == 1:
        write()
        return
    on_rank0(write, f"saving {path!r}",
             f"make {path!r} writable on rank 0's host (free space, permissions, every parent a directory); "
             "every rank stopped", group)


def read_state(path: str, check_permissions: bool = True) -> Any:
    """``torch.load`` of a file this user owns (:func:`cpuddp.train.checkpoint.paths.open_own_file`), tensors only."""
    with open_own_file(path, check_permissions=check_permissions) as f:
        return load_tensors(f, path)


def load_state_dict(
    model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True, group: Any = None,
    check_permissions: bool = True,
) -> Any:
    """Rank 0 reads ``path`` into ``unwrap(model)`` and broadcasts it to the other ranks.

    Only rank 0 needs the file (no shared file system assumed).  Returns the
    ``missing_keys``/``unexpected_keys`` result on every rank; an error on rank 0 is
    raised on every rank, so none is left waiting.  A file owned by another user, or in a
    directory another user can change, is refused (``check_permissions=False``: a warning).
    """
    path = check_model_and_path("load_state_dict", model, path)
    core = unwrap(model)
    rank, world = _rank_world(group)
    if world == 1:
        return core.load_state_dict(read_state(path, check_permissions), strict=strict)
    strategy = strategy_of(model)
    if strategy.shards_parameters:
        return _load_sharded(strategy, core, path, strict, group, check_permissions)

    def read() -> tuple[list[str], list[str]]:
        result = core.load_state_dict(read_state(path, check_permissions), strict=strict)
        return list(result.missing_keys), list(result.unexpected_keys)

    missing, unexpected = on_rank0(read, f"loading {path!r}", "fix the checkpoint on rank 0; every rank stopped", group)
    src = global_rank0(group)
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


def _load_sharded(strategy: Strategy, core: nn.Module, path: str, strict: bool, group: Any,
                  check_permissions: bool) -> Any:
    """A plain state dict read on rank 0 into a ``shard="full"`` model: rank 0's whole tensors
    broadcast, each rank keeping its shards (the strategy's
    :meth:`~cpuddp.train.strategies.base.Strategy.load_whole_model_state`)."""
    box: dict = {}
    on_rank0(lambda: box.update(read_state(path, check_permissions)), f"loading {path!r}",
             "fix the checkpoint on rank 0; every rank stopped", group)
    return strategy.load_whole_model_state(core, box, strict)
