"""Set-up for :mod:`cpuddp.shm`: which ranks share a node, and the node's shared segment.

* :func:`whoami` / :func:`plan_node`: each rank publishes ``host identity, pid, PID namespace,
  allowed CPUs`` through the store; :func:`parse_who` checks each line (a malformed one is an
  error naming its key); :func:`plan_node` (pure) turns them into this rank's :class:`NodePlan`
  or the reason the group runs gloo for every collective.
* :func:`map_segment`: local rank 0 creates an anonymous ``memfd`` (no name in any directory:
  nothing another user can pre-create, substitute or find left over), reserves it
  (``posix_fallocate``: no memory is a clear error now, never a SIGBUS later) and hands it to
  each local peer over an abstract Unix socket.  Both ends check the other's credentials
  (``SO_PEERCRED``: same user; the expected pid where the PID namespace is shared), the peer
  checks the descriptor with ``fstat`` (regular file, our uid, mode 0600, the size the layout
  needs) and the header (magic, token, size).  Nothing is mapped because a store value says so.
* Liveness: every rank holds an open-file-description lock (``F_OFD_SETLK``) on its own byte
  past the segment's end; the kernel drops it when the process dies, so a peer's death is seen
  through ``F_OFD_GETLK`` even from another PID namespace (:meth:`Segment.alive`).
* :class:`Segment`: the mapped header words, per-rank control lines (arrival counter, posted
  and checked call numbers, state), descriptor rings and typed slot views.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import re
import secrets
import select
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from cpuddp.errors import BackendError
from cpuddp.launchers.hosts import host_identity, pid_alive

from . import check as shm_check

log = logging.getLogger("cpuddp.shm")

MAGIC = 0x6370756464707368  # "cpuddpsh"
# int64 words of the header page
W_MAGIC, W_SIZE, W_SLOT, W_TOKEN, W_ABORT, W_RING = 0, 1, 2, 3, 4, 5
# int64 words of each rank's control line
C_EPOCH, C_POSTED, C_CHECKED, C_STATE = 0, 1, 2, 3
STATE_LIVE, STATE_LEFT = 0, 1

FIX = ("give the job memory for the segment (or lower CPUDDP_SHM_SLOT), run the node's ranks as one user "
       "in one network namespace, or pass backend='gloo'")
_PEER_FIX = "the fix is in that rank's own error (and docs/security.md if another user is named)"
_SOCK_RE = re.compile(r"^[0-9a-f]{32}$")
_SOCK_PREFIX = b"\0cpuddp-shm-"
_MAX_SLOT = 1 << 30
_POLL = 0.05
#: How long a failed local rank 0 (which may host the store) stays for its peers to read why.
_LINGER = 10.0
_FLOCK = "hhqqixxxx"  # struct flock on Linux x86-64: type, whence, start, len, pid (+pad)


def pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "?"


def _allowed_cpus() -> str:
    try:
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return ""


# --------------------------------------------------------------------------- who shares a node


def whoami() -> str:
    """This rank's line for ``shm/who/<rank>``: host identity, pid, PID namespace, allowed CPUs."""
    return f"{host_identity()}\t{os.getpid()}\t{pid_namespace()}\t{_allowed_cpus()}"


def parse_who(raw: bytes, key: str) -> List[str]:
    """One rank's :func:`whoami` line, checked: 4 tab-separated fields, a positive pid, CPU numbers."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        text = None
    fields = text.split("\t") if text is not None else []
    ok = len(fields) == 4 and fields[0] and fields[1].isdigit() and int(fields[1]) > 0 and fields[2]
    ok = ok and all(c.isdigit() for c in fields[3].split(",") if fields[3])
    if not ok:
        raise BackendError(f"store key {key} holds {raw[:80]!r}, not a rank's 'host<TAB>pid<TAB>pid-namespace"
                           "<TAB>cpus' line: something else writes to this job's rendezvous store",
                           fix="give the job a store only it uses (its own MASTER_PORT), and see docs/security.md")
    return fields


@dataclass(frozen=True)
class NodePlan:
    """This rank's place among the ranks of its node, from every rank's :func:`whoami` line."""

    local: Tuple[int, ...]  # the global ranks on this node, in order
    local_rank: int
    node: int
    nodes: int
    peer_pids: dict = field(default_factory=dict)  # local rank's global rank -> pid (same PID namespace)
    spin: bool = True  # the node's ranks have at least a CPU each: yield-spin before sleeping
    gloo_only: Optional[str] = None  # why shared memory is not used, else None

    @property
    def local_size(self) -> int:
        return len(self.local)


def plan_node(who: Sequence[Sequence[str]], rank: int) -> NodePlan:
    """Pure: ``who[r]`` is rank r's :func:`whoami` line split at tabs."""
    size = len(who)
    hosts = list(dict.fromkeys(w[0] for w in who))
    local = tuple(r for r in range(size) if who[r][0] == who[rank][0])
    counts = {h: sum(1 for w in who if w[0] == h) for h in hosts}
    cpus = set().union(*(who[r][3].split(",") for r in local)) - {""}
    gloo_only = None
    if size == 1 or len(local) == 1:
        gloo_only = "gloo for every collective: one rank per node"
    elif len(set(counts.values())) != 1:
        gloo_only = ("gloo for every collective: nodes run different numbers of ranks "
                     f"({', '.join(str(c) for c in counts.values())})")
    return NodePlan(
        local=local,
        local_rank=local.index(rank),
        node=hosts.index(who[rank][0]),
        nodes=len(hosts),
        peer_pids={r: int(who[r][1]) for r in local if r != rank and who[r][2] == who[rank][2]},
        spin=bool(cpus) and len(cpus) >= len(local),
        gloo_only=gloo_only,
    )


