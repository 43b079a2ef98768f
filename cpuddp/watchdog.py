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
* wraps ``sys.excepthook`` and ``threading.excepthook``: an uncaught exception appends
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

Never able to hang exit: the thread is a daemon, every store request is bounded by
:data:`OP_TIMEOUT`, the store is probed with a plain TCP connect first (a dead store then costs
no error spew from torch's client), and the diagnosis runs on a daemon thread joined with a
deadline (:data:`DIAGNOSIS_LIMIT`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from .errors import first_line
from .hosts import host_identity

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

# Words in an exception's text that mark a failure of the group rather than of the user's code.
_COMM_WORDS = (
    "gloo", "connection", "peer", "timed out", "timeout", "store", "socket", "broken pipe",
    "ccl", "processgroup", "process group", "collective", "rendezvous",
    "shm", "died while",  # cpuddp.shm's "shm allreduce: rank(s) [1] ... died while rank 0 waited"
)


def running() -> bool:
    """True between :func:`start` and :func:`stop`."""
    return _dog is not None


def start(env: Any, store: Any, *, interval: float = INTERVAL) -> None:
    """Start heartbeats and install the exception hooks.  ``env``: the job's
    :class:`~cpuddp.env.DistEnv`; ``store``: the rendezvous store (a ``TCPStore``, or a
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
    """Make local peers blocked in a :mod:`cpuddp.shm` allreduce raise at once (if it is in use)."""
    shm = sys.modules.get("cpuddp.shm")
    if shm is not None:
        with contextlib.suppress(Exception):
            shm.abort_groups("this rank raised an uncaught exception")


def _pid_gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie, not yet reaped by its launcher, counts as exited)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        psutil = None
    if psutil is not None:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _looks_like_comm_failure(exc_type: type, exc: Optional[BaseException]) -> bool:
    mod = getattr(exc_type, "__module__", "") or ""
    if mod.startswith("torch.distributed") or exc_type.__name__.startswith("Dist"):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    text = f"{exc_type.__name__} {exc}".lower()
    return any(w in text for w in _COMM_WORDS)


def _describe(exc_type: type, exc: Optional[BaseException]) -> str:
    line = f"{exc_type.__name__}: {first_line(exc)}" if exc is not None else exc_type.__name__
    line = " ".join(line.split())  # one line, no tabs
    return line if len(line) <= 200 else line[:197] + "..."


class _Watchdog:
    def __init__(self, env: Any, store: Any, interval: float) -> None:
        self.rank = int(env.rank)
        self.world = int(env.world_size)
        self.interval = max(0.05, float(interval))
        self.stale = max(STALE, 2.5 * self.interval)
        self.agent_store = bool(getattr(env, "agent_store", False))
        self.is_store_host = self.rank == 0 and not self.agent_store
        base = getattr(store, "underlying_store", store)  # PrefixStore -> its TCPStore
        self.host = str(getattr(base, "host", "") or env.master_addr)
        self.port = int(getattr(base, "port", 0) or env.master_port)
        self.client = self._client(base)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"cpuddp/watchdog/{attempt}/"
        self.identity = host_identity(("net", "pid"))
        self.stopping = threading.Event()
        self.store_lost: Optional[str] = None
        self.thread: Optional[threading.Thread] = None
        self.old_sys_hook: Optional[Callable[..., Any]] = None
        self.old_thread_hook: Optional[Callable[..., Any]] = None
        self.sys_hook: Optional[Callable[..., Any]] = None
        self.thread_hook: Optional[Callable[..., Any]] = None
        self.marked = False
        self.failed_here = False  # an uncaught exception is ending this rank
        self.known: dict[int, tuple[int, str, str]] = {}

    # -- store access

    def _client(self, base: Any) -> Any:
        import torch.distributed as dist

        td = datetime.timedelta(seconds=OP_TIMEOUT)
        if hasattr(base, "clone"):
            # Its own connection (one more per rank on the store's host), so a heartbeat is never
            # queued behind a long request of the main thread's.
            client = base.clone()
        else:
            client = dist.TCPStore(self.host, self.port, None, False, td, wait_for_workers=False)
        client.set_timeout(td)
        return client

    def key(self, name: str) -> str:
        return self.prefix + name

    def store_reachable(self) -> bool:
        """A plain TCP connect: no request, so a dead store costs no error spew from torch."""
        if self.store_lost is not None:
            return False
        try:
            with socket.create_connection((self.host, self.port), timeout=OP_TIMEOUT):
                return True
        except OSError as exc:
            self.store_lost = f"{self.host}:{self.port}: {exc.strerror or exc}"
            self.stopping.set()  # no more heartbeats into a store that is gone (torch would log each failure)
            return False

    def get_text(self, name: str) -> str:
        k = self.key(name)
        if not self.client.check([k]):
            return ""
        return self.client.get(k).decode(errors="replace")

    # -- life cycle

    def begin(self) -> None:
        c = self.client
        c.add(self.key(f"hb/{self.rank}"), 1)
        c.append(self.key("info"), f"{self.rank}\t{os.getpid()}\t{socket.gethostname()}\t{self.identity}\n")
        self.thread = threading.Thread(target=self._beat, name="cpuddp-watchdog", daemon=True)
        self.thread.start()
        self.old_sys_hook = sys.excepthook
        self.old_thread_hook = threading.excepthook
        self.sys_hook = self._sys_hook
        self.thread_hook = self._thread_hook
        sys.excepthook = self.sys_hook
        threading.excepthook = self.thread_hook
        global _atexit_registered
        if not _atexit_registered:
            import atexit

            atexit.register(stop)  # also when the script never calls cpuddp.shutdown()
            _atexit_registered = True

    def _beat(self) -> None:
        k = self.key(f"hb/{self.rank}")
        quick = 20  # the first beats come fast, to learn the peers' pids early
        delay = 0.05
        while not self.stopping.wait(delay):
            quick -= 1
            delay = min(self.interval, 0.25) if quick > 0 and len(self.known) < self.world else self.interval
            try:
                self.client.add(k, 1)
                if len(self.known) < self.world <= 256:
                    # Learn every rank's pid and host while the store is up, for the message
                    # when the store itself is lost.
                    self.known = self._info()
            except Exception as exc:
                if not self.stopping.is_set():
                    self.store_lost = f"{self.host}:{self.port} ({type(exc).__name__}: {first_line(exc)})"
                    log.warning("cpuddp: the rendezvous store at %s:%d stopped answering; heartbeats stopped",
                                self.host, self.port)
                return

    def end(self, timeout: float) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout)
        if sys.excepthook is self.sys_hook:
            sys.excepthook = self.old_sys_hook or sys.__excepthook__
        if threading.excepthook is self.thread_hook:
            threading.excepthook = self.old_thread_hook or threading.__excepthook__
        self.sys_hook = self.thread_hook = None

        def _leave() -> None:
            if not self.store_reachable():
                return
            self.client.append(self.key("done"), f"{self.rank}\n")
            if self.is_store_host and not self.failed_here:
                self._linger()

        self._bounded(_leave, timeout + (LINGER if self.is_store_host else 0.0))

    def _linger(self) -> None:
        """Keep the store up until every rank has left, failed or died, or those left have not
        sent a heartbeat for :data:`STALE` s (bounded by :data:`LINGER`)."""
        info = self._info()
        seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        deadline = time.monotonic() + LINGER
        while time.monotonic() < deadline:
            gone = self._ranks(self.get_text("done")) | {r for r, _ in self._failed()}
            gone |= {r for r, (pid, _, ident) in info.items() if ident == self.identity and _pid_gone(pid)}
            waiting = [r for r in range(self.world) if r not in gone]
            if not waiting:
                return
            now = time.monotonic()
            for r, v in self._counters(waiting).items():
                if r not in seen or seen[r][0] != v:
                    seen[r] = (v, now)
            if all(now - seen[r][1] >= self.stale for r in waiting):
                return
            time.sleep(0.1)

    # -- exception hooks

    def _sys_hook(self, exc_type: type, exc: BaseException, tb: Any) -> None:
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
            self._bounded(lambda: self._mark(exc_type, exc), OP_TIMEOUT)
            print_traceback()
            return
        if mark:  # before the traceback: peers that fail next read it at once
            self.failed_here = True
            self._bounded(lambda: self._mark(exc_type, exc), OP_TIMEOUT)
            _abort_shared_memory()  # local peers waiting in shared memory stop now, not at our exit
        print_traceback()
        comm = _looks_like_comm_failure(exc_type, exc)
        result: list[Optional[str]] = [None]

        def _work() -> None:
            result[0] = self.verdict(comm)

        self._bounded(_work, DIAGNOSIS_LIMIT)
        if mark:
            self.stopping.set()  # no more heartbeats: this rank is going down
        if result[0]:
            with contextlib.suppress(Exception):
                sys.stderr.write(result[0] + "\n")
                sys.stderr.flush()

    def _mark(self, exc_type: type, exc: Optional[BaseException]) -> None:
        if self.marked or not self.store_reachable():
            return
        self.client.append(self.key("failed"), f"{self.rank}\t{_describe(exc_type, exc)}\n")
        self.marked = True

    @staticmethod
    def _bounded(fn: Callable[[], None], limit: float) -> None:
        def _run() -> None:
            with contextlib.suppress(Exception):
                fn()

        t = threading.Thread(target=_run, name="cpuddp-watchdog-diagnosis", daemon=True)
        t.start()
        t.join(limit)

    # -- the diagnosis

    @staticmethod
    def _ranks(text: str) -> set[int]:
        out = set()
        for line in text.splitlines():
            head = line.split("\t", 1)[0].strip()
            if head.isdigit():
                out.add(int(head))
        return out

    def _failed(self) -> list[tuple[int, str]]:
        out = []
        for line in self.get_text("failed").splitlines():
            head, _, why = line.partition("\t")
            if head.strip().isdigit():
                out.append((int(head), why.strip()))
        return out

    def _info(self) -> dict[int, tuple[int, str, str]]:
        out = {}
        for line in self.get_text("info").splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[0].isdigit() and parts[1].isdigit():
                out[int(parts[0])] = (int(parts[1]), parts[2], parts[3])
        return out

    def _counters(self, ranks: list[int]) -> dict[int, int]:
        keys = [self.key(f"hb/{r}") for r in ranks]
        if keys and self.client.check(keys):
            values = self.client.multi_get(keys)
            return {r: int(v or b"0") for r, v in zip(ranks, values)}
        return {r: int(self.client.add(k, 0)) for r, k in zip(ranks, keys)}

    def _store_gone(self) -> Optional[str]:
        me = f"cpuddp: [rank{self.rank}]"
        if self.agent_store:
            return (f"{me} the rendezvous store (torchrun's agent at {self.store_lost}) is gone: "
                    f"the agent or its node died; see the launcher's log")
        if self.rank == 0:
            return None
        known = self.known.get(0)
        who = f"rank 0 (pid {known[0]} on {known[1]})" if known else "rank 0"
        return f"{me} lost {who}, which hosts the rendezvous store (at {self.store_lost}); see rank 0's log"

    def verdict(self, comm_failure: bool) -> Optional[str]:
        if not self.store_reachable():
            return self._store_gone()
        try:
            return self._verdict(comm_failure)
        except Exception as exc:
            # The store died under us: a connect can still succeed while rank 0's sockets close.
            if self.store_lost is None:
                self.store_lost = f"{self.host}:{self.port} ({type(exc).__name__}: {first_line(exc)})"
            self.stopping.set()
            return self._store_gone()

    def _verdict(self, comm_failure: bool) -> Optional[str]:
        me = f"cpuddp: [rank{self.rank}]"
        failed = self._failed()
        done = self._ranks(self.get_text("done"))
        info = self._info()
        self.known.update(info)
        failed_ranks = {r for r, _ in failed}
        others = [r for r in range(self.world) if r != self.rank and r not in failed_ranks and r not in done]

        def who(r: int) -> str:
            if r in info:
                pid, host, _ = info[r]
                return f"rank {r} (pid {pid} on {host})"
            return f"rank {r}"

        dead: list[int] = []
        rest: list[int] = []
        for r in others:
            if r in info and info[r][2] == self.identity and _pid_gone(info[r][0]):
                dead.append(r)
            else:
                rest.append(r)
        first = next(((r, why) for r, why in failed), None)
        blamed = first is not None and first[0] != self.rank
        stale: list[int] = []
        waited = 0.0
        if rest and comm_failure and not dead and not blamed:
            # Nobody is known to have died or raised: look for a rank that stopped answering
            # (host down, process stopped, stuck in native code holding the GIL).
            stale, waited = self._sample(rest)
        if dead or stale:
            details = [f"{who(r)} died without a Python exception (killed, a crash, or os._exit)" for r in dead]
            for r in stale:
                local = r in info and info[r][2] == self.identity
                why = ("alive but not responding: stopped, or stuck holding the GIL" if local
                       else "its host is down or unreachable, or it is stuck")
                details.append(f"no heartbeat from {who(r)} for {waited:.0f} s ({why})")
            return f"{me} lost rank(s) {sorted(dead + stale)}: " + "; ".join(details)
        if blamed:
            r, why = first  # type: ignore[misc]
            return f"{me} lost rank(s) [{r}]: {who(r)} raised {why}"
        if comm_failure and done:
            gone = sorted(done - failed_ranks - {self.rank})
            if gone:
                return (f"{me} rank(s) {gone} already left the group (shutdown or exit) while this rank "
                        f"still expected them in a collective: the ranks ran different collectives")
        return None

    def _sample(self, ranks: list[int]) -> tuple[list[int], float]:
        t0 = time.monotonic()
        first = self._counters(ranks)
        moved: set[int] = set()
        step = min(0.5, self.interval / 2)
        while time.monotonic() - t0 < self.stale and len(moved) < len(ranks):
            time.sleep(step)
            now = self._counters([r for r in ranks if r not in moved])
            moved.update(r for r, v in now.items() if v != first[r])
        return [r for r in ranks if r not in moved], time.monotonic() - t0
