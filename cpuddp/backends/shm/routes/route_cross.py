"""The native route of a shm group across nodes (:mod:`cpuddp.backends.shm.routes.route`): the
node part of all_reduce, broadcast, all_gather_single, reduce_scatter_single and barrier on the
native data path (:class:`~cpuddp.backends.shm.cross.native_hier.NativeHierarchy`), the leg between
nodes as on :class:`~cpuddp.backends.shm.routes.route_node.CrossRoute`; what the library does not
reduce (dtype, op) and the other collectives take the Python engine's hierarchy, as there."""

from __future__ import annotations

from typing import Any, List


from ..python.ops import AVG, check_tensors, flat_bytes, reducer, staged, summed
from .route_node import CrossRoute

__all__ = ["NativeCrossRoute"]


class NativeCrossRoute(CrossRoute):
    """Several nodes, one level inside each, the native library loaded on every rank: ``nhier``
    (the native hierarchy) for what ``nat`` reduces, ``hier`` (the Python one) for the rest."""

    def __init__(self, ex: Any, eng: Any, hier: Any, world: Any, nat: Any, nhier: Any) -> None:
        super().__init__(ex, eng, hier, world)
        self.nat, self.nhier = nat, nhier

    def all_reduce(self, tensors: List[Any], code: Any) -> Any:
        elsewhere = self._all_reduce_elsewhere(tensors, code, lambda c, d: self.nat.reduces(summed(c), d))
        if elsewhere is not None:
            return elsewhere
        t, size, nhier = tensors[0], self.size, self.nhier

        def native(call: Any) -> None:
            with staged(t, out=True) as flat:
                nhier.all_reduce(call, flat, summed(code))
                if code == AVG:
                    flat.div_(size)

        return self.ex.run_native("all_reduce", [t], native, tensors, op=code)

    def broadcast(self, tensors: List[Any], root: Any) -> Any:
        t = tensors[0]
        check_tensors(tensors, "broadcast")
        self.ex.check_root(root)

        def native(call: Any) -> None:
            with staged(t, out=self.rank != root) as flat:
                self.nhier.broadcast(call, flat_bytes(flat), root)

        return self.ex.run_native("broadcast", [t], native, tensors, root=root)

    def all_gather_single(self, output: Any, inp: Any) -> Any:
        self._check_all_gather_single(output, inp)

        def native(call: Any) -> None:
            with staged(output, out=True) as flat, staged(inp, out=False) as fin:
                self.nhier.all_gather(call, flat_bytes(flat), flat_bytes(fin))

        return self.ex.run_native("all_gather_single", [inp], native, output)

    def reduce_scatter_single(self, output: Any, inp: Any, code: Any) -> Any:
        self._check_reduce_scatter_single(output, inp)
        fn = reducer(code, output.dtype)
        if not self.nat.reduces(summed(code), output.dtype):
            return self._reduce_scatter_single_python(output, inp, code, fn)
        size = self.size

        def native(call: Any) -> None:
            with staged(inp, out=False) as fin, staged(output, out=True) as flat:
                self.nhier.reduce_scatter(call, flat, fin, summed(code))
                if code == AVG:
                    flat.div_(size)

        return self.ex.run_native("reduce_scatter_single", [output], native, output, op=code)

    def barrier(self) -> Any:
        return self.ex.run_native("barrier", [], self.nhier.barrier, None)
