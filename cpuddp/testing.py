"""Test DDP code on N gloo ranks in CI: ``run_distributed`` and the pytest plugin.

``run_distributed(fn, world_size=2)`` spawns ``world_size`` fresh processes (spawn, never
fork), forms a real process group among them with :func:`cpuddp.init_distributed`, runs
``fn(*args, **kwargs)`` on each, and returns the return values in rank order.

* A rank raises: one :class:`~cpuddp.errors.RankFailedError` carrying that rank's number and
  traceback; the other ranks are stopped.
* A rank hangs: the call fails at ``timeout`` naming the ranks that did not finish.
* A rank dies without a word (killed, ``os._exit``, a crash): the error says so, with the exit code.
* No orphans: every rank is killed and reaped before the call returns or raises, and a rank
  whose parent dies is killed by the kernel (``PR_SET_PDEATHSIG``).
* No shared ports: the parent hosts the rendezvous store on a socket it binds to
  ``127.0.0.1:0`` itself, as torchrun's agent does, so concurrent calls (pytest-xdist workers)
  never race for a port, and nothing listens beyond loopback.

The pytest plugin (entry point ``pytest11: cpuddp``) adds the ``distributed`` marker and the
``run_distributed`` and ``clean_launcher_env`` fixtures; see ``docs/testing.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback as _tb
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from .errors import RankFailedError

__all__ = ["run_distributed", "LAUNCHER_ENV_PREFIXES", "clean_environ"]

#: Variables that describe a launched process.  They are stripped from each rank's
#: environment (so a test run under mpirun or srun still gets a clean world) and isolated
#: around tests by the ``clean_launcher_env`` fixture.
LAUNCHER_ENV_PREFIXES = (
    "PMI_", "PMIX_", "OMPI_", "MV2_", "SLURM_", "MPI_LOCAL", "I_MPI_HYDRA", "HYDRA_",
    "TORCHELASTIC_", "GROUP_", "ROLE_", "CCL_",
)
LAUNCHER_ENV_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "GLOO_SOCKET_IFNAME",
)


def clean_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any launcher's variables."""
    return {
        k: v for k, v in environ.items()
        if k not in LAUNCHER_ENV_NAMES and not k.startswith(LAUNCHER_ENV_PREFIXES)
    }


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    backend: str = "gloo",
    timeout: float = 60.0,
    env: Optional[Mapping[str, str]] = None,
    pin: bool = False,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks with an initialized process group; return results by rank.

    ``fn`` and its arguments must be picklable (a module-level function).  ``env`` adds
    variables to every rank's environment; ``pin`` lets :func:`cpuddp.init_distributed` pin
    cores (off by default: parallel test workers would fight over them); ``threads`` sets
    each rank's torch/OpenMP thread count when not pinning.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive (seconds), got {timeout}")
    import torch.distributed as dist

    ctx = multiprocessing.get_context("spawn")
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, True, datetime.timedelta(seconds=timeout),
        wait_for_workers=False, master_listen_fd=sock.fileno(),
    )
    base = clean_environ(os.environ)
    base.update(env or {})
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        CPUDDP_TEST_RUN_ID=uuid.uuid4().hex,
    )
    if not pin:
        base.setdefault("OMP_NUM_THREADS", str(threads))

    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            ours, theirs = ctx.Pipe(duplex=False)
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            p = ctx.Process(
                target=_rank_main,
                args=(theirs, rank_env, fn, tuple(args), dict(kwargs or {}), backend, timeout, pin, threads),
                name=f"cpuddp-rank{rank}",
                daemon=True,
            )
            p.start()
            theirs.close()
            procs.append(p)
            conns[ours] = rank
        return _collect(procs, conns, timeout)
    finally:
        _reap(procs)
        for c in conns:
            c.close()
        del store
        sock.close()


def _collect(procs: list[Any], conns: dict[Connection, int], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    pending = dict(conns)
    while len(results) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(len(procs))) - set(results))
            raise RankFailedError(
                f"rank(s) {missing} of {len(procs)} did not finish within {timeout:g} s "
                f"(finished: {sorted(results)})",
                rank=missing[0] if len(missing) == 1 else None,
                fix="a rank is stuck (often in a collective the others never entered); raise timeout= if the work is slow",
            )
        ready = wait(list(pending) + list(sentinels), timeout=min(left, 1.0))
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)  # type: ignore[index]
                try:
                    status, payload = obj.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    continue  # the rank died before reporting: its sentinel says how
                if status == "ok":
                    results[rank] = payload
                else:
                    raise RankFailedError(f"rank {rank} of {len(procs)} raised", rank=rank, traceback=payload)
        for obj in ready:
            if obj in sentinels:
                rank = sentinels.pop(obj)  # type: ignore[index]
                conn = next((c for c, r in pending.items() if r == rank), None)
                if conn is not None and conn.poll(0):
                    continue  # its report is waiting; read it on the next pass
                if rank not in results:
                    code = procs[rank].exitcode
                    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                    raise RankFailedError(f"rank {rank} of {len(procs)} {how} without reporting a result", rank=rank)
    return [results[r] for r in range(len(procs))]


def _reap(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent is already gone
            os._exit(1)


def _rank_main(
    conn: Connection, rank_env: dict[str, str], fn: Callable[..., Any], args: tuple, kwargs: dict,
    backend: str, timeout: float, pin: bool, threads: int,
) -> None:
    _die_with_parent()
    os.environ.clear()
    os.environ.update(rank_env)
    try:
        import torch

        if not pin:
            torch.set_num_threads(threads)
        from .distributed import init_distributed, shutdown

        init_distributed(backend, timeout=timeout, pin=pin)
        try:
            result = fn(*args, **kwargs)
        finally:
            shutdown()
        conn.send(("ok", result))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", _tb.format_exc()))
        conn.close()
        sys.stderr.flush()
        os._exit(1)
    conn.close()


# --------------------------------------------------------------------------- pytest plugin

try:
    import pytest
except ImportError:  # pragma: no cover - the plugin only loads under pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    def pytest_configure(config: Any) -> None:
        config.addinivalue_line(
            "markers",
            "distributed(world_size=2, timeout=60, backend='gloo'): defaults for the run_distributed fixture",
        )

    @pytest.fixture
    def clean_launcher_env(monkeypatch: Any) -> Iterator[None]:
        """Hide every launcher variable during the test and restore them after it."""
        for key in list(os.environ):
            if key in LAUNCHER_ENV_NAMES or key.startswith(LAUNCHER_ENV_PREFIXES):
                monkeypatch.delenv(key)
        yield

    @pytest.fixture(name="run_distributed")
    def _run_distributed_fixture(request: Any, clean_launcher_env: None) -> Callable[..., list[Any]]:
        """``run_distributed(fn, ...)`` with defaults from ``@pytest.mark.distributed(...)``."""
        marker = request.node.get_closest_marker("distributed")
        defaults: dict[str, Any] = dict(marker.kwargs) if marker else {}
        if marker and marker.args:
            defaults.setdefault("world_size", marker.args[0])

        def runner(fn: Callable[..., Any], world_size: Optional[int] = None, **kw: Any) -> list[Any]:
            opts = {**defaults, **kw}
            ws = world_size if world_size is not None else opts.pop("world_size", 2)
            opts.pop("world_size", None)
            return run_distributed(fn, ws, **opts)

        return runner
