"""Per-call agreement for the shm group: before data moves, the node's ranks compare what they
are about to do.

Every collective on a shm group gets a call number.  The calling rank writes a descriptor --
the call number, the collective, the reduce op, the dtype, the element count, the root, the
number of tensors and a digest of their sizes -- into its ring in the segment and raises its
``posted`` word; before it reads a byte a peer wrote for this call, it waits until every local
peer posted the same call number and compares.  Any difference is a :class:`CallMismatch` on
every rank, naming both sides' calls, before anything is read: a mismatch can never give a
wrong result or shift the pairing of later calls.

Pure helpers (:func:`encode`, :func:`describe`) are tested without processes; :class:`Ring`
reads and writes the segment's words.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..native.layout import DESC, DESC_WORDS, RING

__all__ = ["Call", "CallMismatch", "KINDS", "Pinned", "READERS", "Ring", "describe", "dtype_name", "encode"]

#: collective -> code in a descriptor (0 is "nothing posted")
KINDS = {name: i + 1 for i, name in enumerate((
    "all_reduce", "broadcast", "all_gather", "all_gather_single", "reduce_scatter",
    "reduce_scatter_single", "barrier", "gather", "scatter", "reduce", "all_to_all", "all_to_all_single",
    "all_reduce_coalesced", "all_gather_coalesced", "all_gather_single_coalesced",
    "reduce_scatter_single_coalesced", "all_reduce_sparse"))}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
_OPS = {0: "SUM", 1: "AVG", 2: "PRODUCT", 3: "MIN", 4: "MAX", 5: "BAND", 6: "BOR", 7: "BXOR", 8: "PREMUL_SUM"}
ANY = -1  # a field this collective does not pin (it may differ between ranks)
WORDS = DESC_WORDS  # fields per descriptor, after the call number (layout.h)


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
    tensors: int = ANY
    sizes: int = ANY  # a digest of each tensor's element count (list forms)

    def words(self) -> Tuple[int, ...]:
        return (self.kind, self.op, self.dtype, self.numel, self.root, self.tensors, self.sizes)


#: the codes of dtypes ``_DTYPES`` lacks start here: each its own, from its name (under 2**16:
#: a sparse tensor's descriptor packs its indices' dtype code into 16 bits)
_OTHER = 1000
_OTHER_SPAN = 60000


def dtype_code(dtype: Any) -> int:
    """A dtype's code in a descriptor: its place in ``_DTYPES``, else one made from its name
    (the same in every process; two dtypes of different names get different codes -- tested
    over every dtype torch has -- so a call's dtype always takes part in the comparison)."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name in _DTYPES:
        return _DTYPES.index(name)
    return _OTHER + zlib.crc32(name.encode()) % _OTHER_SPAN


def dtype_name(code: int) -> str:
    """The dtype a descriptor's code stands for (as text)."""
    if 0 <= code < len(_DTYPES):
        return _DTYPES[code]
    import torch

    names = [str(d).rsplit(".", 1)[-1] for d in vars(torch).values() if isinstance(d, torch.dtype)]
    return next((n for n in names if n not in _DTYPES and dtype_code(n) == code), f"dtype {code}")


class Pinned(list):
    """A call's tensors (its byte count) and descriptor fields its collective sets itself:
    :func:`encode` takes ``fields`` as they are (:mod:`cpuddp.backends.shm.routes.call_args` and
    :mod:`cpuddp.backends.shm.python.sparse` pack all_to_all's dtype and a sparse tensor's layout)."""

    def __init__(self, items: Sequence[Any] = (), /, **fields: int) -> None:
        super().__init__(items)
        self.fields = fields


#: kind code -> the text of a descriptor whose collective packs fields of its own (after the op)
READERS: Dict[int, Callable[[Sequence[int]], List[str]]] = {}


#: single-tensor calls already encoded, ``(kind, op, root, dtype, numel) -> Call`` (a training loop
#: repeats a few shapes; bounded)
_ENCODED: Dict[Tuple[Any, ...], Call] = {}
_ENCODED_MAX = 4096


def encode(kind: str, tensors: Sequence[Any] = (), *, op: Optional[int] = None, root: Optional[int] = None) -> Call:
    """The :class:`Call` for collective ``kind`` over ``tensors`` (the tensors every rank must
    hold alike: their total element count, the first one's dtype, their number and sizes)."""
    if len(tensors) != 1 or getattr(tensors, "fields", None):
        return _encode(kind, tensors, op, root)
    t = tensors[0]
    key = (kind, op, root, t.dtype, t.numel())
    call = _ENCODED.get(key)
    if call is None:
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.clear()
        call = _ENCODED[key] = _encode(kind, tensors, op, root)
    return call


def _encode(kind: str, tensors: Sequence[Any], op: Optional[int], root: Optional[int]) -> Call:
    fields = getattr(tensors, "fields", {})
    tensors = list(tensors)
    sizes = ",".join(str(int(t.numel())) for t in tensors)
    call = Call(
        kind=KINDS[kind],
        op=ANY if op is None else int(op),
        dtype=dtype_code(tensors[0].dtype) if tensors else ANY,
        numel=sum(int(t.numel()) for t in tensors) if tensors else ANY,
        root=ANY if root is None else int(root),
        tensors=len(tensors) if tensors else ANY,
        sizes=zlib.crc32(sizes.encode()) if len(tensors) > 1 else ANY,
    )
    return dataclasses.replace(call, **fields) if fields else call


def describe(call: Sequence[int]) -> str:
    """``all_reduce(SUM, float32, 10 elements in 1 tensor)``: a descriptor as text."""
    kind, op, dtype, numel, root, tensors, sizes = call[:WORDS]
    parts = []
    if op != ANY:
        parts.append(_OPS.get(op, f"op {op}"))
    if kind in READERS:
        return f"{_KIND_NAMES[kind]}({', '.join(parts + READERS[kind](call[:WORDS]))})"
    if dtype != ANY:
        parts.append(dtype_name(dtype))
    if numel != ANY:
        parts.append(f"{numel} element{'s' if numel != 1 else ''}"
                     + (f" in {tensors} tensors" if tensors not in (ANY, 1) else ""))
    if sizes != ANY:
        parts.append(f"sizes #{sizes:08x}")
    if root != ANY:
        parts.append(f"root {root}")
    return f"{_KIND_NAMES.get(kind, f'collective {kind}')}({', '.join(parts)})"


class Ring:
    """This rank's view of the node's descriptor rings and control lines in the segment.  Each
    check is one pass over a view of every rank's words (``min`` over a step slice, one bytes
    comparison of a ring entry across ranks), not a loop over the peers."""

    def __init__(self, seg: Any, fence: Optional[Callable[[], None]] = None) -> None:
        self._seg = seg
        self.me = seg.local_rank
        self._entry = DESC
        self._fence = fence  # the channel's (cpuddp.backends.shm.protocol.channel): None on x86

    def slot_free(self, seq: int) -> List[int]:
        """Local ranks that have not checked call ``seq - RING`` yet (this rank may not overwrite
        ring entry ``seq % RING`` before they have)."""
        need = seq - RING
        checked = self._seg.checked
        return [] if min(checked) >= need else [i for i in self._seg.late(checked, need) if i != self.me]

    def post(self, seq: int, call: Call) -> None:
        fence = self._fence
        if fence is not None:
            fence()  # the peers' `checked` (slot_free) before this entry is written again
        entry = self._seg.rings[self.me][seq % RING]
        entry[1:1 + WORDS] = call.words()
        entry[0] = seq
        if fence is not None:
            fence()  # the entry before `posted`
        self._seg.posted[self.me] = seq  # on x86 (TSO) peers that see this see the entry

    def late(self, seq: int) -> List[int]:
        """Local ranks that have not posted call ``seq`` yet."""
        posted = self._seg.posted
        return [] if min(posted) >= seq else self._seg.late(posted, seq)

    def compare(self, seq: int, call: Call, rank_of: Sequence[int]) -> None:
        """Raise :class:`CallMismatch` if any local peer's call ``seq`` differs from ``call``."""
        seg, size, fence = self._seg, self._seg.size, self._fence
        if fence is not None:
            fence()  # the peers' `posted` (late) before their entries are read
        at = seg.ring_at[seq % RING]
        mine = bytes(seg.mm[at + self.me * self._entry:at + (self.me + 1) * self._entry])
        if seg.mm[at:at + size * self._entry] != mine * size:
            self.mismatch(seq, call, rank_of)
        if fence is not None:
            fence()  # the reads before `checked`
        seg.checked[self.me] = seq

    def mismatch(self, seq: int, call: Call, rank_of: Sequence[int]) -> None:
        """Raise the :class:`CallMismatch` naming the first local peer whose call ``seq`` differs."""
        mine = call.words()
        for i in range(self._seg.size):
            entry = self._seg.rings[i][seq % RING]
            theirs = tuple(entry[1:1 + WORDS])
            if i != self.me and (entry[0] != seq or theirs != mine):
                raise CallMismatch(
                    f"collective call #{seq} differs between the ranks of this node: rank {rank_of[self.me]} called "
                    f"{describe(mine)}, rank {rank_of[i]} called "
                    f"{describe(theirs) if entry[0] == seq else f'call #{entry[0]} in that slot'}. Every rank must "
                    "call the same collectives in the same order with the same op, dtype, root and element count; "
                    "no data was read, and the group is now broken")
