"""Resuming a training checkpoint: :func:`load_checkpoint` restores the newest one (or the one
named) into the objects given; :func:`list_checkpoints` lists this run's line.

Usage::

    state = cpuddp.load_checkpoint("ckpt", model=model, optimizer=optimizer, scheduler=scheduler,
                                   loader=loader)                   # None: nothing saved yet
    step = state.step if state else 0

What a checkpoint holds, where, and whose: :mod:`cpuddp.train.checkpoint.save`.

**Resuming**: at the same world size a resumed fp32 run continues bit-identically (the same
batches, random numbers and optimizer steps; tested on 2 ranks).  At another world size the
model, optimizer, scheduler, scaler, step, epoch and extras carry over exactly; the data
position carries over as the samples consumed in the epoch, the rest dealt over the new ranks
(none repeated or skipped); ranks that existed get their random state back, new ones keep
their own.  The per-rank batch, and so the global batch, is what the new job uses.

Both calls are collective (every rank calls them) and refuse an unsafe place
(:mod:`cpuddp.train.checkpoint.paths`).
"""

from __future__ import annotations

import io
import logging
import os
import stat
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from cpuddp.errors import CheckpointError
from cpuddp.launchers.report import note_checkpoint
from cpuddp.ranks import group_rank_world, log_here

from ..common.data import ShardedLoader
from ..common.rank0 import broadcast_bytes, on_rank0
from ..strategies.base import unwrap
from ..strategies.modes import strategy_of
from .arguments import FORMAT, check_args
from .ckpt_dirs import remove_dead_dirs
from .ckpt_index import checkpoints
from .ckpt_lock import while_free
from .paths import check_directory, checked_entry, open_own_file
from .state_io import apply_state, load_sharded, load_tensors

__all__ = ["load_checkpoint", "Resumed", "list_checkpoints"]

