"""``shm``: a shared-memory allreduce for the ranks of one node, gloo for everything else.

Use::

    import cpuddp
    cpuddp.init_distributed(backend="shm")          # or backend="auto" (see docs/backends.md)

    import cpuddp.shm                                # registers "shm" with torch.distributed
    torch.distributed.init_process_group("shm")      # plain torch, Trainer, Lightning, accelerate

Importing this module registers the backend with ``torch.distributed.Backend`` (idempotent).
``import cpuddp`` alone does not (it never imports torch); :func:`cpuddp.init_distributed`
imports this module when the chosen backend is ``shm``.

What goes through shared memory: ``allreduce`` of contiguous dense CPU tensors of float32,
float64, float16, bfloat16, int8, uint8, int16, int32 and int64 with SUM, AVG (floating
types; each rank divides by the world size as it copies in), PRODUCT, MIN and MAX.  The
result is bit-identical on every rank: each element is reduced in rank order by one code path.
Everything else -- other collectives, other ops and dtypes, sparse or non-contiguous tensors,
``allreduce_coalesced`` and any operation C++ dispatches directly -- runs on an inner
``ProcessGroupGloo`` over the same store, registered as the group's CPU backend.

Data path (one segment file per node and group, two buffers of one slot per rank, one
arrival counter per rank on its own cache line): per chunk of at most one slot, each rank
copies its chunk in, raises its counter, and waits until every local peer's counter reached
it; then

* 2 ranks on the node: each rank sums ``slot0 + slot1`` into its own tensor;
* 3 or more: rank ``i`` reduces part ``i`` of the chunk over all slots into its slot of the
  other buffer, a second counter round, then every rank copies all parts out
  (reduce-scatter / all-gather, so no rank reads every slot twice);
* several nodes (same number of ranks on each): the reduce-scatter above, one gloo allreduce
  of each rank's parts among the ranks with the same local rank on every node, then the
  all-gather through shared memory.

Waiting: ``os.sched_yield()`` for the first 2 ms (not at all when the node's ranks outnumber
the CPUs they may use), then 0.2 ms sleeps (no core burnt at 100% for minutes); every 0.1 s
the waiting rank checks that its local peers' processes are alive.  A peer that died, or that
gave up (it sets the segment's abort word), ends the wait with an error at once; otherwise the
group timeout does.  After an error the group is
broken: every later shared-memory allreduce raises at once.

Memory: the segment (``cpuddp.shm_check.reservation_bytes``: 4 MiB + 8 KiB for 2 ranks) is
reserved with ``posix_fallocate`` when the group forms, so a full ``/dev/shm`` is a clear
error then, never a SIGBUS later.  The file is unlinked as soon as every local rank has
mapped it; a file left by a creator that died before that is removed by the next group
formed on the host.

Environment variables read (see :mod:`cpuddp.shm_check`): ``CPUDDP_SHM_DIR``,
``CPUDDP_SHM_SLOT``.

The code: this module is the process group (torch's interface, the data path, the waiting);
:mod:`cpuddp._shm_segment` finds the node's ranks and creates, checks and maps the segment file;
:mod:`cpuddp.shm_check` says whether it can run here and how much it reserves.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from . import shm_check
from ._shm_segment import W_ABORT as _W_ABORT
from ._shm_segment import Segment, map_segment, plan_node, whoami
from .hosts import pid_alive

__all__ = ["NAME", "ShmProcessGroup", "register", "eligibility", "SUPPORTED_DTYPES"]

log = logging.getLogger("cpuddp.shm")

NAME = shm_check.NAME
eligibility = shm_check.eligibility

_RedOp = dist.ReduceOp.RedOpType
#: reduce op -> the torch function applied in rank order.  Keyed by ``opts.reduceOp.op``
#: (a RedOpType): a ``ReduceOp`` instance as key would never match and silently send all to gloo.
_REDUCE: dict[Any, Callable[..., torch.Tensor]] = {
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
#: How often a waiting rank checks that its local peers are alive.
_CHECK_EVERY = 0.1
#: Up to this many local ranks every rank reads every slot; above, reduce-scatter/all-gather.
_ALL_READ_MAX = 2


def _parts(n: int, parts: int, i: int) -> Tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


class ShmProcessGroup(dist.ProcessGroup):
    """The ``shm`` process group: shared-memory allreduce within a node, gloo for the rest."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._timeout = timeout.total_seconds()
        self._lock = threading.Lock()
        self._epoch = 0
        #: tensors all-reduced through shared memory so far (tests and benchmarks read it)
        self.shm_calls = 0
        self._broken: Optional[str] = None
        self._seg: Optional[Segment] = None
        self._cross: Optional[Any] = None
        self._spin_for = _YIELD_FOR
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.reason = self._setup(store, rank, size, timeout)
        if rank == 0:
            log.info("cpuddp.shm: group of %d: %s", size, self.reason)

    # ------------------------------------------------------------------ torch's interface

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return NAME

    def allreduce(self, tensors: Any, opts: Any = None, *, op: Any = None) -> Any:
        """Shared-memory allreduce when every tensor qualifies; gloo's otherwise."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None or not isinstance(opts, dist.AllreduceOptions):
            if opts is not None:  # allreduce(tensors, ReduceOp) as pybind's overload allows
                op = opts
            opts = dist.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)
        code = opts.reduceOp.op
        if not self._qualifies(tensors, code):
            return self._gloo.allreduce(tensors, opts)
        with self._lock:
            for t in tensors:
                self._run(t.view(-1), code)
                self.shm_calls += 1
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensors)
        return _create_work_from_future(fut)

    # ------------------------------------------------------------------ set-up

    def _setup(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> str:
        """Find the node's ranks through ``store``, map the node's segment; the mode's reason."""
        store.set(f"shm/who/{rank}", whoami())
        plan = plan_node([store.get(f"shm/who/{r}").decode().split("\t") for r in range(size)], rank)
        self._local_rank, self._local_size = plan.local_rank, plan.local_size
        self._node, self._nodes = plan.node, plan.nodes
        self._peer_pids = plan.peer_pids
        self._spin_for = _YIELD_FOR if plan.spin else 0.0
        if plan.gloo_only is not None:
            return plan.gloo_only
        self._seg = map_segment(store, rank, plan.local, plan.local_rank)
        if self._nodes > 1:
            cross = dist.PrefixStore(f"shm/cross/{self._local_rank}/", store)
            self._cross = dist.ProcessGroupGloo(cross, self._node, self._nodes, timeout)
            return (f"shared memory within each of {self._nodes} nodes ({self._local_size} ranks each), "
                    "gloo between them")
        return f"shared memory among {self._local_size} ranks"

    # ------------------------------------------------------------------ the data path

    def _qualifies(self, tensors: Sequence[Any], code: Any) -> bool:
        if self._seg is None or code not in _REDUCE:
            return False
        for t in tensors:
            if (not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided
                    or not t.is_contiguous() or t.dtype not in SUPPORTED_DTYPES
                    or (code == _RedOp.AVG and not t.dtype.is_floating_point)):
                return False
        return True

    def _run(self, flat: torch.Tensor, code: Any) -> None:
        if self._broken is not None:
            raise dist.DistBackendError(f"the shm process group is broken by an earlier error: {self._broken}")
        if flat.numel() == 0:
            return
        self._check_abort()
        try:
            if self._cross is not None:
                self._hierarchical(flat, code)
            elif self._local_size <= _ALL_READ_MAX:
                self._all_read(flat, code)
            else:
                self._scatter_gather(flat, code)
        except BaseException as exc:
            self._fail(str(exc))
            raise

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, code: Any) -> None:
        if code == _RedOp.AVG:
            torch.div(src, self.size(), out=dst)
        else:
            dst.copy_(src)

    def _chunks(self, flat: torch.Tensor) -> List[Tuple[int, int]]:
        cap = self._seg.slot // flat.element_size()  # type: ignore[union-attr]
        n = flat.numel()
        return [(o, min(cap, n - o)) for o in range(0, n, cap)]

    def _reduce_into(self, dst: torch.Tensor, parts: Sequence[torch.Tensor], code: Any) -> None:
        """``dst = parts[0] op parts[1] op ...`` in rank order (bit-identical wherever it runs)."""
        fn = _REDUCE[code]
        fn(parts[0], parts[1], out=dst)
        for p in parts[2:]:
            fn(dst, p, out=dst)

    def _all_read(self, flat: torch.Tensor, code: Any) -> None:
        slots = self._seg.slots(flat.dtype)  # type: ignore[union-attr]
        me = self._local_rank
        for o, k in self._chunks(flat):
            e = self._epoch + 1
            buf = slots[e & 1]
            self._copy_in(buf[me][:k], flat[o:o + k], code)
            self._sync(e)
            self._reduce_into(flat[o:o + k], [s[:k] for s in buf], code)
            self._epoch = e

    def _scatter_gather(self, flat: torch.Tensor, code: Any) -> None:
        slots = self._seg.slots(flat.dtype)  # type: ignore[union-attr]
        me, n = self._local_rank, self._local_size
        for o, k in self._chunks(flat):
            e = self._epoch + 1
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
            self._epoch = e + 1

    def _hierarchical(self, flat: torch.Tensor, code: Any) -> None:
        """Reduce-scatter in shared memory, gloo allreduce of the parts across nodes, all-gather."""
        slots = self._seg.slots(flat.dtype)  # type: ignore[union-attr]
        me, n = self._local_rank, self._local_size
        chunks = self._chunks(flat)
        spans = [_parts(k, n, me) for _, k in chunks]
        part = torch.empty(sum(hi - lo for lo, hi in spans), dtype=flat.dtype)
        pos = 0
        for (o, k), (lo, hi) in zip(chunks, spans):
            e = self._epoch + 1
            buf = slots[e & 1]
            self._copy_in(buf[me][:k], flat[o:o + k], code)
            self._sync(e)
            if hi > lo:
                self._reduce_into(part[pos:pos + hi - lo], [s[lo:hi] for s in buf], code)
            pos += hi - lo
            self._epoch = e
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if code == _RedOp.AVG else dist.ReduceOp(code)
        self._cross.allreduce([part], opts).wait()  # type: ignore[union-attr]
        pos = 0
        for (o, k), (lo, hi) in zip(chunks, spans):
            e = self._epoch + 1
            buf = slots[e & 1]
            buf[me][lo:hi].copy_(part[pos:pos + hi - lo])
            pos += hi - lo
            self._sync(e)
            for r in range(n):
                a, b = _parts(k, n, r)
                flat[o + a:o + b].copy_(buf[r][a:b])
            self._epoch = e

    # ------------------------------------------------------------------ waiting

    def _sync(self, epoch: int) -> None:
        """Announce arrival at ``epoch``; return once every local peer has arrived there."""
        seg = self._seg
        seg.mine.value = epoch  # type: ignore[union-attr]
        for c in seg.others:  # type: ignore[union-attr]
            if c.value < epoch:
                self._wait(epoch)
                return

    def _wait(self, epoch: int) -> None:
        seg = self._seg
        assert seg is not None
        others, words = seg.others, seg.words
        start = time.monotonic()
        spin_until, check_at = start + self._spin_for, start + _CHECK_EVERY
        deadline = start + self._timeout
        while True:
            if all(c.value >= epoch for c in others):
                return
            if words[_W_ABORT]:
                self._check_abort()
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            time.sleep(_SLEEP)
            if now >= check_at:
                check_at = now + _CHECK_EVERY
                dead = [r for r, pid in self._peer_pids.items() if not pid_alive(pid)]
                if dead:
                    raise dist.DistBackendError(
                        f"shm allreduce: rank(s) {dead} (pid {[self._peer_pids[r] for r in dead]}) on this node died "
                        f"while rank {self.rank()} waited for them")
                if now > deadline:
                    late = [i for i, c in enumerate(seg.counters) if c.value < epoch]
                    raise dist.DistBackendError(
                        f"shm allreduce: rank {self.rank()} timed out after {self._timeout:g} s waiting for local "
                        f"rank(s) {late} (the group timeout; a peer is stuck or not calling the same collective)")

    def _check_abort(self) -> None:
        aborted = self._seg.words[_W_ABORT]  # type: ignore[union-attr]
        if aborted:
            raise dist.DistBackendError(
                f"shm allreduce: local rank {aborted - 1} gave up (see its error); rank {self.rank()} stops too")

    def _fail(self, why: str) -> None:
        self._broken = why
        seg = self._seg
        if seg is not None and not seg.words[_W_ABORT]:
            seg.words[_W_ABORT] = self._local_rank + 1


#: The live groups of this process, for :func:`abort_groups`.
_groups: "weakref.WeakSet[ShmProcessGroup]" = weakref.WeakSet()


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ShmProcessGroup:
    group = ShmProcessGroup(store, rank, size, timeout)
    _groups.add(group)
    return group


def abort_groups(why: str) -> None:
    """Set the abort word of every shm group of this process: local peers waiting for this rank
    raise at once ("local rank N gave up").  The watchdog calls it when the rank raises, so the
    peers stop while this rank still reports its error, not when its process is gone."""
    for group in list(_groups):
        group._fail(why)


def register() -> None:
    """Register ``shm`` with ``torch.distributed`` (idempotent; done on import)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])


register()
