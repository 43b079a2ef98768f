"""``shm``: a shared-memory allreduce for the ranks of one node, gloo for everything else.

Use::

    import cpuddp
    cpuddp.init_distributed(backend="shm")          # or backend="auto" (see docs/backends.md)

    import cpuddp.shm                                # registers "shm" with torch.distributed
    torch.distributed.init_process_group("shm")      # plain torch, no pinning (frameworks: docs/frameworks.md)

Importing this module registers the backend with ``torch.distributed.Backend`` (idempotent).
``import cpuddp`` alone does not (it never imports torch); :func:`cpuddp.init_distributed`
imports this module when the chosen backend is ``shm``.  Hugging Face Trainer and accelerate
refuse backend names they do not know: there, call :func:`cpuddp.init_distributed` first
(docs/frameworks.md).

What goes through shared memory: ``allreduce`` of contiguous dense CPU tensors of float32,
float64, float16, bfloat16, int8, uint8, int16, int32 and int64 with SUM, AVG (floating
types; each rank divides by the world size as it copies in), PRODUCT, MIN and MAX.  The
result is bit-identical on every rank: each element is reduced in rank order by one code path.
Everything else -- other collectives, other ops and dtypes, sparse or non-contiguous tensors --
runs on an inner ``ProcessGroupGloo`` over the same store, called from Python (never through
torch's C++ fallback, which enters gloo holding the GIL and can deadlock with gloo's worker
freeing a Python-owned tensor: docs/backends.md).

Asynchronous: every collective returns its ``Work`` at once; a communication thread per group
does the work in issue order, so DDP's reducer goes on with backward while buckets are summed.
Before data moves the node's ranks agree on the call (:mod:`cpuddp.backends.shm.agree`: call number,
collective, op, dtype, element count, root, shared memory or gloo): a mismatch is an error on
every rank naming both calls, never a wrong result.  Errors surface from ``wait()``.

Data path (one anonymous segment per node and group, two buffers of one slot per rank, one
control line per rank): per chunk of at most one slot, each rank copies its chunk in, raises
its counter, and waits until every local peer's counter reached it; then

* 2 ranks on the node: each rank sums ``slot0 + slot1`` into its own tensor;
* 3 or more: rank ``i`` reduces part ``i`` of the chunk over all slots into its slot of the
  other buffer, a second counter round, then every rank copies all parts out;
* several nodes (same number of ranks on each): the reduce-scatter above, one allreduce of
  each rank's parts among the ranks with the same local rank on every node (gloo, or oneCCL
  when ``CPUDDP_SHM_INTER=ccl``), then the all-gather through shared memory.

Waiting: ``os.sched_yield()`` for the first 2 ms (not at all when the node's ranks outnumber
the CPUs they may use), then 0.2 ms sleeps; every 0.1 s the waiting rank checks that its local
peers live (the kernel-held lock of :meth:`cpuddp.backends.shm.segment.Segment.alive`, which works
across PID namespaces, and the pid where it is visible) and have not left the group.  A peer
that died, left (``shutdown``/``destroy_process_group``) or gave up (the abort word) ends the
wait with an error naming it at once; otherwise the group timeout does.  After an error the
group is broken: every later collective raises at once.

Security (docs/security.md): the segment is a ``memfd`` handed over a Unix socket whose peer
credentials are checked; nothing is mapped because a store value names it.

Environment variables read: ``CPUDDP_SHM_SLOT`` (:mod:`cpuddp.backends.shm.check`), ``CPUDDP_SHM_INTER``
(``gloo`` or ``ccl``: the node-to-node leg), ``CPUDDP_SHM_ASYNC`` (``0``: every collective in the
caller's thread).

The code: this module is the process group (torch's interface, the issue path, delegation);
:mod:`cpuddp.backends.shm.path` the data path and the waiting; :mod:`cpuddp.backends.shm.agree` the per-call
agreement; :mod:`cpuddp.backends.shm.segment` the node's ranks and the segment;
:mod:`cpuddp.backends.shm.check` whether it can run here and how much it reserves.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError

from . import check as shm_check
from .agree import Call, encode
from .path import SUPPORTED_DTYPES, DataPath
from .segment import C_STATE, STATE_LEFT, map_segment, parse_who, plan_node, whoami

__all__ = ["NAME", "ShmProcessGroup", "register", "eligibility", "SUPPORTED_DTYPES", "INTER_VAR"]

log = logging.getLogger("cpuddp.shm")

NAME = shm_check.NAME
eligibility = shm_check.eligibility
INTER_VAR = "CPUDDP_SHM_INTER"
_RedOp = dist.ReduceOp.RedOpType
_JOIN_TIMEOUT = 10.0
#: How long shutdown lets gloo's worker threads run on before it returns.  A worker drops its
#: last reference to a finished Work after the caller's wait() returned; a Work whose tensors'
#: Python objects it then frees needs the GIL, and at interpreter exit Python ends such a thread
#: inside a C++ destructor, which aborts the process ("terminate called without an active
#: exception", a rank killed by SIGABRT after its job is done).
_SETTLE = 0.05
#: An allreduce up to this size runs in the caller's thread when the stream is idle: the thread
#: hop costs more than overlap could win (DDP's buckets are 1 MiB and up).
_INLINE_BYTES = 64 << 10
#: ``CPUDDP_SHM_ASYNC=0`` runs every collective in the caller's thread (as before round 3).
ASYNC_VAR = "CPUDDP_SHM_ASYNC"


def _inline_bytes(environ: Any = os.environ) -> float:
    raw = (environ.get(ASYNC_VAR) or "1").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return _INLINE_BYTES
    if raw in ("0", "false", "no", "off"):
        return float("inf")
    raise BackendError(f"{ASYNC_VAR}={environ.get(ASYNC_VAR)!r} is neither 1 nor 0",
                       fix=f"set {ASYNC_VAR}=0 to run every shm collective in the caller's thread, or unset it")


def _root(opts: Any, args: Sequence[Any]) -> Optional[int]:
    root = getattr(opts, "rootRank", None)
    if root is None and len(args) > 1 and isinstance(args[1], int):
        root = args[1]
    return root


def _flat(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    return []


class _Work(dist.Work):
    """A collective queued on the communication thread: ``wait()`` raises its error (the Work torch
    makes from a future does not), ``get_future()`` is what DDP's reducer chains on."""

    def __init__(self, fut: "torch.futures.Future[Any]") -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0 and not self._fut.done():
            done = threading.Event()
            self._fut.add_done_callback(lambda _f: done.set())
            if not done.wait(timeout.total_seconds()):
                raise dist.DistBackendError(f"shm: the collective did not finish within {timeout}")
        self._fut.wait()  # raises the collective's error
        return True

    def get_future(self) -> "torch.futures.Future[Any]":
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def result(self) -> Any:
        return self._fut.value()


