"""The node-local collectives of the shm group, over the node's segment.

Every collective moves its data in rounds.  A round has an epoch ``e``: each rank writes into
its own slot of buffer ``e % 2`` (copy-in), raises its arrival counter to ``e``, waits until
every local peer's counter reached ``e`` (:meth:`cpuddp.backends.shm.protocol.channel.Channel.round`), then reads what it needs
from the peers' slots (copy-out or reduce).  With two buffers one synchronisation per round
suffices: a rank writes buffer ``e % 2`` again only at ``e + 2``, after every peer arrived at
``e + 1``, which it does only after its reads of round ``e``.  Large tensors take several
rounds of at most one slot per rank (``CPUDDP_SHM_SLOT``, 1 MiB by default: the slots stay
in the caches).

Per collective (``n`` local ranks, ``me`` this rank's local rank):

Per-call work does not grow with ``n``: the slots of a buffer are one ``[n, slot]`` view
(:meth:`~cpuddp.backends.shm.protocol.segment.Segment.rows`), so a rank reads or writes every slot in
one op -- one reduction over dim 0 (:func:`cpuddp.backends.shm.python.ops.rows_reducer`), one strided
copy of the parts every rank reduced (the diagonal blocks of the view) -- and every op covers
whole slots, big enough for the rank's intra-op threads.  The views of the segment a round uses
are made once per message size and kept (:meth:`~cpuddp.backends.shm.protocol.segment.Segment.regions`,
``LocalEngine._parts_views``; a training loop repeats a few sizes): in Python, a view costs
about as much as copying 4 KiB.

* ``all_reduce``: 2 ranks -- each copies its chunk in, then sums ``slot0 + slot1`` in rank
  order straight into its own tensor (its own operand read from its tensor, not the slot);
  3 or more -- rank ``i`` reduces part ``i`` of the chunk (parts of equal, 64-byte aligned
  length, the last one shorter) over every slot, in one op, into its slot of the other buffer;
  a second round; then every rank copies every part out in one strided copy (two when the
  last part is short).  Each element is reduced by exactly one rank: the result is
  bit-identical on every rank.  On a node whose NUMA plan has two or more groups: within each
  NUMA node, then across them (:mod:`cpuddp.backends.shm.python.levels`).
* ``reduce``: like all_reduce, only the root reduces (one op over every slot); the others'
  tensors are not changed.
* ``broadcast``: the root copies in, the others copy out.
* ``all_gather`` / ``gather``: each rank copies in, each rank (the root) copies the other
  slots out -- one strided copy on each side of its own row when the outputs are evenly spaced
  rows of one tensor (the single-tensor forms), one copy per rank otherwise (separate tensors).
* ``reduce_scatter``: each rank copies its input's parts into regions of its slot (one strided
  copy when the parts are evenly spaced), then reduces its own region of every slot in one op
  (2 ranks: its own operand from its input, as all_reduce).
* ``scatter``: the root copies part ``r`` into region ``r`` of its slot; rank ``r`` copies it out.
* ``all_to_all``: a first round exchanges every rank's send and receive sizes (an error on every
  rank if they do not match); then each round carries up to ``slot / n`` bytes per pair.
* ``barrier``: the agreement itself (every rank posted the call, so every rank entered it).

Before it reads anything a peer wrote for a call, a rank compares the call's descriptor with
every peer's (:mod:`cpuddp.backends.shm.protocol.descriptor`, driven by the channel): a mismatch is an error
on every rank.  After any error the group is broken: every later call raises at once, and the
segment's abort word makes the peers stop too (:mod:`cpuddp.backends.shm.protocol.channel`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..native.layout import ALIGN
from ..protocol.channel import Channel
from .ops import rows_reducer

__all__ = ["LocalEngine", "part_length", "span", "rows_of", "block"]


def part_length(k: int, n: int, size: int) -> int:
    """Elements per part when ``k`` elements split into ``n`` parts: equal, 64-byte aligned (the
    last parts shorter or empty)."""
    align = max(1, ALIGN // size)
    return max(align, -(-(-(-k // n)) // align) * align)


def span(p: int, k: int, i: int) -> Tuple[int, int]:
    """Part ``i`` of ``k`` elements in parts of ``p``: ``(lo, hi)``, empty past the end."""
    lo = min(i * p, k)
    return lo, min(lo + p, k)


def block(t: torch.Tensor, rows: int, cols: int, row_stride: int, offset: int) -> torch.Tensor:
    """A ``[rows, cols]`` view of ``t``'s storage (element ``offset``, rows ``row_stride`` apart)."""
    return torch.as_strided(t, (rows, cols), (row_stride, 1), offset)


