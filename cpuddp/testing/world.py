"""Test DDP code on N gloo ranks in CI: ``run_distributed``.

``run_distributed(fn, world_size=2)`` starts ``world_size`` fresh processes (forked from
Python's fork server, which has imported torch once; never from the test process), forms a
real process group among them with :func:`cpuddp.init_distributed`, runs
``fn(*args, **kwargs)`` on each, and returns the return values in rank order::

    def _step():                          # module level: the ranks import it by name
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(_step, 2) == [3.0, 3.0]

Failure modes -- every one raises a single :class:`~cpuddp.errors.RankFailedError` whose
``rank`` names the rank at fault and whose ``traceback`` holds its traceback or stack:

* A rank raises: the error carries that rank's number and traceback; the other ranks are
  stopped at once (also those blocked in a collective with it).  When several ranks fail,
  the root cause is reported (the first to raise, or a rank that died without a word,
  since the others' "connection closed" errors follow from it) and the rest are listed.
* A rank dies without reporting (SIGKILL, the out-of-memory killer, ``os._exit``, a
  segfault): the error names its exit code or signal; for a crash in native code it
  carries the rank's Python stack (``faulthandler``).
* A rank hangs: the call fails at ``timeout`` naming the ranks that did not finish, with
  each one's Python stack at that moment.
* ``fn`` or an argument cannot be pickled: ``TypeError`` before any process starts.

No orphans: every rank is stopped and reaped before the call returns or raises, and so
are the processes it started (a rank stops its own before exiting; the parent stops those
of a rank it has to kill -- only a rank killed outright cannot), and a rank whose parent
dies is killed by the kernel (``PR_SET_PDEATHSIG``, Linux; the fork server, the ranks' parent,
ends with the test process).  (The first call starts Python's ``multiprocessing`` fork server
and resource tracker, which live as long as the test process.)

No shared ports: the parent hosts the rendezvous store on a socket it binds to
``127.0.0.1:0`` itself, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``), and
holds it until the call ends, so back-to-back calls and concurrent pytest-xdist workers
never race for a port.  The ranks' gloo traffic stays on the loopback interface.  (The store,
the ranks' environment, their stacks and their reaping come from :mod:`cpuddp._procs`, the
launcher ``cpuddp bench --nproc`` uses too; the rank side is :mod:`cpuddp.testing.rank`, the
pickling and import hooks :mod:`cpuddp.testing.ship`.)

Environment of each rank: the parent's, minus every launcher's variables
(:func:`clean_environ`: ``RANK``, ``PMI_*``, ``SLURM_*``, ...; a test run under srun or
mpirun still gets a clean world), plus ``env=``, plus ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE``, ``GLOO_SOCKET_IFNAME`` (loopback), ``OMP_NUM_THREADS``
(``threads=``, unless pinning) and ``CPUDDP_TEST_RUN_ID`` (unique per call).

Where ``fn`` may live: at module level in any module, including a pytest test module or a
conftest under every ``--import-mode`` (``importlib`` too: the ranks load such modules from
the file the parent loaded them from) -- and the ranks rewrite ``assert`` statements in test
modules as pytest does, so a failing assert inside ``fn`` reads as it would in the test.
Lambdas and functions nested in a test cannot be pickled.

The pytest plugin (:mod:`cpuddp.testing.plugin`; entry point ``pytest11: cpuddp``, loaded
whenever cpuddp is installed) adds the ``run_distributed`` and ``clean_launcher_env`` fixtures,
the ``distributed(world_size=..., timeout=..., ...)`` marker and the ``cpuddp_isolate_env`` ini
option; see ``docs/testing.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import pickle
import socket
import sys
import time
import traceback as _tb
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from cpuddp.errors import RankFailedError, how_it_ended

__all__ = ["run_distributed", "clean_environ", "is_launcher_variable", "LAUNCHER_ENV_PREFIXES", "LAUNCHER_ENV_NAMES"]

from cpuddp import _procs
from cpuddp.launchers import registry as _launchers

from .rank import Report as _Report
from .rank import rank_main as _rank_main
from .rank import trim_stack as _trim_stack
from .ship import LOAD_FIX as _LOAD_FIX
from .ship import ModuleRef as _ModuleRef
from .ship import dumps_call as _dumps_call
from .ship import module_refs as _module_refs

log = logging.getLogger("cpuddp.testing")

#: What a test must not inherit: every launcher's variables (:mod:`cpuddp.launchers`) plus the
#: backend settings cpuddp exports, so one test's world never leaks into the next.  They are
#: stripped from each rank's environment and hidden from a test by ``clean_launcher_env``.
LAUNCHER_ENV_PREFIXES = (*_launchers.LAUNCHER_ENV_PREFIXES, *_launchers.BACKEND_ENV_PREFIXES)
LAUNCHER_ENV_NAMES = (*_launchers.LAUNCHER_ENV_NAMES, *_launchers.BACKEND_ENV_NAMES)

#: Set by run_distributed for each rank; ``env=`` may not override them.
_RANK_CONTROLLED = (*_procs.RANK_CONTROLLED, "CPUDDP_TEST_RUN_ID")

#: After a first failure, how long to wait for the other ranks' reports, to find the root cause.
_SETTLE = 1.0
#: After every result is in, how long ranks get to exit on their own (atexit, coverage data).
_EXIT_GRACE = 5.0


def is_launcher_variable(name: str) -> bool:
    """True for a variable some launcher sets to describe a launched process, or a backend setting."""
    return _launchers.is_launcher_variable(name, backend_settings=True)


def clean_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any launcher's variables or backend settings."""
    return _launchers.clean_environ(environ, strip_backend_settings=True)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    backend: str = "gloo",
    timeout: Union[float, datetime.timedelta] = 60.0,
    env: Optional[Mapping[str, str]] = None,
    pin: bool = False,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks with an initialized process group; return results by rank.

    ``fn`` and its arguments must be picklable (a module-level function), and so must its
    return value.  ``timeout`` (seconds) bounds the whole call, start-up included, and each
    rank's rendezvous and collectives.  ``env`` adds variables to every rank's environment;
    ``pin`` lets :func:`cpuddp.init_distributed` pin cores (off by default: parallel test
    workers would fight over them); ``threads`` sets each rank's torch/OpenMP thread count
    when not pinning.  Raises :class:`~cpuddp.errors.RankFailedError` (see the module doc).
    """
    __tracebackhide__ = True  # pytest: show the test's line, not this harness
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    extra = dict(env or {})
    bad = sorted(k for k, v in extra.items() if not isinstance(k, str) or not isinstance(v, str))
    if bad:
        raise TypeError(f"env= must map str to str; not so for {bad}")
    taken = sorted(set(extra) & set(_RANK_CONTROLLED))
    if taken:
        raise ValueError(f"env= may not set {taken}: run_distributed sets them for each rank")
    payload = _dumps_call(fn, tuple(args), dict(kwargs or {}))
    modules = _module_refs(payload, fn)
    deadline = time.monotonic() + timeout

    settings = {} if pin else {"OMP_NUM_THREADS": str(threads)}
    settings["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    settings.update(extra)  # env= may override the two above
    settings["CPUDDP_TEST_RUN_ID"] = uuid.uuid4().hex
    with _procs.LocalWorld(world_size, timeout, extra=settings, strip_backend_settings=True) as world:
        return _start_and_collect(world, payload, modules, backend, float(timeout), pin, threads, deadline)


def _start_and_collect(world: _procs.LocalWorld, payload: bytes, modules: dict[str, "_ModuleRef"], backend: str,
                       timeout: float, pin: bool, threads: int, deadline: float) -> list[Any]:
    """Spawn every rank of ``world``, collect the results, and stop the ranks (gracefully after success)."""
    __tracebackhide__ = True
    ctx = _rank_context()
    conns: dict[Connection, int] = {}
    ok = False
    try:
        for rank in range(world.world_size):
            ours, theirs = ctx.Pipe(duplex=False)
            conns[ours] = rank
            p = ctx.Process(
                target=_rank_main,
                args=(theirs, world.environ(rank), payload, modules, backend, timeout, pin, threads),
                # not daemonic: a rank may start processes of its own (DataLoader workers);
                # every rank is stopped and reaped before run_distributed returns anyway
                name=f"cpuddp-rank{rank}",
            )
            try:
                p.start()
            finally:
                theirs.close()
            world.add(p)
        results = _collect(world, conns, deadline, timeout)
        ok = True
        return results
    finally:
        stopped = world.stop(grace=_EXIT_GRACE if ok else 0.0)
        if ok and stopped:
            log.warning("cpuddp.testing: %s did not exit within %.0f s of reporting a result; they were stopped",
                        _ranks(stopped), _EXIT_GRACE)
        for c in conns:
            c.close()


def _rank_context() -> multiprocessing.context.BaseContext:
    """Where ranks start: Python's fork server, which imports torch once and forks each rank from
    that clean, single-threaded process (never the test process itself, whose threads and state a
    fork would copy).  A rank so started is a fresh interpreter that finds torch imported: it
    skips the second or more that every rank spent importing torch, which made a test suite of
    many small worlds CPU-bound.  The server lives as long as the test process (it is started by
    the first call and ends when its parent does); each rank still gets a clean environment
    (``rank_main`` sets it whole) and dies with its parent (``PR_SET_PDEATHSIG``; the server dies
    with the test process)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows: a spawn each, as before
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])  # read when the server starts: the first call of this process
    return ctx


