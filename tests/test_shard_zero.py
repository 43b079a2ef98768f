"""shard="optimizer" and shard="full" on 2 real ranks: the optimizer state is really split, the ranks
agree when shard="optimizer" starts sharding (and say when it does not), optimizer.state_dict() on
one rank only is an error naming the fix, and a resumed run continues bit-identically (issue 37).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cpuddp
from cpuddp.errors import PrepareError, RankFailedError
from cpuddp.train.sharding.zero_sync import REASONS, WARN_AFTER, decide_start, local_verdict

# --------------------------------------------------------------------------- pure


def test_the_common_verdict():
    assert decide_start([0, 7, -7]) == ("shard", "")
    assert decide_start([2, 7, -7]) == ("wait", REASONS[2])
    assert decide_start([1, 0, -7]) == ("wait", REASONS[1])  # one rank saw no bucket: nobody shards
    verdict, why = decide_start([0, 9, -7])  # the same code, other layouts
    assert verdict == "error" and "differ" in why


def test_local_verdict_waits_for_a_layout_seen_twice():
    code, crc, first = local_verdict({0: (3, 2), 1: (1, 0)}, None)
    assert code == 2 and crc
    assert local_verdict({1: (1, 0), 0: (3, 2)}, first) == (0, crc, first)
    assert local_verdict({}, first)[0] == 1


def _step_pieces(optimizer_kw: dict, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """5 AdamW steps of one 1003-element parameter, stepped as the pieces ``cuts`` makes."""
    torch.manual_seed(0)
    whole, grads = torch.randn(1003), [torch.randn(1003) for _ in range(5)]
    bounds = [0, *cuts, 1003]
    pieces = [nn.Parameter(whole[a:b].clone()) for a, b in zip(bounds, bounds[1:])]
    opt = torch.optim.AdamW(pieces, lr=1e-2, **optimizer_kw)
    for g in grads:
        for p, a, b in zip(pieces, bounds, bounds[1:]):
            p.grad = g[a:b].clone()
        opt.step()
    return torch.cat([p.detach() for p in pieces]), torch.cat([opt.state[p]["exp_avg_sq"] for p in pieces])


def test_the_step_shard_optimizer_keeps_does_not_depend_on_the_pieces():
    """shard="optimizer" steps whole parameters before the sharding starts and pieces after: the
    step it keeps (foreach) must give each element the same bits either way.  (The fused CPU
    kernel, which prepare leaves off under shard="optimizer", does not: its scalar tail rounds
    otherwise -- the 1-ulp exp_avg_sq of issue 37.)"""
    for cuts in ([501], [7], [333, 777]):
        for a, b in zip(_step_pieces({"foreach": True}, []), _step_pieces({"foreach": True}, cuts)):
            assert torch.equal(a, b), cuts


def test_the_plan_splits_a_bucket_into_shares_and_a_tail():
    from cpuddp.train.sharding.zero_plan import ShardPlan, owner, plan_bucket

    a, b = torch.zeros(3), torch.zeros(6)  # 9 elements over 2 ranks: 4 each, element 8 the tail
    _, offsets, chunk, r0 = plan_bucket((a, b), 0, 2)
    assert (offsets, chunk) == ([0, 3], 4)
    assert [(p is a, lo, hi, s, t, tail) for p, lo, hi, s, t, tail in r0] == [
        (True, 0, 3, 0, 3, False), (False, 0, 1, 3, 4, False), (False, 5, 6, 8, 9, True)]
    _, _, _, r1 = plan_bucket((a, b), 1, 2)
    assert [(lo, hi, s, t, tail) for _, lo, hi, s, t, tail in r1] == [(1, 5, 4, 8, False), (5, 6, 8, 9, True)]
    assert [owner(start, 4, 2) for start in (0, 3, 4, 8)] == [0, 0, 1, 0]  # the tail: rank 0 speaks

    # the state is cut to the pieces, the parameters move into one buffer, the groups swap for the step
    p, q = nn.Parameter(torch.arange(3.0)), nn.Parameter(torch.arange(3.0, 9.0))
    opt = torch.optim.SGD([p, q], lr=0.1, momentum=0.9)
    opt.state[p] = {"momentum_buffer": torch.arange(3.0) * 10}
    plan = ShardPlan.build(opt, {0: (p, q)}, {0: torch.arange(9.0)}, ("momentum_buffer",), rank=1, world=2)
    bucket = plan.buckets[0]
    assert p.data_ptr() == bucket.flat.data_ptr() and torch.equal(bucket.flat, torch.arange(9.0))
    assert torch.equal(bucket.grad, torch.arange(4.0, 8.0)) and torch.equal(bucket.tail, torch.tensor([8.0]))
    assert p not in opt.state  # rank 1 holds no piece of p: its state is gone here
    q.grad = torch.zeros_like(q)
    plan.step_groups(opt)
    assert [t.tolist() for t in opt.param_groups[0]["params"]] == [[4.0, 5.0, 6.0, 7.0], [8.0]]
    assert torch.equal(opt.param_groups[0]["params"][0].grad, torch.arange(4.0, 8.0))
    plan.model_groups(opt)
    assert opt.param_groups[0]["params"][0] is p and all(pc.tensor.grad is None for pc in bucket.pieces)


# --------------------------------------------------------------------------- 2 real ranks: the state is split


def _split(shard: str):
    """After 6 steps: (elements of optimizer state this rank holds, of the whole, prepared_info)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = cpuddp.prepare(model, opt, shard=shard, shard_blocks=[nn.Linear] if shard == "full" else None, ipex=False)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(6):
        nn.functional.mse_loss(m(torch.randn(8, 32, generator=g)), torch.randn(8, 4, generator=g)).backward()
        opt.step()
        opt.zero_grad()
    held = sum((v.to_local() if hasattr(v, "to_local") else v).numel()
               for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))
    whole = 2 * sum(p.numel() for p in model.parameters())
    info = cpuddp.prepared_info(m)
    return held, whole, info.optimizer_sharded, info.sharded_since_step, info.fused_optimizer


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_each_rank_holds_its_share_of_the_optimizer_state(run_distributed, shard):
    ranks = run_distributed(_split, 2, args=(shard,), timeout=120)
    whole = ranks[0][1]
    assert sum(r[0] for r in ranks) == pytest.approx(whole, rel=0.01), ranks  # together: the whole, once
    for held, _, sharded, since, _ in ranks:
        assert held <= whole / 2 * 1.05, f"shard={shard!r}: a rank holds {held} of {whole} state elements"
        assert sharded and since == (1 if shard == "full" else 3), (sharded, since)
    if shard == "optimizer":
        assert not ranks[0][4], "shard='optimizer' must keep the foreach step (UNFUSED_WHY)"


