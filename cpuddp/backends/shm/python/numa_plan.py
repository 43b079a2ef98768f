"""The node's reduction plan over its NUMA nodes (pure, no torch): one level, or two.

On a node with two or more NUMA nodes (sockets, or sub-NUMA clusters) a rank's reads of a slot
that lives on another NUMA node cross the interconnect.  :func:`plan_numa` groups the node's
local ranks by the NUMA node their CPUs are on, from each rank's allowed CPUs (the records the
group already exchanges, :mod:`cpuddp.backends.shm.protocol.node`) and the CPU -> NUMA node map of
:func:`cpuddp.topology.read_topology`:

* one group (every rank on one NUMA node), or any rank whose node is unknown (no CPUs, a CPU
  the map does not know) or ambiguous (CPUs on two nodes: an unpinned rank runs anywhere), or
  one rank per NUMA node (a second level would move the same bytes in one more round): the
  **single-level** plan, exactly the engine's one-level path
  (:mod:`cpuddp.backends.shm.python.local`);
* otherwise the **two-level** plan: a group per NUMA node, in ascending node id, each group's
  ranks in ascending local rank; its leader is its lowest local rank.

The order of reduction is part of the plan, so every rank computes the same one and the result
is bit-identical on every rank and from run to run: a chunk is cut into :attr:`NumaPlan.parts`
parts (the size of the largest group); part ``p`` of group ``g``'s sum is reduced, over the
group's ranks in ascending local rank, by the group's member ``p % len(group)``
(:meth:`NumaPlan.intra_owner`); then sub-part ``h`` of part ``p`` is reduced, over the groups'
sums in ascending group order, by group ``h``'s owner of part ``p`` (:meth:`NumaPlan.cross_owner`).
Each element is summed by exactly one rank at each level.  The two-level sum is
``((r0 + r1 + ...) of group 0) + ((...) of group 1) + ...``: the same as the one-level sum up
to the order of floating-point additions, not bit for bit.

``CPUDDP_SHM_NUMA`` (:func:`forced_nodes`): a comma-separated NUMA node per local rank
(``0,0,1,1``) replaces what the CPUs say -- for tests of the two-level path on a machine with
one NUMA node; placement is not affected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Tuple

from cpuddp.errors import BackendError

__all__ = ["NumaPlan", "plan_numa", "plan_nodes", "rank_node", "forced_node", "single_level", "forced_nodes",
           "FORCE_VAR"]

FORCE_VAR = "CPUDDP_SHM_NUMA"


@dataclass(frozen=True)
class NumaPlan:
    """``groups[g]``: the local ranks of group ``g`` (ascending); ``nodes[g]``: its NUMA node
    (None when unknown); ``rank_nodes[r]``: local rank ``r``'s NUMA node, None when unknown or
    ambiguous; ``reason``: why this plan, in words."""

    groups: Tuple[Tuple[int, ...], ...]
    nodes: Tuple[Optional[int], ...]
    rank_nodes: Tuple[Optional[int], ...]
    reason: str

    @property
    def two_level(self) -> bool:
        return len(self.groups) > 1

    @property
    def leaders(self) -> Tuple[int, ...]:
        """Each group's lowest local rank."""
        return tuple(g[0] for g in self.groups)

    @property
    def parts(self) -> int:
        """Parts a chunk is cut into at the first level: the size of the largest group."""
        return max(len(g) for g in self.groups)

    def group_of(self, local_rank: int) -> int:
        """The group that holds ``local_rank``."""
        for g, ranks in enumerate(self.groups):
            if local_rank in ranks:
                return g
        raise ValueError(f"local rank {local_rank} is in no group of {self.groups}")

    def intra_owner(self, g: int, p: int) -> int:
        """The local rank that reduces part ``p`` over group ``g``'s ranks."""
        ranks = self.groups[g]
        return ranks[p % len(ranks)]

    def cross_owner(self, h: int, p: int) -> int:
        """The local rank that reduces sub-part ``h`` of part ``p`` over the groups' sums: group
        ``h``'s owner of part ``p`` (its own group's sum of that part is in its slot)."""
        return self.intra_owner(h, p)

    def my_parts(self, local_rank: int) -> Tuple[int, ...]:
        """The parts ``local_rank`` reduces at the first level (and owns sub-parts of at the second)."""
        g = self.group_of(local_rank)
        return tuple(p for p in range(self.parts) if self.intra_owner(g, p) == local_rank)


