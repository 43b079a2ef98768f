"""Which CPUs the shm group runs on, and on which data path.

On x86 a group runs either data path: the native one (:mod:`cpuddp.backends.shm.native`) or the
Python one, whose plain stores and loads keep the segment protocol's order there (x86's total
store order: a peer that sees a counter also sees what was stored before it).  On any other CPU
(aarch64) Python has no fence of its own, so the group forms only on the native data path,
agreed by every local rank (:func:`cpuddp.backends.shm.native.form`), and the steps the Python
engine still runs beside it (the collectives the library does not run, the agreement of the
path) call the library's full fence (:class:`cpuddp.backends.shm.protocol.channel.Channel`).  A
group that would take the Python data path there is refused with the reason and the fix
(:func:`check_path`); ``backend="auto"`` offers shm there only where the library loads
(:func:`cpuddp.backends.shm.protocol.check.eligibility`).
"""

from __future__ import annotations

import os
import platform
from typing import Any, Callable, Mapping, Optional

from cpuddp.errors import BackendError

from .. import native
from ..protocol.check import X86_MACHINES, native_fix

__all__ = ["machine", "is_x86", "fence_here", "check_path"]


def machine() -> str:
    """This CPU, as ``platform.machine()`` names it (tests of another CPU replace this function)."""
    return platform.machine() or "unknown"


def is_x86() -> bool:
    """Is this CPU an x86?"""
    return machine().lower() in X86_MACHINES


def fence_here() -> Optional[Callable[[], None]]:
    """The fence the channel calls around its counters: None on x86; elsewhere the native
    library's, or None where it does not load on this rank (the node then agrees on the Python
    path, which :func:`check_path` refuses before any collective runs)."""
    if is_x86():
        return None
    try:
        return native.load().fence  # type: ignore[no-any-return]
    except native.Unavailable:
        return None


def check_path(engine: Any, path: str, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse the group on a CPU that is not x86 where the node agreed on the Python data path
    (``engine`` None; ``path``: :func:`~cpuddp.backends.shm.native.form`'s words).  Every local
    rank reaches the same verdict, from the same agreement."""
    if engine is not None or is_x86():
        return
    arch = machine()
    head = f"shm: the Python data path relies on x86's store ordering; this CPU is {arch}"
    gloo = "or use backend='gloo' (backend='auto' takes gloo here)"
    mine = native.unavailable(environ)
    if mine is not None:
        words = (f"{mine} asks for the Python data path" if native.setting(environ) is False
                 else f"the native library did not load: {mine}")
        raise BackendError(f"{head} and {words}", fix=f"{native_fix(environ, arch)}; {gloo}")
    raise BackendError(f"{head} and not every rank of this node can run the native one ({path})",
                       fix=f"run every rank of the node from one install of cpuddp whose native library loads "
                           f"('cpuddp doctor' says native), {gloo}")
