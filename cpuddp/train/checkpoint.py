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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
from typing import BinaryIO, Callable

__all__ = ["write_atomically", "remove_leftovers", "is_temp_name", "TEMP_PREFIX", "TEMP_SUFFIX"]

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


def _fsync_directory(directory: str) -> None:
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


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a locked temporary file, fsync it, rename it to ``path``, fsync
    the directory.  On any failure (or interrupt) the temporary file is removed and ``path``
    is left as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_leftovers(directory)
    fd, tmp = _open_locked_temp(directory, os.path.basename(path))
    renamed = False
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        renamed = True
        _fsync_directory(directory)
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
