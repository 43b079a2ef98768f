"""Tests for cpuddp.prepare: decisions (pure), the stock path, DDP, and DDP == big batch."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pickle
import warnings

import pytest
import torch
from torch import nn

from cpuddp.train.precision import ipex as _ipex
from cpuddp.train.precision import optim as prepare_optim
from cpuddp.train.precision import bf16 as prepare_precision
from cpuddp.errors import PrepareError
from cpuddp.train.common.comm import bf16_allreduce_hook
from cpuddp.train.strategies.ddp import ddp_kwargs
from cpuddp.train.strategies.options import PrepareOptions
from cpuddp.train.precision.bf16 import decide_precision
from cpuddp.train.strategies.base import unwrap
from cpuddp.train.prepare import prepare, prepared_info

# the module, not the function of the same name that ``cpuddp.prepare`` is
prepare_mod = importlib.import_module("cpuddp.train.prepare")
IPEX = _ipex.probe()
needs_ipex = pytest.mark.skipif(not IPEX.usable, reason=f"IPEX not usable here: {IPEX.reason}")


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


# --------------------------------------------------------------------------- pure decisions


@pytest.mark.parametrize(
    "ipex_version, torch_version, usable",
    [
        ("2.8.0+cpu", "2.8.0", True),
        ("2.8.0", "2.8.1+cu128", True),
        ("2.8.0", "2.13.0+cpu", False),
        ("2.1.0", "2.10.0", False),  # "2.10" >= "2.1" as strings; not as versions
        ("2.10.0", "2.1.0", False),
        (None, "2.13.0", False),
        ("not-a-version", "2.8.0", False),
    ],
)
def test_ipex_version_check(ipex_version, torch_version, usable):
    probe = _ipex.check_versions(ipex_version, torch_version)
    assert probe.usable is usable
    assert probe.reason


def test_ipex_probe_does_not_import_ipex():
    import sys

    _ipex.probe()
    if not IPEX.usable:
        assert "intel_extension_for_pytorch" not in sys.modules


@pytest.mark.parametrize(
    "requested, strict, cpu_bf16, expect",
    [
        (None, False, True, None),
        ("fp32", True, False, None),
        ("no", False, True, None),
        ("bf16", False, True, torch.bfloat16),
        ("bf16", True, True, torch.bfloat16),
        ("bf16", False, False, None),  # warn-and-fall-back is prepare()'s job
    ],
)
def test_decide_precision(requested, strict, cpu_bf16, expect):
    dtype, why = decide_precision(requested, strict=strict, cpu_bf16=cpu_bf16, reason="test CPU")
    assert dtype is expect
    assert why


def test_decide_precision_strict_raises_without_bf16():
    with pytest.raises(PrepareError, match="strict=True"):
        decide_precision("bf16", strict=True, cpu_bf16=False, reason="CPU has neither AMX nor AVX512-BF16")


@pytest.mark.parametrize("bad", ["fp16", "BF16", "bfloat16", 16])
def test_decide_precision_rejects_unknown(bad):
    with pytest.raises(PrepareError, match="mixed_precision must be one of"):
        decide_precision(bad, strict=False, cpu_bf16=True, reason="")


@pytest.mark.parametrize(
    "flags, ok",
    [
        ({"amx": True, "avx512_bf16": False}, True),
        ({"amx": False, "avx512_bf16": True}, True),
        ({"amx": False, "avx512_bf16": False}, False),
        ({"amx": None, "avx512_bf16": None}, False),
    ],
)
def test_bf16_from_flags(flags, ok):
    assert prepare_precision.bf16_from_flags(flags, "test")[0] is ok


@pytest.mark.parametrize(
    "cpuinfo_flags, amx, avx512_bf16",
    [
        ({"avx2", "amx_tile", "amx_bf16"}, True, False),
        ({"avx512f", "avx512_bf16"}, False, True),
        ({"avx2", "fma"}, False, False),
    ],
)
def test_cpuinfo_flags_are_named_by_topology_cpu_features(cpuinfo_flags, amx, avx512_bf16):
    from cpuddp.topology import cpu_features

    got = prepare_precision.features_to_bf16_flags(cpu_features(cpuinfo_flags))
    assert got == {"amx": amx, "avx512_bf16": avx512_bf16}


def test_cpu_bf16_support_falls_back_to_the_topology_flags(monkeypatch):
    from cpuddp.topology import read as topology

    class _Topo:
        flags = frozenset({"avx2", "avx512_bf16"})

    monkeypatch.setattr(prepare_precision, "_torch_probes", lambda: {})
    monkeypatch.setattr(topology, "read_topology", lambda: _Topo())
    assert prepare_precision.cpu_bf16_support() == (True, "CPU has avx512_bf16 (/proc/cpuinfo)")
    _Topo.flags = frozenset()  # no flag list at all: unknown, not "neither"
    ok, why = prepare_precision.cpu_bf16_support()
    assert not ok and why.startswith("could not tell")


def test_cpu_bf16_support_reports_a_reason():
    ok, why = prepare_mod.cpu_bf16_support()
    assert isinstance(ok, bool) and why


# --------------------------------------------------------------------------- steps, alone


@pytest.mark.parametrize(
    "ddp, world, wants_grad, expect",
    [
        (None, 1, True, False),
        (None, 2, True, True),
        (None, 2, False, False),  # evaluation-only model: not wrapped
        (False, 2, True, False),
        (True, 1, True, True),
    ],
)
def test_decide_ddp(ddp, world, wants_grad, expect):
    assert prepare_mod.decide_ddp(ddp, world_size=world, wants_grad=wants_grad) is expect


def test_decide_ddp_true_without_grad_raises():
    with pytest.raises(PrepareError, match="ddp=True, but no parameter requires grad"):
        prepare_mod.decide_ddp(True, world_size=2, wants_grad=False)


def _fusion(opt, cpu_kernel=True):
    return prepare_optim.fusion_decision(opt, cpu_kernel=cpu_kernel)


def test_fusion_decision_is_pure_and_says_why():
    ps = list(_mlp().parameters())
    opt = torch.optim.AdamW(ps)
    assert _fusion(opt) == (True, "switched to the fused CPU kernel")
    assert opt.param_groups[0]["fused"] is None  # deciding changed nothing
    assert _fusion(opt, cpu_kernel=False) == (False, f"torch {torch.__version__} has no fused CPU Adam")

    class MyAdam(torch.optim.Adam):
        pass

    assert _fusion(MyAdam(ps)) == (False, "MyAdam has no fused CPU kernel we switch to")
    assert _fusion(torch.optim.Adam(ps, fused=False))[1] == "fused=False set by the user; respected"
    assert "foreach" in _fusion(torch.optim.Adam(ps, foreach=True))[1]
    complex_param = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    assert _fusion(torch.optim.Adam([complex_param])) == (
        False, "a parameter is torch.complex64 on cpu; the fused kernel needs real floating CPU tensors")
    stepped = torch.optim.Adam([torch.zeros(2, requires_grad=True)])
    stepped.state[stepped.param_groups[0]["params"][0]] = {"step": torch.tensor(1.0)}
    assert _fusion(stepped) == (False, "the optimizer has already stepped; left as it is")


def test_already_prepared_step():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert prepare_mod._already_prepared(model, opt, PrepareOptions()) is None  # never prepared
    out = prepare(model, opt, ipex=False)
    options = prepared_info(out).options
    assert prepare_mod._already_prepared(model, None, options) is out
    assert prepare_mod._already_prepared(out, opt, options) is out
    with pytest.raises(PrepareError, match="already prepared"):
        prepare_mod._already_prepared(out, opt, dataclasses.replace(options, static_graph=True))
    with pytest.raises(PrepareError, match="already prepared"):
        prepare_mod._already_prepared(out, torch.optim.SGD(model.parameters(), lr=0.1), options)


def test_check_bare_cpu_module_step():
    prepare_mod._check_bare_cpu_module(_mlp())
    with pytest.raises(PrepareError, match="already wrapped"):
        prepare_mod._check_bare_cpu_module(torch.compile(_mlp(), backend="eager"))
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(PrepareError, match="parameter 'weight' is on meta; cpuddp trains on the CPU"):
        prepare_mod._check_bare_cpu_module(meta)


def test_ddp_kwargs_step():
    kw = ddp_kwargs(PrepareOptions())
    assert kw == dict(device_ids=None, gradient_as_bucket_view=True, static_graph=False,
                      find_unused_parameters=False, process_group=None)  # no broadcast_buffers unless given
    kw = ddp_kwargs(PrepareOptions(broadcast_buffers=False, bucket_cap_mb=4,
                                   ddp_kwargs={"gradient_as_bucket_view": False}))
    assert kw["broadcast_buffers"] is False and kw["bucket_cap_mb"] == 4
    assert kw["gradient_as_bucket_view"] is False  # the user's ddp_kwargs win


def test_choose_path_step():
    notes: list = []
    assert prepare_mod._choose_path(False, notes) is None and notes == []
    probe = prepare_mod._choose_path(None, notes)
    assert (probe is not None) is IPEX.usable


class _FakeIpex:
    """Stands in for the IPEX module in the IPEX steps' unit tests (no IPEX is imported)."""

    def __init__(self, onednn_bf16: bool = True, new_optimizer: bool = False) -> None:
        self._C = type("C", (), {"onednn_has_bf16_support": staticmethod(lambda: onednn_bf16)})
        self.new_optimizer = new_optimizer
        self.calls: list = []

    def optimize(self, model, **kw):
        self.calls.append(kw)
        if "optimizer" not in kw:
            return model
        opt = kw["optimizer"]
        return model, (torch.optim.SGD(model.parameters(), lr=0.5) if self.new_optimizer else opt)


