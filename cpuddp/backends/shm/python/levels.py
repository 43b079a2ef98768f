"""The node's all_reduce in two levels: within each NUMA node, then once across them.

Selected only when the node's plan (:func:`cpuddp.backends.shm.python.numa_plan.plan_nodes`, from each
rank's NUMA node as it wrote it in the segment; :func:`setup_levels`) has two or more groups; otherwise the
engine's one-level path runs unchanged.  Each rank's slots live on its own NUMA node
(:mod:`cpuddp.backends.shm.protocol.segment`).  With ``M`` parts per chunk (the largest group) and ``K``
groups, for each chunk of at most one slot (epoch ``e``, buffers ``A = e % 2`` and ``B``):

1. every rank copies its chunk into its row of ``A``;                                   sync(e)
2. part ``p``'s group sum: the group's owner of ``p`` reduces the group's rows of ``A``
   (its own NUMA node only) into its row of ``B``;                                    sync(e+1)
3. sub-part ``h`` of part ``p``: group ``h``'s owner of ``p`` reduces the ``K`` group sums
   (one row of ``B`` per group, ``K - 1`` on other nodes) into its row of ``A``;      sync(e+2)
4. each owner copies the other groups' finished sub-parts of its parts into its row of ``B``
   (``K - 1`` sub-parts from other nodes): its node now holds the whole result;       sync(e+3)
5. every rank copies each part out of its own group's owner's row of ``B`` (its node only).

A buffer is written again only after every rank arrived at the next round, so two buffers
still suffice.  Every element is reduced by exactly one rank at each level, in the plan's fixed
order: the result is bit-identical on every rank and from run to run (and equal to the
one-level result up to the order of floating-point additions).  Only ``all_reduce`` (the one
DDP calls) has two levels; the other collectives run the one-level path.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from .local import LocalEngine, block, part_length, span
from cpuddp.errors import BackendError

from .numa_plan import NumaPlan, forced_node, forced_nodes, plan_nodes, rank_node
from ..native.layout import C_NUMA, NOTE_BYTES
from .ops import rows_reducer

__all__ = ["TwoLevel", "my_node", "setup_levels"]


def my_node(me: int, n: int, cpus: Iterable[int], environ: Mapping[str, str] = os.environ) -> Tuple[Optional[int], str]:
    """Local rank ``me``'s NUMA node of ``n`` and why it has none (:func:`~.numa_plan.rank_node`):
    from its compute ``cpus`` and this machine's topology, or from ``CPUDDP_SHM_NUMA``."""
    forced = forced_nodes(environ)
    if forced is not None:
        return forced_node(forced, me, n)
    from cpuddp.topology import read_topology

    return rank_node(cpus, {c.cpu: c.numa for c in read_topology().cpus})


def setup_levels(eng: LocalEngine, cpus: Iterable[int], environ: Mapping[str, str] = os.environ) -> str:
    """Plan the node's levels (3 or more local ranks): each rank writes its NUMA node (and why it
    has none) into its control line of the segment -- never the store, which others can write --
    one round, then every rank plans from the same words; ``eng`` gets its :class:`TwoLevel`
    when the plan has two or more groups.  The plan's reason ("" for fewer than 3 ranks)."""
    seg, n = eng.seg, eng.n
    if n < 3:
        return ""
    try:
        node, why = my_node(eng.me, n, cpus, environ)
    except BackendError:
        eng.ch.waiter.abort(eng.me)  # the peers stop at the round below instead of waiting it out
        raise
    seg.lines[eng.me][C_NUMA] = _UNPLACED if node is None else node + _PLACED
    note = why.encode()[:NOTE_BYTES]
    seg.note(eng.me)[:] = note + bytes(NOTE_BYTES - len(note))
    eng.ch.round(eng.ch.next_round())
    plan = plan_nodes([_node_of(seg, r) for r in range(n)])
    if plan.two_level:
        eng.levels = TwoLevel(eng, plan)
    return plan.reason


#: a control line's C_NUMA word: 0 not written yet, _UNPLACED, or the node + _PLACED
_UNPLACED, _PLACED = 1, 2


def _node_of(seg: Any, r: int) -> Tuple[Optional[int], str]:
    word = seg.lines[r][C_NUMA]
    if word >= _PLACED:
        return word - _PLACED, ""
    return None, bytes(seg.note(r)).rstrip(b"\0").decode(errors="replace") or "has no NUMA node"


class TwoLevel:
    """This rank's side of the two-level all_reduce over ``eng``'s segment, for ``plan``."""

    def __init__(self, eng: LocalEngine, plan: NumaPlan) -> None:
        self.eng, self.plan, self.me = eng, plan, eng.me
        self.g = plan.group_of(eng.me)
        self.group = plan.groups[self.g]
        self.mine = plan.my_parts(eng.me)
        self.owners = [tuple(plan.cross_owner(h, p) for h in range(len(plan.groups))) for p in range(plan.parts)]
        self.local_owner = [plan.intra_owner(self.g, p) for p in range(plan.parts)]

    def rows(self, buf: torch.Tensor, ranks: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """Columns ``lo:hi`` of rows ``ranks`` of ``buf``, in that order: a view when the rows are
        evenly spaced upwards, else a copy."""
        step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return block(buf, len(ranks), hi - lo, buf.stride(0) * step,
                         buf.storage_offset() + ranks[0] * buf.stride(0) + lo)
        return torch.stack([self.eng.row(buf, r, lo, hi) for r in ranks])

    def spans(self, k: int, size: int) -> List[Tuple[Tuple[int, int], List[Tuple[int, int]]]]:
        """Per part of a ``k``-element chunk: its ``(lo, hi)`` and its groups' sub-parts."""
        parts, groups = self.plan.parts, len(self.plan.groups)
        out = []
        for p in range(parts):
            lo, hi = span(part_length(k, parts, size), k, p)
            sub = part_length(hi - lo, groups, size)
            out.append(((lo, hi), [(lo + a, lo + b) for a, b in (span(sub, hi - lo, h) for h in range(groups))]))
        return out

    def all_reduce(self, flat: torch.Tensor, fn: Callable[..., Any]) -> None:
        eng, me = self.eng, self.me
        rows, red = eng.seg.rows(flat.dtype), rows_reducer(fn, flat.dtype)
        for e, chunk, k in eng.copied_in(flat):
            a, b = rows[e & 1], rows[(e + 1) & 1]
            spans = self.spans(k, flat.element_size())
            for p in self.mine:
                (lo, hi), _subs = spans[p]
                if hi > lo:
                    red(self.rows(a, self.group, lo, hi), eng.row(b, me, lo, hi))
            eng.ch.round(e + 1)
            for p in self.mine:
                lo, hi = spans[p][1][self.g]
                if hi > lo:
                    red(self.rows(b, self.owners[p], lo, hi), eng.row(a, me, lo, hi))
            eng.ch.round(e + 2)
            for p in self.mine:
                for owner, (lo, hi) in zip(self.owners[p], spans[p][1]):
                    if hi > lo:
                        eng.row(b, me, lo, hi).copy_(eng.row(a, owner, lo, hi))
            eng.ch.round(e + 3)
            for p, ((lo, hi), _subs) in enumerate(spans):
                if hi > lo:
                    chunk[lo:hi].copy_(eng.row(b, self.local_owner[p], lo, hi))
