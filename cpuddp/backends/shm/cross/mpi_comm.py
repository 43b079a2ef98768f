"""One MPI communicator as the shm group's node-to-node leg sees it (mpi4py): byte collectives,
posted nonblocking, waited for with the shm backend's wait policy, each one agreed first.

* **Bytes only.**  Every collective moves ``MPI.BYTE`` straight from and into the tensors'
  storage (by address: no copy, no numpy).  Reductions are computed by the caller
  (:mod:`cpuddp.backends.shm.cross.mpi_group`), in rank order, so no MPI datatype or reduction
  algorithm decides a result.
* **Agreed.**  Each collective posts its descriptor (:func:`~cpuddp.backends.shm.protocol.descriptor.encode`)
  on a twin communicator first -- its words and their negation, MIN-reduced in one small
  nonblocking all-reduce that travels beside the data -- and its result counts only once the
  descriptors agree: ranks that called different collectives, sizes or roots get a
  :class:`~cpuddp.backends.shm.protocol.descriptor.CallMismatch` naming each rank's call.
* **Waiting.**  MPI moves a large message only inside the calls that look at its request, so
  the leg looks often while a transfer may be under way, and never spins without giving the CPU
  away: where every rank of the node has a CPU of its own, it yields the CPU between looks for
  the first part of a wait (``sched_yield``: the CPU is the rank's, and any other thread that
  wants it gets it); where the node's ranks share CPUs, it sleeps :data:`SLEEP` between looks
  then.  That part lasts :data:`LONG_WAIT` seconds, or as long as the call's bytes take at
  :data:`MOVE_RATE` where that is longer (a large message that the leg looked at less often would
  move slower than gloo's); past it (a peer still computing) the leg sleeps longer between looks,
  up to :data:`SLEEP_MAX`.  MPI's own blocking waits spin instead: 4 ranks on 2 CPUs
  took 7 s for a 16 MiB all_reduce with Open MPI's, 0.13 s polled.  Every
  :data:`CHECK_EVERY` seconds of a wait: has a rank of this process given up (:meth:`abort`), is
  a rank known lost (:func:`cpuddp.backends.shm.api.lost`: the watchdog's check), and the group
  timeout.
* **Threads.**  One thread in MPI at a time unless MPI gave ``MPI_THREAD_MULTIPLE``.
* **Errors.**  MPI's errors return (``MPI.ERRORS_RETURN``) and become a ``DistBackendError``
  naming the rank and the call; after one the leg is broken (later calls raise at once) and the
  process ends with ``MPI_Abort`` at exit, not in an ``MPI_Finalize`` that would wait for a peer
  that is gone (:func:`cpuddp.launchers.mpi.abort_at_exit`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from cpuddp.launchers import mpi as mpi_world

from .. import api
from ..protocol.descriptor import Call, CallMismatch, describe

__all__ = ["MpiComm", "CHECK_EVERY"]

#: Seconds between the checks a long wait makes (abort, a lost rank, the timeout).
CHECK_EVERY = 1.0
#: Seconds slept between looks at a request for the first LONG_WAIT seconds of a wait where the
#: node's ranks share CPUs (else the CPU is yielded between looks), then growing with the wait up
#: to SLEEP_MAX.
SLEEP, LONG_WAIT, SLEEP_MAX = 50e-6, 0.05, 1e-3
#: Bytes per second a wait allows a call's data before it counts as a long wait: a slow link's
#: (1 Gb/s Ethernet moves about 117 MB/s), so a transfer under way is looked at often throughout.
MOVE_RATE = 100e6
#: Bytes of a row's head in :meth:`MpiComm.gather_rows`: the call's descriptor and the row's length.
HEAD = 64
_HEAD = struct.Struct(f"<{HEAD // 8}q")
#: Held around each MPI call where MPI did not give THREAD_MULTIPLE.
_SERIAL = threading.RLock()
_EMPTY = torch.zeros(8, dtype=torch.uint8)  # the address of an empty buffer (MPI takes no null)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MpiComm:
    """One communicator (``comm``) and its twin for the agreement, as the leg uses them."""

    def __init__(self, mpi: Any, comm: Any, timeout: float, spin: bool, what: str) -> None:
        self.MPI, self.comm = mpi, comm
        comm.Set_errhandler(mpi.ERRORS_RETURN)
        self.twin = comm.Dup()
        self.rank, self.size = int(comm.Get_rank()), int(comm.Get_size())
        self.timeout, self.spin, self.what = timeout, spin, what
        self.serial = _SERIAL if mpi_world.thread_level(mpi) != mpi_world.MULTIPLE_NAME else None
        self.broken: Optional[str] = None
        self.aborted: Optional[str] = None
        self.error_class: Optional[int] = None  # MPI's class of the last MPI error (ERR_TRUNCATE, ...)
        self._rows: dict = {}  # gather_rows' buffers, by row size

    # ------------------------------------------------------------------ plumbing

    def lock(self) -> Any:
        return self.serial if self.serial is not None else contextlib.nullcontext()

    def buf(self, t: torch.Tensor, count: Optional[int] = None) -> List[Any]:
        """``[buffer, count, MPI.BYTE]`` over ``t``'s storage (contiguous); ``count``: the bytes
        per rank of a collective that moves one block per rank (default: all of them)."""
        n = _nbytes(t)
        addr = t.data_ptr() if n else _EMPTY.data_ptr()
        return [self.MPI.buffer.fromaddress(addr, n), n if count is None else count, self.MPI.BYTE]

    def counts(self, t: torch.Tensor, counts: Sequence[int]) -> List[Any]:
        """``[buffer, counts, displacements, MPI.BYTE]`` for a v-collective over ``t``'s bytes."""
        displs, at = [], 0
        for c in counts:
            displs.append(at)
            at += c
        n = _nbytes(t)
        addr = t.data_ptr() if n else _EMPTY.data_ptr()
        return [self.MPI.buffer.fromaddress(addr, n), list(counts), displs, self.MPI.BYTE]

    def post(self, start: Callable[[], Any], call: str, *, check: bool = True) -> Any:
        """Start one nonblocking MPI call; its request (``check``: refused on a broken leg)."""
        if check:
            self.usable(call)
        try:
            with self.lock():
                return start()
        except self.MPI.Exception as exc:
            raise self.fail(f"{call}: {exc.Get_error_string()}") from None

    def usable(self, call: str) -> None:
        if self.broken is not None:
            raise dist.DistBackendError(f"MPI leg: {call} on rank {self.rank} of the {self.what}: the leg broke "
                                        f"earlier ({self.broken})")

    def fail(self, why: str) -> Exception:
        """Mark the leg broken (later calls raise at once; MPI_Abort at exit); the error to raise."""
        self.broken = self.broken or why
        mpi_world.abort_at_exit(1)
        return dist.DistBackendError(f"MPI leg: {why} (rank {self.rank} of the {self.what})")

    def abort(self, why: str) -> None:
        """Another part of this process gave up: a wait in progress ends with ``why``."""
        self.aborted = why

    # ------------------------------------------------------------------ waiting

    def wait(self, reqs: Sequence[Any], call: str, statuses: Optional[List[Any]] = None, *, nbytes: int = 0) -> None:
        """Until every request of ``reqs`` completed (see the module docstring); ``statuses``
        get theirs (a receive's source); ``nbytes``: the bytes the requests move on this rank."""
        test = self.MPI.Request.Testall
        start = time.monotonic()
        moving = max(LONG_WAIT, nbytes / MOVE_RATE)
        yield_until = start + (moving if self.spin else 0.0)
        check_at, deadline = start + CHECK_EVERY, start + self.timeout
        while True:
            try:
                with self.lock():
                    if test(reqs, statuses) if statuses is not None else test(reqs):
                        return
            except self.MPI.Exception as exc:
                self.error_class = exc.Get_error_class()
                raise self.fail(f"{call} failed: {exc.Get_error_string()}") from None
            now = time.monotonic()
            if now < yield_until:
                os.sched_yield()
            else:
                waited = now - start
                time.sleep(SLEEP if waited < moving else min(SLEEP_MAX, waited / 50))
            if now >= check_at:
                check_at = now + CHECK_EVERY
                self._check(call, now > deadline)

    def _check(self, call: str, late: bool) -> None:
        if self.aborted is not None:
            raise self.fail(f"{call} stopped: {self.aborted}")
        lost = api.lost()
        if lost:
            raise self.fail(f"{call} cannot finish: {lost}")
        if late:
            raise self.fail(f"{call} did not finish within {self.timeout:g} s (the group timeout: a rank of the "
                            f"{self.what} is stuck, gone, or not calling the same collective)")

    # ------------------------------------------------------------------ the agreement

    def agree(self, call: Call) -> tuple:
        """Post ``call``'s descriptor on the twin: ``(request, words)`` for :meth:`agreed`."""
        words = call.words()
        mine = torch.tensor([*words, *(-w for w in words)], dtype=torch.int64)
        mpi = self.MPI
        req = self.post(lambda: self.twin.Iallreduce(mpi.IN_PLACE, [self.buf(mine)[0], mine.numel(), mpi.INT64_T],
                                                     mpi.MIN), "the agreement")
        return req, mine, words

    def agreed(self, posted: tuple, what: str, also: Sequence[Any] = (), nbytes: int = 0) -> None:
        """Wait for the agreement :meth:`agree` posted (and the requests ``also``, polled with
        it); a mismatch is an error on every rank that names each rank's call (every rank sees
        the same minimum and maximum)."""
        req, mine, words = posted
        self.wait([req, *also], what, nbytes=nbytes)
        n = len(words)
        if mine[:n].tolist() != [-v for v in mine[n:].tolist()]:
            self.mismatch(words)

    def mismatch(self, words: Sequence[int]) -> None:
        """The ranks called different collectives (or one rank's MPI call failed, which may be
        why): every rank's call through the twin, then :class:`CallMismatch` naming them -- or,
        where every rank called the same, nothing (the caller raises its own error)."""
        calls = self._every_call(words)
        if len(set(calls)) == 1:
            return
        shown = "; ".join(f"rank {r}: {describe(c)}" for r, c in enumerate(calls))
        self.broken = self.broken or "ranks called different collectives"
        mpi_world.abort_at_exit(1)
        raise CallMismatch(f"MPI leg: the ranks of the {self.what} called different collectives (this is rank "
                           f"{self.rank}, which called {describe(words)}): {shown[:1500]}")

    def _every_call(self, words: Sequence[int]) -> List[tuple]:
        n, mpi = len(words), self.MPI
        mine = torch.tensor(list(words), dtype=torch.int64)
        every = torch.empty(n * self.size, dtype=torch.int64)
        req = self.post(lambda: self.twin.Iallgather([self.buf(mine)[0], n, mpi.INT64_T],
                                                     [self.buf(every)[0], n, mpi.INT64_T]), "naming the calls",
                        check=False)
        self.wait([req], "naming the ranks' calls")
        rows = every.view(self.size, n).tolist()
        return [tuple(r) for r in rows]

    def run(self, call: Call, what: str, steps: Sequence[Callable[[], Any]], nbytes: int = 0) -> None:
        """One collective: its agreement posted, then each step run and the requests it returns
        (one, a list, or none: a step that computes) waited for, in turn -- the first step's with
        the agreement's, so they travel together; the agreement checked before any result counts.
        ``nbytes``: the bytes a step moves on this rank (the most of any step)."""
        posted = self.agree(call)
        checked = False
        for step in steps:
            reqs = self.post(step, what)
            reqs = [r for r in (reqs if isinstance(reqs, (list, tuple)) else [reqs])
                    if isinstance(r, self.MPI.Request)]
            if not checked:
                self.agreed(posted, what, reqs, nbytes)
                checked = True
            elif reqs:
                self.wait(reqs, what, nbytes=nbytes)
        if not checked:
            self.agreed(posted, what)

    def gather_rows(self, call: Call, what: str, addr: int, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Every rank's ``n`` bytes at ``addr`` (the same length on every rank), as rows ``[ranks,
        n / itemsize]`` of ``dtype``, in one all-gather that carries the call's descriptor in each
        row's head: the agreement without a round of its own (a difference is a
        :class:`CallMismatch` on every rank, each having every rank's descriptor; where sizes
        differ so that MPI fails the call, the ranks name their calls through the twin).  The rows
        are this communicator's buffer, valid until its next call (the caller reduces or copies
        them at once)."""
        words = call.words()
        rows = self._rows_for(HEAD + -(-n // 8) * 8)
        head = _HEAD.pack(*words, n)
        ctypes.memmove(rows.send_at, head, HEAD)
        if n:
            ctypes.memmove(rows.send_at + HEAD, addr, n)
        req = self.post(lambda: self.comm.Iallgather(rows.send, rows.recv), what)
        try:
            self.wait([req], what, nbytes=rows.size * rows.row)
        except dist.DistBackendError:
            if self.error_class == self.MPI.ERR_TRUNCATE:  # a peer's row was longer: say whose call
                self.mismatch(words)  # (after any other MPI error, no more MPI calls: a peer may be gone)
            raise
        if not rows.heads_are(head):
            self.mismatch(words)
        return rows.block(n, dtype)

    def _rows_for(self, row: int) -> "_Rows":
        """The send and receive buffers of :meth:`gather_rows` for rows of ``row`` bytes, kept for
        the next call of the same size (a training loop repeats a few)."""
        rows = self._rows.get(row)
        if rows is None:
            if len(self._rows) >= 64:
                self._rows.clear()
            rows = self._rows[row] = _Rows(self, row)
        return rows

    def close(self) -> None:
        """Free the communicators (a broken leg's are left: a peer may be gone)."""
        if self.broken is not None:
            return
        for c in (self.twin, self.comm):
            with contextlib.suppress(Exception), self.lock():
                if c != self.MPI.COMM_WORLD:
                    c.Free()


class _Rows:
    """:meth:`MpiComm.gather_rows`' buffers for one row size: this rank's row and every rank's,
    with MPI's views of them made once."""

    def __init__(self, comm: MpiComm, row: int) -> None:
        self.row, self.size = row, comm.size
        self.mine = torch.empty(row, dtype=torch.uint8)
        self.data = torch.empty((comm.size, row), dtype=torch.uint8)
        self.send_at = self.mine.data_ptr()
        self.send, self.recv = comm.buf(self.mine), comm.buf(self.data, row)
        self._heads = memoryview(comm.MPI.buffer.fromaddress(self.data.data_ptr(), row * comm.size))
        self._blocks: Dict[Tuple[int, torch.dtype], torch.Tensor] = {}

    def block(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's ``n`` bytes after its head, as rows of ``dtype`` (views made once)."""
        got = self._blocks.get((n, dtype))
        if got is None:
            got = self._blocks[(n, dtype)] = self.data[:, HEAD:HEAD + n].view(dtype)
        return got

    def heads_are(self, head: bytes) -> bool:
        """Whether every rank's row begins with ``head``."""
        mv, row = self._heads, self.row
        return all(mv[r * row:r * row + HEAD] == head for r in range(self.size))
