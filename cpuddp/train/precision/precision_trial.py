"""The precision trial: time fp32 and bf16 on the job's own first training steps, keep the faster.

bf16 pays where matrix products are large, and costs where casts dominate: on an Intel Xeon
with AMX, README's small example ran at 0.72x in bf16, a 2-layer transformer encoder at
1.45x (docs/performance.md has the figures and the CPUs).  No rule of thumb tells the two
apart for a given model, so ``prepare(mixed_precision="auto")`` measures:

1. The module's forward runs under a pre-hook that, on each **training** forward (module in
   ``train()`` mode, grad enabled), starts the clock and chooses the precision of that step.
   A step's time is the time from its forward to the next one's: forward, backward, the
   optimizer step and whatever else the loop does, as the job runs it.
2. The first :data:`WARM` steps (one of each precision: allocations, DDP's first bucket
   rebuild, oneDNN's bf16 kernels) are not counted; then ``n`` steps of each precision,
   interleaved in ``A B B A`` blocks so a drift in the machine's speed weighs on both alike
   (``n`` is ``CPUDDP_PRECISION_TRIAL``, default :data:`DEFAULT_STEPS`; A is the requested
   precision's default: fp32 for ``"auto"``, bf16 for ``"bf16"``, so the first step runs in it).
3. At the next training forward every rank takes the median of its steps of each precision,
   the ranks average them (one ``all_reduce``: every rank decides the same), and bf16 is kept
   when it is at least :data:`MARGIN` faster; else fp32 (the more exact of two equals).  The
   trial ends early, after a block of :data:`BLOCK` measured steps, when every step of one
   precision took over :data:`EARLY` times every step of the other on every rank (bf16
   emulated by kernels that lack it ran 8x slower: the trial should not pay for that long).  The
   decision is logged on rank 0 with both numbers, and :func:`cpuddp.prepared_info` says it.

An explicit ``mixed_precision="bf16"`` runs the same trial and keeps bf16 whatever it
measures, but says so (a warning on rank 0, with the numbers) when bf16 measured slower.
``CPUDDP_PRECISION_TRIAL=0`` skips the trial: ``"bf16"`` is then bf16 from the first step,
``"auto"`` fp32.  Evaluation forwards (``eval()`` or ``no_grad``) are never timed; during
the trial they run in the requested precision's default (bf16 for ``"bf16"``, fp32 for
``"auto"``), after it in the kept one.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import PrepareError, warn
from cpuddp.ranks import group_rank_world

from .bf16 import AutocastHooks

__all__ = ["PrecisionTrial", "add_precision_hooks", "trial_steps", "verdict", "DEFAULT_STEPS", "MARGIN", "WARM",
           "BLOCK", "EARLY", "ENV"]

_log = logging.getLogger("cpuddp.prepare")

ENV = "CPUDDP_PRECISION_TRIAL"
DEFAULT_STEPS = 6
#: bf16 is kept by "auto" only when its median step is this much shorter than fp32's.
MARGIN = 0.05
#: Steps not counted: the first of each precision.
WARM = 2
#: Measured steps per block (two of each); after each block the trial may end early ...
BLOCK = 4
#: ... when one precision's median step is this many times the other's: no need to pay for more.
EARLY = 1.5


def trial_steps(environ: Mapping[str, str]) -> int:
    """Measured steps per precision from ``CPUDDP_PRECISION_TRIAL`` (0: no trial)."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_STEPS
    if not raw.isdigit():
        raise PrepareError(f"{ENV}={raw!r} is not a whole number of steps",
                           fix=f"unset {ENV} (default {DEFAULT_STEPS} steps of each precision), or {ENV}=0 to skip "
                               "the measurement")
    return int(raw)