@pytest.mark.parametrize(
    "onednn, all_reduces, allreduce_ok, expect, note",
    [
        (True, False, True, torch.bfloat16, None),
        (True, True, True, torch.bfloat16, None),
        (False, False, True, None, "IPEX bf16 weights not used (IPEX's oneDNN has no bf16 kernels"),
        (True, True, False, None, "IPEX bf16 weights not used (gloo says no)"),
    ],
)
def test_ipex_weight_dtype_step(monkeypatch, onednn, all_reduces, allreduce_ok, expect, note):
    monkeypatch.setattr(prepare_mod, "bf16_allreduce_supported", lambda group: (allreduce_ok, "gloo says no"))
    notes: list = []
    assert prepare_mod._ipex_weight_dtype(_FakeIpex(onednn), torch.bfloat16, all_reduces, None, notes) is expect
    assert (notes[0].startswith(note) if note else notes == [])
    assert prepare_mod._ipex_weight_dtype(_FakeIpex(onednn), None, all_reduces, None, []) is None  # fp32


def test_ipex_optimize_keeps_the_users_optimizer_object():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fake, notes = _FakeIpex(new_optimizer=True), []
    assert prepare_optim.ipex_optimize(fake, model, opt, None, notes) is model
    assert fake.calls == [{"dtype": torch.float32, "inplace": True, "optimizer": opt}]
    assert opt.param_groups[0]["lr"] == 0.5  # the user's object adopted IPEX's optimizer
    assert notes == ["IPEX returned a new optimizer; the user's object now shares its state and step"]
    notes = []
    assert prepare_optim.ipex_optimize(_FakeIpex(), model, None, torch.bfloat16, notes) is model
    assert not model.training and "model.eval() was called" in notes[0]  # inference optimization