def single_level(n: int, reason: str, rank_nodes: Optional[Sequence[Optional[int]]] = None) -> NumaPlan:
    """The one-level plan of ``n`` local ranks (today's path)."""
    nodes = tuple(rank_nodes) if rank_nodes is not None else (None,) * n
    common = nodes[0] if len(set(nodes)) == 1 else None
    return NumaPlan((tuple(range(n)),), (common,), nodes, reason)


def rank_node(cpus: Iterable[int], numa_of: Mapping[int, int]) -> Tuple[Optional[int], str]:
    """``(node, "")`` when every CPU of ``cpus`` is on NUMA node ``node``; else ``(None, why)``."""
    cpus = sorted(set(cpus))
    if not cpus:
        return None, "has no CPUs listed"
    unknown = [c for c in cpus if c not in numa_of]
    if unknown:
        return None, f"runs on CPU {unknown[0]}, which the topology does not place on a NUMA node"
    found = sorted({numa_of[c] for c in cpus})
    if len(found) > 1:
        return None, f"may run on NUMA nodes {', '.join(map(str, found))} (pin each rank to one node's CPUs)"
    return found[0], ""


def plan_numa(rank_cpus: Sequence[Iterable[int]], numa_of: Mapping[int, int],
              forced: Optional[Sequence[int]] = None) -> NumaPlan:
    """The plan for local ranks whose allowed CPUs are ``rank_cpus`` (local-rank order) on a node
    whose CPU -> NUMA node map is ``numa_of``; ``forced``: a node per local rank instead
    (:func:`forced_nodes`)."""
    n = len(rank_cpus)
    if n == 0:
        raise ValueError("plan_numa needs at least one local rank")
    if forced is not None:
        return plan_nodes([forced_node(forced, r, n) for r in range(n)])
    return plan_nodes([rank_node(cpus, numa_of) for cpus in rank_cpus])


def forced_node(forced: Sequence[int], local_rank: int, n: int) -> Tuple[Optional[int], str]:
    """Local rank ``local_rank``'s node in ``forced`` (:func:`forced_nodes`), for ``n`` local ranks."""
    if len(forced) != n:
        raise BackendError(f"{FORCE_VAR} names {len(forced)} NUMA node(s) for {n} local ranks",
                           fix=f"give one NUMA node per local rank ({FORCE_VAR}=0,0,1,1 for 4), or unset it")
    return int(forced[local_rank]), ""


def plan_nodes(found: Sequence[Tuple[Optional[int], str]]) -> NumaPlan:
    """The plan from each local rank's ``(node, why)`` (:func:`rank_node`; node None: unplaced)."""
    n = len(found)
    nodes = tuple(node for node, _ in found)
    for r, (node, why) in enumerate(found):
        if node is None:
            return single_level(n, f"one level: local rank {r} {why}", nodes)
    by_node = {x: tuple(r for r in range(n) if nodes[r] == x) for x in sorted(set(nodes))}  # type: ignore[type-var]
    if len(by_node) == 1:
        return single_level(n, f"one level: every local rank is on NUMA node {nodes[0]}", nodes)
    if all(len(ranks) == 1 for ranks in by_node.values()):
        return single_level(n, f"one level: one local rank on each of {len(by_node)} NUMA nodes", nodes)
    sizes = ", ".join(f"{len(ranks)} on node {x}" for x, ranks in by_node.items())
    return NumaPlan(tuple(by_node.values()), tuple(by_node), nodes,
                    f"two levels: within each of {len(by_node)} NUMA nodes, then across them ({sizes})")


def forced_nodes(environ: Mapping[str, str]) -> Optional[Tuple[int, ...]]:
    """``CPUDDP_SHM_NUMA`` as a NUMA node per local rank, or None when unset."""
    raw = (environ.get(FORCE_VAR) or "").strip()
    if not raw:
        return None
    try:
        nodes = tuple(int(x) for x in raw.split(","))
    except ValueError:
        nodes = ()
    if not nodes or min(nodes) < 0:
        raise BackendError(f"{FORCE_VAR}={raw!r} is not a comma-separated list of NUMA node ids",
                           fix=f"give one NUMA node id per local rank (e.g. {FORCE_VAR}=0,0,1,1), or unset it "
                               "to group the ranks by their CPUs")
    return nodes
