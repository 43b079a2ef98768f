"""IPEX beside torch, for real: a mismatched IPEX is never imported, and prepare()'s IPEX path
trains on 1 and 2 ranks like the stock path, in fp32 and (where the CPU has it) bf16.

Tests that need a usable IPEX skip where none is installed or it does not match torch; under
``CPUDDP_REQUIRE_IPEX=1`` (``.ci/ipex.sh test``, torch 2.8 + IPEX 2.8) they fail instead.
IPEX is only ever imported inside the ranks that ``run_distributed`` spawns: importing it
re-registers autocast kernels for the whole process, which the rest of the suite must not see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from torch import nn

from cpuddp.train.precision import ipex as _ipex
from cpuddp.errors import PrepareError
from cpuddp.train.strategies.base import unwrap
from cpuddp.train.prepare import prepare, prepared_info
from cpuddp.topology import cpu_features, read_topology

IPEX = _ipex.probe()
REQUIRE = os.environ.get("CPUDDP_REQUIRE_IPEX") == "1"
FLAGS = read_topology().flags
FEATURES = cpu_features(FLAGS)
#: Native bf16, judged from /proc/cpuinfo -- independently of prepare()'s torch.cpu probes.
CPU_BF16 = FEATURES["amx_bf16"] or FEATURES["avx512_bf16"]
CPU_NAME = "AMX/AVX512-BF16" if CPU_BF16 else "no AMX/AVX512-BF16"


def _need_ipex() -> None:
    if IPEX.usable:
        return
    msg = f"IPEX not usable here: {IPEX.reason}"
    if REQUIRE:
        pytest.fail(f"{msg} (CPUDDP_REQUIRE_IPEX=1 demands it)")
    pytest.skip(msg)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


# --------------------------------------------------------------------------- a mismatched IPEX

_CHILD = r"""
import dataclasses, json, sys
import torch
from torch import nn
import cpuddp
from cpuddp.train.precision import ipex as _ipex
from cpuddp.errors import PrepareError

out = {"probe": dataclasses.asdict(_ipex.probe())}
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
prepared = cpuddp.prepare(model, opt, mixed_precision="bf16")
info = cpuddp.prepared_info(prepared)
out["path"], out["notes"] = info.path, list(info.notes)
before = model.weight.detach().clone()
prepared(torch.randn(3, 4)).sum().backward()
opt.step()
out["trained"] = not torch.equal(before, model.weight)
try:
    cpuddp.prepare(nn.Linear(4, 2), ipex=True)
    out["ipex_true"] = None
except PrepareError as exc:
    out["ipex_true"] = str(exc)
