"""The shared-memory routes of a shm group (:mod:`cpuddp.backends.shm.routes.route`): one node on the
Python engine (:class:`NodeRoute`), and several nodes through the hierarchy (:class:`CrossRoute`,
the same checks and staging with the data legs of :class:`~cpuddp.backends.shm.cross.hierarchy.Hierarchy`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence

import torch

from cpuddp.errors import BackendError

from . import call_args
from ..python.ops import AVG, SUM, check_tensors, flat_bytes, reducer, staged
from .route import Route, WorldAllToAll
from ..python.sparse import all_reduce_sparse, check_sparse, sparse_call

__all__ = ["NodeRoute", "CrossRoute"]


class NodeRoute(Route):
    """One node's collectives in shared memory on the Python engine ``eng``: each call checked,
    then posted with a body through the group's executor ``ex``
    (:class:`~cpuddp.backends.shm.routes.executor.Executor`).  The data legs (``_leg_*``) are
    this node's engine; :class:`CrossRoute` replaces them."""

    def __init__(self, ex: Any, eng: Any) -> None:
        self.ex, self.eng = ex, eng
        self.rank, self.size = ex.rank, ex.size
        #: what moves bytes between every rank: the node's engine here, the hierarchy across nodes
        self.data: Any = eng

    # ------------------------------------------------------------------ the data legs

    def _leg_all_reduce(self, flat: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        self.eng.all_reduce(flat, fn)

    def _leg_reduce(self, flat: torch.Tensor, root: int, code: Any, fn: Callable[..., Any]) -> None:
        self.eng.reduce(flat, self.ex.local_rank_of(root), fn)

    def _leg_broadcast(self, flat: torch.Tensor, root: int) -> None:
        self.eng.broadcast(flat, self.ex.local_rank_of(root))

    def _leg_gather(self, fin: torch.Tensor, flats: Optional[List[torch.Tensor]], root: int) -> None:
        self.eng.all_gather(fin, flats if flats is not None else [None] * self.size, self.ex.local_rank_of(root))

    def _leg_reduce_scatter(self, flats: List[torch.Tensor], dst: torch.Tensor, code: Any,
                            fn: Callable[..., Any]) -> None:
        self.eng.reduce_scatter(flats, dst, fn)

    def _leg_scatter(self, fins: Optional[List[torch.Tensor]], fout: torch.Tensor, root: int) -> None:
        self.eng.scatter(fins, fout, self.ex.local_rank_of(root))

    def _rows(self, flat: torch.Tensor) -> Any:
        """The output's rows as one [n, bytes] view: no object per rank."""
        return flat_bytes(flat).view(self.size, -1)

    # ------------------------------------------------------------------ all_reduce, reduce

    def _all_reduce_sparse(self, tensors: List[Any], t: torch.Tensor, code: Any) -> Any:
        check_sparse(t, code)
        gather = self.data.all_gather
        return self.ex.run("all_reduce_sparse", sparse_call(t), lambda: all_reduce_sparse(t, code, self.size, gather),
                           tensors, op=code)

    def all_reduce(self, tensors: List[Any], code: Any) -> Any:
        t = tensors[0]
        if isinstance(t, torch.Tensor) and t.is_sparse:
            return self._all_reduce_sparse(tensors, t, code)
        check_tensors(tensors, "all_reduce")
        return self._all_reduce_python(tensors, t, code, reducer(code, t.dtype))

    def _all_reduce_elsewhere(self, tensors: List[Any], code: Any, native: Callable[[Any, Any], bool]) -> Any:
        """all_reduce's checks for a native route: the Work where the Python engine takes the call
        (a sparse tensor, or a dtype and op ``native(code, dtype)`` declines), else None."""
        t = tensors[0]
        if isinstance(t, torch.Tensor) and t.is_sparse:
            return self._all_reduce_sparse(tensors, t, code)
        check_tensors(tensors, "all_reduce")
        fn = reducer(code, t.dtype)
        return None if native(code, t.dtype) else self._all_reduce_python(tensors, t, code, fn)

    def _all_reduce_python(self, tensors: List[Any], t: torch.Tensor, code: Any, fn: Callable[..., Any]) -> Any:
        def body() -> None:
            with staged(t, out=True) as flat:
                self._all_reduce(flat, code, fn)

        return self.ex.run("all_reduce", [t], body, tensors, op=code)

    def _all_reduce(self, flat: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        self._leg_all_reduce(flat, code, fn)
        if code == AVG and self.size > 1:
            flat.div_(self.size)

    def all_reduce_coalesced(self, tensors: List[Any], code: Any) -> Any:
        check_tensors(tensors, "all_reduce_coalesced")
        fns = [reducer(code, t.dtype) for t in tensors]

        def body() -> None:
            for t, fn in zip(tensors, fns):
                with staged(t, out=True) as flat:
                    self._all_reduce(flat, code, fn)

        return self.ex.run("all_reduce_coalesced", tensors, body, tensors, op=code)

    def reduce(self, tensors: List[Any], root: Any, code: Any) -> Any:
        t = tensors[0]
        check_tensors(tensors, "reduce")
        fn = reducer(code, t.dtype)
        self.ex.check_root(root)
        return self._reduce_python(tensors, t, root, code, fn)

    def _reduce_python(self, tensors: List[Any], t: torch.Tensor, root: int, code: Any, fn: Callable[..., Any]) -> Any:
        mine = self.rank == root

        def body() -> None:
            with staged(t, out=mine) as flat:
                self._leg_reduce(flat, root, code, fn)
                if code == AVG and mine:
                    flat.div_(self.size)

        return self.ex.run("reduce", [t], body, tensors, op=code, root=root)

    # ------------------------------------------------------------------ broadcast

    def broadcast(self, tensors: List[Any], root: Any) -> Any:
        t = tensors[0]
        check_tensors(tensors, "broadcast")
        self.ex.check_root(root)

        def body() -> None:
            with staged(t, out=self.rank != root) as flat:
                self._leg_broadcast(flat_bytes(flat), root)

        return self.ex.run("broadcast", [t], body, tensors, root=root)

    # ------------------------------------------------------------------ all_gather, gather

    def all_gather(self, outputs: Any, inputs: Any) -> Any:
        inputs = call_args.one_tensor(inputs, "all_gather")
        check_tensors([*inputs, *outputs[0]], "all_gather")
        outs = call_args.same_as_input(outputs[0], inputs[0], self.size, self.rank, "all_gather")
        return self.ex.run("all_gather", inputs, lambda: self._all_gather(inputs[0], outs), outputs)

    def _all_gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        with contextlib.ExitStack() as stack:
            fin = flat_bytes(stack.enter_context(staged(inp, out=False)))
            flats = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs]
            self.data.all_gather(self._apart(fin, flats), flats)

    def _apart(self, fin: torch.Tensor, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        """``fin``, or a copy of it where it shares bytes with an output other than as this
        rank's own output exactly: the engine writes the outputs while it still reads ``fin``."""
        for r, out in enumerate(flats):
            mine = r == self.rank and out.data_ptr() == fin.data_ptr() and out.nbytes == fin.nbytes
            if not mine and call_args.overlaps(out, fin):
                return fin.clone()
        return fin

    def _all_gather_single(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        with staged(output, out=True) as flat, staged(inp, out=False) as fin:
            rows = [flat_bytes(flat)] * self.size if not inp.numel() else self._rows(flat)
            fin = flat_bytes(fin)
            if call_args.overlaps_elsewhere(flat_bytes(flat), fin, self.rank):
                fin = fin.clone()  # the engine writes the other rows while it still reads the input
            self.data.all_gather(fin, rows)

    def _check_all_gather_single(self, output: Any, inp: Any) -> None:
        check_tensors([output, inp], "all_gather_single")
        call_args.whole_of(output, inp, self.size, self.rank, "all_gather_single")

    def all_gather_single(self, output: Any, inp: Any) -> Any:
        self._check_all_gather_single(output, inp)
        return self.ex.run("all_gather_single", [inp], lambda: self._all_gather_single(output, inp), output)

    def all_gather_single_coalesced(self, outputs: List[Any], inputs: List[Any]) -> Any:
        check_tensors([*outputs, *inputs], "all_gather_single_coalesced")
        for o, i in zip(outputs, inputs):
            call_args.whole_of(o, i, self.size, self.rank, "all_gather_single_coalesced")

        def body() -> None:
            for o, i in zip(outputs, inputs):
                self._all_gather_single(o, i)

        return self.ex.run("all_gather_single_coalesced", inputs, body, outputs)

    def all_gather_coalesced(self, outputs: Any, inputs: Any) -> Any:
        inputs = list(inputs)
        check_tensors([*inputs, *(t for o in outputs for t in o)], "all_gather_coalesced")
        outs = [call_args.same_as_input(o, i, self.size, self.rank, "all_gather_coalesced")
                for o, i in zip(outputs, inputs)]

        def body() -> None:
            for o, i in zip(outs, inputs):
                self._all_gather(i, o)

        return self.ex.run("all_gather_coalesced", inputs, body, outputs)

    def gather(self, outputs: Any, inputs: Any, root: Any) -> Any:
        inp = call_args.one_tensor(inputs, "gather")[0]
        self.ex.check_root(root)
        outs = None
        if self.rank == root:
            check_tensors([inp, *(outputs[0] if outputs else [])], "gather")
            outs = call_args.same_as_input(outputs[0] if outputs else [], inp, self.size, self.rank, "gather")
        elif outputs and any(len(o) for o in outputs):
            raise BackendError(f"gather: rank {self.rank} passed a gather_list but is not the root ({root})",
                               fix="pass gather_list on the root (dst) only")
        else:
            check_tensors([inp], "gather")
        return self.ex.run("gather", [inp], lambda: self._gather(outs, inp, root), outputs, root=root)

    def _gather(self, outs: Optional[List[torch.Tensor]], inp: torch.Tensor, root: int) -> None:
        with contextlib.ExitStack() as stack:
            fin = flat_bytes(stack.enter_context(staged(inp, out=False)))
            flats = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs] if outs else None
            self._leg_gather(self._apart(fin, flats) if flats else fin, flats, root)

    # ------------------------------------------------------------------ reduce_scatter, scatter

    def reduce_scatter(self, outputs: Any, inputs: Any, code: Any) -> Any:
        out = call_args.one_tensor(outputs, "reduce_scatter")[0]
        check_tensors([out, *inputs[0]], "reduce_scatter")
        parts = call_args.same_as_input(inputs[0], out, self.size, self.rank, "reduce_scatter")
        fn = reducer(code, out.dtype)
        return self.ex.run("reduce_scatter", [out], lambda: self._reduce_scatter(out, parts, code, fn), outputs,
                           op=code)

    def _check_reduce_scatter_single(self, output: Any, inp: Any) -> None:
        check_tensors([output, inp], "reduce_scatter_single")
        call_args.whole_of(inp, output, self.size, self.rank, "reduce_scatter_single")

    def reduce_scatter_single(self, output: Any, inp: Any, code: Any) -> Any:
        self._check_reduce_scatter_single(output, inp)
        fn = reducer(code, output.dtype)
        return self._reduce_scatter_single_python(output, inp, code, fn)

    def _reduce_scatter_single_python(self, output: Any, inp: Any, code: Any, fn: Callable[..., Any]) -> Any:
        return self.ex.run("reduce_scatter_single", [output],
                           lambda: self._reduce_scatter_single(output, inp, code, fn), output, op=code)

    def reduce_scatter_single_coalesced(self, outputs: List[Any], inputs: List[Any], code: Any) -> Any:
        check_tensors([*outputs, *inputs], "reduce_scatter_single_coalesced")
        for out, inp in zip(outputs, inputs):
            call_args.whole_of(inp, out, self.size, self.rank, "reduce_scatter_single_coalesced")
        fns = [reducer(code, out.dtype) for out in outputs]

        def body() -> None:
            for out, inp, fn in zip(outputs, inputs, fns):
                self._reduce_scatter_single(out, inp, code, fn)

        return self.ex.run("reduce_scatter_single_coalesced", outputs, body, outputs, op=code)

    def _reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        with staged(inp, out=False) as flat:
            if out.numel() and not call_args.overlaps(out, flat):
                # the input's parts as one [n, part] view, the output written in place: no object per rank
                with staged(out, out=True) as dst:
                    self.eng.reduce_scatter(flat.view(self.size, -1), dst, fn)
                    if code == AVG and self.size > 1:
                        dst.div_(self.size)
                return
            parts = list(flat.view(self.size, -1)) if out.numel() else [flat] * self.size
            self._reduce_scatter(out, parts, code, fn)

    def _reduce_scatter(self, out: torch.Tensor, parts: List[torch.Tensor], code: Any, fn: Callable[..., Any]) -> None:
        with contextlib.ExitStack() as stack:
            flats = [stack.enter_context(staged(p, out=False)) for p in parts]
            aside = any(call_args.overlaps(out, f) for f in flats)  # in place: a result of its own first
            with staged(torch.empty_like(out) if aside else out, out=True) as dst:
                self._leg_reduce_scatter(flats, dst, code, fn)
                if code == AVG and self.size > 1:
                    dst.div_(self.size)
                if aside:
                    out.copy_(dst.view(out.shape))

    def scatter(self, outputs: Any, inputs: Any, root: Any) -> Any:
        out = call_args.one_tensor(outputs, "scatter")[0]
        self.ex.check_root(root)
        parts: Optional[List[torch.Tensor]] = None
        if self.rank == root:
            check_tensors([out, *(inputs[0] if inputs else [])], "scatter")
            parts = call_args.same_as_input(inputs[0] if inputs else [], out, self.size, self.rank, "scatter")
        else:
            check_tensors([out], "scatter")
        return self.ex.run("scatter", [out], lambda: self._scatter(out, parts, root), outputs, root=root)

    def _scatter(self, out: torch.Tensor, parts: Optional[List[torch.Tensor]], root: int) -> None:
        with contextlib.ExitStack() as stack:
            fout = flat_bytes(stack.enter_context(staged(out, out=True)))
            fins = [flat_bytes(stack.enter_context(staged(p, out=False))) for p in parts] if parts else None
            self._leg_scatter(fins, fout, root)

    # ------------------------------------------------------------------ all_to_all, barrier

    def all_to_all(self, outs: List[torch.Tensor], ins: List[torch.Tensor], agreed: Sequence[torch.Tensor],
                   result: Any) -> Any:
        if len(outs) != self.size or len(ins) != self.size:
            raise BackendError(f"all_to_all: rank {self.rank} passed {len(ins)} inputs and {len(outs)} outputs",
                               fix=f"pass one of each per rank ({self.size})")
        return self.ex.run("all_to_all", agreed, lambda: self._all_to_all(outs, ins), result)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: Any,
                          input_split_sizes: Any, agreed: Sequence[torch.Tensor]) -> Any:
        ins = call_args.split_rows(inp, input_split_sizes, self.size, "input")
        call_args.split_rows(output, output_split_sizes, self.size, "output")

        def body() -> None:
            with staged(output, out=True) as flat:
                outs = call_args.split_rows(flat.view(output.shape), output_split_sizes, self.size, "output")
                self._all_to_all(outs, ins)

        return self.ex.run("all_to_all_single", agreed, body, output)

    def _all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        with contextlib.ExitStack() as stack:
            fouts = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs]
            fins = [flat_bytes(stack.enter_context(staged(i, out=False))) for i in ins]
            self.eng.all_to_all(fins, fouts)

    def barrier(self) -> Any:
        return self.ex.run("barrier", [], self.data.barrier, None)


