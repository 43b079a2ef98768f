"""Test DDP code on N gloo ranks in CI: ``run_distributed`` and the pytest plugin.

``run_distributed(fn, world_size=2)`` spawns ``world_size`` fresh processes (spawn, never
fork), forms a real process group among them with :func:`cpuddp.init_distributed`, runs
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
dies is killed by the kernel (``PR_SET_PDEATHSIG``, Linux).  (Spawning starts Python's one
``multiprocessing`` resource tracker, which lives as long as the test process.)

No shared ports: the parent hosts the rendezvous store on a socket it binds to
``127.0.0.1:0`` itself, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``), and
holds it until the call ends, so back-to-back calls and concurrent pytest-xdist workers
never race for a port.  The ranks' gloo traffic stays on the loopback interface.

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

The pytest plugin (entry point ``pytest11: cpuddp``, loaded whenever cpuddp is installed)
adds the ``run_distributed`` and ``clean_launcher_env`` fixtures, the
``distributed(world_size=..., timeout=..., ...)`` marker and the ``cpuddp_isolate_env`` ini
option; see ``docs/testing.md``.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import multiprocessing
import os
import pickle
import pickletools
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback as _tb
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

from .errors import RankFailedError, how_it_ended

__all__ = ["run_distributed", "clean_environ", "is_launcher_variable", "LAUNCHER_ENV_PREFIXES", "LAUNCHER_ENV_NAMES"]

from . import launchers as _launchers

log = logging.getLogger("cpuddp.testing")

#: What a test must not inherit: every launcher's variables (:mod:`cpuddp.launchers`) plus the
#: backend settings cpuddp exports, so one test's world never leaks into the next.  They are
#: stripped from each rank's environment and hidden from a test by ``clean_launcher_env``.
LAUNCHER_ENV_PREFIXES = (*_launchers.LAUNCHER_ENV_PREFIXES, "CCL_")
LAUNCHER_ENV_NAMES = (*_launchers.LAUNCHER_ENV_NAMES, "GLOO_SOCKET_IFNAME")

#: Set by run_distributed for each rank; ``env=`` may not override them.
_RANK_CONTROLLED = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "CPUDDP_TEST_RUN_ID",
)

#: After a first failure, how long to wait for the other ranks' reports, to find the root cause.
_SETTLE = 1.0
#: After every result is in, how long ranks get to exit on their own (atexit, coverage data).
_EXIT_GRACE = 5.0
#: SIGTERM, then SIGKILL after this many seconds.
_KILL_AFTER = 2.0


def is_launcher_variable(name: str) -> bool:
    """True for a variable some launcher sets to describe a launched process."""
    return name in LAUNCHER_ENV_NAMES or name.startswith(LAUNCHER_ENV_PREFIXES)


def clean_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any launcher's variables."""
    return {k: v for k, v in environ.items() if not is_launcher_variable(k)}


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

    import torch.distributed as dist

    ctx = multiprocessing.get_context("spawn")
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, True, datetime.timedelta(seconds=timeout),
            wait_for_workers=False, master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening socket now and closes it when destroyed

    base = clean_environ(os.environ)
    if not pin:
        base["OMP_NUM_THREADS"] = str(threads)
    base["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    base.update(extra)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        CPUDDP_TEST_RUN_ID=uuid.uuid4().hex,
    )

    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    workdir = tempfile.mkdtemp(prefix="cpuddp-run-")
    stacks = [os.path.join(workdir, f"rank{r}.stack") for r in range(world_size)]
    ok = False
    try:
        for rank in range(world_size):
            ours, theirs = ctx.Pipe(duplex=False)
            conns[ours] = rank
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            p = ctx.Process(
                target=_rank_main,
                args=(theirs, rank_env, payload, modules, backend, float(timeout), pin, threads, stacks[rank]),
                # not daemonic: a rank may start processes of its own (DataLoader workers);
                # every rank is stopped and reaped before run_distributed returns anyway
                name=f"cpuddp-rank{rank}",
            )
            try:
                p.start()
            finally:
                theirs.close()
            procs.append(p)
        results = _collect(procs, conns, deadline, timeout, stacks)
        ok = True
        return results
    finally:
        _stop(procs, grace=_EXIT_GRACE if ok else 0.0)
        for c in conns:
            c.close()
        del store
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------- the parent side