class _Stream:
    """One communication thread per group: agreement, then the work, in issue order.

    When nothing is queued, a call that gains nothing from the thread (a small allreduce, the
    agreement of a call handed to gloo) runs in the caller's thread instead: no thread hop."""

    def __init__(self, path: DataPath, rank: int) -> None:
        self._path = path
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._seq = 0
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"cpuddp-shm-comm-{rank}", daemon=True)
        self._thread.start()

    def shm(self, call: Call, fn: Callable[[], None], result: Any, inline: bool) -> "_Work":
        """A shared-memory allreduce: in this thread when ``inline`` and idle, else queued."""
        with self._lock:
            seq = self._next()
            if inline and self._pending == 0:
                self._inline(seq, call, fn, lazy=True)
                fut: torch.futures.Future = torch.futures.Future()
                fut.set_result(result)
                return _Work(fut)
            return self._queue(seq, call, fn, result, lazy=True)

    def gloo(self, call: Call, submit: Callable[[], Any], result: Any) -> Any:
        """A collective handed to gloo now (issue order = gloo's order), agreed before it counts."""
        with self._lock:
            work = submit()
            seq = self._next()
            if self._pending == 0 and not isinstance(work, list):
                self._inline(seq, call, lambda: None)
                return work
            return self._queue(seq, call, lambda: _wait_all(work), result)

    def _next(self) -> int:
        if self._closed:
            raise dist.DistBackendError("the shm process group was shut down")
        self._seq += 1
        return self._seq

    def _inline(self, seq: int, call: Call, fn: Callable[[], None], lazy: bool = False) -> None:
        try:
            self._path.agree(seq, call, lazy=lazy)
            fn()
            self._path.settle()
        except BaseException as exc:
            self._path.fail(str(exc))
            raise

    def _queue(self, seq: int, call: Call, fn: Callable[[], None], result: Any, lazy: bool = False) -> "_Work":
        fut: torch.futures.Future = torch.futures.Future()
        self._pending += 1
        self._q.put((seq, call, fn, result, fut, lazy))
        return _Work(fut)

    def _loop(self) -> None:
        path = self._path
        path.thread_setup()
        while True:
            item = self._q.get()
            if item is None:
                return
            seq, call, fn, result, fut, lazy = item
            error: Optional[BaseException] = None
            try:
                path.agree(seq, call, lazy=lazy)
                fn()
                path.settle()
            except BaseException as exc:  # every error reaches the caller's wait()
                path.fail(str(exc))
                error = exc
            with self._lock:
                self._pending -= 1
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error if isinstance(error, Exception) else dist.DistBackendError(str(error)))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._q.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT)


