"""The shm group across nodes: shared memory within each node, one backend between them.

The ranks with the same local rank on every node form a *cross group*, formed by the backend
object of the group's node-to-node leg (gloo, or oneCCL when the group's options say
``inter="ccl"``): cross rank ``j`` is node ``j``.  Each collective
keeps what it can inside the node (per collective; docs/backends.md has the table):

* ``all_reduce``: reduce-scatter in shared memory, an all_reduce of each rank's part over its
  cross group, all-gather in shared memory (node-to-node traffic: one part per rank);
* ``broadcast``: the root's cross group broadcasts from the root's node, then each node
  broadcasts in shared memory from that local rank;
* ``all_gather``: each cross group all-gathers its ranks' inputs, then each node all-gathers
  those blocks in shared memory;
* ``reduce_scatter``: a reduce-scatter in shared memory leaves each local rank the node's sum
  of the parts of the ranks with its local rank on every node; its cross group all-reduces
  those and each rank keeps its node's (gloo's own reduce_scatter is an all_reduce too);
* ``barrier``: the node's barrier, then the cross group's;
* ``reduce``, ``gather``, ``scatter``: the all_reduce, all_gather and broadcast above, the root
  keeping its part (one call more traffic than a direct one; nothing between a node's ranks
  leaves shared memory);
* ``all_to_all`` and point-to-point between nodes: one gloo group of every rank (a hierarchy
  gains nothing for them); point-to-point within a node uses the node's sockets.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError

from ...types import backend_for
from ..python.local import LocalEngine
from ..protocol.node import NodePlan
from ..python.ops import AVG, reducer, rows_reducer, summed
from ..routes.stream import GatheredWork

__all__ = ["Hierarchy", "cross_group", "SumThenDivide"]


def cross_group(store: Any, plan: NodePlan, timeout: datetime.timedelta, inter: str) -> Any:
    """The group of the ranks with this local rank on every node, formed by the leg's backend
    object (:meth:`~cpuddp.backends.types.BackendSpec.create_group`: gloo's, or oneCCL's, which
    loads the bindings as ``backend="ccl"`` does -- checked against torch, under either module
    name)."""
    return backend_for(inter).create_group(store, plan.node, plan.nodes, timeout)


class Hierarchy:
    """One group's collectives across nodes (the node-local legs run on ``eng``)."""

    def __init__(self, eng: LocalEngine, plan: NodePlan, cross: Any) -> None:
        self.eng, self.plan, self.cross = eng, plan, cross
        self.me, self.n, self.node = plan.local_rank, plan.local_size, plan.node

    def all_reduce(self, flat: torch.Tensor, code: Any, fn: Callable[..., Any]) -> None:
        eng, me = self.eng, self.me
        rows, red = eng.seg.rows(flat.dtype), rows_reducer(fn, flat.dtype)
        chunks = eng.rounds(flat.numel(), eng.cap(flat))
        spans = [eng.my_part(k, flat.element_size()) for _, k in chunks]
        part = torch.empty(sum(hi - lo for lo, hi in spans), dtype=flat.dtype)
        pos = 0
        for (o, k), (lo, hi) in zip(chunks, spans):
            e = eng.ch.next_round()
            buf = rows[e & 1]
            buf[me, :k].copy_(flat[o:o + k])
            eng.ch.round(e)
            if hi > lo:
                red(eng.part_rows(buf, lo, hi), part[pos:pos + hi - lo])
            pos += hi - lo
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(code)
        self.cross.allreduce([part], opts).wait()
        pos = 0
        for (o, k), (lo, hi) in zip(chunks, spans):
            e = eng.ch.next_round()
            buf = rows[e & 1]
            buf[me, lo:hi].copy_(part[pos:pos + hi - lo])
            pos += hi - lo
            eng.ch.round(e)
            eng.parts_out(buf, k, flat[o:o + k])

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        node, lr = self._where(root)
        if self.me == lr:
            opts = dist.BroadcastOptions()
            opts.rootRank = node
            self.cross.broadcast([flat], opts).wait()
        self.eng.broadcast(flat, lr)

    def all_gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Bytes: ``outs[r]`` (every group rank's) gets rank r's ``inp``."""
        nodes, k = self.plan.nodes, inp.numel()
        mine = torch.empty(nodes * k, dtype=torch.uint8)
        self.cross.allgather([list(mine.view(nodes, k))], [inp]).wait()
        block = torch.empty(self.n * nodes * k, dtype=torch.uint8)
        self.eng.all_gather(mine, list(block.view(self.n, nodes * k)))
        for i in range(self.n):
            for j in range(nodes):
                outs[self.plan.grid[j][i]].copy_(block[(i * nodes + j) * k:(i * nodes + j + 1) * k])

    def reduce_scatter(self, inps: Sequence[torch.Tensor], out: torch.Tensor, code: Any,
                       fn: Callable[..., Any]) -> None:
        """``inps[r]``: the part for group rank r.  ``out`` gets the reduction of this rank's part."""
        nodes, k, grid = self.plan.nodes, out.numel(), self.plan.grid
        supers = list(torch.cat([inps[grid[j][i]] for i in range(self.n) for j in range(nodes)]).view(self.n, -1))
        node_sum = torch.empty(nodes * k, dtype=out.dtype)
        self.eng.reduce_scatter(supers, node_sum, fn)
        # between nodes an all_reduce of the column's parts, this node's kept: what gloo's
        # reduce_scatter does anyway (pytorch PR 118911), without its MAX bug of torch 2.8
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(code)
        self.cross.allreduce([node_sum], opts).wait()
        out.copy_(node_sum[self.node * k:(self.node + 1) * k])

    def barrier(self) -> None:
        self.eng.barrier()
        self.cross.barrier().wait()

    def _where(self, rank: int) -> tuple:
        for j, row in enumerate(self.plan.grid):
            if rank in row:
                return j, row.index(rank)
        raise BackendError(f"rank {rank} is not in this group", fix="pass a rank of the group")

    # reduce, gather and scatter through the collectives above: nothing leaves shared memory
    # between a node's ranks, and they are rare in training (checkpoints, object collectives)

    def reduce(self, flat: torch.Tensor, root: int, code: Any, fn: Callable[..., Any]) -> None:
        tmp = flat.clone()
        self.all_reduce(tmp, code, fn)
        if self.eng.rank == root:
            flat.copy_(tmp)

    def gather(self, inp: torch.Tensor, outs: Optional[Sequence[torch.Tensor]], root: int, size: int) -> None:
        tmp = [torch.empty_like(inp) for _ in range(size)]
        self.all_gather(inp, tmp)
        if self.eng.rank == root and outs is not None:
            for o, t in zip(outs, tmp):
                o.copy_(t)

    def scatter(self, inps: Optional[Sequence[torch.Tensor]], out: torch.Tensor, root: int, size: int) -> None:
        k = out.numel()
        packed = torch.cat(list(inps)) if self.eng.rank == root and inps is not None else torch.empty(
            size * k, dtype=torch.uint8)
        self.broadcast(packed, root)
        mine = self.eng.rank
        out.copy_(packed[mine * k:(mine + 1) * k])



class SumThenDivide:
    """A gloo group of every rank (a group that runs every collective on gloo, and the one the
    hierarchy keeps for all_to_all and point-to-point) that never sees ``ReduceOp.AVG``: an AVG
    reduction runs as SUM and the outputs are divided by the group size once it finished, as on
    the shared-memory paths (torch 2.8's gloo returns the sum for an AVG reduce_scatter).
    Everything else is the gloo group's own."""

    def __init__(self, gloo: Any, size: int) -> None:
        self._gloo, self._size = gloo, size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gloo, name)

    def _avg(self, opts: Any, outputs: Sequence[torch.Tensor], call: Callable[[], Any]) -> Any:
        code = getattr(opts.reduceOp, "op", opts.reduceOp)
        if code != AVG:
            return call()
        for t in outputs:
            reducer(AVG, t.dtype)  # an average of integers is a clear error, as on every path
        asked, opts.reduceOp = opts.reduceOp, dist.ReduceOp(summed(code))
        try:
            work = call()
        finally:
            opts.reduceOp = asked  # a caller may hand the same options to its next call
        return GatheredWork([work], list(outputs), lambda: [t.div_(self._size) for t in outputs])

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
        return self._avg(opts, tensors, lambda: self._gloo.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
        return self._avg(opts, tensors, lambda: self._gloo.allreduce_coalesced(tensors, opts))

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
        mine = tensors if self._gloo.rank() == opts.rootRank else []
        return self._avg(opts, mine, lambda: self._gloo.reduce(tensors, opts))

    def reduce_scatter(self, outputs: Sequence[torch.Tensor], inputs: Any, opts: Any) -> Any:
        return self._avg(opts, outputs, lambda: self._gloo.reduce_scatter(outputs, inputs, opts))

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
        return self._avg(opts, [output], lambda: self._gloo._reduce_scatter_base(output, inp, opts))
