"""Per-call agreement for :mod:`cpuddp.shm`: before data moves, the node's ranks compare what
they are about to do.

Every collective on a shm group (the shared-memory allreduce and each one it hands to gloo)
gets a call number.  Its communication thread writes a descriptor -- the call number, the
collective, the reduce op, the dtype, the element count, the root and whether the call goes
through shared memory -- into this rank's ring in the segment, raises its ``posted`` word, waits
until every local peer posted the same call number, and compares.  Any difference is a
:class:`CallMismatch` on every rank, naming both sides' calls, before a byte is summed: a
mismatch can never give a wrong result or shift the pairing of later calls.

Pure helpers (:func:`encode`, :func:`describe`, :func:`first_difference`) are tested without
processes; :class:`Ring` reads and writes the segment's words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from . import check as shm_check

__all__ = ["Call", "CallMismatch", "KINDS", "Ring", "describe", "encode", "first_difference"]

#: collective -> code in a descriptor (0 is "nothing posted")
KINDS = {name: i + 1 for i, name in enumerate((
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "barrier", "gather", "scatter", "reduce", "all_to_all", "all_to_all_single",
    "all_reduce_coalesced", "all_gather_coalesced", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced"))}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
_OPS = {0: "SUM", 1: "AVG", 2: "PRODUCT", 3: "MIN", 4: "MAX", 5: "BAND", 6: "BOR", 7: "BXOR", 8: "PREMUL_SUM"}
ANY = -1  # a field this collective does not pin (it may differ between ranks)


class CallMismatch(RuntimeError):
    """The ranks of a node called different collectives at the same point."""


@dataclass(frozen=True)
class Call:
    """What one rank is about to do: plain integers, ``ANY`` where the field does not apply."""

    kind: int
    op: int = ANY
    dtype: int = ANY
    numel: int = ANY
    root: int = ANY
    shm: int = 0  # 1: through shared memory, 0: handed to gloo
    tensors: int = ANY

    def words(self) -> Tuple[int, ...]:
        return (self.kind, self.op, self.dtype, self.numel, self.root, self.shm, self.tensors)


def dtype_code(dtype: Any) -> int:
    name = str(dtype).rsplit(".", 1)[-1]
    return _DTYPES.index(name) if name in _DTYPES else 99


def encode(kind: str, tensors: Sequence[Any] = (), *, op: Optional[int] = None, root: Optional[int] = None,
           shm: bool = False) -> Call:
    """The :class:`Call` for collective ``kind`` over ``tensors`` (their total element count and
    the first one's dtype; ``()`` when the count may legitimately differ between ranks)."""
    tensors = list(tensors)
    return Call(
        kind=KINDS[kind],
        op=ANY if op is None else int(op),
        dtype=dtype_code(tensors[0].dtype) if tensors else ANY,
        numel=sum(int(t.numel()) for t in tensors) if tensors else ANY,
        root=ANY if root is None else int(root),
        shm=int(shm),
        tensors=len(tensors) if tensors else ANY,
    )


def describe(call: Sequence[int]) -> str:
    """``all_reduce(SUM, float32, 10 elements in 1 tensor, shared memory)``: a descriptor as text."""
    kind, op, dtype, numel, root, shm, tensors = call[:7]
    parts = []
    if op != ANY:
        parts.append(_OPS.get(op, f"op {op}"))
    if dtype != ANY:
        parts.append(_DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else f"dtype {dtype}")
    if numel != ANY:
        parts.append(f"{numel} element{'s' if numel != 1 else ''}"
                     + (f" in {tensors} tensors" if tensors not in (ANY, 1) else ""))
    if root != ANY:
        parts.append(f"root {root}")
    if _KIND_NAMES.get(kind) == "all_reduce":
        parts.append("shared memory" if shm else "gloo (not eligible for shared memory)")
    return f"{_KIND_NAMES.get(kind, f'collective {kind}')}({', '.join(parts)})"


def first_difference(mine: Sequence[int], theirs: Sequence[int]) -> bool:
    """Do two descriptors (without the call number) describe different calls?"""
    return tuple(mine[:7]) != tuple(theirs[:7])


class Ring:
    """This rank's view of the node's descriptor rings and control lines in the segment."""

    def __init__(self, seg: Any) -> None:
        from .segment import C_CHECKED, C_POSTED

        self._seg, self._posted, self._checked = seg, C_POSTED, C_CHECKED
        self.me = seg.local_rank

    def slot_free(self, seq: int) -> bool:
        """May this rank overwrite ring entry ``seq % RING``?  (Every peer checked ``seq - RING``.)"""
        need = seq - shm_check.RING
        return all(line[self._checked] >= need for i, line in enumerate(self._seg.lines) if i != self.me)

    def post(self, seq: int, call: Call) -> None:
        entry = self._seg.rings[self.me][seq % shm_check.RING]
        entry[1:8] = call.words()
        entry[0] = seq
        self._seg.lines[self.me][self._posted] = seq  # x86 TSO: peers that see this see the entry

    def late(self, seq: int) -> List[int]:
        """Local ranks that have not posted call ``seq`` yet."""
        return [i for i, line in enumerate(self._seg.lines) if i != self.me and line[self._posted] < seq]

    def compare(self, seq: int, call: Call, rank_of: Sequence[int]) -> None:
        """Raise :class:`CallMismatch` if any local peer's call ``seq`` differs from ``call``."""
        mine = call.words()
        for i in range(self._seg.size):
            if i == self.me:
                continue
            entry = self._seg.rings[i][seq % shm_check.RING]
            theirs = tuple(entry[1:8])
            if entry[0] != seq or first_difference(mine, theirs):
                raise CallMismatch(
                    f"collective call #{seq} differs between the ranks of this node: rank {rank_of[self.me]} called "
                    f"{describe(mine)}, rank {rank_of[i]} called "
                    f"{describe(theirs) if entry[0] == seq else f'call #{entry[0]} in that slot'}. Every rank must "
                    "call the same collectives in the same order with the same op, dtype and element count; "
                    "no data moved, and the group is now broken")
        self._seg.lines[self.me][self._checked] = seq
