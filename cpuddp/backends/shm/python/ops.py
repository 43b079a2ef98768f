"""Reduce ops of the shm group, and the staging of tensors of any layout.

:func:`reducer` maps a ``ReduceOp`` and a dtype to the torch function applied in rank order
(``AVG`` is a SUM the group divides afterwards), or raises a :class:`BackendError` that names
the pair and the fix.  :func:`rows_reducer` turns it into one op over every rank's slot at once
(``[ranks, n]`` to ``[n]``: ``torch.sum``, ``prod``, ``amin``, ``amax`` over dim 0), so a
call's work does not grow with the rank count.  Each element is reduced by one rank only, so
the result is the same on every rank; the kernel's order is fixed by the sizes, not by the
thread count (tests/test_shm_ops.py), so it is the same run to run.  Where that one op would
not add in rank order, a rank-order loop of the elementwise function runs instead: the bitwise
ops (torch has no reduction for them), every floating-point SUM/AVG (``torch.sum`` sums 5 or
more rows pairwise, not in order) and every float16/bfloat16 op (``torch.sum``/``prod`` would
accumulate in float32 and round once), so each step rounds to the dtype.  That order --
``((row0 op row1) op row2) ...`` -- is the native data path's too
(:mod:`cpuddp.backends.shm.native`): both give the same bits.  Whether torch has a kernel for a (function, dtype) pair is asked of
torch itself, once per pair, so the table holds on every torch version.

:func:`staged` / :func:`flat_bytes`: the collectives work on contiguous 1-D tensors.  A tensor
that is not dense and contiguous (a strided view, a transposed or expanded tensor) is copied
into a contiguous staging tensor and, for outputs, copied back into the view after the call:
the view's elements get the result, memory outside the view is never touched, and ranks that
hold the same values in different layouts get the same result.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError

__all__ = ["reducer", "rows_reducer", "summed", "staged", "dense", "flat_bytes", "check_tensors", "AVG", "SUM"]

_RedOp = dist.ReduceOp.RedOpType
AVG, SUM = _RedOp.AVG, _RedOp.SUM
_FUNCTIONS: Dict[Any, Callable[..., torch.Tensor]] = {
    _RedOp.SUM: torch.add,
    _RedOp.AVG: torch.add,
    _RedOp.PRODUCT: torch.mul,
    _RedOp.MIN: torch.minimum,
    _RedOp.MAX: torch.maximum,
    _RedOp.BAND: torch.bitwise_and,
    _RedOp.BOR: torch.bitwise_or,
    _RedOp.BXOR: torch.bitwise_xor,
}
_works: Dict[Tuple[Any, torch.dtype], bool] = {}


def _torch_has(fn: Callable[..., torch.Tensor], dtype: torch.dtype) -> bool:
    key = (fn, dtype)
    if key not in _works:
        try:
            x = torch.zeros(2, dtype=dtype)
            fn(x, x, out=torch.empty_like(x))
            _works[key] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _works[key] = False
    return _works[key]


#: ``(op, dtype) -> function`` for the pairs :func:`reducer` accepted (a call's lookup, not its checks)
_reducers: Dict[Tuple[Any, torch.dtype], Callable[..., torch.Tensor]] = {}


def reducer(code: Any, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The elementwise function of reduce op ``code`` on ``dtype`` (rank order: ``fn(a, b, out=)``)."""
    known = _reducers.get((code, dtype))
    if known is not None:
        return known
    fn = _FUNCTIONS.get(code)
    name = getattr(code, "name", str(code))
    if fn is None:
        raise BackendError(f"the shm backend cannot reduce with ReduceOp.{name}",
                           fix="use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR (PREMUL_SUM is NCCL's; "
                               "multiply by the factor before an all_reduce with SUM)")
    if code == AVG and not dtype.is_floating_point and not dtype.is_complex:
        raise BackendError(f"ReduceOp.AVG of {dtype} tensors: an average of integers is not an integer",
                           fix="all_reduce with SUM and divide, or use a floating-point dtype")
    if not _torch_has(fn, dtype):
        raise BackendError(f"the shm backend cannot reduce {dtype} tensors with ReduceOp.{name}: torch has no "
                           f"{fn.__name__} kernel for {dtype}",
                           fix=f"cast to a dtype torch can {fn.__name__} (e.g. int64 or float32) before the collective")
    _reducers[(code, dtype)] = fn
    return fn


