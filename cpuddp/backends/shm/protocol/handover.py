"""Handing the node's segment (and the ranks' point-to-point sockets) from local rank 0 to its
local peers, over an abstract Unix socket whose every peer is checked.

Local rank 0 makes the segment (:func:`cpuddp.backends.shm.protocol.segment.create_segment`) and one
``socketpair`` per pair of local ranks, binds a listening socket with a random abstract name,
and publishes ``sock<TAB>name<TAB>token<TAB>slot`` under the group's ``seg/<rank>`` key.  Each
local peer connects, and both ends check the other's credentials (``SO_PEERCRED``: this uid)
and job identity (the words: :mod:`cpuddp.backends.shm.protocol.offer`):

* local rank 0 checks a connection right after ``accept()``, before reading a byte: another
  user's connection is closed at once (the first one of each uid logged with its uid and pid,
  the rest counted: a flood is logged as one line, "hand-over socket busy: N connections from
  uid U"); it accepts every connection waiting at each wake-up, from a backlog of ``SOMAXCONN``,
  so a flood of connections from another user is dropped as fast as it comes and cannot hold
  the socket's backlog full; it serves every connection without blocking (``selectors``), so a
  process that connects and sends nothing holds only its own connection, which is dropped
  after :data:`HELLO_WITHIN` seconds;
* a peer whose connect meets a full backlog waits in the kernel for its turn (woken at each
  ``accept``), until the group timeout; then its error says the socket was busy, and by whom
  (local rank 0 publishes its count under ``busy/<rank 0>``), never "network namespaces";
* the peer checks that the listening end is this uid before it says which local rank it is, and
  states its job identity (:class:`~cpuddp.launchers.identity.JobIdentity`: the store it
  connected to, the launcher's job id, the world, the group -- derived by itself, never read
  from the store); local rank 0 refuses a peer of another job or group at once, and states its
  own identity with the descriptors (``SCM_RIGHTS``); the peer checks it, then the segment
  (:func:`cpuddp.backends.shm.protocol.segment.check_received`), and answers ``ok`` or its error.  So
  two jobs of one user whose stores someone rewrote fail, naming the store, and are never wired
  to each other; each side holds the other's process as the kernel named it
  (:class:`~cpuddp.launchers.identity.PeerProcess`), never by a pid from the store.

A failure on any local rank is published in the store (``ready/<rank 0>``, ``mapped/<rank>``)
and raised on all of them at once (:func:`map_segment`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import secrets
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from cpuddp.errors import BackendError
from cpuddp.launchers.identity import JobIdentity, PeerProcess, mismatch, peer_cred, peer_process
from cpuddp.launchers.proof import connect_waiting
from cpuddp.launchers.store_values import stall_cause
from cpuddp.topology.here import pid_alive

from .node import NodePlan
from .offer import (MAX_HELLO, PEER_FIX, another_job, busy_text, busy_value, hello_line, parse_busy, parse_hello, parse_offer,
                    uid_problem)
from .segment import FIX, Segment, check_received, create_segment

__all__ = ["map_segment", "HELLO_WITHIN"]

log = logging.getLogger("cpuddp.shm")

_SOCK_PREFIX = b"\0cpuddp-shm-"
_POLL = 0.05
#: How long a connection of this uid may stay silent before local rank 0 drops it.
HELLO_WITHIN = 1.0
#: How long a failed local rank 0 (which may host the store) stays for its peers to read why.
_LINGER = 10.0
#: Connections accepted at one wake-up at most (the peers' hellos and replies are served between).
_ACCEPT_BURST = 512
#: How often local rank 0 republishes its count of refused connections (seconds).
_BUSY_EVERY = 0.5
_BUSY_FIX = ("another user's processes connect to this job's shared-memory hand-over socket (its name is public "
             "on the host): stop them (their uid is named; ask the node's administrator), or run the job's ranks "
             "in a network namespace of their own (a container), where nobody else can reach the socket; see "
             "docs/security.md")


# --------------------------------------------------------------------------- local rank 0


@dataclass
class _Conn:
    """One accepted connection of this uid: waiting for its hello, then for its reply."""

    sock: socket.socket
    since: float
    proc: PeerProcess
    buf: bytes = b""
    local_rank: Optional[int] = None  # set once the descriptors went out


@dataclass
class _Server:
    """Local rank 0's side: serve every local peer its descriptors, never blocking on one."""

    srv: socket.socket
    plan: NodePlan
    store: Any
    deadline: float
    fds_for: Callable[[int], Tuple[bytes, List[int]]]
    identity: JobIdentity
    pending: Dict[int, int] = field(default_factory=dict)  # local rank -> group rank, not served yet
    peers: Dict[int, PeerProcess] = field(default_factory=dict)  # local rank -> its process, once served
    refused: Dict[int, int] = field(default_factory=collections.Counter)  # another uid -> its connections
    published: Tuple[float, int] = (0.0, 0)  # when, and how many refused, busy/<rank 0> was last set

    def run(self) -> None:
        self.pending = {lr: r for lr, r in enumerate(self.plan.local) if lr != 0}
        conns: Dict[socket.socket, _Conn] = {}
        self.srv.setblocking(False)
        with selectors.DefaultSelector() as sel:
            sel.register(self.srv, selectors.EVENT_READ)
            try:
                while self.pending:
                    for key, _ in sel.select(_POLL):
                        if key.fileobj is self.srv:
                            self._accept(sel, conns)
                        elif key.fileobj in conns:
                            self._read(sel, conns, conns[key.fileobj])  # type: ignore[index]
                    self._drop_silent(sel, conns)
                    self._publish_busy()
                    self._peers_failed()
            finally:
                for c in conns.values():
                    c.sock.close()
                if self.refused:
                    log.warning("cpuddp.shm: hand-over socket busy: %s were refused during the hand-over",
                                busy_text(self.refused))

    def _error(self, msg: str) -> BackendError:
        """An error of the hand-over, naming a flood of other users' connections if there was one."""
        if not self.refused:
            return BackendError(msg, fix=FIX)
        return BackendError(f"{msg}; hand-over socket busy: {busy_text(self.refused)} were refused", fix=_BUSY_FIX)

    def _publish_busy(self) -> None:
        """Tell the peers (``busy/<rank 0>``) how many connections of other users were refused."""
        total, (when, last) = sum(self.refused.values()), self.published
        if total != last and time.monotonic() - when > _BUSY_EVERY:
            self.store.set(f"busy/{self.plan.local[0]}", busy_value(self.refused))
            self.published = (time.monotonic(), total)

    def _accept(self, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> None:
        """Accept every connection waiting (a burst at most); another user's is closed at once."""
        for _ in range(_ACCEPT_BURST):
            try:
                sock, _ = self.srv.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            pid, uid = peer_cred(sock)
            if uid != os.geteuid():
                if not self.refused[uid]:
                    log.warning("cpuddp.shm: refused a connection to the hand-over socket: the process %s (more "
                                "from uid %d are counted, and logged once the hand-over ends)",
                                uid_problem(pid, uid), uid)
                self.refused[uid] += 1
                sock.close()
                continue
            sock.setblocking(False)
            conns[sock] = _Conn(sock, time.monotonic(), peer_process(sock))
            sel.register(sock, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn], c: _Conn) -> None:
        try:
            data = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if c.local_rank is None:
            self._hello(sel, conns, c, data)
        else:
            self._reply(sel, conns, c, data)

    def _close(self, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn], c: _Conn) -> None:
        sel.unregister(c.sock)
        conns.pop(c.sock, None)
        c.sock.close()

    def _hello(self, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn], c: _Conn, data: bytes) -> None:
        """A peer's hello: ``local rank<TAB>group rank<TAB>job identity``.  A wrong local rank is
        dropped (logged); a rank of another job or group stops the hand-over (the store was
        rewritten); a rank of this group gets its descriptors and this rank's identity."""
        c.buf += data
        if data and b"\n" not in c.buf and len(c.buf) < MAX_HELLO:
            return
        lr, rank, theirs = parse_hello(c.buf.split(b"\n", 1)[0])
        if lr not in self.pending or self.pending[lr] != rank:
            log.warning("cpuddp.shm: refused a hand-over request: the process (pid %d) said it is local rank %r "
                        "(rank %r), which is not waiting", c.proc.pid, lr, rank)
            self._close(sel, conns, c)
            return
        why = mismatch(self.identity, theirs)
        if why is not None:
            with contextlib.suppress(OSError):
                c.sock.setblocking(True)
                c.sock.sendall(f"refused: {mismatch(theirs, self.identity) if theirs else why}".encode()[:4000])
            self._close(sel, conns, c)
            raise another_job(f"the process (pid {c.proc.pid}) that asked for this node's "
                               f"segment as local rank {lr}", why, self.identity.store)
        msg, fds = self.fds_for(lr)
        c.sock.setblocking(True)
        c.sock.settimeout(HELLO_WITHIN)
        socket.send_fds(c.sock, [msg], fds)
        c.sock.setblocking(False)
        c.local_rank, c.buf = lr, b""
        self.peers[lr] = c.proc

    def _reply(self, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn], c: _Conn, data: bytes) -> None:
        c.buf += data
        if data and c.buf != b"ok" and len(c.buf) < 4000 and not b"\n" in c.buf:
            return
        lr = c.local_rank
        self._close(sel, conns, c)
        if c.buf != b"ok":
            text = c.buf.decode(errors="replace").strip() or "it closed the connection (died?)"
            raise self._error(f"local rank {lr} (rank {self.pending.get(lr)}) could not map the segment: {text}")
        self.pending.pop(lr, None)  # type: ignore[arg-type]

    def _drop_silent(self, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> None:
        now = time.monotonic()
        for c in list(conns.values()):
            if c.local_rank is None and now - c.since > HELLO_WITHIN:
                log.warning("cpuddp.shm: dropped a connection to the hand-over socket that said nothing for %.0f s "
                            "(pid %d)", HELLO_WITHIN, c.proc.pid)
                self._close(sel, conns, c)

    def _peers_failed(self) -> None:
        for lr, r in self.pending.items():
            key = f"mapped/{r}"
            if self.store.check([key]):
                text = self.store.get(key).decode(errors='replace').split(chr(9), 1)[-1]
                if self.refused:
                    raise self._error(f"local rank {lr}: {text}")
                raise BackendError(f"local rank {lr}: {text}", fix=PEER_FIX)
            pid = self.plan.peer_pids.get(r)
            if pid is not None and not pid_alive(pid):
                raise self._error(f"local rank {lr} (rank {r}, pid {pid}) died before it mapped the segment")
        if time.monotonic() > self.deadline:
            late = f"local rank(s) {sorted(self.pending)} did not ask for the segment within the group timeout"
            raise self._error(late) if self.refused else BackendError(late, fix=stall_cause(self.identity.store))


def _socket_pairs(n: int) -> Dict[Tuple[int, int], socket.socket]:
    """One connected ``socketpair`` per pair of local ranks: ``ends[(a, b)]`` is a's end to b."""
    ends: Dict[Tuple[int, int], socket.socket] = {}
    for a in range(n):
        for b in range(a + 1, n):
            ends[(a, b)], ends[(b, a)] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ends


def _create_and_serve(store: Any, key: str, plan: NodePlan, deadline: float, slot: int,
                      identity: JobIdentity) -> Tuple[Segment, Dict[int, socket.socket], Dict[int, PeerProcess]]:
    fd, token = create_segment(plan.local_size, slot)
    ends = _socket_pairs(plan.local_size)
    try:
        seg = Segment(fd, 0, plan.local_size, slot)
        seg.hold_liveness()
        offer = struct.pack("q", token) + identity.wire().encode()

        def fds_for(lr: int) -> Tuple[bytes, List[int]]:
            return offer, [fd] + [ends[(lr, j)].fileno() for j in range(plan.local_size) if j != lr]

        name = secrets.token_hex(16)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
            srv.bind(_SOCK_PREFIX + name.encode())
            srv.listen(max(socket.SOMAXCONN, plan.local_size))  # the kernel caps it (net.core.somaxconn)
            store.set(key, f"sock\t{name}\t{token}\t{slot}")
            server = _Server(srv, plan, store, deadline, fds_for, identity)
            server.run()
    except BaseException:
        os.close(fd)
        for s in ends.values():
            s.close()
        raise
    mine = {j: ends.pop((0, j)) for j in range(1, plan.local_size)}
    for s in ends.values():  # the peers hold theirs now
        s.close()
    return seg, mine, server.peers


# --------------------------------------------------------------------------- the other local ranks


#: The likeliest cause of a hand-over with the wrong group, for the errors that may follow from it.
_OTHER_ORDER = "ranks that create their subgroups in different orders, so that one read another group's offer"


def _connect(name: str, deadline: float, busy: Callable[[], str], store: str) -> socket.socket:
    """A connection to local rank 0's hand-over socket.  A full backlog is waited out in the kernel
    (each ``accept`` wakes the waiting connects) until ``deadline``; then the error says the socket
    was busy, and by whom (``busy()``: local rank 0's published count, or nothing).  ``store``:
    the rendezvous store's endpoint, which named the socket."""
    try:
        return connect_waiting(_SOCK_PREFIX + name.encode(), deadline)
    except OSError as exc:
        if exc.errno != errno.EAGAIN:
            raise BackendError(f"cannot reach the shared-memory hand-over socket the rendezvous store at {store} "
                               f"names for local rank 0: {exc.strerror} ({_OTHER_ORDER}; ranks with the same host "
                               "identity in different network namespaces; or something other than this job's ranks "
                               "writes to the store: docs/security.md)", fix=FIX) from exc
        counts = busy()
        raise BackendError("hand-over socket busy: local rank 0's shared-memory hand-over socket kept its "
                           "listen backlog full until the group timeout, so this rank could not connect"
                           + (f" (local rank 0 refused {counts})" if counts else ""),
                           fix=_BUSY_FIX) from exc


def _check_leader(conn: socket.socket) -> PeerProcess:
    """Local rank 0's end of ``conn`` must run as this user (checked before a byte is sent)."""
    proc = peer_process(conn)
    problem = uid_problem(proc.pid, proc.uid)
    if problem is not None:
        raise BackendError(f"the process at the other end of the shared-memory hand-over (local rank 0) {problem}; "
                           "refusing", fix="see docs/security.md (something else writes to this job's store)")
    return proc


def _receive(conn: socket.socket, token: int, want: int, identity: JobIdentity, leader: PeerProcess) -> List[int]:
    """The ``want`` descriptors local rank 0 sends, once its identity proves it is of this job
    and group (the token alone came from the store: it proves nothing)."""
    try:
        msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_HELLO, want)
    except OSError as exc:
        raise BackendError(f"local rank 0 (pid {leader.pid}) closed the hand-over before it sent the segment "
                           f"({exc.strerror or exc}): it failed, or refused this rank ({_OTHER_ORDER}?)",
                           fix=FIX) from None
    why: Optional[str] = None
    if len(fds) == want and msg[:8] == struct.pack("q", token):
        why = mismatch(identity, JobIdentity.from_wire(msg[8:]))
        if why is None:
            return fds
    elif msg.startswith(b"refused: "):
        why = msg[len(b"refused: "):].decode(errors="replace")
    for f in fds:
        os.close(f)
    if why:
        raise another_job(f"the process (pid {leader.pid}) at local rank 0's hand-over socket",
                           f"{why}; or {_OTHER_ORDER}", identity.store)
    raise BackendError(f"local rank 0's socket did not hand over this group's segment ({_OTHER_ORDER}?)", fix=FIX)


