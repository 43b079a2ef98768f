"""``init_distributed()``: detect, export, choose a backend, rendezvous, pin -- and tear down.

Usage::

    env = cpuddp.init_distributed()        # under mpirun, torchrun, srun, Kubeflow or plain python
    ...
    cpuddp.shutdown()                      # or: with cpuddp.session() as env: ...

Environment variables read: every launcher's (see :mod:`cpuddp.launchers`), plus
``CPUDDP_TIMEOUT`` (seconds; the default for ``timeout=``) and ``CPUDDP_LOG_LEVEL`` (attach a
stderr handler to the ``cpuddp`` logger at that level).

Environment variables written (for this process and its children): ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; the
backend's settings (``CCL_*``, ``GLOO_SOCKET_IFNAME``) and the pinning plan's
(``OMP_NUM_THREADS``, ``KMP_AFFINITY``, ``KMP_BLOCKTIME``) only where the user has not set
them.  A value the user set that cpuddp must change is logged as a warning.

The rendezvous: unless torchrun's agent already hosts one, rank 0 binds the TCP store's
listening socket itself -- on 127.0.0.1 for a single-node job, so nothing is reachable from
outside the machine -- and fails at once, naming ``MASTER_PORT``, when the port is taken.  The
store carries a job key (from the launcher's job id), so a rank that reaches another job's
store fails with a clear error instead of joining it.

Failure modes: a malformed environment raises :class:`~cpuddp.errors.LauncherEnvError` before
anything is started; a busy port, an unresolvable ``MASTER_ADDR`` or a peer that never comes
raise :class:`~cpuddp.errors.RendezvousError` (the last within ``timeout``).  The default
timeout is 300 s (torch's gloo default is 30 minutes); it bounds the rendezvous and every
collective.  :func:`shutdown` is bounded too, and runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import logging
import os
import socket
import threading
import time
from typing import Any, Iterator, Mapping, MutableMapping, Optional, Union

from .env import DistEnv
from .errors import LauncherEnvError, RendezvousError
from .launchers import LAUNCHER_NAMES, detect, is_loopback

__all__ = ["init_distributed", "shutdown", "get_env", "session", "DEFAULT_TIMEOUT"]

log = logging.getLogger("cpuddp")

#: Default bound, in seconds, on the rendezvous and on every collective.
DEFAULT_TIMEOUT = 300.0
#: How long :func:`shutdown` waits for torch's own teardown before giving up on it.
SHUTDOWN_TIMEOUT = 10.0

_lock = threading.RLock()
_state: Optional[DistEnv] = None
_store: Any = None  # keep our TCPStore (and its listening socket) alive with the group
_pin_state: Any = None
_atexit_registered = False

Timeout = Union[float, int, datetime.timedelta]


def get_env() -> Optional[DistEnv]:
    """The :class:`DistEnv` of the current process group, or None before :func:`init_distributed`."""
    return _state


def init_distributed(
    backend: str = "auto",
    *,
    timeout: Optional[Timeout] = None,
    pin: bool = True,
    environ: Optional[MutableMapping[str, str]] = None,
) -> DistEnv:
    """Join (or form) the job's process group and return where this process sits in it.

    ``backend``: ``"auto"`` (oneCCL when its bindings match torch, else gloo), ``"gloo"``,
    ``"ccl"``, or any registered name.  ``timeout``: seconds or a timedelta (default
    ``CPUDDP_TIMEOUT`` or 300 s).  ``pin``: pin this rank to its own physical cores.
    ``environ``: the environment to read and export to (default ``os.environ``).

    Safe to call twice: a second call returns the current :class:`DistEnv`.
    """
    global _state
    with _lock:
        if _state is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                log.debug("init_distributed: already initialized; returning the current DistEnv")
                return _state
        environ = os.environ if environ is None else environ
        _configure_logging(environ)
        td = _timeout(timeout, environ)
        # Before importing torch (2 s or more): a malformed environment fails at once.
        env = detect(environ)
        import torch.distributed as dist

        if dist.is_initialized():
            # Someone else made the group (e.g. torch's own init_process_group): adopt it.
            env = env.replace(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend())
            _state = env
            log.debug("init_distributed: adopting an existing process group: %s", env)
            return env

        if env.master_addr == "":
            env = env.replace(master_addr=_mpi_master_addr(env))

        from . import backends

        choice = backends.resolve_backend(backend, env, environ=environ)
        if env.is_main:
            log.info("cpuddp: backend %s (%s)", choice.name, choice.reason)

        plan = None
        if pin:
            from . import affinity

            plan = affinity.plan_for(env, backend=choice.name, environ=environ)

        _export(environ, env.exported(), reason="describes this process to torch and child processes", strict=True)
        _export(environ, backends.backend_env(env, choice.name, plan, environ), reason="backend setting")
        backends.load_backend(choice)

        _rendezvous(env, choice.name, td, environ)
        env = env.replace(backend=choice.name)
        env = _check_hosts(env)
        from . import watchdog

        watchdog.start(env, _store)
        if plan is not None:
            from . import affinity

            global _pin_state
            _pin_state = affinity.apply_plan(plan, environ)
            env = env.replace(pin_plan=plan)
        _state = env
        _register_atexit()
        if env.is_main:
            log.info(
                "cpuddp: rank %d of %d ready (launcher %s, %d node(s), rendezvous %s:%d)",
                env.rank, env.world_size, env.launcher, env.num_nodes, env.master_addr, env.master_port,
            )
        return env


def shutdown(timeout: float = SHUTDOWN_TIMEOUT) -> None:
    """Destroy the process group (bounded by ``timeout`` seconds) and restore pinning.

    Never hangs: if torch's teardown does not return in time it is abandoned with a warning.
    Safe to call when nothing was initialized.
    """
    global _state, _store, _pin_state
    with _lock:
        import torch.distributed as dist

        from . import watchdog

        watchdog.stop()  # first: it says "done" through the store the group is about to drop

        if dist.is_available() and dist.is_initialized():
            done = threading.Event()

            def _destroy() -> None:
                try:
                    dist.destroy_process_group()
                except Exception as exc:  # teardown must not raise over a finished job
                    log.debug("destroy_process_group raised: %s", exc)
                finally:
                    done.set()

            t = threading.Thread(target=_destroy, name="cpuddp-shutdown", daemon=True)
            t.start()
            if not done.wait(timeout):
                log.warning("cpuddp: destroy_process_group did not return within %.0f s; abandoning it", timeout)
        if _pin_state is not None:
            from . import affinity

            with contextlib.suppress(Exception):
                affinity.restore(_pin_state)
            _pin_state = None
        _store = None
        _state = None


@contextlib.contextmanager
def session(backend: str = "auto", **kwargs: Any) -> Iterator[DistEnv]:
    """``with cpuddp.session() as env: ...`` -- :func:`init_distributed`, then :func:`shutdown`."""
    env = init_distributed(backend, **kwargs)
    try:
        yield env
    finally:
        shutdown()


# --------------------------------------------------------------------------- internals


def _configure_logging(environ: Mapping[str, str]) -> None:
    level = environ.get("CPUDDP_LOG_LEVEL", "").strip().upper()
    if not level or any(getattr(h, "_cpuddp", False) for h in log.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    handler._cpuddp = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(level if level.isalpha() else int(level))


def _timeout(timeout: Optional[Timeout], environ: Mapping[str, str]) -> datetime.timedelta:
    source = "timeout="
    if timeout is None:
        raw = environ.get("CPUDDP_TIMEOUT", "").strip()
        if raw:
            source = "CPUDDP_TIMEOUT"
            try:
                timeout = float(raw)
            except ValueError:
                raise LauncherEnvError(
                    "CPUDDP_TIMEOUT must be a number of seconds",
                    variable="CPUDDP_TIMEOUT",
                    value=raw,
                    launcher="the job script",
                    fix="export CPUDDP_TIMEOUT=300 (seconds), or unset it",
                ) from None
        else:
            timeout = DEFAULT_TIMEOUT
    td = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0 and source == "CPUDDP_TIMEOUT":
        raise LauncherEnvError(
            "CPUDDP_TIMEOUT must be a positive number of seconds",
            variable="CPUDDP_TIMEOUT",
            value=environ.get("CPUDDP_TIMEOUT"),
            launcher="the job script",
            fix="export CPUDDP_TIMEOUT=300 (seconds), or unset it",
        )
    if td.total_seconds() <= 0:
        raise ValueError(f"{source} must be positive, got {timeout!r}; pass seconds or a timedelta, e.g. timeout=300")
    return td


def _export(environ: MutableMapping[str, str], values: Mapping[str, str], *, reason: str, strict: bool = False) -> None:
    """Export ``values``.  ``strict``: these must describe this process, so a differing user
    value is replaced (with a warning); otherwise the user's value wins (logged at debug)."""
    for key, value in values.items():
        old = environ.get(key)
        if old is None or old == value:
            environ[key] = value
        elif strict:
            log.warning("cpuddp: %s was %r; setting it to %r (%s)", key, old, value, reason)
            environ[key] = value
        else:
            log.debug("cpuddp: keeping the user's %s=%r (cpuddp would set %r: %s)", key, old, value, reason)


