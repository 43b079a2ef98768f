"""The heavy-benchmark lock: one file per user, in a directory nobody else can write.

Heavy benchmarks (the DDP and sharding tables, the netns runs) take turns under this lock so
that two of them never share the CPUs.  Its path is defined here and nowhere else::

    flock "$(python benchmarks/_heavy_lock.py)" python benchmarks/shm_ddp.py

``python benchmarks/_heavy_lock.py`` creates the directory if need be and prints the lock's
path: ``$XDG_RUNTIME_DIR/cpuddp/heavy.lock``, or ``~/.cache/cpuddp/heavy.lock`` where
``XDG_RUNTIME_DIR`` is unset or not a directory of this user's that only it can write.  The ``cpuddp`` directory is made with mode 0700 and checked to be a real
directory (not a symlink) owned by this user; where it is not, the command prints nothing and
exits 1, and ``flock`` then refuses the empty name, so nothing runs.  (It used to be a fixed
name in ``/tmp``: any user of the machine could create it first, hold it for ever, or plant a
symlink there.)  Under ``sudo`` the lock is the invoking user's (``SUDO_UID``),
so that ``sudo python benchmarks/netns_ddp.py`` and that user's other runs exclude one another.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import stat
import sys
from pathlib import Path
from typing import Any, Optional

NAME = "heavy.lock"


def _owner() -> tuple[int, int, Optional[Path]]:
    """The uid and gid the lock belongs to, and their runtime directory if known: this process's,
    or under ``sudo`` (root with ``SUDO_UID``) the invoking user's."""
    sudo_uid = os.environ.get("SUDO_UID", "")
    if os.geteuid() == 0 and sudo_uid.isdigit() and int(sudo_uid) != 0:
        uid = int(sudo_uid)
        pw = pwd.getpwuid(uid)
        run = Path(f"/run/user/{uid}")  # sudo drops XDG_RUNTIME_DIR; this is where logind puts it
        return uid, pw.pw_gid, run if run.is_dir() else None
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    return os.geteuid(), os.getegid(), Path(xdg) if xdg.startswith("/") else None


def _home(uid: int) -> Path:
    if uid == os.geteuid():
        return Path.home()
    return Path(pwd.getpwuid(uid).pw_dir)


def _safe_base(path: Path, uid: int) -> bool:
    """A directory of ``uid`` (or root) that no other user can write into."""
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid in (uid, 0) and not st.st_mode & 0o022


def lock_dir() -> Path:
    """``<runtime dir or ~/.cache>/cpuddp``, created with mode 0700; raises :class:`SystemExit`
    where it is a symlink, not a directory, or not owned by the user."""
    try:
        return _lock_dir()
    except OSError as e:
        raise SystemExit(f"cannot make the heavy lock's directory: {e}") from e


def _lock_dir() -> Path:
    uid, gid, run = _owner()
    if run is not None and _safe_base(run, uid):
        base = run
    else:
        base = _home(uid) / ".cache"
        if not base.exists():
            base.mkdir(parents=True, mode=0o700)
            if uid != os.geteuid():
                os.chown(base, uid, gid)
        if not _safe_base(base, uid):
            raise SystemExit(f"{base}: not a directory of uid {uid} that only it can write; "
                             "cannot keep the heavy lock there")
    d = base / "cpuddp"
    try:
        d.mkdir(mode=0o700)
        if uid != os.geteuid():
            os.chown(d, uid, gid)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise SystemExit(f"{d}: not a real directory owned by uid {uid} (a symlink? another user's?); "
                         "remove it or fix it -- the heavy lock is kept nowhere else")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)  # ours: tighten it rather than share it
    return d


def lock_path() -> str:
    """The heavy lock's path (its directory created and checked; the file itself is made by
    whoever locks it first)."""
    return str(lock_dir() / NAME)


class HeavyLock:
    """``with HeavyLock(lock_path()):`` -- an exclusive ``flock`` on the file, the same lock as
    ``flock "$(python benchmarks/_heavy_lock.py)" ...``; ``HeavyLock(None)`` takes nothing."""

    def __init__(self, path: Optional[str]) -> None:
        self.path, self.fd = path, None

    def __enter__(self) -> "HeavyLock":
        if self.path:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise SystemExit(f"{self.path}: not a regular file")
                uid, gid, _ = _owner()
                if uid != os.geteuid() and os.fstat(fd).st_uid == os.geteuid():
                    os.fchown(fd, uid, gid)  # made by root under sudo: the user's file
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def main() -> int:
    try:
        print(lock_path())
    except SystemExit as e:
        print(f"_heavy_lock.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
