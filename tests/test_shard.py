"""prepare(shard=...): the decisions (pure), the bad inputs, world size 1, and on 2 real ranks
each mode's loss trajectory against DDP (fp32, relative difference <= 1e-5 after 50 steps)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn

import cpuddp
from cpuddp.errors import PrepareError
from cpuddp.train.strategies.options import PrepareOptions
from cpuddp.train.strategies.zero import ZeroStrategy
from cpuddp.train.sharding.shard import (
    LARGE,
    check_shardable,
    decide_mesh,
    find_blocks,
    shared_across_blocks,
)

STEPS = 50
RTOL = 1e-5


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 7), nn.Tanh(), nn.Linear(7, 3))


class _Stack(nn.Module):
    """A transformer-shaped model: embedding, a ModuleList of repeated layers, a tied head."""

    def __init__(self, tie: bool = False, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# --------------------------------------------------------------------------- the request (pure)


@pytest.mark.parametrize("shard", [None, "optimizer", "full"])
def test_valid_requests_pass(shard):
    assert PrepareOptions(shard=shard).shard == shard


@pytest.mark.parametrize("shard, options, words", [
    ("zero", {}, ["shard must be None, 'optimizer' or 'full'", "'zero'", "Fix: pass shard="]),
    (True, {}, ["Got True instead"]),
    ("full", {"ipex": True}, ["ipex=True", "Fix: pass ipex=None"]),
    ("optimizer", {"ddp": False}, ["ddp=False", "Fix: drop ddp=False"]),
    ("full", {"compile": True}, ["compile=True", "Fix: pass compile=False"]),
    ("optimizer", {"comm_hook": "fp16"}, ["comm_hook='fp16'", "Fix: drop comm_hook"]),
    ("full", {"bucket_cap_mb": 25}, ["bucket_cap_mb=25", "FSDP2", "Fix: drop bucket_cap_mb"]),
    ("full", {"static_graph": True}, ["static_graph=True"]),
    ("full", {"ddp_kwargs": {"x": 1}}, ["ddp_kwargs="]),
    ("optimizer", {"shard_blocks": [nn.Linear]}, ["shard_blocks with shard='optimizer'"]),
    (None, {"shard_blocks": [nn.Linear]}, ["shard=None", "Fix: pass shard='full'"]),
    ("full", {"shard_scope": "rack"}, ["shard_scope", "'rack'"]),
])
def test_bad_requests_name_the_argument_and_the_fix(shard, options, words):
    with pytest.raises(PrepareError) as info:
        PrepareOptions(shard=shard, **options)
    for word in words:
        assert word in str(info.value)


def test_prepare_rejects_an_unknown_shard_before_touching_anything():
    model = _mlp()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(PrepareError, match="shard must be None"):
        cpuddp.prepare(model, torch.optim.AdamW(model.parameters()), shard="zero3")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --------------------------------------------------------------------------- blocks (pure)


def test_default_blocks_are_the_repeated_layers_and_large_leaves():
    model = _Stack(vocab=LARGE // 8 + 1)  # embedding and head just over LARGE parameters
    assert [n for n, _ in find_blocks(model)] == ["embed", "layers.0", "layers.1", "layers.2", "head"]


def test_default_blocks_skip_small_leaves_and_find_torch_encoder_layers():
    assert find_blocks(_mlp()) == []
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), num_layers=2,
                                enable_nested_tensor=False)
    assert [n for n, _ in find_blocks(enc)] == ["layers.0", "layers.1"]
    assert [n for n, _ in find_blocks(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 10)))] == ["0"]


@pytest.mark.parametrize("spec, expect", [
    ([nn.Linear], ["layers.0.0", "layers.1.0", "layers.2.0", "head"]),
    ("Sequential", ["layers.0", "layers.1", "layers.2"]),
    (lambda name, m: name.startswith("layers."), ["layers.0", "layers.1", "layers.2"]),
    ((), []),
])
def test_named_blocks(spec, expect):
    assert [n for n, _ in find_blocks(_Stack(), spec)] == expect


def test_block_spec_errors():
    with pytest.raises(PrepareError, match="matched no module"):
        find_blocks(_Stack(), [nn.Conv2d])
    with pytest.raises(PrepareError, match="shard_blocks must be"):
        find_blocks(_Stack(), 3)


def test_shared_parameters_across_blocks_are_found():
    tied = _Stack(tie=True)
    blocks = find_blocks(tied, ["Embedding", nn.Linear])
    assert shared_across_blocks(tied, blocks) == {"embed.weight": ["embed.weight", "head.weight"]}
    assert shared_across_blocks(_Stack(), find_blocks(_Stack(), ["Embedding", nn.Linear])) == {}
    # a block and the rest of the model count as two groups too
    assert shared_across_blocks(tied, find_blocks(tied, ["Embedding"])) != {}
    # both uses in one group: fine
    assert shared_across_blocks(tied, []) == {}


# --------------------------------------------------------------------------- the mesh (pure)


@pytest.mark.parametrize("places, scope, expect", [
    ([(0, 0, 2), (0, 1, 2)], None, (1, 2)),
    ([(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)], None, (2, 2)),
    ([(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)], "node", (2, 2)),  # ranks round-robin over nodes
    ([(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)], "world", (1, 4)),
    ([(0, 0, 1), (1, 0, 1), (2, 0, 1)], None, (1, 3)),  # one rank per node: shard across nodes
])
def test_decide_mesh(places, scope, expect):
    assert decide_mesh(places, scope) == expect


def test_decide_mesh_refuses_uneven_nodes():
    with pytest.raises(PrepareError, match="same number of ranks on every node"):
        decide_mesh([(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)], None)
    with pytest.raises(PrepareError, match="not a 2 x 2 grid"):
        decide_mesh([(0, 0, 2), (0, 0, 2), (1, 0, 2), (1, 1, 2)], None)


# --------------------------------------------------------------------------- the objects


def test_non_cpu_tensors_are_refused():
    model = _mlp()
    model.register_buffer("scale", torch.ones(3, device="meta"))
    with pytest.raises(PrepareError, match="'scale' is on meta.*\nFix: call model.to\\('cpu'\\)"):
        check_shardable(model, None, "full")


def test_a_stepped_optimizer_is_refused():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with pytest.raises(PrepareError, match="already stepped.*\nFix: call cpuddp.prepare\\(\\) before"):
        check_shardable(model, opt, "optimizer")


def test_an_ipex_patched_optimizer_is_refused():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.params_attr = {}  # what ipex.optimize leaves on the optimizer it fused
    with pytest.raises(PrepareError, match="patched by ipex.optimize"):
        check_shardable(model, opt, "full")


def test_an_optimizer_over_foreign_tensors_is_refused():
    model = _mlp()
    opt = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(5))], lr=0.1)
    with pytest.raises(PrepareError, match=r"shape \[\(5,\)\] that are not parameters"):
        check_shardable(model, opt, "full")


def test_shard_optimizer_needs_an_elementwise_optimizer_holding_every_parameter():
    model = _mlp()
    with pytest.raises(PrepareError, match="none was given"):
        ZeroStrategy().check_objects(model, None)
    with pytest.raises(PrepareError, match="element-wise.*got LBFGS.*\nFix: use shard=\"full\""):
        ZeroStrategy().check_objects(model, torch.optim.LBFGS(model.parameters()))

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(PrepareError, match="got MyAdam"):
        ZeroStrategy().check_objects(model, MyAdam(model.parameters()))
    with pytest.raises(PrepareError, match=r"\['4.weight', '4.bias'\] are not in the optimizer"):
        ZeroStrategy().check_objects(model, torch.optim.AdamW(list(model.parameters())[:4]))
    ZeroStrategy().check_objects(model, torch.optim.AdamW(model.parameters()))
    check_shardable(model, torch.optim.LBFGS(model.parameters()), "full")  # FSDP2 takes any optimizer


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_world_size_1_is_a_no_op_with_one_log_line(shard, caplog):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    with caplog.at_level(logging.INFO, logger="cpuddp.prepare"):
        out = cpuddp.prepare(model, opt, shard=shard)
    assert out is model
    info = cpuddp.prepared_info(out)
    assert info.shard is None and f"shard={shard!r} not applied: world size 1" in info.notes
    said = [r.getMessage() for r in caplog.records if "nothing to shard" in r.getMessage()]
    assert said == [f"shard={shard!r} at world size 1: nothing to shard; the model is prepared unsharded"]
    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # the optimizer still trains the model


def test_helpers_at_world_size_1():
    # ipex=False: IPEX (CI's torch 2.8 job) optimizes a model prepared without an optimizer for inference
    model = cpuddp.prepare(_mlp(), None, ipex=False)
    model(torch.randn(4, 16)).pow(2).sum().backward()
    with cpuddp.no_sync(model):
        model(torch.randn(4, 16)).pow(2).sum().backward()
    before = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    total = cpuddp.clip_grad_norm_(model, 0.5)
    assert torch.allclose(total, before)
    after = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert after == pytest.approx(0.5, rel=1e-4)


# --------------------------------------------------------------------------- 2 real ranks


def _train(shard, steps=STEPS, groups=False, clip=None, accumulate=1, bf16=False):
    """Train the MLP on this rank's own data; the losses (mean over ranks) and the final weights."""
    import torch.distributed as dist

    model = _mlp()
    if groups:
        params = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    else:
        params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2)
    m = cpuddp.prepare(model, opt, shard=shard, shard_blocks=[nn.Linear] if shard == "full" else None,
                       mixed_precision="bf16" if bf16 else None)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(steps):
        for k in range(accumulate):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
            with cpuddp.no_sync(m) if k < accumulate - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(m(x), y)
                loss.backward()
        if clip:
            cpuddp.clip_grad_norm_(m, clip)
        opt.step()
        opt.zero_grad()
        losses.append(cpuddp.reduce_mean(loss.detach()).item())
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in model.named_parameters()}
    info = cpuddp.prepared_info(m)
    return losses, weights, info.shard, info.notes


