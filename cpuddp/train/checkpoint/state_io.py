"""Moving a training checkpoint's state in and out of the objects: the model and optimizer
through ``torch.distributed.checkpoint.state_dict`` (parameter names as keys, DTensor shards
for a ``fully_shard`` model), a sharded checkpoint through ``torch.distributed.checkpoint``
(DCP) into a directory every rank writes, and the rest (scheduler, scaler, data position,
random state) through their own ``state_dict``.  :mod:`cpuddp.train.checkpoint.save` and
:mod:`cpuddp.train.checkpoint.load` are the doors.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import CheckpointError
from cpuddp.ranks import group_rank_world

from ..common.rank0 import on_rank0
from . import rng
from .atomic import write_atomically
from .ckpt_dirs import TempDir, finish, make_temp_dir, read_token
from .paths import is_space_error, space_error, state_nbytes

__all__ = ["gather_state", "apply_state", "save_sharded", "load_sharded", "load_tensors", "TRAINER_FILE"]

#: In a sharded checkpoint's directory: everything but the model and optimizer (rank 0 writes it).
TRAINER_FILE = "trainer.pt"


def load_tensors(source: Any, path: str) -> Any:
    """``torch.load(source, weights_only=True)`` of the file at ``path``; a file that is not one
    torch saved (or holds objects that are not plain data) is a :class:`CheckpointError` naming it --
    never torch's advice to load it with ``weights_only=False``, which runs whatever it holds."""
    import pickle

    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path!r} is not a checkpoint: torch cannot read it as tensors and plain data "
                              f"({type(exc).__name__})", path=path,
                              fix="pass the directory save_checkpoint() wrote, or a file save_state_dict() or "
                                  "torch.save() wrote; a file from elsewhere is not loaded (it could run code)") from None


def gather_state(core: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[dict, Optional[dict]]:
    """The model's and optimizer's state dicts, keyed by parameter name (shards for DTensors).

    Every rank calls it: for an optimizer that has not stepped yet, torch creates its state
    with a zero step, which must happen on every rank alike."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(core)
    optim_sd = get_optimizer_state_dict(core, optimizer) if optimizer is not None else None
    return model_sd, optim_sd


def _missing(what: str, where: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint holds no {what} state, but {what}= was given",
                           fix=f"leave {what}= out when resuming this checkpoint, or save one with {what}=")


def apply_state(state: Mapping[str, Any], core: nn.Module, optimizer: Any, scheduler: Any, scaler: Any,
                loader: Any, rank: int, restore_rng: bool, *, full: bool) -> None:
    """Load ``state`` into the objects given.  ``full``: whole tensors into a sharded model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=full)
    set_model_state_dict(core, dict(state["model"]), options=opts)
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise _missing("optimizer", "")
        set_optimizer_state_dict(core, optimizer, state["optimizer"], options=opts)
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader)):
        if obj is None:
            continue
        if state.get(name) is None:
            raise _missing(name, "")
        obj.load_state_dict(state[name])
    states = state.get("rng") or []
    if restore_rng and rank < len(states):
        rng.restore(states[rank])


# --------------------------------------------------------------------------- sharded (DCP)


def _space_cause(exc: BaseException) -> Optional[BaseException]:
    """An ENOSPC/EDQUOT anywhere in ``exc`` (its causes, DCP's per-rank failures)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if is_space_error(e):
            return e
        todo += [e.__cause__, e.__context__]  # type: ignore[list-item]
        failures = getattr(e, "failures", None)
        if isinstance(failures, Mapping):
            for f in failures.values():
                todo += [f[0] if isinstance(f, tuple) else f]
    return None


def _run(fn: Callable[[], Any], group: Any, what: str, fix: str) -> Any:
    return fn() if group_rank_world(group)[1] == 1 else on_rank0(fn, what, fix, group)


def _everyone_sees(tmp: str, token: str, group: Any) -> None:
    """Every rank must read rank 0's token in ``tmp``: a sharded checkpoint needs a shared directory."""
    blind = torch.tensor([0 if read_token(tmp) == token else 1], dtype=torch.int64)
    if group_rank_world(group)[1] > 1:
        dist.all_reduce(blind, group=group)
    if int(blind.item()):
        raise CheckpointError(
            f"{int(blind.item())} rank(s) cannot see {tmp!r}, which rank 0 created: a sharded model's "
            "checkpoint is written by every rank into one directory", path=tmp,
            fix="save to a directory on a file system every node mounts at the same path (NFS, Lustre, GPFS)")


def save_sharded(target: str, tensors: Mapping[str, Any], trainer: dict[str, Any], group: Any,
                 check_permissions: bool, prepare: Callable[[], str], prune: Callable[[str], Any]) -> None:
    """Every rank writes its shards of ``tensors`` into a temporary directory through DCP;
    rank 0 adds ``trainer`` and renames the directory to ``target`` (:mod:`.ckpt_dirs`).
    ``prepare`` (rank 0, first: the directory checked, made and held; it returns the directory's
    real path) and ``prune`` (rank 0, last, given that path) are the door's.  Rank 0 makes, fills
    and renames the temporary directory through the real path; the ranks write their shards
    through the path as given (checked whole by ``prepare``: every rank, on any node, names it
    alike), and each must find rank 0's token there."""
    import torch.distributed.checkpoint as dcp

    from ..common.objects import without_numpy

    without_numpy()  # DCP plans through torch's object collectives
    held: list[TempDir] = []
    directory, name = os.path.split(target)
    fix = f"make {directory!r} writable on every rank's host (free space, permissions); every rank stopped"

    def begin() -> list[str]:
        real = prepare()
        held.append(make_temp_dir(real, name))
        return [os.path.join(directory, os.path.basename(held[0].path)), held[0].token]

    def end() -> str:
        real = os.path.dirname(held[0].path)
        write_atomically(os.path.join(held[0].path, TRAINER_FILE), lambda f: torch.save(trainer, f),
                         check_permissions=check_permissions)
        finish(held[0], os.path.join(real, name))
        prune(real)
        return target

    try:
        tmp, token = _run(begin, group, f"starting checkpoint {target!r}", fix)
        _everyone_sees(tmp, token, group)
        try:
            dcp.save(dict(tensors), checkpoint_id=tmp, process_group=group)
        except Exception as exc:
            cause = _space_cause(exc)
            if cause is not None:
                raise space_error(target, state_nbytes(dict(tensors)), 0, cause) from exc
            raise
        _run(end, group, f"finishing checkpoint {target!r}", fix)
    finally:
        for t in held:
            t.close(remove=os.path.basename(t.path) != name)  # finish() renamed it to the target


def load_sharded(where: str, core: nn.Module, optimizer: Any, group: Any) -> dict[str, Any]:
    """Read a sharded checkpoint's model (and optimizer) into this model's own layout, whatever
    the layout and world size that saved it (DCP reshards)."""
    import torch.distributed.checkpoint as dcp

    from ..common.objects import without_numpy

    without_numpy()  # DCP plans through torch's object collectives
    model_sd, optim_sd = gather_state(core, optimizer)
    wanted: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        wanted["optimizer"] = optim_sd
    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process", category=UserWarning)
        dcp.load(wanted, checkpoint_id=where, process_group=None if no_dist else group, no_dist=no_dist)
    return {"model": wanted["model"], "optimizer": wanted.get("optimizer")}
