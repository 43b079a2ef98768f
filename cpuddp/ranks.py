"""Where this process sits -- rank, world size, local rank -- before, without or after init; rank-0 output.

``cpuddp.get_rank()``, ``get_world_size()``, ``get_local_rank()`` and ``get_local_world_size()``
answer at any time, so a script can ask before :func:`cpuddp.init_distributed`:

* with a process group (cpuddp's, or one the script formed with
  ``torch.distributed.init_process_group``): the group's rank and size; the local rank and
  size are those :func:`cpuddp.init_distributed` fixed from the hosts, else the launcher's;
* without one, under a launcher (torchrun, mpirun/mpiexec, srun, Kubeflow): the launcher's
  values, read by :func:`cpuddp.launchers.detect` from ``os.environ``;
* in plain ``python``: rank 0 of 1.

A half-set launcher environment raises :class:`~cpuddp.errors.LauncherEnvError`, as
``init_distributed()`` would: partial information is an error, never a silent rank 0.

:func:`print0` and :func:`log0` are ``print`` and ``logging`` on global rank 0 only (what
accelerate's ``accelerator.print`` and Lightning's ``rank_zero_info`` do), so a line is
written once per job, not once per rank -- before init too.  :func:`log_here` is
:func:`log0`'s line on whichever rank its caller chose (a group's rank 0).

This module never imports torch: without ``torch.distributed`` in ``sys.modules`` there can be
no process group, so the answer comes from the environment.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, Union

__all__ = [
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "print0",
    "log0",
    "log_here",
    "group_rank_world",
    "require_group",
]


def _dist() -> Any:
    """``torch.distributed`` when a default process group exists, else None (torch not imported:
    no group can exist, and this module does not import it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def group_rank_world(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the world) and its size; ``(0, 1)`` without a
    process group -- the group's view, which the loop helpers use."""
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def require_group(what: str) -> None:
    """Raise when the launcher says this process is one rank of several but no process group
    exists: ``what`` (``prepare()``, ``shard()``) would then run this rank alone, training a model
    of its own on every batch, unsynchronised with the others, and exit 0."""
    if _dist() is not None:
        return
    from cpuddp.errors import LauncherEnvError, PrepareError
    from cpuddp.launchers.registry import detect

    try:
        env = detect(os.environ)
    except LauncherEnvError:
        return  # init_distributed() says what is wrong with these variables
    if env.world_size > 1:
        said = env.sources.get("world_size")
        var = f" ({said.detail}={env.world_size})" if said is not None and said.from_variable else ""
        raise PrepareError(
            f"{what}: the launcher says this is rank {env.rank} of {env.world_size}{var}, but no process group "
            f"exists: {what} would train this rank alone, on every batch, unsynchronised with the other ranks",
            fix="call cpuddp.init_distributed() before it (or torch.distributed.init_process_group())")


def _where() -> Any:
    """The :class:`~cpuddp.launchers.env.DistEnv` that describes this process: cpuddp's after
    :func:`~cpuddp.init_distributed` (local rank fixed from the hosts), else the launcher's."""
    from cpuddp.launchers.registry import detect

    from . import distributed

    env = distributed.get_env()
    return env if env is not None else detect(os.environ)


def get_rank() -> int:
    """This process's global rank: the process group's, else the launcher's, else 0."""
    dist = _dist()
    return dist.get_rank() if dist is not None else _where().rank


def get_world_size() -> int:
    """The number of ranks: the process group's, else the launcher's, else 1."""
    dist = _dist()
    return dist.get_world_size() if dist is not None else _where().world_size


def get_local_rank() -> int:
    """This process's rank among the ranks on its node (init's, else the launcher's, else 0)."""
    return _where().local_rank


def get_local_world_size() -> int:
    """The number of ranks on this node (init's, else the launcher's, else 1)."""
    return _where().local_world_size


def get_node_rank() -> int:
    """This process's node among the job's nodes, from 0 (init's, else the launcher's, else 0)."""
    return _where().node_rank


def print0(*args: Any, **kwargs: Any) -> None:
    """``print(*args, **kwargs)`` on global rank 0 only; ``flush`` defaults to True.

    The rank is :func:`get_rank`'s, so this holds before ``init_distributed()`` too.  (The
    flush: a launcher pipes each rank's stdout, and a buffered line would appear late.)  The
    line goes out in one write, so other ranks' output in the same pipe cannot split it.
    """
    if get_rank() != 0:
        return
    sep, end = kwargs.pop("sep", " "), kwargs.pop("end", "\n")
    file, flush = kwargs.pop("file", None) or sys.stdout, kwargs.pop("flush", True)
    if kwargs:
        raise TypeError(f"print0() got an unexpected keyword argument {next(iter(kwargs))!r}")
    file.write((" " if sep is None else sep).join(map(str, args)) + ("\n" if end is None else end))
    if flush:
        file.flush()


Logger = Union[logging.Logger, logging.LoggerAdapter, str, None]


def log0(msg: object, *args: Any, level: Union[int, str] = logging.INFO, logger: Logger = None,
         **kwargs: Any) -> None:
    """``logger.log(level, msg, *args, **kwargs)`` on global rank 0 only.

    ``logger``: a logger, or a logger's name; default the root logger (as ``logging.info``
    uses).  ``level``: a number or a name (``"WARNING"``).  The record names the caller's
    file and line, not this function's.  Where logging is not configured at all (no handler on
    the logger or above it), a message at INFO or above is printed to stderr instead: Python
    would drop an INFO record there, and the README's ``log0`` line would print nothing.
    """
    lvl = _level(level)
    if get_rank() != 0:
        return
    kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
    log_here(msg, *args, level=lvl, logger=logger, **kwargs)


def log_here(msg: object, *args: Any, level: Union[int, str] = logging.INFO, logger: Logger = None,
             **kwargs: Any) -> None:
    """:func:`log0`'s line on this rank, whatever its global rank: for a caller that has chosen
    the one rank that speaks itself (rank 0 of the group it was given).  The same rule: the
    record names the caller's line, and where logging is not configured a message at INFO or
    above is printed to stderr."""
    lvl = _level(level)
    target = logging.getLogger(logger) if logger is None or isinstance(logger, str) else logger
    if lvl >= logging.INFO and not target.hasHandlers():
        print(str(msg) % args if args else str(msg), file=sys.stderr, flush=True)
        return
    kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
    target.log(lvl, msg, *args, **kwargs)


def _level(level: Union[int, str]) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    value: Optional[int] = logging.getLevelName(level.upper()) if isinstance(level, str) else None
    if not isinstance(value, int):
        raise ValueError(
            f"log0(level={level!r}): not a logging level. Pass a number or one of "
            "'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'."
        )
    return value