class ShmProcessGroup(dist.ProcessGroup):
    """The ``shm`` process group: shared-memory allreduce within a node, gloo for the rest."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._path: Optional[DataPath] = None
        self._stream: Optional[_Stream] = None
        self.reason = self._setup(store, rank, size, timeout)
        self._inline_bytes = _inline_bytes()
        if self._path is not None:
            self._stream = _Stream(self._path, rank)
        if rank == 0:
            log.info("cpuddp.shm: group of %d: %s", size, self.reason)

    @property
    def shm_calls(self) -> int:
        """Tensors all-reduced through shared memory so far (tests and benchmarks read it)."""
        return self._path.calls if self._path is not None else 0

    # ------------------------------------------------------------------ set-up

    def _setup(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> str:
        """Find the node's ranks through ``store``, map the node's segment; the mode's reason."""
        store.set(f"shm/who/{rank}", whoami())
        plan = plan_node([parse_who(store.get(f"shm/who/{r}"), f"shm/who/{r}") for r in range(size)], rank)
        if plan.gloo_only is not None:
            return plan.gloo_only
        seg = map_segment(store, rank, plan, timeout.total_seconds())
        cross = None
        if plan.nodes > 1:
            cross = _cross_group(dist.PrefixStore(f"shm/cross/{plan.local_rank}/", store), plan.node, plan.nodes,
                                 timeout)
        self._path = DataPath(seg, plan, rank, size, timeout.total_seconds(), cross)
        if cross is not None:
            return (f"shared memory within each of {plan.nodes} nodes ({plan.local_size} ranks each), "
                    f"{_inter()} between them")
        return f"shared memory among {plan.local_size} ranks"

    # ------------------------------------------------------------------ torch's interface

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return NAME

    def allreduce(self, tensors: Any, opts: Any = None, *, op: Any = None) -> Any:
        """Shared-memory allreduce when every tensor qualifies; gloo's otherwise (both agreed first)."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None or not isinstance(opts, dist.AllreduceOptions):
            if opts is not None:  # allreduce(tensors, ReduceOp) as pybind's overload allows
                op = opts
            opts = dist.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)
        code = opts.reduceOp.op
        path = self._path
        if path is not None and path.qualifies(tensors, code):
            call = encode("all_reduce", tensors, op=int(code), shm=True)
            inline = call.numel * tensors[0].element_size() <= self._inline_bytes
            return self._stream.shm(call, lambda: path.run(tensors, code), tensors, inline)  # type: ignore[union-attr]
        return self._delegate("all_reduce", tensors, lambda: self._gloo.allreduce(tensors, opts), tensors,
                              op=int(code))

    def _delegate(self, kind: str, described: Sequence[Any], submit: Callable[[], Any], result: Any = None,
                  *, op: Optional[int] = None, root: Optional[int] = None) -> Any:
        """Hand a collective to the inner gloo group: from Python (its binding releases the GIL),
        in issue order, agreed with the node's peers before its Work completes."""
        if self._stream is None:
            return submit()
        return self._stream.gloo(encode(kind, list(described), op=op, root=root), submit, result)

    # Every collective torch's C++ would otherwise run through its GIL-holding fallback:
    def broadcast(self, tensors: Any, *args: Any, **kw: Any) -> Any:
        ts = _flat(tensors)
        return self._delegate("broadcast", ts, lambda: self._gloo.broadcast(tensors, *args, **kw), ts,
                              root=_root(args[0] if args else kw.get("opts"), (tensors, *args)))

    def allgather(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        return self._delegate("all_gather", _flat(inputs), lambda: self._gloo.allgather(outputs, inputs, *args, **kw),
                              outputs)

    def allgather_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        return self._delegate("all_gather_coalesced", _flat(inputs),
                              lambda: self._gloo.allgather_coalesced(outputs, inputs, *args, **kw), outputs)

    def _allgather_base(self, output: Any, input: Any, *args: Any, **kw: Any) -> Any:  # noqa: A002
        return self._delegate("all_gather_into_tensor", [input],
                              lambda: self._gloo._allgather_base(output, input, *args, **kw), output)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        return self._delegate("all_gather_into_tensor_coalesced", _flat(inputs), lambda: [
            self._gloo._allgather_base(o, i, *args, **kw) for o, i in zip(outputs, inputs)], outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        rest = (opts, *args) if opts is not None else args
        return self._delegate("reduce_scatter", _flat(outputs),
                              lambda: self._gloo.reduce_scatter(outputs, inputs, *rest, **kw), outputs,
                              op=_op_of(opts))

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:  # noqa: A002
        rest = (opts, *args) if opts is not None else args
        return self._delegate("reduce_scatter_tensor", [output],
                              lambda: self._gloo._reduce_scatter_base(output, input, *rest, **kw), output,
                              op=_op_of(opts))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        rest = (opts, *args) if opts is not None else args
        return self._delegate("reduce_scatter_tensor_coalesced", _flat(outputs), lambda: [
            self._gloo._reduce_scatter_base(o, i, *rest, **kw) for o, i in zip(outputs, inputs)], outputs,
            op=_op_of(opts))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def allreduce_coalesced(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        rest = (opts, *args) if opts is not None else args
        return self._delegate("all_reduce_coalesced", _flat(tensors),
                              lambda: self._gloo.allreduce_coalesced(tensors, *rest, **kw), tensors, op=_op_of(opts))

    def barrier(self, *args: Any, **kw: Any) -> Any:
        return self._delegate("barrier", [], lambda: self._gloo.barrier(*args, **kw))

    def gather(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        rest = (opts, *args) if opts is not None else args
        return self._delegate("gather", _flat(inputs), lambda: self._gloo.gather(outputs, inputs, *rest, **kw),
                              outputs, root=_root(opts, ()))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        rest = (opts, *args) if opts is not None else args
        return self._delegate("scatter", _flat(outputs), lambda: self._gloo.scatter(outputs, inputs, *rest, **kw),
                              outputs, root=_root(opts, ()))

    def reduce(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        rest = (opts, *args) if opts is not None else args
        return self._delegate("reduce", _flat(tensors), lambda: self._gloo.reduce(tensors, *rest, **kw), tensors,
                              op=_op_of(opts), root=_root(opts, ()))

    def alltoall(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        return self._delegate("all_to_all", [], lambda: self._gloo.alltoall(outputs, inputs, *args, **kw), outputs)

    def alltoall_base(self, output: Any, input: Any, *args: Any, **kw: Any) -> Any:  # noqa: A002
        return self._delegate("all_to_all_single", [],
                              lambda: self._gloo.alltoall_base(output, input, *args, **kw), output)

    all_to_all_single = alltoall_base

    # point-to-point: two ranks, not the node's agreement; straight to gloo (GIL released)
    def send(self, *args: Any, **kw: Any) -> Any:
        return self._gloo.send(*args, **kw)

    def recv(self, *args: Any, **kw: Any) -> Any:
        return self._gloo.recv(*args, **kw)

    def recv_anysource(self, *args: Any, **kw: Any) -> Any:
        return self._gloo.recv_anysource(*args, **kw)

    # ------------------------------------------------------------------ teardown

    def leave(self) -> None:
        """Mark this rank as gone from the group (peers waiting for it stop at once), join the thread."""
        stream, self._stream = self._stream, None
        if self._path is not None:
            self._path.seg.lines[self._path.local_rank][C_STATE] = STATE_LEFT
        if stream is not None:
            stream.close()

    def shutdown(self) -> None:  # torch's destroy_process_group calls it
        self.leave()
        try:
            super().shutdown()
        except Exception as exc:  # noqa: BLE001 - teardown of gloo must not raise over a finished job
            log.debug("cpuddp.shm: gloo shutdown raised: %s", exc)
        time.sleep(_SETTLE)  # gloo's workers release their last Works while Python still runs

    def abort(self) -> None:
        self.leave()
        try:
            super().abort()
        except Exception as exc:  # noqa: BLE001
            log.debug("cpuddp.shm: gloo abort raised: %s", exc)

    def _fail(self, why: str) -> None:
        if self._path is not None:
            self._path.fail(why)


def _op_of(opts: Any) -> Optional[int]:
    op = getattr(opts, "reduceOp", None)
    return int(op.op) if op is not None else None


def _wait_all(work: Any) -> None:
    for w in work if isinstance(work, list) else [work]:
        w.wait()


def _inter() -> str:
    value = (os.environ.get(INTER_VAR) or "gloo").strip().lower()
    if value not in ("gloo", "ccl"):
        raise BackendError(f"{INTER_VAR}={os.environ.get(INTER_VAR)!r} is not a node-to-node backend of the shm group",
                           fix=f"set {INTER_VAR}=gloo or {INTER_VAR}=ccl, or unset it")
    return value


def _cross_group(store: Any, node: int, nodes: int, timeout: datetime.timedelta) -> Any:
    """The group of the ranks with this local rank on every node: gloo, or oneCCL when asked."""
    if _inter() == "ccl":
        import oneccl_bindings_for_pytorch  # noqa: F401  (registers "ccl")

        plugin = dist.Backend._plugins.get("CCL")
        if plugin is None:
            raise BackendError(f"{INTER_VAR}=ccl, but the oneCCL bindings registered no 'ccl' backend",
                               fix=f"unset {INTER_VAR} (gloo between nodes), or install working oneCCL bindings")
        return plugin.creator_fn(store, node, nodes, timeout)
    return dist.ProcessGroupGloo(store, node, nodes, timeout)


#: The live groups of this process, for :func:`abort_groups` and :func:`leave_groups`.
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


def leave_groups() -> None:
    """Mark every shm group of this process as left (``cpuddp.shutdown`` calls it first)."""
    for group in list(_groups):
        group.leave()


def register() -> None:
    """Register ``shm`` with ``torch.distributed`` (idempotent; done on import)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])


register()