out["imported"] = "intel_extension_for_pytorch" in sys.modules
print("RESULT " + json.dumps(out))
"""


def _mismatched_version() -> str:
    """An IPEX release that is not for the running torch (2.7.0 beside torch 2.8, else 2.8.0)."""
    v = Version(torch.__version__)
    return "2.7.0" if (v.major, v.minor) == (2, 8) else "2.8.0"


def _fake_ipex(root: Path, version: str) -> Path:
    """A dist-info claiming IPEX ``version`` and a module that, like the real one, ends the
    interpreter on import (the real 2.8 prints "needs to work with PyTorch 2.8.*" and exits)."""
    pkg = root / "intel_extension_for_pytorch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os, sys\nsys.stderr.write('FAKE IPEX IMPORTED\\n')\nos._exit(86)\n")
    info = root / f"intel_extension_for_pytorch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: intel-extension-for-pytorch\nVersion: {version}\n")
    return root


@pytest.mark.parametrize("which", ["fake", "installed"])
def test_mismatched_ipex_is_detected_from_metadata_and_never_imported(tmp_path, which):
    env = dict(os.environ)
    if which == "fake":
        version = _mismatched_version()
        site = _fake_ipex(tmp_path / "site", version)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    else:
        if IPEX.ipex_version is None or IPEX.usable:
            pytest.skip(f"needs an installed IPEX that does not match torch {torch.__version__}: {IPEX.reason}")
        version = IPEX.ipex_version
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAKE IPEX IMPORTED" not in proc.stderr and "needs to work with PyTorch" not in proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["probe"]["usable"] is False and out["probe"]["ipex_version"] == version
    assert not out["imported"]
    assert out["path"] == "stock" and out["trained"]
    v = Version(version)
    assert any(f"IPEX not used: intel-extension-for-pytorch {version} is built for torch {v.major}.{v.minor}.*" in n
               for n in out["notes"]), out["notes"]
    assert out["ipex_true"] and "ipex=True" in out["ipex_true"] and version in out["ipex_true"]

    doctor = subprocess.run([sys.executable, "-m", "cpuddp", "doctor", "--json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert "FAKE IPEX IMPORTED" not in doctor.stderr, doctor.stderr[-2000:]
    report = json.loads(doctor.stdout)
    assert report["versions"]["ipex"] == version and report["versions"]["ipex_matches_torch"] is False
    assert any(w.get("code") == "version-mismatch" and "IPEX" in json.dumps(w) for w in report["warnings"]), \
        report["warnings"]


# --------------------------------------------------------------------------- IPEX on one rank


def _bf16_on_one_rank() -> dict:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = prepare(model, opt, mixed_precision="bf16")
    info = prepared_info(out)
    before = {k: v.detach().float().clone() for k, v in unwrap(out).state_dict().items()}
    y = out(torch.randn(8, 16))
    y.float().square().mean().backward()
    opt.step()  # the user's object
    after = unwrap(out).state_dict()
    # strict=True on a CPU without bf16 must refuse before IPEX touches the model
    strict_error, fresh = None, _mlp(1)
    fresh_before = [p.detach().clone() for p in fresh.parameters()]
    try:
        prepare(fresh, torch.optim.AdamW(fresh.parameters()), mixed_precision="bf16", strict=True)
    except PrepareError as exc:
        strict_error = str(exc)
    import intel_extension_for_pytorch as ipex

    return {
        "info": info.as_dict(),
        "warnings": [str(w.message) for w in caught],
        "param_dtypes": sorted({str(p.dtype) for p in unwrap(out).parameters()}),
        "output_dtype": str(y.dtype),
        "trained": any(not torch.equal(before[k], after[k].float()) for k in before),
        "state_dtypes": sorted({str(v.dtype) for v in after.values()}),
        "strict_error": strict_error,
        "fresh_untouched": all(torch.equal(a, b) and b.dtype == torch.float32
                               for a, b in zip(fresh_before, fresh.parameters())),
        "ipex_bf16_weights": _ipex.bf16_weights(ipex),
    }


@pytest.mark.timeout(240)
def test_ipex_bf16_follows_the_cpu(run_distributed):
    _need_ipex()
    (r,) = run_distributed(_bf16_on_one_rank, 1, timeout=200)
    info = r["info"]
    assert info["path"] == "ipex" and info["ipex_version"] == IPEX.ipex_version
    assert r["trained"] and r["output_dtype"] == "torch.float32"
    # IPEX's own rule for bf16 weights: AVX-NE-CONVERT, or AVX512 BW+VL+DQ
    assert r["ipex_bf16_weights"][0] == ("avx_ne_convert" in FLAGS or {"avx512bw", "avx512vl", "avx512dq"} <= FLAGS)
    if CPU_BF16:
        assert info["mixed_precision"] == "bf16", info
        assert r["strict_error"] is None
        weights = "torch.bfloat16" if r["ipex_bf16_weights"][0] else "torch.float32"
        assert weights in r["param_dtypes"], r
    else:  # e.g. an AVX2-only CPU: IPEX's bf16 would assert; prepare stays in fp32 on IPEX
        assert info["mixed_precision"] is None and "staying in fp32" in info["precision_reason"], info
        assert any("staying in fp32" in w for w in r["warnings"]), r["warnings"]
        assert r["param_dtypes"] == ["torch.float32"]
        assert r["strict_error"] and "strict=True" in r["strict_error"]
        assert r["fresh_untouched"]
    assert r["state_dtypes"] == ["torch.float32"]  # the state dict holds the fp32 master weights


# --------------------------------------------------------------------------- IPEX on two ranks

STEPS, BATCH = 6, 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(STEPS * BATCH, 16, generator=g), torch.randn(STEPS * BATCH, 4, generator=g)


def _train_both_paths(precision: str | None, save_to: str) -> dict:
    """On each rank: train the same model on the IPEX path and on the stock path."""
    import torch.distributed as dist

    from cpuddp.train.loop import save_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCH // world
    x, y = _data()
    result: dict = {}
    for path in ("ipex", "stock"):
        model = _mlp(seed=7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 falling back to fp32 on a CPU without it
            dmodel = prepare(model, opt, mixed_precision=precision, ipex=None if path == "ipex" else False)
        for step in range(STEPS):
            lo = step * BATCH + rank * per
            opt.zero_grad()
            nn.functional.mse_loss(dmodel(x[lo : lo + per]), y[lo : lo + per]).backward()
            opt.step()  # the optimizer object the user created
        if path == "ipex":
            save_state_dict(dmodel, save_to)
        result[path] = {
            "info": prepared_info(dmodel).as_dict(),
            "state": {k: v.detach().float().clone() for k, v in unwrap(dmodel).state_dict().items()},
            "model_kept": unwrap(dmodel) is model,
        }
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_ipex_path_on_two_ranks_matches_the_stock_path(run_distributed, tmp_path, precision):
    _need_ipex()
    saved = tmp_path / "ipex.pt"
    ranks = run_distributed(_train_both_paths, 2, args=(precision, str(saved)), timeout=240)
    initial = _mlp(seed=7).state_dict()
    for r in ranks:
        ipex, stock = r["ipex"], r["stock"]
        assert ipex["info"]["path"] == "ipex" and stock["info"]["path"] == "stock"
        assert ipex["info"]["ddp"] and ipex["info"]["world_size"] == 2 and ipex["model_kept"]
        assert ipex["info"]["mixed_precision"] == ("bf16" if precision and CPU_BF16 else None), ipex["info"]
    ipex0, stock0 = ranks[0]["ipex"]["state"], ranks[0]["stock"]["state"]
    for k in initial:
        assert torch.equal(ipex0[k], ranks[1]["ipex"]["state"][k]), f"ranks differ in {k}"
    moved = sum((stock0[k] - initial[k]).norm() ** 2 for k in initial) ** 0.5
    assert moved > 0.05, "training did not change the weights"
    if ranks[0]["ipex"]["info"]["mixed_precision"] is None:  # fp32 on both paths
        for k in initial:
            torch.testing.assert_close(ipex0[k], stock0[k], rtol=1e-4, atol=1e-5, msg=f"IPEX != stock in {k}")
    else:  # bf16 weights on IPEX, fp32 weights under autocast on stock: the same updates within bf16
        gap = sum((ipex0[k] - stock0[k]).norm() ** 2 for k in initial) ** 0.5
        assert gap < 0.1 * moved, f"IPEX and stock bf16 training differ by {gap:.4f} (weights moved {moved:.4f})"

    # The saved state dict is plain fp32 and loads on the stock path, without IPEX.
    state = torch.load(saved, map_location="cpu", weights_only=True)
    assert {str(v.dtype) for v in state.values()} == {"torch.float32"}
    stock_model = prepare(_mlp(seed=3), ipex=False)
    assert prepared_info(stock_model).path == "stock"
    stock_model.load_state_dict(state)
    for k, v in stock_model.state_dict().items():
        assert torch.equal(v, ipex0[k]), k