def _fetch(name: str, token: int, plan: NodePlan, slot: int, deadline: float, identity: JobIdentity, rank: int,
           busy: Callable[[], str] = lambda: "") -> Tuple[Segment, List[int], PeerProcess]:
    """A peer: connect to local rank 0's socket, check it, receive and check the descriptors, map
    the segment and take this rank's liveness lock -- all before the "ok" that lets local rank 0
    start its first round (a peer it waits for then never looks dead for still mapping)."""
    with _connect(name, deadline, busy, identity.store) as conn:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        leader = _check_leader(conn)
        conn.sendall(hello_line(plan.local_rank, rank, identity))
        fds = _receive(conn, token, plan.local_size, identity, leader)
        try:  # an open file description of our own: its liveness lock is ours alone
            fd = os.open(f"/proc/self/fd/{fds[0]}", os.O_RDWR | os.O_CLOEXEC)
        finally:
            os.close(fds[0])
        try:
            check_received(fd, token, plan.local_size, slot)
            seg = Segment(fd, plan.local_rank, plan.local_size, slot)
            seg.hold_liveness()
        except BaseException as exc:
            os.close(fd)
            for f in fds[1:]:
                os.close(f)
            with contextlib.suppress(OSError):
                conn.sendall(str(getattr(exc, "msg", exc)).encode()[:4000])
            raise
        conn.sendall(b"ok")
    return seg, fds[1:], leader


