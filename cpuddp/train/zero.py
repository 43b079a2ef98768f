"""``prepare(..., shard="optimizer")``: DDP whose gradient hook reduce-scatters, and the user's
optimizer stepping only this rank's share of every parameter (ZeRO stage 2).

Built on torch's extension points only -- a DDP communication hook and the optimizer's step
pre/post hooks -- so DDP keeps its buckets, their order and the overlap with backward:

* **Backward.**  The hook reduce-scatters each of DDP's gradient buckets
  (``reduce_scatter_single``): rank ``r`` receives the sum of elements ``[r*c, (r+1)*c)`` of
  the bucket (``c = numel // world``), divides it by the world size, and keeps it as its
  share's gradient.  The last ``numel - world*c`` elements (fewer than the world size) are
  all-reduced and stepped by every rank alike.  The model's own ``.grad`` keeps this rank's
  unreduced gradient (DDP's bucket); the optimizer never reads it.
* **Step.**  Each bucket's parameters live in one flat buffer in the bucket's order (``p.data``
  is a view of it, as ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` does), so a
  share is a plain view.  For the step only, the optimizer's param groups hold those views
  (*pieces*: the part of each parameter inside this rank's share) with their gradients; then
  each bucket's buffer is all-gathered in place (``all_gather_single``), so every rank holds
  every updated parameter again, and the param groups hold the model's parameters.
  Element-wise optimizers only (Adam, AdamW, SGD, ...): a piece is stepped on its own.
* **The first steps run as DDP.**  DDP rebuilds its buckets once, after the first iteration.
  Until every rank has seen the same bucket layout in two steps in a row (they agree before each
  step: :mod:`cpuddp.train.zero_sync`), the hook all-reduces (sum, then divide: the sharded
  steps' arithmetic) and the optimizer steps every parameter; at the next step the parameters
  move into their buffers and the optimizer state is cut to this rank's pieces
  (``prepared_info(...).sharded_since_step``).  A whole parameter and its pieces step to the
  same bits only with torch's foreach step, so prepare leaves the optimizer unfused
  (:data:`UNFUSED_WHY`).
* **State dicts.**  Between steps the optimizer's param groups hold the model's parameters, and
  its ``state_dict()``/``load_state_dict()`` -- collectives once sharded (``state_dict()``
  first waits for every rank in the store: :class:`~cpuddp.train.zero_sync.StateDictGate`) --
  give and take the whole, unsharded state as DDP's optimizer would, so ``torch.distributed.checkpoint.state_dict``
  (``get_state_dict``/``set_state_dict``) and plain ``torch.save`` work, across world sizes.

Costs: the same bytes on the wire as DDP's all-reduce (a reduce-scatter plus an all-gather), the
optimizer's work and state divided by the world size, no copy of parameters or gradients.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import PrepareError

from .zero_sync import WARN_AFTER, StateDictGate, agree_start, local_verdict

__all__ = ["ELEMENTWISE", "UNFUSED_WHY", "ZeroStep", "zero_hook", "zero_state"]

_log = logging.getLogger("cpuddp.prepare")

#: Optimizers whose update of an element reads only that element's parameter, gradient and
#: state (stepping a piece of a parameter equals stepping the whole and cutting), with their
#: per-element state: the keys shaped like the parameter.  (Adagrad is element-wise too, but it
#: creates its state in its constructor, before prepare could rebind it.)
PER_ELEMENT = {
    "SGD": ("momentum_buffer",), "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "Adamax": ("exp_avg", "exp_inf"),
    "NAdam": ("exp_avg", "exp_avg_sq"), "RAdam": ("exp_avg", "exp_avg_sq"),
    "RMSprop": ("square_avg", "momentum_buffer", "grad_avg"), "Adadelta": ("square_avg", "acc_delta"),
    "ASGD": ("ax",),
}
#: Their per-parameter numbers (one value per parameter, whatever its shape).
PER_PARAMETER = ("step", "mu_product", "eta", "mu")
ELEMENTWISE = tuple(PER_ELEMENT)

_ATTR = "_cpuddp_zero"

#: Why shard="optimizer" keeps torch's foreach step rather than the fused CPU Adam(W).
UNFUSED_WHY = ("the fused CPU kernel rounds an element differently near the end of a tensor (its scalar tail), so "
               "stepping a whole parameter (the steps before the sharding starts, e.g. the first after a resume) "
               "and stepping this rank's piece of it would differ in the last bit; torch's foreach step does not")


def zero_state(model: nn.Module) -> Optional["ZeroStep"]:
    """The :class:`ZeroStep` behind a model prepared with ``shard="optimizer"``, else None."""
    return model.__dict__.get(_ATTR)


def zero_hook(state, bucket):  # no annotations: DDP compares them with dist.GradBucket
    """DDP communication hook of ``shard="optimizer"`` (``state`` is the :class:`ZeroStep`)."""
    return state.reduce(bucket)


def _collective(name: str, fallback: str) -> Callable[..., Any]:
    # torch 2.13 deprecates *_tensor for *_single; 2.8 has only *_tensor
    return getattr(dist, name, None) or getattr(dist, fallback)


_reduce_scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
_all_gather = _collective("all_gather_single", "all_gather_into_tensor")


def _future(works: list, finish: Callable[[], torch.Tensor]) -> torch.futures.Future:
    """A future of ``finish()``'s tensor once every work is done (waiting here when the backend's
    work has no future: gloo's reduce-scatter)."""
    try:
        futures = [w.get_future() for w in works]
    except RuntimeError:  # "Work::getFuture not implemented"
        for w in works:
            w.wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(finish())
        return done
    return torch.futures.collect_all(futures).then(lambda _: finish())