_ROWS: Dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {
    torch.add: torch.sum, torch.mul: torch.prod, torch.minimum: torch.amin, torch.maximum: torch.amax}
_HALVES = (torch.float16, torch.bfloat16)
_rows_work: Dict[Tuple[Any, torch.dtype], bool] = {}


def rows_reducer(fn: Callable[..., torch.Tensor], dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``reduce(rows, out)``: ``out = rows[0] fn rows[1] fn ...`` for a ``[k, n]`` ``rows`` (any
    strides) -- one op where torch has the reduction (see the module docstring), else a loop in
    row order.  ``out`` must not overlap ``rows``."""
    whole = _ROWS.get(fn)
    if whole is None or _in_rank_order(fn, dtype) or not _rows_kernel(whole, dtype):
        return lambda rows, out: _loop(rows, out, fn)
    if whole in (torch.amin, torch.amax):
        return lambda rows, out: whole(rows, 0, out=out)
    return lambda rows, out: whole(rows, 0, dtype=dtype, out=out)


def _in_rank_order(fn: Callable[..., torch.Tensor], dtype: torch.dtype) -> bool:
    """Must ``fn`` over ``dtype`` run as a rank-order loop (see the module docstring)?"""
    if dtype in _HALVES:
        return fn in (torch.add, torch.mul)
    return fn is torch.add and (dtype.is_floating_point or dtype.is_complex)


def _loop(rows: torch.Tensor, out: torch.Tensor, fn: Callable[..., torch.Tensor]) -> None:
    if rows.shape[0] == 1:
        out.copy_(rows[0])
        return
    each = rows.unbind(0)  # every row's view in one op
    fn(each[0], each[1], out=out)
    for row in each[2:]:
        fn(out, row, out=out)


def _rows_kernel(whole: Callable[..., torch.Tensor], dtype: torch.dtype) -> bool:
    key = (whole, dtype)
    if key not in _rows_work:
        try:
            x = torch.zeros(3, 2, dtype=dtype)
            out = torch.empty(2, dtype=dtype)
            if whole in (torch.amin, torch.amax):
                whole(x, 0, out=out)
            else:
                whole(x, 0, dtype=dtype, out=out)
            _rows_work[key] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _rows_work[key] = False
    return _rows_work[key]


def summed(code: Any) -> Any:
    """The op a backend underneath is asked for: SUM for AVG (the shm group divides the sum
    itself on every path -- shared memory, the hierarchy, whole gloo: torch 2.8's gloo returns
    the sum for an AVG reduce_scatter), else ``code``."""
    return SUM if code == AVG else code


def check_tensors(tensors: Sequence[Any], what: str) -> None:
    """Every tensor a collective takes is a dense CPU tensor: anything else is a clear error."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise BackendError(f"{what} got a {type(t).__name__}, not a tensor", fix="pass torch tensors")
        if t.device.type != "cpu":
            raise BackendError(f"{what} got a tensor on {t.device}: the shm backend moves CPU tensors",
                               fix="move the tensor to the CPU (.cpu()) or use a backend for that device")
        if t.layout != torch.strided:
            raise BackendError(f"{what} got a {t.layout} tensor: the shm backend moves dense tensors",
                               fix="convert it with .todense(), or use backend='gloo' for sparse collectives")


class staged:  # noqa: N801 - used as a function that returns a context
    """``with staged(t, out=True) as flat:`` a contiguous 1-D tensor with ``t``'s values; for an
    output, copied back into ``t`` on exit (only when ``t`` itself is not contiguous)."""

    __slots__ = ("t", "flat", "out")

    def __init__(self, t: torch.Tensor, out: bool) -> None:
        self.t, self.out = t, out
        self.flat = _flat(t) if dense(t) else _flat(t.resolve_conj().resolve_neg().contiguous())

    def __enter__(self) -> torch.Tensor:
        return self.flat

    def __exit__(self, kind: Optional[type], *_: Any) -> None:
        if self.out and kind is None and not dense(self.t):
            self.t.copy_(self.flat.view(self.t.shape))


def dense(t: torch.Tensor) -> bool:
    """Contiguous, with no conjugate or negative bit: its storage holds its values as they are."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as 1-D with stride 1 (a size-1 dimension may carry any stride)."""
    return t.as_strided((t.numel(),), (1,))


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as 1-D bytes (what copy-only collectives move)."""
    return _flat(t).view(torch.uint8)