def _attach(store: Any, key: str, plan: NodePlan, deadline: float, identity: JobIdentity,
            rank: int) -> Tuple[Segment, Dict[int, socket.socket], Dict[int, PeerProcess]]:
    rank0 = plan.local[0]
    pid0 = plan.peer_pids.get(rank0)  # the store's word: only to notice a death sooner
    died = f"local rank 0 (rank {rank0}, pid {pid0}) died"
    raw = _wait_key(store, key, deadline, "waiting for local rank 0's shared-memory segment",
                    lambda: None if pid0 is None or pid_alive(pid0) else died, identity.store)
    name, token, slot = parse_offer(raw, key, identity.store)

    def busy() -> str:
        key = f"busy/{rank0}"
        return busy_text(parse_busy(store.get(key))) if store.check([key]) else ""

    seg, others, leader = _fetch(name, token, plan, slot, deadline, identity, rank, busy)
    peers = [j for j in range(plan.local_size) if j != plan.local_rank]
    return seg, {j: socket.socket(fileno=f) for j, f in zip(peers, others)}, {0: leader}


def _wait_key(store: Any, key: str, deadline: float, what: str, failed: Callable[[], Optional[str]],
              where: str) -> bytes:
    """Poll the store (at ``where``) for ``key`` while ``failed()`` has nothing to say, until ``deadline``."""
    while True:
        if store.check([key]):
            return store.get(key)
        why = failed()
        if why is not None:
            raise BackendError(f"{what}: {why}", fix=FIX)
        if time.monotonic() > deadline:
            raise BackendError(f"{what}: store key {key} did not appear within the group timeout",
                               fix=stall_cause(where))
        time.sleep(_POLL)