_log = logging.getLogger("cpuddp.checkpoint")


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_checkpoint` restored: where to go on from, and the user's extras."""

    step: int
    epoch: Optional[int]
    extra: Any
    path: str
    saved_world_size: int
    world_size: int

    @property
    def same_world(self) -> bool:
        """Saved at this world size (then the run continues bit-identically in fp32)."""
        return self.saved_world_size == self.world_size


# --------------------------------------------------------------------------- the directory


def list_checkpoints(directory: Union[str, os.PathLike], *, check_permissions: bool = True) -> list[str]:
    """The checkpoints of this run's line in ``directory``, oldest first (paths under ``directory``
    as given; complete ones that cpuddp wrote, owned by you: :mod:`cpuddp.train.checkpoint.ckpt_index`),
    listed in the checked directory (:func:`cpuddp.train.checkpoint.paths.check_directory`)."""
    path = os.fspath(directory)
    real = check_directory(path, check_permissions=check_permissions)
    found = checkpoints(real, check_permissions=check_permissions)
    return [os.path.join(path, os.path.basename(c.path)) for c in found]


def _is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


# --------------------------------------------------------------------------- loading


def _find(path: str, check_permissions: bool) -> Optional[list[str]]:
    """``[kind, checkpoint path]`` for ``path`` (a checkpoint, or a directory of them: the
    newest of this run's line), or None when there is none yet.  Its directories are checked
    whole and looked into by their real path (:func:`cpuddp.train.checkpoint.paths.check_directory`:
    no link another user could have made); ``path`` itself is never a symlink.  The path
    returned is under ``path`` as given (every rank reads a sharded one)."""
    real = checked_entry(path, check_permissions=check_permissions)
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode) and os.path.isdir(real) and not _is_dcp_dir(real):
        # a directory of checkpoints through a link: followed where the walk trusts it
        # (``$HOME/ckpt -> /scratch/me/ckpt``), refused where another user could have made it
        real = check_directory(path, check_permissions=check_permissions)
        st = os.lstat(real)
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{path!r} is a symbolic link: a checkpoint is never loaded through one (whoever "
                              "can make the link chooses what is resumed)", path=path,
                              fix=f"pass the checkpoint or directory itself ({os.path.realpath(path)!r}), after "
                                  "checking that it is yours")
    if stat.S_ISREG(st.st_mode):
        return ["file", path]
    if _is_dcp_dir(real):
        return ["sharded", path]
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path!r} is neither a checkpoint nor a directory ({stat.filemode(st.st_mode)})",
                              path=path, fix="pass the directory save_checkpoint() wrote, or one checkpoint in it")
    check_directory(real, check_permissions=check_permissions)
    busy = while_free(real, lambda: remove_dead_dirs(real))  # a killed replacement's checkpoint restored
    if busy:
        _log.warning("another job writes checkpoints in %r (%s holds its lock): reading its newest checkpoint; this "
                     "process cannot save there while that job runs", path, busy)
    found = checkpoints(real, check_permissions=check_permissions, others=not check_permissions)
    if not found:
        return None
    return ["sharded" if found[-1].sharded else "file", os.path.join(path, os.path.basename(found[-1].path))]


def _say_fresh(path: str, rank: int) -> None:
    """Say, once (the group's rank 0), that nothing is resumed: a mistyped directory must not
    restart at step 0 silently.  A directory that does not exist is a warning -- a first run
    and a mistyped path look alike from here, and a run that saves there resumes next time, so
    only a path nothing is ever saved to warns run after run."""
    if rank != 0:
        return
    if os.path.lexists(path):
        log_here("cpuddp: no checkpoint in %s yet: starting at step 0", path, logger=_log)
    else:
        log_here("cpuddp: no checkpoint in %s (it does not exist): starting at step 0, as a first run does; if this "
                 "run should resume, check the path (the directory save_checkpoint() wrote)", path,
                 level=logging.WARNING, logger=_log)


def _say_resumed(where: str, state: dict, saved: int, world: int) -> None:
    """The group's rank 0's one line for a resume: which checkpoint, which step (and epoch), at
    which world size."""
    epoch = state.get("epoch")
    log_here("cpuddp: resumed from %s at step %d%s (saved by %d rank(s), now %d)", where, int(state["step"]),
             "" if epoch is None else f", epoch {epoch}", saved, world, logger=_log)


def _tell_world(saved: int, world: int) -> None:
    """Rank 0's line when the world size changed (what carries over, what does not)."""
    _log.warning(
        "resuming at world size %d a checkpoint saved at world size %d: the model, optimizer, scheduler, "
        "scaler, step, epoch and extras carry over exactly; the data position (loader=) carries over as the "
        "samples consumed in the epoch, the rest dealt over the %d ranks (none repeated or skipped); %s; the "
        "per-rank batch is this job's, so the global batch differs, and the run is not bit-identical to one "
        "that went on at world size %d", world, saved, world,
        "ranks %d..%d start from their own random state" % (saved, world - 1) if world > saved
        else "the random state of ranks %d..%d is dropped" % (world, saved - 1), saved)


def _read_bytes(path: str, check_permissions: bool) -> bytes:
    with open_own_file(path, check_permissions=check_permissions) as f:
        return f.read()


def load_checkpoint(
    directory: Union[str, os.PathLike],
    *,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    scaler: Any = None,
    loader: Optional[ShardedLoader] = None,
    group: Any = None,
    restore_rng: bool = True,
    check_permissions: bool = True,
) -> Optional[Resumed]:
    """Restore the newest checkpoint in ``directory`` (or the checkpoint ``directory`` names)
    into the objects given; None when there is none yet (a fresh start).

    Every rank calls it; only rank 0 needs to see a one-file checkpoint (it reads and sends
    it), every rank must see a sharded one.  ``restore_rng=False`` leaves the random state
    as it is.  A file or directory another user can change is refused
    (``check_permissions=False``: a warning).
    """
    path = check_args("load_checkpoint", directory, model, optimizer, scheduler, scaler, loader)
    core = unwrap(model)
    rank, world = group_rank_world(group)
    fix = f"check {path!r} on rank 0's host; every rank stopped"
    found = (_find(path, check_permissions) if world == 1
             else on_rank0(lambda: _find(path, check_permissions), f"finding a checkpoint in {path!r}", fix, group))
    if found is None:
        _say_fresh(path, rank)
        return None
    kind, where = found
    meta = os.path.join(where, "trainer.pt") if kind == "sharded" else where
    if world == 1:
        data = _read_bytes(meta, check_permissions)
    else:
        mine: list[bytes] = []
        on_rank0(lambda: mine.append(_read_bytes(meta, check_permissions)) or len(mine[0]),
                 f"reading {meta!r}", fix, group)
        data = broadcast_bytes(mine[0] if rank == 0 else None, group)
    state = load_tensors(io.BytesIO(data), meta)
    del data
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{where!r} is not a cpuddp training checkpoint (no format {FORMAT!r})", path=where,
                              fix="pass the directory save_checkpoint() wrote; a file of save_state_dict() "
                                  "loads with cpuddp.load_state_dict(model, path)")
    if kind == "sharded":
        state.update(load_sharded(where, core, optimizer, group))
    apply_state(state, core, optimizer, scheduler, scaler, loader, rank, restore_rng,
                full=strategy_of(model).shards_parameters and kind == "file")
    saved_world = int(state.get("world_size", 1))
    if rank == 0:
        if saved_world != world:
            _tell_world(saved_world, world)
        _say_resumed(where, state, saved_world, world)
    note_checkpoint(int(state["step"]), where)
    return Resumed(step=int(state["step"]), epoch=state.get("epoch"), extra=state.get("extra"), path=where,
                   saved_world_size=saved_world, world_size=world)