def test_choose_precision_step_warns_at_the_callers_line(monkeypatch):
    _with_cpu_bf16(monkeypatch, False)
    with pytest.warns(UserWarning, match="staying in fp32") as rec:
        assert prepare(_mlp(), mixed_precision="bf16", ipex=False) is not None
    assert rec[0].filename == __file__  # stacklevel points at the user's prepare() call
    assert prepare_mod._choose_precision(None, False) == (None, "fp32 requested")


# --------------------------------------------------------------------------- world size 1


def test_world1_returns_the_model_unwrapped():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = prepare(model, opt)
    assert out is model
    info = prepared_info(out)
    assert info is not None and not info.ddp and info.world_size == 1
    assert info.path == ("ipex" if IPEX.usable else "stock")


def test_optimizer_may_be_omitted():
    model = _mlp()
    out = prepare(model, ipex=False)
    assert prepared_info(out).fused_optimizer is False
    with torch.no_grad():
        assert out(torch.randn(3, 16)).shape == (3, 4)


def test_second_call_same_args_returns_it_unchanged():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    out = prepare(model, opt, ipex=False)
    hooks = (len(out._forward_hooks), len(out._forward_pre_hooks))
    assert prepare(out, opt, ipex=False) is out
    assert prepare(model, ipex=False) is out  # optimizer omitted: still the same preparation
    assert (len(out._forward_hooks), len(out._forward_pre_hooks)) == hooks