@dataclass
class _Piece:
    """The part ``[lo, hi)`` of a parameter's flat elements that this rank steps."""

    param: torch.Tensor
    lo: int
    hi: int
    tensor: torch.Tensor  # view of the bucket's flat parameter buffer
    grad: torch.Tensor  # view of the bucket's reduced gradient share (or its tail)


@dataclass
class _Bucket:
    params: tuple  # the model's parameters, in DDP's bucket order
    offsets: list[int]
    chunk: int  # elements per rank
    flat: torch.Tensor  # the parameters
    grad: torch.Tensor  # this rank's reduced share
    tail: torch.Tensor  # the reduced last numel - world * chunk elements (every rank)
    pieces: list[_Piece] = field(default_factory=list)
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


def _index(items: tuple, item: Any) -> int:
    return next(i for i, x in enumerate(items) if x is item)


def _cut(key: str, value: Any, per_element: tuple, lo: int, hi: int) -> Any:
    """A piece's share of one optimizer state value (per-element values are cut, the rest copied)."""
    if torch.is_tensor(value) and key in per_element:
        return value.reshape(-1)[lo:hi].clone()
    return value.clone() if torch.is_tensor(value) else value


def _owner(start: int, chunk: int, world: int) -> int:
    """The rank that holds a bucket's element ``start`` (the tail: rank 0 speaks for every rank)."""
    return start // chunk if chunk and start < world * chunk else 0


