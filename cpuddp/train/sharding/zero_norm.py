"""``shard="optimizer"``: the total gradient norm, computed to the same bits before and after the
optimizer is sharded -- so a run that clips its gradients resumes bit-identically.

A process runs its first steps as DDP (every rank holds every reduced gradient) and the later
ones sharded (each rank holds its share of every bucket, and the buckets' tails); a resumed run
has its unsharded steps where the uninterrupted run was already sharded, and the buckets it
sees first are DDP's initial ones, not the rebuilt ones.  A norm summed over whatever pieces a
phase holds would round differently in each.  So the sum has one shape, whatever the phase and
the layout:

* Each parameter's flat gradient is cut into **blocks** of :data:`BLOCK` elements (the last one
  shorter), in the model's parameter order; each block's norm is one row of one
  ``vector_norm(..., dim=1)`` (a row's result does not depend on the rows beside it).
* The block norms fill one vector in that order; its norm is the total.
* Unsharded, every rank computes every block.  Sharded, a block inside one rank's share is
  computed by that rank, a block inside the tails by rank 0, and a block cut by a share's edge
  by rank 0 after an all-gather of the pieces the others hold; every other entry is zero, so the
  all-reduce (sum) that gives every rank the vector adds only zeros: exact in any order.

The cost once sharded: the norms of this rank's share, an all-gather of at most two blocks per
share edge, and an all-reduce of one float per :data:`BLOCK` gradient elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from .zero_plan import ShardPlan, all_gather

__all__ = ["BLOCK", "block_norms", "norm_dtype", "unsharded_norm", "NormPlan"]

#: Gradient elements per block of the norm (one float of the all-reduced vector each).
BLOCK = 8192


def norm_dtype(params: Iterable[torch.Tensor]) -> torch.dtype:
    """float64 if any parameter is float64, else float32 (16-bit gradients are widened)."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def block_norms(flat: torch.Tensor, norm_type: float, dtype: torch.dtype) -> torch.Tensor:
    """The norms of ``flat``'s consecutive blocks of :data:`BLOCK` elements (the last may be shorter)."""
    flat = flat.to(dtype)
    full, rest = divmod(flat.numel(), BLOCK)
    parts = []
    if full:
        parts.append(torch.linalg.vector_norm(flat[:full * BLOCK].view(full, BLOCK), norm_type, dim=1))
    if rest:
        parts.append(torch.linalg.vector_norm(flat[full * BLOCK:].view(1, rest), norm_type, dim=1))
    return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else flat.new_zeros(0)


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _bases(params: list[torch.Tensor]) -> list[int]:
    """Each parameter's first entry in the vector of block norms."""
    bases, at = [], 0
    for p in params:
        bases.append(at)
        at += _blocks(p.numel())
    return bases + [at]


def unsharded_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total norm of ``params``' gradients, every rank holding all of them (a missing gradient
    counts as zeros)."""
    dtype = norm_dtype(params)
    bases = _bases(params)
    vec = torch.zeros(bases[-1], dtype=dtype)
    for p, at in zip(params, bases):
        if p.grad is not None:
            vec[at:at + _blocks(p.numel())] = block_norms(p.grad.reshape(-1), norm_type, dtype)
    return torch.linalg.vector_norm(vec, norm_type)


@dataclass
class _Split:
    """A block cut by a share's edge: its entry, and its parts in order as ``(rank, start, length)``
    in that rank's send buffer, or ``(-1, view)`` for a part in the tails (every rank holds them)."""

    entry: int
    parts: list = field(default_factory=list)


