"""The route a shm group's collectives take: one object, chosen once when the group forms
(:meth:`~cpuddp.backends.shm.group.process_group.ShmProcessGroup._route_for`).

:class:`~cpuddp.backends.shm.group.calls.Collectives` (torch's methods) normalises torch's argument
forms and hands each call to the group's route, whose methods the group bound as ``_<name>``
when it formed (:data:`CALLS`): no ``if`` per call on what kind of group this is.  Four routes:

* :class:`~cpuddp.backends.shm.routes.route_node.NodeRoute` -- one node, shared memory, the Python
  engine (:class:`~cpuddp.backends.shm.python.local.LocalEngine`, NUMA levels inside it);
* :class:`~cpuddp.backends.shm.routes.route_native.NativeRoute` -- one node, one level, the native data
  path (:mod:`cpuddp.backends.shm.native`) for what it reduces, the Python engine for the rest;
  its :class:`~cpuddp.backends.shm.routes.direct.Direct` (no communication thread) is asked first, by
  :mod:`~cpuddp.backends.shm.group.calls` itself, so that the common call is one native call;
* :class:`~cpuddp.backends.shm.routes.route_node.CrossRoute` -- several nodes: shared memory inside each
  node and a cross group between them (:class:`~cpuddp.backends.shm.cross.hierarchy.Hierarchy`),
  all_to_all on the gloo group of every rank;
* :class:`WorldRoute` -- a group with no node-local engine (nodes of one rank, uneven nodes):
  every collective on the gloo group of every rank.

Each route's methods take the normalised call (tensors, the reduce op's code, the root) and
return torch's Work.  The shared-memory routes check the call (tensor kinds, dtypes and ops,
sizes, roots) before they post it: a refused call never happened, for this rank and its peers
alike; the world route leaves the checks to gloo.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.distributed as dist

from . import call_args
from .stream import GatheredWork

__all__ = ["CALLS", "Route", "WorldRoute", "WorldAllToAll", "world_all_to_all"]

#: The route's methods (the group binds each as ``_<name>`` when it forms).
CALLS = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_single",
         "all_gather_single_coalesced", "all_gather_coalesced", "gather", "reduce_scatter", "reduce_scatter_single",
         "reduce_scatter_single_coalesced", "scatter", "all_to_all", "all_to_all_single", "barrier")


class Route:
    """The interface (see the module docstring).  ``code``: a ``ReduceOp.RedOpType``; ``root``: a
    group rank; list arguments as torch's list forms pass them (one list per tensor)."""

    def all_reduce(self, tensors: List[Any], code: Any) -> Any:
        raise NotImplementedError

    def all_reduce_coalesced(self, tensors: List[Any], code: Any) -> Any:
        raise NotImplementedError

    def reduce(self, tensors: List[Any], root: Any, code: Any) -> Any:
        raise NotImplementedError

    def broadcast(self, tensors: List[Any], root: Any) -> Any:
        raise NotImplementedError

    def all_gather(self, outputs: Any, inputs: Any) -> Any:
        raise NotImplementedError

    def all_gather_single(self, output: Any, inp: Any) -> Any:
        raise NotImplementedError

    def all_gather_single_coalesced(self, outputs: List[Any], inputs: List[Any]) -> Any:
        raise NotImplementedError

    def all_gather_coalesced(self, outputs: Any, inputs: Any) -> Any:
        raise NotImplementedError

    def gather(self, outputs: Any, inputs: Any, root: Any) -> Any:
        raise NotImplementedError

    def reduce_scatter(self, outputs: Any, inputs: Any, code: Any) -> Any:
        raise NotImplementedError

    def reduce_scatter_single(self, output: Any, inp: Any, code: Any) -> Any:
        raise NotImplementedError

    def reduce_scatter_single_coalesced(self, outputs: List[Any], inputs: List[Any], code: Any) -> Any:
        raise NotImplementedError

    def scatter(self, outputs: Any, inputs: Any, root: Any) -> Any:
        raise NotImplementedError

    def all_to_all(self, outs: List[torch.Tensor], ins: List[torch.Tensor], agreed: Sequence[torch.Tensor],
                   result: Any) -> Any:
        """The list form (``outs``, ``ins``: lists of torch's ``result``, the outputs, and its inputs),
        its tensors checked and ``agreed`` (one dtype) chosen by the caller."""
        raise NotImplementedError

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: Any,
                          input_split_sizes: Any, agreed: Sequence[torch.Tensor]) -> Any:
        raise NotImplementedError

    def barrier(self) -> Any:
        raise NotImplementedError


