"""Which job a process belongs to, as the process itself knows it -- never as the store says.

The rendezvous store has no authentication: another user can write anything to it, and so can
make one of a user's jobs read another job's records, socket names and tokens.  ``SO_PEERCRED``
tells a rank that the process at the other end of a socket runs as the same user, not that it is
a rank of the same job.  So wherever two ranks meet over a checked socket (the node's proof at
init, :mod:`cpuddp.launchers.proof`; the shm group's hand-over,
:mod:`cpuddp.backends.shm.protocol.handover`), each side states the :class:`JobIdentity` it derived
itself, and a peer whose identity differs is refused: two jobs of one user can at most fail, with
an error naming the store, never be wired to each other.

A process's identity is made of what only its own launch decided:

* ``store``: the endpoint of the rendezvous store it connected to (``host:port``; two jobs that
  run at once cannot share one);
* ``job``: the launcher's job id where there is one (``TORCHELASTIC_RUN_ID``,
  ``SLURM_JOB_ID.SLURM_STEP_ID``, the MPI job's, as :func:`cpuddp.launchers.rendezvous.job_key`
  words it), with the world size;
* ``group``: which group of the job is forming (``init`` for the node's proof; the shm group's
  torch name, its members' global ranks and how many times this process formed it).

A launch by hand (plain ``python`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` per process) has no
job id; its ranks share the store's endpoint, the world size and the groups, so they still agree.

:class:`PeerProcess` holds the process at the other end of such a socket as the kernel names it
(``SO_PEERCRED``, and a pidfd from ``SO_PEERPIDFD`` where the kernel has it, Linux 6.5+), so its
liveness is never read from a pid the store gave, or one the system reused.

Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

__all__ = ["JobIdentity", "PeerProcess", "store_endpoint", "mismatch", "peer_cred", "peer_process", "launcher_job",
           "remember_hosts", "proven_hosts"]

#: ``SO_PEERPIDFD`` (Linux 6.5+; Python names it from 3.12 on only where the headers did).
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_MAX_WIRE = 4096


@dataclass(frozen=True)
class JobIdentity:
    """What a process states about its job over a checked socket (see the module docstring)."""

    store: str
    job: str
    world: int
    group: str

    def wire(self) -> str:
        """The identity as one line of JSON (what travels)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_wire(cls, raw: Any) -> Optional["JobIdentity"]:
        """A peer's :meth:`wire` text, or None when it is not one (every field checked)."""
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
            d = json.loads(text) if isinstance(text, str) and len(text) <= _MAX_WIRE else None
            fields = (d["store"], d["job"], d["world"], d["group"]) if isinstance(d, dict) and len(d) == 4 else None
        except (UnicodeDecodeError, ValueError, KeyError):
            return None
        if fields is None or not all(isinstance(f, str) for f in (fields[0], fields[1], fields[3])):
            return None
        if not isinstance(fields[2], int) or isinstance(fields[2], bool) or fields[2] < 1:
            return None
        return cls(fields[0], fields[1], fields[2], fields[3])


def store_endpoint(store: Any) -> str:
    """``host:port`` of the TCP store under ``store`` (PrefixStores unwrapped), else its type's name."""
    seen = 0
    while hasattr(store, "underlying_store") and seen < 64:
        store, seen = store.underlying_store, seen + 1
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        return f"{host}:{port}"
    return type(store).__name__


def _addresses(endpoint: str) -> frozenset:
    host, _, port = endpoint.rpartition(":")
    try:
        return frozenset(a[4][0] for a in socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM))
    except (OSError, ValueError, UnicodeError):
        return frozenset()


def _same_store(mine: str, theirs: str) -> bool:
    """One store: the same endpoint, or the same port on names that resolve to a shared address
    (``localhost:29500`` and ``127.0.0.1:29500``)."""
    if mine == theirs:
        return True
    if mine.rpartition(":")[2] != theirs.rpartition(":")[2]:
        return False
    return bool(_addresses(mine) & _addresses(theirs))


def mismatch(mine: JobIdentity, theirs: Optional[JobIdentity]) -> Optional[str]:
    """Why a peer stating ``theirs`` is not of this process's job and group (None when it is)."""
    if theirs is None:
        return "it did not state a job identity"
    if not _same_store(mine.store, theirs.store):
        return f"its rendezvous store is {theirs.store}, this rank's {mine.store}: another job"
    for name in ("job", "world", "group"):
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            return f"its {name} is {str(b)[:120]!r}, this rank's {str(a)[:120]!r}: another job or group"
    return None


def launcher_job(environ: Mapping[str, str]) -> str:
    """The job key this process's launcher variables give (``nojobid/w<size>`` by hand; the
    same words as the rendezvous's :func:`~cpuddp.launchers.rendezvous.job_key`)."""
    from .registry import detect
    from .rendezvous import job_key

    try:
        return job_key(detect(environ))
    except Exception:  # noqa: BLE001 -- an environment init would refuse: no launcher's word
        return "unknown"


# --------------------------------------------------------------------------- the peer's process


class PeerProcess:
    """The process at the other end of a Unix socket, as the kernel named it when it connected."""

    def __init__(self, pid: int, uid: int, pidfd: Optional[int]) -> None:
        self.pid, self.uid, self._pidfd = pid, uid, pidfd

    @property
    def pidfd(self) -> Optional[int]:
        """The kernel's handle of the process (None where the kernel has no SO_PEERPIDFD)."""
        return self._pidfd

    def alive(self) -> bool:
        """False once the process has exited (its pidfd turns readable); by pid where no pidfd."""
        if self._pidfd is None:
            from cpuddp.topology.here import pid_alive

            return pid_alive(self.pid)
        try:
            return not select.select([self._pidfd], [], [], 0)[0]
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        self.close()


def peer_cred(conn: socket.socket) -> tuple:
    """The (pid, uid) of the process at the other end of ``conn`` (``SO_PEERCRED``)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def peer_process(conn: socket.socket) -> PeerProcess:
    """The :class:`PeerProcess` at the other end of ``conn`` (``SO_PEERCRED``, ``SO_PEERPIDFD``).
    The pid is 0 when the peer is in a PID namespace this one cannot see (then no pid is checked)."""
    pid, uid = peer_cred(conn)
    pidfd = None
    with contextlib.suppress(OSError):
        pidfd = struct.unpack("i", conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4))[0]
        os.set_inheritable(pidfd, False)
    return PeerProcess(pid, uid, pidfd if pidfd is not None and pidfd >= 0 else None)


# --------------------------------------------------------------------------- the layout proven at init

#: (store endpoint, world size) -> each global rank's host identity, as proven when the job's
#: ranks met (:func:`cpuddp.launchers.proof.prove_node` at init, or the world's shm group).
_proven: dict = {}


def remember_hosts(endpoint: str, hosts: "tuple[str, ...] | list[str]") -> None:
    """Keep the proven host of each global rank of the job whose store is at ``endpoint``."""
    _proven[(endpoint, len(hosts))] = tuple(hosts)


def proven_hosts(endpoint: str, world: int) -> Optional[tuple]:
    """Each global rank's proven host for the job at ``endpoint`` with ``world`` ranks, or None."""
    return _proven.get((endpoint, world))
