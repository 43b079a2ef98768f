"""The native route of a shm group (:mod:`cpuddp.backends.shm.routes.route`): a one-level, single-node
group whose native library loaded (:mod:`cpuddp.backends.shm.native`)."""

from __future__ import annotations

from typing import Any, List

import torch

from . import call_args
from ..python.ops import AVG, check_tensors, flat_bytes, reducer, staged
from .route_node import NodeRoute

__all__ = ["NativeRoute"]


class NativeRoute(NodeRoute):
    """A one-level, single-node group with the native data path ``nat``
    (:class:`~cpuddp.backends.shm.native.Engine`): all_reduce, reduce, broadcast,
    all_gather_single, reduce_scatter_single and barrier are one native call each (queued on the
    progress thread where one runs and the call is big or others wait -- not an AVG, whose
    division must be done before the next call may touch the tensor); what the library does
    not reduce (dtype, op) and the other collectives run on the Python engine, as on
    :class:`NodeRoute`.  The group's :class:`~cpuddp.backends.shm.routes.direct.Direct`, where it
    has one, is asked before this route, by torch's method itself."""

    def __init__(self, ex: Any, eng: Any, nat: Any) -> None:
        super().__init__(ex, eng)
        self.nat = nat

    def all_reduce(self, tensors: List[Any], code: Any) -> Any:
        nat = self.nat
        elsewhere = self._all_reduce_elsewhere(tensors, code, nat.reduces)
        if elsewhere is not None:
            return elsewhere
        t, ex, size = tensors[0], self.ex, self.size
        if code != AVG and ex.queues([t]):
            return ex.submit_native("all_reduce", [t], lambda call: nat.all_reduce(call, t, code), tensors, op=code)

        def native(call: Any) -> None:
            with staged(t, out=True) as flat:
                nat.run(call, nat.all_reduce(call, flat, code))
                if code == AVG:
                    flat.div_(size)

        return ex.run_native("all_reduce", [t], native, tensors, op=code)

    def reduce(self, tensors: List[Any], root: Any, code: Any) -> Any:
        t = tensors[0]
        check_tensors(tensors, "reduce")
        fn = reducer(code, t.dtype)
        self.ex.check_root(root)
        nat = self.nat
        if not nat.reduces(code, t.dtype):
            return self._reduce_python(tensors, t, root, code, fn)
        mine, local = self.rank == root, self.ex.local_rank_of(root)

        def native(call: Any) -> None:
            with staged(t, out=mine) as flat:
                nat.run(call, nat.reduce(call, flat, local, code))
                if code == AVG and mine:
                    flat.div_(self.size)

        return self.ex.run_native("reduce", [t], native, tensors, op=code, root=root)

    def broadcast(self, tensors: List[Any], root: Any) -> Any:
        t = tensors[0]
        check_tensors(tensors, "broadcast")
        ex = self.ex
        ex.check_root(root)
        nat, local = self.nat, ex.local_rank_of(root)
        if ex.queues([t]):
            return ex.submit_native("broadcast", [t], lambda call: nat.broadcast(call, flat_bytes(t), local),
                                    tensors, root=root)

        def native(call: Any) -> None:
            with staged(t, out=self.rank != root) as flat:
                nat.run(call, nat.broadcast(call, flat_bytes(flat), local))

        return ex.run_native("broadcast", [t], native, tensors, root=root)

    def all_gather_single(self, output: Any, inp: Any) -> Any:
        self._check_all_gather_single(output, inp)
        ex, nat = self.ex, self.nat
        if ex.queues([output, inp]) and not call_args.overlaps_elsewhere(output, inp, self.rank):
            return ex.submit_native("all_gather_single", [inp],
                                    lambda call: nat.all_gather(call, flat_bytes(output), flat_bytes(inp)), output,
                                    keep=(inp,))
        return ex.run_native("all_gather_single", [inp], lambda call: self._native_gather(call, output, inp), output)

    def _native_gather(self, call: Any, output: torch.Tensor, inp: torch.Tensor) -> None:
        """all_gather_single on the native path: the input is this rank's row of the output or
        apart from it (any other overlap goes through a copy of its own)."""
        with staged(output, out=True) as flat, staged(inp, out=False) as staged_in:
            out, fin = flat_bytes(flat), flat_bytes(staged_in)
            if call_args.overlaps_elsewhere(out, fin, self.rank):
                fin = fin.clone()
            self.nat.run(call, self.nat.all_gather(call, out, fin))

    def reduce_scatter_single(self, output: Any, inp: Any, code: Any) -> Any:
        self._check_reduce_scatter_single(output, inp)
        fn = reducer(code, output.dtype)
        ex, nat = self.ex, self.nat
        if not nat.reduces(code, output.dtype):
            return self._reduce_scatter_single_python(output, inp, code, fn)
        if code != AVG and ex.queues([output, inp]) and not call_args.overlaps(output, inp):
            return ex.submit_native("reduce_scatter_single", [output],
                                    lambda call: nat.reduce_scatter(call, output, inp, code), output,
                                    keep=(inp,), op=code)
        return ex.run_native("reduce_scatter_single", [output],
                             lambda call: self._native_scatter(call, output, inp, code), output, op=code)

    def _native_scatter(self, call: Any, output: torch.Tensor, inp: torch.Tensor, code: Any) -> None:
        """reduce_scatter_single on the native path: an output that overlaps the input gets a
        result of its own first."""
        with staged(inp, out=False) as fin, staged(output, out=True) as flat:
            aside = call_args.overlaps(flat, fin)
            dst = torch.empty_like(flat) if aside else flat
            self.nat.run(call, self.nat.reduce_scatter(call, dst, fin, code))
            if code == AVG:
                dst.div_(self.size)
            if aside:
                flat.copy_(dst)

    def barrier(self) -> Any:
        nat = self.nat
        return self.ex.run_native("barrier", [], lambda call: nat.run(call, nat.barrier(call)), None)
