"""Files several ranks share: an exclusive lock beside a file, and writes that readers never
see half done.  The one copy of this pattern (the oneCCL import probe's per-user cache,
:mod:`cpuddp.backends.ccl_probe`, uses it; anything else that caches to disk should too).

:func:`locked` holds ``flock`` on a lock file for a block, waiting a bounded time, and runs
the block unlocked when the lock cannot be had (a read-only or lock-less filesystem costs
duplicate work, never a hang).  :func:`atomic_path` yields a temporary name in the target's
directory and renames it over the target only when the block succeeds;
:func:`atomic_write_text` writes text that way.  Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Union

__all__ = ["locked", "atomic_path", "atomic_write_text"]

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def locked(path: PathLike, *, wait: float) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if missing) for the block, waiting at most
    ``wait`` seconds; yields whether the lock is held (False: it timed out or could not be
    taken at all, and the block runs unlocked)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + wait
        held = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        yield held
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """A temporary file name beside ``path`` for the block to write; renamed over ``path``
    when the block returns, removed when it raises (the error propagates)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # gone after a successful replace


def atomic_write_text(path: PathLike, text: str) -> bool:
    """Write ``text`` to ``path`` through :func:`atomic_path`; False (and nothing left behind)
    when the directory cannot be written."""
    try:
        with atomic_path(path) as tmp:
            Path(tmp).write_text(text)
    except OSError:
        return False
    return True