class _Report(NamedTuple):
    stage: str  # "load" (unpickling fn), "init" (joining the group), "run" (fn), "report" (pickling the result)
    summary: str  # the exception's first line: "ValueError: boom"
    traceback: str
    when: float  # time.monotonic() in the rank: system-wide, so comparable across ranks


def _collect(
    procs: list[Any], conns: dict[Connection, int], deadline: float, timeout: float, stacks: list[str]
) -> list[Any]:
    """Wait for every rank's report; raise RankFailedError on the first failure or at the deadline."""
    __tracebackhide__ = True
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
            raise _timeout_error(procs, sorted(set(range(n)) - set(results)), sorted(results), timeout, stacks)
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
        raise _failure_error(n, results, errors, died, stacks)
    return [results[r] for r in range(n)]


def _failure_error(
    n: int, results: dict[int, Any], errors: dict[int, _Report], died: dict[int, Optional[int]], stacks: list[str]
) -> RankFailedError:
    # A rank that died without a word comes first: the others' errors ("Connection closed by
    # peer") follow from it.  Otherwise the rank that raised first is the root cause.
    if died:
        root = min(died)
        msg = f"rank {root} of {n} {how_it_ended(died[root])} before reporting a result"
        stack = _trim_stack(_read(stacks[root]))
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


_LOAD_FIX = (
    "define fn (and the classes of its arguments) at module level in a module the ranks can "
    "import: a test module, conftest.py or a package on sys.path; not a lambda, a nested "
    "function or a module made at run time"
)


def _timeout_error(procs: list[Any], missing: list[int], done: list[int], timeout: float, stacks: list[str]) -> RankFailedError:
    dumps = _dump_stacks([procs[r] for r in missing], [stacks[r] for r in missing])
    none = "(no Python stack: the rank had not reached Python code yet, or did not answer SIGUSR1)"
    parts = [f"--- rank {r}, where it was at the timeout:\n{text or none}" for r, text in zip(missing, dumps)]
    msg = f"{_ranks(missing)} of {len(procs)} did not finish within {timeout:g} s"
    if done:
        msg += f" ({_ranks(done)} returned)"
    return RankFailedError(
        msg,
        rank=missing[0] if len(missing) == 1 else None,
        traceback="\n".join(parts),
        fix="a rank is stuck, often in a collective another rank never entered (see the stacks above); "
        "if the work is just slow, raise timeout=",
    )