def test_second_call_other_args_raises():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    out = prepare(model, opt, ipex=False)
    with pytest.raises(PrepareError, match="already prepared"):
        prepare(out, opt, ipex=False, static_graph=True)
    with pytest.raises(PrepareError, match="already prepared"):
        prepare(out, torch.optim.AdamW(model.parameters()), ipex=False)


def test_prewrapped_model_raises():
    model = torch.compile(_mlp(), backend="eager")
    with pytest.raises(PrepareError, match="already wrapped"):
        prepare(model)


def test_deepcopy_and_pickle_of_a_prepared_model():
    model = prepare(_mlp(), ipex=False)
    assert prepared_info(copy.deepcopy(model)) is None
    assert prepared_info(pickle.loads(pickle.dumps(model))) is None


def test_unwrap_peels_compile_and_ddp_like_wrappers():
    inner = _mlp()
    assert unwrap(inner) is inner
    assert unwrap(torch.compile(inner, backend="eager")) is inner


def test_public_prepare_is_the_function_even_after_submodule_imports():
    import cpuddp
    import cpuddp.train.loop  # noqa: F401
    import cpuddp.train.prepare  # noqa: F401

    assert cpuddp.prepare is prepare
    assert prepared_info(cpuddp.prepare(_mlp(), ipex=False)) is not None


def test_bad_comm_hook_raises():
    with pytest.raises(PrepareError, match="comm_hook must be"):
        prepare(_mlp(), comm_hook="int8")


def test_ipex_true_without_ipex_raises():
    if IPEX.usable:
        pytest.skip("IPEX is usable here")
    with pytest.raises(PrepareError, match="ipex=True"):
        prepare(_mlp(), ipex=True)


# --------------------------------------------------------------------------- bf16 autocast


class _Recorder:
    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    def __call__(self, module, args, output):
        self.dtypes.append(output.dtype)


def _with_cpu_bf16(monkeypatch, ok: bool) -> None:
    for owner in (prepare_mod, prepare_precision):  # prepare's step, and the loop's autocast
        monkeypatch.setattr(owner, "cpu_bf16_support", lambda: (ok, "test CPU"))


def test_bf16_forward_runs_under_autocast_with_fp32_outputs(monkeypatch):
    _with_cpu_bf16(monkeypatch, True)
    model = _mlp()
    rec = _Recorder()
    model[0].register_forward_hook(rec)
    out = prepare(model, torch.optim.AdamW(model.parameters()), mixed_precision="bf16", ipex=False)
    y = out(torch.randn(2, 16))
    assert rec.dtypes == [torch.bfloat16]  # the Linear inside ran in bf16
    assert y.dtype == torch.float32  # output_fp32=True
    assert not torch.is_autocast_enabled("cpu")  # the context was left
    assert prepared_info(out).mixed_precision == "bf16"


def test_bf16_outputs_in_containers_are_cast():
    out = prepare_precision.to_fp32({"loss": torch.ones((), dtype=torch.bfloat16), "n": 3, "t": (torch.ones(1, dtype=torch.float16),)})
    assert out["loss"].dtype == torch.float32 and out["t"][0].dtype == torch.float32 and out["n"] == 3


