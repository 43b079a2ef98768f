"""Tests for cpuddp.loop: sharding, metrics, rank-0 checkpoints, and the example script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from cpuddp.errors import PrepareError
from cpuddp.loop import (
    ShardedLoader,
    autocast,
    barrier,
    is_main_process,
    load_state_dict,
    reduce_mean,
    save_state_dict,
    shard,
)
from cpuddp.preparation import prepare, unwrap

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _ids(loader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


# --------------------------------------------------------------------------- world size 1


def test_single_process_helpers():
    assert is_main_process()
    barrier()  # a no-op without a process group
    assert reduce_mean(3) == 3.0 and isinstance(reduce_mean(3), float)
    t = reduce_mean(torch.tensor(2.5))
    assert isinstance(t, torch.Tensor) and t.item() == 2.5
    assert reduce_mean({"b": 1, "a": torch.tensor(4.0)}) == {"a": torch.tensor(4.0), "b": 1.0}
    with pytest.raises(PrepareError, match="scalars"):
        reduce_mean(torch.ones(3))


def test_shard_dataset_reshuffles_each_epoch():
    data = TensorDataset(torch.arange(20))
    loader = shard(data, batch_size=4, seed=3)
    assert isinstance(loader, ShardedLoader) and len(loader) == 5
    first, second = _ids(loader), _ids(loader)
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second  # set_epoch moved on by itself
    loader.set_epoch(0)
    assert _ids(loader) == first  # and is reproducible
    assert _ids(shard(data, batch_size=4, seed=3)) == first


def test_shard_dataset_no_shuffle_and_drop_last():
    data = TensorDataset(torch.arange(10))
    assert _ids(shard(data, batch_size=3, shuffle=False)) == list(range(10))
    assert _ids(shard(data, batch_size=3, shuffle=False, drop_last=True)) == list(range(9))


def test_shard_explicit_ranks_partition_the_data():
    data = TensorDataset(torch.arange(12))
    parts = [_ids(shard(data, batch_size=2, num_replicas=3, rank=r)) for r in range(3)]
    assert sorted(sum(parts, [])) == list(range(12))
    assert all(len(p) == 4 for p in parts)


def test_shard_dataloader_keeps_its_settings():
    data = TensorDataset(torch.arange(12))
    seen = []

    def collate(items):
        seen.append(len(items))
        return (torch.stack([x for (x,) in items]),)

    dl = DataLoader(data, batch_size=4, shuffle=True, collate_fn=collate)
    assert shard(dl).loader is dl  # world size 1: only wrapped
    halves = [shard(dl, num_replicas=2, rank=r) for r in range(2)]
    parts = [_ids(h) for h in halves]
    assert sorted(sum(parts, [])) == list(range(12))
    assert halves[0].batch_size == 4 and seen  # batch size and collate_fn kept
    assert parts[0] != sorted(parts[0]) or parts[1] != sorted(parts[1])  # still shuffled


def test_shard_refuses_what_it_cannot_shard():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(PrepareError, match="IterableDataset"):
        shard(Stream())
    data = TensorDataset(torch.arange(8))
    custom = DataLoader(data, batch_size=2, sampler=list(range(8)))
    with pytest.raises(PrepareError, match="custom sampler"):
        shard(custom, num_replicas=2, rank=0)


def test_autocast_defaults_to_bf16():
    with autocast():
        assert torch.is_autocast_enabled("cpu")
    with autocast(enabled=False):
        assert not torch.is_autocast_enabled("cpu")


def test_save_and_load_single_process(tmp_path):
    torch.manual_seed(0)
    model = prepare(nn.Linear(4, 2), ipex=False)
    path = tmp_path / "sub" / "model.pt"
    save_state_dict(model, path)
    plain = torch.load(path, weights_only=True)  # a plain state dict, readable without cpuddp
    assert set(plain) == {"weight", "bias"}
    other = nn.Linear(4, 2)
    result = load_state_dict(other, path)
    assert not result.missing_keys and torch.equal(other.weight, model.weight)
    assert not [p for p in os.listdir(path.parent) if p.startswith(".cpuddp-")]  # no temp left


# --------------------------------------------------------------------------- two ranks


def _two_rank_checks(path: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict = {"main": is_main_process()}
    barrier()
    out["mean"] = reduce_mean(float(rank))  # 0 and 1 -> 0.5
    out["weighted"] = reduce_mean(float(rank), weight=3 if rank else 1)  # (0*1 + 1*3) / 4
    out["many"] = reduce_mean({"x": torch.tensor(float(rank)), "y": 10.0 * rank})
    data = TensorDataset(torch.arange(10))
    loader = shard(data, batch_size=2, seed=1)
    out["epoch0"], out["epoch1"] = _ids(loader), _ids(loader)
    # checkpoint: rank 0 saves; the ranks diverge; load restores rank 0's weights everywhere
    torch.manual_seed(0)
    model = prepare(nn.Linear(4, 2), ipex=False)
    save_state_dict(model, path)
    with torch.no_grad():
        unwrap(model).weight.add_(rank + 1.0)
    load_state_dict(model, path if rank == 0 else path + ".not-needed-on-other-ranks")
    out["weight"] = unwrap(model).weight.detach().clone()
    # an error on rank 0 is raised on every rank, none hangs
    try:
        load_state_dict(model, path + ".missing")
        out["missing"] = None
    except Exception as exc:  # noqa: BLE001
        out["missing"] = type(exc).__name__
    return out


@pytest.mark.timeout(180)
def test_loop_helpers_on_two_ranks(run_distributed, tmp_path):
    path = str(tmp_path / "ck.pt")
    r0, r1 = run_distributed(_two_rank_checks, 2, args=(path,), timeout=150)
    assert r0["main"] and not r1["main"]
    assert r0["mean"] == r1["mean"] == 0.5
    assert r0["weighted"] == r1["weighted"] == 0.75
    assert r0["many"]["y"] == 5.0 and r0["many"]["x"].item() == 0.5
    assert sorted(r0["epoch0"] + r1["epoch0"]) == list(range(10))
    assert r0["epoch0"] != r0["epoch1"]
    assert torch.equal(r0["weight"], r1["weight"])
    assert torch.equal(r0["weight"], torch.load(path, weights_only=True)["weight"])
    assert r0["missing"] == "FileNotFoundError" and r1["missing"] == "CpuddpError"


# --------------------------------------------------------------------------- the example


def _example_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    return env


def test_paraphrase_data_is_deterministic_and_balanced():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import paraphrase_data as pd
    finally:
        sys.path.remove(str(EXAMPLES))
    a, b = pd.generate(200, seed=5), pd.generate(200, seed=5)
    assert a == b and sum(label for _, _, label in a) == 100
    ds = pd.PairDataset(a[:4], max_len=32)
    item = ds[0]
    assert item["input_ids"].shape == (32,) and item["input_ids"][0] == pd.CLS
    assert int(item["attention_mask"].sum()) == int((item["input_ids"] != pd.PAD).sum())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_runs_single_process(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(EXAMPLES / "finetune.py"), "--steps", "3", "--batch-size", "4",
           "--num-samples", "64", "--eval-samples", "16", "--model", "torch", "--bf16",
           "--result-json", str(out), "--save", str(tmp_path / "m.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_example_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "samples/s" in proc.stdout and "loss" in proc.stdout
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["samples_per_s"] > 0
    assert (tmp_path / "m.pt").exists()
