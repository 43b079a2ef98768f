"""Point-to-point (``send``/``recv``) between the ranks of one node, over the ``socketpair``
local rank 0 made for each pair of them and handed over with the segment
(:mod:`cpuddp.backends.shm.protocol.handover`).  The sockets have no name: no other process can reach
them.

One thread per group moves the bytes (``selectors``: a send never waits for its receive, so two
ranks that send to each other before they receive cannot deadlock).  A message is a header
(kind, tag, byte count, element count, dtype) and the tensor's bytes.  A ``recv`` takes the
first message from its source with its tag, in the order they were sent; a message that arrives
before its ``recv`` is kept until one asks for it (also after the link closed).  Before a byte lands in the receiving tensor,
the message's dtype and element count are compared with the tensor's: a difference fails that
``recv`` naming both sides, and the receiver sends the same text back (a *refusal*) and closes
its link with the sender; the sender's link closes with that text too, so its pending and later
sends and receives with that rank raise it (its send itself has completed: it never waits for
the receive).  A peer that exits or dies closes its socket: every ``recv`` from it then fails at
once.  A forked child closes its copies of the sockets at once.
"""

from __future__ import annotations

import collections
import ctypes
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..protocol.forks import close_in_forked_child

__all__ = ["PeerLinks"]

_HEADER = struct.Struct("<bqqq16s")  # kind, tag, bytes, elements, dtype
_DATA, _REFUSAL = 0, 1
_MAX_REFUSAL = 1 << 16


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous tensor's bytes (empty for an empty tensor)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


@dataclass
class _Out:
    data: memoryview
    fut: "torch.futures.Future[Any]"
    keep: Any  # the tensor, alive until sent
    done: int = 0
    more: bool = False  # the next item is the rest of this message (a header's payload)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


@dataclass(frozen=True)
class _Facts:
    """What a message holds (or a recv expects): its tag, element count and dtype."""

    tag: int
    numel: int
    dtype: str

    @staticmethod
    def of(t: torch.Tensor, tag: int) -> "_Facts":
        return _Facts(tag, t.numel(), _dtype(t))

    def text(self) -> str:
        return f"{self.numel} {self.dtype} element{'s' if self.numel != 1 else ''}"


@dataclass
class _In:
    tensor: Optional[torch.Tensor]
    fut: Optional["torch.futures.Future[Any]"]
    tag: int = 0
    data: Optional[memoryview] = None
    done: int = 0
    facts: Optional[_Facts] = None  # a message being read: what its sender said it holds
    refusal: bool = False  # a message being read: the peer's refusal of one of ours


@dataclass
class _Peer:
    sock: socket.socket
    out: Deque[_Out] = field(default_factory=collections.deque)
    head: bytes = b""
    reading: Optional[_In] = None
    posted: Dict[int, Deque[_In]] = field(default_factory=lambda: collections.defaultdict(collections.deque))
    arrived: Dict[int, Deque[Tuple[_Facts, bytes]]] = field(
        default_factory=lambda: collections.defaultdict(collections.deque))
    closed: Optional[str] = None
    flushing: bool = False  # closed, but a refusal is still being written
    mid: bool = False  # the items written so far end inside a message (its header went out)


