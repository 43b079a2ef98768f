"""Where a checkpoint may be written and read: a place only this user controls, and a full disk named.

A checkpoint is code and data the next run loads, so a place another user can change is refused:

- :func:`check_directory`: the directory and every directory above it must be owned by this
  user or by root, and writable by nobody else -- unless it has the sticky bit (``/tmp``),
  which stops others from renaming or removing what they do not own.  Otherwise another
  user could replace the checkpoint (a group- or world-writable directory) or the whole
  directory under it (the same, one level up), and the next run would load their weights.
- :func:`open_own_file`: a file to load must be a regular file owned by this user (or root)
  and writable by nobody else, and is opened without following a symbolic link
  (``O_NOFOLLOW``: whoever can make a link would choose what is loaded); the check is made on
  the opened descriptor, so the file read is the file checked.

Both raise :class:`~cpuddp.errors.CheckpointError` naming the path, its owner and mode, and
the fix; with ``check_permissions=False`` they warn instead.

:func:`space_error` turns ``ENOSPC``/``EDQUOT`` into a :class:`CheckpointError` that says "no
space left", with the path and how much the checkpoint needs; :func:`check_free_space` says
it before a byte is written when the file system reports too little room.  Nothing here
imports torch.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import warnings
from typing import Any, Iterator, Optional

from cpuddp._units import format_size
from cpuddp.errors import CheckpointError

__all__ = ["check_directory", "open_own_file", "make_private_dirs", "space_error", "check_free_space",
           "is_space_error", "state_nbytes", "SPACE_ERRNOS"]

#: The errors that mean "the file system is full" (a quota counts).
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _ancestors(path: str) -> Iterator[str]:
    """``path`` and each directory above it, up to ``/``."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _problem(path: str, st: os.stat_result, uid: int, what: str) -> Optional[str]:
    """Why ``path`` lets another user change it (None when it does not)."""
    if st.st_uid not in (uid, 0):
        return f"{what} {path!r} is owned by {_owner(st.st_uid)}, not by you ({_owner(uid)})"
    writable = st.st_mode & _OTHERS_WRITE
    if writable and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        who = "everyone" if st.st_mode & stat.S_IWOTH else "its group"
        sticky = " without the sticky bit" if stat.S_ISDIR(st.st_mode) else ""
        return f"{what} {path!r} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by {who}{sticky}"
    return None


def _directory_problems(directory: str, uid: int) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for start in (os.path.abspath(directory), os.path.realpath(directory)):
        for d in _ancestors(start):
            if d in seen:
                continue
            seen.add(d)
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                continue  # made below, 0700
            if stat.S_ISLNK(st.st_mode):
                continue  # its directory is checked; so is where it points (realpath)
            why = _problem(d, st, uid, "directory")
            if why:
                problems.append(why)
    return problems


def _refuse(problems: list[str], path: str, fix: str, check_permissions: bool, stacklevel: int) -> None:
    if not problems:
        return
    msg = "; ".join(problems) + ": another user could replace the checkpoint"
    full_fix = f"{fix}; or pass check_permissions=False to accept it (with a warning)"
    if check_permissions:
        raise CheckpointError(msg, path=path, fix=full_fix)
    warnings.warn(f"cpuddp: {msg} (check_permissions=False: going on)", stacklevel=stacklevel)


def check_directory(directory: str, *, check_permissions: bool = True, stacklevel: int = 3) -> None:
    """Refuse (or warn about) a checkpoint directory another user can change; see the module doc."""
    problems = _directory_problems(directory, os.geteuid())
    _refuse(problems, directory,
            "save under a directory you own that only you can write (chmod go-w on the one named, "
            "or chmod +t to set its sticky bit)", check_permissions, stacklevel + 1)


def make_private_dirs(directory: str) -> None:
    """Create ``directory`` and any missing parent, each ``0700`` (only this user)."""
    missing = []
    for d in _ancestors(os.path.abspath(directory)):
        if os.path.isdir(d):
            break
        if os.path.lexists(d):
            raise CheckpointError(f"{d!r} is not a directory, so the checkpoint directory {directory!r} cannot be made",
                                  path=d, fix=f"remove or rename {d!r}, or save somewhere else")
        missing.append(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def open_own_file(path: str, *, check_permissions: bool = True, stacklevel: int = 3) -> Any:
    """Open ``path`` for reading (a binary file object) after checking, on the open descriptor,
    that only this user (or root) can have written it, and that its directories are safe."""
    check_directory(os.path.dirname(os.path.abspath(path)), check_permissions=check_permissions,
                    stacklevel=stacklevel + 1)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CheckpointError(f"{path!r} is a symbolic link: a checkpoint is never read through one (whoever "
                              "can make the link chooses what is loaded)", path=path,
                              fix=f"pass the file itself ({os.path.realpath(path)!r}) after checking it is yours"
                              ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path!r} is not a regular file (mode {stat.filemode(st.st_mode)})", path=path,
                                  fix="pass a checkpoint file that save_state_dict() or save_checkpoint() wrote")
        os.set_blocking(fd, True)
        problem = _problem(path, st, os.geteuid(), "file")
        _refuse([problem] if problem else [], path,
                "load only files you wrote yourself (chown them, or copy them into a directory of your own)",
                check_permissions, stacklevel + 1)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# --------------------------------------------------------------------------- space


def state_nbytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples walked; shared storage counted once)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "untyped_storage") and hasattr(x, "element_size"):
            try:
                storage = x.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, TypeError, NotImplementedError):  # a tensor without storage
                key, size = id(x), x.numel() * x.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


def free_bytes(directory: str) -> Optional[int]:
    """Bytes this user may still write on ``directory``'s file system (None when unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def is_space_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


def space_error(path: str, needed: Optional[int], written: int, exc: Optional[BaseException] = None) -> CheckpointError:
    """The "no space left" error for a save of ``path`` (``needed``: the checkpoint's size, when known)."""
    directory = os.path.dirname(os.path.abspath(path))
    free = free_bytes(directory)
    quota = isinstance(exc, OSError) and exc.errno == errno.EDQUOT
    need = f"needs about {format_size(needed)}" if needed else f"needed more than the {format_size(written)} written"
    msg = (f"no space left{' (disk quota exceeded)' if quota else ''} saving {path!r}: the checkpoint {need}"
           + (f", {format_size(written)} were written when the disk filled" if needed and written else "")
           + (f"; {format_size(free)} free on that file system" if free is not None else "")
           + "; the previous checkpoint is untouched")
    return CheckpointError(msg, path=path, fix=f"free space under {directory!r} (or raise the quota), save to "
                                               "another directory, or keep fewer checkpoints (keep=)")


def check_free_space(path: str, needed: Optional[int]) -> None:
    """Raise the "no space left" error at once when the file system reports less room than ``needed``."""
    if not needed:
        return
    free = free_bytes(os.path.dirname(os.path.abspath(path)))
    if free is not None and free < needed:
        raise space_error(path, needed, 0)