# --------------------------------------------------------------------------- the segment


def _lock(fd: int, cmd: int, kind: int, offset: int) -> int:
    got = fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0))
    return struct.unpack(_FLOCK, got)[0]


class Segment:
    """One node's mapped segment: header words, control lines, descriptor rings, typed slot views."""

    def __init__(self, fd: int, local_rank: int, local_size: int, slot: int) -> None:
        counters, slots, total = shm_check.layout(local_size, slot)
        self.fd, self.total = fd, total
        self.mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.slot = slot
        self.size = local_size
        self.local_rank = local_rank
        self.words = (ctypes.c_int64 * 8).from_buffer(self.mm, 0)
        self.lines = [(ctypes.c_int64 * 4).from_buffer(self.mm, counters + i * shm_check.COUNTER_STRIDE)
                      for i in range(local_size)]
        ring = shm_check.ring_offset(local_size)
        per = shm_check.DESC_BYTES // 8
        self.rings = [[(ctypes.c_int64 * per).from_buffer(self.mm, ring + (r * shm_check.RING + i)
                                                          * shm_check.DESC_BYTES)
                       for i in range(shm_check.RING)] for r in range(local_size)]
        # the arrival counters the data path reads and writes (views of each line's first word)
        self.counters = [ctypes.c_int64.from_buffer(self.mm, counters + i * shm_check.COUNTER_STRIDE)
                         for i in range(local_size)]
        self.mine = self.counters[local_rank]
        self.others = [c for i, c in enumerate(self.counters) if i != local_rank]
        self.raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=total - slots, offset=slots)
        self._views: dict[torch.dtype, List[List[torch.Tensor]]] = {}

    def hold_liveness(self) -> None:
        """Lock this rank's byte past the end: held until this process (and its OFD) is gone."""
        _lock(self.fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, self.total + self.local_rank)

    def alive(self, local_rank: int) -> bool:
        """Does local rank ``local_rank``'s process still hold its liveness lock?"""
        return _lock(self.fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, self.total + local_rank) != fcntl.F_UNLCK

    def slots(self, dtype: torch.dtype) -> List[List[torch.Tensor]]:
        """``[parity][local rank]`` 1-D views of ``dtype`` over the slots."""
        views = self._views.get(dtype)
        if views is None:
            flat = self.raw.view(dtype)
            n = self.slot // flat.element_size()
            views = [[flat[(p * self.size + r) * n:(p * self.size + r + 1) * n] for r in range(self.size)]
                     for p in (0, 1)]
            self._views[dtype] = views
        return views