def _mpi_master_addr(env: DistEnv) -> str:
    """Learn rank 0's address over MPI (multi-node MPI job without MASTER_ADDR)."""
    name = LAUNCHER_NAMES.get(env.launcher, env.launcher)
    fix = (
        "export MASTER_ADDR=<rank 0's host or address> to every rank (Intel MPI/MPICH: "
        "`mpiexec -genv MASTER_ADDR $(hostname -I | cut -d' ' -f1) ...`; Open MPI: "
        "`mpirun -x MASTER_ADDR=... ...`), or `pip install cpuddp[mpi]` so cpuddp can ask rank 0 over MPI"
    )
    try:
        from mpi4py import MPI  # lazy: importing mpi4py initializes MPI
    except ImportError:
        raise LauncherEnvError(
            f"this is a {env.num_nodes}-node {name} job and MASTER_ADDR is not set",
            variable="MASTER_ADDR", value=None, launcher=name, fix=fix,
        ) from None
    comm = MPI.COMM_WORLD
    addr = local_address() if comm.Get_rank() == 0 else None
    addr = comm.bcast(addr, root=0)
    if not addr:
        raise LauncherEnvError("rank 0 found no non-loopback address to offer", variable="MASTER_ADDR", value=None, launcher=name, fix=fix)
    return str(addr)


