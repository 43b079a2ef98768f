"""The data path of the shm group (:mod:`cpuddp.backends.shm.group`), run on the group's
communication thread: agreement, copy-in, the rank-order reduction, copy-out, and the waiting
between them.

See the group's module for the algorithm; :class:`DataPath` holds one group's segment and node
plan, and every wait goes through :meth:`DataPath.wait_for`, which ends at once with an error
naming the peer that died, left the group or gave up, and at the group timeout otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from cpuddp.launchers.hosts import pid_alive

from . import check as shm_check
from .agree import Call, Ring, describe
from .segment import C_CHECKED, C_STATE, STATE_LEFT, W_ABORT, NodePlan, Segment

log = logging.getLogger("cpuddp.shm")

_RedOp = dist.ReduceOp.RedOpType
#: reduce op -> the torch function applied in rank order.  Keyed by ``opts.reduceOp.op``
#: (a RedOpType): a ``ReduceOp`` instance as key would never match and silently send all to gloo.
REDUCE: Dict[Any, Callable[..., torch.Tensor]] = {
    _RedOp.SUM: torch.add,
    _RedOp.AVG: torch.add,
    _RedOp.PRODUCT: torch.mul,
    _RedOp.MIN: torch.minimum,
    _RedOp.MAX: torch.maximum,
}
SUPPORTED_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
})

#: Spin with sched_yield this long, then sleep between checks.  Not at all when the node's
#: ranks outnumber their CPUs: a spinning rank would hold the core the peer it waits for needs
#: (measured: 4 ranks on 2 vCPUs, 4 MiB took 0.5 s with a 50 ms spin).
_YIELD_FOR = 0.002
_SLEEP = 2e-4
#: The communication thread shares its cores with backward: it yields only this long, then sleeps
#: (a 2 ms yield-spin there cost DDP 0.79x gloo; none at all tripled a lone 1 MiB allreduce).
_COMM_YIELD_FOR = 1e-4
#: How often a waiting rank checks that its local peers are alive and still in the group.
_CHECK_EVERY = 0.1
#: Up to this many local ranks every rank reads every slot; above, reduce-scatter/all-gather.
_ALL_READ_MAX = 2


def _parts(n: int, parts: int, i: int) -> Tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


def _single_threaded_ops() -> None:
    """Make this thread's torch ops use one OpenMP thread (its own ICV; the compute threads keep
    theirs).  Best effort: where the OpenMP runtime is not reachable, nothing changes."""
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except (AttributeError, OSError):
        log.debug("cpuddp.shm: omp_set_num_threads not reachable from the communication thread")


class DataPath:
    """One group's shared-memory allreduce and waiting (used by its communication thread only)."""

    def __init__(self, seg: Segment, plan: NodePlan, rank: int, size: int, timeout: float,
                 cross: Optional[Any]) -> None:
        self.seg, self.rank, self.size = seg, rank, size
        self.local, self.local_rank, self.local_size = plan.local, plan.local_rank, plan.local_size
        self.peer_pids = {plan.local.index(r): pid for r, pid in plan.peer_pids.items()}
        self.timeout = timeout
        self.cross = cross
        self.spin_for = _YIELD_FOR if plan.spin else 0.0
        self.ring = Ring(seg)
        self.epoch = 0
        self.calls = 0
        self.broken: Optional[str] = None
        self._unchecked: Optional[Tuple[int, Call]] = None  # posted, not yet compared
        self._comm_thread: Optional[int] = None

    def thread_setup(self) -> None:
        """On the communication thread: one OpenMP thread for its ops; no yield-spinning while it
        shares its CPUs with the compute threads (a spin would take the core backward needs)."""
        _single_threaded_ops()
        self._comm_thread = threading.get_ident()

    # ------------------------------------------------------------------ agreement

    def agree(self, seq: int, call: Call, *, lazy: bool = False) -> None:
        """Post call ``seq``; unless ``lazy``, wait for every local peer's and compare (raises on a
        mismatch).  ``lazy`` (a shared-memory allreduce): the comparison happens at the call's
        first arrival round, before anything is reduced -- one synchronisation instead of two."""
        if self.broken is not None:
            raise dist.DistBackendError(f"the shm process group is broken by an earlier error: {self.broken}")
        self.check_abort()  # a peer gave up: its data in the slots may be from a call it abandoned
        ring, lines, me = self.ring, self.seg.lines, self.local_rank
        if not ring.slot_free(seq):
            need = seq - shm_check.RING
            self.wait_for(lambda: [i for i, ln in enumerate(lines) if i != me and ln[C_CHECKED] < need],
                          f"call #{seq - shm_check.RING} to be checked")
        ring.post(seq, call)
        self._unchecked = (seq, call)
        if not lazy:
            self.settle()

    def settle(self) -> None:
        """Finish a posted call's agreement: wait until every local peer posted it, compare."""
        if self._unchecked is None:
            return
        seq, call = self._unchecked
        if self.ring.late(seq):
            self.wait_for(lambda: self.ring.late(seq), f"collective call #{seq} ({describe(call.words())})")
        self._unchecked = None
        self.ring.compare(seq, call, self.local)

    def _compare_if_posted(self) -> None:
        """While waiting: a peer that posted a different call (one that will never arrive here,
        e.g. it went to gloo) is a mismatch now, not at the timeout."""
        if self._unchecked is not None and not self.ring.late(self._unchecked[0]):
            self.settle()

    # ------------------------------------------------------------------ the data path

    def qualifies(self, tensors: Sequence[Any], code: Any) -> bool:
        if code not in REDUCE:
            return False
        for t in tensors:
            if (not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided
                    or not t.is_contiguous() or t.dtype not in SUPPORTED_DTYPES
                    or (code == _RedOp.AVG and not t.dtype.is_floating_point)):
                return False
        return True

    def run(self, tensors: Sequence[torch.Tensor], code: Any) -> None:
        for t in tensors:
            flat = t.view(-1)
            if flat.numel():
                if self.cross is not None:
                    self._hierarchical(flat, code)
                elif self.local_size <= _ALL_READ_MAX:
                    self._all_read(flat, code)
                else:
                    self._scatter_gather(flat, code)
            self.calls += 1

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, code: Any) -> None:
        if code == _RedOp.AVG:
            torch.div(src, self.size, out=dst)
        else:
            dst.copy_(src)

    def _chunks(self, flat: torch.Tensor) -> List[Tuple[int, int]]:
        cap = self.seg.slot // flat.element_size()
        n = flat.numel()
        return [(o, min(cap, n - o)) for o in range(0, n, cap)]

    @staticmethod
    def _reduce_into(dst: torch.Tensor, parts: Sequence[torch.Tensor], code: Any) -> None:
        """``dst = parts[0] op parts[1] op ...`` in rank order (bit-identical wherever it runs)."""
        fn = REDUCE[code]
        fn(parts[0], parts[1], out=dst)
        for p in parts[2:]:
            fn(dst, p, out=dst)

    def _all_read(self, flat: torch.Tensor, code: Any) -> None:
        slots = self.seg.slots(flat.dtype)
        me = self.local_rank
        for o, k in self._chunks(flat):
            e = self.epoch + 1
            buf = slots[e & 1]
            self._copy_in(buf[me][:k], flat[o:o + k], code)
            self._sync(e)
            self._reduce_into(flat[o:o + k], [s[:k] for s in buf], code)
            self.epoch = e

    def _scatter_gather(self, flat: torch.Tensor, code: Any) -> None:
        slots = self.seg.slots(flat.dtype)
        me, n = self.local_rank, self.local_size
        for o, k in self._chunks(flat):
            e = self.epoch + 1
            src, out = slots[e & 1], slots[(e + 1) & 1]
            self._copy_in(src[me][:k], flat[o:o + k], code)
            self._sync(e)
            lo, hi = _parts(k, n, me)
            if hi > lo:
                self._reduce_into(out[me][lo:hi], [s[lo:hi] for s in src], code)
            self._sync(e + 1)
            for r in range(n):
                lo, hi = _parts(k, n, r)
                flat[o + lo:o + hi].copy_(out[r][lo:hi])
            self.epoch = e + 1

    def _hierarchical(self, flat: torch.Tensor, code: Any) -> None:
        """Reduce-scatter in shared memory, an allreduce of the parts across nodes, all-gather."""
        slots = self.seg.slots(flat.dtype)
        me, n = self.local_rank, self.local_size
        chunks = self._chunks(flat)
        spans = [_parts(k, n, me) for _, k in chunks]
        part = torch.empty(sum(hi - lo for lo, hi in spans), dtype=flat.dtype)
        pos = 0
        for (o, k), (lo, hi) in zip(chunks, spans):
            e = self.epoch + 1
            buf = slots[e & 1]
            self._copy_in(buf[me][:k], flat[o:o + k], code)
            self._sync(e)
            if hi > lo:
                self._reduce_into(part[pos:pos + hi - lo], [s[lo:hi] for s in buf], code)
            pos += hi - lo
            self.epoch = e
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if code == _RedOp.AVG else dist.ReduceOp(code)
        self.cross.allreduce([part], opts).wait()  # type: ignore[union-attr]
        pos = 0
        for (o, k), (lo, hi) in zip(chunks, spans):
            e = self.epoch + 1
            buf = slots[e & 1]
            buf[me][lo:hi].copy_(part[pos:pos + hi - lo])
            pos += hi - lo
            self._sync(e)
            for r in range(n):
                a, b = _parts(k, n, r)
                flat[o + a:o + b].copy_(buf[r][a:b])
            self.epoch = e

    # ------------------------------------------------------------------ waiting

    def _sync(self, epoch: int) -> None:
        """Announce arrival at ``epoch``; return once every local peer has arrived there."""
        seg = self.seg
        seg.mine.value = epoch
        for c in seg.others:
            if c.value < epoch:
                counters = seg.counters
                self.wait_for(lambda: [i for i, x in enumerate(counters) if x.value < epoch],
                              f"the shared-memory allreduce (step {epoch})")
                break
        if self._unchecked is not None:  # every peer arrived, so every peer posted: compare first
            self.settle()

    def wait_for(self, late: Callable[[], List[int]], what: str) -> None:
        """Return once ``late()`` (the local ranks not there yet) is empty; raise at once when one of
        them died, left the group or gave up, and at the group timeout otherwise."""
        words = self.seg.words
        start = time.monotonic()
        spin = min(self.spin_for, _COMM_YIELD_FOR) if threading.get_ident() == self._comm_thread else self.spin_for
        spin_until, check_at = start + spin, start + _CHECK_EVERY
        deadline = start + self.timeout
        while True:
            if not late():
                return
            if words[W_ABORT]:
                self._compare_if_posted()  # a mismatch the peer found is this rank's error too
                self.check_abort()
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            time.sleep(_SLEEP)
            if now >= check_at:
                check_at = now + _CHECK_EVERY
                self._compare_if_posted()
                self._check_peers(late(), what)
                if now > deadline:
                    raise dist.DistBackendError(
                        f"shm: rank {self.rank} timed out after {self.timeout:g} s waiting for local rank(s) "
                        f"{late()} in {what} (the group timeout; a peer is stuck or not calling the same "
                        "collective)")

    def _check_peers(self, late: List[int], what: str) -> None:
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

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        words = self.seg.words
        if not words[W_ABORT]:
            words[W_ABORT] = self.local_rank + 1
