"""Name the rank that was lost when a job fails.

When one rank dies (killed, crashed, or raised), the others fail in their next collective with
gloo's ``Connection closed by peer [127.0.0.1]:41234`` -- an address, not a rank -- or, when
the peer's host vanished, with a timeout.  Launchers do not always say who went first either
(MPICH's banner gives a PID, not always the right one; torchrun names the lowest rank as the
"root cause" when several exit with code 1).  The watchdog ends each surviving rank's output
with one line, after the traceback::

    cpuddp: [rank0] lost rank(s) [1]: rank 1 (pid 4242 on node7) raised ValueError: bad batch
    cpuddp: [rank0] lost rank(s) [1]: rank 1 (pid 4242 on node7) died without a Python exception (killed, a crash, or os._exit)
    cpuddp: [rank0] lost rank(s) [3]: no heartbeat from rank 3 (pid 77 on node9) for 3 s (its host is down or unreachable, or it is stuck)
    cpuddp: [rank1] lost rank 0 (pid 4241 on node7), which hosts the rendezvous store (at 10.0.0.7:29500: Connection refused); see rank 0's log
    cpuddp: [rank1] rank(s) [0] already left the group (shutdown or exit) while this rank still expected them in a collective: ...

Usage (by :mod:`cpuddp.distributed`): ``watchdog.start(env, store)`` once the group has formed,
``watchdog.stop()`` first thing in ``shutdown()``.  Both are no-ops when not applicable and never
raise.  ``CPUDDP_WATCHDOG=0`` turns it off.

How: :func:`start` opens a second client on the rendezvous store (``store.clone()``: one more
connection per rank on the store's host) and, under the prefix ``cpuddp/watchdog/<attempt>/``:

* appends ``rank pid host identity`` to ``info`` once;
* adds 1 to ``hb/<rank>`` every :data:`INTERVAL` seconds from a daemon thread (one small
  request per rank per second; a few quicker ones at first, to learn the peers' pids);
* wraps ``sys.excepthook`` and ``threading.excepthook``: an uncaught exception is reported
  first (:func:`cpuddp.launchers.report.record_failure`: torchrun's error file, ``cpuddp run``'s report
  directory), then appends
  ``rank<TAB>Type: message`` to ``failed`` (first in, first failed), lets the previous hook
  (torch's ``[rankN]:`` prefixer) print the traceback, then prints the verdict.

The verdict, cheaply: a peer in ``failed`` raised (the first one is blamed); a peer in ``done``
called :func:`stop` and left; a peer on this same host (same hostname, boot, network and PID
namespaces) whose pid is gone or a zombie died.  Only when nobody is known to have raised or
died, and the exception looks like a communication failure, are the other ranks' heartbeats
watched, for at most :data:`STALE` s.  A rank that raised on its own exits at once.

:func:`stop` appends ``done``; rank 0, when it hosts the store, then keeps it up while other
ranks are still working (heartbeat moving), at most :data:`LINGER` s, so their own shutdown never
meets a store that is gone.

The code: :mod:`cpuddp.watchdog.verdict` decides, as pure functions of a snapshot of what
was read (who raised, left or exited; heartbeat counters over a measured time);
:mod:`cpuddp.watchdog.store` is the store client and the key protocol; this module holds the
heartbeat thread, the exception hooks, the linger at exit and :func:`start`/:func:`stop`.

Never able to hang exit: the thread is a daemon, every store request is bounded by
:data:`OP_TIMEOUT`, the store is probed with a plain TCP connect first (a dead store then costs
no error spew from torch's client), and the diagnosis runs on a daemon thread joined with a
deadline (:data:`DIAGNOSIS_LIMIT`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from cpuddp.errors import RendezvousError, first_line
from cpuddp.launchers.report import record_failure
from cpuddp.topology import here

from .store import StoreClient
from .verdict import (
    HeartbeatClock,
    PeerInfo,
    Snapshot,
    decide,
    describe,
    linger_waiting,
    local_ranks,
    looks_like_comm_failure,
    ranks_to_watch,
    store_gone,
)

__all__ = ["start", "stop", "running", "diagnose", "INTERVAL", "STALE", "OP_TIMEOUT"]

log = logging.getLogger("cpuddp.watchdog")

#: Seconds between heartbeats.
INTERVAL = 1.0
#: A heartbeat that has not moved for this long means the rank is lost.
STALE = 3.0
#: Bound on each store request the watchdog makes.
OP_TIMEOUT = 2.0
#: How long the excepthook may spend on the diagnosis, at most.
DIAGNOSIS_LIMIT = STALE + 2 * OP_TIMEOUT + 1.0
#: At most this long, rank 0 (when it hosts the store) waits at :func:`stop` for the ranks that
#: are still working (heartbeat moving) to leave, so they never meet a store that is gone.
LINGER = 30.0

_lock = threading.Lock()
_dog: Optional["_Watchdog"] = None
_atexit_registered = False


def running() -> bool:
    """True between :func:`start` and :func:`stop`."""
    return _dog is not None


def start(env: Any, store: Any, *, interval: float = INTERVAL) -> None:
    """Start heartbeats and install the exception hooks.  ``env``: the job's
    :class:`~cpuddp.launchers.env.DistEnv`; ``store``: the rendezvous store (a ``TCPStore``, or a
    ``PrefixStore`` over one).  A no-op for a world of 1, when already running, or with
    ``CPUDDP_WATCHDOG=0``; never raises (a watchdog that cannot start logs why)."""
    global _dog
    with _lock:
        if _dog is not None or env is None or store is None or int(env.world_size) < 2:
            return
        if os.environ.get("CPUDDP_WATCHDOG", "1").strip().lower() in ("0", "false", "no", "off"):
            return
        try:
            dog = _Watchdog(env, store, interval)
            dog.begin()
        except Exception as exc:  # the watchdog is an aid: it must never stop a job
            log.warning("cpuddp: watchdog not started (%s: %s)", type(exc).__name__, first_line(exc))
            return
        _dog = dog


def stop(timeout: float = OP_TIMEOUT) -> None:
    """Say this rank left cleanly, stop the heartbeat, restore the hooks.  Bounded; never raises.
    Call it before the process group is destroyed."""
    global _dog
    with _lock:
        dog, _dog = _dog, None
    if dog is not None:
        with contextlib.suppress(Exception):
            dog.end(timeout)


def diagnose(comm_failure: bool = True) -> Optional[str]:
    """The one-line verdict on lost peers, as the exception hook prints it (None when none is
    known to be lost, or when the watchdog is not running).  ``comm_failure``: when no peer is
    known to have raised or died, watch the others' heartbeats for up to :data:`STALE` s."""
    dog = _dog
    if dog is None:
        return None
    return dog.verdict(comm_failure)


