"""Handing the node's segment (and the ranks' point-to-point sockets) from local rank 0 to its
local peers, over an abstract Unix socket whose every peer is checked.

Local rank 0 makes the segment (:func:`cpuddp.backends.shm.segment.create_segment`) and one
``socketpair`` per pair of local ranks, binds a listening socket with a random abstract name,
and publishes ``sock<TAB>name<TAB>token<TAB>slot`` under the group's ``seg/<rank>`` key.  Each
local peer connects, and both ends check the other's credentials (``SO_PEERCRED``: this uid;
the expected pid where the PID namespace is shared):

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
* the peer checks that the listening end is this uid (and rank 0's pid) before it says which
  local rank it is, receives the descriptors (``SCM_RIGHTS``), checks the segment
  (:func:`cpuddp.backends.shm.segment.check_received`) and answers ``ok`` or its error.

A failure on any local rank is published in the store (``ready/<rank 0>``, ``mapped/<rank>``)
and raised on all of them at once (:func:`map_segment`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import pwd
import re
import secrets
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from cpuddp.errors import BackendError
from cpuddp.launchers.proof import connect_waiting
from cpuddp.launchers.store_values import STORE_FIX
from cpuddp.topology.here import pid_alive

from . import check as shm_check
from .node import NodePlan
from .segment import FIX, Segment, check_received, create_segment

__all__ = ["map_segment", "parse_offer", "parse_busy", "busy_text", "HELLO_WITHIN"]

log = logging.getLogger("cpuddp.shm")

_PEER_FIX = "the fix is in that rank's own error (and docs/security.md if another user is named)"
_SOCK_RE = re.compile(r"^[0-9a-f]{32}$")
_SOCK_PREFIX = b"\0cpuddp-shm-"
_MAX_SLOT = 1 << 30
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


def _peer_cred(conn: socket.socket) -> Tuple[int, int]:
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _cred_problem(conn: socket.socket, expected_pids: Optional[set]) -> Optional[str]:
    """Why the process at the other end of ``conn`` is not one of ours (None when it is)."""
    pid, uid = _peer_cred(conn)
    if uid != os.geteuid():
        return f"runs as uid {uid} (pid {pid}), not this job's uid {os.geteuid()}: another user"
    if expected_pids is not None and pid not in expected_pids:
        return f"is pid {pid}, not the expected pid {' or '.join(str(p) for p in sorted(expected_pids))}"
    return None


def _user(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f" ({pwd.getpwuid(uid).pw_name})"
    return ""


def _most(refused: Dict[int, int]) -> List[Tuple[int, int]]:
    """The three uids with the most refused connections, and their counts."""
    return sorted(refused.items(), key=lambda kv: -kv[1])[:3]


def busy_text(refused: Dict[int, int]) -> str:
    """``150 connections from uid 999 (name)``, for the uids with the most."""
    return ", ".join(f"{n} connection{'s' if n != 1 else ''} from uid {uid}{_user(uid)}" for uid, n in _most(refused))


def parse_busy(raw: bytes) -> Dict[int, int]:
    """Local rank 0's published count (``uid<TAB>count`` lines), checked; empty if it is not one."""
    out: Dict[int, int] = {}
    for line in raw.decode(errors="replace").splitlines()[:3]:
        parts = line.split("\t")
        if len(parts) == 2 and all(p.isdigit() and len(p) <= 12 for p in parts):
            out[int(parts[0])] = int(parts[1])
    return out


def parse_offer(raw: bytes, key: str) -> Tuple[str, int, int]:
    """Local rank 0's offer under ``key``: ``sock<TAB>name<TAB>token<TAB>slot``, checked."""
    text = raw.decode(errors="replace")
    if text.startswith("error\t"):
        raise BackendError(text.split("\t", 1)[1], fix=FIX)
    parts = text.split("\t")
    try:
        name, token, slot = parts[1], int(parts[2]), int(parts[3])
        ok = (len(parts) == 4 and parts[0] == "sock" and _SOCK_RE.match(name) is not None
              and 0 < token < (1 << 62) + 1 and shm_check.PAGE <= slot <= _MAX_SLOT and slot % shm_check.PAGE == 0)
    except (IndexError, ValueError):
        ok = False
    if not ok:
        raise BackendError(f"store key {key} holds {raw[:100]!r}, not local rank 0's shared-memory offer",
                           fix=STORE_FIX)
    return name, token, slot


# --------------------------------------------------------------------------- local rank 0


