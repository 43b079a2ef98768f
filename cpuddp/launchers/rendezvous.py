"""The rendezvous store: where the ranks of a job first meet, before any process group.

:func:`open_store` returns the store every rank of the job shares: torchrun's agent store
under torchrun (and under :mod:`cpuddp.testing`), otherwise a ``TCPStore`` whose listening
socket rank 0 binds itself -- on the address the ranks dial for a single-node job (so
nothing is reachable from outside the machine), on every address (IPv4 and IPv6 where the
host has both) for a multi-node one -- and hands to the store.  A busy port, an address this
host cannot listen on and an unresolvable ``MASTER_ADDR`` fail at once, each with a fix that
fits its cause.  The store carries a job key (from the launcher's job id), so a rank that
reaches another job's store fails with a clear error instead of joining it.  The key also
names the process's init (``init_distributed`` -> ``shutdown`` -> ``init_distributed``): a
rank that re-joins faster than rank 0 tears down the previous init's store reaches that
store, sees the older init, and dials again until rank 0's new store answers.  A rank that
finds nothing listening says so after :data:`~cpuddp.launchers.exports.NOTICE_AFTER` seconds,
once (where it dials, whose store it waits for, the fix), as rank 0 says whom it waits for.

IPv6: ``MASTER_ADDR`` may be an IPv6 address or a name that resolves to one (``localhost``
resolves to ``::1`` first on many Debian and RHEL hosts); the socket takes the family of
the address it binds.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import os
import logging
import socket
import time
from typing import Any, Callable, NamedTuple, Optional

from cpuddp.errors import LauncherEnvError, RendezvousError, first_line
from cpuddp.topology import here

from . import exports
from .env import DistEnv
from .mpi import start, world_mismatch
from .parsers import is_loopback
from .registry import LAUNCHER_NAMES
from .store_values import job_key_value, shown

__all__ = ["Rendezvous", "open_store", "local_address", "mpi_master_addr", "job_key", "JOB_KEY"]

log = logging.getLogger("cpuddp")

#: The key under which rank 0's own store names its job (read back with
#: :func:`cpuddp.launchers.store_values.job_key_value`: printable text, at most 1024 characters).
JOB_KEY = "cpuddp/job"


class Rendezvous(NamedTuple):
    """``store``: the job's store, for the process group and cpuddp's own keys.  ``keep``:
    the object that must stay alive as long as the group (it owns the connection or the
    listening socket)."""

    store: Any
    keep: Any


def open_store(env: DistEnv, td: datetime.timedelta, environ: Any, generation: int = 1) -> Rendezvous:
    """The job's store for a world of two or more (see the module docstring); ``generation``:
    which init of this process it is for (1, 2, ... -- the same on every rank)."""
    import torch.distributed as dist

    if env.agent_store:
        # torchrun's agent (or cpuddp.testing's parent) hosts the store: join it as a client,
        # under the same prefix torch's env:// rendezvous uses.
        client = _connect(env, td)
        attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return Rendezvous(dist.PrefixStore(f"/worker/attempt_{attempt}", client), client)
    key = job_key(env)
    if env.rank == 0:
        store = _own_store(env, td)
        store.set(JOB_KEY, _init_key(key, generation))
    else:
        store = _join_job(env, key, generation, td)
    return Rendezvous(dist.PrefixStore(f"cpuddp/{key}", store), store)


def _init_key(key: str, generation: int) -> str:
    """The value of :data:`JOB_KEY`: the job and which of its processes' inits the store is for."""
    return f"{key} init{generation}"


def _resolve(addr: str, port: int) -> list[Any]:
    try:
        return socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RendezvousError(
            f"MASTER_ADDR={addr!r} does not resolve ({exc.strerror})",
            fix="set MASTER_ADDR to rank 0's hostname or IP address, as every rank can resolve it",
        ) from None


