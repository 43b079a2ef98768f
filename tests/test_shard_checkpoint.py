"""Sharded checkpoints across world sizes: through ``torch.distributed.checkpoint`` directly, and
through cpuddp's training checkpoint (``save_checkpoint``/``load_checkpoint``).

A run saved with shard="full" on 2 ranks (every rank writes its shards) resumes on 1 rank, on 2
ranks with shard="full" and on 2 ranks with shard=None: the weights after loading equal the
saved ones, and training goes on as the uninterrupted run did.  The same for a run saved with
shard="optimizer" (whose optimizer gives its whole state: one file, written by rank 0).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cpuddp

SAVED_AT, MORE = 6, 6
TOL = dict(rtol=1e-5, atol=1e-7)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, rank: int, world: int):
    """Rank ``rank``'s batch of step ``step`` in a world of ``world``: the 2-rank run's batches,
    concatenated on a world of 1 (so one rank sees what two saw)."""
    parts = range(2) if world == 1 else [rank]
    xs, ys = [], []
    for r in parts:
        g = torch.Generator().manual_seed(1000 * step + r)
        xs.append(torch.randn(8, 16, generator=g))
        ys.append(torch.randn(8, 3, generator=g))
    return torch.cat(xs), torch.cat(ys)


def _steps(m, opt, first: int, count: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(first, first + count):
        x, y = _batch(step, dist.get_rank(), dist.get_world_size())
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(cpuddp.reduce_mean(loss.detach()).item())
    return losses


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _save(path: str, model: nn.Module, opt, via: str) -> None:
    if via == "cpuddp":
        cpuddp.save_checkpoint(path, step=SAVED_AT, model=model, optimizer=opt)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(path: str, model: nn.Module, opt, via: str) -> None:
    if via == "cpuddp":
        assert cpuddp.load_checkpoint(path, model=model, optimizer=opt).step == SAVED_AT
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _save_run(path: str, shard: str, via: str):
    """Train SAVED_AT steps, save, go on MORE steps: (weights at the save, the later losses)."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # ipex=False: unsharded (or at world size 1) prepare would step through IPEX's fused optimizer
    # where IPEX is installed (CI's torch 2.8 job): float-level different from torch's
    m = cpuddp.prepare(model, opt, shard=shard, shard_blocks=[nn.Linear] if shard == "full" else None, ipex=False)
    _steps(m, opt, 0, SAVED_AT)
    _save(path, m, opt, via)
    saved = _whole(model)
    return saved, _steps(m, opt, SAVED_AT, MORE)


def _resume_run(path: str, shard, via: str):
    """Prepare afresh, load the checkpoint: (weights after loading, the next MORE losses)."""
    torch.manual_seed(123)  # other initial weights: the load must replace them
    model = _mlp()
    for p in model.parameters():
        nn.init.normal_(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # ipex=False: unsharded (or at world size 1) prepare would step through IPEX's fused optimizer
    # where IPEX is installed (CI's torch 2.8 job): float-level different from torch's
    m = cpuddp.prepare(model, opt, shard=shard, shard_blocks=[nn.Linear] if shard == "full" else None, ipex=False)
    _load(path, m, opt, via)
    loaded = _whole(model)
    return loaded, _steps(m, opt, SAVED_AT, MORE)


def _check(resumed, saved, later):
    loaded, losses = resumed
    for name, w in saved.items():
        assert torch.equal(loaded[name], w), f"{name}: the loaded weights differ from the saved ones"
    assert losses == pytest.approx(later, rel=1e-5), "training after the resume differs from the uninterrupted run"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("via", ["dcp", "cpuddp"])
@pytest.mark.parametrize("saved_with", ["full", "optimizer"])
def test_a_sharded_checkpoint_resumes_on_1_rank_2_ranks_and_unsharded(run_distributed, tmp_path, saved_with, via):
    path = str(tmp_path / "ckpt")
    saved, later = run_distributed(_save_run, 2, args=(path, saved_with, via), timeout=120)[0]
    _check(run_distributed(_resume_run, 1, args=(path, "full", via), timeout=120)[0], saved, later)
    _check(run_distributed(_resume_run, 2, args=(path, saved_with, via), timeout=120)[0], saved, later)
    _check(run_distributed(_resume_run, 2, args=(path, None, via), timeout=120)[0], saved, later)


def _plain_state_dict_round_trip(path: str) -> dict:
    """save_state_dict of a shard="full" model is a plain state dict torch.load reads without
    cpuddp (whole tensors, no DTensor); load_state_dict puts it back into a sharded model."""
    import torch.distributed as dist

    model = _mlp()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sharded = cpuddp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), shard="full")
    cpuddp.save_state_dict(sharded, path)
    plain = {}
    if dist.get_rank() == 0:
        loaded = torch.load(path, weights_only=True)
        plain = {k: (type(v).__name__, tuple(v.shape), bool(torch.equal(v, want[k]))) for k, v in loaded.items()}
    fresh = _mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    again = cpuddp.prepare(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), shard="full")
    result = cpuddp.load_state_dict(again, path)
    back = _whole(again)
    return {"plain": plain, "back": all(torch.equal(back[k], want[k]) for k in want),
            "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


def test_save_state_dict_of_a_sharded_model_is_a_plain_state_dict(run_distributed, tmp_path):
    """Issue 46: save_state_dict with shard="full" wrote DTensors that a plain torch.load could not
    read, though its docs promise a plain state dict."""
    res = run_distributed(_plain_state_dict_round_trip, 2, args=(str(tmp_path / "model.pt"),), timeout=180)
    plain = res[0]["plain"]
    assert plain and all(kind == "Tensor" and same for kind, _shape, same in plain.values()), plain
    assert plain["0.weight"][1] == (32, 16), plain
    for r in res:
        assert r["back"] and r["missing"] == [] and r["unexpected"] == [], r
