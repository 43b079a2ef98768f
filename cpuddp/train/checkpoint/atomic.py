"""Writing a checkpoint file so that a crash at any moment leaves the old one or the new one.

:func:`write_atomically` writes through a temporary file in the target's directory, named
``.cpuddp-<target>.<random>.pt`` and created ``0600`` (only this user can read the weights),
then: ``fsync`` the file, ``rename`` it over the target (atomic on POSIX: a reader sees the old
file or the new one, never a mix), ``fsync`` the directory (so the rename itself survives a
power cut).  A save that raises removes its temporary file.

A save that is killed (SIGKILL, the OOM killer, a node lost) cannot clean up after itself, so
the next save in that directory does (:func:`remove_leftovers`).  It removes only what is
certainly a dead save's: a regular file named ``.cpuddp-*.pt``, owned by this user, that no
process holds locked.  Every writer holds an exclusive ``flock`` on its temporary file from
creation to rename, and the kernel drops the lock when its process dies, so a save in flight
(this job's or another's, in another PID namespace too) is never touched.

Before anything is written, the directory is checked whole
(:func:`cpuddp.train.checkpoint.paths.checked_entry`: refused when another user could change it or
redirect it with a symbolic link) and created ``0700`` when missing; the temporary file, the rename
and the fsync then go through its real path (every link resolved), the one checked.  A full disk
(``ENOSPC``, ``EDQUOT``) -- seen before writing when the file system reports less room than
the checkpoint needs, or while writing -- is a :class:`~cpuddp.errors.CheckpointError` saying
"no space left" with the path and the size (torch's own message, ``unexpected pos 832 vs
726``, names neither).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
from typing import Any, BinaryIO, Callable, Optional

from .paths import check_free_space, checked_entry, is_space_error, space_error

__all__ = ["write_atomically", "remove_leftovers", "is_temp_name", "fsync_directory", "TEMP_PREFIX", "TEMP_SUFFIX"]

TEMP_PREFIX = ".cpuddp-"
TEMP_SUFFIX = ".pt"
_TEMP_NAME = re.compile(r"\A\.cpuddp-.*\.pt\Z", re.DOTALL)


def is_temp_name(name: str) -> bool:
    """Is ``name`` (a file name, no directory) one of our temporary checkpoint files?"""
    return bool(_TEMP_NAME.match(name))


def _open_locked_temp(directory: str, target: str) -> tuple[int, str]:
    """A new ``0600`` temporary file in ``directory``, exclusively locked: (fd, path).

    A cleaner may lock and remove the file between its creation and our lock (it then looks
    like a dead save's); we notice that the name no longer points at our file and try again.
    """
    for _ in range(10):
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{target}.", suffix=TEMP_SUFFIX, dir=directory)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(tmp, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, tmp
        os.close(fd)
    raise OSError(errno.EAGAIN, f"could not keep a temporary file in {directory!r} (something removes them)")


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable.  File systems that cannot fsync a directory
    (EINVAL/ENOTSUP) are skipped; a real I/O error is raised."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(dfd)


class _Counting:
    """A file wrapper that counts the bytes written and keeps the ``OSError`` a write raised
    (torch's writer replaces it with a message that names neither the errno nor the path)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.written = 0
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.written += len(memoryview(data).cast("B")) if n is None else n
        return n if n is not None else 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _space_cause(exc: BaseException, counter: _Counting) -> Optional[OSError]:
    if counter.error is not None and is_space_error(counter.error):
        return counter.error
    return exc if is_space_error(exc) else None  # type: ignore[return-value]


def write_atomically(path: str, write: Callable[[BinaryIO], None], *, needed: Optional[int] = None,
                     check_permissions: bool = True) -> None:
    """Call ``write(f)`` on a locked temporary file, fsync it, rename it to ``path``, fsync
    the directory.  On any failure (or interrupt) the temporary file is removed and ``path``
    is left as it was.  ``needed``: the bytes the file will take, when known (for the
    free-space check and the error).  ``check_permissions=False`` warns about a directory
    another user can change instead of refusing it."""
    target = checked_entry(path, check_permissions=check_permissions, make=True)
    directory = os.path.dirname(target)
    check_free_space(path, needed)
    remove_leftovers(directory)
    fd, tmp = _open_locked_temp(directory, os.path.basename(target))
    renamed = False
    counter: Optional[_Counting] = None
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            counter = _Counting(f)
            write(counter)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        renamed = True
        fsync_directory(directory)
    except Exception as exc:
        cause = _space_cause(exc, counter or _Counting(None))  # type: ignore[arg-type]
        if cause is not None:
            raise space_error(path, needed, counter.written if counter else 0, cause) from exc
        raise
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        os.close(fd)  # drops the lock, after the rename or the removal


def _remove_if_dead(directory: str, name: str, uid: int) -> bool:
    """Remove ``directory/name`` when it is a regular file owned by ``uid`` that nobody holds
    locked (its writer died).  Never follows a symlink; True when removed."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone already, a symlink (ELOOP), unreadable: not ours to judge
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a save in flight holds it
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # replaced under us
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_leftovers(directory: str) -> list[str]:
    """Remove the temporary files of killed saves in ``directory`` (see the module docstring);
    return the names removed.  Never raises: a leftover that cannot be judged is left."""
    uid = os.geteuid()
    try:
        names = sorted(n for n in os.listdir(directory) if is_temp_name(n))
    except OSError:
        return []
    return [n for n in names if _remove_if_dead(directory, n, uid)]
