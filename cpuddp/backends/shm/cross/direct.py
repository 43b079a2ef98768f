"""The direct route of a group across nodes whose node part runs on the native data path: a small
``all_reduce`` and ``barrier`` from torch's call to the node's native calls and local rank 0's leg
call, with no Python object made per call (the latency-bound calls: a metric, a loss, a barrier,
FSDP's and ZeRO's small collectives).

:class:`CrossDirect` is :class:`~cpuddp.backends.shm.routes.direct.Direct` (the same checks, the
same remembered call shapes, the same lock and error handling) with the steps of
:class:`~cpuddp.backends.shm.cross.native_hier.NativeHierarchy`'s small ``all_reduce`` -- the
node's sum at local rank 0 (a native reduce), its leg's all-reduce among the nodes' local ranks
0, a native broadcast -- and of its ``barrier``.  What it does not take (a larger tensor, AVG, a
dtype or op the library does not reduce, the other collectives) returns None, and the general
route (:class:`~cpuddp.backends.shm.routes.route_cross.NativeCrossRoute`) runs it, with the same
descriptors: a rank on either route meets its peers on the other.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from ..protocol.descriptor import encode
from ..python.ops import flat_bytes
from ..routes.direct import _AVG_CODE, Direct
from ..routes.stream import ShmWork
from .native_hier import options, small

__all__ = ["CrossDirect"]


class CrossDirect(Direct):
    """A group's direct route across nodes (see the module docstring); ``leg``: the node's leg
    (its ``cross`` group) on local rank 0, None on the node's other ranks."""

    def __init__(self, engine: Any, life: Any, seg: Any, lock: Any, on_error: Any, local: Any, crowded: Any,
                 leg: Optional[Any]) -> None:
        super().__init__(engine, life, seg, lock, on_error, local, crowded)
        self._leg = leg

    def _entry(self, t: torch.Tensor, code: int) -> Optional[Tuple[Any, Any]]:
        """``(call, (reduce's entry, broadcast's entry, the leg's options))`` for an all_reduce of
        ``t``'s dtype and size with op ``code``, or None where this route does not take it."""
        if code == _AVG_CODE or not self.engine.reduces(code, t.dtype):
            return None
        if not small(t.numel(), t.numel() * t.element_size(), self._n):  # NativeHierarchy's large path
            return None
        call, eng = encode("all_reduce", [t], op=code), self.engine
        opts = options(dist.AllreduceOptions, reduceOp=dist.ReduceOp.RedOpType(code))
        return call, (eng.reduce(call, t, 0, code)[0], eng.broadcast(call, flat_bytes(t), 0)[0], opts)

    def all_reduce(self, tensors: Any, opts: Any) -> Optional[ShmWork]:
        entry = self._all_reduce_entry(tensors, opts)
        if entry is None:
            return None
        self._locked(self._all_reduce, tensors, entry)
        return self._finished(tensors)

    def _all_reduce(self, tensors: Any, entry: Tuple[Any, Any]) -> None:
        call, (reduce, bcast, leg_opts) = entry
        ptr = tensors[0].data_ptr()
        self._native(call, reduce, ptr, None)
        if self._leg is not None:
            self._leg.allreduce(tensors, leg_opts).wait()
        self._native(call, bcast, ptr, None)

    def broadcast(self, tensors: Any, opts: Any) -> Optional[ShmWork]:
        return None  # the general route: the root's node first

    def all_gather(self, output: Any, inp: Any) -> Optional[ShmWork]:
        return None

    def reduce_scatter(self, output: Any, inp: Any, opts: Any) -> Optional[ShmWork]:
        return None

    def barrier(self) -> Optional[ShmWork]:
        if not self._usable():
            return None
        self._locked(self._barrier_steps)
        return self._finished(None)

    def _barrier_steps(self) -> None:
        self._native(self._barrier, self._barrier_entry, None, None)
        if self._leg is not None:
            self._leg.barrier().wait()
        self._native(self._barrier, self._barrier_entry, None, None)
