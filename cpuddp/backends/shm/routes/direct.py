"""The direct route of a native group: ``all_reduce``, ``broadcast``, ``all_gather_single``,
``reduce_scatter_single`` and ``barrier`` from torch's call to one native call, with no Python
object made per call.

:class:`~cpuddp.backends.shm.group.calls.Collectives` asks :class:`Direct` first; it takes the call
only in the common case -- plain, dense, contiguous CPU tensors of one dtype (and, for a
reduction, an op the library reduces; AVG excluded: the general route divides), the sizes the
collective needs, an input that is the output's own row or apart from it, a root of the group,
a live group in its own process, no communication thread -- and returns None for anything
else, which the general route (the same checks as always, then the same native call or the
Python engine, with its errors) handles.  Per call it does
the checks that protect the native code (type, device, layout, contiguity), one dict lookup
for what the call's shape was agreed as (its descriptor, made once per dtype, size and op), one
native call under the stream's lock, and hands back a finished Work it reuses while nobody else
holds it (a Work a caller kept is never changed: a new one is made instead).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ..protocol.descriptor import encode
from .call_args import overlaps_dense
from ..python.ops import dense, flat_bytes
from .stream import ShmWork

__all__ = ["Direct"]

_ENTRIES_MAX = 4096
_SUM = torch.distributed.ReduceOp.SUM
_SUM_CODE = int(torch.distributed.ReduceOp.RedOpType.SUM)
_AVG_CODE = int(torch.distributed.ReduceOp.RedOpType.AVG)


class Direct:
    """One group's direct route (see the module docstring)."""

    def __init__(self, engine: Any, life: Any, seg: Any, lock: Any, on_error: Any, local: Sequence[int],
                 crowded: Any = lambda: None) -> None:
        """``local``: the group's ranks in local-rank order (a single-node group: all of them);
        ``crowded()``: this thread found ``lock`` held by another (two threads call at once)."""
        from ..protocol.channel import State

        self.engine, self.life, self.seg, self.lock, self.on_error = engine, life, seg, lock, on_error
        self.crowded = crowded
        self._local = {rank: i for i, rank in enumerate(local)}
        self._n = len(local)
        self._live = State.LIVE
        self._call, self._ctx = engine.lib.call, engine.ctx
        self._entries: Dict[Tuple[Any, int, Any], Optional[Tuple[Any, Any]]] = {}
        self._barrier = encode("barrier", [])
        self._barrier_entry = engine.barrier(self._barrier)[0]
        self._work = ShmWork.done(None)
        # what sys.getrefcount says of it while nobody but this object holds it, read with the
        # expression _finished reads it with (Python 3.14 borrows a local's reference for a call)
        self._free = sys.getrefcount(self._work)

    def _entry(self, t: torch.Tensor, code: int) -> Optional[Tuple[Any, Any]]:
        """``(call, the library's entry)`` for an all_reduce of ``t``'s dtype and size with
        op ``code``, or None where the direct route does not take it."""
        if code == _AVG_CODE or not self.engine.reduces(code, t.dtype):
            return None
        call = encode("all_reduce", [t], op=code)
        return call, self.engine.all_reduce(call, t, code)[0]

    def _finished(self, result: Any) -> ShmWork:
        if sys.getrefcount(self._work) > self._free:  # someone kept the last one: leave it as it is
            work = self._work = ShmWork.done(result)
            return work
        work = self._work  # its future (if one was asked for) held the last call's result: this one makes its own
        work._result, work._fut = result, None
        return work

    def all_reduce(self, tensors: Any, opts: Any) -> Optional[ShmWork]:
        entry = self._all_reduce_entry(tensors, opts)
        if entry is None:
            return None
        self._run(entry[0], entry[1], tensors[0].data_ptr(), None)
        return self._finished(tensors)

    def _all_reduce_entry(self, tensors: Any, opts: Any) -> Optional[Tuple[Any, Any]]:
        """What an all_reduce of ``tensors`` was agreed as (:meth:`_entry`, remembered per dtype,
        size and op), or None where this route does not take it."""
        if type(tensors) is not list or len(tensors) != 1 or not self._usable() or not _plain(tensors[0]):
            return None
        t = tensors[0]
        code = _op_code(opts)
        if code is None:
            return None
        key = (t.dtype, t.numel(), code)
        entry = self._entries.get(key, False)
        if entry is False:
            entry = self._add(key, self._entry(t, code))
        return entry

    def _run(self, call: Any, prepared: Any, a: Any, b: Any) -> None:
        self._locked(self._native, call, prepared, a, b)

    def _native(self, call: Any, prepared: Any, a: Any, b: Any) -> None:
        """One native call (the library's prepared ``call`` on ``a``, ``b``); its error raised."""
        rc = self._call(self._ctx, prepared, a, b)
        if rc:
            self.engine.done(rc, call)

    def _locked(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` under the stream's lock, its error the group's (``on_error``)."""
        lock = self.lock
        if not lock.acquire(False):  # another thread's call runs: two threads call at once
            self.crowded()
            lock.acquire()
        try:
            fn(*args)
        except BaseException as exc:
            self.on_error(exc)
            raise
        finally:
            lock.release()

    def _usable(self) -> bool:
        return self.life.state is self._live and not self.seg.forked

    def _shape(self, key: Tuple[Any, ...], make: Any) -> Optional[Tuple[Any, Any]]:
        entry = self._entries.get(key, False)
        return self._add(key, make()) if entry is False else entry

    def _add(self, key: Tuple[Any, ...], entry: Optional[Tuple[Any, Any]]) -> Optional[Tuple[Any, Any]]:
        """Remember what the call of shape ``key`` was agreed as (at most ``_ENTRIES_MAX`` shapes)."""
        if len(self._entries) >= _ENTRIES_MAX:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def broadcast(self, tensors: Any, opts: Any) -> Optional[ShmWork]:
        if type(tensors) is not list or len(tensors) != 1 or not self._usable():
            return None
        t = tensors[0]
        root = getattr(opts, "rootRank", None)
        if not _plain(t) or type(root) is not int or root not in self._local:
            return None
        local = self._local[root]

        def make() -> Tuple[Any, Any]:
            call = encode("broadcast", [t], root=root)
            return call, self.engine.broadcast(call, flat_bytes(t), local)[0]

        call, prepared = self._shape(("broadcast", t.dtype, t.numel(), root), make)  # type: ignore[misc]
        self._run(call, prepared, t.data_ptr(), None)
        return self._finished(tensors)

    def all_gather(self, output: Any, inp: Any) -> Optional[ShmWork]:
        """all_gather_single: ``inp`` into row ``rank`` of ``output`` on every rank."""
        if not self._usable() or not _plain(output) or not _plain(inp) or output.dtype != inp.dtype \
                or output.numel() != inp.numel() * self._n:
            return None
        o0, i0, k = output.data_ptr(), inp.data_ptr(), inp.nbytes  # overlaps_dense, inlined (a hot path)
        if i0 != o0 + self.engine.ch.me * k and i0 < o0 + output.nbytes and o0 < i0 + k and k:
            return None  # shares bytes, by address, other than as its own row (local rank = rank: one node)

        def make() -> Tuple[Any, Any]:
            call = encode("all_gather_single", [inp])
            return call, self.engine.all_gather(call, flat_bytes(output), flat_bytes(inp))[0]

        call, prepared = self._shape(("all_gather", inp.dtype, inp.numel()), make)  # type: ignore[misc]
        self._run(call, prepared, output.data_ptr(), inp.data_ptr())
        return self._finished(output)

    def reduce_scatter(self, output: Any, inp: Any, opts: Any) -> Optional[ShmWork]:
        """reduce_scatter_single: part ``rank`` of every rank's ``inp``, reduced, into ``output``."""
        if not self._usable() or not _plain(output) or not _plain(inp) or output.dtype != inp.dtype \
                or inp.numel() != output.numel() * self._n or overlaps_dense(output, inp):
            return None
        code = _op_code(opts)
        if code is None or code == _AVG_CODE or not self.engine.reduces(code, output.dtype):
            return None

        def make() -> Tuple[Any, Any]:
            call = encode("reduce_scatter_single", [output], op=code)
            return call, self.engine.reduce_scatter(call, output, inp, code)[0]

        call, prepared = self._shape(("reduce_scatter", output.dtype, output.numel(), code), make)  # type: ignore[misc]
        self._run(call, prepared, output.data_ptr(), inp.data_ptr())
        return self._finished(output)

    def barrier(self) -> Optional[ShmWork]:
        if self.life.state is not self._live or self.seg.forked:  # _usable, inlined: torch's own
            return None  # barrier wrapper costs 2.9 µs of the 4 µs a barrier takes (Zen 4); this is the rest
        self._run(self._barrier, self._barrier_entry, None, None)
        return self._finished(None)


def _op_code(opts: Any) -> Optional[int]:
    """``opts``' reduce op as an int, or None where it carries none.  SUM is found with
    ReduceOp's own ``==`` (0.3 µs on a Zen 4, where reading ``.op`` and hashing the enum it returns cost 1.1)."""
    try:
        return _SUM_CODE if opts.reduceOp == _SUM else int(opts.reduceOp.op)
    except (AttributeError, TypeError):
        return None


def _plain(t: Any) -> bool:
    """A plain, dense, contiguous CPU tensor (what the library may take as it is)."""
    return type(t) is torch.Tensor and t.is_cpu and t.layout is torch.strided and dense(t)