def _listen(env: DistEnv) -> socket.socket:
    """Rank 0's listening socket: on the address the ranks dial for one node, on every
    address (dual-stack where the host has IPv6) for several."""
    addr, port = env.master_addr, env.master_port
    infos = _resolve(addr, port)
    if env.single_node:
        family, host = infos[0][0], str(infos[0][4][0])
        where = f"{host}:{port}" if family == socket.AF_INET else f"[{host}]:{port}"
        make = lambda: socket.create_server((host, port), family=family, backlog=max(128, env.world_size))  # noqa: E731
    else:
        dual = socket.has_dualstack_ipv6()
        where = f"*:{port}"
        make = lambda: socket.create_server(  # noqa: E731
            ("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
            dualstack_ipv6=dual, backlog=max(128, env.world_size))
    try:
        return make()
    except OSError as exc:
        raise _listen_error(env, where, exc) from None


def _listen_error(env: DistEnv, where: str, exc: OSError) -> RendezvousError:
    port = env.master_port
    if exc.errno == errno.EADDRINUSE:
        return RendezvousError(
            f"rank 0 cannot listen on MASTER_PORT={port}: the port is already in use "
            f"(another job, or a leftover process, holds it)",
            fix=f"export MASTER_PORT to a free port (or unset it to derive one from the job id); "
            f"`ss -ltnp 'sport = :{port}'` shows the holder",
        )
    if exc.errno == errno.EACCES:
        return RendezvousError(
            f"rank 0 may not listen on MASTER_PORT={port} ({exc.strerror})",
            fix="export MASTER_PORT to a port above 1023 (or unset it to derive one from the job id)",
        )
    # EADDRNOTAVAIL, EAFNOSUPPORT, gaierror -9: the address, not the port, is the problem.
    return RendezvousError(
        f"rank 0 cannot listen on {where}: MASTER_ADDR={env.master_addr!r} is not an address of "
        f"this host it can listen on ({exc.strerror or exc})",
        fix="set MASTER_ADDR to an address of rank 0's host that every rank can reach "
        "(127.0.0.1 when every rank runs on this machine); if 'localhost' resolves to ::1 here "
        "but IPv6 is disabled, use 127.0.0.1",
    )


def _own_store(env: DistEnv, td: datetime.timedelta) -> Any:
    sock = _listen(env)
    # The store takes ownership of the listening socket (and closes it when destroyed).
    fd = sock.detach()
    try:
        return _tcp_store(env.master_addr, env.master_port, env.world_size, True, td, fd)
    except Exception:
        with contextlib.suppress(OSError):  # the store may have closed it already
            os.close(fd)
        raise


def _join_job(env: DistEnv, key: str, generation: int, td: datetime.timedelta) -> Any:
    """A client of rank 0's store for this job's init ``generation``.  A store of this job's
    previous init (rank 0 has not torn it down yet) or one that closes under us is dialled
    again until ``td`` is spent; another job's store fails at once."""
    addr, port = env.master_addr, env.master_port
    deadline = time.monotonic() + td.total_seconds()
    theirs: Optional[str] = None
    late = _late_notice(env, td)  # one notice, however often this rank dials
    while True:
        left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        store = _connect(env, left, late)
        theirs = _job_of(store, addr, port, left)
        if _is_ours(env, theirs, key, generation):
            return store
        del store  # rank 0's previous init, or a store that went away: dial again
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if theirs is None:
        raise RendezvousError(
            f"rank {env.rank} reached a store at {addr}:{port} that is not this job's rank 0 "
            f"(no cpuddp job key within {td.total_seconds():.0f} s)",
            fix="MASTER_PORT is used by another program or job: export a different MASTER_PORT",
        )
    raise RendezvousError(
        f"rank {env.rank} found rank 0's store at {addr}:{port} still on another init of this job "
        f"({shown(theirs)}, this rank's {_init_key(key, generation)!r}) after {td.total_seconds():.0f} s",
        fix="every rank must call init_distributed() and shutdown() the same number of times; "
        "a rank that failed an init and retried alone is out of step with the others",
    )


def _is_ours(env: DistEnv, theirs: Optional[str], key: str, generation: int) -> bool:
    """True for this init's store, False for none or this job's other init (dial again);
    raises for another job's store."""
    if theirs == _init_key(key, generation):
        return True
    if theirs is not None and not theirs.startswith(f"{key} init"):
        raise RendezvousError(
            f"rank {env.rank} reached the store of another job at {env.master_addr}:{env.master_port} "
            f"(its job {shown(theirs)}, ours {_init_key(key, generation)!r})",
            fix="two jobs share MASTER_PORT: export a different MASTER_PORT for one of them, or unset it",
        )
    return False


def _job_of(store: Any, addr: str, port: int, td: datetime.timedelta) -> Optional[str]:
    """The job key the store at ``addr:port`` carries, or None when it has none (within ``td``)
    or the connection broke."""
    try:
        store.wait([JOB_KEY], td)
        raw = store.get(JOB_KEY)
    except Exception:
        return None
    return job_key_value(f"{JOB_KEY} (at {addr}:{port})", raw)


def _connect(env: DistEnv, td: datetime.timedelta, late: Optional[Callable[[], None]] = None) -> Any:
    """A client of the job's store (rank 0's, or the launcher's agent's); ``late``: called while
    this rank waits for it (:func:`_late_notice`; one of its own when None)."""
    addr, port = env.master_addr, env.master_port
    _resolve(addr, port)
    try:
        _wait_listening(addr, port, td.total_seconds(), late or _late_notice(env, td))
        return _tcp_store(addr, port, env.world_size, False, td, None)
    except Exception as exc:  # torch raises DistStoreError / RuntimeError
        raise RendezvousError(
            f"rank {env.rank} could not reach {_host_of_store(env)} at {addr}:{port} within "
            f"{td.total_seconds():.0f} s ({type(exc).__name__}: {first_line(exc)})",
            fix=_reach_fix(env),
        ) from None


def _host_of_store(env: DistEnv) -> str:
    """Whose store a rank dials: rank 0's, or the launcher's (torchrun's agent hosts it)."""
    return "the launcher's store (its agent hosts it)" if env.agent_store else "rank 0's store"


def _reach_fix(env: DistEnv) -> str:
    """The fix for a rank that cannot reach the job's store: said after a few seconds, and in the error."""
    who = "the launcher's agent" if env.agent_store else "rank 0"
    return (f"check that {who} started and that MASTER_ADDR/MASTER_PORT point at it (launcher: "
            f"{LAUNCHER_NAMES.get(env.launcher, env.launcher)}); a firewall between nodes also causes this")


def _late_notice(env: DistEnv, td: datetime.timedelta) -> Callable[[], None]:
    """What a rank waiting for the job's store calls as it waits: after
    :data:`cpuddp.launchers.exports.NOTICE_AFTER` seconds it logs one warning -- the address it
    dials, what it waits for, for how long, and the fix -- as rank 0 says whom it waits for;
    never again after that (the error at the end of ``td`` says the rest)."""
    start = time.monotonic()
    said: list[bool] = []

    def late() -> None:
        if said or time.monotonic() - start < exports.NOTICE_AFTER or td.total_seconds() <= exports.NOTICE_AFTER:
            return
        said.append(True)
        log.warning("cpuddp: rank %d waiting for %s at %s:%d (nothing there has answered yet), up to %.0f s "
                    "(CPUDDP_TIMEOUT); fix: %s", env.rank, _host_of_store(env), env.master_addr, env.master_port,
                    td.total_seconds(), _reach_fix(env))

    return late


def _wait_listening(addr: str, port: int, seconds: float, late: Callable[[], None] = lambda: None) -> None:
    """Return once ``addr:port`` accepts a TCP connection; TimeoutError after ``seconds``.
    (A bare connect and close: the store's server ignores it.)  ``late`` is called after each
    failed try."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as exc:
            if left <= 0.1:
                raise TimeoutError(f"nothing accepted a connection at {addr}:{port} ({exc.strerror or exc})") from None
            late()
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _tcp_store(addr: str, port: int, world: int, is_master: bool, td: datetime.timedelta, fd: Optional[int]) -> Any:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"wait_for_workers": False}
    if fd is not None:
        kwargs["master_listen_fd"] = fd
    return dist.TCPStore(addr, port, world, is_master, td, **kwargs)


# --------------------------------------------------------------------------- job identity


def job_key(env: DistEnv) -> str:
    """What tells this job's store from another's on the same port."""
    job = env.job_id
    if job is None and env.single_node and env.launcher in ("hydra", "openmpi", "mvapich"):
        # MPICH gives no job id, but an MPI launcher starts every rank on a node from one
        # proxy process: its pid tells two concurrent jobs on this machine apart.
        proxy = _launcher_proxy_pid()
        if proxy is not None:
            job = f"proxy={proxy}@{here.hostname()}"
    key = f"{job or 'nojobid'}/w{env.world_size}"
    if len(key) > 256 or not key.isprintable():  # what job_key_value accepts, whatever the launcher said
        key = "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return key


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


# --------------------------------------------------------------------------- MASTER_ADDR


def mpi_master_addr(env: DistEnv) -> str:
    """Learn rank 0's address over MPI (multi-node MPI job without MASTER_ADDR)."""
    name = LAUNCHER_NAMES.get(env.launcher, env.launcher)
    fix = (
        "export MASTER_ADDR=<rank 0's host or address> to every rank (Intel MPI/MPICH: "
        "`mpiexec -genv MASTER_ADDR $(hostname -I | cut -d' ' -f1) ...`; Open MPI: "
        "`mpirun -x MASTER_ADDR=... ...`), or `pip install cpuddp[mpi]` so cpuddp can ask rank 0 over MPI"
    )

    def unset(why: str) -> LauncherEnvError:
        return LauncherEnvError(f"this is a {env.num_nodes}-node {name} job and MASTER_ADDR is not set{why}",
                                variable="MASTER_ADDR", value=None, launcher=name, fix=fix)

    try:
        MPI = start()  # every rank of an MPI launcher's multi-node job without MASTER_ADDR comes here
    except ImportError:
        raise unset("") from None
    except RuntimeError as exc:  # mpi4py found no MPI library
        raise unset(f" (and mpi4py cannot ask rank 0: {str(exc).splitlines()[0]})") from None
    other = world_mismatch(MPI, env)
    if other is not None:  # each rank would take its own address: a job split in worlds of one
        raise unset(f" (and mpi4py cannot ask rank 0: {other})")
    comm = MPI.COMM_WORLD
    addr = local_address() if comm.Get_rank() == 0 else None
    addr = comm.bcast(addr, root=0)
    if not addr:
        raise LauncherEnvError("rank 0 found no non-loopback address to offer", variable="MASTER_ADDR", value=None, launcher=name, fix=fix)
    return str(addr)


def local_address() -> str:
    """This host's address for other hosts: the hostname's, unless it is loopback (a common
    /etc/hosts setup), else the first non-loopback IPv4 address of an interface that is up,
    else the first global IPv6 one (an IPv6-only host)."""
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(here.hostname(), None, type=socket.SOCK_STREAM):
            addr = str(info[4][0])
            if not is_loopback(addr) and "%" not in addr:
                return addr
    import psutil

    stats = psutil.net_if_stats()
    found: dict[int, str] = {}
    for ifname, addrs in sorted(psutil.net_if_addrs().items()):
        if ifname in stats and not stats[ifname].isup:
            continue
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(a.address) and "%" not in a.address \
                    and not a.address.lower().startswith("fe80"):
                found.setdefault(a.family, a.address)
    return found.get(socket.AF_INET) or found.get(socket.AF_INET6) or ""