def rows_of(ts: Any) -> Optional[Tuple[torch.Tensor, int, int]]:
    """``(first, step, offset)`` when ``ts`` are 1-D contiguous tensors of one size and dtype,
    evenly spaced (``step`` elements apart, no overlap) in one storage: rows of one view
    (:func:`block`); else None.  A 2-D tensor with contiguous rows (a single-tensor collective's
    ``[n, part]`` view) is its rows."""
    if isinstance(ts, torch.Tensor):
        return ts, ts.stride(0), ts.storage_offset()
    first = ts[0]
    if first is None or first.dim() != 1 or (first.numel() > 1 and first.stride(0) != 1):
        return None
    m, base = first.numel(), first.untyped_storage().data_ptr()
    step = (ts[1].storage_offset() - first.storage_offset()) if len(ts) > 1 and ts[1] is not None else m
    if step < m:
        return None
    for r, t in enumerate(ts):
        if (t is None or t.numel() != m or t.dtype != first.dtype or (m > 1 and t.stride(0) != 1)
                or t.storage_offset() != first.storage_offset() + r * step
                or t.untyped_storage().data_ptr() != base):
            return None
    return first, step, first.storage_offset()


#: sizes whose round views :meth:`LocalEngine._parts_views` keeps (then it starts again)
_VIEWS_MAX = 64


class _PartsOut(NamedTuple):
    """The sources of the copy out of a ``k``-element chunk's parts: ``whole`` parts of ``p``
    elements (the ``diagonal`` blocks of the rows), then a short ``tail`` part (or None)."""

    whole: int
    p: int
    k: int
    diagonal: Optional[torch.Tensor]
    tail: Optional[torch.Tensor]


class _PartsRound(NamedTuple):
    reduce: Optional[torch.Tensor]  # this rank's part of every slot (None: its part is empty)
    result: Optional[torch.Tensor]  # its part of its own slot of the other buffer
    out: _PartsOut


def _copy_parts_out(src: _PartsOut, dst: torch.Tensor) -> None:
    """``dst`` (the chunk) gets every part: one strided copy (and one for a short last part)."""
    if src.diagonal is not None:
        block(dst, src.whole, src.p, src.p, dst.storage_offset()).copy_(src.diagonal)
    if src.tail is not None:
        dst[src.whole * src.p:src.k].copy_(src.tail)


