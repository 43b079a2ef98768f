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

from cpuddp._package import __version__
from cpuddp.errors import CheckpointError
from cpuddp.launchers.report import note_checkpoint
from cpuddp.ranks import group_rank_world

from ..common.data import ShardedLoader
from ..common.rank0 import all_gather_bytes, broadcast_bytes, on_rank0
from ..sharding.distribute import is_sharded, unwrap
from . import rng
from .atomic import write_atomically
from .ckpt_dirs import remove_dead_dirs
from .ckpt_index import checkpoint_name, checkpoints, note_new, prune, supersede
from .ckpt_lock import hold_directory, while_free
from .paths import check_directory, checked_entry, open_own_file, private_directory, state_nbytes
from .resume_io import apply_state, gather_state, load_sharded, load_tensors, save_sharded

__all__ = ["save_checkpoint", "load_checkpoint", "Resumed", "list_checkpoints", "FORMAT"]

_log = logging.getLogger("cpuddp.checkpoint")

FORMAT = "cpuddp-checkpoint/1"


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


# --------------------------------------------------------------------------- arguments


def _kind(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_args(fn: str, directory: Any, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
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
    path = _check_args("save_checkpoint", directory, model, optimizer, scheduler, scaler, loader)
    _check_step(step, epoch, keep)
    core = unwrap(model)
    _, world = group_rank_world(group)
    model_sd, optim_sd = gather_state(core, optimizer)  # on every rank: the optimizer's lazy init matches
    blobs = all_gather_bytes(rng.to_bytes(rng.capture()), group) if world > 1 else [rng.to_bytes(rng.capture())]
    trainer = _trainer_state(step, epoch, extra, scheduler, scaler, loader, blobs, world)
    _check_loadable({k: trainer[k] for k in ("extra", "scheduler", "scaler")})
    sharded = is_sharded(core)
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
    """Say, once (rank 0), that nothing is resumed: a mistyped directory must not restart at step 0 silently."""
    if rank != 0:
        return
    if os.path.lexists(path):
        _log.info("no checkpoint in %s: starting at step 0", path)
    else:
        _log.warning("no checkpoint in %s (it does not exist): starting at step 0; if you meant to resume, check "
                     "the path", path)


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
    path = _check_args("load_checkpoint", directory, model, optimizer, scheduler, scaler, loader)
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
    apply_state(state, core, optimizer, scheduler, scaler, loader, rank, restore_rng, full=is_sharded(core)
                and kind == "file")
    saved_world = int(state.get("world_size", 1))
    if saved_world != world and rank == 0:
        _tell_world(saved_world, world)
    _log.info("resumed from %s: step %s, epoch %s (saved by %d rank(s), now %d)", where, state["step"],
              state.get("epoch"), saved_world, world)
    note_checkpoint(int(state["step"]), where)
    return Resumed(step=int(state["step"]), epoch=state.get("epoch"), extra=state.get("extra"), path=where,
                   saved_world_size=saved_world, world_size=world)