def local_address() -> str:
    """This host's address for other hosts: the hostname's, unless it is loopback (a common
    /etc/hosts setup), else the first non-loopback IPv4 address of an interface that is up."""
    with contextlib.suppress(OSError):
        addr = socket.gethostbyname(socket.gethostname())
        if not is_loopback(addr):
            return addr
    import psutil

    stats = psutil.net_if_stats()
    for ifname, addrs in sorted(psutil.net_if_addrs().items()):
        if ifname in stats and not stats[ifname].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                return a.address
    return ""


def _job_key(env: DistEnv) -> str:
    job = env.job_id
    if job is None and env.single_node and env.launcher in ("hydra", "openmpi", "mvapich"):
        # MPICH gives no job id, but an MPI launcher starts every rank on a node from one
        # proxy process: its pid tells two concurrent jobs on this machine apart.
        proxy = _launcher_proxy_pid()
        if proxy is not None:
            job = f"proxy={proxy}@{socket.gethostname()}"
    return f"{job or 'nojobid'}/w{env.world_size}"


#: Per-node daemons that MPI launchers start the ranks from.
_PROXY_NAMES = ("hydra_pmi_proxy", "pmi_proxy", "mpispawn", "prted", "orted")


def _launcher_proxy_pid() -> Optional[int]:
    """The pid of the MPI launcher's per-node proxy above this process (through any wrapper
    scripts between them), or None."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for parent in psutil.Process().parents():
            if parent.name() in _PROXY_NAMES:
                return parent.pid
    return None


def _rendezvous(env: DistEnv, backend: str, td: datetime.timedelta, environ: Mapping[str, str]) -> None:
    import torch.distributed as dist

    global _store
    if env.world_size == 1:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
        return
    if env.agent_store:
        # torchrun's agent (or cpuddp.testing's parent) hosts the store: join it as a client,
        # under the same prefix torch's env:// rendezvous uses.
        client = _connect(env, td)
        attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _store = client
        store = dist.PrefixStore(f"/worker/attempt_{attempt}", client)
        _init_group(env, backend, store, td)
        return

    addr, port = env.master_addr, env.master_port
    try:
        resolved = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RendezvousError(
            f"MASTER_ADDR={addr!r} does not resolve ({exc.strerror})",
            fix="set MASTER_ADDR to rank 0's hostname or IP address, as every rank can resolve it",
        ) from None

    key = _job_key(env)
    if env.rank == 0:
        # One node: listen only on the address the ranks dial (loopback unless the user chose
        # otherwise), so nothing is reachable from outside.  Several nodes: every interface.
        bind_host = str(resolved[0][4][0]) if env.single_node else ""
        try:
            sock = socket.create_server((bind_host, port), backlog=max(128, env.world_size))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise RendezvousError(
                    f"rank 0 cannot listen on MASTER_PORT={port}: the port is already in use "
                    f"(another job, or a leftover process, holds it)",
                    fix=f"export MASTER_PORT to a free port (or unset it to derive one from the job id); "
                    f"`ss -ltnp 'sport = :{port}'` shows the holder",
                ) from None
            raise RendezvousError(f"rank 0 cannot listen on {bind_host or '*'}:{port}: {exc}", fix="check MASTER_PORT") from None
        # The store takes ownership of the listening socket (and closes it when destroyed).
        fd = sock.detach()
        try:
            store = _tcp_store(addr, port, env.world_size, True, td, fd)
        except Exception:
            with contextlib.suppress(OSError):  # the store may have closed it already
                os.close(fd)
            raise
        store.set("cpuddp/job", key)
    else:
        store = _connect(env, td)
        try:
            store.wait(["cpuddp/job"], td)
            theirs = store.get("cpuddp/job").decode()
        except Exception:
            raise RendezvousError(
                f"rank {env.rank} reached a store at {addr}:{port} that is not this job's rank 0 "
                f"(no cpuddp job key within {td.total_seconds():.0f} s)",
                fix="MASTER_PORT is used by another program or job: export a different MASTER_PORT",
            ) from None
        if theirs != key:
            raise RendezvousError(
                f"rank {env.rank} reached the store of another job at {addr}:{port} (its job {theirs!r}, ours {key!r})",
                fix="two jobs share MASTER_PORT: export a different MASTER_PORT for one of them, or unset it",
            )
    _store = store
    _init_group(env, backend, dist.PrefixStore(f"cpuddp/{key}", store), td)


def _connect(env: DistEnv, td: datetime.timedelta) -> Any:
    addr, port = env.master_addr, env.master_port
    try:
        _wait_listening(addr, port, td.total_seconds())
        return _tcp_store(addr, port, env.world_size, False, td, None)
    except Exception as exc:  # torch raises DistStoreError / RuntimeError
        raise RendezvousError(
            f"rank {env.rank} could not reach rank 0's store at {addr}:{port} within "
            f"{td.total_seconds():.0f} s ({type(exc).__name__}: {_first_line(exc)})",
            fix="check that rank 0 started and that MASTER_ADDR/MASTER_PORT point at it "
            f"(launcher: {LAUNCHER_NAMES.get(env.launcher, env.launcher)}); a firewall between nodes also causes this",
        ) from None


def _wait_listening(addr: str, port: int, seconds: float) -> None:
    """Return once ``addr:port`` accepts a TCP connection; TimeoutError after ``seconds``.
    (A bare connect and close: the store's server ignores it.)"""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as exc:
            if left <= 0.1:
                raise TimeoutError(f"nothing accepted a connection at {addr}:{port} ({exc.strerror or exc})") from None
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _init_group(env: DistEnv, backend: str, store: Any, td: datetime.timedelta) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        store.append("cpuddp/arrived", f"{env.rank},")
    try:
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=td)
    except Exception as exc:
        missing = _missing_ranks(env, store)
        where = f"{env.master_addr}:{env.master_port}"
        if missing:
            shown = missing if len(missing) <= 16 else f"{missing[:16]} and {len(missing) - 16} more"
            raise RendezvousError(
                f"rank {env.rank}: the {backend} group of {env.world_size} did not form within "
                f"{td.total_seconds():.0f} s: rank(s) {shown} never arrived "
                f"({type(exc).__name__}: {_first_line(exc)})",
                fix=f"{_size_var(env)}={env.world_size} but rank(s) {shown} never reached the rendezvous at {where}: "
                "start them (check the launcher's rank count and their logs), or fix the world size",
            ) from exc
        if missing == []:
            fix = (f"every rank reached the rendezvous at {where}, but they could not connect to each other: "
                   "set GLOO_SOCKET_IFNAME to the interface the hosts share, and check firewalls between them")
        else:
            fix = ("a rank did not start or cannot reach the others; check every rank's log "
                   "(and GLOO_SOCKET_IFNAME on multi-homed hosts)")
        raise RendezvousError(
            f"rank {env.rank}: forming the {backend} group of {env.world_size} failed: "
            f"{type(exc).__name__}: {_first_line(exc)}",
            fix=fix,
        ) from exc


