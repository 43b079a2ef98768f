"""The node's proof: the ranks that share a host confirm, over a channel only this user's
processes can use, that the host records the store gave them are the ones their peers wrote.

The rendezvous store has no authentication (docs/security.md): anyone who can reach it can
rewrite a rank's host record, and the records decide which ranks share a node, how many CPUs
they have between them and, from those, the backend ``"auto"`` picks and the pinning plan.
So before any of that is decided, :func:`prove_node` checks them where they can be checked:

1. Each rank compares the store's copy of its own record with the record it wrote.
2. Each rank publishes its role in exchange ``name``: ``alone``, ``lead <socket>`` (the lowest
   rank of a host with 2+ ranks, listening on a fresh abstract Unix socket with a random name)
   or ``join <leader>``; every rank checks that the roles match the hosts it read.
3. On a host with 2+ ranks, each member connects to its leader; both ends check the other's
   credentials (``SO_PEERCRED``: this user) before a byte is read, so a stranger's socket or
   connection is refused.  Each member sends the record it wrote and its job identity
   (:class:`~cpuddp.launchers.identity.JobIdentity`, derived by itself: the store it connected
   to, the launcher's job id, the world size); the leader refuses another job's rank and compares
   the record with the store's copy, then sends its own identity and the node's records as it
   holds them (its own and the members', each from its writer), and each member checks the
   identity and compares the records with its own reads of the store.  So a store rewritten to
   point one job of a user at another job's leader fails both, never joins them.

Any difference is a :class:`~cpuddp.errors.RendezvousError` naming the rank, what the store
said and what the rank itself wrote: another process writes to the job's store.  What this
proves: every record of a rank on this host came from that rank.  What it cannot prove: the
records of ranks on other hosts (no channel between hosts is private; docs/security.md).

Standard library only.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import secrets
import select
import socket
import struct
import time
from typing import Any, Callable, Optional, Sequence

from cpuddp.errors import RendezvousError

from . import store_values
from .hosts import _ERROR, HostRecord, _peer_error, exchange, parse_record
from .identity import JobIdentity, launcher_job, mismatch, peer_cred, store_endpoint

__all__ = ["prove_node", "node_roles", "check_roles", "connect_waiting"]

log = logging.getLogger("cpuddp")

_PREFIX = b"\0cpuddp-proof-"
_MAX_MESSAGE = 1 << 20  # a node's records: far below this
_STRANGER_LOG_EVERY = 50


def _fail(rank: int, what: str) -> RendezvousError:
    return RendezvousError(f"rank {rank}: {what}: something other than this job's ranks writes to its "
                           "rendezvous store", fix=store_values.STORE_FIX)


def node_roles(records: Sequence[HostRecord], host: str) -> tuple[int, ...]:
    """The ranks whose records name ``host``, in rank order (pure)."""
    return tuple(sorted(r.rank for r in records if r.host == host))


def check_roles(rank: int, local: Sequence[int], roles: Sequence[str]) -> None:
    """Raise unless the published ``roles`` match the host this rank read for each rank (pure):
    the lowest local rank leads, the other local ranks join it, no other rank joins it."""
    lead = local[0] if len(local) > 1 else None
    for r, role in enumerate(roles):
        word, _, arg = role.partition(" ")
        if r == lead:
            ok = word == "lead" and len(arg) == 32 and all(c in "0123456789abcdef" for c in arg)
        elif lead is not None and r in local:
            ok = role == f"join {lead}"
        else:
            ok = role not in {f"join {x}" for x in local} and (r != rank or role == "alone")
        if not ok:
            where = "on this host" if r in local else "on another host"
            raise _fail(rank, f"the host records in the store put rank {r} {where}, but rank {r} published the "
                        f"role {store_values.shown(role, 60)} (the ranks read different host records)")


def init_identity(store: Any, world_size: int, job: Optional[str] = None) -> JobIdentity:
    """This process's identity in the node's proof at init: the store it reached, its launcher's
    job key (``job``; read from the environment when None), the world size."""
    return JobIdentity(store_endpoint(store), job if job is not None else launcher_job(os.environ), world_size, "init")


def prove_node(store: Any, name: str, mine: HostRecord, records: Sequence[HostRecord], world_size: int,
               timeout: datetime.timedelta, errors: str = "", identity: Optional[JobIdentity] = None) -> None:
    """Check ``records`` (read from the store) against what this host's ranks wrote; see the
    module docstring.  ``mine``: the record this rank wrote.  ``errors``: the exchange where a
    rank that fails publishes its error (the next one of init): the leader stops at once with a
    member's error instead of waiting for it.  ``identity``: this rank's job identity
    (:func:`init_identity` when None)."""
    rank = mine.rank
    identity = identity or init_identity(store, world_size)
    if records[rank] != mine:
        raise _fail(rank, f"the store's host record of rank {rank} is not the one rank {rank} wrote "
                    f"(store: {store_values.shown(records[rank].to_json(), 120)})")
    local = node_roles(records, mine.host)
    deadline = time.monotonic() + timeout.total_seconds()
    server = _listen() if len(local) > 1 and local[0] == rank else None
    try:
        role = ("alone" if len(local) < 2 else
                f"lead {server.getsockname()[len(_PREFIX):].decode()}" if server else f"join {local[0]}")
        roles = exchange(store, name, rank, world_size, role, timeout, what="proof")
        check_roles(rank, local, roles)
        if server is not None:
            _lead(server, mine, records, local, deadline, lambda missing: _failed(store, errors, missing), identity)
        elif len(local) > 1:
            _join(roles[local[0]].split(" ", 1)[1], mine, records, local, deadline, identity)
    finally:
        if server is not None:
            server.close()


# --------------------------------------------------------------------------- the channel


def _listen() -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(_PREFIX + secrets.token_hex(16).encode())
    srv.listen(socket.SOMAXCONN)
    srv.setblocking(False)
    return srv


def _send(conn: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv(conn: socket.socket, deadline: float) -> Any:
    head = _recv_exactly(conn, 4, deadline)
    (size,) = struct.unpack("!I", head)
    if size > _MAX_MESSAGE:
        raise OSError(f"a message of {size} bytes")
    return json.loads(_recv_exactly(conn, size, deadline).decode())


def _recv_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    out = b""
    while len(out) < n:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise OSError("the other end closed the connection")
        out += chunk
    return out


def _lead(server: socket.socket, mine: HostRecord, records: Sequence[HostRecord], local: Sequence[int],
          deadline: float, failed: Callable[[list[int]], Optional[str]], identity: JobIdentity) -> None:
    """Accept each local member (refusing every other user), check the record it wrote against
    the store's, then send every member the node's records as their writers sent them.
    ``failed(missing)``: the error a missing member published instead, if any."""
    rank, members, strangers = mine.rank, {}, [0]
    try:
        while len(members) < len(local) - 1:
            missing = sorted(set(local[1:]) - set(members))
            why = failed(missing)
            if why:
                raise RendezvousError(f"rank {rank}: {why}", fix="see that rank's log for the cause; every rank stops with it")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"rank {rank}: rank(s) {missing} of this host never reached its private check of the host "
                    f"records" + (f" ({strangers[0]} connection(s) from other users were refused)" if strangers[0] else ""),
                    fix="see those ranks' logs; raise CPUDDP_TIMEOUT if they were merely slow")
            if select.select([server], [], [], min(left, 0.5))[0]:
                for conn in _accept_all(server, rank, strangers):
                    _member(conn, rank, records, local, members, deadline, identity)
        table = [mine.to_json()] + [members[r][1] for r in local[1:]]
        for r in local[1:]:
            _send(members[r][0], {"identity": identity.wire(), "table": table})
    finally:
        for conn, _ in members.values():
            conn.close()


def _accept_all(server: socket.socket, rank: int, strangers: list[int]) -> list[socket.socket]:
    """Every connection waiting on ``server`` from this user; another user's are closed at once
    (counted in ``strangers[0]``, logged now and then), so a flood cannot keep the backlog full."""
    mine = []
    while True:
        try:
            conn, _ = server.accept()
        except (BlockingIOError, InterruptedError):
            return mine
        pid, uid = peer_cred(conn)
        if uid == os.geteuid():
            mine.append(conn)
            continue
        conn.close()
        strangers[0] += 1
        if strangers[0] % _STRANGER_LOG_EVERY == 1:
            log.warning("cpuddp: refused connection %d to rank %d's private check from pid %d, uid %d "
                        "(another user)", strangers[0], rank, pid, uid)


def _failed(store: Any, name: str, ranks: Sequence[int]) -> Optional[str]:
    """The first error one of ``ranks`` published in exchange ``name`` ('' when none did)."""
    if not name:
        return None
    for r in ranks:
        key = f"{name}/{r}"
        try:
            if store.check([key]):
                value = store.get(key).decode(errors="replace")
                if value.startswith(_ERROR):
                    return f"rank {r} failed during init: {_peer_error(value[len(_ERROR):])}"
        except Exception:  # noqa: BLE001 -- a store that fails here fails the next exchange too
            return None
    return None


def _another_job(rank: int, who: str, why: str, identity: JobIdentity) -> RendezvousError:
    return RendezvousError(f"rank {rank}: {who} is not a rank of this job ({why}): something other than this job's "
                           f"ranks writes to its rendezvous store at {identity.store}, and pointed this host's ranks "
                           "at another job of yours; refusing", fix=store_values.STORE_FIX)


def _member(conn: socket.socket, rank: int, records: Sequence[HostRecord], local: Sequence[int],
            members: dict, deadline: float, identity: JobIdentity) -> None:
    """Read one member's identity and record, and check them: the same job, and the record the
    store holds for it (the leader's side)."""
    try:
        said = _recv(conn, deadline)
    except OSError as exc:
        conn.close()
        raise RendezvousError(f"rank {rank}: a rank of this host connected to its private check of the host records "
                              f"and ended before it sent its record ({exc})",
                              fix="see the other ranks' logs; raise CPUDDP_TIMEOUT if they were merely slow") from None
    said = said if isinstance(said, dict) else {}
    why = mismatch(identity, JobIdentity.from_wire(said.get("identity")))
    if why is not None:
        pid = peer_cred(conn)[0]
        conn.close()
        raise _another_job(rank, f"the process (pid {pid}) that reached this host's private check", why, identity)
    raw = said.get("record")
    try:
        got = parse_record("the private check", raw, int(json.loads(raw)["rank"]), len(records))
    except (ValueError, KeyError, TypeError, RendezvousError) as exc:
        conn.close()
        raise _fail(rank, f"a process of this user sent the private check of the host records something "
                    f"other than a record ({type(exc).__name__}: {exc})") from None
    r = got.rank
    if r not in local[1:] or r in members:
        conn.close()
        raise _fail(rank, f"rank {r} reached this host's private check, but the store's records do not put "
                    f"it here, or it came twice")
    if records[r] != got:
        conn.close()
        raise _fail(rank, f"the store's host record of rank {r} ({store_values.shown(records[r].to_json(), 120)}) "
                    f"is not the one rank {r} wrote ({store_values.shown(raw, 120)})")
    members[r] = (conn, raw)


def _join(sock: str, mine: HostRecord, records: Sequence[HostRecord], local: Sequence[int],
          deadline: float, identity: JobIdentity) -> None:
    """Send the leader this rank's identity and record; check the leader's identity and the node's
    records it sends back."""
    rank, lead = mine.rank, local[0]
    with _connect(rank, lead, sock, deadline) as conn:
        pid, uid = peer_cred(conn)
        if uid != os.geteuid():
            raise _fail(rank, f"the socket the store names for rank {lead}'s private check belongs to pid {pid} "
                        f"of uid {uid}, another user")
        try:
            _send(conn, {"identity": identity.wire(), "record": mine.to_json()})
            said = _recv(conn, deadline)
        except (OSError, ValueError) as exc:
            raise RendezvousError(f"rank {rank}: rank {lead} ended the private check of the host records "
                                  f"({exc}); its log says why",
                                  fix=f"see rank {lead}'s log; every rank stops with it") from None
    said = said if isinstance(said, dict) else {}
    why = mismatch(identity, JobIdentity.from_wire(said.get("identity")))
    if why is not None:
        raise _another_job(rank, f"the process (pid {pid}) at the socket the store names for rank {lead}'s private "
                           "check", why, identity)
    _compare(rank, said.get("table"), records, local)


def connect_waiting(address: bytes, deadline: float) -> socket.socket:
    """A connected AF_UNIX stream socket to ``address``.  A full listen backlog (another user's
    flood) is waited out in the kernel, each try at most 1 s, until ``deadline``; then the last
    ``EAGAIN`` is raised.  Any other error is raised at once.  (A plain socket timeout makes an
    AF_UNIX connect fail with ``EAGAIN`` at once instead.)  The socket is left blocking."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            wait = min(1.0, max(0.01, deadline - time.monotonic()))
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(wait), int(wait % 1 * 1e6)))
            try:
                conn.connect(address)
                break
            except OSError as exc:
                if exc.errno != errno.EAGAIN or time.monotonic() >= deadline:
                    raise
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
        return conn
    except BaseException:
        conn.close()
        raise


def _connect(rank: int, lead: int, sock: str, deadline: float) -> socket.socket:
    """A connection to the leader's socket (:func:`connect_waiting`), its failures worded."""
    try:
        conn = connect_waiting(_PREFIX + sock.encode(), deadline)
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            raise RendezvousError(f"rank {rank}: rank {lead}'s private check of the host records kept its "
                                  "listen backlog full until the timeout (busy: another process floods it)",
                                  fix="run the job in a network namespace of its own (docs/security.md)") from None
        raise _fail(rank, f"rank {lead}'s private check of the host records is not listening where the "
                    f"store says ({exc.strerror or exc})") from None
    conn.settimeout(max(0.01, deadline - time.monotonic()))
    return conn


def _compare(rank: int, table: Any, records: Sequence[HostRecord], local: Sequence[int]) -> None:
    if not isinstance(table, list) or len(table) != len(local):
        raise _fail(rank, "the leader's table of this host's records is malformed")
    for r, raw in zip(local, table):
        got = parse_record("the private check", raw, r, len(records))
        if records[r] != got:
            raise _fail(rank, f"the store's host record of rank {r} "
                        f"({store_values.shown(records[r].to_json(), 120)}) is not the one rank {r} wrote "
                        f"({store_values.shown(raw, 120)})")