@dataclass
class NormPlan:
    """Who computes which block norm once sharded (see the module), built once per shard plan."""

    size: int  # entries in the vector
    dtype: torch.dtype
    runs: list  # (grad view, first entry): whole blocks this rank computes
    sends: list  # this rank's parts of cut blocks, in order
    width: int  # elements of the largest rank's send buffer (0: no block is cut)
    splits: list  # rank 0's cut blocks (_Split)
    rank: int
    world: int

    @classmethod
    def build(cls, plan: ShardPlan, params: list[torch.Tensor], rank: int, world: int) -> NormPlan:
        bases = _bases(params)
        entry_of = {id(p): at for p, at in zip(params, bases)}
        runs: list = []
        sends: list[list] = [[] for _ in range(world)]  # per rank: (entry, position, length, view or None)
        tails: list = []  # (entry, position, length, view)
        placed = set()
        for b in plan.buckets.values():
            numel, c = b.flat.numel(), b.chunk
            for p, a in zip(b.params, b.offsets):
                at = entry_of.get(id(p))
                if at is None:
                    continue
                placed.add(id(p))
                for r, lo, hi, view in _segments(b, a, p.numel(), rank, world, numel, c):
                    cls._place(runs, sends, tails, r, rank, at, lo, hi, p.numel(), view)
        for p, at in zip(params, bases):  # outside every bucket (not expected): rank 0, its own gradient
            if id(p) not in placed and rank == 0:
                runs.append((p, at))
        splits = cls._splits(sends, tails, rank) if rank == 0 else []
        width = max((sum(n for _, _, n, _ in s) for s in sends), default=0)
        mine = [v for _, _, _, v in sorted(sends[rank], key=lambda s: s[:2])]
        return cls(bases[-1], norm_dtype(params), runs, mine, width, splits, rank, world)

    @staticmethod
    def _place(runs: list, sends: list, tails: list, owner: int, rank: int, at: int, lo: int, hi: int,
               numel: int, view: Optional[torch.Tensor]) -> None:
        """A parameter's elements ``[lo, hi)`` held by ``owner`` (-1: the tails): its whole blocks
        become a run of the owner's, each cut block's part a send (or a tail part)."""
        first = -(-lo // BLOCK)
        last = _blocks(numel) if hi == numel else hi // BLOCK
        whole = owner == rank or (owner < 0 and rank == 0)
        if first < last and whole:
            start, stop = first * BLOCK - lo, min(last * BLOCK, numel) - lo
            runs.append((view[start:stop], at + first))
        for k in sorted({lo // BLOCK, (hi - 1) // BLOCK}):
            if first <= k < last:
                continue
            s, t = max(lo, k * BLOCK), min(hi, (k + 1) * BLOCK, numel)
            part = view[s - lo:t - lo] if view is not None else None
            item = (at + k, s - k * BLOCK, t - s, part)
            (tails if owner < 0 else sends[owner]).append(item)

    @staticmethod
    def _splits(sends: list, tails: list, rank: int) -> list:
        """Rank 0's cut blocks, each part found in a send buffer (by rank and start) or the tails."""
        parts: dict[int, list] = {}
        for r, items in enumerate(sends):
            start = 0
            for entry, pos, n, _ in sorted(items, key=lambda s: s[:2]):
                parts.setdefault(entry, []).append((pos, (r, start, n)))
                start += n
        for entry, pos, n, view in tails:
            parts.setdefault(entry, []).append((pos, (-1, view)))
        return [_Split(entry, [src for _, src in sorted(ps, key=lambda x: x[0])]) for entry, ps in sorted(parts.items())]

    def norm(self, norm_type: float, group: Any) -> torch.Tensor:
        """The total norm of the reduced gradients (a collective: every rank calls it)."""
        vec = torch.zeros(self.size, dtype=self.dtype)
        for view, at in self.runs:
            if isinstance(view, torch.nn.Parameter):  # a parameter outside the buckets
                if view.grad is None:
                    continue
                view = view.grad.reshape(-1)
            norms = block_norms(view, norm_type, self.dtype)
            vec[at:at + norms.numel()] = norms
        if self.width:
            self._cut_blocks(vec, norm_type, group)
        dist.all_reduce(vec, group=group)
        return torch.linalg.vector_norm(vec, norm_type)

    def _cut_blocks(self, vec: torch.Tensor, norm_type: float, group: Any) -> None:
        send = torch.zeros(self.width, dtype=self.dtype)
        if self.sends:
            mine = torch.cat([v.to(self.dtype) for v in self.sends])
            send[:mine.numel()] = mine
        got = torch.empty(self.world * self.width, dtype=self.dtype)
        all_gather(got, send, group=group)
        for split in self.splits:
            pieces = [src[1].to(self.dtype) if src[0] < 0 else got[src[0] * self.width + src[1]:][:src[2]]
                      for src in split.parts]
            vec[split.entry] = block_norms(torch.cat(pieces), norm_type, self.dtype)[0]


def _segments(b: Any, a: int, numel: int, rank: int, world: int, total: int, chunk: int) -> list:
    """A bucket parameter's elements by who holds them: ``(owner, lo, hi, view)`` with ``[lo, hi)``
    in the parameter, ``owner`` a rank (its share) or -1 (the tails); ``view`` this rank's reduced
    gradient of those elements where it holds them, else None."""
    out = []
    bounds = [(r, r * chunk, (r + 1) * chunk) for r in range(world) if chunk] + [(-1, world * chunk, total)]
    for owner, s, t in bounds:
        lo, hi = max(a, s), min(a + numel, t)
        if lo >= hi:
            continue
        if owner == rank:
            view = b.grad[lo - s:hi - s]
        elif owner < 0:
            view = b.tail[lo - s:hi - s]
        else:
            view = None
        out.append((owner, lo - a, hi - a, view))
    return out
