"""Where a shm group's collectives run: in the caller's thread, or queued on one communication
thread per group, always in issue order.

The rule (``CPUDDP_SHM_ASYNC``, or :class:`~cpuddp.backends.shm.group.process_group.ShmOptions`
``async_comm``): a collective runs in the caller's thread unless the group was told that this
rank has a CPU its compute threads do not use (a plan that leaves one free), or the user asked
for the thread; then collectives of :data:`ASYNC_FROM` bytes and more are queued, and DDP's
backward goes on while they run.  On a rank whose compute threads fill its CPUs the thread
can only take CPU time from backward: measured on 2 ranks x 1 core of an AMD EPYC Zen 4 (docs/performance.md),
DDP ran slower with it than without.

Every collective returns a :class:`ShmWork`; its ``wait()`` raises the collective's error.

The hand-off between the caller and the thread waits the way the ranks wait for each other
(:mod:`cpuddp.backends.shm.protocol.wait`): the thread polls its queue, and ``wait()`` its collective,
for up to 2 ms (yielding the CPU) before blocking, so a collective queued right behind the last
one, or one that ends soon after ``wait()`` was called, costs no sleep and wake-up of a thread.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError, CpuddpError

from ..protocol.wait import spin_until

__all__ = ["Stream", "ShmWork", "GatheredWork", "TimedWork", "async_setting", "ASYNC_VAR", "ASYNC_FROM"]

ASYNC_VAR = "CPUDDP_SHM_ASYNC"
#: With the communication thread on, collectives at least this big are queued on it; smaller
#: ones run in the caller's thread when nothing is queued (the thread hop costs more than
#: overlap could win: DDP's buckets are 1 MiB and up).
ASYNC_FROM = 256 << 10
_JOIN_TIMEOUT = 10.0


def async_setting(option: Optional[bool], environ: Any = os.environ) -> bool:
    """``CPUDDP_SHM_ASYNC`` (``1``/``0``) when set, else the group's option (False when None)."""
    raw = (environ.get(ASYNC_VAR) or "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    if raw and raw != "auto":
        raise BackendError(f"{ASYNC_VAR}={environ.get(ASYNC_VAR)!r} is neither 1, 0 nor auto",
                           fix=f"set {ASYNC_VAR}=1 (a communication thread), 0 (the caller's thread) or auto, "
                               "or unset it")
    return bool(option)


class ShmWork(dist.Work):
    """A collective's handle: ``wait()`` raises its error (the Work torch makes from a future
    does not), ``get_future()`` is what DDP's reducer chains on.  A collective that ran in the
    caller's thread (:meth:`done`) has finished: its future is made only if asked for."""

    def __init__(self, fut: "Optional[torch.futures.Future[Any]]", result: Any = None) -> None:
        super().__init__()
        self._fut, self._result = fut, result

    @classmethod
    def done(cls, result: Any) -> "ShmWork":
        return cls(None, result)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if self._fut is None:
            return True
        if timeout is not None and timeout.total_seconds() > 0 and not self._fut.done():
            finished = threading.Event()
            self._fut.add_done_callback(lambda _f: finished.set())
            if not finished.wait(timeout.total_seconds()):
                raise dist.DistBackendError(f"shm: the collective did not finish within {timeout}")
        spin_until(self._fut.done)
        self._fut.wait()  # raises the collective's error
        return True

    def get_future(self) -> "torch.futures.Future[Any]":
        if self._fut is None:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(self._result)
            self._fut = fut
        return self._fut

    def is_completed(self) -> bool:
        return self._fut is None or self._fut.done()

    def is_success(self) -> bool:
        if self._fut is None:
            return True
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def result(self) -> Any:
        return self._result if self._fut is None else self._fut.value()


class GatheredWork(dist.Work):
    """Several inner Works as one (a gloo group's coalesced forms; a staged send/recv), with
    ``after()`` run once they all finished (a staged recv's copy back)."""

    def __init__(self, works: Sequence[Any], result: Any, after: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self._works, self._result, self._after = list(works), result, after

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        for w in self._works:
            w.wait()
        after, self._after = self._after, None
        if after is not None:
            after()
        return True

    def get_future(self) -> "torch.futures.Future[Any]":
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class TimedWork(ShmWork):
    """A point-to-point Work: like :class:`ShmWork`, and its ``wait()`` gives up after the group
    timeout (a send or recv the peer never matches)."""

    def __init__(self, fut: "torch.futures.Future[Any]", timeout: datetime.timedelta) -> None:
        super().__init__(fut)
        self._timeout = timeout

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        limit = timeout if timeout is not None and timeout.total_seconds() > 0 else self._timeout
        if not self._fut.done():
            finished = threading.Event()
            self._fut.add_done_callback(lambda _f: finished.set())
            if not finished.wait(limit.total_seconds()):
                raise dist.DistBackendError(f"shm: send/recv did not finish within {limit} (the group timeout)")
        self._fut.wait()
        return True


#: how the note on two threads that called at once begins
_CROWD = "two threads called collectives on this shm group at once"


def _prefix(exc: BaseException, note: str) -> None:
    """Put ``note`` before ``exc``'s message (a cpuddp error's ``msg``, else its first argument)."""
    if isinstance(exc, CpuddpError):
        exc.msg = note + exc.msg.replace("; this is a bug", "")
        exc.args = (str(CpuddpError(exc.msg, fix=exc.fix)),)  # its message and fix, rendered as errors.py does
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (note + exc.args[0].replace("; this is a bug", ""), *exc.args[1:])


class Stream:
    """Runs a group's collectives one at a time, in issue order: inline, or on its thread."""

    def __init__(self, rank: int, threaded: bool, on_error: Callable[[BaseException], None],
                 thread_setup: Callable[[], None]) -> None:
        self._lock = threading.Lock()  # the queue's state
        self._exec = threading.Lock()  # one collective at a time
        self._crowd: Dict[str, None] = {}  # threads seen calling collectives at once (crowded), in order
        self._queued_by: Dict[int, Any] = {}  # the thread of each call queued and not run yet, by ticket
        self._tickets = 0
        self._on_error = on_error
        self._pending = 0
        self._closed = False
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, args=(thread_setup,), name=f"cpuddp-shm-comm-{rank}",
                                            daemon=True)
            self._thread.start()

    @property
    def inline(self) -> bool:
        """Does every collective run in the caller's thread (no communication thread)?"""
        return self._thread is None

    @property
    def exec_lock(self) -> Any:
        """Held while a collective runs (one at a time, in issue order)."""
        return self._exec

    def run(self, fn: Callable[[], None], result: Any, nbytes: Callable[[], int],
            hold: Optional[Callable[[], Any]] = None) -> ShmWork:
        """Run ``fn`` (one collective) and return its Work; ``nbytes()``: the bytes it moves
        (asked only with the communication thread on); ``hold()``: what a queued call holds
        until it ran (:class:`~cpuddp.backends.shm.routes.hold.Held`; asked only when queued)."""
        with self._lock:
            if self._closed:
                raise dist.DistBackendError("the shm process group was shut down")
            queued = self._thread is not None and (self._pending or nbytes() >= ASYNC_FROM)
            if self._queued_by:
                self._met_queued()
            if queued:
                fut: torch.futures.Future = torch.futures.Future()
                self._pending += 1
                self._tickets += 1
                me = threading.current_thread()
                self._queued_by[self._tickets] = (me.ident, me.name)
                self._q.put((fn, result, fut, hold() if hold is not None else None, self._tickets))
                return ShmWork(fut)
            self.take_exec()
        try:
            fn()
        except BaseException as exc:
            self._on_error(exc)
            raise
        finally:
            self._exec.release()
        return ShmWork.done(result)

    def _loop(self, thread_setup: Callable[[], None]) -> None:
        thread_setup()
        q = self._q
        while True:
            spin_until(lambda: not q.empty())
            item = q.get()
            if item is None:
                return
            fn, result, fut, held, ticket = item
            error: Optional[BaseException] = None
            with self._exec:
                try:
                    if held is not None and held.changed():  # its peers wait for the call as it was made
                        raise held.refused()
                    fn()
                except BaseException as exc:  # every error reaches the caller's wait()
                    self._on_error(exc)
                    error = exc
            with self._lock:
                self._pending -= 1
                self._queued_by.pop(ticket, None)
            changed = held.release() if held is not None else None
            if error is None and changed is not None:  # it ran on every rank: this tensor no longer shows it
                error = changed
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error if isinstance(error, Exception) else dist.DistBackendError(str(error)))

    # ------------------------------------------------------------------ two threads at once

    def take_exec(self) -> None:
        """Take the exec lock (one collective at a time); finding it held by another thread is
        two threads calling this group's collectives at once (:meth:`crowded`)."""
        if not self._exec.acquire(False):
            self.crowded()
            self._exec.acquire()

    def crowded(self, *others: str) -> None:
        """This thread called a collective while another thread's (``others``, where known) ran or
        was queued: remembered, and every error from then on says so first (:meth:`name_crowd`)."""
        self._crowd.update(dict.fromkeys((*others, threading.current_thread().name)))

    def _met_queued(self) -> None:
        me = threading.get_ident()
        others = [name for ident, name in self._queued_by.values() if ident != me]
        if others:
            self.crowded(*others)

    def name_crowd(self, exc: BaseException) -> None:
        """Where two threads called this group's collectives at once, ``exc``'s message names that
        first: the calls of two threads can reach the ranks in different orders, so a mismatch, a
        refusal or a stall that follows is theirs (the message it had follows it)."""
        if not self._crowd or _CROWD in str(exc):  # named already (the broken group's error repeats it)
            return
        names = [f"'{n}'" for n in self._crowd]
        seen = f"threads {', '.join(names)}" if len(names) > 1 else f"thread {names[0]} and another"
        note = (f"{_CROWD} ({seen}): their calls can reach "
                "the ranks in different orders (a mismatch, or data of one thread's call summed with another's); "
                "call a group's collectives from one thread, or give each thread a group of its own "
                "(dist.new_group(..., backend='shm'), made by every rank in the same order). What the group saw: ")
        _prefix(exc, note)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._q.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT)
