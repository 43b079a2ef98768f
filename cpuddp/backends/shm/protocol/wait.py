"""Waiting for the node's other ranks on the Python data path (:mod:`cpuddp.backends.shm.python.local`),
by the shm backend's one wait policy (:class:`Backoff`, :func:`spin_until`; the group's threads
and its Works use it too, :mod:`cpuddp.backends.shm.routes.stream`).

The policy and its numbers are ``layout.h``'s ("the wait policy": defined there once, for this
engine and the native one, :mod:`cpuddp.backends.shm.native.layout`): ``sched_yield`` polling
for ``WAIT_YIELD_NS`` when every local rank has a CPU of its own (``WAIT_YIELD_SHARED_NS`` when
ranks share CPUs), then sleeps that grow with the wait (at most 1/``WAIT_SLEEP_SHARE`` of the
time waited so far, ``WAIT_SLEEP_MIN_NS`` to ``WAIT_SLEEP_MAX_NS``), and every
``WAIT_CHECK_NS`` a look at the late peers.  This engine has no pause-spin (Python has no
``pause``) and no futex (it sleeps for the time the policy says; a native waiter sleeps on the
segment's bell, which wakes it at the peer's arrival).

:meth:`Waiter.until` returns once no local peer is late, and ends at once with an error naming
the peer that died (the kernel-held lock of
:meth:`cpuddp.backends.shm.protocol.segment.Segment.alive`, which works across PID namespaces,
and its pid where it is visible), left the group or gave up (the segment's abort word), and at
the group timeout otherwise.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Sequence

import torch.distributed as dist

from ..native.layout import (C_STATE, STATE_LEFT, W_ABORT, WAIT_CHECK_NS, WAIT_SLEEP_MAX_NS, WAIT_SLEEP_MIN_NS,
                             WAIT_SLEEP_SHARE, WAIT_YIELD_NS, WAIT_YIELD_SHARED_NS)
from .segment import Segment

__all__ = ["Waiter", "Backoff", "spin_until"]

# layout.h's policy in seconds
_YIELD, _YIELD_SHARED = WAIT_YIELD_NS / 1e9, WAIT_YIELD_SHARED_NS / 1e9
_SLEEP_MIN, _SLEEP_MAX, _CHECK = WAIT_SLEEP_MIN_NS / 1e9, WAIT_SLEEP_MAX_NS / 1e9, WAIT_CHECK_NS / 1e9


class Backoff:
    """The wait policy: :meth:`pause` once per look at a condition that did not hold yet."""

    __slots__ = ("start", "spin_until", "now")

    def __init__(self, spin: bool) -> None:
        """``spin``: every local rank has a CPU of its own (the longer yield phase)."""
        self.start = self.now = time.monotonic()
        self.spin_until = self.start + (_YIELD if spin else _YIELD_SHARED)

    def pause(self) -> float:
        """Yield (the policy's first phase) or sleep (growing); the time now."""
        now = self.now = time.monotonic()
        if now < self.spin_until:
            os.sched_yield()
        else:
            time.sleep(min(_SLEEP_MAX, max(_SLEEP_MIN, (now - self.start) / WAIT_SLEEP_SHARE)))
        return now


def spin_until(ready: Callable[[], bool], spin: bool = True) -> bool:
    """Yield-poll ``ready()`` for the yield phase of :class:`Backoff` only; whether it became true
    (the caller then blocks on its own primitive: a queue, a future)."""
    if ready():
        return True
    end = time.monotonic() + (_YIELD if spin else _YIELD_SHARED)
    while time.monotonic() < end:
        os.sched_yield()
        if ready():
            return True
    return False


class Waiter:
    """One group's waiting: spin policy, liveness checks, the abort word and the timeout."""

    def __init__(self, seg: Segment, local: Sequence[int], peers: Dict[int, Any], rank: int, timeout: float,
                 spin: bool) -> None:
        """``peers``: local rank -> the :class:`~cpuddp.launchers.identity.PeerProcess` the
        hand-over met (the others' liveness is their lock on the segment alone)."""
        self.seg, self.local, self.rank, self.timeout = seg, tuple(local), rank, timeout
        self.peers = dict(peers)
        self.spin = spin

    def until(self, pending: Callable[[], bool], late: Callable[[], List[int]], what: str,
              poll: Callable[[], None]) -> None:
        """Return once ``pending()`` is false; ``late()`` names the local ranks not there yet.
        ``poll()`` runs while waiting (the agreement's early comparison); errors end the wait."""
        words = self.seg.words
        backoff = Backoff(self.spin)
        check_at, deadline = backoff.start + _CHECK, backoff.start + self.timeout
        while pending():
            if words[W_ABORT]:
                poll()  # a mismatch the peer found is this rank's error too
                self.check_abort()
            now = backoff.pause()
            if now >= check_at:
                check_at = now + _CHECK
                poll()
                self.check_peers(late(), what)
                if now > deadline:
                    raise self.timed_out(late(), what)

    def timed_out(self, late: List[int], what: str) -> Exception:
        """The error of a wait for local ranks ``late`` in ``what`` that ran out of time."""
        return dist.DistBackendError(
            f"shm: rank {self.rank} timed out after {self.timeout:g} s waiting for local rank(s) {late} in {what} "
            "(the group timeout; a peer is stuck or not calling the same collective)")

    def check_peers(self, late: List[int], what: str) -> None:
        lines = self.seg.lines
        for i in late:
            who = f"rank(s) [{self.local[i]}] (local rank {i}"
            if lines[i][C_STATE] == STATE_LEFT:
                raise dist.DistBackendError(
                    f"shm: {who}) left the group (cpuddp.shutdown() or destroy_process_group()) and lives on, "
                    f"while rank {self.rank} waited for it in {what}")
            proc = self.peers.get(i)
            if not self.seg.alive(i) or (proc is not None and not proc.alive()):
                pid_text = ("" if proc is None else f", pid {proc.pid}" if proc.pid else ", in another PID namespace")
                raise dist.DistBackendError(
                    f"shm: {who}{pid_text}) on this node died while rank {self.rank} waited for them in {what}")

    def check_abort(self) -> None:
        aborted = self.seg.words[W_ABORT]
        if not aborted:
            return
        if not 1 <= aborted <= len(self.local):  # no rank of the group wrote that: the header was overwritten
            raise dist.DistBackendError(
                f"shm: the shared-memory segment's header was overwritten (its abort word holds {aborted}, which "
                f"names none of the {len(self.local)} local ranks): something other than this group's ranks wrote "
                f"to its memory, what cannot be known (a process of this job's user can: docs/security.md); "
                f"rank {self.rank} stops")
        raise dist.DistBackendError(
            f"shm: local rank {aborted - 1} gave up (see its error); rank {self.rank} stops too")

    def abort(self, local_rank: int) -> None:
        """Tell the node's ranks that ``local_rank`` gave up (the first one to do so is kept)."""
        words = self.seg.words
        if not words[W_ABORT]:
            words[W_ABORT] = local_rank + 1