def world_all_to_all(world: Any, outs: List[torch.Tensor], ins: List[torch.Tensor]) -> Any:
    """The list form on the gloo group of every rank, as one single-tensor call (gloo's list
    form needs equal sizes, and torch 2.9)."""
    flat_in = torch.cat([i.reshape(-1) for i in ins])
    flat_out = torch.empty(sum(o.numel() for o in outs), dtype=flat_in.dtype)
    work = world.alltoall_base(flat_out, flat_in, [o.numel() for o in outs], [i.numel() for i in ins])

    def unpack() -> None:
        for o, part in zip(outs, torch.split(flat_out, [o.numel() for o in outs])):
            o.copy_(part.view(o.shape))

    return GatheredWork([work], outs, unpack)


class WorldAllToAll:
    """all_to_all on ``self.world``, the gloo group of every rank (a hierarchy gains nothing for
    it): the world route's, and the cross-node route's."""

    world: Any

    def all_to_all(self, outs: List[torch.Tensor], ins: List[torch.Tensor], agreed: Sequence[torch.Tensor],
                   result: Any) -> Any:
        return world_all_to_all(self.world, outs, ins)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: Any,
                          input_split_sizes: Any, agreed: Sequence[torch.Tensor]) -> Any:
        return self.world.alltoall_base(output, inp, list(output_split_sizes or []), list(input_split_sizes or []))


class WorldRoute(WorldAllToAll, Route):
    """Every collective on ``world``, the gloo group of every rank
    (:class:`~cpuddp.backends.shm.cross.hierarchy.SumThenDivide`): no engine of the node's."""

    def __init__(self, world: Any) -> None:
        self.world = world

    def all_reduce(self, tensors: List[Any], code: Any) -> Any:
        return self.world.allreduce(tensors, call_args.options(dist.AllreduceOptions, reduceOp=code))

    def all_reduce_coalesced(self, tensors: List[Any], code: Any) -> Any:
        return self.world.allreduce_coalesced(tensors, call_args.options(dist.AllreduceCoalescedOptions, reduceOp=code))

    def reduce(self, tensors: List[Any], root: Any, code: Any) -> Any:
        return self.world.reduce(tensors, call_args.options(dist.ReduceOptions, reduceOp=code, rootRank=root))

    def broadcast(self, tensors: List[Any], root: Any) -> Any:
        return self.world.broadcast(tensors, call_args.options(dist.BroadcastOptions, rootRank=root))

    def all_gather(self, outputs: Any, inputs: Any) -> Any:
        return self.world.allgather(outputs, inputs)

    def all_gather_single(self, output: Any, inp: Any) -> Any:
        return self.world._allgather_base(output, inp)

    def all_gather_single_coalesced(self, outputs: List[Any], inputs: List[Any]) -> Any:
        return GatheredWork([self.world._allgather_base(o, i) for o, i in zip(outputs, inputs)], outputs)

    def all_gather_coalesced(self, outputs: Any, inputs: Any) -> Any:
        return self.world.allgather_coalesced(outputs, inputs)

    def gather(self, outputs: Any, inputs: Any, root: Any) -> Any:
        return self.world.gather(outputs, inputs, call_args.options(dist.GatherOptions, rootRank=root))

    def reduce_scatter(self, outputs: Any, inputs: Any, code: Any) -> Any:
        return self.world.reduce_scatter(outputs, inputs, call_args.options(dist.ReduceScatterOptions, reduceOp=code))

    def reduce_scatter_single(self, output: Any, inp: Any, code: Any) -> Any:
        return self.world._reduce_scatter_base(output, inp, call_args.options(dist.ReduceScatterOptions, reduceOp=code))

    def reduce_scatter_single_coalesced(self, outputs: List[Any], inputs: List[Any], code: Any) -> Any:
        o = call_args.options(dist.ReduceScatterOptions, reduceOp=code)
        return GatheredWork([self.world._reduce_scatter_base(a, b, o) for a, b in zip(outputs, inputs)], outputs)

    def scatter(self, outputs: Any, inputs: Any, root: Any) -> Any:
        return self.world.scatter(outputs, inputs, call_args.options(dist.ScatterOptions, rootRank=root))

    def barrier(self) -> Any:
        return self.world.barrier()