class ZeroStep:
    """The state of ``shard="optimizer"`` for one DDP model and its optimizer (see the module)."""

    def __init__(self, ddp: nn.Module, optimizer: torch.optim.Optimizer, group: Any = None) -> None:
        self.optimizer = optimizer
        self.per_element = PER_ELEMENT[type(optimizer).__name__]
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.buckets: dict[int, _Bucket] = {}
        self.sharded_at: Optional[int] = None  # the step at which sharding began
        self.waiting: Optional[str] = None  # why the last step ran unsharded (every rank agreed on it)
        self._steps = 0
        self._seen: dict[int, tuple] = {}  # bucket index -> its parameters, this backward
        self._buffers: dict[int, torch.Tensor] = {}
        self._last: Optional[tuple] = None  # the layout of the previous step
        self._position = {id(p): i for i, p in enumerate(ddp.module.parameters())}
        self.gate = StateDictGate(group)
        self._ddp = ddp
        ddp.register_forward_pre_hook(lambda *_: self._before_forward())
        self._model_params: list[list[torch.Tensor]] = []
        self._step_params: list[list[torch.Tensor]] = []
        ddp.register_comm_hook(self, zero_hook)
        optimizer.register_step_pre_hook(lambda *_: self._before_step())
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        optimizer.state_dict = self.state_dict  # type: ignore[method-assign]
        optimizer.load_state_dict = self.load_state_dict  # type: ignore[method-assign]
        for m in {id(ddp): ddp, id(ddp.module): ddp.module}.values():
            m.__dict__[_ATTR] = self

    @property
    def sharded(self) -> bool:
        return self.sharded_at is not None

    @property
    def steps(self) -> int:
        """Optimizer steps taken in this process."""
        return self._steps

    # ------------------------------------------------------------------ backward: the hook

    def reduce(self, bucket: Any) -> torch.futures.Future:
        buf, index, params = bucket.buffer(), bucket.index(), tuple(bucket.parameters())
        self._seen[index] = params
        if not self.sharded:  # sum, then divide: the sharded steps' arithmetic, so both give the same gradients
            self._buffers[index] = buf
            return _future([dist.all_reduce(buf, group=self.group, async_op=True)], lambda: buf.div_(self.world))
        if index == 0:  # DDP reduces its buckets in index order: a backward's first collective
            self.gate.begin_round()
        b = self.buckets.get(index)
        if b is None or tuple(map(id, b.params)) != tuple(map(id, params)):
            raise RuntimeError(
                f"cpuddp shard='optimizer': DDP's gradient bucket {index} changed after the optimizer was "
                "sharded; cpuddp expects DDP to rebuild its buckets only after the first iteration")
        works, (head, tail) = [], b.grad_views(buf)
        with torch.profiler.record_function("cpuddp::shard::reduce_scatter"):
            if b.chunk:
                works.append(_reduce_scatter(b.grad, head, group=self.group, async_op=True))
            if b.tail.numel():
                works.append(dist.all_reduce(tail, group=self.group, async_op=True))

        def finish() -> torch.Tensor:
            b.grad.div_(self.world)
            if b.tail.numel():  # in DDP's bucket too: a second backward before the step adds to the mean
                b.tail.copy_(tail.div_(self.world))
            return buf

        return _future(works, finish)

    # ------------------------------------------------------------------ the step

    def _before_forward(self) -> None:
        """A forward that broadcasts DDP's buffers is a round of collectives (see zero_sync)."""
        will_sync = getattr(self._ddp, "will_sync_module_buffers", None)
        if self.sharded and torch.is_grad_enabled() and will_sync is not None and will_sync():
            self.gate.begin_round()

    def _agree_to_shard(self) -> None:
        """Shard when every rank saw the same settled bucket layout (one all-reduce), else say why not."""
        seen = {i: tuple(self._position.get(id(p), -1) for p in ps) for i, ps in self._seen.items()}
        code, crc, layout = local_verdict(seen, self._last)
        self._last = layout
        verdict, why = agree_start(code, crc, self.group)
        if verdict == "error":
            raise PrepareError(f"shard='optimizer' cannot shard: {why}", fix="prepare the same model on every rank")
        if verdict == "shard":
            self.waiting = None
            self._shard()
            return
        self.waiting = why
        if self._steps == WARN_AFTER:
            warnings.warn(f"cpuddp shard='optimizer': the optimizer is still not sharded after {self._steps} steps "
                          f"(every rank steps the whole optimizer state, as DDP does): {why}", RuntimeWarning,
                          stacklevel=4)

    def _before_step(self) -> None:
        self._steps += 1
        if not self.sharded:
            self._agree_to_shard()
        self._seen = {}
        self._buffers = {}  # DDP's buckets of this backward: DDP drops the old ones when it rebuilds
        if self.sharded:
            if len(self.optimizer.param_groups) != len(self._step_params):
                raise RuntimeError(
                    "cpuddp shard='optimizer': a param group was added after the optimizer was sharded; add every "
                    "group before cpuddp.prepare()")
            for group, params in zip(self.optimizer.param_groups, self._step_params):
                group["params"] = params
            for b in self.buckets.values():
                for piece in b.pieces:  # a parameter without a gradient (unused everywhere) is not stepped
                    piece.tensor.grad = piece.grad if piece.param.grad is not None else None

    def _after_step(self) -> None:
        if not self.sharded:
            return
        for group, params in zip(self.optimizer.param_groups, self._model_params):
            group["params"] = params
        works = []
        with torch.profiler.record_function("cpuddp::shard::all_gather"):
            for b in self.buckets.values():
                for piece in b.pieces:
                    piece.tensor.grad = None
                if b.chunk:
                    works.append(_all_gather(b.views["gathered"], b.views["mine"], group=self.group, async_op=True))
            for w in works:
                w.wait()

    # ------------------------------------------------------------------ sharding, once

    def _shard(self) -> None:
        """Cut the optimizer state to this rank's pieces, then move each bucket's parameters into
        its flat buffer and take this step's gradients from DDP's all-reduced buckets.  In that
        order, so that the whole state is freed before the new buffers are allocated (the peak
        stays near DDP's)."""
        opt = self.optimizer
        group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
        plans = {index: self._plan(self._seen[index]) for index in sorted(self._seen)}
        cut = self._cut_ranges(plans.values())
        pieces: list[list[torch.Tensor]] = [[] for _ in opt.param_groups]
        for index, plan in plans.items():
            b = self.buckets[index] = self._bucket(plan, self._buffers[index], cut)
            for piece in b.pieces:
                gi = group_of.get(id(piece.param))
                if gi is not None:
                    pieces[gi].append(piece.tensor)
        in_buckets = {id(p) for b in self.buckets.values() for p in b.params}
        for gi, g in enumerate(opt.param_groups):
            rest = [p for p in g["params"] if id(p) not in in_buckets]  # frozen: stepped as they are
            self._model_params.append(list(g["params"]))
            self._step_params.append(pieces[gi] + rest)
        self.sharded_at = self._steps
        _log.info("shard='optimizer': optimizer sharded at step %d (%d buckets, rank %d of %d)",
                  self._steps, len(self.buckets), self.rank, self.world)

    def _plan(self, params: tuple) -> tuple[tuple, list[int], int, list[tuple]]:
        """A bucket's layout: its parameters, their offsets, the elements per rank, and this rank's
        pieces as ``(param, lo, hi, start, stop, in_tail)`` (``start:stop`` in the flat buffer)."""
        offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        numel = sum(p.numel() for p in params)
        chunk = numel // self.world
        ranges = []
        for p, a in zip(params, offsets):
            e = a + p.numel()
            for lo, hi, tail in ((self.rank * chunk, (self.rank + 1) * chunk, False), (self.world * chunk, numel, True)):
                s, t = max(a, lo), min(e, hi)
                if s < t:
                    ranges.append((p, s - a, t - a, s, t, tail))
        return params, offsets, chunk, ranges

    def _cut_ranges(self, plans: Any) -> dict[tuple[int, int], dict[str, Any]]:
        """Each piece's share of its parameter's state, keyed ``(id(param), lo)``; the whole state of
        each parameter is dropped as soon as its pieces are cut."""
        state, cut = self.optimizer.state, {}
        for params, _, _, ranges in plans:
            for p in params:
                whole = state.pop(p, None)
                if whole:
                    for q, lo, hi, *_ in ranges:
                        if q is p:
                            cut[(id(p), lo)] = {k: _cut(k, v, self.per_element, lo, hi) for k, v in whole.items()}
        return cut

    def _bucket(self, plan: tuple, reduced: torch.Tensor, cut: dict[tuple[int, int], dict[str, Any]]) -> _Bucket:
        params, offsets, chunk, ranges = plan
        numel = sum(p.numel() for p in params)
        flat = torch.empty(numel, dtype=params[0].dtype)
        for p, off in zip(params, offsets):
            flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[off:off + p.numel()].view_as(p)
        lo = self.rank * chunk
        b = _Bucket(params, offsets, chunk, flat, reduced[lo:lo + chunk].clone(), reduced[self.world * chunk:].clone())
        b.views.update(gathered=flat[:b.shared], mine=flat[lo:lo + chunk])
        for p, plo, phi, s, t, tail in ranges:
            grads, base = (b.tail, b.shared) if tail else (b.grad, lo)
            piece = _Piece(p, plo, phi, flat[s:t], grads[s - base:t - base])
            b.pieces.append(piece)
            mine = cut.pop((id(p), plo), None)
            if mine is not None:
                self.optimizer.state[piece.tensor] = mine
        return b

    def _cut_state(self) -> None:
        """Replace each bucket parameter's optimizer state by its pieces' shares."""
        state = self.optimizer.state
        for b in self.buckets.values():
            for piece in b.pieces:
                whole = state.get(piece.param)
                if whole:
                    state[piece.tensor] = {k: _cut(k, v, self.per_element, piece.lo, piece.hi)
                                           for k, v in whole.items()}
            for p in b.params:
                state.pop(p, None)

    # ------------------------------------------------------------------ state dicts (collectives once sharded)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's whole state dict, as DDP's optimizer would give it (every rank calls it)."""
        opt = self.optimizer
        if not self.sharded:
            return type(opt).state_dict(opt)
        self.gate.enter()
        held = opt.state
        pieces = {id(pc.tensor) for b in self.buckets.values() for pc in b.pieces}
        whole: defaultdict = defaultdict(dict, ((p, s) for p, s in held.items() if id(p) not in pieces))
        for b in self.buckets.values():
            whole.update(self._gather_bucket(b))
        opt.state = whole
        try:
            return type(opt).state_dict(opt)
        finally:
            opt.state = held

    def _gather_bucket(self, b: _Bucket) -> dict[torch.Tensor, dict[str, Any]]:
        """Each bucket parameter's whole state: per-element values all-gathered from every rank's
        pieces, per-parameter numbers from the rank holding the parameter's first element.  What
        each parameter has is agreed first, so every rank makes the same calls whatever it holds
        (a parameter without state yet, a key only some param groups have)."""
        have, numbers = self._agree_state(b)
        flats = {}
        for ki, key in enumerate(self.per_element):
            if not have[ki].any():
                continue
            flat = torch.zeros_like(b.flat)
            for piece in b.pieces:
                value = self.optimizer.state.get(piece.tensor, {}).get(key)
                if value is not None:
                    start = b.offsets[_index(b.params, piece.param)] + piece.lo
                    flat[start:start + piece.hi - piece.lo].copy_(value)
            if b.chunk:
                _all_gather(flat[:b.shared], flat[self.rank * b.chunk:(self.rank + 1) * b.chunk].clone(),
                            group=self.group)
            flats[ki] = flat
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch's for "step"
        out = {}
        for j, (p, a) in enumerate(zip(b.params, b.offsets)):
            entry = {key: flats[ki][a:a + p.numel()].view_as(p)
                     for ki, key in enumerate(self.per_element) if have[ki, j]}
            entry.update((key, torch.tensor(numbers[1, ni, j].item(), dtype=scalar))
                         for ni, key in enumerate(PER_PARAMETER) if numbers[0, ni, j])
            if entry:
                out[p] = entry
        return out

    def _agree_state(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """``(have, numbers)``: which per-element keys each of the bucket's parameters has
        (``[key, param]``), and its per-parameter numbers (``[0]``: present, ``[1]``: value), as
        the rank holding the parameter's first element says (one all-reduce)."""
        state, keys = self.optimizer.state, self.per_element
        k, n, params = len(keys), len(PER_PARAMETER), len(b.params)
        table = torch.zeros(k * params + 2 * n * params + 1, dtype=torch.float64)  # the last: a key nobody knows
        have, numbers = table[:k * params].view(k, params), table[k * params:-1].view(2, n, params)
        for piece in b.pieces:
            j = _index(b.params, piece.param)
            if piece.lo or _owner(b.offsets[j], b.chunk, self.world) != self.rank:
                continue
            held = state.get(piece.tensor, {})
            if any(key not in keys and key not in PER_PARAMETER for key in held):
                table[-1] = 1.0  # said after the all-reduce, on every rank
            for ki, key in enumerate(keys):
                have[ki, j] = float(held.get(key) is not None)
            for ni, key in enumerate(PER_PARAMETER):
                if key in held:
                    numbers[0, ni, j], numbers[1, ni, j] = 1.0, float(held[key])
        dist.all_reduce(table, group=self.group)
        if table[-1]:
            raise RuntimeError(f"cpuddp shard='optimizer': {type(self.optimizer).__name__} holds optimizer state "
                               f"other than {self.per_element + PER_PARAMETER}, which cpuddp does not know how to "
                               "gather (a torch version cpuddp has not seen?); report it, and use shard='full' meanwhile")
        return have > 0, numbers

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (DDP-style) optimizer state dict; once sharded, keep this rank's pieces."""
        opt = self.optimizer
        type(opt).load_state_dict(opt, state_dict)
        if self.sharded:
            self._cut_state()

    # ------------------------------------------------------------------ for clip_grad_norm_

    def grad_shares(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The reduced gradients: this rank's shares, and the tails every rank holds alike."""
        return ([b.grad for b in self.buckets.values() if b.grad.numel()],
                [b.tail for b in self.buckets.values() if b.tail.numel()])
