"""prepare(mixed_precision="auto"): the first training steps run in fp32 and bf16 by turns, are
timed, and the faster is kept (logged with both numbers); an explicit "bf16" that measures
slower says so.  The step times come from a fake clock the model itself advances (bf16 steps
cost what the test says), so the decision is tested without timing anything real; the real
figures are benchmarks (docs/performance.md)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from cpuddp.errors import PrepareError
from cpuddp.train import prepare as prepare_mod
from cpuddp.train.precision.precision_trial import DEFAULT_STEPS, ENV, PrecisionTrial, schedule, trial_steps, verdict
from cpuddp.train.prepare import prepare, prepared_info


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Timed(nn.Module):
    """A model whose step costs ``bf16_ms`` under bf16 autocast and ``fp32_ms`` otherwise, on
    the fake clock; records the precision of every forward."""

    def __init__(self, clock: _Clock, fp32_ms: float, bf16_ms: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.clock, self.cost = clock, {False: fp32_ms / 1e3, True: bf16_ms / 1e3}
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bf16 = torch.is_autocast_enabled("cpu")
        self.seen.append(bf16)
        self.clock.t += self.cost[bf16]
        return self.lin(x)


def _prepared(monkeypatch, fp32_ms: float, bf16_ms: float, requested: str = "auto", cpu_bf16: bool = True):
    monkeypatch.setattr(prepare_mod, "cpu_bf16_support", lambda: (cpu_bf16, "test CPU has avx512_bf16"))
    clock = _Clock()
    model = _Timed(clock, fp32_ms, bf16_ms)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = prepare(model, opt, mixed_precision=requested, ipex=False)
    for hook in out._forward_pre_hooks.values():
        if isinstance(getattr(hook, "__self__", None), PrecisionTrial):
            hook.__self__.clock = clock
    return model, out, opt


def _steps(out: nn.Module, opt, n: int) -> None:
    for _ in range(n):
        out(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


TRIAL = 2 + 2 * DEFAULT_STEPS  # forwards until the decision (it is taken at the next one)


# --------------------------------------------------------------------------- pure parts


def test_schedule_interleaves_and_starts_with_the_requested_default() -> None:
    plan = schedule(6)
    assert plan[:2] == [False, True] and plan[2:6] == [False, True, True, False]
    assert plan.count(True) == plan.count(False) == 7
    assert schedule(3, first=True)[:6] == [True, False, True, False, False, True] and len(schedule(3)) == 8


@pytest.mark.parametrize("requested, fp32, bf16, keep, words, warn", [
    ("auto", 0.100, 0.060, True, "auto keeps bf16", False),
    ("auto", 0.100, 0.140, False, "auto keeps fp32", False),
    ("auto", 0.100, 0.097, False, "bf16 is not 5% faster", False),  # a tie goes to the exact one
    ("bf16", 0.100, 0.140, True, "but it is slower here", True),
    ("bf16", 0.100, 0.060, True, "bf16 as requested", False),
])
def test_verdict(requested, fp32, bf16, keep, words, warn) -> None:
    got_keep, reason, got_warn = verdict(requested, fp32, bf16)
    assert (got_keep, got_warn) == (keep, warn) and words in reason
    assert f"fp32 {fp32 * 1e3:.1f} ms/step, bf16 {bf16 * 1e3:.1f} ms/step" in reason


def test_trial_steps_from_the_environment() -> None:
    assert trial_steps({}) == DEFAULT_STEPS and trial_steps({ENV: "0"}) == 0 and trial_steps({ENV: "3"}) == 3
    with pytest.raises(PrepareError, match=rf"{ENV}='many' is not a whole number"):
        trial_steps({ENV: "many"})


# --------------------------------------------------------------------------- prepare(..., "auto")


@pytest.mark.parametrize("fp32_ms, bf16_ms, kept", [(100, 70, "bf16"), (100, 140, None)])
def test_auto_keeps_the_faster_and_says_both_numbers(monkeypatch, caplog, fp32_ms, bf16_ms, kept) -> None:
    model, out, opt = _prepared(monkeypatch, fp32_ms, bf16_ms)
    assert prepared_info(out).precision_reason.startswith("auto: measuring fp32 and bf16 on the first 14")
    with caplog.at_level(logging.WARNING, logger="cpuddp.prepare"):
        _steps(out, opt, TRIAL + 3)
    info = prepared_info(out)
    assert info.mixed_precision == kept and info.requested_precision == "auto"
    assert f"fp32 {fp32_ms:.1f} ms/step, bf16 {bf16_ms:.1f} ms/step" in info.precision_reason
    assert info.precision_reason in caplog.text  # logged once, on rank 0
    assert model.seen[:TRIAL].count(True) == model.seen[:TRIAL].count(False) == TRIAL // 2
    assert model.seen[TRIAL:] == [kept == "bf16"] * 3  # then the kept one only


def test_eval_forwards_are_not_timed_and_run_fp32_during_an_auto_trial(monkeypatch) -> None:
    model, out, opt = _prepared(monkeypatch, 100, 70)
    _steps(out, opt, 4)
    with torch.no_grad():
        out(torch.randn(1, 4))
    out.eval()
    out(torch.randn(1, 4))
    out.train()
    assert model.seen[4:6] == [False, False]
    _steps(out, opt, TRIAL - 4 + 1)
    assert prepared_info(out).mixed_precision == "bf16"


def test_explicit_bf16_that_measures_slower_says_so_and_stays(monkeypatch) -> None:
    model, out, opt = _prepared(monkeypatch, 100, 140, requested="bf16")
    assert model.seen == [] and prepared_info(out).mixed_precision == "bf16"
    _steps(out, opt, 1)
    assert model.seen == [True]  # the first step runs in the precision asked for
    with pytest.warns(UserWarning, match=r"fp32 100.0 ms/step, bf16 140.0 ms/step .*it is slower here"):
        _steps(out, opt, TRIAL)
    assert prepared_info(out).mixed_precision == "bf16" and model.seen[-1] is True


@pytest.mark.parametrize("fp32_ms, bf16_ms, kept", [(30, 260, None), (300, 100, "bf16")])
def test_a_clear_verdict_ends_the_trial_early(monkeypatch, fp32_ms, bf16_ms, kept) -> None:
    """bf16 emulated (8x slower) need not be paid for 7 steps: after the first block of 4
    measured steps, every step of one precision over 1.5x every step of the other ends it."""
    model, out, opt = _prepared(monkeypatch, fp32_ms, bf16_ms)
    _steps(out, opt, 2 + 4 + 1 + 2)
    info = prepared_info(out)
    assert info.mixed_precision == kept and "decided after 4 measured steps" in info.precision_reason
    assert model.seen[:6].count(True) == 3 and model.seen[6:] == [kept == "bf16"] * 3


def test_one_slow_outlier_does_not_end_the_trial(monkeypatch) -> None:
    model, out, opt = _prepared(monkeypatch, 100, 90)
    costs = model.cost
    model.cost = {False: 0.100, True: 0.090}
    _steps(out, opt, 3)
    model.cost = {False: 0.100, True: 0.500}  # one bf16 step stalls (a page fault storm, a GC)
    _steps(out, opt, 1)
    model.cost = costs
    _steps(out, opt, TRIAL - 4 + 1)
    assert "decided after" not in prepared_info(out).precision_reason


def test_no_native_bf16_means_fp32_without_measuring(monkeypatch) -> None:
    model, out, opt = _prepared(monkeypatch, 100, 60, cpu_bf16=False)
    _steps(out, opt, TRIAL + 1)
    info = prepared_info(out)
    assert set(model.seen) == {False} and info.mixed_precision is None
    assert info.precision_reason.startswith("auto: fp32, not measured: ")


def test_the_trial_can_be_switched_off(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "0")
    model, out, opt = _prepared(monkeypatch, 100, 60)
    _steps(out, opt, 3)
    assert set(model.seen) == {False} and prepared_info(out).precision_reason == f"auto: fp32 ({ENV}=0)"
    model, out, opt = _prepared(monkeypatch, 100, 140, requested="bf16")
    _steps(out, opt, 3)
    assert set(model.seen) == {True}


def test_a_copy_keeps_the_decision(monkeypatch) -> None:
    model, out, opt = _prepared(monkeypatch, 100, 60)
    _steps(out, opt, TRIAL + 1)
    twin = copy.deepcopy(out)
    twin.seen.clear()
    twin(torch.randn(2, 4))
    assert twin.seen == [True]


# --------------------------------------------------------------------------- two ranks agree


def _two_rank_auto(fp32_ms: list, bf16_ms: list) -> dict:
    import cpuddp

    rank = cpuddp.get_rank()

    prepare_mod.cpu_bf16_support = lambda: (True, "test CPU")  # this rank's process only
    clock = _Clock()
    model = _Timed(clock, fp32_ms[rank], bf16_ms[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = prepare(model, opt, mixed_precision="auto", ipex=False)
    for hook in out._forward_pre_hooks.values():
        if isinstance(getattr(hook, "__self__", None), PrecisionTrial):
            hook.__self__.clock = clock
    _steps(out, opt, TRIAL + 2)
    info = prepared_info(out)
    return {"kept": info.mixed_precision, "reason": info.precision_reason, "last": model.seen[-2:]}


@pytest.mark.timeout(120)
def test_every_rank_keeps_the_same_precision(run_distributed) -> None:
    """Rank 0 sees bf16 faster, rank 1 slower: the ranks average their medians and agree
    (bf16: (60 + 130) / 2 = 95 ms against fp32's 100 ms is not 5% faster, so fp32)."""
    r0, r1 = run_distributed(_two_rank_auto, 2, args=([100, 100], [60, 130]), timeout=90)
    assert r0["kept"] is None and r1["kept"] is None and r0["reason"] == r1["reason"]
    assert "fp32 100.0 ms/step, bf16 95.0 ms/step" in r0["reason"]
    assert r0["last"] == r1["last"] == [False, False]
