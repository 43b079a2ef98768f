"""Waiting for the node's other ranks, for the shm group (:mod:`cpuddp.backends.shm.python.local`), and
the one wait policy of the shm backend (:class:`Backoff`, :func:`spin_until`; the group's
communication thread and its Works use it too, :mod:`cpuddp.backends.shm.routes.stream`).

:meth:`Waiter.until` returns once no local peer is late, and ends at once with an error naming
the peer that died, left the group or gave up (the segment's abort word), and at the group
timeout otherwise.  How it waits, and why:

* ``os.sched_yield()`` polling for the first :data:`YIELD_FOR` (2 ms) when every local rank has
  a CPU of its own -- on every thread, the communication thread included (it runs only where
  the plan left a CPU free for it).  A peer's arrival is seen within a microsecond or two, and
  the yield hands the CPU to any other thread that wants it.  Not at all when the node's ranks
  outnumber their CPUs: a spinning rank would hold the CPU the peer it waits for needs (4 ranks
  on 2 CPUs took 0.5 s for 4 MiB with a 50 ms spin).
* then sleeps that grow with the wait: each at most 1/8 of the time waited so far, from
  :data:`SLEEP_FIRST` up to :data:`SLEEP_MAX` (2 ms).  A sleep costs at most ~1/8 more than
  the wait it ends (a fixed 0.2 ms sleep -- ~0.26 ms with the kernel's timer slack -- could cost
  a rank that arrived first several times the copy it waited for), and a wait of seconds for a
  late peer wakes ~450 times a second, not ~2,500 (``benchmarks/wait_cost.py``).
* every 0.1 s, a check that each late peer lives (the kernel-held lock of
  :meth:`cpuddp.backends.shm.protocol.segment.Segment.alive`, which works across PID namespaces, and
  its pid where it is visible) and has not left the group.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Sequence

import torch.distributed as dist

from .segment import C_STATE, STATE_LEFT, W_ABORT, Segment

__all__ = ["Waiter", "Backoff", "spin_until", "YIELD_FOR", "SLEEP_FIRST", "SLEEP_MAX", "CHECK_EVERY"]

YIELD_FOR = 0.002
SLEEP_FIRST = 2e-5
SLEEP_MAX = 0.002
CHECK_EVERY = 0.1


class Backoff:
    """The wait policy: :meth:`pause` once per look at a condition that did not hold yet."""

    __slots__ = ("start", "spin_until", "now")

    def __init__(self, spin: bool) -> None:
        self.start = self.now = time.monotonic()
        self.spin_until = self.start + (YIELD_FOR if spin else 0.0)

    def pause(self) -> float:
        """Yield (the first 2 ms, when spinning is right) or sleep (growing); the time now."""
        now = self.now = time.monotonic()
        if now < self.spin_until:
            os.sched_yield()
        else:
            time.sleep(min(SLEEP_MAX, max(SLEEP_FIRST, (now - self.start) / 8)))
        return now


def spin_until(ready: Callable[[], bool], spin: bool = True) -> bool:
    """Yield-poll ``ready()`` for the spin phase of :class:`Backoff` only; whether it became true
    (the caller then blocks on its own primitive: a queue, a future)."""
    if ready():
        return True
    if not spin:
        return False
    end = time.monotonic() + YIELD_FOR
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
        check_at, deadline = backoff.start + CHECK_EVERY, backoff.start + self.timeout
        while pending():
            if words[W_ABORT]:
                poll()  # a mismatch the peer found is this rank's error too
                self.check_abort()
            now = backoff.pause()
            if now >= check_at:
                check_at = now + CHECK_EVERY
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
        if aborted:
            raise dist.DistBackendError(
                f"shm: local rank {aborted - 1} gave up (see its error); rank {self.rank} stops too")

    def abort(self, local_rank: int) -> None:
        """Tell the node's ranks that ``local_rank`` gave up (the first one to do so is kept)."""
        words = self.seg.words
        if not words[W_ABORT]:
            words[W_ABORT] = local_rank + 1
