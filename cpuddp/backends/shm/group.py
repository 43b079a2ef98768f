"""``shm``: cpuddp's process group -- every collective between the ranks of a node through
shared memory, nothing between them through sockets anyone else can reach.

Use::

    import cpuddp
    cpuddp.init_distributed(backend="shm")          # or backend="auto" (see docs/backends.md)

    import cpuddp.shm                                # registers "shm" with torch.distributed
    torch.distributed.init_process_group("shm")      # plain torch, no pinning (frameworks: docs/frameworks.md)

What it does: all_reduce (and its coalesced form), reduce, broadcast, all_gather (list, single
tensor and coalesced forms, the torch 2.13 names ``all_gather_single*`` and the old ones),
reduce_scatter (likewise ``reduce_scatter_single*``), gather, scatter, all_to_all and
all_to_all_single, barrier, and send/recv, for dense CPU tensors of any layout (a strided
tensor goes through a contiguous staging copy and back) -- through the node's shared segment
(:mod:`cpuddp.backends.shm.local`) and, between the node's ranks, its sockets for send/recv
(:mod:`cpuddp.backends.shm.p2p`).  Across nodes: shared memory inside each node and gloo (or
oneCCL) between them (:mod:`cpuddp.backends.shm.cross`).  Nodes that run different numbers of
ranks, or one rank each, run every collective on gloo (the reason is logged).

Every collective is agreed first (:mod:`cpuddp.backends.shm.agree`): a mismatch between the
node's ranks is an error on every rank naming both calls, never a wrong result.  Errors raise
from the call (or its ``wait()``), and break the group: later calls raise at once.

The group's torch-side name needs a backend object registered for the CPU; it is a
``FakeProcessGroup`` that raises if anything calls it (nothing does: every path torch has --
its Python API, DDP's reducer, functional collectives, FSDP2, DCP -- reaches these methods).

Lifecycle: ``shutdown``/``destroy_process_group`` and ``cpuddp.shutdown`` leave the group
(peers waiting for this rank stop at once); any use after that raises
:class:`~cpuddp.errors.GroupShutDownError`; a forked child can neither use its parent's group
nor leave it (:mod:`cpuddp.backends.shm.segment`).  Each group forms under a key prefix of its
own in the store (``shm/<n>/``, n counting this rank's groups), so a group formed again in the
same processes never reads a key the last one left.

Options: :class:`~cpuddp.backends.shm.api.ShmOptions` as ``pg_options``; without them
``CPUDDP_SHM_INTER``, ``CPUDDP_SHM_ASYNC`` and ``CPUDDP_SHM_SLOT`` are read.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError, GroupShutDownError

from . import api
from . import check as shm_check
from .agree import encode
from .cross import Hierarchy, cross_group
from .handover import map_segment
from .local import LocalEngine
from .node import NodePlan, check_local_size, parse_who, plan_node, whoami
from .ops import AVG, SUM, check_tensors, flat_bytes, reducer, staged
from .p2p import PeerLinks
from .segment import C_STATE, STATE_LEFT
from .stream import Stream, async_setting
from .wait import Waiter

__all__ = ["NAME", "ShmProcessGroup", "register", "eligibility"]

log = logging.getLogger("cpuddp.shm")

NAME = shm_check.NAME
eligibility = shm_check.eligibility
#: How long shutdown lets gloo's worker threads run on before it returns (multi-node groups).
#: A worker drops its last reference to a finished Work after the caller's wait() returned; a
#: Work whose tensors' Python objects it then frees needs the GIL, and at interpreter exit
#: Python ends such a thread inside a C++ destructor, which aborts the process.
_SETTLE = 0.05


def _name_holder(rank: int, size: int) -> Any:
    """A backend object for the group's name (torch keeps it there); it raises if called."""
    from torch._C._distributed_c10d import FakeProcessGroup

    opts = FakeProcessGroup.Options()
    if hasattr(opts, "error_on_collective"):
        opts.error_on_collective = True
    create = getattr(FakeProcessGroup, "_create_internal", None)
    return create(rank, size, opts) if create is not None else FakeProcessGroup(rank, size, opts)