def test_autocast_is_left_when_forward_raises(monkeypatch):
    _with_cpu_bf16(monkeypatch, True)

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            raise ValueError("boom")

    out = prepare(Boom(), mixed_precision="bf16", ipex=False)
    with pytest.raises(ValueError, match="boom"):
        out(torch.randn(1, 2))
    assert not torch.is_autocast_enabled("cpu")


def test_bf16_without_cpu_support_warns_and_stays_fp32(monkeypatch):
    _with_cpu_bf16(monkeypatch, False)
    model = _mlp()
    with pytest.warns(UserWarning, match="staying in fp32"):
        out = prepare(model, mixed_precision="bf16", ipex=False)
    assert prepared_info(out).mixed_precision is None
    assert out(torch.randn(2, 16)).dtype == torch.float32
    assert not out._forward_pre_hooks


def test_bf16_strict_without_cpu_support_raises(monkeypatch):
    _with_cpu_bf16(monkeypatch, False)
    with pytest.raises(PrepareError, match="strict=True"):
        prepare(_mlp(), mixed_precision="bf16", strict=True, ipex=False)


def test_cpuddp_autocast_follows_the_prepared_model(monkeypatch):
    from cpuddp.train.loop import autocast_for as autocast

    _with_cpu_bf16(monkeypatch, True)
    bf = prepare(_mlp(), mixed_precision="bf16", ipex=False)
    fp = prepare(_mlp(), ipex=False)
    with autocast(bf):
        assert torch.is_autocast_enabled("cpu")
    with autocast(fp):
        assert not torch.is_autocast_enabled("cpu")
    with autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


# --------------------------------------------------------------------------- fused optimizer


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int = 5) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_switch_keeps_the_users_object_and_matches(cls):
    ref = _mlp()
    model = copy.deepcopy(ref)
    ref_opt = cls(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
    out = prepare(model, opt, ipex=False)
    assert prepared_info(out).fused_optimizer
    assert all(g["fused"] is True for g in opt.param_groups)
    _steps(out, opt)  # stepping the user's own object
    _steps(ref, ref_opt)
    assert opt.state[next(model.parameters())]["step"].item() == 5
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, fused=False),
        lambda ps: torch.optim.AdamW(ps, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["fused-false", "foreach", "sgd"],
)
def test_fused_switch_respects_the_user(make):
    model = _mlp()
    opt = make(model.parameters())
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    out = prepare(model, opt, ipex=False)
    assert not prepared_info(out).fused_optimizer
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == before


def test_fused_switch_skips_an_optimizer_that_has_stepped():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    _steps(model, opt, 1)
    out = prepare(model, opt, ipex=False)
    assert not prepared_info(out).fused_optimizer
    _steps(out, opt, 1)


def test_fused_optimizer_false_leaves_it():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    prepare(model, opt, ipex=False, fused_optimizer=False)
    assert opt.param_groups[0]["fused"] is None


@pytest.mark.timeout(300)
def test_compile_option():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    out = prepare(model, opt, ipex=False, compile={"backend": "eager"})
    assert prepared_info(out).compiled and unwrap(out) is model
    _steps(out, opt, 2)


# --------------------------------------------------------------------------- IPEX (real)


