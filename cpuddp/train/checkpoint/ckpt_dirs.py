"""A checkpoint that is a directory (a sharded model's, written by every rank): made atomically.

The ranks write into a temporary directory beside the target, ``.cpuddp-<name>.<random>.tmp``
(``0700``), which rank 0 creates and holds an exclusive ``flock`` on (its ``.lock`` file)
until the end.  When every rank is done, rank 0 makes the files ``0600``, fsyncs them and the
directory, renames it to the target and fsyncs the parent.  A reader sees the old checkpoint or the new one.
A save that is killed leaves its temporary directory; the next save (or load) removes it once no
process holds its lock (as :mod:`cpuddp.train.checkpoint.atomic` does for files).

Replacing a directory of the same name takes two renames (POSIX cannot rename over a directory
that is not empty): the old one to ``.cpuddp-<name>.old.<random>.tmp``, then the new one into
place; after that the old one's ``.metadata`` goes first, then the rest.  A process killed
between the two renames leaves the step only in the ``.old`` directory: the next save or load
(:func:`remove_dead_dirs`) renames a complete ``.old`` directory whose name is free back into
place, and removes one whose replacement landed.  So a crash at any point leaves the step
loadable, the old checkpoint or the new one.  Every rank must see a directory checkpoint's
directory: :func:`cpuddp.train.checkpoint.state_io.save_sharded` checks that first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import stat
import logging
import tempfile
from typing import Optional

from cpuddp.errors import CheckpointError

from .atomic import fsync_directory

__all__ = ["TempDir", "make_temp_dir", "remove_dead_dirs", "finish", "TOKEN_FILE"]

_log = logging.getLogger("cpuddp.checkpoint")

_TEMP_DIR = re.compile(r"\A\.cpuddp-.*\.tmp\Z", re.DOTALL)
#: A replaced checkpoint moved aside by :func:`finish`: group 1 is the checkpoint's name.
_OLD_DIR = re.compile(r"\A\.cpuddp-(step-\d{9,})\.old\..*\.tmp\Z", re.DOTALL)
#: A file rank 0 writes into the temporary directory; every rank must read the same token.
TOKEN_FILE = ".cpuddp-token"
_LOCK = ".lock"


class TempDir:
    """Rank 0's temporary directory for one save, its lock held until :meth:`close`."""

    def __init__(self, path: str, lock_fd: int, token: str) -> None:
        self.path = path
        self.token = token
        self._fd: Optional[int] = lock_fd

    def close(self, remove: bool) -> None:
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def make_temp_dir(directory: str, name: str) -> TempDir:
    """A new ``0700`` temporary directory for target ``name`` in ``directory``, locked, with a token file."""
    path = tempfile.mkdtemp(prefix=f".cpuddp-{name}.", suffix=".tmp", dir=directory)
    fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    token = secrets.token_hex(16)
    with open(os.path.join(path, TOKEN_FILE), "w", encoding="ascii") as f:
        f.write(token)
    return TempDir(path, fd, token)


def read_token(path: str) -> Optional[str]:
    """The token in ``path``'s token file, or None when this process cannot read it."""
    try:
        with open(os.path.join(path, TOKEN_FILE), encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _dead(path: str, uid: int) -> bool:
    """A temporary directory of this user whose writer is gone (nobody holds its lock)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            return False
        fd = os.open(os.path.join(path, _LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # a save in flight holds it
    finally:
        os.close(fd)


def _restore(directory: str, name: str) -> bool:
    """Put a dead ``.old`` directory back as its checkpoint when the replacement never landed."""
    m = _OLD_DIR.match(name)
    if m is None:
        return False
    path, final = os.path.join(directory, name), os.path.join(directory, m.group(1))
    try:
        complete = stat.S_ISREG(os.lstat(os.path.join(path, ".metadata")).st_mode)
    except OSError:
        complete = False
    if not complete or os.path.lexists(final):
        return False
    os.rename(path, final)
    fsync_directory(directory)
    _log.warning("restored %s from %s: a save replacing it was killed between its two renames", final, name)
    return True


def remove_dead_dirs(directory: str) -> list[str]:
    """Remove killed saves' temporary directories in ``directory``, after restoring a replaced
    checkpoint whose replacement never landed (the module doc); return the names removed.
    Call it holding the directory's writer lock (:mod:`cpuddp.train.checkpoint.ckpt_lock`)."""
    uid = os.geteuid()
    try:
        names = sorted(n for n in os.listdir(directory) if _TEMP_DIR.match(n))
    except OSError:
        return []
    gone = []
    for n in names:
        path = os.path.join(directory, n)
        if _dead(path, uid) and not _restore(directory, n):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(n)
    return gone


def _seal(path: str) -> None:
    """Every file ``0600`` and fsynced, then the directory itself."""
    for root, dirs, files in os.walk(path):
        for name in files:
            fp = os.path.join(root, name)
            os.chmod(fp, 0o600)
            fd = os.open(fp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(root)


def _check_replaceable(final: str) -> None:
    """``final`` may be replaced only when it is a directory of this user's (never a symlink:
    its removal would reach where it points)."""
    st = os.lstat(final)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        return
    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"not a directory of yours (uid {st.st_uid})"
    raise CheckpointError(f"{final!r} is {what}: cpuddp does not replace it with the new checkpoint", path=final,
                          fix=f"remove {final!r} if it is yours, or save under a directory only you can write")


def finish(temp: TempDir, final: str) -> None:
    """Seal ``temp`` and rename it to ``final`` (an existing ``final`` is replaced)."""
    _seal(temp.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(temp.path, TOKEN_FILE))
    parent = os.path.dirname(final)
    old: Optional[str] = None
    if os.path.lexists(final):
        _check_replaceable(final)
        old = tempfile.mkdtemp(prefix=f".cpuddp-{os.path.basename(final)}.old.", suffix=".tmp", dir=parent)
        os.rmdir(old)
        os.rename(final, old)
    os.rename(temp.path, final)
    fsync_directory(parent)
    temp.path = final  # nothing left to remove on close
    if old is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(old, ".metadata"))  # first: never restored half-removed
        shutil.rmtree(old, ignore_errors=True)