def _bypassing_ddp():
    """Backward through the unwrapped module: DDP's hook never runs, so nothing can be sharded."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = cpuddp.prepare(model, opt, shard="optimizer", ipex=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(WARN_AFTER + 2):
            cpuddp.unwrap(m)(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    info = cpuddp.prepared_info(m)
    return [str(w.message) for w in caught if "not sharded" in str(w.message)], info.optimizer_sharded, info.notes


@pytest.mark.timeout(200)
def test_a_run_that_cannot_shard_says_so_and_why(run_distributed):
    for said, sharded, notes in run_distributed(_bypassing_ddp, 2, timeout=120):
        assert len(said) == 1 and "no gradient reached DDP" in said[0], said
        assert not sharded
        assert any("not sharded yet" in n for n in notes), notes


# --------------------------------------------------------------------------- state_dict() on one rank


def _state_dict_on_rank_0_only():
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = cpuddp.prepare(model, opt, shard="optimizer", ipex=False)
    for step in range(8):
        nn.functional.mse_loss(m(torch.randn(4, 16)), torch.randn(4, 3)).backward()
        opt.step()
        opt.zero_grad()
        if step == 4 and dist.get_rank() == 0:
            opt.state_dict()  # the mistake: the others go on training


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_state_dict_on_one_rank_is_an_error_naming_the_fix(run_distributed, backend):
    with pytest.raises(RankFailedError) as err:
        run_distributed(_state_dict_on_rank_0_only, 2, backend=backend, timeout=90)
    assert err.value.rank == 0, str(err.value)
    text = str(err.value)
    assert "every rank must call it" in text and "rank 1 went on training" in text, text
    assert "cpuddp.save_checkpoint" in text, text


# --------------------------------------------------------------------------- resume, bit for bit


STEPS, SAVED_AT = 12, 5


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(12, 32)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, dim_feedforward=72, dropout=0.0,
                                                               batch_first=True) for _ in range(2))
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def _objects(shard):
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=8)
    # DDP's first buckets (the first 1 MiB, then the cap, in reverse order) are rebuilt after a
    # process's first backward into 16 KiB buckets: the first steps after a resume see another layout
    extra = {"shard_blocks": [nn.TransformerEncoderLayer]} if shard == "full" else {"bucket_cap_mb": 1 / 64}
    m = cpuddp.prepare(model, opt, shard=shard, ipex=False, **extra)
    return model, m, opt, sched


def _train(m, opt, sched, first: int, last: int) -> None:
    import torch.distributed as dist

    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(4, 6, 12, generator=g), torch.randint(0, 5, (4,), generator=g)
        nn.functional.cross_entropy(m(x), y).backward()
        cpuddp.clip_grad_norm_(m, 0.05)  # below every step's norm here: each step is clipped
        opt.step()
        sched.step()
        opt.zero_grad()


def _end_state(model, opt):
    """Every parameter, whole, and the whole optimizer state dict (a collective: every rank)."""
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in model.named_parameters()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    state = {k: {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for n, v in st.items()}
             for k, st in osd["state"].items()}
    return weights, state


def _uninterrupted(shard: str):
    model, m, opt, sched = _objects(shard)
    _train(m, opt, sched, 0, STEPS)
    return _end_state(model, opt)


def _until_saved(shard: str, path: str) -> None:
    model, m, opt, sched = _objects(shard)
    _train(m, opt, sched, 0, SAVED_AT)
    cpuddp.save_checkpoint(path, step=SAVED_AT, model=m, optimizer=opt, scheduler=sched)


def _resumed(shard: str, path: str):
    model, m, opt, sched = _objects(shard)
    assert cpuddp.load_checkpoint(path, model=m, optimizer=opt, scheduler=sched).step == SAVED_AT
    _train(m, opt, sched, SAVED_AT, STEPS)
    return _end_state(model, opt)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shard", [None, "optimizer", "full"])
def test_a_resumed_run_continues_bit_identically(run_distributed, tmp_path, shard):
    """A transformer, AdamW, gradient clipping and an LR schedule on 2 ranks: STEPS steps in one
    run, against SAVED_AT steps, a checkpoint, and new processes (a new group) that load it and
    run the rest; every parameter and every optimizer state tensor must be equal, bit for bit."""
    want = run_distributed(_uninterrupted, 2, args=(shard,), timeout=150)[0]
    path = str(tmp_path / "ckpt")
    run_distributed(_until_saved, 2, args=(shard, path), timeout=150)
    got = run_distributed(_resumed, 2, args=(shard, path), timeout=150)[0]
    for name, w in want[0].items():
        assert torch.equal(got[0][name], w), f"shard={shard!r}: parameter {name} differs after the resume"
    assert sorted(got[1]) == sorted(want[1])
    for key, st in want[1].items():
        for k, v in st.items():
            assert torch.equal(got[1][key][k], v), f"shard={shard!r}: optimizer state {key}.{k} differs after the resume"


def test_an_optimizer_fused_by_the_user_is_kept_with_a_warning(monkeypatch):
    from cpuddp.train.strategies.zero import ZeroStrategy

    model = nn.Linear(4, 2)
    with pytest.warns(RuntimeWarning, match="leave fused unset"):
        ZeroStrategy().check_objects(model, torch.optim.AdamW(model.parameters(), fused=True))
    # through prepare (a world of 2 without a group: the DDP wrap refuses after the checks), the
    # warning names the user's line
    import importlib

    monkeypatch.setattr(importlib.import_module("cpuddp.train.prepare"), "_world_size", lambda group: 2)
    with pytest.warns(RuntimeWarning, match="leave fused unset") as said, \
            pytest.raises(PrepareError, match="not initialized"):
        cpuddp.prepare(model, torch.optim.AdamW(model.parameters(), fused=True), shard="optimizer", ipex=False)
    assert [w.filename for w in said if "leave fused unset" in str(w.message)] == [__file__]


def test_object_collectives_work_without_numpy(monkeypatch):
    """README's install has no numpy, and torch's object collectives (which DCP plans through)
    read what they receive with ``tensor.numpy()``; ``without_numpy`` gives them another way."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from cpuddp.train.common.objects import numpy_missing, without_numpy

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    monkeypatch.setattr(c10d, "_tensor_to_object", c10d._tensor_to_object)  # restored after the test
    assert numpy_missing()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        box: list = [None]
        with pytest.raises(RuntimeError, match="Numpy is not available"):
            dist.all_gather_object(box, {"seat": (0, 1, 2)})
        assert without_numpy() and without_numpy()  # installed once
        dist.all_gather_object(box, {"seat": (0, 1, 2), "text": "é" * 300})
        assert box == [{"seat": (0, 1, 2), "text": "é" * 300}]
    finally:
        dist.destroy_process_group()