def _size_var(env: DistEnv) -> str:
    var = env.sources.get("world_size", "")
    return var if var and not var.startswith(("derived", "default")) else "WORLD_SIZE"


def _missing_ranks(env: DistEnv, store: Any) -> Optional[list[int]]:
    """The ranks that never announced themselves in the store (None when unknown)."""
    try:
        if not store.check(["cpuddp/arrived"]):
            return None
        seen = {int(x) for x in store.get("cpuddp/arrived").decode().split(",") if x.strip().isdigit()}
    except Exception:
        return None
    return [r for r in range(env.world_size) if r not in seen]


def _tcp_store(addr: str, port: int, world: int, is_master: bool, td: datetime.timedelta, fd: Optional[int]) -> Any:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"wait_for_workers": False}
    if fd is not None:
        kwargs["master_listen_fd"] = fd
    return dist.TCPStore(addr, port, world, is_master, td, **kwargs)


def _host_identity() -> str:
    """What distinguishes hosts: hostname, boot id and network namespace (so two network
    namespaces on one machine count as two hosts, as they do for gloo)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    return "|".join(parts)


def _check_hosts(env: DistEnv) -> DistEnv:
    """Gather every rank's host and confirm (or correct) the node rank and local layout."""
    if env.world_size == 1:
        return env
    import torch.distributed as dist

    mine = (_host_identity(), env.local_rank, env.local_world_size)
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    order: list[str] = []
    for host, _, _ in everyone:
        if host not in order:
            order.append(host)
    node_rank = order.index(mine[0])
    here = sum(1 for host, _, _ in everyone if host == mine[0])
    if here != env.local_world_size and env.is_main:
        log.warning(
            "cpuddp: the launcher says %d rank(s) per node (%s), but %d rank(s) share rank 0's host",
            env.local_world_size, env.sources.get("local_world_size"), here,
        )
    changes: dict[str, Any] = {}
    if env.sources.get("node_rank", "").startswith("derived") and node_rank != env.node_rank:
        log.info("cpuddp: node rank %d (from the hosts), not %d (from block placement)", node_rank, env.node_rank)
        changes["node_rank"] = node_rank
    if len(order) != env.num_nodes and env.sources.get("num_nodes", "").startswith("derived"):
        changes["num_nodes"] = len(order)
    if changes:
        sources = dict(env.sources)
        sources.update({k: "derived: hosts gathered at init" for k in changes})
        env = env.replace(sources=sources, **changes)
    return env


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True
