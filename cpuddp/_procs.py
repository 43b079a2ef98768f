"""Start, watch and stop local ranks: the one launcher behind ``cpuddp.testing.run_distributed``
and ``cpuddp bench --nproc``.

:class:`LocalWorld` owns what both need:

* **The rendezvous store**, hosted in this (the parent) process on a socket it binds to
  ``127.0.0.1:0`` itself and holds until the world ends -- as torchrun's agent does
  (``TORCHELASTIC_USE_AGENT_STORE=True``; :func:`cpuddp.launchers.rendezvous.open_store` joins it as a
  client) -- so no port is chosen by bind-then-release and two worlds never race for one.
* **Each rank's environment**, built once: the parent's minus every launcher's variables
  (:func:`cpuddp.launchers.clean_environ`), plus ``extra``, plus ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``,
  ``TORCHELASTIC_USE_AGENT_STORE``, ``TORCHELASTIC_RESTART_COUNT=0`` and
  :data:`STACK_FILE_ENV` (where the rank writes its Python stack when asked); and
  :data:`NUMPY_WARNING_FILTER` appended to ``PYTHONWARNINGS``: torch warns "Failed to
  initialize NumPy" at every import where numpy is not installed, and this process has said
  it once already (it imported torch to host the store), so its ranks do not say it again.
* **Stacks of hung ranks**: a rank calls :func:`rank_setup` first thing; it registers
  ``faulthandler`` on SIGUSR1 (and on crashes) into its stack file, and only then makes the
  file visible, so :meth:`LocalWorld.dump_stacks` signals only ranks that can answer (SIGUSR1
  would kill any other).
* **No orphans**: :meth:`LocalWorld.stop` waits a grace period, then SIGTERMs every live rank
  and its descendants, then SIGKILLs; a rank whose parent dies is killed by the kernel
  (``PR_SET_PDEATHSIG``, set by the rank itself in :func:`rank_setup`: a ``preexec_fn`` is not
  safe here, the parent runs the store's threads).

How a rank is started is the caller's: ``cpuddp.testing`` spawns a ``multiprocessing``
process running a pickled function, ``cpuddp bench`` a ``python -m cpuddp bench ...``
subprocess (:func:`start_command`, wrapped in :class:`Command` so both kinds have the
``multiprocessing.Process`` interface).  Watching is the caller's too (testing reads results
from pipes; bench only needs exit codes: :func:`wait_exit_codes`).

Why not torch's ``torch.distributed.elastic.multiprocessing.start_processes``: it has no way
to ask a hung rank for its stack, it ends every rank as soon as one fails (``cpuddp.testing``
waits a moment to find the root cause among several failures, and needs a crashed rank's
native-crash stack), it takes its output through log files and ``@record`` error files, and
it is an internal-ish API that changed between the torch releases cpuddp supports (2.8-2.15).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, NamedTuple, Optional, Sequence

__all__ = ["LocalWorld", "Command", "start_command", "wait_exit_codes", "rank_setup", "STACK_FILE_ENV",
           "NUMPY_WARNING", "NUMPY_WARNING_FILTER", "without_numpy_warning", "ignore_numpy_warning"]

#: Where a rank started by :class:`LocalWorld` writes its Python stack (read by :func:`rank_setup`).
STACK_FILE_ENV = "CPUDDP_STACK_FILE"
#: SIGTERM, then SIGKILL after this many seconds.
KILL_AFTER = 2.0
#: How long :meth:`LocalWorld.dump_stacks` waits for the ranks' answers.
STACK_WAIT = 2.0

#: A ``PYTHONWARNINGS`` entry: torch's own warning at import where numpy is not installed
#: ("Failed to initialize NumPy: No module named 'numpy'"; cpuddp needs no numpy), said once by
#: the process that starts the ranks, left out in each process it starts.
NUMPY_WARNING = "Failed to initialize NumPy"
NUMPY_WARNING_FILTER = f"ignore:{NUMPY_WARNING}:UserWarning"

#: Set by the launcher for each rank; a caller's ``extra`` may not override them.
RANK_CONTROLLED = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", STACK_FILE_ENV,
)


# --------------------------------------------------------------------------- the parent side


def host_store(world_size: int, timeout: float) -> tuple[Any, int]:
    """A ``TCPStore`` server on ``127.0.0.1`` at a port the OS picked, held by the store: ``(store, port)``."""
    import torch.distributed as dist

    sock = socket.create_server(("127.0.0.1", 0), backlog=max(128, world_size))
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
    return store, port


def world_environ(environ: Mapping[str, str], world_size: int, port: int, *, extra: Mapping[str, str] = {},
                  strip_backend_settings: bool = False) -> dict[str, str]:
    """Every rank's environment but its rank (pure); see the module docstring."""
    from cpuddp.launchers.registry import clean_environ

    taken = sorted(set(extra) & set(RANK_CONTROLLED))
    if taken:
        raise ValueError(f"the launcher sets {taken} for each rank; they cannot be overridden")
    env = clean_environ(environ, strip_backend_settings=strip_backend_settings)
    env.update(extra)
    env.update(without_numpy_warning(env))
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
    )
    return env