@dataclass
class _Conn:
    """One accepted connection of this uid: waiting for its hello, then for its reply."""

    sock: socket.socket
    since: float
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
    pending: Dict[int, int] = field(default_factory=dict)  # local rank -> group rank, not served yet
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
            self.store.set(f"busy/{self.plan.local[0]}", "\n".join(f"{uid}\t{n}" for uid, n in _most(self.refused)))
            self.published = (time.monotonic(), total)

    def _expected_pids(self) -> Optional[set]:
        pids = {self.plan.peer_pids.get(r) for r in self.pending.values()}
        return None if None in pids else pids  # a peer in another PID namespace: uid only

    def _accept(self, sel: selectors.BaseSelector, conns: Dict[socket.socket, _Conn]) -> None:
        """Accept every connection waiting (a burst at most); another user's is closed at once."""
        for _ in range(_ACCEPT_BURST):
            try:
                sock, _ = self.srv.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            _, uid = _peer_cred(sock)
            if uid != os.geteuid():
                if not self.refused[uid]:
                    log.warning("cpuddp.shm: refused a connection to the hand-over socket: the process %s (more "
                                "from uid %d are counted, and logged once the hand-over ends)",
                                _cred_problem(sock, None), uid)
                self.refused[uid] += 1
                sock.close()
                continue
            problem = _cred_problem(sock, self._expected_pids())
            if problem is not None:
                log.warning("cpuddp.shm: refused a connection to the hand-over socket: the process %s", problem)
                sock.close()
                continue
            sock.setblocking(False)
            conns[sock] = _Conn(sock, time.monotonic())
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
        c.buf += data
        if data and b"\n" not in c.buf and len(c.buf) < 32:
            return
        text = c.buf.split(b"\n", 1)[0].decode(errors="replace")
        lr = int(text) if text.isdigit() else -1
        pid = self.plan.peer_pids.get(self.pending.get(lr, -1))
        problem = None if lr in self.pending else f"said it is local rank {text[:16]!r}, which is not waiting"
        if problem is None and pid is not None:
            problem = _cred_problem(c.sock, {pid})
        if problem is not None:
            log.warning("cpuddp.shm: refused a hand-over request: the process %s", problem)
            self._close(sel, conns, c)
            return
        msg, fds = self.fds_for(lr)
        c.sock.setblocking(True)
        c.sock.settimeout(HELLO_WITHIN)
        socket.send_fds(c.sock, [msg], fds)
        c.sock.setblocking(False)
        c.local_rank, c.buf = lr, b""

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
                pid, _ = _peer_cred(c.sock)
                log.warning("cpuddp.shm: dropped a connection to the hand-over socket that said nothing for %.0f s "
                            "(pid %d)", HELLO_WITHIN, pid)
                self._close(sel, conns, c)

    def _peers_failed(self) -> None:
        for lr, r in self.pending.items():
            key = f"mapped/{r}"
            if self.store.check([key]):
                text = self.store.get(key).decode(errors='replace').split(chr(9), 1)[-1]
                if self.refused:
                    raise self._error(f"local rank {lr}: {text}")
                raise BackendError(f"local rank {lr}: {text}", fix=_PEER_FIX)
            pid = self.plan.peer_pids.get(r)
            if pid is not None and not pid_alive(pid):
                raise self._error(f"local rank {lr} (rank {r}, pid {pid}) died before it mapped the segment")
        if time.monotonic() > self.deadline:
            raise self._error(f"local rank(s) {sorted(self.pending)} did not ask for the segment within the group "
                              "timeout")


def _socket_pairs(n: int) -> Dict[Tuple[int, int], socket.socket]:
    """One connected ``socketpair`` per pair of local ranks: ``ends[(a, b)]`` is a's end to b."""
    ends: Dict[Tuple[int, int], socket.socket] = {}
    for a in range(n):
        for b in range(a + 1, n):
            ends[(a, b)], ends[(b, a)] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ends


def _create_and_serve(store: Any, key: str, plan: NodePlan, deadline: float,
                      slot: int) -> Tuple[Segment, Dict[int, socket.socket]]:
    fd, token = create_segment(plan.local_size, slot)
    ends = _socket_pairs(plan.local_size)
    try:
        seg = Segment(fd, 0, plan.local_size, slot)
        seg.hold_liveness()

        def fds_for(lr: int) -> Tuple[bytes, List[int]]:
            return struct.pack("q", token), [fd] + [ends[(lr, j)].fileno() for j in range(plan.local_size) if j != lr]

        name = secrets.token_hex(16)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
            srv.bind(_SOCK_PREFIX + name.encode())
            srv.listen(max(socket.SOMAXCONN, plan.local_size))  # the kernel caps it (net.core.somaxconn)
            store.set(key, f"sock\t{name}\t{token}\t{slot}")
            _Server(srv, plan, store, deadline, fds_for).run()
    except BaseException:
        os.close(fd)
        for s in ends.values():
            s.close()
        raise
    mine = {j: ends.pop((0, j)) for j in range(1, plan.local_size)}
    for s in ends.values():  # the peers hold theirs now
        s.close()
    return seg, mine


# --------------------------------------------------------------------------- the other local ranks