def _reserve(fd: int, total: int, local_size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        from cpuddp._units import format_size

        raise BackendError(f"cannot reserve {format_size(total)} of shared memory for {local_size} local ranks: "
                           f"{exc.strerror}", fix=FIX) from exc


def create_segment(local_size: int, slot: int) -> Tuple[int, int]:
    """Local rank 0: a new, reserved, owner-only memfd with its header written; ``(fd, token)``."""
    total = shm_check.layout(local_size, slot)[2]
    fd = os.memfd_create("cpuddp-shm", getattr(os, "MFD_CLOEXEC", 1))
    try:
        os.fchmod(fd, 0o600)
        _reserve(fd, total, local_size)
        token = secrets.randbits(62) + 1
        with mmap.mmap(fd, shm_check.PAGE) as head:
            words = (ctypes.c_int64 * 8).from_buffer(head, 0)
            words[W_SIZE], words[W_SLOT], words[W_TOKEN], words[W_RING] = local_size, slot, token, shm_check.RING
            words[W_MAGIC] = MAGIC
            del words
    except BaseException:
        os.close(fd)
        raise
    return fd, token


def check_received(fd: int, token: int, local_size: int, slot: int) -> None:
    """A peer: is ``fd`` the segment local rank 0 made for this group?  Raises if not."""
    total = shm_check.layout(local_size, slot)[2]
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not this job's uid {os.geteuid()}"
    elif st.st_mode & 0o077:
        problem = f"has mode {oct(st.st_mode & 0o777)}, not owner-only"
    elif st.st_size != total:
        problem = f"has size {st.st_size}, expected {total}"
    if problem is None:
        with mmap.mmap(fd, shm_check.PAGE) as head:
            words = (ctypes.c_int64 * 8).from_buffer(head, 0)
            ok = (words[W_MAGIC], words[W_TOKEN], words[W_SIZE], words[W_SLOT]) == (MAGIC, token, local_size, slot)
            del words
        problem = None if ok else "has a header that is not this group's (magic, token, size)"
    if problem is not None:
        raise BackendError(f"the shared-memory segment received from local rank 0 {problem}: refusing to map it",
                           fix="see docs/security.md; if no other user interferes, report it as a bug")


# --------------------------------------------------------------------------- the hand-over


def _peer_cred(conn: socket.socket) -> Tuple[int, int]:
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _check_cred(conn: socket.socket, expected_pid: Optional[int], who: str) -> None:
    pid, uid = _peer_cred(conn)
    if uid != os.geteuid():
        raise BackendError(f"the process at the other end of the shared-memory hand-over ({who}) runs as uid {uid}, "
                           f"not this job's uid {os.geteuid()}: another user answered; refusing",
                           fix="see docs/security.md (another user writes to this job's store)")
    if expected_pid is not None and pid != expected_pid:
        raise BackendError(f"the process at the other end of the shared-memory hand-over ({who}) is pid {pid}, "
                           f"not the expected pid {expected_pid}; refusing",
                           fix="see docs/security.md (something else writes to this job's store)")


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
                           fix="give the job a store only it uses (its own MASTER_PORT), and see docs/security.md")
    return name, token, slot


@dataclass
class _Waiter:
    """Polls the store for ``key`` while ``failed()`` has nothing to say, until ``deadline``."""

    store: Any
    deadline: float
    what: str

    def get(self, key: str, failed: Callable[[], Optional[str]]) -> bytes:
        while True:
            if self.store.check([key]):
                return self.store.get(key)
            why = failed()
            if why is not None:
                raise BackendError(f"{self.what}: {why}", fix=FIX)
            if time.monotonic() > self.deadline:
                raise BackendError(f"{self.what}: store key {key} did not appear within the group timeout",
                                   fix=FIX)
            time.sleep(_POLL)


def _serve(srv: socket.socket, fd: int, token: int, plan: NodePlan, store: Any, deadline: float) -> None:
    """Local rank 0: hand ``fd`` to every local peer (checked credentials), wait for each one's reply."""
    pending = {lr: r for lr, r in enumerate(plan.local) if lr != 0}
    while pending:
        ready, _, _ = select.select([srv], [], [], _POLL)
        if not ready:
            _peers_failed(store, plan, pending, deadline)
            continue
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                lr = int(conn.recv(16).decode() or "-1")
                if lr not in pending:
                    raise BackendError(f"an unexpected local rank {lr} asked for the segment", fix=FIX)
                _check_cred(conn, plan.peer_pids.get(pending[lr]), f"local rank {lr}")
            except (BackendError, ValueError, OSError) as exc:
                log.warning("cpuddp.shm: refused a hand-over request: %s", getattr(exc, "msg", exc))
                continue
            socket.send_fds(conn, [struct.pack("q", token)], [fd])
            reply = conn.recv(4096).decode(errors="replace")
        if reply != "ok":
            raise BackendError(f"local rank {lr} (rank {pending[lr]}) could not map the segment: "
                               f"{reply or 'it closed the connection (died?)'}", fix=FIX)
        del pending[lr]


def _peers_failed(store: Any, plan: NodePlan, pending: Dict[int, int], deadline: float) -> None:
    for lr, r in pending.items():
        key = f"shm/mapped/{r}"
        if store.check([key]):
            raise BackendError(f"local rank {lr}: {store.get(key).decode(errors='replace').split(chr(9), 1)[-1]}",
                               fix=_PEER_FIX)
        pid = plan.peer_pids.get(r)
        if pid is not None and not pid_alive(pid):
            raise BackendError(f"local rank {lr} (rank {r}, pid {pid}) died before it mapped the segment", fix=FIX)
    if time.monotonic() > deadline:
        raise BackendError(f"local rank(s) {sorted(pending)} did not ask for the segment within the group timeout",
                           fix=FIX)


