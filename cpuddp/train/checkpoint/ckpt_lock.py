"""One writer per checkpoint directory: the job that saves there first holds it until it exits.

Two jobs saving into one directory would prune, replace and supersede each other's checkpoints
(``keep=`` counts the other's too, and ``load_checkpoint(dir)`` would resume whichever wrote
last).  So the first :func:`cpuddp.save_checkpoint` of a job
in a directory takes a lock on ``directory/.cpuddp-lock`` and holds it until the process exits;
a second job's save gets a :class:`~cpuddp.errors.CheckpointError` naming the host and pid of
the job that holds it.  A load does not keep it (:func:`while_free`): it cleans up under the lock
when the lock is free, and reads as it is when another job holds it.

Only the process that does a checkpoint's directory work takes it (group rank 0: it writes the
files, the manifest and the renames; the other ranks write a sharded checkpoint's shards into
rank 0's temporary directory), so the ranks of one job never conflict.  The lock is an
open-file-description lock (``F_OFD_SETLK``; a POSIX ``lockf`` where the kernel has none): the
kernel drops it when the process dies, however it dies (and its forked children, such as
DataLoader workers, which share the description), NFS carries it between hosts, and -- unlike a
plain POSIX lock -- the process closing another descriptor of the file (a backup copying the
directory) does not drop it.  The file is opened without following a symlink and must be a
regular file of this user with one name: the holder writes its host and pid into it, so a hard link
another user made to a file of yours (where ``fs.protected_hardlinks=0``), or a symbolic link, in its
place is a :class:`~cpuddp.errors.CheckpointError` naming it, and the file is left as it was.
:func:`release_directory` lets a long-lived process (a notebook) hand the directory on.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import struct
import time
from typing import Callable, Optional

from cpuddp.errors import CheckpointError
from cpuddp.topology.here import hostname

__all__ = ["LOCK_FILE", "hold_directory", "release_directory", "holds_directory", "while_free"]

_log = logging.getLogger("cpuddp.checkpoint")

#: In a checkpoint directory: the lock its writing job holds, with that job's host and pid.
LOCK_FILE = ".cpuddp-lock"
#: realpath of a directory -> the open lock file this process holds.
_HELD: dict[str, int] = {}


def _key(directory: str) -> str:
    return os.path.realpath(directory)


def holds_directory(directory: str) -> bool:
    """Does this process hold ``directory``'s lock (and is it still that directory's lock file)?"""
    fd = _HELD.get(_key(directory))
    if fd is None:
        return False
    try:
        now = os.stat(os.path.join(directory, LOCK_FILE), follow_symlinks=False)
        mine = os.fstat(fd)
    except OSError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
        release_directory(directory)  # the directory (or its lock file) was removed and made again
        return False
    return True


def release_directory(directory: str) -> bool:
    """Let another job write ``directory`` (this process stops holding its lock); True when it held it."""
    fd = _HELD.pop(_key(directory), None)
    if fd is None:
        return False
    os.close(fd)  # closing the last descriptor of its description drops the lock
    return True


def _holder(fd: int) -> str:
    """Who holds the lock, as the lock file says (written by its holder)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {int(info['pid'])} on host {str(info['host'])!r} (since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"


def _lock_error(path: str, why: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{path!r}, the checkpoint directory's lock, {why}", path=path, fix=fix)


def _not_yours(path: str, directory: str, st: os.stat_result) -> CheckpointError:
    return _lock_error(path, f"is not a file of yours (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): "
                             f"another user can create files in {directory!r}",
                       f"save under a directory only you can write (or remove {path!r} if it is left from a run "
                       "of yours)")


def _planted(path: str, directory: str, load: bool) -> Optional[CheckpointError]:
    """Why the lock could not be opened, when another user put something at its name: a symbolic
    link (in a world-writable sticky directory such as ``/tmp`` the kernel refuses another user's
    link with EACCES, not ELOOP), or -- for a save -- a file of theirs.  None otherwise."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return _lock_error(path, f"is a symbolic link (uid {st.st_uid}, to {os.readlink(path)!r}): someone put it "
                                 f"in {directory!r} so that cpuddp would write where it points",
                           f"remove {path!r}, and save under a directory only you can write")
    return _not_yours(path, directory, st) if st.st_uid != os.geteuid() and not load else None


def _check_lock(fd: int, path: str, directory: str) -> None:
    """The lock must be a regular file of this user's with one name (its holder writes into it)."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
        return
    os.close(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise _not_yours(path, directory, st)
    raise _lock_error(path, f"has {st.st_nlink} hard links: another name for a file of yours, put in {directory!r} "
                            "so that cpuddp would write over it (it is left as it was)",
                      f"remove {path!r} (that name only: the file keeps its other names and contents), and save "
                      "under a directory only you can write")


def _open_lock(directory: str, load: bool) -> Optional[int]:
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        planted = _planted(path, directory, load) if exc.errno in (errno.ELOOP, errno.EACCES, errno.EPERM) else None
        if planted is not None:
            raise planted from None
        if load and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            _log.debug("cannot create %s (%s): a job that cannot write here writes no checkpoint here", path, exc)
            return None
        raise
    _check_lock(fd, path, directory)
    return fd


def _lock(fd: int) -> None:
    """An exclusive lock on the whole file, not waiting (EAGAIN/EACCES: someone holds it)."""
    ofd = getattr(fcntl, "F_OFD_SETLK", None)
    if ofd is not None:
        try:  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
            fcntl.fcntl(fd, ofd, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: a kernel without OFD locks
                raise
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _take(fd: int) -> Optional[str]:
    """Lock ``fd``'s file; None when taken, else who holds it (``fd`` then closed)."""
    try:
        _lock(fd)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            os.close(fd)
            raise
        who = _holder(fd)
        os.close(fd)
        return who
    return None


def hold_directory(directory: str, *, load: bool = False) -> None:
    """Take ``directory``'s writer lock for this process's life (a no-op when held already).

    A lock held by another process is a :class:`CheckpointError` naming its host and pid.
    ``load``: a directory this user cannot write (read-only) is not locked."""
    if holds_directory(directory):
        return
    fd = _open_lock(directory, load)
    if fd is None:
        return
    who = _take(fd)
    if who is not None:
        raise CheckpointError(
            f"another job writes checkpoints in {directory!r}: {who} holds {LOCK_FILE} (two jobs in one "
            "directory would prune and resume each other's checkpoints)", path=directory,
            fix="give each job a checkpoint directory of its own, or wait for that job to end (a job holds "
                "its directory until its process exits; a process done with it, such as a notebook, hands it "
                "on with cpuddp.train.checkpoint.ckpt_lock.release_directory(directory))") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": hostname(), "pid": os.getpid(), "since": time.time()}).encode(), 0)
    _HELD[_key(directory)] = fd


def while_free(directory: str, work: Callable[[], object]) -> Optional[str]:
    """Run ``work()`` under ``directory``'s lock when no other job holds it, without keeping the
    lock (a load: reading takes no directory from its writer); else return who holds it.  A
    directory this user cannot write is read as it is (``work`` is not run)."""
    if holds_directory(directory):
        work()
        return None
    fd = _open_lock(directory, load=True)
    if fd is None:
        return None
    who = _take(fd)
    if who is not None:
        return who
    try:
        work()
    finally:
        os.close(fd)  # drops the lock: this process has not saved here
    return None