def _linger_for_peers(store: Any, plan: NodePlan, until: float) -> None:
    """Local rank 0 failed: wait (bounded) until each live local peer has read the error and said so."""
    for r in plan.local[1:]:
        pid = plan.peer_pids.get(r)
        while not store.check([f"mapped/{r}"]) and time.monotonic() < until:
            if pid is not None and not pid_alive(pid):
                break
            time.sleep(_POLL)


def map_segment(store: Any, rank: int, plan: NodePlan, timeout: float, slot: int,
                identity: JobIdentity) -> Tuple[Segment, Dict[int, socket.socket], Dict[int, PeerProcess]]:
    """Map the node's segment on every local rank; also each rank's socket to every other local
    rank (``{local rank: socket}``) and the processes it met in the hand-over, as the kernel named
    them (``{local rank: PeerProcess}``: local rank 0 meets every peer, a peer meets local rank 0).
    ``identity``: this rank's job and group, which every rank it meets must share.  Any local
    rank's failure is raised on all, fast."""
    deadline = time.monotonic() + timeout
    key, ready = f"seg/{plan.local[0]}", f"ready/{plan.local[0]}"
    try:
        if plan.local_rank == 0:
            seg, socks, peers = _create_and_serve(store, key, plan, deadline, slot, identity)
        else:
            seg, socks, peers = _attach(store, key, plan, deadline, identity, rank)
    except BaseException as exc:
        _publish_failure(store, rank, plan, key, ready, deadline, exc)
        raise
    if plan.local_rank == 0:
        store.set(ready, "ok")
        return seg, socks, peers
    got = _wait_key(store, ready, deadline, "waiting for the node's ranks to map the segment",
                    lambda: None if seg.alive(0) else "local rank 0 died", identity.store)
    if got != b"ok":
        seg.close()
        raise BackendError("the shared-memory segment could not be mapped: "
                           + got.decode(errors="replace").split("\t", 1)[-1], fix=FIX)
    return seg, socks, peers


def _publish_failure(store: Any, rank: int, plan: NodePlan, key: str, ready: str, deadline: float,
                     exc: BaseException) -> None:
    status = f"error\trank {rank}: {getattr(exc, 'msg', exc)}"
    with contextlib.suppress(Exception):
        if plan.local_rank == 0:
            store.set(ready, status)
            if not store.check([key]):
                store.set(key, status)
            _linger_for_peers(store, plan, min(deadline, time.monotonic() + _LINGER))
        else:
            store.set(f"mapped/{rank}", status)