def _dump_stacks(procs: list[Any], paths: list[str]) -> list[str]:
    """Ask each live rank for its Python stack (SIGUSR1 -> faulthandler) and read the answers."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None:
        return [""] * len(procs)
    sizes = [_size(p) for p in paths]
    asked = []
    for proc, path, size in zip(procs, paths, sizes):
        if proc.is_alive():
            with contextlib.suppress(OSError):
                os.kill(proc.pid, sig)
                asked.append(path)
    end = time.monotonic() + 2.0
    while asked and time.monotonic() < end:
        if all(_size(p) > s for p, s in zip(paths, sizes) if p in asked):
            time.sleep(0.1)  # let the last writes land
            break
        time.sleep(0.05)
    return [_trim_stack(_read(p, start=s)) for p, s in zip(paths, sizes)]


def _trim_stack(text: str) -> str:
    """Drop the frames below fn (this harness, multiprocessing's bootstrap) from a faulthandler dump."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith("  File ") and line.endswith(" in _rank_main") and __file__ in line:
            skipping = True
        elif not line.startswith("  File "):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out).strip()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, start: int = 0) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(start)
            return f.read().strip()
    except OSError:
        return ""


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stop(procs: list[Any], grace: float) -> None:
    """Reap every rank: wait ``grace`` s for them to exit, then SIGTERM them and their
    descendants, then SIGKILL what is left."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    if not alive:
        return
    if grace > 0:
        log.warning(
            "cpuddp.testing: %s did not exit within %.0f s of reporting a result; stopping them",
            _ranks([procs.index(p) for p in alive]), grace,
        )
    kids: list[Any] = []
    with contextlib.suppress(Exception):
        import psutil

        for p in alive:  # before the rank dies, or its children are re-parented out of sight
            with contextlib.suppress(psutil.Error):
                kids.extend(psutil.Process(p.pid).children(recursive=True))
    for p in alive:
        with contextlib.suppress(OSError):
            p.terminate()
    for k in kids:
        with contextlib.suppress(Exception):
            k.terminate()
    end = time.monotonic() + _KILL_AFTER
    for p in alive:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            with contextlib.suppress(OSError):
                p.kill()
            p.join(5.0)
    if kids:
        import psutil

        left = _wait_gone(kids, end)
        for k in left:
            with contextlib.suppress(psutil.Error):
                k.kill()
        _wait_gone(left, time.monotonic() + 5.0)


def _wait_gone(procs: list[Any], end: float) -> list[Any]:
    """Poll until each psutil process is gone or a zombie (no longer ours to reap: its
    parent, a rank, is dead), or until ``end``; return those still running."""
    import psutil

    def running(p: Any) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    left = [p for p in procs if running(p)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in left if running(p)]
    return left


def _loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(Exception):
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
                return name
    return "lo0" if sys.platform == "darwin" else "lo"


# --------------------------------------------------------------------------- shipping fn to the ranks


def _dumps_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    if not callable(fn):
        raise TypeError(f"run_distributed: fn must be callable, got {type(fn).__name__}")
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"run_distributed: cannot pickle fn {getattr(fn, '__qualname__', fn)!r} or its arguments "
            f"({type(exc).__name__}: {exc}); {_LOAD_FIX}"
        ) from exc


class _ModuleRef(NamedTuple):
    file: Optional[str]  # None for a namespace package
    path: Optional[list[str]]  # __path__ of a package, else None
    rewrite: bool  # pytest rewrote its asserts in the parent


def _module_refs(payload: bytes, fn: Any) -> dict[str, _ModuleRef]:
    """The user's modules the payload refers to, with the files the parent loaded them from.

    The ranks need them when pytest imported a test module in a way plain ``import`` cannot
    repeat (``--import-mode=importlib``), and to rewrite asserts as pytest did."""
    names = {getattr(fn, "__module__", None)}
    for op, arg, _ in pickletools.genops(payload):
        if isinstance(arg, str):
            names.add(arg.split(" ")[0] if op.name in ("GLOBAL", "INST") else arg)
    names = {n for n in names if isinstance(n, str) and n in sys.modules and n not in ("__main__", "__mp_main__")}
    for name in list(names):  # and their parent packages
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    skip = _installed_roots()
    refs: dict[str, _ModuleRef] = {}
    for name in sorted(names):
        mod = sys.modules.get(name)
        file = getattr(mod, "__file__", None)
        path = getattr(mod, "__path__", None)
        if mod is None or (file is None and path is None):
            continue
        if file is not None and not file.endswith(".py"):
            continue
        where = file or next(iter(path), "")  # type: ignore[arg-type]
        if not where or os.path.abspath(where).startswith(skip):
            continue
        loader = getattr(getattr(mod, "__spec__", None), "loader", None)
        refs[name] = _ModuleRef(file, list(path) if path is not None else None, type(loader).__name__ == "AssertionRewritingHook")
    return refs


def _installed_roots() -> tuple[str, ...]:
    import site
    import sysconfig

    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            roots.add(sysconfig.get_paths()[key])
    with contextlib.suppress(Exception):
        roots.update(site.getsitepackages())
    with contextlib.suppress(Exception):
        roots.add(site.getusersitepackages())
    return tuple(os.path.abspath(r) + os.sep for r in roots if r)


class _RankLoader(importlib.machinery.SourceFileLoader):
    """Loads a user module from the parent's file; rewrites asserts when pytest did."""

    def __init__(self, fullname: str, path: str, rewrite: bool) -> None:
        super().__init__(fullname, path)
        self.rewrite = rewrite

    def get_code(self, fullname: str) -> Any:
        source = self.get_data(self.path)
        if self.rewrite:
            try:  # pytest's own rewriter (a private API: fall back to plain asserts if it moves)
                from _pytest.assertion.rewrite import rewrite_asserts

                tree = ast.parse(source, filename=self.path)
                rewrite_asserts(tree, source, self.path, None)
                return compile(tree, self.path, "exec", dont_inherit=True)
            except Exception:
                pass
        return compile(source, self.path, "exec", dont_inherit=True)