class CrossRoute(WorldAllToAll, NodeRoute):
    """Several nodes: the checks and staging of :class:`NodeRoute`, the data through ``hier``
    (:class:`~cpuddp.backends.shm.cross.hierarchy.Hierarchy`: shared memory inside the node, its cross group
    between nodes); all_to_all on ``world``, the gloo group of every rank."""

    def __init__(self, ex: Any, eng: Any, hier: Any, world: Any) -> None:
        super().__init__(ex, eng)
        self.hier, self.world = hier, world
        self.data = hier

    def _leg_all_reduce(self, flat: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        self.hier.all_reduce(flat, SUM if code == AVG else code, fn)

    def _leg_reduce(self, flat: torch.Tensor, root: int, code: Any, fn: Callable[..., Any]) -> None:
        self.hier.reduce(flat, root, SUM if code == AVG else code, fn)

    def _leg_broadcast(self, flat: torch.Tensor, root: int) -> None:
        self.hier.broadcast(flat, root)

    def _leg_gather(self, fin: torch.Tensor, flats: Optional[List[torch.Tensor]], root: int) -> None:
        self.hier.gather(fin, flats, root, self.size)

    def _leg_reduce_scatter(self, flats: List[torch.Tensor], dst: torch.Tensor, code: Any,
                            fn: Callable[..., Any]) -> None:
        self.hier.reduce_scatter(flats, dst, SUM if code == AVG else code, fn)

    def _leg_scatter(self, fins: Optional[List[torch.Tensor]], fout: torch.Tensor, root: int) -> None:
        self.hier.scatter(fins, fout, root, self.size)

    def _rows(self, flat: torch.Tensor) -> Any:
        return list(flat_bytes(flat).view(self.size, -1))

    def _reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        with staged(inp, out=False) as flat:
            parts = list(flat.view(self.size, -1)) if out.numel() else [flat] * self.size
            self._reduce_scatter(out, parts, code, fn)

