"""The collectives torch calls on a shm group (:class:`Collectives`, mixed into
:class:`~cpuddp.backends.shm.group.process_group.ShmProcessGroup`), each handed to the group's route.

Every method: ask the group's direct route first where it has one (five collectives: one
native call, :mod:`cpuddp.backends.shm.routes.direct`), else normalise torch's argument forms
(:mod:`cpuddp.backends.shm.routes.call_args`) and hand the call to the route the group chose when it formed
(:mod:`cpuddp.backends.shm.routes.route`: one node in shared memory on the Python engine or the native
data path, several nodes through the hierarchy, or every rank's gloo group), whose methods the
group bound as ``_<name>`` (:data:`~cpuddp.backends.shm.routes.route.CALLS`): a bound method, no branch
on the kind of group per call.  The shared-memory routes
check a call (tensor kinds, dtypes and ops, sizes, roots) before it is posted: a refused call
never happened, for this rank and its peers alike (a peer that waits for it learns of it when
this rank calls something else, exits or dies, or the watchdog reports its error).  An error once
a call is posted breaks the group: every later call raises at once, and the peers stop too.
Tensors of any layout go through staging (:func:`cpuddp.backends.shm.python.ops.staged`).
"""

from __future__ import annotations

from typing import Any, Callable, List

import torch

from ..routes import call_args
from ..python.ops import check_tensors

__all__ = ["Collectives"]


class Collectives:
    """torch's collective methods for a group with ``_direct`` and its route's bound methods."""

    _direct: Any  # its direct route (cpuddp.backends.shm.routes.direct), or None
    # the route's methods (cpuddp.backends.shm.routes.route.CALLS), bound when the group formed
    _all_reduce: Callable[[List[Any], Any], Any]
    _all_reduce_coalesced: Callable[[List[Any], Any], Any]
    _reduce: Callable[[List[Any], Any, Any], Any]
    _broadcast: Callable[[List[Any], Any], Any]
    _all_gather: Callable[[Any, Any], Any]
    _all_gather_single: Callable[[Any, Any], Any]
    _all_gather_single_coalesced: Callable[[List[Any], List[Any]], Any]
    _all_gather_coalesced: Callable[[Any, Any], Any]
    _gather: Callable[[Any, Any, Any], Any]
    _reduce_scatter: Callable[[Any, Any, Any], Any]
    _reduce_scatter_single: Callable[[Any, Any, Any], Any]
    _reduce_scatter_single_coalesced: Callable[[List[Any], List[Any], Any], Any]
    _scatter: Callable[[Any, Any, Any], Any]
    _all_to_all: Callable[..., Any]
    _all_to_all_single: Callable[..., Any]
    _barrier: Callable[[], Any]
    rank: Callable[[], int]
    size: Callable[[], int]

    # ------------------------------------------------------------------ all_reduce, reduce

    def allreduce(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        direct = self._direct
        if direct is not None and not args and not kw:
            work = direct.all_reduce(tensors, opts)
            if work is not None:
                return work
        return self._all_reduce(call_args.one_tensor(tensors, "all_reduce"), call_args.reduce_op(opts, args, kw))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        return self._all_reduce_coalesced(list(tensors), call_args.reduce_op(opts, args, kw))

    def reduce(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(tensors, torch.Tensor):  # reduce(tensor, root, op=SUM, timeout=None)
            root, code = call_args.root_of(None, opts, kw), call_args.reduce_op(None, args, kw)
        else:
            root, code = call_args.root_of(opts, None, kw), call_args.reduce_op(opts)
        return self._reduce(call_args.one_tensor(tensors, "reduce"), root, code)

    # ------------------------------------------------------------------ broadcast

    def broadcast(self, tensors: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        direct = self._direct
        if direct is not None and not args and not kw:
            work = direct.broadcast(tensors, opts)
            if work is not None:
                return work
        if isinstance(tensors, torch.Tensor):  # broadcast(tensor, root, timeout=None)
            root = call_args.root_of(None, opts, kw)
        else:
            root = call_args.root_of(opts, None, kw)
        return self._broadcast(call_args.one_tensor(tensors, "broadcast"), root)

    # ------------------------------------------------------------------ all_gather, gather

    def allgather(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(inputs, torch.Tensor):  # allgather(output_list, input, timeout=None)
            outputs, inputs = [outputs], [inputs]
        return self._all_gather(outputs, inputs)

    def all_gather_single(self, output: Any, input: Any, *args: Any, **kw: Any) -> Any:  # noqa: A002
        direct = self._direct
        if direct is not None:
            work = direct.all_gather(output, input)
            if work is not None:
                return work
        return self._all_gather_single(output, input)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        return self._all_gather_single_coalesced(list(outputs), list(inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        return self._all_gather_coalesced(outputs, inputs)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(inputs, torch.Tensor):  # gather(output_list, input, root, timeout=None)
            root = call_args.root_of(None, opts, kw)
            outputs, inputs = ([outputs] if outputs else []), [inputs]
        else:
            root = call_args.root_of(opts, None, kw)
        return self._gather(outputs, inputs, root)

    # ------------------------------------------------------------------ reduce_scatter, scatter

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(outputs, torch.Tensor):  # reduce_scatter(output, input_list, op=SUM, timeout=None)
            outputs, inputs, code = [outputs], [inputs], call_args.reduce_op(opts, args, kw)
        else:
            code = call_args.reduce_op(opts)
        return self._reduce_scatter(outputs, inputs, code)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None, *args: Any,  # noqa: A002
                              **kw: Any) -> Any:
        direct = self._direct
        if direct is not None and not args and not kw:
            work = direct.reduce_scatter(output, input, opts)
            if work is not None:
                return work
        return self._reduce_scatter_single(output, input, call_args.reduce_op(opts, args, kw))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any,
                                        **kw: Any) -> Any:
        code, outputs, inputs = call_args.reduce_op(opts, args, kw), list(outputs), list(inputs)
        return self._reduce_scatter_single_coalesced(outputs, inputs, code)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None, *args: Any, **kw: Any) -> Any:
        if isinstance(outputs, torch.Tensor):  # scatter(output, input_list, root, timeout=None)
            root = call_args.root_of(None, opts, kw)
            outputs, inputs = [outputs], ([inputs] if inputs else [])
        else:
            root = call_args.root_of(opts, None, kw)
        return self._scatter(outputs, inputs, root)

    # ------------------------------------------------------------------ all_to_all, barrier

    def alltoall(self, outputs: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        outs, ins = list(outputs), list(inputs)
        check_tensors([*outs, *ins], "all_to_all")
        agreed = call_args.one_dtype(ins, outs, self.rank(), "all_to_all")
        return self._all_to_all(outs, ins, agreed, outputs)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any = None,  # noqa: A002
                          input_split_sizes: Any = None, *args: Any, **kw: Any) -> Any:
        check_tensors([output, input], "all_to_all_single")
        agreed = call_args.one_dtype([input], [output], self.rank(), "all_to_all_single")
        return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, agreed)

    alltoall_base = all_to_all_single

    def barrier(self, *args: Any, **kw: Any) -> Any:
        direct = self._direct
        if direct is not None:
            work = direct.barrier()
            if work is not None:
                return work
        return self._barrier()