# --------------------------------------------------------------------------- internals


def _abort_shared_memory() -> None:
    """Make local peers blocked in a collective with this rank raise at once (the backends'
    abort hooks: the shm group's abort word)."""
    from cpuddp.backends.registry import abort_all

    with contextlib.suppress(Exception):
        abort_all("this rank raised an uncaught exception")


def _watch(check: Optional[Callable[[], Optional[str]]]) -> None:
    """Hand the backends' long waits this watchdog's lost-rank check (None: take it back)."""
    from cpuddp.backends.registry import watch_all

    with contextlib.suppress(Exception):
        watch_all(check)


def _bounded(fn: Callable[[], None], limit: float) -> None:
    """Run ``fn`` on a daemon thread for at most ``limit`` s; its exceptions are dropped."""

    def _run() -> None:
        with contextlib.suppress(Exception):
            fn()

    t = threading.Thread(target=_run, name="cpuddp-watchdog-diagnosis", daemon=True)
    t.start()
    t.join(limit)


class _Watchdog:
    """One rank's watchdog: the heartbeat thread, the exception hooks, the linger at exit."""

    def __init__(self, env: Any, store: Any, interval: float) -> None:
        self.rank = int(env.rank)
        self.world = int(env.world_size)
        self.interval = max(0.05, float(interval))
        self.stale = max(STALE, 2.5 * self.interval)
        self.agent_store = bool(getattr(env, "agent_store", False))
        self.is_store_host = self.rank == 0 and not self.agent_store
        self.store = StoreClient(store, env.master_addr, env.master_port, OP_TIMEOUT, self.world)
        self.identity = here.host_identity(("net", "pid"))
        self.stopping = threading.Event()
        self.store_lost: Optional[str] = None
        self.thread: Optional[threading.Thread] = None
        self.old_sys_hook: Optional[Callable[..., Any]] = None
        self.old_thread_hook: Optional[Callable[..., Any]] = None
        self.sys_hook: Optional[Callable[..., Any]] = None
        self.thread_hook: Optional[Callable[..., Any]] = None
        self.marked = False
        self.failed_here = False  # an uncaught exception is ending this rank
        self.known: dict[int, PeerInfo] = {}
        self.malformed: Optional[str] = None  # a watchdog key holds what no rank of this job wrote
        self.clock = HeartbeatClock()  # the peers' heartbeats as :meth:`lost_now` saw them

    def store_reachable(self) -> bool:
        """False once the store is known lost; then no more heartbeats into it (torch would log
        each failure)."""
        if self.store_lost is not None:
            return False
        self.store_lost = self.store.connect_error()
        if self.store_lost is not None:
            self.stopping.set()
        return self.store_lost is None

    def _lose_store(self, exc: BaseException) -> None:
        if self.store_lost is None:
            self.store_lost = f"{self.store.address} ({type(exc).__name__}: {first_line(exc)})"

    # -- life cycle

    def begin(self) -> None:
        self.store.beat(self.rank)
        self.store.announce(self.rank, os.getpid(), here.hostname(), self.identity)
        self.thread = threading.Thread(target=self._beat, name="cpuddp-watchdog", daemon=True)
        self.thread.start()
        self._install_hooks()
        _watch(self.lost_now)
        global _atexit_registered
        if not _atexit_registered:
            import atexit

            atexit.register(stop)  # also when the script never calls cpuddp.shutdown()
            _atexit_registered = True

    def _beat(self) -> None:
        quick = 20  # the first beats come fast, to learn the peers' pids early
        delay = 0.05
        while not self.stopping.wait(delay):
            quick -= 1
            delay = min(self.interval, 0.25) if quick > 0 and len(self.known) < self.world else self.interval
            try:
                self.store.beat(self.rank)
                if len(self.known) < self.world <= 256 and self.malformed is None:
                    # Learn every rank's pid and host while the store is up, for the message
                    # when the store itself is lost.
                    self.known = self.store.info()
            except RendezvousError as exc:  # a malformed key: keep beating, say so in the verdict
                self.malformed = str(exc)
                log.warning("cpuddp: watchdog: %s", first_line(exc))
            except Exception as exc:
                if not self.stopping.is_set():
                    self._lose_store(exc)
                    log.warning("cpuddp: the rendezvous store at %s stopped answering; heartbeats stopped",
                                self.store.address)
                return

    def end(self, timeout: float) -> None:
        _watch(None)
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout)
        self._restore_hooks()

        def _leave() -> None:
            if not self.store_reachable():
                return
            self.store.mark_done(self.rank)
            if self.is_store_host and not self.failed_here:
                self._linger()

        _bounded(_leave, timeout + (LINGER if self.is_store_host else 0.0))

    def _exited(self, info: dict[int, PeerInfo]) -> frozenset[int]:
        """The ranks on this host whose process is gone (their pids are visible here)."""
        return frozenset(r for r in local_ranks(info, self.identity, self.rank) if not here.pid_alive(info[r].pid))

    def _linger(self) -> None:
        """Keep the store up until every rank has left, failed or died, or those left have not
        sent a heartbeat for :data:`STALE` s (bounded by :data:`LINGER`)."""
        info = self.store.info()
        clock = HeartbeatClock()
        deadline = time.monotonic() + LINGER
        while time.monotonic() < deadline:
            failed = [r for r, _ in self.store.failed()]
            waiting = linger_waiting(self.world, self.store.done(), failed, self._exited(info))
            if not waiting:
                return
            now = time.monotonic()
            clock.observe(self.store.counters(waiting), now)
            if clock.all_silent(waiting, now, self.stale):
                return
            time.sleep(0.1)

    # -- exception hooks

    def _install_hooks(self) -> None:
        self.old_sys_hook = sys.excepthook
        self.old_thread_hook = threading.excepthook
        self.sys_hook = self._sys_hook
        self.thread_hook = self._thread_hook
        sys.excepthook = self.sys_hook
        threading.excepthook = self.thread_hook

    def _restore_hooks(self) -> None:
        if sys.excepthook is self.sys_hook:
            sys.excepthook = self.old_sys_hook or sys.__excepthook__
        if threading.excepthook is self.thread_hook:
            threading.excepthook = self.old_thread_hook or threading.__excepthook__
        self.sys_hook = self.thread_hook = None

    def _sys_hook(self, exc_type: type, exc: BaseException, tb: Any) -> None:
        # First of all, before the mark and the abort that make local peers fail: the rank
        # that failed first then has the earliest report (cpuddp.launchers.report).
        record_failure(exc_type, exc, kind="interrupted" if issubclass(exc_type, KeyboardInterrupt) else "error",
                       secondary=looks_like_comm_failure(exc_type, exc))
        self._report(exc_type, exc, lambda: (self.old_sys_hook or sys.__excepthook__)(exc_type, exc, tb), mark=True)

    def _thread_hook(self, args: Any) -> None:
        if args.exc_type is SystemExit:
            (self.old_thread_hook or threading.__excepthook__)(args)
            return
        self._report(args.exc_type, args.exc_value, lambda: (self.old_thread_hook or threading.__excepthook__)(args),
                     mark=False)

    def _report(
        self, exc_type: type, exc: Optional[BaseException], print_traceback: Callable[[], None], mark: bool
    ) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            self.failed_here = self.failed_here or mark
            _bounded(lambda: self._mark(exc_type, exc), OP_TIMEOUT)
            print_traceback()
            return
        if mark:  # before the traceback: peers that fail next read it at once
            self.failed_here = True
            _bounded(lambda: self._mark(exc_type, exc), OP_TIMEOUT)
            _abort_shared_memory()  # local peers waiting in shared memory stop now, not at our exit
        print_traceback()
        comm = looks_like_comm_failure(exc_type, exc)
        result: list[Optional[str]] = [None]

        def _work() -> None:
            result[0] = self.verdict(comm)

        _bounded(_work, DIAGNOSIS_LIMIT)
        if mark:
            self.stopping.set()  # no more heartbeats: this rank is going down
        if result[0]:
            with contextlib.suppress(Exception):
                sys.stderr.write(result[0] + "\n")
                sys.stderr.flush()

    def _mark(self, exc_type: type, exc: Optional[BaseException]) -> None:
        if self.marked or not self.store_reachable():
            return
        self.store.mark_failed(self.rank, describe(exc_type, exc))
        self.marked = True

    # -- the diagnosis: read a snapshot, watch heartbeats if the verdict needs them, decide

    def _store_gone(self) -> Optional[str]:
        v = store_gone(self.rank, self.agent_store, self.store_lost, self.known)
        return v.message if v is not None else None

    def verdict(self, comm_failure: bool) -> Optional[str]:
        if not self.store_reachable():
            return self._store_gone()
        try:
            snap = self._snapshot()
            watch = ranks_to_watch(snap, comm_failure)
            if watch:
                heartbeats, waited = self._sample(watch)
                snap = dataclasses.replace(snap, heartbeats=heartbeats, watched=waited)
            v = decide(snap, comm_failure)
            return v.message if v is not None else None
        except RendezvousError as exc:  # what was read is malformed: say that, not "the store is gone"
            return f"cpuddp: [rank{self.rank}] the watchdog cannot name a lost rank: {exc}"
        except Exception as exc:
            # The store died under us: a connect can still succeed while rank 0's sockets close.
            self._lose_store(exc)
            self.stopping.set()
            return self._store_gone()

    def lost_now(self) -> Optional[str]:
        """A rank of the job known lost now, in the verdict's words (None: none): what a long
        wait of a backend asks every second (the MPI leg's).  A few store reads; a peer counts as
        silent once :meth:`lost_now` has seen its heartbeat stand still for :attr:`stale` s."""
        if self.stopping.is_set() or not self.store_reachable():
            return self._store_gone() if self.store_lost is not None else None
        try:
            snap = self._snapshot()
            now = time.monotonic()
            watch = ranks_to_watch(snap, True)
            if watch:
                self.clock.observe(self.store.counters(watch), now)
                silent = {r: (self.clock.seen[r][0],) * 2 for r in watch if now - self.clock.seen[r][1] >= self.stale}
                snap = dataclasses.replace(snap, heartbeats=silent, watched=self.stale)
            v = decide(snap, True)
        except Exception:  # the check is an aid: a failed read is no verdict
            return None
        return v.message if v is not None else None

    def _snapshot(self) -> Snapshot:
        failed = self.store.failed()
        done = self.store.done()
        info = self.store.info()
        self.known.update(info)
        return Snapshot(rank=self.rank, world=self.world, identity=self.identity, failed=failed,
                        done=frozenset(done), info=info, exited=self._exited(info))

    def _sample(self, ranks: list[int]) -> tuple[dict[int, tuple[int, int]], float]:
        """Watch ``ranks``' heartbeats until each moved or :attr:`stale` s passed:
        rank -> (first counter, last counter read), and the seconds watched."""
        t0 = time.monotonic()
        first = self.store.counters(ranks)
        last = dict(first)
        step = min(0.5, self.interval / 2)
        while time.monotonic() - t0 < self.stale and any(last[r] == first[r] for r in ranks):
            time.sleep(step)
            last.update(self.store.counters([r for r in ranks if last[r] == first[r]]))
        return {r: (first[r], last[r]) for r in ranks}, time.monotonic() - t0