class LocalEngine:
    """One group's collectives among the ranks of this node (used by one thread at a time), over
    its :class:`~cpuddp.backends.shm.protocol.channel.Channel`: each round is ``ch.round(e)``."""

    def __init__(self, ch: Channel) -> None:
        self.ch, self.seg, self.local, self.rank = ch, ch.seg, ch.local, ch.rank
        self.me, self.n = ch.me, ch.n
        #: the two-level all_reduce (:class:`cpuddp.backends.shm.python.levels.TwoLevel`) when the node's
        #: NUMA plan has two or more groups, set by the group; else None: the one-level path
        self.levels: Optional[Any] = None
        self._parts: Dict[Tuple[torch.dtype, int], List[_PartsRound]] = {}

    # ------------------------------------------------------------------ helpers

    def rounds(self, numel: int, cap: int) -> List[Tuple[int, int]]:
        """``(offset, elements)`` of each chunk of ``numel`` elements, ``cap`` at a time."""
        return [(o, min(cap, numel - o)) for o in range(0, numel, cap)]

    def cap(self, t: torch.Tensor, parts: int = 1) -> int:
        """Elements of ``t``'s dtype per slot region when a slot holds ``parts`` regions (aligned)."""
        size = t.element_size()
        per = (self.seg.slot // parts) // ALIGN * ALIGN
        return max(1, per // size)

    def my_part(self, k: int, size: int) -> Tuple[int, int]:
        """This rank's part ``(lo, hi)`` of a ``k``-element chunk of elements of ``size`` bytes."""
        return span(part_length(k, self.n, size), k, self.me)

    @staticmethod
    def row(buf: torch.Tensor, r: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo:hi`` of row ``r`` of ``buf`` (one view op)."""
        return torch.as_strided(buf, (hi - lo,), (1,), buf.storage_offset() + r * buf.stride(0) + lo)

    def part_rows(self, buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Columns ``lo:hi`` of every row of ``buf``: what one op reduces."""
        return block(buf, self.n, hi - lo, buf.stride(0), buf.storage_offset() + lo)

    def parts_out(self, buf: torch.Tensor, k: int, dst: torch.Tensor) -> None:
        """``dst`` (``k`` elements) gets part ``r`` of the chunk from row ``r`` of ``buf``, for every
        ``r``: the diagonal blocks of the rows, in one strided copy (and one for a short last part)."""
        _copy_parts_out(self._parts_out_sources(buf, k), dst)

    def _parts_out_sources(self, buf: torch.Tensor, k: int) -> "_PartsOut":
        p = part_length(k, self.n, buf.element_size())
        whole = min(k // p, self.n)
        diagonal = block(buf, whole, p, buf.stride(0) + p, buf.storage_offset()) if whole else None
        tail = self.row(buf, whole, whole * p, k) if whole < self.n and whole * p < k else None
        return _PartsOut(whole, p, k, diagonal, tail)

    def _parts_views(self, dtype: torch.dtype, k: int) -> List["_PartsRound"]:
        """``[parity]``: the views one round of the N-rank all_reduce of ``k`` elements uses, made
        once per size (a training loop repeats a few): rank ``me``'s part of every slot of buffer
        ``parity`` (what it reduces), its part of its slot of the other buffer (where the result
        goes), and the other buffer's parts (what every rank copies out)."""
        key = (dtype, k)
        views = self._parts.get(key)
        if views is None:
            rows = self.seg.rows(dtype)
            lo, hi = self.my_part(k, rows[0].element_size())
            views = [_PartsRound(self.part_rows(rows[p], lo, hi) if hi > lo else None,
                                 self.row(rows[1 - p], self.me, lo, hi) if hi > lo else None,
                                 self._parts_out_sources(rows[1 - p], k)) for p in (0, 1)]
            if len(self._parts) >= _VIEWS_MAX:
                self._parts.clear()
            self._parts[key] = views
        return views

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, flat: torch.Tensor, fn: Callable[..., Any]) -> None:
        if self.n == 1 or not flat.numel():
            return
        if self.levels is not None:
            self.levels.all_reduce(flat, fn)
        elif self.n == 2:
            self._all_reduce_pair(flat, fn)
        else:
            self._all_reduce_parts(flat, fn)

    def _all_reduce_pair(self, flat: torch.Tensor, fn: Callable[..., Any]) -> None:
        me = self.me
        for o, k in self.rounds(flat.numel(), self.cap(flat)):
            e = self.ch.next_round()
            buf = self.seg.regions(flat.dtype, 0, k)[e & 1]
            mine = flat[o:o + k] if k != flat.numel() else flat
            buf[me].copy_(mine)
            self.ch.round(e)
            theirs = buf[1 - me]
            if me == 0:
                fn(mine, theirs, out=mine)
            else:
                fn(theirs, mine, out=mine)

    def copied_in(self, flat: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor, int]]:
        """Each chunk of ``flat`` (at most a slot) copied into this rank's slot of buffer ``e % 2``,
        and every peer's too (the round's sync): ``(e, chunk, k)``, ``k`` elements."""
        for o, k in self.rounds(flat.numel(), self.cap(flat)):
            e = self.ch.next_round()
            chunk = flat[o:o + k] if k != flat.numel() else flat
            self.seg.regions(flat.dtype, 0, k)[e & 1][self.me].copy_(chunk)
            self.ch.round(e)
            yield e, chunk, k

    def _all_reduce_parts(self, flat: torch.Tensor, fn: Callable[..., Any]) -> None:
        red = rows_reducer(fn, flat.dtype)
        for e, chunk, k in self.copied_in(flat):
            views = self._parts_views(flat.dtype, k)[e & 1]
            if views.reduce is not None:
                red(views.reduce, views.result)
            self.ch.round(e + 1)
            _copy_parts_out(views.out, chunk)

    def reduce(self, flat: torch.Tensor, root: int, fn: Callable[..., Any]) -> None:
        if self.n == 1 or not flat.numel():
            return
        if self.n == 2:
            self._reduce_pair(flat, root, fn)
            return
        rows, me, red = self.seg.rows(flat.dtype), self.me, rows_reducer(fn, flat.dtype)
        for o, k in self.rounds(flat.numel(), self.cap(flat)):
            e = self.ch.next_round()
            buf = rows[e & 1]
            buf[me, :k].copy_(flat[o:o + k])
            self.ch.round(e)
            if me == root:
                red(buf[:, :k], flat[o:o + k])

    def _reduce_pair(self, flat: torch.Tensor, root: int, fn: Callable[..., Any]) -> None:
        me = self.me
        for o, k in self.rounds(flat.numel(), self.cap(flat)):
            e = self.ch.next_round()
            buf = self.seg.regions(flat.dtype, 0, k)[e & 1]
            if me != root:
                buf[me].copy_(flat[o:o + k] if k != flat.numel() else flat)
            self.ch.round(e)
            if me == root:
                mine, theirs = (flat[o:o + k] if k != flat.numel() else flat), buf[1 - me]
                fn(*((mine, theirs) if me == 0 else (theirs, mine)), out=mine)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """``flat``: bytes (:func:`cpuddp.backends.shm.python.ops.flat_bytes`)."""
        if self.n == 1 or not flat.numel():
            return
        me = self.me
        for o, k in self.rounds(flat.numel(), self.cap(flat)):
            e = self.ch.next_round()
            buf = self.seg.regions(torch.uint8, 0, k)[e & 1]
            chunk = flat[o:o + k] if k != flat.numel() else flat
            if me == root:
                buf[me].copy_(chunk)
            self.ch.round(e)
            if me != root:
                chunk.copy_(buf[root])

    def all_gather(self, inp: torch.Tensor, outs: Sequence[Optional[torch.Tensor]], root: Optional[int] = None) -> None:
        """Bytes: ``outs[r]`` gets rank r's ``inp``.  With ``root``: a gather (only the root's
        ``outs`` are written; the others may pass Nones)."""
        me = self.me
        reads = root is None or root == me
        own = outs[me] if reads else None
        if own is not None and own.data_ptr() != inp.data_ptr():
            own.copy_(inp)
        if self.n == 1 or not inp.numel():
            return
        rows = self.seg.rows(torch.uint8)
        spaced = rows_of(outs) if reads else None
        for o, k in self.rounds(inp.numel(), self.cap(inp)):
            e = self.ch.next_round()
            buf = rows[e & 1]
            if root != me or root is None:
                self.seg.regions(torch.uint8, 0, k)[e & 1][me].copy_(inp[o:o + k] if k != inp.numel() else inp)
            self.ch.round(e)
            if reads:
                self._copy_rows_out(buf, k, o, outs, spaced)

    def _copy_rows_out(self, buf: torch.Tensor, k: int, o: int, outs: Sequence[Optional[torch.Tensor]],
                       spaced: Optional[Tuple[torch.Tensor, int, int]]) -> None:
        """Every other rank's row of ``buf`` (``k`` bytes) into its output at ``o``: the rows
        before this rank's and those after it in one strided copy each, when the outputs are
        evenly spaced rows (``spaced``), else one copy per rank."""
        me, n = self.me, self.n
        if spaced is None:
            for r in range(n):
                if r != me:
                    outs[r][o:o + k].copy_(buf[r, :k])  # type: ignore[index]
            return
        first, step, off = spaced
        for a, b in ((0, me), (me + 1, n)):
            if b > a:
                block(first, b - a, k, step, off + a * step + o).copy_(
                    block(buf, b - a, k, buf.stride(0), buf.storage_offset() + a * buf.stride(0)))

    def reduce_scatter(self, inps: Sequence[torch.Tensor], out: torch.Tensor, fn: Callable[..., Any]) -> None:
        """``out`` gets the rank-order reduction of every rank's ``inps[me]``."""
        me, n = self.me, self.n
        if n == 1:
            if out.data_ptr() != inps[0].data_ptr():
                out.copy_(inps[0])
            return
        if n == 2:
            self._reduce_scatter_pair(inps, out, fn)
            return
        rows, red = self.seg.rows(out.dtype), rows_reducer(fn, out.dtype)
        cap = self.cap(out, n)
        spaced = rows_of(inps)
        for o, c in self.rounds(out.numel(), cap):
            e = self.ch.next_round()
            buf = rows[e & 1]
            mine = block(buf, n, c, cap, buf.storage_offset() + me * buf.stride(0))  # region r of my slot
            if spaced is not None:
                first, step, off = spaced
                mine.copy_(block(first, n, c, step, off + o))
            else:
                for r in range(n):
                    mine[r].copy_(inps[r][o:o + c])
            self.ch.round(e)
            red(self.part_rows(buf, me * cap, me * cap + c), out[o:o + c] if c != out.numel() else out)

    def _reduce_scatter_pair(self, inps: Sequence[torch.Tensor], out: torch.Tensor, fn: Callable[..., Any]) -> None:
        me, other, m = self.me, 1 - self.me, out.numel()
        cap = self.cap(out, 2)
        mine_in, their_in = inps[me], inps[other]
        for o, c in self.rounds(m, cap):
            e = self.ch.next_round()
            whole = c == m
            self.seg.regions(out.dtype, other * cap, c)[e & 1][me].copy_(their_in if whole else their_in[o:o + c])
            self.ch.round(e)
            mine = mine_in if whole else mine_in[o:o + c]
            theirs = self.seg.regions(out.dtype, me * cap, c)[e & 1][other]
            fn(*((mine, theirs) if me == 0 else (theirs, mine)), out=out if whole else out[o:o + c])

    def scatter(self, inps: Optional[Sequence[torch.Tensor]], out: torch.Tensor, root: int) -> None:
        """Bytes: rank r's ``out`` gets the root's ``inps[r]``."""
        me, n = self.me, self.n
        if me == root and inps is not None and out.data_ptr() != inps[me].data_ptr():
            out.copy_(inps[me])
        if n == 1 or not out.numel():
            return
        rows = self.seg.rows(torch.uint8)
        cap = self.cap(out, n)
        spaced = rows_of(inps) if me == root and inps is not None else None
        for o, c in self.rounds(out.numel(), cap):
            e = self.ch.next_round()
            buf = rows[e & 1]
            if me == root:
                mine = block(buf, n, c, cap, buf.storage_offset() + me * buf.stride(0))
                if spaced is not None:
                    mine.copy_(block(spaced[0], n, c, spaced[1], spaced[2] + o))
                else:
                    for r in range(n):
                        if r != me:
                            mine[r].copy_(inps[r][o:o + c])  # type: ignore[index]
            self.ch.round(e)
            if me != root:
                out[o:o + c].copy_(buf[root, me * cap:me * cap + c])

    def all_to_all(self, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Bytes: ``outs[r]`` gets rank r's ``ins[me]``.  Sizes may differ per pair; they are
        exchanged first and must match on both ends."""
        me, n = self.me, self.n
        if outs[me].data_ptr() != ins[me].data_ptr() or outs[me].numel() != ins[me].numel():
            if outs[me].numel() != ins[me].numel():
                raise dist.DistBackendError(f"all_to_all: rank {self.rank} sends itself {ins[me].numel()} bytes "
                                            f"but expects {outs[me].numel()}")
            outs[me].copy_(ins[me])
        if n == 1:
            return
        send, recv = self._exchange_sizes([t.numel() for t in ins], [t.numel() for t in outs])
        slots = self.seg.slots(torch.uint8)
        cap = self.cap(ins[0], n)
        longest = max(max(row) for row in send)
        for o in range(0, longest, cap):
            e = self.ch.next_round()
            buf = slots[e & 1]
            for d in range(n):
                k = min(cap, send[me][d] - o)
                if d != me and k > 0:
                    buf[me][d * cap:d * cap + k].copy_(ins[d][o:o + k])
            self.ch.round(e)
            for s in range(n):
                k = min(cap, recv[me][s] - o)
                if s != me and k > 0:
                    outs[s][o:o + k].copy_(buf[s][me * cap:me * cap + k])

    def _exchange_sizes(self, send: List[int], recv: List[int]) -> Tuple[List[List[int]], List[List[int]]]:
        """Every rank's send and receive byte counts (a round of their own), checked pairwise."""
        n = self.n
        slots = self.seg.slots(torch.int64)
        e = self.ch.next_round()
        buf = slots[e & 1]
        buf[self.me][:2 * n].copy_(torch.tensor(send + recv, dtype=torch.int64))
        self.ch.round(e)
        rows = [buf[r][:2 * n].tolist() for r in range(n)]
        sends, recvs = [row[:n] for row in rows], [row[n:] for row in rows]
        wrong = [(a, b) for a in range(n) for b in range(n) if a != b and sends[a][b] != recvs[b][a]]
        if wrong:
            a, b = wrong[0]
            raise dist.DistBackendError(
                f"all_to_all: rank {self.local[a]} sends {sends[a][b]} bytes to rank {self.local[b]}, which expects "
                f"{recvs[b][a]}: every rank's output split sizes must be the senders' input split sizes")
        return sends, recvs

    def barrier(self) -> None:
        self.ch.settle()
