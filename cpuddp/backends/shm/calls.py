"""The collectives torch calls on a shm group, each reduced to its node-local or hierarchical
run (:class:`Collectives`, mixed into :class:`~cpuddp.backends.shm.group.ShmProcessGroup`).

Every method: normalise torch's argument forms (:mod:`cpuddp.backends.shm.forms`), describe the
call for the agreement, and hand a body to the group's ``_run``.  A call is checked (tensor
kinds, dtypes and ops, sizes, roots) before it is posted: a refused call never happened, for
this rank and its peers alike (a peer that waits for it learns of it when this rank calls
something else, exits or dies, or the watchdog reports its error).  An error once a call is
posted breaks the group: every later call raises at once, and the peers stop too.  Tensors of any layout go through staging
(:func:`cpuddp.backends.shm.ops.staged`).  A group running every collective on gloo (nodes of
one rank, uneven nodes) hands the call to its gloo group instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError

from . import forms
from .ops import AVG, SUM, check_tensors, flat_bytes, reducer, staged
from .sparse import all_reduce_sparse, check_sparse, sparse_call
from .stream import GatheredWork

__all__ = ["Collectives"]


class Collectives:
    """torch's collective methods for a group with ``_run``, ``_eng``, ``_hier`` and ``_world``."""

    _eng: Any
    _hier: Any
    _direct: Any  # its direct route (cpuddp.backends.shm.direct), or None
    _native: Any  # the native data path (cpuddp.backends.shm.native.Engine) of a one-level node, or None
    _run_native: Callable[..., Any]
    _submit_native: Callable[..., Any]
    _queues: Callable[[Sequence[torch.Tensor]], bool]
    _world: Any
    _run: Callable[..., Any]
    rank: Callable[[], int]
    size: Callable[[], int]
    _local: Callable[[int], int]
    _check_root: Callable[[Any], None]

    # ------------------------------------------------------------------ all_reduce, reduce

    def allreduce(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        direct = self._direct
        if direct is not None and not args and not kw:
            work = direct.all_reduce(tensors, opts)
            if work is not None:
                return work
        tensors, code = forms.one_tensor(tensors, "all_reduce"), forms.reduce_op(opts, args, kw)
        if self._eng is None:
            return self._world.allreduce(tensors, forms.options(dist.AllreduceOptions, reduceOp=code))
        t = tensors[0]
        if isinstance(t, torch.Tensor) and t.is_sparse:
            check_sparse(t, code)
            gather = (self._hier or self._eng).all_gather
            return self._run("all_reduce_sparse", sparse_call(t), lambda: all_reduce_sparse(t, code, self.size(), gather),
                             tensors, op=code)
        check_tensors(tensors, "all_reduce")
        fn = reducer(code, t.dtype)
        nat = self._native
        if nat is not None and nat.reduces(code, t.dtype):
            size = self.size()
            if self._queues([t]):
                return self._submit_native("all_reduce", [t], lambda call: nat.all_reduce(call, t, code), tensors,
                                           (lambda: t.div_(size)) if code == AVG else None, op=code)

            def native(call: Any) -> None:
                with staged(t, out=True) as flat:
                    nat.run(call, nat.all_reduce(call, flat, code))
                    if code == AVG:
                        flat.div_(size)

            return self._run_native("all_reduce", [t], native, tensors, op=code)

        def body() -> None:
            with staged(t, out=True) as flat:
                self._all_reduce(flat, code, fn)

        return self._run("all_reduce", [t], body, tensors, op=code)

    def _all_reduce(self, flat: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        if self._hier is not None:
            self._hier.all_reduce(flat, SUM if code == AVG else code, fn)
        else:
            self._eng.all_reduce(flat, fn)
        if code == AVG and self.size() > 1:
            flat.div_(self.size())

    def allreduce_coalesced(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        tensors, code = list(tensors), forms.reduce_op(opts, args, kw)
        if self._eng is None:
            return self._world.allreduce_coalesced(tensors, forms.options(dist.AllreduceCoalescedOptions,
                                                                          reduceOp=code))

        check_tensors(tensors, "all_reduce_coalesced")
        fns = [reducer(code, t.dtype) for t in tensors]

        def body() -> None:
            for t, fn in zip(tensors, fns):
                with staged(t, out=True) as flat:
                    self._all_reduce(flat, code, fn)

        return self._run("all_reduce_coalesced", tensors, body, tensors, op=code)

    def reduce(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(tensors, torch.Tensor):  # reduce(tensor, root, op=SUM, timeout=None)
            root, code = forms.root_of(None, opts, kw), forms.reduce_op(None, args, kw)
        else:
            root, code = forms.root_of(opts, None, kw), forms.reduce_op(opts)
        tensors = forms.one_tensor(tensors, "reduce")
        if self._eng is None:
            return self._world.reduce(tensors, forms.options(dist.ReduceOptions, reduceOp=code, rootRank=root))
        t = tensors[0]
        check_tensors(tensors, "reduce")
        fn = reducer(code, t.dtype)
        self._check_root(root)
        nat = self._native
        if nat is not None and nat.reduces(code, t.dtype):
            mine, local = self.rank() == root, self._local(root)

            def native(call: Any) -> None:
                with staged(t, out=mine) as flat:
                    nat.run(call, nat.reduce(call, flat, local, code))
                    if code == AVG and mine:
                        flat.div_(self.size())

            return self._run_native("reduce", [t], native, tensors, op=code, root=root)

        def body() -> None:
            with staged(t, out=self.rank() == root) as flat:
                if self._hier is not None:
                    self._hier.reduce(flat, root, SUM if code == AVG else code, fn)
                else:
                    self._eng.reduce(flat, self._local(root), fn)
                if code == AVG and self.rank() == root:
                    flat.div_(self.size())

        return self._run("reduce", [t], body, tensors, op=code, root=root)

    # ------------------------------------------------------------------ broadcast

    def broadcast(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        direct = self._direct
        if direct is not None and not args and not kw:
            work = direct.broadcast(tensors, opts)
            if work is not None:
                return work
        if isinstance(tensors, torch.Tensor):  # broadcast(tensor, root, timeout=None)
            root = forms.root_of(None, opts, kw)
        else:
            root = forms.root_of(opts, None, kw)
        tensors = forms.one_tensor(tensors, "broadcast")
        if self._eng is None:
            return self._world.broadcast(tensors, forms.options(dist.BroadcastOptions, rootRank=root))
        t = tensors[0]
        check_tensors(tensors, "broadcast")
        self._check_root(root)
        nat = self._native
        if nat is not None:
            local = self._local(root)
            if self._queues([t]):
                return self._submit_native("broadcast", [t], lambda call: nat.broadcast(call, flat_bytes(t), local),
                                           tensors, None, root=root)

            def native(call: Any) -> None:
                with staged(t, out=self.rank() != root) as flat:
                    nat.run(call, nat.broadcast(call, flat_bytes(flat), local))

            return self._run_native("broadcast", [t], native, tensors, root=root)

        def body() -> None:
            with staged(t, out=self.rank() != root) as flat:
                if self._hier is not None:
                    self._hier.broadcast(flat_bytes(flat), root)
                else:
                    self._eng.broadcast(flat_bytes(flat), self._local(root))

        return self._run("broadcast", [t], body, tensors, root=root)

    # ------------------------------------------------------------------ all_gather, gather

    def allgather(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(inputs, torch.Tensor):  # allgather(output_list, input, timeout=None)
            outputs, inputs = [outputs], [inputs]
        if self._eng is None:
            return self._world.allgather(outputs, inputs)
        inputs = forms.one_tensor(inputs, "all_gather")
        check_tensors([*inputs, *outputs[0]], "all_gather")
        outs = forms.same_as_input(outputs[0], inputs[0], self.size(), self.rank(), "all_gather")
        return self._run("all_gather", inputs, lambda: self._all_gather(inputs[0], outs), outputs)

    def _all_gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        with contextlib.ExitStack() as stack:
            fin = flat_bytes(stack.enter_context(staged(inp, out=False)))
            flats = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs]
            (self._hier or self._eng).all_gather(fin, flats)

    def _all_gather_single(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        with staged(output, out=True) as flat, staged(inp, out=False) as fin:
            if not inp.numel():
                rows: Any = [flat_bytes(flat)] * self.size()
            elif self._hier is None:  # the output's rows as one [n, bytes] view: no object per rank
                rows = flat_bytes(flat).view(self.size(), -1)
            else:
                rows = list(flat_bytes(flat).view(self.size(), -1))
            (self._hier or self._eng).all_gather(flat_bytes(fin), rows)

    def all_gather_single(self, output: Any, input: Any, *args: Any, **kw: Any) -> Any:  # noqa: A002
        direct = self._direct
        if direct is not None:
            work = direct.all_gather(output, input)
            if work is not None:
                return work
        if self._eng is None:
            return self._world._allgather_base(output, input)
        check_tensors([output, input], "all_gather_single")
        forms.whole_of(output, input, self.size(), self.rank(), "all_gather_single")
        nat = self._native
        if nat is not None:
            if self._queues([output, input]) and not forms.overlaps_elsewhere(output, input, self.rank()):
                return self._submit_native("all_gather_single", [input],
                                           lambda call: nat.all_gather(call, flat_bytes(output), flat_bytes(input)),
                                           output, None)
            return self._run_native("all_gather_single", [input], lambda call: self._native_gather(call, output, input),
                                    output)
        return self._run("all_gather_single", [input], lambda: self._all_gather_single(output, input), output)

    _allgather_base = all_gather_single

    def _native_gather(self, call: Any, output: torch.Tensor, inp: torch.Tensor) -> None:
        """all_gather_single on the native path: the input is this rank's row of the output or
        apart from it (any other overlap goes through a copy of its own)."""
        with staged(output, out=True) as flat, staged(inp, out=False) as staged_in:
            out, fin = flat_bytes(flat), flat_bytes(staged_in)
            if forms.overlaps_elsewhere(out, fin, self.rank()):
                fin = fin.clone()
            self._native.run(call, self._native.all_gather(call, out, fin))

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        outputs, inputs = list(outputs), list(inputs)
        if self._eng is None:
            return GatheredWork([self._world._allgather_base(o, i) for o, i in zip(outputs, inputs)], outputs)
        check_tensors([*outputs, *inputs], "all_gather_single_coalesced")
        for o, i in zip(outputs, inputs):
            forms.whole_of(o, i, self.size(), self.rank(), "all_gather_single_coalesced")

        def body() -> None:
            for o, i in zip(outputs, inputs):
                self._all_gather_single(o, i)

        return self._run("all_gather_single_coalesced", inputs, body, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if self._eng is None:
            return self._world.allgather_coalesced(outputs, inputs)
        inputs = list(inputs)
        check_tensors([*inputs, *(t for o in outputs for t in o)], "all_gather_coalesced")
        outs = [forms.same_as_input(o, i, self.size(), self.rank(), "all_gather_coalesced")
                for o, i in zip(outputs, inputs)]

        def body() -> None:
            for o, i in zip(outs, inputs):
                self._all_gather(i, o)

        return self._run("all_gather_coalesced", inputs, body, outputs)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(inputs, torch.Tensor):  # gather(output_list, input, root, timeout=None)
            root = forms.root_of(None, opts, kw)
            outputs, inputs = ([outputs] if outputs else []), [inputs]
        else:
            root = forms.root_of(opts, None, kw)
        if self._eng is None:
            return self._world.gather(outputs, inputs, forms.options(dist.GatherOptions, rootRank=root))
        inp = forms.one_tensor(inputs, "gather")[0]
        self._check_root(root)
        outs = None
        if self.rank() == root:
            check_tensors([inp, *(outputs[0] if outputs else [])], "gather")
            outs = forms.same_as_input(outputs[0] if outputs else [], inp, self.size(), self.rank(), "gather")
        elif outputs and any(len(o) for o in outputs):
            raise BackendError(f"gather: rank {self.rank()} passed a gather_list but is not the root ({root})",
                               fix="pass gather_list on the root (dst) only")
        else:
            check_tensors([inp], "gather")
        return self._run("gather", [inp], lambda: self._gather(outs, inp, root), outputs, root=root)

    def _gather(self, outs: Optional[List[torch.Tensor]], inp: torch.Tensor, root: int) -> None:
        with contextlib.ExitStack() as stack:
            fin = flat_bytes(stack.enter_context(staged(inp, out=False)))
            flats = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs] if outs else None
            if self._hier is not None:
                self._hier.gather(fin, flats, root, self.size())
            else:
                self._eng.all_gather(fin, flats if flats is not None else [None] * self.size(), self._local(root))

    # ------------------------------------------------------------------ reduce_scatter, scatter

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(outputs, torch.Tensor):  # reduce_scatter(output, input_list, op=SUM, timeout=None)
            outputs, inputs, code = [outputs], [inputs], forms.reduce_op(opts, args, kw)
        else:
            code = forms.reduce_op(opts)
        if self._eng is None:
            return self._world.reduce_scatter(outputs, inputs, forms.options(dist.ReduceScatterOptions, reduceOp=code))
        out = forms.one_tensor(outputs, "reduce_scatter")[0]
        check_tensors([out, *inputs[0]], "reduce_scatter")
        parts = forms.same_as_input(inputs[0], out, self.size(), self.rank(), "reduce_scatter")
        fn = reducer(code, out.dtype)
        return self._run("reduce_scatter", [out], lambda: self._reduce_scatter(out, parts, code, fn), outputs, op=code)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None, *args: Any,  # noqa: A002
                              **kw: Any) -> Any:
        direct = self._direct
        if direct is not None and not args and not kw:
            work = direct.reduce_scatter(output, input, opts)
            if work is not None:
                return work
        code = forms.reduce_op(opts, args, kw)
        if self._eng is None:
            return self._world._reduce_scatter_base(output, input,
                                                    forms.options(dist.ReduceScatterOptions, reduceOp=code))
        check_tensors([output, input], "reduce_scatter_single")
        forms.whole_of(input, output, self.size(), self.rank(), "reduce_scatter_single")
        fn = reducer(code, output.dtype)
        nat = self._native
        if nat is not None and nat.reduces(code, output.dtype):
            if self._queues([output, input]) and not forms.overlaps(output, input):
                size = self.size()
                return self._submit_native("reduce_scatter_single", [output],
                                           lambda call: nat.reduce_scatter(call, output, input, code), output,
                                           (lambda: output.div_(size)) if code == AVG else None, op=code)
            return self._run_native("reduce_scatter_single", [output],
                                    lambda call: self._native_scatter(call, output, input, code), output, op=code)
        return self._run("reduce_scatter_single", [output],
                         lambda: self._reduce_scatter_single(output, input, code, fn), output, op=code)

    _reduce_scatter_base = reduce_scatter_single

    def _native_scatter(self, call: Any, output: torch.Tensor, inp: torch.Tensor, code: Any) -> None:
        """reduce_scatter_single on the native path: an output that overlaps the input gets a
        result of its own first."""
        with staged(inp, out=False) as fin, staged(output, out=True) as flat:
            aside = forms.overlaps(flat, fin)
            dst = torch.empty_like(flat) if aside else flat
            self._native.run(call, self._native.reduce_scatter(call, dst, fin, code))
            if code == AVG:
                dst.div_(self.size())
            if aside:
                flat.copy_(dst)

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any,
                                        **kw: Any) -> Any:
        code, outputs, inputs = forms.reduce_op(opts, args, kw), list(outputs), list(inputs)
        if self._eng is None:
            o = forms.options(dist.ReduceScatterOptions, reduceOp=code)
            return GatheredWork([self._world._reduce_scatter_base(a, b, o) for a, b in zip(outputs, inputs)], outputs)
        check_tensors([*outputs, *inputs], "reduce_scatter_single_coalesced")
        for out, inp in zip(outputs, inputs):
            forms.whole_of(inp, out, self.size(), self.rank(), "reduce_scatter_single_coalesced")
        fns = [reducer(code, out.dtype) for out in outputs]

        def body() -> None:
            for out, inp, fn in zip(outputs, inputs, fns):
                self._reduce_scatter_single(out, inp, code, fn)

        return self._run("reduce_scatter_single_coalesced", outputs, body, outputs, op=code)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        with staged(inp, out=False) as flat:
            if self._hier is None and out.numel() and not forms.overlaps(out, flat):
                # the input's parts as one [n, part] view, the output written in place: no object per rank
                with staged(out, out=True) as dst:
                    self._eng.reduce_scatter(flat.view(self.size(), -1), dst, fn)
                    if code == AVG and self.size() > 1:
                        dst.div_(self.size())
                return
            parts = list(flat.view(self.size(), -1)) if out.numel() else [flat] * self.size()
            self._reduce_scatter(out, parts, code, fn)

    def _reduce_scatter(self, out: torch.Tensor, parts: List[torch.Tensor], code: Any, fn: Callable[..., Any]) -> None:
        with contextlib.ExitStack() as stack:
            flats = [stack.enter_context(staged(p, out=False)) for p in parts]
            aside = any(forms.overlaps(out, f) for f in flats)  # in place: a result of its own first
            with staged(torch.empty_like(out) if aside else out, out=True) as dst:
                if self._hier is not None:
                    self._hier.reduce_scatter(flats, dst, SUM if code == AVG else code, fn)
                else:
                    self._eng.reduce_scatter(flats, dst, fn)
                if code == AVG and self.size() > 1:
                    dst.div_(self.size())
                if aside:
                    out.copy_(dst.view(out.shape))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(outputs, torch.Tensor):  # scatter(output, input_list, root, timeout=None)
            root = forms.root_of(None, opts, kw)
            outputs, inputs = [outputs], ([inputs] if inputs else [])
        else:
            root = forms.root_of(opts, None, kw)
        if self._eng is None:
            return self._world.scatter(outputs, inputs, forms.options(dist.ScatterOptions, rootRank=root))
        out = forms.one_tensor(outputs, "scatter")[0]
        self._check_root(root)
        parts: Optional[List[torch.Tensor]] = None
        if self.rank() == root:
            check_tensors([out, *(inputs[0] if inputs else [])], "scatter")
            parts = forms.same_as_input(inputs[0] if inputs else [], out, self.size(), self.rank(), "scatter")
        else:
            check_tensors([out], "scatter")
        return self._run("scatter", [out], lambda: self._scatter(out, parts, root), outputs, root=root)

    def _scatter(self, out: torch.Tensor, parts: Optional[List[torch.Tensor]], root: int) -> None:
        with contextlib.ExitStack() as stack:
            fout = flat_bytes(stack.enter_context(staged(out, out=True)))
            fins = [flat_bytes(stack.enter_context(staged(p, out=False))) for p in parts] if parts else None
            if self._hier is not None:
                self._hier.scatter(fins, fout, root, self.size())
            else:
                self._eng.scatter(fins, fout, self._local(root))

    # ------------------------------------------------------------------ all_to_all, barrier

    def alltoall(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        outs, ins = list(outputs), list(inputs)
        check_tensors([*outs, *ins], "all_to_all")
        agreed = forms.one_dtype(ins, outs, self.rank(), "all_to_all")
        if self._eng is None or self._hier is not None:
            return self._world_all_to_all(outs, ins)
        if len(outs) != self.size() or len(ins) != self.size():
            raise BackendError(f"all_to_all: rank {self.rank()} passed {len(ins)} inputs and {len(outs)} outputs",
                               fix=f"pass one of each per rank ({self.size()})")
        return self._run("all_to_all", agreed, lambda: self._all_to_all(outs, ins), outputs)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any = None,  # noqa: A002
                          input_split_sizes: Any = None, *args: Any, **kw: Any) -> Any:
        check_tensors([output, input], "all_to_all_single")
        agreed = forms.one_dtype([input], [output], self.rank(), "all_to_all_single")
        if self._eng is None or self._hier is not None:
            return self._world.alltoall_base(output, input, list(output_split_sizes or []),
                                             list(input_split_sizes or []))

        ins = forms.split_rows(input, input_split_sizes, self.size(), "input")
        forms.split_rows(output, output_split_sizes, self.size(), "output")

        def body() -> None:
            with staged(output, out=True) as flat:
                outs = forms.split_rows(flat.view(output.shape), output_split_sizes, self.size(), "output")
                self._all_to_all(outs, ins)

        return self._run("all_to_all_single", agreed, body, output)

    alltoall_base = all_to_all_single

    def _world_all_to_all(self, outs: List[torch.Tensor], ins: List[torch.Tensor]) -> Any:
        """The list form on the gloo group of every rank, as one single-tensor call (gloo's list
        form needs equal sizes, and torch 2.9)."""
        flat_in = torch.cat([i.reshape(-1) for i in ins])
        flat_out = torch.empty(sum(o.numel() for o in outs), dtype=flat_in.dtype)
        work = self._world.alltoall_base(flat_out, flat_in, [o.numel() for o in outs], [i.numel() for i in ins])

        def unpack() -> None:
            for o, part in zip(outs, torch.split(flat_out, [o.numel() for o in outs])):
                o.copy_(part.view(o.shape))

        return GatheredWork([work], outs, unpack)

    def _all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        with contextlib.ExitStack() as stack:
            fouts = [flat_bytes(stack.enter_context(staged(o, out=True))) for o in outs]
            fins = [flat_bytes(stack.enter_context(staged(i, out=False))) for i in ins]
            self._eng.all_to_all(fins, fouts)

    def barrier(self, *args: Any, **kw: Any) -> Any:
        if self._eng is None:
            return self._world.barrier()
        direct = self._direct
        if direct is not None:
            work = direct.barrier()
            if work is not None:
                return work
        nat = self._native
        if nat is not None:
            return self._run_native("barrier", [], lambda call: nat.run(call, nat.barrier(call)), None)
        return self._run("barrier", [], (self._hier or self._eng).barrier, None)