def _fetch(name: str, token: int, plan: NodePlan, slot: int, deadline: float) -> int:
    """A peer: connect to local rank 0's socket, check it, receive and check the segment's fd."""
    rank0 = plan.local[0]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            conn.connect(_SOCK_PREFIX + name.encode())
        except OSError as exc:
            raise BackendError(f"cannot reach local rank 0's shared-memory hand-over socket: {exc.strerror} "
                               "(ranks with the same host identity in different network namespaces?)",
                               fix=FIX) from exc
        _check_cred(conn, plan.peer_pids.get(rank0), "local rank 0")
        conn.sendall(str(plan.local_rank).encode())
        msg, fds, _flags, _addr = socket.recv_fds(conn, 64, 1)
        if len(fds) != 1 or msg != struct.pack("q", token):
            for f in fds:
                os.close(f)
            raise BackendError("local rank 0's socket did not hand over this group's segment", fix=FIX)
        try:  # an open file description of our own: its liveness lock is ours alone
            fd = os.open(f"/proc/self/fd/{fds[0]}", os.O_RDWR | os.O_CLOEXEC)
        finally:
            os.close(fds[0])
        try:
            check_received(fd, token, plan.local_size, slot)
        except BaseException as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(str(getattr(exc, "msg", exc)).encode()[:4000])
            raise
        conn.sendall(b"ok")
    return fd


def _create_and_serve(store: Any, key: str, plan: NodePlan, deadline: float) -> Segment:
    slot = shm_check.slot_bytes(os.environ)
    fd, token = create_segment(plan.local_size, slot)
    try:
        seg = Segment(fd, 0, plan.local_size, slot)
        seg.hold_liveness()
        name = secrets.token_hex(16)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
            srv.bind(_SOCK_PREFIX + name.encode())
            srv.listen(max(8, plan.local_size))
            store.set(key, f"sock\t{name}\t{token}\t{slot}")
            _serve(srv, fd, token, plan, store, deadline)
    except BaseException:
        os.close(fd)
        raise
    return seg


def _attach(store: Any, key: str, plan: NodePlan, deadline: float) -> Segment:
    rank0 = plan.local[0]
    pid0 = plan.peer_pids.get(rank0)
    waiter = _Waiter(store, deadline, "waiting for local rank 0's shared-memory segment")
    raw = waiter.get(key, lambda: None if pid0 is None or pid_alive(pid0)
                     else f"local rank 0 (rank {rank0}, pid {pid0}) died")
    name, token, slot = parse_offer(raw, key)
    fd = _fetch(name, token, plan, slot, deadline)
    try:
        seg = Segment(fd, plan.local_rank, plan.local_size, slot)
        seg.hold_liveness()
    except BaseException:
        os.close(fd)
        raise
    return seg


def _linger_for_peers(store: Any, plan: NodePlan, until: float) -> None:
    """Local rank 0 failed: wait (bounded) until each live local peer has read the error and said so."""
    for r in plan.local[1:]:
        pid = plan.peer_pids.get(r)
        while not store.check([f"shm/mapped/{r}"]) and time.monotonic() < until:
            if pid is not None and not pid_alive(pid):
                break
            time.sleep(_POLL)


def map_segment(store: Any, rank: int, plan: NodePlan, timeout: float) -> Segment:
    """Map the node's segment on every local rank; any local rank's failure is raised on all, fast."""
    deadline = time.monotonic() + timeout
    key, ready = f"shm/seg/{plan.local[0]}", f"shm/ready/{plan.local[0]}"
    try:
        seg = (_create_and_serve if plan.local_rank == 0 else _attach)(store, key, plan, deadline)
    except BaseException as exc:
        status = f"error\trank {rank}: {getattr(exc, 'msg', exc)}"
        if plan.local_rank == 0:
            with contextlib.suppress(Exception):
                store.set(ready, status)
                if not store.check([key]):
                    store.set(key, status)
                _linger_for_peers(store, plan, min(deadline, time.monotonic() + _LINGER))
        else:
            with contextlib.suppress(Exception):
                store.set(f"shm/mapped/{rank}", status)
        raise
    if plan.local_rank == 0:
        store.set(ready, "ok")
        return seg
    got = _Waiter(store, deadline, "waiting for the node's ranks to map the segment").get(
        ready, lambda: None if seg.alive(0) else "local rank 0 died")
    if got != b"ok":
        raise BackendError("the shared-memory segment could not be mapped: "
                           + got.decode(errors="replace").split("\t", 1)[-1], fix=FIX)
    return seg