# --------------------------------------------------------------------------- the parent side


def _collect(world: _procs.LocalWorld, conns: dict[Connection, int], deadline: float, timeout: float) -> list[Any]:
    """Wait for every rank's report; raise RankFailedError on the first failure or at the deadline."""
    __tracebackhide__ = True
    procs = world.procs
    n = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, _Report] = {}
    died: dict[int, Optional[int]] = {}  # rank -> exit code, for ranks that ended without a report
    live = dict(conns)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    settle: Optional[float] = None

    def read(conn: Connection, rank: int) -> None:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # closed without a report: the sentinel says how the rank ended
        try:
            status, value = pickle.loads(data)
        except Exception as exc:
            errors[rank] = _Report(
                "report", f"the parent could not unpickle rank {rank}'s report: {type(exc).__name__}: {exc}",
                _tb.format_exc(), time.monotonic(),
            )
            return
        if status == "ok":
            results[rank] = value
        else:
            errors[rank] = value

    while len(results) + len(errors) + len(died) < n:
        now = time.monotonic()
        if settle is not None and now >= settle:
            break
        if now >= deadline:
            if errors or died:
                break
            raise _timeout_error(world, sorted(set(range(n)) - set(results)), sorted(results), timeout)
        ready = wait(list(live) + list(sentinels), timeout=min(deadline, settle or deadline) - now)
        for obj in ready:
            if obj in live:
                read(obj, live.pop(obj))  # type: ignore[arg-type]
        for obj in ready:
            if obj in sentinels:
                rank = sentinels.pop(obj)  # type: ignore[index]
                for conn in [c for c, r in live.items() if r == rank]:
                    del live[conn]
                    read(conn, rank)  # the rank is gone: whatever it wrote is there
                if rank not in results and rank not in errors:
                    procs[rank].join(2.0)  # the sentinel can fire a moment before the exit code is reapable
                    died[rank] = procs[rank].exitcode
        if (errors or died) and settle is None:
            settle = time.monotonic() + _SETTLE
    if errors or died:
        raise _failure_error(world, results, errors, died)
    return [results[r] for r in range(n)]


