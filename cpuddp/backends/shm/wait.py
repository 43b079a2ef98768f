"""Waiting for the node's other ranks, for the shm group (:mod:`cpuddp.backends.shm.local`).

:meth:`Waiter.until` returns once no local peer is late, and ends at once with an error naming
the peer that died, left the group or gave up (the segment's abort word), and at the group
timeout otherwise.  How it waits, and why:

* ``os.sched_yield()`` for the first 2 ms when every local rank has a CPU of its own (a
  rank's arrival is seen within a microsecond or two; the yield hands the CPU to any other
  thread that wants it), 0.1 ms on the group's communication thread (it shares its CPU with
  the compute threads), and not at all when the node's ranks outnumber their CPUs (a spinning
  rank would hold the CPU the peer it waits for needs: 4 ranks on 2 CPUs took 0.5 s for
  4 MiB with a 50 ms spin);
* then 0.2 ms sleeps;
* every 0.1 s, a check that each late peer lives (the kernel-held lock of
  :meth:`cpuddp.backends.shm.segment.Segment.alive`, which works across PID namespaces, and
  its pid where it is visible) and has not left the group.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from cpuddp.topology.here import pid_alive

from .segment import C_STATE, STATE_LEFT, W_ABORT, Segment

__all__ = ["Waiter", "YIELD_FOR", "SLEEP", "CHECK_EVERY"]

YIELD_FOR = 0.002
COMM_YIELD_FOR = 1e-4
SLEEP = 2e-4
CHECK_EVERY = 0.1


class Waiter:
    """One group's waiting: spin policy, liveness checks, the abort word and the timeout."""

    def __init__(self, seg: Segment, local: Sequence[int], peer_pids: Dict[int, int], rank: int, timeout: float,
                 spin: bool) -> None:
        self.seg, self.local, self.rank, self.timeout = seg, tuple(local), rank, timeout
        self.peer_pids = {self.local.index(r): pid for r, pid in peer_pids.items()}
        self.spin_for = YIELD_FOR if spin else 0.0
        self.comm_thread: Optional[int] = None

    def until(self, late: Callable[[], List[int]], what: str, poll: Callable[[], None]) -> None:
        """Return once ``late()`` (the local ranks not there yet) is empty.  ``poll()`` runs while
        waiting (the agreement's early comparison); errors end the wait."""
        words = self.seg.words
        start = time.monotonic()
        spin = min(self.spin_for, COMM_YIELD_FOR) if threading.get_ident() == self.comm_thread else self.spin_for
        spin_until, check_at, deadline = start + spin, start + CHECK_EVERY, start + self.timeout
        while late():
            if words[W_ABORT]:
                poll()  # a mismatch the peer found is this rank's error too
                self.check_abort()
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            time.sleep(SLEEP)
            if now >= check_at:
                check_at = now + CHECK_EVERY
                poll()
                self.check_peers(late(), what)
                if now > deadline:
                    raise dist.DistBackendError(
                        f"shm: rank {self.rank} timed out after {self.timeout:g} s waiting for local rank(s) "
                        f"{late()} in {what} (the group timeout; a peer is stuck or not calling the same "
                        "collective)")

    def check_peers(self, late: List[int], what: str) -> None:
        lines = self.seg.lines
        for i in late:
            who = f"rank(s) [{self.local[i]}] (local rank {i}"
            if lines[i][C_STATE] == STATE_LEFT:
                raise dist.DistBackendError(
                    f"shm: {who}) left the group (cpuddp.shutdown() or destroy_process_group()) and lives on, "
                    f"while rank {self.rank} waited for it in {what}")
            pid = self.peer_pids.get(i)
            if not self.seg.alive(i) or (pid is not None and not pid_alive(pid)):
                pid_text = f", pid {pid}" if pid is not None else ", in another PID namespace"
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