class _RankFinder(importlib.abc.MetaPathFinder):
    """First in ``sys.meta_path``: the modules pytest rewrote.  Last (``fallback``): any user
    module the normal import system cannot find, e.g. under ``--import-mode=importlib``."""

    def __init__(self, refs: dict[str, _ModuleRef], fallback: bool) -> None:
        self.refs = refs
        self.fallback = fallback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        ref = self.refs.get(fullname)
        if ref is None or not (self.fallback or ref.rewrite):
            return None
        if ref.file is None:
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = list(ref.path or [])
            return spec
        return importlib.util.spec_from_file_location(
            fullname, ref.file, loader=_RankLoader(fullname, ref.file, ref.rewrite), submodule_search_locations=ref.path
        )


# --------------------------------------------------------------------------- the rank side


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent is already gone
            os._exit(1)


_stack_file: Any = None


def _stacks_to(path: str) -> None:
    """Python stacks to ``path`` on a crash (SIGSEGV, SIGABRT, ...) and on SIGUSR1 (a hang)."""
    global _stack_file
    with contextlib.suppress(Exception):
        import faulthandler

        _stack_file = open(path, "w")
        faulthandler.enable(_stack_file, all_threads=True)
        if hasattr(faulthandler, "register") and hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, _stack_file, all_threads=True, chain=False)


def _send(conn: Connection, message: Any) -> None:
    # Plain pickle, by value: the default ForkingPickler would move tensors through shared
    # memory handed over by this process, which is gone by the time the parent reads them.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _rank_main(
    conn: Connection, rank_env: dict[str, str], payload: bytes, refs: dict[str, _ModuleRef],
    backend: str, timeout: float, pin: bool, threads: int, stack_path: str,
) -> None:
    _die_with_parent()
    os.environ.clear()
    os.environ.update(rank_env)
    _stacks_to(stack_path)
    stage = "load"
    try:
        if refs:
            sys.meta_path.insert(0, _RankFinder(refs, fallback=False))
            sys.meta_path.append(_RankFinder(refs, fallback=True))
        fn, args, kwargs = pickle.loads(payload)
        stage = "init"
        import torch

        if not pin:
            torch.set_num_threads(threads)
        from .distributed import init_distributed, shutdown

        init_distributed(backend, timeout=timeout, pin=pin)
        stage = "run"
        result = fn(*args, **kwargs)
        stage = "report"
        _send(conn, ("ok", result))
    except BaseException as exc:
        summary = "".join(_tb.format_exception_only(type(exc), exc)).strip().splitlines()
        tb = exc.__traceback__
        if stage == "run" and tb is not None and tb.tb_next is not None:
            tb = tb.tb_next  # start the traceback at fn, not at this harness
        text = "".join(_tb.format_exception(type(exc), exc, tb))
        with contextlib.suppress(Exception):
            _send(conn, ("error", _Report(stage, summary[0] if summary else type(exc).__name__, text, time.monotonic())))
        _exit_now(1, cleanly=False)  # no teardown: the group may be broken, and a hung teardown helps nobody
    conn.close()
    shutdown()
    _exit_now(0, cleanly=True)


