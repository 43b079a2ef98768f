"""Where the segment's pages are: the NUMA node of each page of a slot (``move_pages(2)``).

The placement itself is made in :mod:`cpuddp.backends.shm.protocol.segment` (each rank reserves its own
slots, so the kernel puts them on that rank's NUMA node); this module only asks the kernel where
a page is -- for tests and diagnostics, never on the data path.

:func:`page_nodes` calls ``move_pages`` with ``nodes=NULL``, which moves nothing and returns each
page's node in ``status`` (a negative errno for a page this process has not mapped: ``-ENOENT``).
It first reads one byte of every page, which maps a page that exists; reading a page that does
not exist yet allocates it on the caller's node, so ask only about slots their owner reserved.
None where the kernel or the sandbox has no ``move_pages`` (no NUMA support, a seccomp profile
that refuses it without ``CAP_SYS_NICE``, a CPU this table does not know).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections import Counter
from typing import Any, Dict, List, Optional

__all__ = ["page_nodes", "slot_nodes", "OS_PAGE"]

#: the kernel's page size (move_pages works in its pages; the segment's PAGE is layout.h's)
OS_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: ``move_pages``'s system call number per CPU (x86-64: 279; arm64: 239).
_MOVE_PAGES = {"x86_64": 279, "amd64": 279, "aarch64": 239, "arm64": 239}


def page_nodes(addr: int, length: int) -> Optional[List[int]]:
    """The NUMA node of each page of ``[addr, addr + length)`` of this process (negative errno for
    a page that is not mapped), or None where ``move_pages`` is unavailable."""
    nr = _MOVE_PAGES.get(platform.machine().lower())
    if nr is None or not hasattr(ctypes, "CDLL"):
        return None
    first, count = addr - addr % OS_PAGE, -(-(addr % OS_PAGE + length) // OS_PAGE)
    if count <= 0:
        return []
    pages = (ctypes.c_void_p * count)(*(first + i * OS_PAGE for i in range(count)))
    for p in pages:  # map each page into this process: move_pages sees only mapped pages
        ctypes.string_at(p, 1)
    status = (ctypes.c_int * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(0), ctypes.c_ulong(count), pages, None, status,
                      ctypes.c_int(0))
    if rc < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL):
            return None
        raise OSError(err, f"move_pages: {os.strerror(err)}")
    return list(status)


def slot_nodes(seg: Any, local_rank: int) -> Optional[Dict[int, int]]:
    """``{NUMA node: pages}`` over ``local_rank``'s two slots of the mapped segment ``seg``
    (:class:`~cpuddp.backends.shm.protocol.segment.Segment`), or None where ``move_pages`` is unavailable."""
    counts: Counter = Counter()
    for offset, length in seg.own_slots(local_rank):
        nodes = page_nodes(seg.address(offset), length)
        if nodes is None:
            return None
        counts.update(nodes)
    return dict(counts)
