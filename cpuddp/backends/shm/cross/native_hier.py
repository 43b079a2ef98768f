"""A shm group's collectives across nodes with each node's part on the native data path
(:mod:`cpuddp.backends.shm.native`): the same legs as :class:`~cpuddp.backends.shm.cross.hierarchy.Hierarchy`,
the node parts one native call each instead of the Python engine's rounds.

* ``all_reduce`` up to :data:`SMALL` bytes: the node's sum at local rank 0 (a native reduce), its
  leg's all-reduce among the nodes' local ranks 0, a native broadcast -- one leg call per node,
  so its latency is the leg's plus two native calls;
* larger: a native reduce-scatter leaves each local rank its part of the node's sum, each local
  rank all-reduces its part over its cross group (the nodes' ranks of its local rank, in
  parallel), a native all-gather hands every rank every part (the elements the parts leave over,
  fewer than the node's ranks, are summed by a native all-reduce and carried by local rank 0);
* ``broadcast``: the root's cross group from the root's node, then a native broadcast;
* ``all_gather``: each cross group gathers its ranks' inputs, a native all-gather of those blocks,
  then one copy into the group's rank order;
* ``reduce_scatter``: a native reduce-scatter of the node's sums of every rank's part, all-reduced
  over the cross group, each rank keeping its node's;
* ``barrier``: a native barrier, local rank 0's leg barrier, a native barrier.

Every rank ends with the same bits: each element's node sum is computed once on its node, the leg
gives every node the same result (gloo's, or the MPI leg's, which reduces each element once), and
the rest are copies.  Each call takes the collective's agreed descriptor, so the native engine
compares every node part across the node's ranks.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError

from ..protocol.node import NodePlan
from ..python.ops import flat_bytes

__all__ = ["NativeHierarchy", "SMALL", "options", "small"]

#: ``all_reduce`` of up to this many bytes: reduce at local rank 0, one leg call per node, broadcast.
SMALL = 256 << 10


def small(numel: int, nbytes: int, local_size: int) -> bool:
    """Does an all_reduce of ``numel`` elements (``nbytes``) take the small path (reduce at local
    rank 0, one leg call per node, broadcast)?  Both routes ask it, so a node's ranks make the
    same native calls whichever route each took."""
    return nbytes <= SMALL or numel < local_size


def options(cls: Any, **values: Any) -> Any:
    """A torch options object of ``cls`` (``reduceOp``: a ``ReduceOp.RedOpType``) for a leg call."""
    o = cls()
    for k, v in values.items():
        setattr(o, k, dist.ReduceOp(v) if k == "reduceOp" else v)
    return o


class NativeHierarchy:
    """One group's collectives across nodes, the node parts on the native engine ``nat``."""

    def __init__(self, nat: Any, plan: NodePlan, cross: Any) -> None:
        self.nat, self.plan, self.cross = nat, plan, cross
        self.me, self.n, self.node, self.nodes = plan.local_rank, plan.local_size, plan.node, plan.nodes
        self._perm: Dict[Tuple[str, int], torch.Tensor] = {}

    # ------------------------------------------------------------------ all_reduce

    def all_reduce(self, call: Any, flat: torch.Tensor, code: Any) -> None:
        """``flat`` (contiguous, 1-D) reduced over every rank with ``code`` (never AVG: the
        route divides)."""
        nat, n = self.nat, self.n
        if small(flat.numel(), flat.numel() * flat.element_size(), n):
            nat.run(call, nat.reduce(call, flat, 0, code))
            if self.me == 0:
                self.cross.allreduce([flat], options(dist.AllreduceOptions, reduceOp=code)).wait()
            nat.run(call, nat.broadcast(call, flat_bytes(flat), 0))
            return
        k = flat.numel() // n
        body, rest = flat[:n * k], flat[n * k:]
        extra = rest.numel() if self.me == 0 else 0
        part = torch.empty(k + extra, dtype=flat.dtype)
        nat.run(call, nat.reduce_scatter(call, part[:k], body, code))
        if rest.numel():
            nat.run(call, nat.all_reduce(call, rest, code))
            if extra:
                part[k:].copy_(rest)
        self.cross.allreduce([part], options(dist.AllreduceOptions, reduceOp=code)).wait()
        nat.run(call, nat.all_gather(call, flat_bytes(body), flat_bytes(part[:k])))
        if rest.numel():
            if extra:
                rest.copy_(part[k:])
            nat.run(call, nat.broadcast(call, flat_bytes(rest), 0))

    # ------------------------------------------------------------------ broadcast, barrier

    def broadcast(self, call: Any, flat: torch.Tensor, root: int) -> None:
        """``flat``: contiguous bytes; ``root``: a group rank."""
        node, lr = self._where(root)
        if self.me == lr:
            self.cross.broadcast([flat], options(dist.BroadcastOptions, rootRank=node)).wait()
        self.nat.run(call, self.nat.broadcast(call, flat, lr))

    def barrier(self, call: Any) -> None:
        nat = self.nat
        nat.run(call, nat.barrier(call))
        if self.me == 0:
            self.cross.barrier().wait()
        nat.run(call, nat.barrier(call))

    # ------------------------------------------------------------------ all_gather, reduce_scatter

    def all_gather(self, call: Any, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out``: contiguous bytes, one row of ``inp``'s size per group rank, in group-rank order."""
        k = inp.numel()
        mine = torch.empty(self.nodes * k, dtype=torch.uint8)
        self.cross._allgather_base(mine, inp).wait()
        block = torch.empty(self.n * self.nodes * k, dtype=torch.uint8)
        self.nat.run(call, self.nat.all_gather(call, block, mine))
        out.view(-1, k).index_copy_(0, self._order("gather"), block.view(-1, k))

    def reduce_scatter(self, call: Any, out: torch.Tensor, inp: torch.Tensor, code: Any) -> None:
        """``out``: this rank's part (``k`` elements) of the reduction of ``inp`` (the group's
        ranks' parts in group-rank order), never AVG."""
        k = out.numel()
        supers = inp.view(-1, k).index_select(0, self._order("gather")).view(-1)
        node_sum = torch.empty(self.nodes * k, dtype=out.dtype)
        self.nat.run(call, self.nat.reduce_scatter(call, node_sum, supers, code))
        self.cross.allreduce([node_sum], options(dist.AllreduceOptions, reduceOp=code)).wait()
        out.copy_(node_sum[self.node * k:(self.node + 1) * k])

    # ------------------------------------------------------------------ the layout

    def _order(self, what: str) -> torch.Tensor:
        """Group rank of each block of a node-level gather, in its order (local rank, then node)."""
        key = (what, 0)
        perm = self._perm.get(key)
        if perm is None:
            grid = self.plan.grid
            perm = self._perm[key] = torch.tensor([grid[j][i] for i in range(self.n) for j in range(self.nodes)])
        return perm

    def _where(self, rank: int) -> Tuple[int, int]:
        for j, row in enumerate(self.plan.grid):
            if rank in row:
                return j, row.index(rank)
        raise BackendError(f"rank {rank} is not in this group", fix="pass a rank of the group")