def _exit_now(code: int, *, cleanly: bool) -> None:
    """Exit without the interpreter's finalization (tearing torch down takes seconds on a
    loaded machine, and has hung), after the atexit handlers when ``cleanly`` (coverage
    data, logging), and after stopping any process fn started and left running."""
    if cleanly:
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        import psutil

        kids = psutil.Process().children(recursive=True)
        for k in kids:
            with contextlib.suppress(psutil.Error):
                k.terminate()
        _, left = psutil.wait_procs(kids, timeout=_KILL_AFTER)
        for k in left:
            with contextlib.suppress(psutil.Error):
                k.kill()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# --------------------------------------------------------------------------- pytest plugin

try:
    import pytest
except ImportError:  # pragma: no cover - the plugin only loads under pytest
    pytest = None  # type: ignore[assignment]


_MARKER_OPTIONS = ("world_size", "timeout", "backend", "env", "pin", "threads")


def _restore_environ(saved: Mapping[str, str]) -> None:
    """Make ``os.environ`` equal to ``saved`` again."""
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _marker_options(node: Any) -> dict[str, Any]:
    marker = node.get_closest_marker("distributed")
    if marker is None:
        return {}
    if len(marker.args) > 1:
        raise TypeError(f"@pytest.mark.distributed takes at most one positional argument (world_size), got {marker.args}")
    opts = dict(marker.kwargs)
    if marker.args:
        if "world_size" in opts:
            raise TypeError("@pytest.mark.distributed: world_size given both by position and by name")
        opts["world_size"] = marker.args[0]
    unknown = sorted(set(opts) - set(_MARKER_OPTIONS))
    if unknown:
        raise TypeError(f"@pytest.mark.distributed got unknown option(s) {unknown}; it takes {list(_MARKER_OPTIONS)}")
    return opts


if pytest is not None:

    def pytest_addoption(parser: Any) -> None:
        parser.addini(
            "cpuddp_isolate_env",
            "cpuddp: hide launcher variables (RANK, PMI_*, SLURM_*, ...) from every test and "
            "restore the environment after it, as the clean_launcher_env fixture does",
            type="bool",
            default=False,
        )

    def pytest_configure(config: Any) -> None:
        config.addinivalue_line(
            "markers",
            "distributed(world_size=2, *, timeout=60, backend='gloo', env=None, pin=False, threads=1): "
            "defaults for the cpuddp run_distributed fixture",
        )

    @pytest.fixture
    def clean_launcher_env(monkeypatch: Any) -> Iterator[None]:
        """Hide every launcher variable during the test; restore the environment after it.

        Variables the test (or code it calls, such as ``init_distributed``) sets are removed
        afterwards, and those it hid or changed come back.
        """
        # Hiding goes through monkeypatch, and this teardown runs before monkeypatch's
        # (it is set up first): so a test's own monkeypatch.setenv("RANK", ...) unwinds in
        # the right order, and direct os.environ writes are undone here.
        saved = dict(os.environ)
        for key in [k for k in os.environ if is_launcher_variable(k)]:
            monkeypatch.delenv(key)
        yield
        _restore_environ(saved)

    @pytest.fixture(autouse=True)
    def _cpuddp_isolate_env(request: Any) -> None:
        if request.config.getini("cpuddp_isolate_env"):
            request.getfixturevalue("clean_launcher_env")

    @pytest.fixture(name="run_distributed")
    def run_distributed_fixture(request: Any, clean_launcher_env: None) -> Callable[..., list[Any]]:
        """``run_distributed(fn, world_size=None, **options)``, defaults from ``@pytest.mark.distributed``."""
        defaults = _marker_options(request.node)

        def runner(fn: Callable[..., Any], world_size: Optional[int] = None, **options: Any) -> list[Any]:
            __tracebackhide__ = True
            opts = {**defaults, **options}
            size = opts.pop("world_size", 2) if world_size is None else world_size
            opts.pop("world_size", None)
            return run_distributed(fn, size, **opts)

        return runner
