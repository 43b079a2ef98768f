"""A native group's progress thread: collectives queued, run in issue order by a native thread
that never holds the GIL, their results handed to torch's futures by a waiter blocked in a
GIL-free native call.

``engine.c`` owns the thread (``cpuddp_shm_start``: a pthread with every signal blocked, so
Ctrl-C stays the main thread's) and its queue of 64 calls; :meth:`Progress.submit` hands it a
call's job -- its prepared entry and its tensors' addresses -- and returns an unfinished
:class:`~cpuddp.backends.shm.routes.stream.ShmWork` at once, so DDP's reducer and FSDP2's prefetch go
on while the data moves.  What a queued call reads and writes is held until it completes
(:class:`~cpuddp.backends.shm.routes.hold.Held`, made before its addresses are taken: the
tensors, their storages, and their memory, lent back so that ``t.resize_()`` is refused): nothing
it uses is freed under it, and a tensor given other memory meanwhile (``t.data = ...``) makes
its Work raise, naming that, instead of reporting a result the tensor does not hold.  One Python thread
(``cpuddp-shm-wait-<rank>``) waits for each call in turn inside ``cpuddp_shm_wait`` (ctypes
releases the GIL; it wakes every 0.1 s to see whether the group closed), then completes its
future -- or sets the error the inline call would raise, and breaks the group.  Nothing runs on
a queued call's data after the library is done with it (an AVG, which divides afterwards, is
never queued: the next queued call could read the tensor before the division).  The future's
callbacks run in the waiter; one that issues a collective while calls are queued waits for them
inside the library (``drain``), not for futures only the waiter itself could complete.  The
thread spins briefly for the next call, then sleeps on a futex; it shares the rank's CPUs (the
work is memory-bound).  A forked child inherits no thread
and may not use the group (the group refuses it), nor stop it.  At exit every running thread is
stopped (after up to 2 s for its queued calls), also for a group nobody destroyed.

Order: a call that runs in the caller's thread (small, or staged, or on the Python path) first
waits for the Works of every queued one (:meth:`drain`), then -- holding the group's exec lock,
so nothing can be queued meanwhile, not even by a Work's callback -- until the library has run
every call queued so far (:meth:`wait_idle`), and only then touches the counters and slots.
``engine.c`` refuses an inline call while any is queued (``RC_BUSY``: the binding waits for
them, then calls again), so the order cannot be broken by mistake.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import weakref
from typing import Any, Callable, Dict, Tuple

import torch

from ..native.layout import RC_AGAIN, RC_BUSY, RC_OK

__all__ = ["Progress"]

#: how long one wait inside the library lasts before the waiter looks at the group again
_WAIT_NS = 100_000_000
_JOIN_TIMEOUT = 10.0
#: the running progress threads: stopped at exit (a group never destroyed must not leave a
#: native thread reading its context while the interpreter frees it)
_live: "weakref.WeakSet[Progress]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for progress in list(_live):
        progress.close(settle=2.0)


class _Job:
    __slots__ = ("call", "fut", "result", "held", "thread")

    def __init__(self, call: Any, fut: Any, result: Any, held: Any):
        self.call, self.fut, self.result, self.held = call, fut, result, held
        me = threading.current_thread()
        self.thread = (me.ident, me.name)  # who queued it


class Progress:
    """One native group's progress thread and waiter (see the module docstring)."""

    def __init__(self, engine: Any, on_error: Callable[[BaseException], None], rank: int) -> None:
        self.engine, self.on_error = engine, on_error
        lib = engine.lib
        self._submit, self._wait = lib.submit, lib.wait
        if lib.start(engine.ctx) != RC_OK:
            raise RuntimeError("the shm engine's progress thread did not start")
        self._jobs: Dict[int, _Job] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._waiter = threading.Thread(target=self._loop, name=f"cpuddp-shm-wait-{rank}", daemon=True)
        self._waiter.start()
        self._pid = os.getpid()
        _live.add(self)

    @property
    def closed(self) -> bool:
        """Was the thread stopped (the group left, or the process exiting)?  Calls then run in
        the caller's thread."""
        return self._closed

    def pending(self) -> int:
        """Calls queued and not completed (their futures not yet set)."""
        return len(self._jobs)

    def submit(self, call: Any, job: Tuple[Any, Any, Any], result: Any, held: Any) -> Any:
        """Queue ``job`` (a :class:`~cpuddp.backends.shm.native.Engine` collective's); an
        unfinished Work at once.  ``held``: its :class:`~cpuddp.backends.shm.routes.hold.Held`,
        released when the call completes (the caller releases it if this raises)."""
        from .stream import ShmWork

        fut: "torch.futures.Future[Any]" = torch.futures.Future()
        while True:
            ticket = self._submit(self.engine.ctx, *job)
            if ticket >= 0:
                break
            if ticket != -RC_BUSY:
                raise torch.distributed.DistBackendError("shm: the group's progress thread is shut down")
            if threading.current_thread() is self._waiter:  # only this thread makes room: never wait for it
                raise torch.distributed.DistBackendError(
                    "shm: a collective issued from a Work's callback while the progress queue is full "
                    "(the callback runs in the thread that completes the queued calls, so it cannot wait for room); "
                    "issue it after waiting for the Work instead")
            oldest = self._oldest()  # 64 calls in flight: the oldest's result makes room
            if oldest is not None:
                oldest.wait()
        with self._cv:
            self._jobs[ticket] = _Job(call, fut, result, held)
            self._cv.notify_all()
        return ShmWork(fut)

    def others(self) -> Tuple[str, ...]:
        """The threads other than this one whose calls are queued and not completed."""
        me = threading.get_ident()
        with self._cv:
            return tuple({job.thread[1]: None for job in self._jobs.values() if job.thread[0] != me})

    def _oldest(self) -> Any:
        """The oldest queued call's future, or None when none is queued."""
        with self._cv:
            return self._jobs[min(self._jobs)].fut if self._jobs else None

    def drain(self) -> None:
        """Wait until every queued call completed (its error, if any, is its Work's and the group's).
        In the waiter (a future's callback issuing a collective): until the library ran them all."""
        if threading.current_thread() is self._waiter:
            self.engine.drain()
            return
        while True:
            fut = self._oldest()
            if fut is None:
                return
            try:
                fut.wait()
            except Exception:  # noqa: BLE001 - the call's own Work raises it; the group is broken
                pass

    def wait_idle(self) -> None:
        """Wait until the library has run every call queued so far (not their Works: the waiter
        completes those).  A call about to run in the caller's thread does this holding the
        group's exec lock, which every submit takes: no call queued meanwhile runs beside it."""
        self.engine.drain()

    def _loop(self) -> None:
        err = (ctypes.c_int64 * 3)()
        ticket = 0
        while True:
            with self._cv:
                while ticket not in self._jobs and not self._closed:
                    self._cv.wait()
                job = self._jobs.get(ticket)  # after close: the queued calls' results, then None
            if job is None:
                return
            rc = self._wait(self.engine.ctx, ticket, _WAIT_NS, err)
            while rc == RC_AGAIN:
                rc = self._wait(self.engine.ctx, ticket, _WAIT_NS, err)
            with self._cv:  # no longer pending: a callback of its future may issue the next call
                del self._jobs[ticket]
                self._cv.notify_all()
            self._finish(job, rc, err)
            ticket += 1

    def _finish(self, job: _Job, rc: int, err: Any) -> None:
        changed = job.held.release()  # before its future: a callback sees its tensors as they were
        if rc == RC_OK:
            if changed is None:
                job.fut.set_result(job.result)
            else:  # the call ran on every rank: this rank's tensor no longer shows its result
                job.fut.set_exception(changed)
            return
        exc = self.engine.error(rc, job.call, int(err[0]), int(err[1]), int(err[2]))
        self.on_error(exc)
        job.fut.set_exception(exc)

    def close(self, settle: float = _JOIN_TIMEOUT) -> None:
        """Let the queued calls finish (up to ``settle`` seconds), then stop the thread (a call
        still waiting for peers ends with an error, and the calls behind it) and the waiter."""
        if self._closed or os.getpid() != self._pid:  # a forked child has no thread to stop
            return
        import time

        end = time.monotonic() + settle
        while self._jobs and time.monotonic() < end and threading.current_thread() is not self._waiter:
            time.sleep(0.001)
        self.engine.lib.stop(self.engine.ctx)  # joins the native thread; every queued call has its result
        with self._cv:  # the waiter takes the results left, then ends
            self._closed = True
            self._cv.notify_all()
        self._waiter.join(_JOIN_TIMEOUT)
