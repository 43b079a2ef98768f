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
  step: :mod:`cpuddp.train.sharding.zero_sync`), the hook all-reduces (sum, then divide: the sharded
  steps' arithmetic) and the optimizer steps every parameter; at the next step the parameters
  move into their buffers and the optimizer state is cut to this rank's pieces
  (``prepared_info(...).sharded_since_step``).  A whole parameter and its pieces step to the
  same bits only with torch's foreach step, so prepare leaves the optimizer unfused
  (:data:`UNFUSED_WHY`).
* **State dicts.**  Between steps the optimizer's param groups hold the model's parameters, and
  its ``state_dict()``/``load_state_dict()`` -- collectives once sharded (``state_dict()``
  first waits for every rank in the store: :class:`~cpuddp.train.sharding.zero_sync.StateDictGate`) --
  give and take the whole, unsharded state as DDP's optimizer would, so ``torch.distributed.checkpoint.state_dict``
  (``get_state_dict``/``set_state_dict``) and plain ``torch.save`` work, across world sizes.

The pieces, one job each: this module runs the hook and the step (:class:`ZeroStep`);
:mod:`cpuddp.train.sharding.zero_sync` tracks DDP's bucket layout and when the ranks agree to shard
(:class:`~cpuddp.train.sharding.zero_sync.BucketLayout`) and gates ``state_dict()``;
:mod:`cpuddp.train.sharding.zero_plan` is the shard plan (buckets, pieces, the state cut to them);
:mod:`cpuddp.train.sharding.zero_dicts` gathers the whole state dict from the pieces.

Costs: the same bytes on the wire as DDP's all-reduce (a reduce-scatter plus an all-gather), the
optimizer's work and state divided by the world size, no copy of parameters or gradients.
"""


from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .zero_dicts import whole_state
from .zero_norm import NormPlan, unsharded_norm
from .zero_plan import ShardPlan, all_gather, reduce_scatter
from .zero_sync import BucketLayout, StateDictGate

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


class ZeroStep:
    """The state of ``shard="optimizer"`` for one DDP model and its optimizer (see the module):
    the hooks on both, the backward's reduce-scatter and the step; the bucket layout, the plan and
    the state dicts are their modules' (:class:`BucketLayout`, :class:`ShardPlan`, :func:`whole_state`)."""

    def __init__(self, ddp: nn.Module, optimizer: torch.optim.Optimizer, group: Any = None) -> None:
        self.optimizer = optimizer
        self.per_element = PER_ELEMENT[type(optimizer).__name__]
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.plan: Optional[ShardPlan] = None  # once sharded
        self.sharded_at: Optional[int] = None  # the step at which sharding began
        self.layout = BucketLayout(ddp.module, group)
        self._steps = 0
        self.gate = StateDictGate(group)
        self._ddp = ddp
        self._norms: Optional[tuple] = None  # (the shard plan, its NormPlan)
        ddp.register_forward_pre_hook(lambda *_: self._before_forward())
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

    @property
    def waiting(self) -> Optional[str]:
        """Why the last step ran unsharded (every rank agreed on it); None once sharded."""
        return self.layout.waiting

    # ------------------------------------------------------------------ backward: the hook

    def reduce(self, bucket: Any) -> torch.futures.Future:
        buf, index, params = bucket.buffer(), bucket.index(), tuple(bucket.parameters())
        if self.plan is None:  # sum, then divide: the sharded steps' arithmetic, so both give the same gradients
            self.layout.saw(index, params, buf)
            return _future([dist.all_reduce(buf, group=self.group, async_op=True)], lambda: buf.div_(self.world))
        self.layout.saw(index, params)
        if index == 0:  # DDP reduces its buckets in index order: a backward's first collective
            self.gate.begin_round()
        b = self.plan.buckets.get(index)
        if b is None or tuple(map(id, b.params)) != tuple(map(id, params)):
            raise RuntimeError(
                f"cpuddp shard='optimizer': DDP's gradient bucket {index} changed after the optimizer was "
                "sharded; cpuddp expects DDP to rebuild its buckets only after the first iteration")
        works, (head, tail) = [], b.grad_views(buf)
        with torch.profiler.record_function("cpuddp::shard::reduce_scatter"):
            if b.chunk:
                works.append(reduce_scatter(b.grad, head, group=self.group, async_op=True))
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

    def _before_step(self) -> None:
        self._steps += 1
        if self.plan is None and self.layout.agree(self._steps):
            self._shard()
        self.layout.forget()
        if self.plan is not None:
            self.plan.step_groups(self.optimizer)

    def _shard(self) -> None:
        """Shard the optimizer over the layout every rank agreed on (:meth:`ShardPlan.build`)."""
        self.plan = ShardPlan.build(self.optimizer, self.layout.seen, self.layout.reduced, self.per_element,
                                    self.rank, self.world)
        self.sharded_at = self._steps
        _log.info("shard='optimizer': optimizer sharded at step %d (%d buckets, rank %d of %d)",
                  self._steps, len(self.plan.buckets), self.rank, self.world)

    def _after_step(self) -> None:
        if self.plan is None:
            return
        self.plan.model_groups(self.optimizer)
        works = []
        with torch.profiler.record_function("cpuddp::shard::all_gather"):
            for b in self.plan.buckets.values():
                if b.chunk:
                    works.append(all_gather(b.views["gathered"], b.views["mine"], group=self.group, async_op=True))
            for w in works:
                w.wait()

    # ------------------------------------------------------------------ state dicts (collectives once sharded)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's whole state dict, as DDP's optimizer would give it (every rank calls it)."""
        opt = self.optimizer
        if self.plan is None:
            return type(opt).state_dict(opt)
        self.gate.enter()
        held = opt.state
        opt.state = whole_state(opt, self.plan, self.rank, self.world, self.group)
        try:
            return type(opt).state_dict(opt)
        finally:
            opt.state = held

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (DDP-style) optimizer state dict; once sharded, keep this rank's pieces."""
        opt = self.optimizer
        type(opt).load_state_dict(opt, state_dict)
        if self.plan is not None:
            self.plan.cut_state(opt.state)

    # ------------------------------------------------------------------ clip_grad_norm_

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Scale the reduced gradients to a total norm of at most ``max_norm``, as torch's
        ``clip_grad_norm_`` does; the norm is computed to the same bits before and after the
        sharding starts (:mod:`cpuddp.train.sharding.zero_norm`), so a resumed run that clips stays
        bit-identical.  Returns the total norm (the same on every rank)."""
        params = self._norm_params()
        if self.plan is None:  # every rank holds every reduced gradient
            total = unsharded_norm(params, norm_type)
            grads = [p.grad for p in params if p.grad is not None]
        else:
            if self._norms is None or self._norms[0] is not self.plan:
                self._norms = (self.plan, NormPlan.build(self.plan, params, self.rank, self.world))
            total = self._norms[1].norm(norm_type, self.group)
            buckets = self.plan.buckets.values()
            grads = [t for b in buckets for t in (b.grad, b.tail) if t.numel()]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    def _norm_params(self) -> list[torch.Tensor]:
        """The parameters DDP reduces, in the model's order: the order of the norm's blocks."""
        ignored = getattr(self._ddp, "parameters_to_ignore", ())
        return [p for n, p in self._ddp.module.named_parameters() if p.requires_grad and n not in ignored]
