"""A training checkpoint: one call saves everything a run needs to go on, one call resumes it.

Usage::

    loader = cpuddp.shard(dataset, batch_size=32)
    state = cpuddp.load_checkpoint("ckpt", model=model, optimizer=optimizer, scheduler=scheduler,
                                   loader=loader)                   # None: nothing saved yet
    step = state.step if state else 0
    while step < total_steps:
        for batch in loader:                                        # a resumed epoch goes on mid-way
            ...
            step += 1
            if step % 500 == 0:
                cpuddp.save_checkpoint("ckpt", step=step, model=model, optimizer=optimizer,
                                       scheduler=scheduler, loader=loader, keep=3)

What is kept: the model, the optimizer, the LR scheduler, a ``torch.amp.GradScaler`` (each
when given), ``step``, ``epoch``, the data position of a :class:`~cpuddp.ShardedLoader`
(its epoch and the samples consumed, :mod:`cpuddp.train.common.data`), every rank's random state
(Python, torch, numpy when loaded: :mod:`cpuddp.train.checkpoint.rng`) and ``extra`` (tensors, numbers,
strings, lists, dicts: what ``torch.load(weights_only=True)`` reads).  The model and optimizer
go through ``torch.distributed.checkpoint.state_dict`` (keys are parameter names), so the same
calls work for a DDP model, a plain one and one sharded by ``fully_shard`` (FSDP2).

**On disk** (``directory/step-000000500.pt`` or ``directory/step-000000500/``): a model whose
parameters are all whole (DDP, one process) is one file that rank 0 writes, as
:func:`cpuddp.save_state_dict` writes (atomic rename, ``0600``, fsynced; only rank 0 needs the
directory).  A sharded model (DTensor parameters) is a directory that every rank writes its
shards into through ``torch.distributed.checkpoint`` (DCP), made atomically
(:mod:`cpuddp.train.checkpoint.ckpt_dirs`); it needs a directory every rank sees.  Either kind loads into
either kind of model, at any world size.  The newest ``keep`` checkpoints stay, older ones go.

**Whose checkpoints** (:mod:`cpuddp.train.checkpoint.ckpt_index`): a directory's record lists what cpuddp
wrote there; only those, owned by this user and no symlink, count for ``keep=``, are removed,
or are resumed from the directory.  They form one line: a save of step ``T`` moves the ones
above ``T`` (a line abandoned by resuming from an earlier step) into
``abandoned-at-step-T.<random>/``, so ``keep=`` never removes the checkpoint just written and
``load_checkpoint(directory)`` resumes the newest of the current line.  **One writer**
(:mod:`cpuddp.train.checkpoint.ckpt_lock`): the first save of a job in a directory holds it until the
process exits; another job's save there gets an error naming that job's host and pid (its load
a warning).

Loading is :mod:`cpuddp.train.checkpoint.load`; both calls are collective (every rank calls
them) and refuse an unsafe place (:mod:`cpuddp.train.checkpoint.paths`).
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from cpuddp._package import __version__
from cpuddp.errors import CheckpointError
from cpuddp.launchers.report import note_checkpoint
from cpuddp.ranks import group_rank_world

from ..common.data import ShardedLoader
from ..common.rank0 import all_gather_bytes, on_rank0
from ..strategies.base import unwrap
from ..strategies.modes import strategy_of
from . import rng
from .arguments import FORMAT, check_args
from .atomic import write_atomically
from .ckpt_dirs import remove_dead_dirs
from .ckpt_index import checkpoint_name, note_new, prune, supersede
from .ckpt_lock import hold_directory
from .paths import private_directory, state_nbytes
from .state_io import gather_state, save_sharded

__all__ = ["save_checkpoint"]

_log = logging.getLogger("cpuddp.checkpoint")


def _check_step(step: Any, epoch: Any, keep: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"cpuddp.save_checkpoint(): step= must be an int >= 0 (the steps done); got {step!r}",
                              fix="pass step=the number of optimizer steps taken so far")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise CheckpointError(f"cpuddp.save_checkpoint(): epoch= must be an int or None; got {epoch!r}",
                              fix="pass epoch=the current epoch number, or leave it out")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"cpuddp.save_checkpoint(): keep= must be an int >= 1 or None (keep all); got {keep!r}",
                              fix="keep=3 keeps the newest three checkpoints")


def _check_loadable(parts: dict[str, Any]) -> None:
    """Each part must load back with ``weights_only=True`` (how a checkpoint is read): try it
    now, so a run learns at its first save, not when it resumes."""
    for name, value in parts.items():
        if value is None:
            continue
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
        except Exception as exc:
            text = str(exc).strip()
            why = next((line.strip() for line in text.splitlines() if "Unsupported global" in line),
                       text.splitlines()[0] if text else "")
            what = "extra=" if name == "extra" else f"the {name}'s state_dict()"
            raise CheckpointError(
                f"cpuddp.save_checkpoint(): {what} cannot be stored safely: {type(exc).__name__}: {why}",
                fix="keep it to tensors, numbers, strings, None, and lists, tuples and dicts of them (what "
                    "torch.load(weights_only=True) reads); put other objects' state in extra= as plain data"
            ) from None


# --------------------------------------------------------------------------- the directory


def _take_directory(directory: str, check_permissions: bool, step: int, name: str) -> str:
    """Rank 0, before a save: the directory safe and made, held by this job, a killed save's
    leftovers cleaned (a replaced checkpoint restored), the abandoned line moved aside, the
    new name recorded.  Returns its real path (every link resolved), checked whole: the save,
    the record and ``keep=`` work through it, never through a link another user could change."""
    real = private_directory(directory, check_permissions=check_permissions)
    hold_directory(real)
    remove_dead_dirs(real)
    supersede(real, step, check_permissions)
    note_new(real, name, check_permissions)
    return real


# --------------------------------------------------------------------------- saving


def _trainer_state(step: int, epoch: Optional[int], extra: Any, scheduler: Any, scaler: Any,
                   loader: Optional[ShardedLoader], rng_states: list[bytes], world: int) -> dict[str, Any]:
    """Everything but the model and optimizer, as plain data."""
    return {
        "format": FORMAT, "step": step, "epoch": epoch, "extra": extra, "world_size": world,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "loader": loader.state_dict() if loader is not None else None,
        "rng": [rng.from_bytes(b) for b in rng_states],
        "versions": {"cpuddp": __version__, "torch": str(torch.__version__)},
    }


def save_checkpoint(
    directory: Union[str, os.PathLike],
    *,
    step: int,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    scaler: Any = None,
    loader: Optional[ShardedLoader] = None,
    epoch: Optional[int] = None,
    extra: Any = None,
    keep: Optional[int] = 3,
    group: Any = None,
    check_permissions: bool = True,
) -> str:
    """Save everything the run needs to go on as ``directory/step-<step>`` (see the module doc).

    Every rank calls it.  Returns the checkpoint's path on every rank.  ``keep``: how many of
    the newest checkpoints stay (None: all).  ``check_permissions=False``: warn about a
    directory another user can change instead of refusing it.  An error on rank 0 (a full
    disk, a permission) is raised on every rank.
    """
    path = check_args("save_checkpoint", directory, model, optimizer, scheduler, scaler, loader)
    _check_step(step, epoch, keep)
    core = unwrap(model)
    _, world = group_rank_world(group)
    model_sd, optim_sd = gather_state(core, optimizer)  # on every rank: the optimizer's lazy init matches
    blobs = all_gather_bytes(rng.to_bytes(rng.capture()), group) if world > 1 else [rng.to_bytes(rng.capture())]
    trainer = _trainer_state(step, epoch, extra, scheduler, scaler, loader, blobs, world)
    _check_loadable({k: trainer[k] for k in ("extra", "scheduler", "scaler")})
    sharded = strategy_of(model).shards_parameters  # a directory of every rank's shards (DCP)
    name = checkpoint_name(step, sharded=sharded)
    target = os.path.join(path, name)
    if sharded:
        save_sharded(target, {"model": model_sd, "optimizer": optim_sd}, trainer, group, check_permissions,
                     lambda: _take_directory(path, check_permissions, step, name),
                     lambda real: prune(real, keep, os.path.join(real, name), check_permissions))
        _log.info("checkpoint saved: %s (sharded, %d rank(s))", target, world)
        note_checkpoint(step, target)
        return target

    def write() -> str:
        real = _take_directory(path, check_permissions, step, name)
        state = dict(trainer, model=model_sd, optimizer=optim_sd)
        write_atomically(os.path.join(real, name), lambda f: torch.save(state, f), needed=state_nbytes(state),
                         check_permissions=check_permissions)
        prune(real, keep, os.path.join(real, name), check_permissions)
        return target

    if world == 1:
        write()
    else:
        on_rank0(write, f"saving checkpoint {target!r}",
                 f"make {path!r} writable on rank 0's host (free space, permissions); every rank stopped", group)
    _log.info("checkpoint saved: %s", target)
    note_checkpoint(step, target)
    return target
