"""The node's shared segment for the shm group: made, checked, mapped, held.

* :func:`create_segment` (local rank 0): an anonymous ``memfd`` -- no name in any directory, so
  nothing another user can pre-create, substitute or find left over -- owner-only (0600), sized
  and then sealed against shrinking and growing (no process can truncate it under the mappings),
  its header, control lines and rings reserved with ``posix_fallocate`` (too little memory is a
  clear error now, never a SIGBUS later), its header written (magic, a random token, size, slot).
* Placement: each rank reserves its own two slots (``posix_fallocate`` of their ranges) when it
  maps the segment, before it says it is ready; nothing maps the whole segment ahead (no
  ``MAP_POPULATE``, which would allocate every hole in the mapping process).  The kernel
  allocates a shared-memory page under the memory policy of the process that allocates it --
  by default on the NUMA node of the CPU it runs on, and ``numactl --membind``/``--preferred``
  still apply -- so each slot lives in its writer's NUMA node.  A rank maps its own slots and
  the control lines ahead (``MADV_POPULATE_WRITE``); a peer's slot is mapped at its first read,
  which comes only in a round after the peer wrote it.
  :mod:`cpuddp.backends.shm.protocol.placement` says where the pages are.
* :func:`check_received` (the other local ranks): the descriptor handed over
  (:mod:`cpuddp.backends.shm.protocol.handover`) is a regular file of this uid, mode 0600, of the size
  the layout needs, sealed, with this group's header.  Nothing is mapped because a store value says so.
* :class:`Segment`: the mapping -- header words, per-rank control lines (arrival counter,
  posted and checked call numbers, state), descriptor rings and typed slot views; where each
  word and area lies is ``layout.h``'s (:mod:`cpuddp.backends.shm.native.layout`: ``W_*``
  header words, ``C_*`` line words, the note, the sizes), defined there once for both engines.
* Liveness: every rank holds an open-file-description lock (``F_OFD_SETLK``) on its own byte
  past the segment's end, taken through a file handle of its own (the memfd opened again
  through ``/proc/self/fd``: a new open file description), never the mapping's; the kernel
  drops it when the process dies, so a peer's death is seen through ``F_OFD_GETLK`` even from
  another PID namespace (:meth:`Segment.alive`).
* Fork: the mapping is ``MADV_DONTFORK`` and a forked child closes its copies of both
  descriptors at once (:func:`os.register_at_fork`).  Python's ``mmap`` keeps a duplicate of
  the descriptor it mapped, which the child inherits and cannot close; it shares the mapped
  descriptor's open file description, which is why the lock is on the other one: a child never
  holds the parent's liveness lock (the parent's death is still seen at once while a DataLoader
  worker or a forked helper lives) nor can touch the segment.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import stat
import struct
from typing import Dict, List, Tuple

import torch

from cpuddp.errors import BackendError

from ..native.layout import (C_ARRIVED, C_CHECKED, C_POSTED, DESC, HEADER_WORDS, LINE, LINE_WORDS, MAGIC, NOTE_AT,
                             NOTE_BYTES, PAGE, RING, W_MAGIC, W_RING, W_SIZE, W_SLOT, W_TOKEN)
from . import check as shm_check
from .forks import close_in_forked_child

__all__ = ["Segment", "create_segment", "check_received", "FIX", "SEALS"]

#: the seals the segment gets once sized (Linux's memfd seals): no
#: process -- not even one of this user's that opens it through /proc/<pid>/fd -- can shrink it
#: under the mappings (every rank's next touch of a page past the end was a SIGBUS) or grow it,
#: and no seal can be added after them
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
FIX = ("give the job memory for the segment (or lower CPUDDP_SHM_SLOT), run the node's ranks as one user "
       "in one network namespace, or pass backend='gloo'")
_FLOCK = "hhqqixxxx"  # struct flock on Linux x86-64: type, whence, start, len, pid (+pad)


def _lock(fd: int, cmd: int, kind: int, offset: int) -> int:
    got = fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0))
    return struct.unpack(_FLOCK, got)[0]


class Segment:
    """One node's mapped segment: header words, control lines, descriptor rings, typed slot views."""

    def __init__(self, fd: int, local_rank: int, local_size: int, slot: int) -> None:
        counters, slots, total = shm_check.layout(local_size, slot)
        self.fd, self.total, self.slot, self.slots_at = fd, total, slot, slots
        self.size, self.local_rank = local_size, local_rank
        for at, length in self.own_slots(local_rank):  # first touch: on this rank's NUMA node
            _reserve(fd, at, length, f"local rank {local_rank}'s slots")
        self.mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED)
        if hasattr(mmap, "MADV_DONTFORK"):
            self.mm.madvise(mmap.MADV_DONTFORK)
        for at, length in [(0, slots), *self.own_slots(local_rank)]:  # allocated: map them ahead
            _populate(self.mm, at, length)
        self.words = (ctypes.c_int64 * HEADER_WORDS).from_buffer(self.mm, 0)
        self.counters_at = counters
        self.lines = [(ctypes.c_int64 * LINE_WORDS).from_buffer(self.mm, counters + i * LINE)
                      for i in range(local_size)]
        # descriptor rings, entry-major: entry i of every rank side by side, so one comparison
        # of those bytes agrees a call (cpuddp.backends.shm.protocol.descriptor)
        ring = shm_check.ring_offset(local_size)
        self.ring_at = [ring + i * local_size * DESC for i in range(RING)]
        self.rings = [[(ctypes.c_int64 * (DESC // 8)).from_buffer(self.mm, self.ring_at[i] + r * DESC)
                       for i in range(RING)] for r in range(local_size)]
        # every rank's control words as one view each (a step slice of the lines): who is late
        # is one min() over it, not a loop over the peers
        words = memoryview(self.mm)[counters:counters + local_size * LINE].cast("q")
        step = LINE // 8
        self.arrived, self.posted, self.checked = (words[c::step] for c in (C_ARRIVED, C_POSTED, C_CHECKED))
        self.mine = ctypes.c_int64.from_buffer(self.mm, counters + local_rank * LINE + 8 * C_ARRIVED)
        self.raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=total - slots, offset=slots)
        self._rows: Dict[torch.dtype, List[torch.Tensor]] = {}
        self._views: Dict[torch.dtype, List[List[torch.Tensor]]] = {}
        self._regions: Dict[Tuple[torch.dtype, int, int], List[List[torch.Tensor]]] = {}
        self.forked = False
        self.lock_fd = -1  # the liveness lock's own open file description (hold_liveness)
        close_in_forked_child(self)

    def own_slots(self, local_rank: int) -> List[Tuple[int, int]]:
        """``(offset, length)`` in the segment of ``local_rank``'s slot in each buffer (parity)."""
        return [(self.slots_at + (p * self.size + local_rank) * self.slot, self.slot) for p in (0, 1)]

    def address(self, offset: int) -> int:
        """This process's address of byte ``offset`` of the slots area (``offset`` from the
        segment's start)."""
        return self.raw.data_ptr() + offset - self.slots_at

    def hold_liveness(self) -> None:
        """Lock this rank's byte past the end through a descriptor of its own: held until this
        process is gone (a forked child closes its copy; the mapping's duplicate is not it)."""
        self.lock_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        _lock(self.lock_fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, self.total + self.local_rank)

    def alive(self, local_rank: int) -> bool:
        """Does local rank ``local_rank``'s process still hold its liveness lock?"""
        return _lock(self.fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, self.total + local_rank) != fcntl.F_UNLCK

    def slots(self, dtype: torch.dtype) -> List[List[torch.Tensor]]:
        """``[parity][local rank]`` 1-D views of ``dtype`` over the slots."""
        views = self._views.get(dtype)
        if views is None:
            flat = self.raw.view(dtype)
            n = self.slot // flat.element_size()
            views = [[flat[(p * self.size + r) * n:(p * self.size + r + 1) * n] for r in range(self.size)]
                     for p in (0, 1)]
            self._views[dtype] = views
        return views

    def regions(self, dtype: torch.dtype, start: int, k: int) -> List[List[torch.Tensor]]:
        """``[parity][local rank]`` views of elements ``start:start + k`` of ``dtype`` of each slot:
        made once per region (a training loop repeats a few sizes), so a round makes no view."""
        key = (dtype, start, k)
        views = self._regions.get(key)
        if views is None:
            whole = self.slots(dtype)
            views = whole if (start, k) == (0, whole[0][0].numel()) else [[s[start:start + k] for s in par]
                                                                           for par in whole]
            if len(self._regions) >= _REGIONS_MAX:
                self._regions.clear()
            self._regions[key] = views
        return views

    def rows(self, dtype: torch.dtype) -> List[torch.Tensor]:
        """``[parity]``: the slots of buffer ``parity`` as one ``[local ranks, slot]`` view of ``dtype``
        (rank r's slot is row r: one op reads or writes every rank's slot)."""
        views = self._rows.get(dtype)
        if views is None:
            flat = self.raw.view(dtype)
            n = self.slot // flat.element_size()
            views = [flat[p * self.size * n:(p + 1) * self.size * n].view(self.size, n) for p in (0, 1)]
            self._rows[dtype] = views
        return views

    def note(self, local_rank: int) -> memoryview:
        """Local rank ``local_rank``'s note: the bytes of its control line after the words."""
        at = self.counters_at + local_rank * LINE + NOTE_AT
        return memoryview(self.mm)[at:at + NOTE_BYTES]

    def late(self, words: memoryview, value: int) -> List[int]:
        """Local ranks whose control word in ``words`` (``arrived``, ``posted``) is below ``value``."""
        return [i for i, v in enumerate(words) if v < value]

    def close(self) -> None:
        """Drop this process's descriptors (the liveness lock goes with its own)."""
        for name in ("lock_fd", "fd"):
            fd = getattr(self, name)
            setattr(self, name, -1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def after_fork_in_child(self) -> None:
        self.forked = True
        self.close()



#: regions whose slot views :meth:`Segment.regions` keeps (then it starts again)
_REGIONS_MAX = 64


#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): map allocated pages ahead, as MAP_POPULATE did
#: for the whole segment (a peer's slot is mapped at its first read, by the kernel's fault-around).
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(mm: mmap.mmap, offset: int, length: int) -> None:
    try:
        mm.madvise(_POPULATE_WRITE, offset, length)
    except (OSError, ValueError):  # an older kernel: the pages are mapped at first use instead
        pass


def _reserve(fd: int, offset: int, length: int, what: str, *, size_only: bool = False) -> None:
    """Allocate bytes ``offset:offset + length`` of the segment now (on this process's NUMA node);
    ``size_only``: give the segment that size, allocating nothing."""
    try:
        if size_only:
            os.ftruncate(fd, length)
        else:
            os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        from cpuddp._units import format_size

        raise BackendError(f"cannot reserve {format_size(length)} of shared memory for {what}: {exc.strerror}",
                           fix=FIX) from exc


def create_segment(local_size: int, slot: int) -> Tuple[int, int]:
    """Local rank 0: a new, reserved, owner-only memfd with its header written; ``(fd, token)``."""
    _counters, slots, total = shm_check.layout(local_size, slot)
    fd = os.memfd_create("cpuddp-shm", getattr(os, "MFD_CLOEXEC", 1) | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        _reserve(fd, 0, total, f"{local_size} local ranks", size_only=True)  # the slots: each rank's (Segment)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # its size is final: a truncation would SIGBUS every rank
        _reserve(fd, 0, slots, f"the control lines of {local_size} local ranks")
        token = secrets.randbits(62) + 1
        with mmap.mmap(fd, PAGE) as head:
            words = (ctypes.c_int64 * HEADER_WORDS).from_buffer(head, 0)
            words[W_SIZE], words[W_SLOT], words[W_TOKEN], words[W_RING] = local_size, slot, token, RING
            words[W_MAGIC] = MAGIC
            del words
    except BaseException:
        os.close(fd)
        raise
    return fd, token


def check_received(fd: int, token: int, local_size: int, slot: int) -> None:
    """A peer: is ``fd`` the segment local rank 0 made for this group?  Raises if not."""
    total = shm_check.layout(local_size, slot)[2]
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not this job's uid {os.geteuid()}"
    elif st.st_mode & 0o077:
        problem = f"has mode {oct(st.st_mode & 0o777)}, not owner-only"
    elif st.st_size != total:
        problem = f"has size {st.st_size}, expected {total}"
    elif fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
        problem = "is not sealed against shrinking and growing"
    if problem is None:
        with mmap.mmap(fd, PAGE) as head:
            words = (ctypes.c_int64 * HEADER_WORDS).from_buffer(head, 0)
            ok = (words[W_MAGIC], words[W_TOKEN], words[W_SIZE], words[W_SLOT]) == (MAGIC, token, local_size, slot)
            del words
        problem = None if ok else "has a header that is not this group's (magic, token, size)"
    if problem is not None:
        raise BackendError(f"the shared-memory segment received from local rank 0 {problem}: refusing to map it",
                           fix="see docs/security.md; if no other user interferes, report it as a bug")