def _failure_error(
    world: _procs.LocalWorld, results: dict[int, Any], errors: dict[int, _Report], died: dict[int, Optional[int]]
) -> RankFailedError:
    n = world.world_size
    # A rank that died without a word comes first: the others' errors ("Connection closed by
    # peer") follow from it.  Otherwise the rank that raised first is the root cause.
    if died:
        root = min(died)
        msg = f"rank {root} of {n} {how_it_ended(died[root])} before reporting a result"
        stack = _trim_stack(world.read_stack(root))
        tb = f"its Python stack when it crashed:\n{stack}" if stack else None
        fix = (
            "a rank that ends without reporting was killed (the out-of-memory killer sends SIGKILL), "
            "crashed in native code, or called os._exit(); its captured stderr may say more"
        )
    else:
        root = min(errors, key=lambda r: (errors[r].when, r))
        report = errors[root]
        what = {
            "load": "could not load fn",
            "init": "failed to join the process group",
            "report": "could not send its return value",
        }.get(report.stage, "raised")
        msg = f"rank {root} of {n} {what}: {report.summary}"
        tb = report.traceback
        fix = _LOAD_FIX if report.stage == "load" else None
    also = [f"rank {r} {how_it_ended(c)}" for r, c in sorted(died.items()) if r != root]
    also += [f"rank {r}: {_clip(e.summary)}" for r, e in sorted(errors.items(), key=lambda kv: kv[1].when) if r != root]
    stopped = sorted(set(range(n)) - set(results) - set(errors) - set(died))
    if also:
        msg += "\nalso failed: " + "; ".join(also)
    if stopped:
        msg += f"\nstopped: {_ranks(stopped)} (still running)"
    return RankFailedError(msg, rank=root, traceback=tb, fix=fix)


def _timeout_error(world: _procs.LocalWorld, missing: list[int], done: list[int], timeout: float) -> RankFailedError:
    dumps = world.dump_stacks(missing)
    none = "(no Python stack: the rank had not reached Python code yet, or did not answer SIGUSR1)"
    parts = [f"--- rank {r}, where it was at the timeout:\n{_trim_stack(dumps[r]) or none}" for r in missing]
    msg = f"{_ranks(missing)} of {world.world_size} did not finish within {timeout:g} s"
    if done:
        msg += f" ({_ranks(done)} returned)"
    return RankFailedError(
        msg,
        rank=missing[0] if len(missing) == 1 else None,
        traceback="\n".join(parts),
        fix="a rank is stuck, often in a collective another rank never entered (see the stacks above); "
        "if the work is just slow, raise timeout=",
    )


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(Exception):
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
                return name
    return "lo0" if sys.platform == "darwin" else "lo"