def _connect(name: str, deadline: float, busy: Callable[[], str]) -> socket.socket:
    """A connection to local rank 0's hand-over socket.  A full backlog is waited out in the kernel
    (each ``accept`` wakes the waiting connects) until ``deadline``; then the error says the socket
    was busy, and by whom (``busy()``: local rank 0's published count, or nothing)."""
    try:
        return connect_waiting(_SOCK_PREFIX + name.encode(), deadline)
    except OSError as exc:
        if exc.errno != errno.EAGAIN:
            raise BackendError(f"cannot reach local rank 0's shared-memory hand-over socket: {exc.strerror} "
                               "(ranks with the same host identity in different network namespaces?)",
                               fix=FIX) from exc
        counts = busy()
        raise BackendError("hand-over socket busy: local rank 0's shared-memory hand-over socket kept its "
                           "listen backlog full until the group timeout, so this rank could not connect"
                           + (f" (local rank 0 refused {counts})" if counts else ""),
                           fix=_BUSY_FIX) from exc


def _fetch(name: str, token: int, plan: NodePlan, slot: int, deadline: float,
           busy: Callable[[], str] = lambda: "") -> Tuple[Segment, List[int]]:
    """A peer: connect to local rank 0's socket, check it, receive and check the descriptors, map
    the segment and take this rank's liveness lock -- all before the "ok" that lets local rank 0
    start its first round (a peer it waits for then never looks dead for still mapping)."""
    rank0 = plan.local[0]
    pid0 = plan.peer_pids.get(rank0)
    want = plan.local_size  # the segment and one socket per other local rank
    with _connect(name, deadline, busy) as conn:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        problem = _cred_problem(conn, None if pid0 is None else {pid0})
        if problem is not None:
            raise BackendError(f"the process at the other end of the shared-memory hand-over (local rank 0) {problem}; "
                               "refusing", fix="see docs/security.md (something else writes to this job's store)")
        conn.sendall(f"{plan.local_rank}\n".encode())
        msg, fds, _flags, _addr = socket.recv_fds(conn, 64, want)
        if len(fds) != want or msg != struct.pack("q", token):
            for f in fds:
                os.close(f)
            raise BackendError("local rank 0's socket did not hand over this group's segment", fix=FIX)
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
    return seg, fds[1:]


def _attach(store: Any, key: str, plan: NodePlan, deadline: float) -> Tuple[Segment, Dict[int, socket.socket]]:
    rank0 = plan.local[0]
    pid0 = plan.peer_pids.get(rank0)
    raw = _wait_key(store, key, deadline, "waiting for local rank 0's shared-memory segment",
                    lambda: None if pid0 is None or pid_alive(pid0) else f"local rank 0 (rank {rank0}, pid {pid0}) died")
    name, token, slot = parse_offer(raw, key)

    def busy() -> str:
        key = f"busy/{rank0}"
        return busy_text(parse_busy(store.get(key))) if store.check([key]) else ""

    seg, others = _fetch(name, token, plan, slot, deadline, busy)
    peers = [j for j in range(plan.local_size) if j != plan.local_rank]
    return seg, {j: socket.socket(fileno=f) for j, f in zip(peers, others)}


def _wait_key(store: Any, key: str, deadline: float, what: str, failed: Callable[[], Optional[str]]) -> bytes:
    """Poll the store for ``key`` while ``failed()`` has nothing to say, until ``deadline``."""
    while True:
        if store.check([key]):
            return store.get(key)
        why = failed()
        if why is not None:
            raise BackendError(f"{what}: {why}", fix=FIX)
        if time.monotonic() > deadline:
            raise BackendError(f"{what}: store key {key} did not appear within the group timeout", fix=FIX)
        time.sleep(_POLL)


def _linger_for_peers(store: Any, plan: NodePlan, until: float) -> None:
    """Local rank 0 failed: wait (bounded) until each live local peer has read the error and said so."""
    for r in plan.local[1:]:
        pid = plan.peer_pids.get(r)
        while not store.check([f"mapped/{r}"]) and time.monotonic() < until:
            if pid is not None and not pid_alive(pid):
                break
            time.sleep(_POLL)


def map_segment(store: Any, rank: int, plan: NodePlan, timeout: float,
                slot: int) -> Tuple[Segment, Dict[int, socket.socket]]:
    """Map the node's segment on every local rank; also each rank's socket to every other local
    rank (``{local rank: socket}``).  Any local rank's failure is raised on all, fast."""
    deadline = time.monotonic() + timeout
    key, ready = f"seg/{plan.local[0]}", f"ready/{plan.local[0]}"
    try:
        if plan.local_rank == 0:
            seg, socks = _create_and_serve(store, key, plan, deadline, slot)
        else:
            seg, socks = _attach(store, key, plan, deadline)
    except BaseException as exc:
        _publish_failure(store, rank, plan, key, ready, deadline, exc)
        raise
    if plan.local_rank == 0:
        store.set(ready, "ok")
        return seg, socks
    got = _wait_key(store, ready, deadline, "waiting for the node's ranks to map the segment",
                    lambda: None if seg.alive(0) else "local rank 0 died")
    if got != b"ok":
        seg.close()
        raise BackendError("the shared-memory segment could not be mapped: "
                           + got.decode(errors="replace").split("\t", 1)[-1], fix=FIX)
    return seg, socks


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
