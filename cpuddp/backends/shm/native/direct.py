"""The direct route of a native group: ``all_reduce`` and ``barrier`` from torch's call to one
native call, with no Python object made per call.

:class:`~cpuddp.backends.shm.calls.Collectives` asks :class:`Direct` first; it takes the call
only in the common case -- one dense, contiguous CPU tensor of a dtype and op the library
reduces (AVG excluded: the general route divides), a live group in its own process, no
communication thread -- and returns None for anything else, which the general route (the same
checks as always, then the same native call or the Python engine) handles.  Per call it does
the checks that protect the native code (type, device, layout, contiguity), one dict lookup
for what the call's shape was agreed as (its descriptor, made once per dtype, size and op), one
native call under the stream's lock, and hands back a finished Work it reuses while nobody else
holds it (a Work a caller kept is never changed: a new one is made instead).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

import torch

from ..agree import encode
from ..stream import ShmWork

__all__ = ["Direct"]

_ENTRIES_MAX = 4096


class Direct:
    """One group's direct route (see the module docstring)."""

    def __init__(self, engine: Any, life: Any, seg: Any, lock: Any, on_error: Any) -> None:
        from ..channel import State

        self.engine, self.life, self.seg, self.lock, self.on_error = engine, life, seg, lock, on_error
        self._live = State.LIVE
        self._call, self._ctx = engine.lib.call, engine.ctx
        self._entries: Dict[Tuple[Any, int, Any], Optional[Tuple[Any, Any]]] = {}
        self._barrier = encode("barrier", [])
        self._barrier_entry = engine.barrier(self._barrier)[0]
        self._work = ShmWork.done(None)
        self._free = sys.getrefcount(self._work)  # nobody but this object holds it

    def _entry(self, t: torch.Tensor, op: Any) -> Optional[Tuple[Any, Any]]:
        """``(call, the library's entry)`` for an all_reduce of ``t``'s dtype and size with
        ``op``, or None where the direct route does not take it."""
        if op == torch.distributed.ReduceOp.RedOpType.AVG or not self.engine.reduces(op, t.dtype):
            return None
        call = encode("all_reduce", [t], op=int(op))
        return call, self.engine.all_reduce(call, t, op)[0]

    def _finished(self, result: Any) -> ShmWork:
        work = self._work
        if sys.getrefcount(work) > self._free + 1:  # someone kept the last one: leave it as it is
            work = self._work = ShmWork.done(result)
        else:  # its future (if one was asked for) holds the last call's result: the next one makes its own
            work._result, work._fut = result, None
        return work

    def all_reduce(self, tensors: Any, opts: Any) -> Optional[ShmWork]:
        if type(tensors) is not list or len(tensors) != 1 or self.life.state is not self._live or self.seg.forked:
            return None
        t = tensors[0]
        if type(t) is not torch.Tensor or not t.is_cpu or t.layout is not torch.strided or not t.is_contiguous() \
                or t.is_neg():
            return None
        op = getattr(getattr(opts, "reduceOp", None), "op", None)
        if op is None:
            return None
        key = (t.dtype, t.numel(), op)
        entries = self._entries
        entry = entries.get(key, False)
        if entry is False:
            if len(entries) >= _ENTRIES_MAX:
                entries.clear()
            entry = entries[key] = self._entry(t, op)
        if entry is None:
            return None
        call, prepared = entry
        with self.lock:
            try:
                rc = self._call(self._ctx, prepared, t.data_ptr(), None)
                if rc:
                    self.engine.done(rc, call)
            except BaseException as exc:
                self.on_error(exc)
                raise
        return self._finished(tensors)

    def barrier(self) -> Optional[ShmWork]:
        if self.life.state is not self._live or self.seg.forked:
            return None
        with self.lock:
            try:
                rc = self._call(self._ctx, self._barrier_entry, None, None)
                if rc:
                    self.engine.done(rc, self._barrier)
            except BaseException as exc:
                self.on_error(exc)
                raise
        return self._finished(None)