class PeerLinks:
    """This rank's sockets to the other ranks of its node (``{group rank: socket}``)."""

    def __init__(self, socks: Dict[int, socket.socket], rank: int) -> None:
        self.rank = rank
        self._peers = {r: _Peer(s) for r, s in socks.items()}
        self._lock = threading.RLock()  # a future's callbacks may send or receive
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        for s in (*socks.values(), self._wake_r):
            s.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        for r, p in self._peers.items():
            self._sel.register(p.sock, selectors.EVENT_READ, r)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"cpuddp-shm-p2p-{rank}", daemon=True)
        self._thread.start()
        close_in_forked_child(self)

    def has(self, rank: int) -> bool:
        return rank in self._peers

    def send(self, t: torch.Tensor, dst: int, tag: int) -> "torch.futures.Future[Any]":
        fut: torch.futures.Future = torch.futures.Future()
        payload = _bytes_of(t)
        head = _HEADER.pack(_DATA, tag, len(payload), t.numel(), _dtype(t).encode())
        with self._lock:
            peer = self._peer(dst, "send to")
            peer.out.append(_Out(memoryview(head), torch.futures.Future(), None, more=True))
            peer.out.append(_Out(payload, fut, t))
        self._wake()
        return fut

    def recv(self, t: torch.Tensor, src: int, tag: int) -> "torch.futures.Future[Any]":
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            peer = self._peers[src]
            waiting = peer.arrived.get(tag)
            if waiting and not self._stop:  # a message that came before the link closed, if it did
                self._deliver(peer, _In(t, fut, tag), *waiting.popleft(), src)
            else:
                self._peer(src, "receive from").posted[tag].append(_In(t, fut, tag))
        return fut

    def _peer(self, rank: int, what: str) -> _Peer:
        peer = self._peers[rank]
        if peer.closed is not None:
            raise dist.DistBackendError(f"shm: cannot {what} rank {rank}: {peer.closed}")
        if self._stop:
            raise dist.DistBackendError("the shm process group was shut down")
        return peer

    def _deliver(self, peer: _Peer, want: _In, facts: _Facts, data: bytes, src: int) -> None:
        """A kept message to the recv that asked for it, once their dtypes and counts agree."""
        if not self._agrees(peer, want, facts, src):
            return
        _bytes_of(want.tensor)[:] = data  # type: ignore[arg-type]
        want.fut.set_result([want.tensor])  # type: ignore[union-attr]

    def _agrees(self, peer: _Peer, want: _In, facts: _Facts, src: int) -> bool:
        """Does message ``facts`` fit the recv ``want``?  If not: fail it, refuse, close the link."""
        expect = _Facts.of(want.tensor, want.tag)  # type: ignore[arg-type]
        if facts == expect:
            return True
        why = (f"send/recv mismatch between rank {src} and rank {self.rank} (tag {facts.tag}): rank {src} sent "
               f"{facts.text()}, rank {self.rank} receives {expect.text()}. A send and its recv must pass tensors "
               "of the same dtype and element count; nothing was written into the receiving tensor, and the link "
               "between the two ranks is closed")
        want.fut.set_exception(dist.DistBackendError(f"shm: {why}"))  # type: ignore[union-attr]
        self._refuse(peer, src, why)
        return False

    def _refuse(self, peer: _Peer, src: int, why: str) -> None:
        """Tell ``src`` why (a refusal after any message half-written to it), then close the link."""
        if peer.closed is not None:
            return  # a message kept from before the link closed: the recv's error is enough
        text = why.encode()[:_MAX_REFUSAL]
        keep = []
        if peer.out and (peer.mid or peer.out[0].done):  # a message half-written goes out whole
            keep = list(peer.out)[:2 if peer.out[0].more else 1]
        err = dist.DistBackendError(f"shm: {why}")
        for item in list(peer.out)[len(keep):]:
            if not item.fut.done():
                item.fut.set_exception(err)
        peer.out.clear()
        peer.out.extend(keep)
        peer.out.append(_Out(memoryview(_HEADER.pack(_REFUSAL, 0, len(text), 0, b"")), torch.futures.Future(), None,
                             more=True))
        peer.out.append(_Out(memoryview(text), torch.futures.Future(), None))
        self._close_peer(peer, src, why, flush=True)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                for r, p in self._peers.items():
                    if p.closed is None:
                        self._sel.modify(p.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if p.out else 0), r)
                    elif p.flushing:
                        self._sel.modify(p.sock, selectors.EVENT_WRITE, r)
            for key, events in self._sel.select(0.5):
                if key.data is None:
                    try:
                        self._wake_r.recv(4096)
                    except (BlockingIOError, OSError):
                        pass
                    continue
                with self._lock:
                    self._serve(self._peers[key.data], key.data, events)

    def _serve(self, peer: _Peer, src: int, events: int) -> None:
        if peer.closed is not None and not peer.flushing:
            return
        try:
            if events & selectors.EVENT_WRITE:
                self._write(peer)
            if peer.flushing and not peer.out:
                self._unregister(peer)  # the refusal went out
            elif events & selectors.EVENT_READ and peer.closed is None:
                self._read(peer, src)
        except OSError as exc:
            self._close_peer(peer, src, f"its socket failed: {exc}")

    def _write(self, peer: _Peer) -> None:
        while peer.out:
            item = peer.out[0]
            if item.done < len(item.data):
                try:
                    item.done += peer.sock.send(item.data[item.done:])
                except BlockingIOError:
                    return
            if item.done >= len(item.data):
                peer.out.popleft()
                peer.mid = item.more
                if not item.fut.done():
                    item.fut.set_result([item.keep] if item.keep is not None else [])

    def _read(self, peer: _Peer, src: int) -> None:
        while peer.closed is None:
            if peer.reading is None:
                try:
                    got = peer.sock.recv(_HEADER.size - len(peer.head))
                except BlockingIOError:
                    return
                if not got:
                    self._close_peer(peer, src, "it closed its connection (it exited, died or left the group)")
                    return
                peer.head += got
                if len(peer.head) < _HEADER.size:
                    continue
                kind, tag, nbytes, numel, dtype = _HEADER.unpack(peer.head)
                peer.head = b""
                peer.reading = self._start(peer, src, kind, _Facts(tag, numel, dtype.rstrip(b"\0").decode()), nbytes)
                if peer.reading is None:
                    return  # refused: the link is closed
            item = peer.reading
            if item.done < len(item.data):  # type: ignore[arg-type]
                try:
                    got_n = peer.sock.recv_into(item.data[item.done:])  # type: ignore[index]
                except BlockingIOError:
                    return
                if got_n == 0:
                    self._close_peer(peer, src, "it closed its connection in the middle of a message")
                    return
                item.done += got_n
            if item.done >= len(item.data):  # type: ignore[arg-type]
                peer.reading = None
                self._finish(peer, item, src)

    def _start(self, peer: _Peer, src: int, kind: int, facts: _Facts, nbytes: int) -> Optional[_In]:
        """Where a message's bytes go: the recv that waits for it, if it agrees; else kept aside."""
        if kind == _REFUSAL and 0 <= nbytes <= _MAX_REFUSAL:
            return _In(None, None, facts.tag, memoryview(bytearray(nbytes)), refusal=True)
        if kind != _DATA or nbytes < 0:
            self._close_peer(peer, src, f"it sent a message of kind {kind} and {nbytes} bytes (not cpuddp's)")
            return None
        posted = peer.posted.get(facts.tag)
        if not posted:
            return _In(None, None, facts.tag, memoryview(bytearray(nbytes)), facts=facts)
        want = posted.popleft()
        if not self._agrees(peer, want, facts, src):
            return None
        want.data = _bytes_of(want.tensor)  # type: ignore[arg-type]
        if len(want.data) != nbytes:  # the same dtype and count in other bytes: not cpuddp's sender
            posted.appendleft(want)
            self._close_peer(peer, src, f"it sent {nbytes} bytes for {facts.text()}")
            return None
        return want

    def _finish(self, peer: _Peer, item: _In, src: int) -> None:
        if item.refusal:
            self._close_peer(peer, src, bytes(item.data).decode(errors="replace"))  # type: ignore[arg-type]
            return
        if item.fut is not None:
            item.fut.set_result([item.tensor])
            return
        posted = peer.posted.get(item.tag)
        if posted:
            self._deliver(peer, posted.popleft(), item.facts, bytes(item.data), src)  # type: ignore[arg-type]
        else:
            peer.arrived[item.tag].append((item.facts, bytes(item.data)))  # type: ignore[arg-type]

    def _close_peer(self, peer: _Peer, src: int, why: str, flush: bool = False) -> None:
        """No more messages with ``src``: every pending one fails with ``why`` (after a refusal
        still to go out, with ``flush``, the socket stays registered for writing until it has)."""
        peer.closed, peer.flushing = why, flush
        err = dist.DistBackendError(f"shm: rank {src} on this node: {why}")
        for queue_ in peer.posted.values():
            for want in queue_:
                if want.fut is not None and not want.fut.done():
                    want.fut.set_exception(err)
        if peer.reading is not None and peer.reading.fut is not None and not peer.reading.fut.done():
            peer.reading.fut.set_exception(err)
        peer.reading = None
        if not flush:  # (with flush, the thread's loop registers the socket for writing only)
            for item in peer.out:
                if not item.fut.done():
                    item.fut.set_exception(err)
            peer.out.clear()
            self._unregister(peer)
        peer.posted.clear()

    def _unregister(self, peer: _Peer) -> None:
        peer.flushing = False
        try:
            self._sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass

    def close(self) -> None:
        self._stop = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for p in self._peers.values():
            p.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def after_fork_in_child(self) -> None:
        self._stop = True
        self._close_sockets()


