"""What a forked child of a rank must drop at once: the one ``os.register_at_fork`` handler.

Owns: the set of this process's objects that hold shm descriptors (the segment, the peer
sockets) and the fork handler that calls their ``after_fork_in_child()``.
May import: the standard library only.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

#: Objects of this process with descriptors a forked child must close (weak: a closed group goes).
_held: "weakref.WeakSet[Any]" = weakref.WeakSet()


def close_in_forked_child(obj: Any) -> None:
    """Have a forked child of this process call ``obj.after_fork_in_child()`` as it starts."""
    _held.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_held):
        obj.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
