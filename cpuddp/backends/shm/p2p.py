"""Point-to-point (``send``/``recv``) between the ranks of one node, over the ``socketpair``
local rank 0 made for each pair of them and handed over with the segment
(:mod:`cpuddp.backends.shm.handover`).  The sockets have no name: no other process can reach
them.

One thread per group moves the bytes (``selectors``: a send never waits for its receive, so two
ranks that send to each other before they receive cannot deadlock).  A message is a header
(tag, byte count) and the tensor's bytes.  A ``recv`` takes the first message from its source
with its tag, in the order they were sent; a message that arrives before its ``recv`` is kept
until one asks for it.  A peer that exits or dies closes its socket: every ``recv`` from it
then fails at once.  A forked child closes its copies of the sockets at once.
"""

from __future__ import annotations

import collections
import ctypes
import os
import selectors
import socket
import struct
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Optional

import torch
import torch.distributed as dist

__all__ = ["PeerLinks"]

_HEADER = struct.Struct("<qq")  # tag, bytes
_live: "weakref.WeakSet[PeerLinks]" = weakref.WeakSet()


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


@dataclass
class _In:
    tensor: Optional[torch.Tensor]
    fut: Optional["torch.futures.Future[Any]"]
    tag: int = 0
    data: Optional[memoryview] = None
    done: int = 0


@dataclass
class _Peer:
    sock: socket.socket
    out: Deque[_Out] = field(default_factory=collections.deque)
    head: bytes = b""
    reading: Optional[_In] = None
    posted: Dict[int, Deque[_In]] = field(default_factory=lambda: collections.defaultdict(collections.deque))
    arrived: Dict[int, Deque[bytes]] = field(default_factory=lambda: collections.defaultdict(collections.deque))
    closed: Optional[str] = None


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
        _live.add(self)

    def has(self, rank: int) -> bool:
        return rank in self._peers

    def send(self, t: torch.Tensor, dst: int, tag: int) -> "torch.futures.Future[Any]":
        fut: torch.futures.Future = torch.futures.Future()
        payload = _bytes_of(t)
        with self._lock:
            peer = self._peer(dst, "send to")
            peer.out.append(_Out(memoryview(_HEADER.pack(tag, len(payload))), torch.futures.Future(), None))
            peer.out.append(_Out(payload, fut, t))
        self._wake()
        return fut

    def recv(self, t: torch.Tensor, src: int, tag: int) -> "torch.futures.Future[Any]":
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            peer = self._peer(src, "receive from")
            waiting = peer.arrived.get(tag)
            if waiting:
                self._deliver(_In(t, fut, tag), waiting.popleft(), src)
            else:
                peer.posted[tag].append(_In(t, fut, tag))
        return fut

    def _peer(self, rank: int, what: str) -> _Peer:
        peer = self._peers[rank]
        if peer.closed is not None:
            raise dist.DistBackendError(f"shm: cannot {what} rank {rank}: {peer.closed}")
        if self._stop:
            raise dist.DistBackendError("the shm process group was shut down")
        return peer

    def _deliver(self, want: _In, data: bytes, src: int) -> None:
        target = _bytes_of(want.tensor)  # type: ignore[arg-type]
        if len(target) != len(data):
            want.fut.set_exception(dist.DistBackendError(  # type: ignore[union-attr]
                f"shm: rank {self.rank} received {len(data)} bytes from rank {src} (tag {want.tag}) into a tensor "
                f"of {len(target)} bytes: send and recv must use tensors of the same size"))
            return
        target[:] = data
        want.fut.set_result([want.tensor])  # type: ignore[union-attr]

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
            for key, events in self._sel.select(0.5):
                if key.data is None:
                    try:
                        self._wake_r.recv(4096)
                    except (BlockingIOError, OSError):
                        pass
                    continue
                with self._lock:
                    peer = self._peers[key.data]
                    if peer.closed is not None:
                        continue
                    try:
                        if events & selectors.EVENT_WRITE:
                            self._write(peer)
                        if events & selectors.EVENT_READ:
                            self._read(peer, key.data)
                    except OSError as exc:
                        self._close_peer(peer, key.data, f"its socket failed: {exc}")

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
                if not item.fut.done():
                    item.fut.set_result([item.keep] if item.keep is not None else [])

    def _read(self, peer: _Peer, src: int) -> None:
        while True:
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
                tag, nbytes = _HEADER.unpack(peer.head)
                peer.head = b""
                peer.reading = self._start(peer, tag, nbytes)
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

    def _start(self, peer: _Peer, tag: int, nbytes: int) -> _In:
        posted = peer.posted.get(tag)
        if posted and posted[0].tensor is not None and len(_bytes_of(posted[0].tensor)) == nbytes:
            want = posted.popleft()
            want.data = _bytes_of(want.tensor)  # type: ignore[arg-type]
            return want
        return _In(None, None, tag, memoryview(bytearray(nbytes)))

    def _finish(self, peer: _Peer, item: _In, src: int) -> None:
        if item.fut is not None:
            item.fut.set_result([item.tensor])
            return
        posted = peer.posted.get(item.tag)
        if posted:
            self._deliver(posted.popleft(), bytes(item.data), src)  # type: ignore[arg-type]
        else:
            peer.arrived[item.tag].append(bytes(item.data))  # type: ignore[arg-type]

    def _close_peer(self, peer: _Peer, src: int, why: str) -> None:
        peer.closed = why
        err = dist.DistBackendError(f"shm: rank {src} on this node: {why}")
        for queue_ in peer.posted.values():
            for want in queue_:
                if want.fut is not None and not want.fut.done():
                    want.fut.set_exception(err)
        if peer.reading is not None and peer.reading.fut is not None and not peer.reading.fut.done():
            peer.reading.fut.set_exception(err)
        for item in peer.out:
            if not item.fut.done():
                item.fut.set_exception(err)
        peer.out.clear()
        peer.posted.clear()
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


def _after_fork_in_child() -> None:
    for links in list(_live):
        links.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