@needs_ipex
def test_ipex_path_trains_and_keeps_the_users_optimizer():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = prepare(model, opt, ipex=True)
    info = prepared_info(out)
    assert info.path == "ipex" and info.ipex_version
    before = [p.detach().clone() for p in unwrap(out).parameters()]
    _steps(out, opt, 3)  # the user's object
    after = list(unwrap(out).parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


# --------------------------------------------------------------------------- DDP (2 ranks)


def _ddp_checks() -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    core = _mlp()
    opt = torch.optim.AdamW(core.parameters())
    model = prepare(core, opt, ipex=False, bucket_cap_mb=1)
    out["ddp"] = isinstance(model, DDP)
    out["bucket_view"] = model.gradient_as_bucket_view
    out["device_ids"] = model.device_ids
    out["info"] = prepared_info(model).as_dict()
    out["again"] = prepare(model, opt, ipex=False, bucket_cap_mb=1) is model
    out["inner_again"] = prepare(unwrap(model), ipex=False, bucket_cap_mb=1) is model
    out["bf16_allreduce"] = prepare_mod.bf16_allreduce_supported()
    # fp16 hook on gloo, and cpuddp's own bf16 hook when the probe passes: both train.
    for hook in ("fp16", "bf16"):
        m = _mlp()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            dm = prepare(m, opt, ipex=False, comm_hook=hook)
        _steps(dm, opt, 2)
        flat = torch.cat([p.detach().flatten() for p in m.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        out[hook] = (prepared_info(dm).comm_hook, [str(x.message) for x in w], torch.equal(gathered[0], gathered[1]))
    # a bf16 hook the backend cannot run: the warning points at the user's prepare() call
    from cpuddp.train.common import comm as comm_mod

    probe, comm_mod.bf16_allreduce_supported = comm_mod.bf16_allreduce_supported, lambda group: (False, "no")
    try:
        m = _mlp()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), ipex=False, comm_hook="bf16")
        out["bf16_refused_at"] = [x.filename for x in w if "comm_hook" in str(x.message)]
    finally:
        comm_mod.bf16_allreduce_supported = probe
    # an evaluation-only model (nothing requires grad) is not wrapped
    frozen = _mlp().requires_grad_(False)
    out["frozen_ddp"] = isinstance(prepare(frozen), DDP)
    return out


@pytest.mark.timeout(180)
def test_ddp_wrap_on_two_ranks(run_distributed):
    results = run_distributed(_ddp_checks, 2, timeout=150)
    for r in results:
        assert r["ddp"] and r["bucket_view"] and not r["device_ids"]
        assert r["info"]["ddp"] and r["info"]["world_size"] == 2
        assert r["again"] and r["inner_again"]
        assert not r["frozen_ddp"]
        assert r["bf16_refused_at"] == [__file__]
        assert r["fp16"][0] == "fp16" and r["fp16"][2]
        ok, why = r["bf16_allreduce"]
        assert r["bf16"][0] == ("bf16" if ok else None), why
        assert r["bf16"][2]  # ranks agree after steps either way
        if not ok:
            assert any("bf16" in m for m in r["bf16"][1])


def test_bf16_hook_matches_torch_name_check():
    # torch refuses hooks named bf16_compress_hook on CPU; ours must not carry that name.
    assert bf16_allreduce_hook.__name__ not in ("bf16_compress_hook", "bf16_compress_wrapper_hook")


# --------------------------------------------------------------------------- DDP == one big batch


STEPS, BATCH = 6, 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(STEPS * BATCH, 16, generator=g), torch.randn(STEPS * BATCH, 4, generator=g)


def _make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _train(opt_name: str, rank: int, world: int) -> list[torch.Tensor]:
    model = _mlp(seed=7)
    opt = _make_opt(opt_name, model.parameters())
    dmodel = prepare(model, opt, ipex=False)
    x, y = _data()
    per = BATCH // world
    for step in range(STEPS):
        lo = step * BATCH + rank * per
        xb, yb = x[lo : lo + per], y[lo : lo + per]
        opt.zero_grad()
        nn.functional.mse_loss(dmodel(xb), yb).backward()
        opt.step()
    return [p.detach().clone() for p in unwrap(dmodel).parameters()]


def _train_rank(opt_name: str) -> list[torch.Tensor]:
    import torch.distributed as dist

    return _train(opt_name, dist.get_rank(), dist.get_world_size())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adamw"])
def test_two_ranks_half_batch_equals_one_process_full_batch(run_distributed, opt_name):
    reference = _train(opt_name, 0, 1)
    ranks = run_distributed(_train_rank, 2, args=(opt_name,), timeout=150)
    # the run changed the weights (a test of nothing would pass too)
    assert any(not torch.allclose(a, b) for a, b in zip(reference, [p.detach() for p in _mlp(seed=7).parameters()]))
    for params in ranks:
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
