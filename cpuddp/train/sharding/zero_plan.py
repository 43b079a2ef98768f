"""``shard="optimizer"``: the shard plan -- which part of each of DDP's gradient buckets this rank
steps, the flat buffers that hold each bucket's parameters, and the optimizer state cut to it.

:func:`plan_bucket` is pure: a bucket's parameters, their offsets in the bucket's flat buffer,
the elements per rank (``chunk = numel // world``) and this rank's *pieces* -- the part of each
parameter inside its share ``[rank*chunk, (rank+1)*chunk)`` or inside the tail (the last
``numel - world*chunk`` elements, which every rank steps).  :meth:`ShardPlan.build` carries a
settled layout out: it cuts the optimizer state to the pieces first, then moves each bucket's
parameters into its flat buffer (``p.data`` a view of it), so the whole state is freed before
the buffers are allocated.  Between steps the optimizer's param groups hold the model's
parameters; for the step they hold the pieces (:meth:`ShardPlan.step_groups`, :meth:`ShardPlan.model_groups`).
:mod:`cpuddp.train.sharding.zero` runs the hook and the step over the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

__all__ = ["Piece", "Bucket", "ShardPlan", "plan_bucket", "cut_value", "owner", "index_of",
           "reduce_scatter", "all_gather"]


def _collective(name: str, fallback: str) -> Callable[..., Any]:
    # torch 2.13 deprecates *_tensor for *_single; 2.8 has only *_tensor
    return getattr(dist, name, None) or getattr(dist, fallback)


reduce_scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
all_gather = _collective("all_gather_single", "all_gather_into_tensor")


@dataclass
class Piece:
    """The part ``[lo, hi)`` of a parameter's flat elements that this rank steps."""

    param: torch.Tensor
    lo: int
    hi: int
    tensor: torch.Tensor  # view of the bucket's flat parameter buffer
    grad: torch.Tensor  # view of the bucket's reduced gradient share (or its tail)


@dataclass
class Bucket:
    params: tuple  # the model's parameters, in DDP's bucket order
    offsets: list[int]
    chunk: int  # elements per rank
    flat: torch.Tensor  # the parameters
    grad: torch.Tensor  # this rank's reduced share
    tail: torch.Tensor  # the reduced last numel - world * chunk elements (every rank)
    pieces: list[Piece] = field(default_factory=list)
    #: The views handed to collectives, kept for the bucket's life: a gloo worker that drops the
    #: last reference to a tensor Python created must take the GIL to free it, and one that does
    #: so while the interpreter exits aborts the process ("terminate called without an active
    #: exception"); with Python holding these, the worker's release frees nothing.
    views: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def shared(self) -> int:
        return self.flat.numel() - self.tail.numel()

    def grad_views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DDP's bucket buffer split at ``shared`` (the same views while DDP keeps the buffer)."""
        if self.views.get("buffer") is None or self.views["buffer"].data_ptr() != buf.data_ptr():
            self.views.update(buffer=buf, head=buf[:self.shared], tail=buf[self.shared:])
        return self.views["head"], self.views["tail"]


def index_of(items: tuple, item: Any) -> int:
    """The position of ``item`` in ``items`` (by identity: tensors compare element-wise)."""
    return next(i for i, x in enumerate(items) if x is item)


def cut_value(key: str, value: Any, per_element: tuple, lo: int, hi: int) -> Any:
    """A piece's share of one optimizer state value (per-element values are cut, the rest copied)."""
    if torch.is_tensor(value) and key in per_element:
        return value.reshape(-1)[lo:hi].clone()
    return value.clone() if torch.is_tensor(value) else value


def owner(start: int, chunk: int, world: int) -> int:
    """The rank that holds a bucket's element ``start`` (the tail: rank 0 speaks for every rank)."""
    return start // chunk if chunk and start < world * chunk else 0


def plan_bucket(params: tuple, rank: int, world: int) -> tuple[tuple, list[int], int, list[tuple]]:
    """Pure: a bucket's layout: its parameters, their offsets, the elements per rank, and this rank's
    pieces as ``(param, lo, hi, start, stop, in_tail)`` (``start:stop`` in the flat buffer)."""
    offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    numel = sum(p.numel() for p in params)
    chunk = numel // world
    ranges = []
    for p, a in zip(params, offsets):
        e = a + p.numel()
        for lo, hi, tail in ((rank * chunk, (rank + 1) * chunk, False), (world * chunk, numel, True)):
            s, t = max(a, lo), min(e, hi)
            if s < t:
                ranges.append((p, s - a, t - a, s, t, tail))
    return params, offsets, chunk, ranges