def ignore_numpy_warning() -> None:
    """Leave torch's :data:`NUMPY_WARNING` out in this process (a rank whose launcher said it)."""
    import warnings

    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)


def without_numpy_warning(environ: Mapping[str, str]) -> dict[str, str]:
    """``{"PYTHONWARNINGS": ...}``: ``environ``'s own filters, then :data:`NUMPY_WARNING_FILTER`
    (the last filter that matches a warning wins, so the user's others still apply)."""
    own = environ.get("PYTHONWARNINGS", "")
    if NUMPY_WARNING_FILTER in own.split(","):
        return {"PYTHONWARNINGS": own}
    return {"PYTHONWARNINGS": ",".join(filter(None, [own, NUMPY_WARNING_FILTER]))}


class LocalWorld:
    """``world_size`` local ranks around a store this process hosts (see the module docstring).

    Use as a context manager: leaving it stops every rank still running (no grace) and
    releases the store and the stack files.  Add each started rank with :meth:`add`, in
    rank order; anything with the ``multiprocessing.Process`` interface will do.
    """

    def __init__(self, world_size: int, timeout: float, environ: Optional[Mapping[str, str]] = None, *,
                 extra: Mapping[str, str] = {}, strip_backend_settings: bool = False) -> None:
        self.world_size = world_size
        self.store, self.port = host_store(world_size, timeout)
        self._base = world_environ(os.environ if environ is None else environ, world_size, self.port,
                                   extra=extra, strip_backend_settings=strip_backend_settings)
        self._workdir = tempfile.mkdtemp(prefix="cpuddp-ranks-")
        self.stack_paths = [os.path.join(self._workdir, f"rank{r}.stack") for r in range(world_size)]
        self.procs: list[Any] = []

    def environ(self, rank: int) -> dict[str, str]:
        """Rank ``rank``'s whole environment."""
        return dict(self._base, RANK=str(rank), LOCAL_RANK=str(rank), **{STACK_FILE_ENV: self.stack_paths[rank]})

    def add(self, proc: Any) -> Any:
        self.procs.append(proc)
        return proc

    def dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Ask each live rank of ``ranks`` for its Python stack (SIGUSR1 -> faulthandler); ``{rank: text}``
        (empty text: no answer -- the rank had not reached :func:`rank_setup`, or is gone)."""
        return dump_stacks([self.procs[r] for r in ranks], [self.stack_paths[r] for r in ranks], ranks)

    def read_stack(self, rank: int) -> str:
        """What rank ``rank`` wrote to its stack file (a crash's stack, say)."""
        return read_text(self.stack_paths[rank])

    def stop(self, grace: float = 0.0) -> list[int]:
        """Reap every rank (see :func:`stop`); the ranks that had to be stopped."""
        return stop(self.procs, grace)

    def close(self) -> None:
        try:
            self.stop(0.0)
        finally:
            self.store = None  # the store closes its listening socket when destroyed
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Command:
    """A ``subprocess.Popen`` with the ``multiprocessing.Process`` interface :class:`LocalWorld` uses."""

    def __init__(self, popen: "subprocess.Popen[Any]") -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: Optional[float] = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


def start_command(world: LocalWorld, rank: int, cmd: Sequence[str], *, quiet: bool = False) -> Command:
    """Start ``cmd`` as rank ``rank`` of ``world``; its stdout is dropped when ``quiet``, stderr is ours."""
    popen = subprocess.Popen(list(cmd), env=world.environ(rank), stdout=subprocess.DEVNULL if quiet else None)
    return world.add(Command(popen))


class Exits(NamedTuple):
    """How :func:`wait_exit_codes` ended: every exit code (None: still running), and why it gave up."""

    codes: list[Optional[int]]
    first_failure: Optional[tuple[int, int]]  # (rank, exit code) of the first rank to fail
    timed_out: bool  # the overall deadline passed
    gave_up: bool  # the others did not finish within the grace after the first failure


def wait_exit_codes(procs: Sequence[Any], timeout: float, grace: float, poll: float = 0.05) -> Exits:
    """Wait until every process has exited, ``timeout`` seconds pass, or ``grace`` seconds after the
    first non-zero exit."""
    deadline = time.monotonic() + timeout
    first: Optional[tuple[int, int]] = None
    give_up = float("inf")
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            return Exits(codes, first, False, False)
        now = time.monotonic()
        if first is None:
            first = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
            if first is not None:
                give_up = now + grace
        if now > deadline or now > give_up:
            return Exits(codes, first, now > deadline, now <= deadline)
        time.sleep(poll)


def dump_stacks(procs: Sequence[Any], paths: Sequence[str], ranks: Sequence[int]) -> dict[int, str]:
    """SIGUSR1 each live process whose stack file exists (it registered faulthandler), read the answers."""
    sig = getattr(signal, "SIGUSR1", None)
    sizes = [file_size(p) for p in paths]
    asked = []
    for proc, path in zip(procs, paths):
        if sig is not None and proc.is_alive() and os.path.exists(path):
            with contextlib.suppress(OSError):
                os.kill(proc.pid, sig)
                asked.append(path)
    end = time.monotonic() + STACK_WAIT
    while asked and time.monotonic() < end:
        if all(file_size(p) > s for p, s in zip(paths, sizes) if p in asked):
            time.sleep(0.1)  # let the last writes land
            break
        time.sleep(0.05)
    return {r: read_text(p, start=s) for r, p, s in zip(ranks, paths, sizes)}


def stop(procs: Sequence[Any], grace: float) -> list[int]:
    """Reap every process: wait ``grace`` s for them to exit, then SIGTERM them and their descendants,
    then SIGKILL what is left after :data:`KILL_AFTER` s.  Returns the indices that had to be stopped."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    if not alive:
        return []
    kids = _descendants([procs[i] for i in alive])  # before the ranks die, or their children are re-parented
    for i in alive:
        with contextlib.suppress(OSError):
            procs[i].terminate()
    for k in kids:
        with contextlib.suppress(Exception):
            k.terminate()
    end = time.monotonic() + KILL_AFTER
    for i in alive:
        p = procs[i]
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            with contextlib.suppress(OSError):
                p.kill()
            p.join(5.0)
    if kids:
        _kill_left(kids, end)
    return alive


def _descendants(procs: Sequence[Any]) -> list[Any]:
    kids: list[Any] = []
    with contextlib.suppress(Exception):
        import psutil

        for p in procs:
            with contextlib.suppress(psutil.Error):
                kids.extend(psutil.Process(p.pid).children(recursive=True))
    return kids


def _kill_left(kids: list[Any], end: float) -> None:
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


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def read_text(path: str, start: int = 0) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(start)
            return f.read().strip()
    except OSError:
        return ""


# --------------------------------------------------------------------------- the rank side


def die_with_parent(parent: Optional[int] = None) -> bool:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``);
    whether that is set.  ``parent``: the pid the parent must have -- checked after the call,
    so a parent that died before it (this process re-parented to init or a subreaper) ends
    this process here (exit code 1); without it, a parent of pid 1 counts as gone."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
            return False
    except Exception:
        return False
    if os.getppid() != parent if parent is not None else os.getppid() == 1:  # the parent is already gone
        os._exit(1)
    return True


_stack_file: Any = None


def stacks_to(path: str) -> None:
    """Python stacks to ``path`` on a crash (SIGSEGV, SIGABRT, ...) and on SIGUSR1 (a hang).

    The file appears under ``path`` only once SIGUSR1 is handled (it is written as
    ``path.part`` and renamed), so the parent never signals a rank that cannot answer."""
    global _stack_file
    with contextlib.suppress(Exception):
        import faulthandler

        _stack_file = open(path + ".part", "w")
        faulthandler.enable(_stack_file, all_threads=True)
        if hasattr(faulthandler, "register") and hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, _stack_file, all_threads=True, chain=False)
        os.replace(path + ".part", path)


def rank_setup(environ: Any = None) -> None:
    """First thing in a rank :class:`LocalWorld` started: die with the parent, answer SIGUSR1 with
    the Python stack.  Takes :data:`STACK_FILE_ENV` out of ``environ`` (``os.environ`` by default),
    so a process the rank starts does not write over the rank's stack file."""
    environ = os.environ if environ is None else environ
    path = environ.pop(STACK_FILE_ENV, None)
    if path is None:
        return
    die_with_parent()
    stacks_to(path)
