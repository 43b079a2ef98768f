"""The argument forms torch calls a process group with, reduced to what the shm group needs,
and the size checks each collective makes before it moves anything.

torch's Python API and its C++ callers pass option objects (``AllreduceOptions`` and kin); the
pybind overloads also let a user call ``pg.allreduce(tensor)``, ``pg.broadcast(tensor, root)``
and so on.  Each helper here accepts both.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError

from ..protocol.descriptor import ANY, Pinned

__all__ = ["one_tensor", "reduce_op", "options", "span", "overlaps", "overlaps_dense", "overlaps_elsewhere", "split_rows",
           "same_as_input", "root_of", "one_dtype"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def one_tensor(tensors: Any, what: str) -> List[torch.Tensor]:
    """torch passes ``[tensor]``; the legacy multi-device form (several) is an error here."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    tensors = list(tensors)
    if len(tensors) != 1:
        raise BackendError(f"{what} got {len(tensors)} tensors for one rank: the shm backend takes one tensor per "
                           "rank (a CPU rank has one device)",
                           fix="pass one tensor (for several, use the coalesced form or one call each)")
    return tensors


def reduce_op(opts: Any, args: Sequence[Any] = (), kw: Any = None) -> Any:
    """The reduce op (a ``RedOpType``) of an options object, a positional op, or ``op=``."""
    op = getattr(opts, "reduceOp", None)
    if op is None:
        if opts is not None and not hasattr(opts, "timeout"):
            op = opts
        else:
            op = args[0] if args else (kw or {}).get("op")
    if op is None:
        return dist.ReduceOp.RedOpType.SUM
    return op.op if hasattr(op, "op") else dist.ReduceOp(op).op


def root_of(opts: Any, positional: Any, kw: Any) -> Any:
    """The root of an options object (``rootRank``), or of the ``(tensor, root, ...)`` overload."""
    if hasattr(opts, "rootRank"):
        return opts.rootRank
    if positional is not None:
        return positional
    return kw.get("root", 0)


def options(cls: Any, **values: Any) -> Any:
    """An options object of ``cls`` (for the gloo group of every rank, between nodes) with ``values`` set."""
    o = cls()
    for k, v in values.items():
        setattr(o, k, dist.ReduceOp(v) if k == "reduceOp" else v)
    return o


def span(t: torch.Tensor) -> Tuple[int, int]:
    """The addresses ``[start, end)`` that ``t``'s elements lie between (a tensor with elements)."""
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.nbytes
    low = high = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride > 0:
            high += (size - 1) * stride
        else:
            low += (size - 1) * stride
    es = t.element_size()
    return start + low * es, start + (high + 1) * es


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two tensors share bytes?  Asked of their addresses, not their storages: two storages
    may hold one memory (two ``torch.from_numpy`` views of one array, ``torch.frombuffer`` views
    of one buffer), and a collective that read one while writing the other gave wrong sums."""
    if a.is_contiguous() and b.is_contiguous():
        return overlaps_dense(a, b)
    if not a.numel() or not b.numel():
        return False
    a0, a1 = span(a)
    b0, b1 = span(b)
    return a0 < b1 and b0 < a1


def overlaps_dense(a: torch.Tensor, b: torch.Tensor) -> bool:
    """:func:`overlaps` of two contiguous tensors (the direct route's per-call check: two
    addresses and two sizes)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    an, bn = a.nbytes, b.nbytes
    return a0 < b0 + bn and b0 < a0 + an and an > 0 < bn


def overlaps_elsewhere(output: torch.Tensor, inp: torch.Tensor, rank: int) -> bool:
    """Does an all_gather's input share bytes with its output other than as row ``rank``?"""
    own = output.data_ptr() + rank * inp.nbytes
    return bool(inp.numel()) and inp.data_ptr() != own and overlaps(output, inp)


def same_as_input(outs: Sequence[torch.Tensor], inp: torch.Tensor, size: int, rank: int, what: str) -> List[torch.Tensor]:
    """``size`` output tensors of ``inp``'s element count and dtype, or an error naming them."""
    outs = list(outs)
    if len(outs) != size or any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
        shown = [(tuple(o.shape), _name(o.dtype)) for o in outs]
        raise BackendError(f"{what}: rank {rank} passed tensors {shown} beside one of {tuple(inp.shape)} "
                           f"{_name(inp.dtype)}", fix=f"pass {size} tensors of that size and dtype")
    return outs


def whole_of(big: torch.Tensor, part: torch.Tensor, size: int, rank: int, what: str) -> None:
    """``big`` holds ``size`` times ``part``'s elements, in ``part``'s dtype, or an error."""
    if big.numel() != size * part.numel() or big.dtype != part.dtype:
        raise BackendError(f"{what}: rank {rank} passed {big.numel()} {_name(big.dtype)} elements for a part of "
                           f"{part.numel()} {_name(part.dtype)}",
                           fix=f"pass {size} x the part's elements in its dtype")


def split_rows(t: torch.Tensor, sizes: Any, n: int, what: str) -> List[torch.Tensor]:
    """``t`` split along dim 0 into ``sizes`` rows (equal parts when empty)."""
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
    return list(torch.split(t, sizes)) if t.dim() else [t]


def one_dtype(ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], rank: int, what: str) -> Pinned:
    """An all_to_all's buffers share one dtype (one rank's input bytes become another's output),
    or an error; the call's descriptor pins that dtype, not the sizes (they may differ per rank)."""
    names = sorted({_name(t.dtype) for t in (*ins, *outs)})
    if len(names) > 1:
        raise BackendError(f"{what}: rank {rank} passed buffers of dtypes {', '.join(names)}: each rank's input "
                           "and output tensors must share one dtype (the bytes one rank sends are another's output)",
                           fix="pass input and output tensors of one dtype (convert with .to(dtype) around the call)")
    return Pinned(ins, numel=ANY, tensors=ANY, sizes=ANY)