class ShmProcessGroup(dist.ProcessGroup):
    """The ``shm`` process group (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                 options: Optional[api.ShmOptions] = None) -> None:
        super().__init__(rank, size)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, _name_holder(rank, size))
        self._options = options or api.ShmOptions.from_environ(size)
        self._timeout = timeout
        self._closed: Optional[str] = None
        self._pid = os.getpid()
        self._eng: Optional[LocalEngine] = None
        self._hier: Optional[Hierarchy] = None
        self._links: Optional[PeerLinks] = None
        self._world: Any = None  # gloo over every rank: across nodes only (all_to_all, send/recv)
        self._plan: Optional[NodePlan] = None
        self.reason = self._setup(store, rank, size, timeout)
        threaded = self._eng is not None and async_setting(self._options.async_comm)
        self._stream = Stream(rank, threaded, self._on_error, self._thread_setup)
        api.track(self)
        if rank == 0:
            log.info("cpuddp.shm: group of %d: %s", size, self.reason)

    # ------------------------------------------------------------------ set-up

    def _setup(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> str:
        """Find the node's ranks through ``store``, map the node's segment; the mode's reason."""
        store = dist.PrefixStore(f"shm/{store.add(f'shm/joins/{rank}', 1)}/", store)
        store.set(f"who/{rank}", whoami())
        plan = plan_node([parse_who(store.get(f"who/{r}"), f"who/{r}") for r in range(size)], rank)
        check_local_size(plan, self._options.local_size, rank)
        self._plan = plan
        if plan.whole_gloo is not None:
            self._world = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
            return plan.whole_gloo
        seconds = timeout.total_seconds()
        seg, socks = map_segment(store, rank, plan, seconds, shm_check.slot_bytes(os.environ))
        waiter = Waiter(seg, plan.local, plan.peer_pids, rank, seconds, plan.spin)
        self._eng = LocalEngine(seg, plan.local, rank, waiter)
        self._links = PeerLinks({plan.local[j]: s for j, s in socks.items()}, rank)
        if plan.nodes == 1:
            return f"shared memory among {plan.local_size} ranks"
        cross = cross_group(dist.PrefixStore(f"cross/{plan.local_rank}/", store), plan, timeout, self._options.inter)
        self._hier = Hierarchy(self._eng, plan, cross)
        self._world = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        return (f"shared memory within each of {plan.nodes} nodes ({plan.local_size} ranks each), "
                f"{self._options.inter} between them")

    def _thread_setup(self) -> None:
        """On the communication thread: its ops use one OpenMP thread; it yields only briefly."""
        import ctypes
        import threading

        with contextlib.suppress(AttributeError, OSError):
            ctypes.CDLL(None).omp_set_num_threads(1)
        if self._eng is not None:
            self._eng.waiter.comm_thread = threading.get_ident()

    @property
    def shm_calls(self) -> int:
        """Collectives agreed through shared memory so far (tests and benchmarks read it)."""
        return self._eng.calls if self._eng is not None else 0

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return NAME

    # ------------------------------------------------------------------ running a call

    def _usable(self) -> None:
        if self._closed is not None:
            raise GroupShutDownError(f"this shm process group was {self._closed}: it cannot run collectives any "
                                     "more", fix="use the group of a new init (cpuddp.init_distributed()), and "
                                                 "wrap the model again (cpuddp.prepare or DDP) after a re-init")
        if os.getpid() != self._pid:
            raise GroupShutDownError(f"this process (pid {os.getpid()}) is a fork of rank {self.rank()} (pid "
                                     f"{self._pid}): a forked child cannot use its parent's process group",
                                     fix="run collectives in the parent only (DataLoader workers need none)")

    def _run(self, kind: str, agreed: Sequence[torch.Tensor], body: Callable[[], None], result: Any, *,
             op: Any = None, root: Optional[int] = None, check: Sequence[Any] = ()) -> Any:
        """Agree on the call, then run ``body`` (in this thread or the group's)."""
        self._usable()
        check_tensors(check or agreed, kind)
        call = encode(kind, agreed, op=None if op is None else int(op), root=root)
        eng = self._eng

        def run() -> None:
            eng.begin(call)  # type: ignore[union-attr]
            body()

        nbytes = sum(t.numel() * t.element_size() for t in agreed)
        return self._stream.run(run, result, nbytes)

    def _on_error(self, exc: BaseException) -> None:
        if self._eng is not None:
            self._eng.fail(str(exc))

    def _local(self, rank: int) -> int:
        """This node's local rank of group rank ``rank`` (single-node groups)."""
        if not 0 <= rank < self.size():
            raise BackendError(f"root/peer rank {rank} is not a rank of this group of {self.size()}",
                               fix=f"pass a rank from 0 to {self.size() - 1}")
        return self._plan.local.index(rank)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ all_reduce, reduce

    def allreduce(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        tensors, code = _one_list(tensors, "all_reduce"), _op(opts, args, kw, "op")
        if self._eng is None:
            return self._world.allreduce(tensors, _opts(dist.AllreduceOptions, reduceOp=code))
        t = tensors[0]
        fn = reducer(code, t.dtype)

        def body() -> None:
            with staged(t, out=True) as flat:
                self._all_reduce(flat, code, fn)

        return self._run("all_reduce", [t], body, tensors, op=code)

    def _all_reduce(self, flat: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        if self._hier is not None:
            self._hier.all_reduce(flat, SUM if code == AVG else code, fn)
        else:
            self._eng.all_reduce(flat, fn)  # type: ignore[union-attr]
        if code == AVG and self.size() > 1:
            flat.div_(self.size())

    def allreduce_coalesced(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        tensors, code = list(tensors), _op(opts, args, kw, "op")
        if self._eng is None:
            return self._world.allreduce_coalesced(tensors, _opts(dist.AllreduceCoalescedOptions, reduceOp=code))
        fns = [reducer(code, t.dtype) for t in tensors]

        def body() -> None:
            for t, fn in zip(tensors, fns):
                with staged(t, out=True) as flat:
                    self._all_reduce(flat, code, fn)

        return self._run("all_reduce_coalesced", tensors, body, tensors, op=code)

    def reduce(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(tensors, torch.Tensor):  # reduce(tensor, root, op=SUM, timeout=None)
            root, code = (opts if opts is not None else kw.get("root")), _op(None, args, kw, "op")
        else:
            root, code = getattr(opts, "rootRank", 0), _op(opts, (), {}, "op")
        tensors = _one_list(tensors, "reduce")
        if self._eng is None:
            return self._world.reduce(tensors, _opts(dist.ReduceOptions, reduceOp=code, rootRank=root))
        t = tensors[0]
        fn = reducer(code, t.dtype)
        self._check_root(root)

        def body() -> None:
            with staged(t, out=self.rank() == root) as flat:
                if self._hier is not None:
                    self._hier.reduce(flat, root, SUM if code == AVG else code, fn)
                else:
                    self._eng.reduce(flat, self._local(root), fn)  # type: ignore[union-attr]
                if code == AVG and self.rank() == root:
                    flat.div_(self.size())

        return self._run("reduce", [t], body, tensors, op=code, root=root)

    # ------------------------------------------------------------------ broadcast

    def broadcast(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(tensors, torch.Tensor):  # broadcast(tensor, root, timeout=None)
            root = opts if opts is not None else kw.get("root", 0)
        else:
            root = getattr(opts, "rootRank", 0)
        tensors = _one_list(tensors, "broadcast")
        if self._eng is None:
            return self._world.broadcast(tensors, _opts(dist.BroadcastOptions, rootRank=root))
        t = tensors[0]
        self._check_root(root)

        def body() -> None:
            with staged(t, out=self.rank() != root) as flat:
                if self._hier is not None:
                    self._hier.broadcast(flat_bytes(flat), root)
                else:
                    self._eng.broadcast(flat_bytes(flat), self._local(root))  # type: ignore[union-attr]

        return self._run("broadcast", [t], body, tensors, root=root)

    # ------------------------------------------------------------------ all_gather, gather

    def allgather(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(inputs, torch.Tensor):  # allgather(output_list, input, timeout=None)
            outputs, inputs = [outputs], [inputs]
        if self._eng is None:
            return self._world.allgather(outputs, inputs)
        inputs = _one_list(inputs, "all_gather")
        outs = self._gather_list(outputs[0], inputs[0], "all_gather")
        return self._run("all_gather", inputs, lambda: self._all_gather(inputs[0], outs), outputs,
                         check=[*inputs, *outs])

    def _all_gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        with contextlib.ExitStack() as stack:
            fin = stack.enter_context(staged(inp, out=False))
            flats = [stack.enter_context(staged(o, out=True)) for o in outs]
            if self._hier is not None:
                self._hier.all_gather(flat_bytes(fin), [flat_bytes(f) for f in flats])
            else:
                self._eng.all_gather(flat_bytes(fin), [flat_bytes(f) for f in flats])  # type: ignore[union-attr]

    def _gather_list(self, outs: Sequence[torch.Tensor], inp: torch.Tensor, what: str) -> List[torch.Tensor]:
        outs = list(outs)
        if len(outs) != self.size() or any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
            shown = [(tuple(o.shape), str(o.dtype).replace("torch.", "")) for o in outs]
            raise BackendError(f"{what}: rank {self.rank()} passed output tensors {shown} for an input of "
                               f"{tuple(inp.shape)} {str(inp.dtype).replace('torch.', '')}",
                               fix=f"pass {self.size()} output tensors of the input's size and dtype")
        return outs

    def _single_outs(self, output: torch.Tensor, inp: torch.Tensor, what: str) -> Tuple[List[torch.Tensor], Any]:
        """Views of ``output`` (``size`` times ``inp``) as one tensor per rank, and the staging."""
        if output.numel() != self.size() * inp.numel() or output.dtype != inp.dtype:
            raise BackendError(f"{what}: rank {self.rank()} passed an output of {output.numel()} "
                               f"{str(output.dtype).replace('torch.', '')} elements for an input of {inp.numel()} "
                               f"{str(inp.dtype).replace('torch.', '')}",
                               fix=f"pass an output of {self.size()} x the input's elements and its dtype")
        stage = staged(output, out=True)
        return list(stage.flat.view(self.size(), -1)) if inp.numel() else [stage.flat] * self.size(), stage

    def all_gather_single(self, output: Any, input: Any, *args: Any, **kw: Any) -> Any:  # noqa: A002
        if self._eng is None:
            return self._world._allgather_base(output, input)
        return self._all_gather_singles([output], [input], "all_gather_single", output)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if self._eng is None:
            works = [self._world._allgather_base(o, i) for o, i in zip(outputs, inputs)]
            return _Waits(works, outputs)
        return self._all_gather_singles(list(outputs), list(inputs), "all_gather_single_coalesced", outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_singles(self, outputs: List[Any], inputs: List[Any], kind: str, result: Any) -> Any:
        check_tensors([*outputs, *inputs], kind)
        staged_outs = [self._single_outs(o, i, kind) for o, i in zip(outputs, inputs)]

        def body() -> None:
            for i, (outs, stage) in zip(inputs, staged_outs):
                with stage:
                    self._all_gather(i, outs)

        return self._run(kind, inputs, body, result)

    def allgather_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if self._eng is None:
            return self._world.allgather_coalesced(outputs, inputs)
        inputs = list(inputs)
        outs = [self._gather_list(o, i, "all_gather_coalesced") for o, i in zip(outputs, inputs)]

        def body() -> None:
            for i, o in zip(inputs, outs):
                self._all_gather(i, o)

        return self._run("all_gather_coalesced", inputs, body, outputs, check=[*inputs, *(t for o in outs for t in o)])

    def gather(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(inputs, torch.Tensor):  # gather(output_list, input, root, timeout=None)
            root = opts if opts is not None else kw.get("root", 0)
            outputs, inputs = ([outputs] if outputs else []), [inputs]
        else:
            root = getattr(opts, "rootRank", 0)
        if self._eng is None:
            return self._world.gather(outputs, inputs, _opts(dist.GatherOptions, rootRank=root))
        self._check_root(root)
        inp = _one_list(inputs, "gather")[0]
        outs = self._gather_list(outputs[0], inp, "gather") if self.rank() == root else None
        if self.rank() != root and outputs and any(len(o) for o in outputs):
            raise BackendError(f"gather: rank {self.rank()} is not the root ({root}) but passed output tensors",
                               fix="pass gather_list only on the root (dst)")

        def body() -> None:
            with contextlib.ExitStack() as stack:
                fin = stack.enter_context(staged(inp, out=False))
                flats = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs] if outs else None
                if self._hier is not None:
                    self._hier.gather(flat_bytes(fin), flats, root, self.size())
                else:
                    local = [None] * self.size() if flats is None else flats
                    self._eng.all_gather(flat_bytes(fin), local, self._local(root))  # type: ignore[union-attr]

        return self._run("gather", [inp], body, outputs, root=root, check=[inp, *(outs or [])])

    # ------------------------------------------------------------------ reduce_scatter, scatter

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(outputs, torch.Tensor):  # reduce_scatter(output, input_list, op=SUM, timeout=None)
            outputs, inputs, code = [outputs], [inputs], _op(opts, args, kw, "op")
        else:
            code = _op(opts, (), {}, "op")
        if self._eng is None:
            return self._world.reduce_scatter(outputs, inputs, _opts(dist.ReduceScatterOptions, reduceOp=code))
        out = _one_list(outputs, "reduce_scatter")[0]
        parts = self._gather_list(inputs[0], out, "reduce_scatter")
        return self._reduce_scatters([(out, parts)], "reduce_scatter", code, outputs)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:  # noqa: A002
        code = _op(opts, args, kw, "op")
        if self._eng is None:
            return self._world._reduce_scatter_base(output, input, _opts(dist.ReduceScatterOptions, reduceOp=code))
        return self._reduce_scatters([self._split(output, input)], "reduce_scatter_single", code, output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any,
                                        **kw: Any) -> Any:
        code = _op(opts, args, kw, "op")
        if self._eng is None:
            o = _opts(dist.ReduceScatterOptions, reduceOp=code)
            return _Waits([self._world._reduce_scatter_base(a, b, o) for a, b in zip(outputs, inputs)], outputs)
        pairs = [self._split(o, i) for o, i in zip(outputs, inputs)]
        return self._reduce_scatters(pairs, "reduce_scatter_single_coalesced", code, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _split(self, output: torch.Tensor, inp: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        if inp.numel() != self.size() * output.numel() or inp.dtype != output.dtype:
            raise BackendError(f"reduce_scatter: rank {self.rank()} passed an input of {inp.numel()} "
                               f"{str(inp.dtype).replace('torch.', '')} elements for an output of {output.numel()}",
                               fix=f"pass an input of {self.size()} x the output's elements and its dtype")
        return output, [inp]  # split inside the call, after staging

    def _reduce_scatters(self, pairs: List[Tuple[torch.Tensor, List[torch.Tensor]]], kind: str, code: Any,
                         result: Any) -> Any:
        outs = [o for o, _ in pairs]
        check_tensors([*outs, *(t for _, p in pairs for t in p)], kind)
        fns = [reducer(code, o.dtype) for o in outs]

        def body() -> None:
            for (out, parts), fn in zip(pairs, fns):
                self._reduce_scatter(out, parts, code, fn)

        return self._run(kind, outs, body, result, op=code)

    def _reduce_scatter(self, out: torch.Tensor, parts: List[torch.Tensor], code: Any, fn: Callable[..., Any]) -> None:
        with contextlib.ExitStack() as stack:
            flats = [stack.enter_context(staged(p, out=False)) for p in parts]
            if len(flats) == 1 and self.size() > 1:  # the single-tensor form: split after staging
                flats = list(flats[0].view(self.size(), -1)) if out.numel() else [flats[0]] * self.size()
            overlaps = any(_overlap(out, f) for f in flats)
            target = torch.empty(out.numel(), dtype=out.dtype) if overlaps or not out.is_contiguous() else None
            dst = target if target is not None else out.reshape(-1)
            if self._hier is not None:
                self._hier.reduce_scatter(flats, dst, SUM if code == AVG else code, fn)
            else:
                self._eng.reduce_scatter(flats, dst, fn)  # type: ignore[union-attr]
            if code == AVG and self.size() > 1:
                dst.div_(self.size())
            if target is not None:
                out.copy_(target.view(out.shape))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(outputs, torch.Tensor):  # scatter(output, input_list, root, timeout=None)
            root = opts if opts is not None else kw.get("root", 0)
            outputs, inputs = [outputs], ([inputs] if inputs else [])
        else:
            root = getattr(opts, "rootRank", 0)
        if self._eng is None:
            return self._world.scatter(outputs, inputs, _opts(dist.ScatterOptions, rootRank=root))
        self._check_root(root)
        out = _one_list(outputs, "scatter")[0]
        parts = self._gather_list(inputs[0], out, "scatter") if self.rank() == root else None

        def body() -> None:
            with contextlib.ExitStack() as stack:
                fout = flat_bytes(stack.enter_context(staged(out, out=True)))
                fins = [flat_bytes(stack.enter_context(staged(p, out=False))) for p in parts] if parts else None
                if self._hier is not None:
                    self._hier.scatter(fins, fout, root, self.size())
                else:
                    self._eng.scatter(fins, fout, self._local(root))  # type: ignore[union-attr]

        return self._run("scatter", [out], body, outputs, root=root, check=[out, *(parts or [])])

    # ------------------------------------------------------------------ all_to_all, barrier

    def alltoall(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if self._eng is None or self._hier is not None:
            return self._world.alltoall(outputs, inputs)
        outs, ins = list(outputs), list(inputs)
        if len(outs) != self.size() or len(ins) != self.size():
            raise BackendError(f"all_to_all: rank {self.rank()} passed {len(ins)} inputs and {len(outs)} outputs",
                               fix=f"pass {self.size()} of each")
        return self._run("all_to_all", [], lambda: self._all_to_all(outs, ins), outputs, check=[*outs, *ins])

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any = None,  # noqa: A002
                          input_split_sizes: Any = None, *args: Any, **kw: Any) -> Any:
        if self._eng is None or self._hier is not None:
            return self._world.alltoall_base(output, input, list(output_split_sizes or []),
                                             list(input_split_sizes or []))
        outs = _split_rows(output, output_split_sizes, self.size(), "output")
        ins = _split_rows(input, input_split_sizes, self.size(), "input")
        stage = staged(output, out=True)

        def body() -> None:
            with stage:
                views = _split_rows(stage.flat.view(output.shape), output_split_sizes, self.size(), "output")
                self._all_to_all(views, ins)

        del outs
        return self._run("all_to_all_single", [], body, output, check=[output, input])

    alltoall_base = all_to_all_single

    def _all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        with contextlib.ExitStack() as stack:
            fouts = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs]
            fins = [flat_bytes(stack.enter_context(staged(i, out=False))) for i in ins]
            self._eng.all_to_all(fins, fouts)  # type: ignore[union-attr]

    def barrier(self, *args: Any, **kw: Any) -> Any:
        if self._eng is None:
            return self._world.barrier()
        body = self._hier.barrier if self._hier is not None else self._eng.barrier
        return self._run("barrier", [], body, None)

    # ------------------------------------------------------------------ point-to-point

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self._p2p(tensors, dst, tag, "send")

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self._p2p(tensors, src, tag, "recv")

    def _p2p(self, tensors: Any, peer: int, tag: int, kind: str) -> Any:
        self._usable()
        tensors = _one_list(tensors, kind)
        check_tensors(tensors, kind)
        if self._links is None or not self._links.has(peer):
            return getattr(self._world, kind)(tensors, peer, tag)
        t = tensors[0]
        if kind == "send":
            flat = t if t.is_contiguous() else t.contiguous()
            return _TimedWork(self._links.send(flat, peer, tag), self._timeout)
        flat = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
        fut = self._links.recv(flat, peer, tag)
        if flat is not t:
            fut = fut.then(lambda f: (t.copy_(flat), f.value())[1])
        return _TimedWork(fut, self._timeout)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        if self._world is not None and self._links is None:
            return self._world.recv_anysource(tensors, tag)
        raise BackendError("recv without a source is not supported by the shm backend",
                           fix="pass src= to recv/irecv (the rank that sends)")

    # ------------------------------------------------------------------ leaving

    def leave(self) -> None:
        """Leave the group: peers waiting for this rank stop at once; later calls raise."""
        if self._closed is not None:
            return
        self._closed = "shut down (cpuddp.shutdown() or destroy_process_group())"
        if os.getpid() != self._pid:
            return  # a forked child: the parent's group is not this process's to leave
        self._stream.close()
        if self._eng is not None:
            self._eng.seg.lines[self._eng.me][C_STATE] = STATE_LEFT
            self._eng.mark_checked()
        if self._links is not None:
            self._links.close()

    def abort_peers(self, why: str) -> None:
        """Set the segment's abort word: local peers waiting for this rank raise at once."""
        if self._eng is not None and os.getpid() == self._pid and self._closed is None:
            self._eng.fail(why)

    def shutdown(self) -> None:  # torch's destroy_process_group calls it
        self.leave()
        if os.getpid() != self._pid:
            return
        for inner in (self._world, getattr(self._hier, "cross", None)):
            if inner is not None:
                with contextlib.suppress(Exception):
                    inner.shutdown()
        if self._world is not None or self._hier is not None:
            time.sleep(_SETTLE)  # gloo's workers release their last Works while Python still runs
        if self._eng is not None:
            self._eng.seg.close()

    def abort(self) -> None:
        self.abort_peers("the process group was aborted")
        self.shutdown()

    def _check_root(self, root: Any) -> None:
        if not isinstance(root, int) or not 0 <= root < self.size():
            raise BackendError(f"root rank {root!r} is not a rank of this group of {self.size()}",
                               fix=f"pass a root from 0 to {self.size() - 1}")


# --------------------------------------------------------------------------- argument forms


def _one_list(tensors: Any, what: str) -> List[torch.Tensor]:
    """torch passes ``[tensor]``; the legacy multi-device form (several) is an error here."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    tensors = list(tensors)
    if len(tensors) != 1:
        raise BackendError(f"{what} got {len(tensors)} tensors for one rank: the shm backend takes one tensor per "
                           "rank (a CPU rank has one device)",
                           fix="pass one tensor (for several, use the coalesced form or one call each)")
    return tensors


def _op(opts: Any, args: Sequence[Any], kw: Any, name: str) -> Any:
    """The reduce op (a ``RedOpType``) of an options object, a positional op, or ``op=``."""
    op = getattr(opts, "reduceOp", None)
    if op is None:
        op = opts if opts is not None and not hasattr(opts, "timeout") else (args[0] if args else kw.get(name))
    if op is None:
        return dist.ReduceOp.SUM.op if hasattr(dist.ReduceOp.SUM, "op") else dist.ReduceOp.RedOpType.SUM
    return op.op if hasattr(op, "op") else dist.ReduceOp(op).op


def _opts(cls: Any, **values: Any) -> Any:
    o = cls()
    for k, v in values.items():
        setattr(o, k, dist.ReduceOp(v) if k == "reduceOp" else v)
    return o


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()
    b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def _split_rows(t: torch.Tensor, sizes: Any, n: int, what: str) -> List[torch.Tensor]:
    """``t`` split along dim 0 into ``sizes`` rows (equal parts when empty), as 1-D tensors."""
    rows = t.shape[0] if t.dim() else 1
    sizes = list(sizes or [])
    if not sizes:
        if rows % n:
            raise BackendError(f"all_to_all_single: the {what} has {rows} rows, not a multiple of {n} ranks",
                               fix=f"pass {what}_split_sizes")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise BackendError(f"all_to_all_single: {what}_split_sizes {sizes} do not split {rows} rows among {n} ranks",
                           fix=f"pass {n} non-negative sizes that add up to the {what}'s first dimension")
    return [p.reshape(-1) if p.is_contiguous() else p for p in torch.split(t, sizes)] if t.dim() else [t.reshape(-1)]


class _Waits(dist.Work):
    """Several inner Works as one (whole-gloo groups' coalesced forms)."""

    def __init__(self, works: Sequence[Any], result: Any) -> None:
        super().__init__()
        self._works, self._result = list(works), result

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def get_future(self) -> "torch.futures.Future[Any]":
        fut: torch.futures.Future = torch.futures.Future()
        self.wait()
        fut.set_result(self._result)
        return fut


class _TimedWork(dist.Work):
    """A point-to-point Work: ``wait()`` raises its error, and gives up after the group timeout."""

    def __init__(self, fut: "torch.futures.Future[Any]", timeout: datetime.timedelta) -> None:
        super().__init__()
        self._fut, self._timeout = fut, timeout

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        limit = timeout if timeout is not None and timeout.total_seconds() > 0 else self._timeout
        deadline = time.monotonic() + limit.total_seconds()
        while not self._fut.done():
            if time.monotonic() > deadline:
                raise dist.DistBackendError(f"shm: send/recv did not finish within {limit} (the group timeout)")
            time.sleep(1e-4)
        self._fut.wait()
        return True

    def get_future(self) -> "torch.futures.Future[Any]":
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()


# --------------------------------------------------------------------------- registration


def _create(dist_opts: Any, pg_options: Any = None) -> ShmProcessGroup:
    """torch's creator (``extended_api=True``): the store, ranks and timeout, and our options."""
    options = pg_options if isinstance(pg_options, api.ShmOptions) else None
    if pg_options is not None and options is None:
        raise BackendError(f"pg_options for the shm backend must be cpuddp's ShmOptions, not "
                           f"{type(pg_options).__name__}",
                           fix="pass cpuddp.backends.shm.api.ShmOptions(...) or nothing")
    return ShmProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout, options)


def register() -> None:
    """Register ``shm`` with ``torch.distributed`` (idempotent; done on import)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


register()