def _assert_same_trajectory(ranks, reference):
    losses = ranks[0][0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert worst <= RTOL, f"loss differs from DDP by {worst:.2e} (relative) within {len(losses)} steps"
    for name, w in ranks[0][1].items():
        assert torch.equal(w, ranks[1][1][name]), f"{name} differs between the ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_each_mode_follows_ddps_loss_trajectory(run_distributed, backend):
    ddp = run_distributed(_train, 2, args=(None,), backend=backend, timeout=120)
    assert ddp[0][0][-1] < ddp[0][0][0] * 0.9, "DDP's loss did not fall: the comparison would be weak"
    for shard in ("optimizer", "full"):
        ranks = run_distributed(_train, 2, args=(shard,), backend=backend, timeout=120)
        assert ranks[0][2] == shard
        _assert_same_trajectory(ranks, ddp[0][0])
        # FSDP2 reduce-scatters a sum and divides it itself on both: gloo's AVG is a sum (torch 2.8),
        # shm's native route takes SUM only (its backend object says so)
        summed = f"shard='full' on {backend}: FSDP2 reduce-scatters a sum and divides it itself"
        assert (summed in ranks[0][3]) == (shard == "full"), ranks[0][3]
        for name, w in ranks[0][1].items():
            assert torch.allclose(w, ddp[0][1][name], rtol=1e-4, atol=1e-6), f"{shard}: {name} differs from DDP's"


@pytest.mark.timeout(300)
def test_groups_clipping_and_accumulation_match_ddp(run_distributed):
    kw = dict(steps=30, groups=True, clip=0.05, accumulate=2)
    ddp = run_distributed(_train, 2, args=(None,), kwargs=kw, timeout=120)
    for shard in ("optimizer", "full"):
        _assert_same_trajectory(run_distributed(_train, 2, args=(shard,), kwargs=kw, timeout=120), ddp[0][0])


class _Scaled(nn.Module):
    """The MLP times a learnable 0-dim temperature, and a layer forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.scale = _mlp(), nn.Parameter(torch.tensor(1.5))
        self.unused = nn.Linear(5, 5)

    def forward(self, x):
        return self.mlp(x) * self.scale


def _state_train(shard, kind):
    """5 steps of 2 backward passes each, accumulated without no_sync; the optimizer's whole state
    dict at the end (``state_dict()`` gathers it with shard='optimizer'), the weights, the losses."""
    import torch.distributed as dist

    model = _Scaled()
    if kind == "sgd":  # groups whose state differs: momentum 0 keeps none
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.SGD([{"params": weights, "momentum": 0.9}, {"params": others, "momentum": 0.0}], lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # ipex=False: torch's optimizer step on both sides (with IPEX installed, shard=None would step
    # through IPEX's fused optimizer, whose state dict has other entries)
    m = cpuddp.prepare(model, opt, shard=shard, find_unused_parameters=True, ipex=False)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(5):
        for _ in range(2):
            loss = nn.functional.mse_loss(m(torch.randn(8, 16, generator=g)), torch.randn(8, 3, generator=g))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(cpuddp.reduce_mean(loss.detach()).item())
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for i, st in opt.state_dict()["state"].items()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_optimizer_state_dict_matches_ddps_with_uneven_state(run_distributed, kind):
    """shard='optimizer' against DDP: param groups whose state keys differ, a 0-dim parameter, a
    parameter no rank uses, accumulation without no_sync; then the gathered state dict."""
    ddp = run_distributed(_state_train, 2, args=(None, kind), timeout=120)
    ranks = run_distributed(_state_train, 2, args=("optimizer", kind), timeout=120)
    _assert_same_trajectory(ranks, ddp[0][0])
    for name, w in ranks[0][1].items():
        assert torch.allclose(w, ddp[0][1][name], rtol=1e-5, atol=1e-7), f"{name} differs from DDP's"
    assert torch.equal(ranks[0][1]["unused.weight"], ddp[0][1]["unused.weight"])  # never stepped
    for r in (0, 1):
        want, got = ddp[0][2], ranks[r][2]
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for i in want:
            assert sorted(got[i]) == sorted(want[i]), (i, sorted(got[i]), sorted(want[i]))
            for k, v in want[i].items():
                assert got[i][k].shape == v.shape, (i, k, got[i][k].shape, v.shape)
                assert torch.allclose(got[i][k].float(), v.float(), rtol=1e-5, atol=1e-7), (i, k)


def _full_grads_against_the_mean():
    """shard='full': each parameter's gradient after one backward against the mean over ranks of
    the gradients an unwrapped copy computes (largest relative difference)."""
    import copy

    import torch.distributed as dist

    model = _mlp()
    plain = copy.deepcopy(model)
    m = cpuddp.prepare(model, torch.optim.AdamW(model.parameters()), shard="full", shard_blocks=[nn.Linear],
                       ipex=False)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
    nn.functional.mse_loss(m(x), y).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    worst = 0.0
    for (_, p), q in zip(model.named_parameters(), plain.parameters()):
        want = q.grad.clone()
        dist.all_reduce(want)
        want /= dist.get_world_size()
        got = p.grad.full_tensor()
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_full_gradients_are_the_mean_over_ranks(run_distributed, backend):
    """torch 2.8's gloo reduce-scatter returns the sum for ReduceOp.AVG (FSDP2's op): cpuddp has
    FSDP2 sum and divide on gloo, so the gradients are the mean on every torch."""
    for worst in run_distributed(_full_grads_against_the_mean, 2, backend=backend, timeout=120):
        assert worst < 1e-5, f"shard='full' gradients differ from the mean over ranks by {worst:.3g} (relative)"


@pytest.mark.timeout(200)
def test_bf16_full_and_optimizer_train(run_distributed):
    for shard in ("optimizer", "full"):
        kw = dict(steps=20, bf16=True)
        losses, weights, _, _ = run_distributed(_train, 2, args=(shard,), kwargs=kw, timeout=120)[0]
        assert losses[-1] < losses[0] * 0.9
        assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 masters, bf16 compute


def test_shard_full_refuses_parameters_shared_across_blocks():
    from cpuddp.train.sharding.shard import apply_full

    tied = _Stack(tie=True)

    def never():  # the check comes before any collective
        raise AssertionError("gathered places")

    with pytest.raises(PrepareError) as info:
        apply_full(tied, None, blocks=["Embedding", nn.Linear], scope=None, group=None, node_of=never,
                   bf16=False, notes=[])
    text = str(info.value)
    assert "'embed.weight' is shared by ['embed.weight', 'head.weight']" in text
    assert "Fix: name blocks that keep shared parameters together" in text


def test_the_default_policy_keeps_tied_leaves_in_the_root_group():
    from cpuddp.train.sharding.shard import apply_full

    tied = _Stack(tie=True, vocab=LARGE // 8 + 1)
    assert [n for n, _ in find_blocks(tied)] == ["embed", "layers.0", "layers.1", "layers.2", "head"]

    class Gathered(Exception):
        pass

    def stop():  # past the checks: the collective that builds the mesh
        raise Gathered

    with pytest.raises(Gathered):
        apply_full(tied, None, blocks=None, scope=None, group=None, node_of=stop, bf16=False, notes=[])


def test_running_allocator_reads_the_maps(tmp_path):
    from cpuddp.train.sharding.shard import running_allocator

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert running_allocator(str(maps)) == "glibc"
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n")
    assert running_allocator(str(maps)) == "tcmalloc"
    assert running_allocator(str(tmp_path / "missing")) == "unknown"
