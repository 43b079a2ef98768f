"""The node's all_reduce in two levels: within each NUMA node, then once across them.

Selected only when the node's plan (:func:`cpuddp.backends.shm.numa_plan.plan_numa`, from each
rank's CPUs and the topology; :func:`node_numa_plan`) has two or more groups; otherwise the
engine's one-level path runs unchanged.  Each rank's slots live on its own NUMA node
(:mod:`cpuddp.backends.shm.segment`).  With ``M`` parts per chunk (the largest group) and ``K``
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
from typing import Any, Callable, Iterable, List, Mapping, Sequence, Tuple

import torch

from .local import LocalEngine, block, part_length, span
from cpuddp.errors import BackendError
from cpuddp.topology.model import format_cpulist, parse_cpulist

from .numa_plan import FORCE_VAR, NumaPlan, forced_nodes, plan_numa
from .ops import rows_reducer

__all__ = ["TwoLevel", "node_numa_plan", "setup_levels"]


def node_numa_plan(local_cpus: Sequence[Sequence[int]], environ: Mapping[str, str] = os.environ) -> NumaPlan:
    """The plan for the node's local ranks (``local_cpus``: each one's allowed CPUs), from this
    machine's topology, or from ``CPUDDP_SHM_NUMA``."""
    forced = forced_nodes(environ)
    from cpuddp.topology import read_topology

    numa = {c.cpu: c.numa for c in read_topology().cpus} if forced is None else {}
    return plan_numa(local_cpus, numa, forced=forced)


def setup_levels(eng: LocalEngine, store: Any, local: Sequence[int], cpus: Iterable[int]) -> str:
    """Plan the node's levels (3 or more local ranks) from every local rank's ``cpus`` (its compute
    CPUs, exchanged through ``store``), check that every local rank planned the same as local rank
    0, and give ``eng`` its :class:`TwoLevel` when the plan has two or more groups; the plan's
    reason ("" for fewer than 3 ranks)."""
    if len(local) < 3:
        return ""
    store.set(f"numa/cpus/{eng.rank}", format_cpulist(cpus))
    try:
        plan = node_numa_plan([_cpus_of(store, r) for r in local])
    except BackendError as exc:
        store.set(f"numa/{eng.rank}", f"an error: {exc.msg}")
        raise
    mine = f"groups {[list(g) for g in plan.groups]}"
    store.set(f"numa/{eng.rank}", mine)
    first = store.get(f"numa/{local[0]}").decode()
    if first != mine:
        raise BackendError(f"rank {eng.rank} planned the node's NUMA levels as {mine}, local rank 0 (rank "
                           f"{local[0]}) as {first}", fix=f"set {FORCE_VAR} alike for every rank of the node, "
                                                          "or unset it")
    if plan.two_level:
        eng.levels = TwoLevel(eng, plan)
    return plan.reason


def _cpus_of(store: Any, rank: int) -> frozenset:
    raw = store.get(f"numa/cpus/{rank}")
    try:
        return parse_cpulist(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise BackendError(f"the store's numa/cpus/{rank} ({raw[:80]!r}) is not a CPU list",
                           fix="see docs/security.md (something else writes to this job's store)") from None


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
        for e, chunk, k in eng.copied_in(flat, rows):
            a, b = rows[e & 1], rows[(e + 1) & 1]
            spans = self.spans(k, flat.element_size())
            for p in self.mine:
                (lo, hi), _subs = spans[p]
                if hi > lo:
                    red(self.rows(a, self.group, lo, hi), eng.row(b, me, lo, hi))
            eng.sync(e + 1)
            for p in self.mine:
                lo, hi = spans[p][1][self.g]
                if hi > lo:
                    red(self.rows(b, self.owners[p], lo, hi), eng.row(a, me, lo, hi))
            eng.sync(e + 2)
            for p in self.mine:
                for owner, (lo, hi) in zip(self.owners[p], spans[p][1]):
                    if hi > lo:
                        eng.row(b, me, lo, hi).copy_(eng.row(a, owner, lo, hi))
            eng.sync(e + 3)
            for p, ((lo, hi), _subs) in enumerate(spans):
                if hi > lo:
                    chunk[lo:hi].copy_(eng.row(b, self.local_owner[p], lo, hi))