def _cut_ranges(state: Any, plans: Iterable[tuple], per_element: tuple) -> dict[tuple[int, int], dict[str, Any]]:
    """Each piece's share of its parameter's state, keyed ``(id(param), lo)``; the whole state of
    each parameter is dropped as soon as its pieces are cut."""
    cut = {}
    for params, _, _, ranges in plans:
        for p in params:
            whole = state.pop(p, None)
            if whole:
                for q, lo, hi, *_ in ranges:
                    if q is p:
                        cut[(id(p), lo)] = {k: cut_value(k, v, per_element, lo, hi) for k, v in whole.items()}
    return cut


def _bucket(plan: tuple, reduced: torch.Tensor, cut: dict[tuple[int, int], dict[str, Any]], state: Any,
            rank: int, world: int) -> Bucket:
    """A bucket's flat buffer (the parameters moved into it), its gradient share and tail (from
    this step's all-reduced ``reduced``), its pieces, each with its cut state."""
    params, offsets, chunk, ranges = plan
    numel = sum(p.numel() for p in params)
    flat = torch.empty(numel, dtype=params[0].dtype)
    for p, off in zip(params, offsets):
        flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[off:off + p.numel()].view_as(p)
    lo = rank * chunk
    b = Bucket(params, offsets, chunk, flat, reduced[lo:lo + chunk].clone(), reduced[world * chunk:].clone())
    b.views.update(gathered=flat[:b.shared], mine=flat[lo:lo + chunk])
    for p, plo, phi, s, t, tail in ranges:
        grads, base = (b.tail, b.shared) if tail else (b.grad, lo)
        piece = Piece(p, plo, phi, flat[s:t], grads[s - base:t - base])
        b.pieces.append(piece)
        mine = cut.pop((id(p), plo), None)
        if mine is not None:
            state[piece.tensor] = mine
    return b


@dataclass
class ShardPlan:
    """The buckets of a sharded optimizer, and what its param groups hold between steps
    (``model_params``) and for the step (``step_params``: the pieces, then the frozen rest)."""

    buckets: dict[int, Bucket]
    model_params: list[list[torch.Tensor]]
    step_params: list[list[torch.Tensor]]
    per_element: tuple

    @classmethod
    def build(cls, optimizer: torch.optim.Optimizer, seen: dict[int, tuple], reduced: dict[int, torch.Tensor],
              per_element: tuple, rank: int, world: int) -> ShardPlan:
        """Cut the optimizer state to this rank's pieces of the buckets ``seen`` (index -> parameters),
        then move each bucket's parameters into its flat buffer, taking this step's gradients from
        ``reduced`` (DDP's all-reduced buckets).  In that order, so that the whole state is freed
        before the new buffers are allocated (the peak stays near DDP's)."""
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        plans = {index: plan_bucket(seen[index], rank, world) for index in sorted(seen)}
        cut = _cut_ranges(optimizer.state, plans.values(), per_element)
        pieces: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        buckets = {}
        for index, plan in plans.items():
            b = buckets[index] = _bucket(plan, reduced[index], cut, optimizer.state, rank, world)
            for piece in b.pieces:
                gi = group_of.get(id(piece.param))
                if gi is not None:
                    pieces[gi].append(piece.tensor)
        in_buckets = {id(p) for b in buckets.values() for p in b.params}
        model_params, step_params = [], []
        for gi, g in enumerate(optimizer.param_groups):
            rest = [p for p in g["params"] if id(p) not in in_buckets]  # frozen: stepped as they are
            model_params.append(list(g["params"]))
            step_params.append(pieces[gi] + rest)
        return cls(buckets, model_params, step_params, per_element)

    def step_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """For the step: the param groups hold this rank's pieces, each with its reduced gradient."""
        if len(optimizer.param_groups) != len(self.step_params):
            raise RuntimeError(
                "cpuddp shard='optimizer': a param group was added after the optimizer was sharded; add every "
                "group before cpuddp.prepare()")
        for group, params in zip(optimizer.param_groups, self.step_params):
            group["params"] = params
        for b in self.buckets.values():
            for piece in b.pieces:  # a parameter without a gradient (unused everywhere) is not stepped
                piece.tensor.grad = piece.grad if piece.param.grad is not None else None

    def model_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """After the step: the param groups hold the model's parameters again; the pieces no gradient."""
        for group, params in zip(optimizer.param_groups, self.model_params):
            group["params"] = params
        for b in self.buckets.values():
            for piece in b.pieces:
                piece.tensor.grad = None

    def cut_state(self, state: Any) -> None:
        """Replace each bucket parameter's optimizer state in ``state`` by its pieces' shares."""
        for b in self.buckets.values():
            for piece in b.pieces:
                whole = state.get(piece.param)
                if whole:
                    state[piece.tensor] = {k: cut_value(k, v, self.per_element, piece.lo, piece.hi)
                                           for k, v in whole.items()}
            for p in b.params:
                state.pop(p, None)
