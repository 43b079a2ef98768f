"""The node-local collectives of the shm group, over the node's segment.

Every collective moves its data in rounds.  A round has an epoch ``e``: each rank writes into
its own slot of buffer ``e % 2`` (copy-in), raises its arrival counter to ``e``, waits until
every local peer's counter reached ``e`` (:meth:`LocalEngine.sync`), then reads what it needs
from the peers' slots (copy-out or reduce).  With two buffers one synchronisation per round
suffices: a rank writes buffer ``e % 2`` again only at ``e + 2``, after every peer arrived at
``e + 1``, which it does only after its reads of round ``e``.  Large tensors take several
rounds of at most one slot per rank (``CPUDDP_SHM_SLOT``, 1 MiB by default: the slots stay
in the caches).

Per collective (``n`` local ranks, ``me`` this rank's local rank):

* ``all_reduce``: 2 ranks -- each copies its chunk in, then sums ``slot0 + slot1`` in rank
  order straight into its own tensor (its own operand read from its tensor, not the slot);
  3 or more -- rank ``i`` reduces part ``i`` of the chunk over every slot into its slot of the
  other buffer, a second round, then every rank copies all parts out.  Every element is
  reduced in rank order by one code path: the result is bit-identical on every rank.
* ``reduce``: like all_reduce, only the root reduces; the others' tensors are not changed.
* ``broadcast``: the root copies in, the others copy out.
* ``all_gather`` / ``gather``: each rank copies in, each rank (the root) copies every slot out.
* ``reduce_scatter``: each rank copies the parts other ranks own into its slot, then reduces
  its own part in rank order from every slot (its own operand from its input).
* ``scatter``: the root copies part ``r`` into region ``r`` of its slot; rank ``r`` copies it out.
* ``all_to_all``: a first round exchanges every rank's send and receive sizes (an error on every
  rank if they do not match); then each round carries up to ``slot / n`` bytes per pair.
* ``barrier``: the agreement itself (every rank posted the call, so every rank entered it).

Before it reads anything a peer wrote for a call, a rank compares the call's descriptor with
every peer's (:mod:`cpuddp.backends.shm.agree`): a mismatch is an error on every rank.  After
any error the engine is broken: every later call raises at once, and the segment's abort word
makes the peers stop too.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .agree import Call, Ring, describe
from .segment import C_CHECKED, W_ABORT, Segment
from .wait import Waiter

__all__ = ["LocalEngine"]

_ALIGN = 64


def _parts(n: int, parts: int, i: int) -> Tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


def _reduce_into(dst: torch.Tensor, parts: Sequence[torch.Tensor], fn: Callable[..., Any]) -> None:
    """``dst = parts[0] op parts[1] op ...`` in rank order (bit-identical wherever it runs).
    ``dst`` may be ``parts[0]`` or ``parts[1]``, never a later part."""
    if len(parts) == 1:
        dst.copy_(parts[0])
        return
    fn(parts[0], parts[1], out=dst)
    for p in parts[2:]:
        fn(dst, p, out=dst)


class LocalEngine:
    """One group's collectives among the ranks of this node (used by one thread at a time)."""

    def __init__(self, seg: Segment, local: Sequence[int], rank: int, waiter: Waiter) -> None:
        self.seg, self.local, self.rank, self.waiter = seg, tuple(local), rank, waiter
        self.me, self.n = seg.local_rank, seg.size
        self.ring = Ring(seg)
        self.epoch = 0
        self.seq = 0
        self.calls = 0
        self.broken: Optional[str] = None
        self._unchecked: Optional[Tuple[int, Call]] = None

    # ------------------------------------------------------------------ agreement and waiting

    def begin(self, call: Call) -> None:
        """Post the next call's descriptor; it is compared at the call's first round (or by
        :meth:`settle` for a call without one)."""
        if self.broken is not None:
            raise dist.DistBackendError(f"the shm process group is broken by an earlier error: {self.broken}")
        self.seq += 1
        seq = self.seq
        if self.n > 1 and self.ring.slot_free(seq):
            self.waiter.until(lambda: self.ring.slot_free(seq), f"call #{seq - 16} to be checked", self._poll)
        self.ring.post(seq, call)
        self._unchecked = (seq, call)
        self.calls += 1

    def settle(self) -> None:
        """Finish the posted call's agreement: wait until every local peer posted it, compare."""
        if self._unchecked is None:
            return
        seq, call = self._unchecked
        if self.ring.late(seq):
            self.waiter.until(lambda: self.ring.late(seq), f"collective call #{seq} ({describe(call.words())})",
                              self._poll)
        self._unchecked = None
        self.ring.compare(seq, call, self.local)

    def _poll(self) -> None:
        """While waiting: a peer that posted a different call is a mismatch now, not at the timeout."""
        if self._unchecked is not None and not self.ring.late(self._unchecked[0]):
            self.settle()

    def sync(self, e: int) -> None:
        """Announce arrival at round ``e``; return once every local peer has arrived there (and
        the call's descriptors, posted before any round, are compared)."""
        seg = self.seg
        seg.mine.value = e
        for c in seg.others:
            if c.value < e:
                counters = seg.counters
                self.waiter.until(lambda: [i for i, x in enumerate(counters) if x.value < e],
                                  f"a shared-memory round ({e})", self._poll)
                break
        if self._unchecked is not None:
            self.settle()
        if seg.words[W_ABORT]:  # a peer gave up: what it left in the slots may be from a call it abandoned
            self.waiter.check_abort()
        self.epoch = e

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self.waiter.abort(self.me)

    def mark_checked(self) -> None:
        """Leaving: peers waiting for this rank to check a call are not held up by it."""
        self.seg.lines[self.me][C_CHECKED] = 1 << 62

    # ------------------------------------------------------------------ helpers

    def _rounds(self, numel: int, cap: int) -> List[Tuple[int, int]]:
        return [(o, min(cap, numel - o)) for o in range(0, numel, cap)]

    def _cap(self, t: torch.Tensor, parts: int = 1) -> int:
        """Elements of ``t``'s dtype per slot region when a slot holds ``parts`` regions (aligned)."""
        size = t.element_size()
        per = (self.seg.slot // parts) // _ALIGN * _ALIGN
        return max(1, per // size)

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, flat: torch.Tensor, fn: Callable[..., Any]) -> None:
        if self.n == 1 or not flat.numel():
            return
        if self.n == 2:
            self._all_reduce_pair(flat, fn)
        else:
            self._all_reduce_parts(flat, fn)

    def _all_reduce_pair(self, flat: torch.Tensor, fn: Callable[..., Any]) -> None:
        slots, me = self.seg.slots(flat.dtype), self.me
        for o, k in self._rounds(flat.numel(), self._cap(flat)):
            e = self.epoch + 1
            buf = slots[e & 1]
            mine = flat[o:o + k]
            buf[me][:k].copy_(mine)
            self.sync(e)
            theirs = buf[1 - me][:k]
            if me == 0:
                fn(mine, theirs, out=mine)
            else:
                fn(theirs, mine, out=mine)

    def _all_reduce_parts(self, flat: torch.Tensor, fn: Callable[..., Any]) -> None:
        slots, me, n = self.seg.slots(flat.dtype), self.me, self.n
        for o, k in self._rounds(flat.numel(), self._cap(flat)):
            e = self.epoch + 1
            src, out = slots[e & 1], slots[(e + 1) & 1]
            src[me][:k].copy_(flat[o:o + k])
            self.sync(e)
            lo, hi = _parts(k, n, me)
            if hi > lo:
                _reduce_into(out[me][lo:hi], [s[lo:hi] for s in src], fn)
            self.sync(e + 1)
            for r in range(n):
                a, b = _parts(k, n, r)
                if b > a:
                    flat[o + a:o + b].copy_(out[r][a:b])

    def reduce(self, flat: torch.Tensor, root: int, fn: Callable[..., Any]) -> None:
        if self.n == 1 or not flat.numel():
            return
        slots, me = self.seg.slots(flat.dtype), self.me
        own_slot = me != root or me > 1  # the root's own operand must not be overwritten early
        for o, k in self._rounds(flat.numel(), self._cap(flat)):
            e = self.epoch + 1
            buf = slots[e & 1]
            if own_slot:
                buf[me][:k].copy_(flat[o:o + k])
            self.sync(e)
            if me == root:
                parts = [flat[o:o + k] if r == me and not own_slot else buf[r][:k] for r in range(self.n)]
                _reduce_into(flat[o:o + k], parts, fn)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """``flat``: bytes (:func:`cpuddp.backends.shm.ops.flat_bytes`)."""
        if self.n == 1 or not flat.numel():
            return
        slots, me = self.seg.slots(torch.uint8), self.me
        for o, k in self._rounds(flat.numel(), self._cap(flat)):
            e = self.epoch + 1
            buf = slots[e & 1]
            if me == root:
                buf[me][:k].copy_(flat[o:o + k])
            self.sync(e)
            if me != root:
                flat[o:o + k].copy_(buf[root][:k])

    def all_gather(self, inp: torch.Tensor, outs: Sequence[Optional[torch.Tensor]], root: Optional[int] = None) -> None:
        """Bytes: ``outs[r]`` gets rank r's ``inp``.  With ``root``: a gather (only the root's
        ``outs`` are written; the others may pass Nones)."""
        me = self.me
        reads = root is None or root == me
        if reads and outs[me] is not None and outs[me].data_ptr() != inp.data_ptr():  # type: ignore[union-attr]
            outs[me].copy_(inp)  # type: ignore[union-attr]
        if self.n == 1 or not inp.numel():
            return
        slots = self.seg.slots(torch.uint8)
        for o, k in self._rounds(inp.numel(), self._cap(inp)):
            e = self.epoch + 1
            buf = slots[e & 1]
            if root != me or root is None:
                buf[me][:k].copy_(inp[o:o + k])
            self.sync(e)
            if reads:
                for r in range(self.n):
                    if r != me:
                        outs[r][o:o + k].copy_(buf[r][:k])  # type: ignore[index]

    def reduce_scatter(self, inps: Sequence[torch.Tensor], out: torch.Tensor, fn: Callable[..., Any]) -> None:
        """``out`` gets the rank-order reduction of every rank's ``inps[me]``."""
        me, n = self.me, self.n
        if n == 1:
            if out.data_ptr() != inps[0].data_ptr():
                out.copy_(inps[0])
            return
        slots = self.seg.slots(out.dtype)
        cap = self._cap(out, n)
        for o, c in self._rounds(out.numel(), cap):
            e = self.epoch + 1
            buf = slots[e & 1]
            mine = buf[me]
            for r in range(n):
                if r != me:
                    mine[r * cap:r * cap + c].copy_(inps[r][o:o + c])
            self.sync(e)
            parts = [inps[me][o:o + c] if r == me else buf[r][me * cap:me * cap + c] for r in range(n)]
            _reduce_into(out[o:o + c], parts, fn)

    def scatter(self, inps: Optional[Sequence[torch.Tensor]], out: torch.Tensor, root: int) -> None:
        """Bytes: rank r's ``out`` gets the root's ``inps[r]``."""
        me, n = self.me, self.n
        if me == root and inps is not None and out.data_ptr() != inps[me].data_ptr():
            out.copy_(inps[me])
        if n == 1 or not out.numel():
            return
        slots = self.seg.slots(torch.uint8)
        cap = self._cap(out, n)
        for o, c in self._rounds(out.numel(), cap):
            e = self.epoch + 1
            buf = slots[e & 1]
            if me == root:
                for r in range(n):
                    if r != me:
                        buf[me][r * cap:r * cap + c].copy_(inps[r][o:o + c])  # type: ignore[index]
            self.sync(e)
            if me != root:
                out[o:o + c].copy_(buf[root][me * cap:me * cap + c])

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
        cap = self._cap(ins[0], n)
        longest = max(max(row) for row in send)
        for o in range(0, longest, cap):
            e = self.epoch + 1
            buf = slots[e & 1]
            for d in range(n):
                k = min(cap, send[me][d] - o)
                if d != me and k > 0:
                    buf[me][d * cap:d * cap + k].copy_(ins[d][o:o + k])
            self.sync(e)
            for s in range(n):
                k = min(cap, recv[me][s] - o)
                if s != me and k > 0:
                    outs[s][o:o + k].copy_(buf[s][me * cap:me * cap + k])

    def _exchange_sizes(self, send: List[int], recv: List[int]) -> Tuple[List[List[int]], List[List[int]]]:
        """Every rank's send and receive byte counts (a round of their own), checked pairwise."""
        n = self.n
        slots = self.seg.slots(torch.int64)
        e = self.epoch + 1
        buf = slots[e & 1]
        buf[self.me][:2 * n].copy_(torch.tensor(send + recv, dtype=torch.int64))
        self.sync(e)
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
        self.settle()