def schedule(n: int, first: bool = False) -> list[bool]:
    """The trial's precisions, True for bf16: one warm-up step of each, then ``n`` of each in
    ``A B B A`` blocks; ``first`` (the requested precision's default) starts each."""
    a, b = first, not first
    block = [a, b, b, a]
    steps = (block * ((n + 1) // 2))[: 2 * n]
    return [a, b, *steps]


def verdict(requested: str, fp32_s: float, bf16_s: float) -> tuple[bool, str, bool]:
    """Pure: (keep bf16?, the sentence that says why with both numbers, warn?)."""
    ratio = fp32_s / bf16_s if bf16_s > 0 else float("inf")
    numbers = (f"fp32 {fp32_s * 1e3:.1f} ms/step, bf16 {bf16_s * 1e3:.1f} ms/step on this job's first steps "
               f"(bf16 {ratio:.2f}x the speed of fp32)")
    if requested == "bf16":
        slower = bf16_s > fp32_s * (1 + MARGIN)
        tail = ("; bf16 as requested, but it is slower here: mixed_precision=\"auto\" (or None) would keep fp32"
                if slower else "; bf16 as requested")
        return True, numbers + tail, slower
    keep = bf16_s < fp32_s * (1 - MARGIN)
    tail = "; auto keeps bf16" if keep else f"; auto keeps fp32 (bf16 is not {MARGIN:.0%} faster)"
    return keep, numbers + tail, False


class PrecisionTrial(AutocastHooks):
    """Autocast hooks that time the first training steps in each precision, then keep one.

    ``on_decide(bf16, reason)`` is called once, on every rank, with the decision."""

    def __init__(self, dtype: torch.dtype, output_fp32: bool, *, requested: str, steps: int, group: Any,
                 on_decide: Optional[Callable[[bool, str], None]] = None) -> None:
        super().__init__(dtype, output_fp32)
        self.requested = requested
        self.plan = schedule(steps, first=requested == "bf16")
        self.group = group
        self.on_decide = on_decide
        self.bf16: Optional[bool] = None  # the decision; None while measuring
        self.reason = ""
        self.times: dict[bool, list[float]] = {False: [], True: []}
        self._index = 0
        self._last: Optional[tuple[float, bool]] = None
        self.clock: Callable[[], float] = time.perf_counter

    def _choose(self, module: nn.Module) -> bool:
        if self.bf16 is not None:
            return self.bf16
        if not (module.training and torch.is_grad_enabled()):
            return self.requested == "bf16"
        now = self.clock()
        if self._last is not None and self._index > WARM:
            start, was_bf16 = self._last
            self.times[was_bf16].append(now - start)
        done = self._index >= len(self.plan)
        if done or (self._index > WARM and (self._index - WARM) % BLOCK == 0 and self._apart()):
            self._decide(*self._medians())  # every rank reaches this forward: they agree
            return bool(self.bf16)
        use = self.plan[self._index]
        self._index += 1
        self._last = (now, use)
        return use

    def _apart(self) -> bool:
        """Is every step of one precision over :data:`EARLY` times every step of the other, on
        every rank?  (Min against max: one slow outlier cannot end the trial.)"""
        f, b = self.times[False], self.times[True]
        spread = torch.tensor([max(f), max(b), -min(f), -min(b)], dtype=torch.float64)
        if group_rank_world(self.group)[1] > 1:
            dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.group)
        max_f, max_b, min_f, min_b = float(spread[0]), float(spread[1]), -float(spread[2]), -float(spread[3])
        return min_b > EARLY * max_f or min_f > EARLY * max_b

    def _medians(self) -> tuple[float, float]:
        """Each precision's median step, averaged over the ranks (the same on every rank)."""
        medians = torch.tensor([statistics.median(self.times[False]), statistics.median(self.times[True])],
                               dtype=torch.float64)
        _, world = group_rank_world(self.group)
        if world > 1:
            dist.all_reduce(medians, group=self.group)
            medians /= world
        return float(medians[0]), float(medians[1])

    def _decide(self, fp32_s: float, bf16_s: float) -> None:
        keep, self.reason, loud = verdict(self.requested, fp32_s, bf16_s)
        steps = len(self.times[False]) + len(self.times[True])
        if steps < len(self.plan) - WARM:
            self.reason += f" (decided after {steps} measured steps: every step of one took over {EARLY:g}x the other's)"
        self.bf16 = keep
        if group_rank_world(None)[0] == 0:
            _log.warning("precision: %s", self.reason)
            if loud:
                warn(f"cpuddp.prepare: {self.reason}")
        if self.on_decide is not None:
            self.on_decide(keep, self.reason)

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) keeps the decision, or the requested precision's default
        # while measuring: it has no process group to agree with the other ranks.
        decided = self.bf16 if self.bf16 is not None else self.requested == "bf16"
        return {**super().__getstate__(), "requested": self.requested, "bf16": decided, "reason": self.reason}

    def __setstate__(self, state: dict) -> None:
        PrecisionTrial.__init__(self, state["dtype"], state["output_fp32"], requested=state["requested"], steps=0,
                                group=None)
        self.bf16, self.reason = state["bf16"], state["reason"]

    def pre(self, module: nn.Module, args: Any) -> None:
        if self._choose(module):
            super().pre(module, args)
        else:
            self._stack().append(None)

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        stack = self._stack()
        ctx = stack.pop() if stack else None
        if ctx is None:
            return None
        ctx.__exit__(None, None, None)
        if self.output_fp32 and output is not None:
            from .bf16 import to_fp32

            return to_fp32(output)
        return None


def add_precision_hooks(module: nn.Module, dtype: torch.dtype, output_fp32: bool, *, requested: Optional[str],
                        group: Any, measure: bool = True, on_decide: Optional[Callable[[bool, str], None]] = None,
                        environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], Optional[str]]:
    """Run ``module``'s forward in ``dtype``: through the trial for ``"auto"`` and ``"bf16"``
    (unless ``measure`` is false or ``CPUDDP_PRECISION_TRIAL=0``), else plain autocast.

    Returns the precision in force now (``"bf16"`` or None) and, when it differs from what
    :func:`~cpuddp.train.precision.bf16.decide_precision` said, the sentence saying why."""
    from .bf16 import add_autocast

    steps = trial_steps(os.environ if environ is None else environ) if measure else 0
    if requested == "auto" and steps == 0:
        why = f"{ENV}=0" if measure else "not measured on this path"
        return None, f"auto: fp32 ({why})"
    if requested not in ("auto", "bf16") or steps == 0:
        add_autocast(module, dtype, output_fp32)
        return "bf16", None
    trial = PrecisionTrial(dtype, output_fp32, requested=requested, steps=steps, group=group, on_decide=on_decide)
    module.register_forward_pre_hook(trial.pre)
    module.register_forward_hook(trial.post, always_call=True)
    why = (f"{requested}: measuring fp32 and bf16 on the first {len(trial.plan)} training steps "
           f"({steps} of each counted)")
    return ("bf16" if requested == "bf16" else None), why
