"""Tests for cpuddp.train.loop: sharding, metrics, rank-0 checkpoints, and the example script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from cpuddp.errors import PrepareError
from cpuddp.train.loop import (
    ShardedLoader,
    autocast_for,
    barrier,
    is_main_process,
    load_state_dict,
    reduce_mean,
    save_state_dict,
    shard,
)
from cpuddp.train.strategies.base import unwrap
from cpuddp.train.prepare import prepare, prepared_info

from example_util import EXAMPLES, example_env, fake_missing_numpy, paraphrase_data


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


def test_epoch_moves_on_only_when_a_pass_ends():
    loader = shard(TensorDataset(torch.arange(20)), batch_size=4, seed=3)
    epoch0 = _ids(loader)
    assert loader.epoch == 1
    next(iter(loader))  # a peek
    for _ in loader:  # a pass left early
        break
    assert loader.epoch == 1
    epoch1 = _ids(loader)
    assert epoch1 != epoch0 and loader.epoch == 2
    loader.set_epoch(1)  # set_epoch names the next pass's epoch, as DistributedSampler's does
    assert _ids(loader) == epoch1 and loader.epoch == 2
    it = iter(loader)
    assert len(it) == 5  # a pass has the DataLoader iterator's length


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


def _cpu_with_bf16(monkeypatch, native: bool) -> None:
    """Make torch's own probes (the first thing prepare's CPU probe asks) report this CPU kind."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)


def test_autocast_for_without_a_model_is_bf16_on_a_bf16_cpu(monkeypatch):
    _cpu_with_bf16(monkeypatch, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with autocast_for():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast_for(enabled=False):
        assert not torch.is_autocast_enabled("cpu")
    assert prepared_info(prepare(nn.Linear(2, 2), mixed_precision="bf16", ipex=False)).mixed_precision == "bf16"


def test_autocast_for_without_a_model_stays_fp32_on_another_cpu(monkeypatch):
    _cpu_with_bf16(monkeypatch, False)
    with pytest.warns(UserWarning, match=r"^cpuddp.autocast_for: bf16 requested but CPU has neither AMX nor "
                                         r"AVX512-BF16 .*staying in fp32$") as rec:
        with autocast_for():
            assert not torch.is_autocast_enabled("cpu")
    assert rec[0].filename == __file__  # stacklevel: the user's line
    # the same sentence as prepare's, which makes the same decision on this CPU
    with pytest.warns(UserWarning) as prep:
        assert prepared_info(prepare(nn.Linear(2, 2), mixed_precision="bf16", ipex=False)).mixed_precision is None
    assert str(prep[0].message).replace("cpuddp.prepare: ", "") == str(rec[0].message).replace(
        "cpuddp.autocast_for: ", "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for explicitly: no probe, no warning
        with autocast_for(enabled=True):
            assert torch.is_autocast_enabled("cpu")
        with autocast_for(dtype=torch.float16):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


def test_autocast_for_a_prepared_model_follows_prepare(monkeypatch):
    _cpu_with_bf16(monkeypatch, False)  # the model decides, not the CPU
    fp = prepare(nn.Linear(2, 2), ipex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with autocast_for(fp):
            assert not torch.is_autocast_enabled("cpu")
    _cpu_with_bf16(monkeypatch, True)
    bf = prepare(nn.Linear(2, 2), mixed_precision="bf16", ipex=False)
    _cpu_with_bf16(monkeypatch, False)
    with autocast_for(bf):
        assert torch.is_autocast_enabled("cpu")


def test_autocast_is_a_deprecated_alias_of_autocast_for(monkeypatch):
    import cpuddp
    import cpuddp.train.loop

    _cpu_with_bf16(monkeypatch, True)
    with pytest.warns(DeprecationWarning, match="use cpuddp.autocast_for"):
        ctx = cpuddp.train.loop.autocast()
    with ctx:
        assert torch.is_autocast_enabled("cpu")
    with pytest.warns(DeprecationWarning, match="use cpuddp.autocast_for"):
        assert cpuddp.autocast is autocast_for


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


def _peek_then_two_epochs(peeker: int) -> dict:
    import torch.distributed as dist

    loader = shard(TensorDataset(torch.arange(20)), batch_size=3, seed=7)
    if dist.get_rank() == peeker:
        next(iter(loader))  # look at one batch first, e.g. to build the model from its shape
    return {"epoch0": _ids(loader), "epoch1": _ids(loader), "epoch": loader.epoch}


@pytest.mark.timeout(120)
def test_a_peek_on_one_rank_keeps_the_ranks_partitioned(run_distributed):
    r0, r1 = run_distributed(_peek_then_two_epochs, 2, args=(0,), timeout=90)
    for epoch in ("epoch0", "epoch1"):
        assert sorted(r0[epoch] + r1[epoch]) == list(range(20)), epoch  # no sample twice, none lost
    assert r0["epoch0"] != r0["epoch1"]  # and each full pass still reshuffles
    assert r0["epoch"] == r1["epoch"] == 2


def _save_fails_on_rank0(path: str) -> dict:
    import torch.distributed as dist

    model = nn.Linear(2, 1)
    start = time.monotonic()
    try:
        save_state_dict(model, path)
        out: dict = {"error": None}
    except Exception as exc:  # noqa: BLE001
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["seconds"] = time.monotonic() - start
    dist.barrier()  # the ranks are still in step: the next collective pairs up
    return out


@pytest.mark.timeout(120)
def test_a_failed_save_on_rank0_raises_on_every_rank_at_once(run_distributed, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # the collective timeout is 30 s; the ranks must not wait for it
    r0, r1 = run_distributed(_save_fails_on_rank0, 2, args=(str(blocker / "model.pt"),), timeout=30)
    assert r0["error"] == "CheckpointError" and "is not a directory" in r0["message"]
    assert r1["error"] == "CpuddpError"
    assert "failed on rank 0: CheckpointError" in r1["message"] and "a-file" in r1["message"]
    assert r0["seconds"] < 10 and r1["seconds"] < 10


class _WorkerReport(torch.utils.data.Dataset):
    """Each item: what the DataLoader worker that loaded it runs with."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        info = torch.utils.data.get_worker_info()
        try:
            from threadpoolctl import threadpool_info  # when installed, cpuddp also limits BLAS pools
            pools = sorted({p["num_threads"] for p in threadpool_info()})
        except ImportError:
            pools = None
        return {"worker": info.id if info else None, "torch_threads": torch.get_num_threads(),
                "cpus": sorted(os.sched_getaffinity(0)), "omp": os.environ.get("OMP_NUM_THREADS"),
                "pools": pools, "user_init": os.environ.get("USER_WORKER_INIT")}


def _first(batch: list) -> dict:
    return batch[0]


def _user_worker_init(worker_id: int) -> None:
    os.environ["USER_WORKER_INIT"] = str(worker_id)


def _worker_reports(worker_threads) -> dict:
    from cpuddp.affinity import pin as affinity

    kwargs = {} if worker_threads == "default" else {"worker_threads": worker_threads}
    loader = shard(_WorkerReport(), batch_size=1, num_workers=2, collate_fn=_first,
                   worker_init_fn=_user_worker_init, **kwargs)
    return {"plan_cpus": sorted(affinity.current_plan().cpus), "rank_omp": os.environ.get("OMP_NUM_THREADS"),
            "workers": {item["worker"]: item for item in loader}}


@pytest.mark.timeout(120)
def test_dataloader_workers_run_one_thread_on_the_ranks_cores(run_distributed):
    # pinned ranks with 2 threads each: a worker inheriting that would run 2 threads per pool
    ranks = run_distributed(_worker_reports, 2, args=("default",), pin=True, timeout=90,
                            env={"CPUDDP_NUM_THREADS": "2"})
    for r in ranks:
        assert r["rank_omp"] == "2" and len(r["workers"]) == 2
        for worker_id, w in r["workers"].items():
            assert w["torch_threads"] == 1 and w["omp"] == "1" and w["pools"] in (None, [1]), w
            assert w["cpus"] == r["plan_cpus"], w  # the rank's compute CPUs, not another rank's
            assert w["user_init"] == str(worker_id)  # the user's worker_init_fn still runs, after ours
    (r0,) = run_distributed(_worker_reports, 1, args=(None,), pin=True, timeout=90, env={"CPUDDP_NUM_THREADS": "2"})
    assert {w["omp"] for w in r0["workers"].values()} == {"2"}  # worker_threads=None: as torch starts them


def test_worker_threads_must_be_a_positive_int():
    with pytest.raises(PrepareError, match="worker_threads=0"):
        shard(TensorDataset(torch.arange(4)), worker_threads=0)


# --------------------------------------------------------------------------- the example


def test_paraphrase_data_is_deterministic_and_balanced():
    pd = paraphrase_data()
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
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=example_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "samples/s" in proc.stdout and "loss" in proc.stdout
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["samples_per_s"] > 0
    assert (tmp_path / "m.pt").exists()


def _example(tmp_path, *extra: str) -> dict:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(EXAMPLES / "finetune.py"), "--batch-size", "4", "--num-samples", "64",
           "--eval-samples", "0", "--precision", "fp32", "--result-json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=example_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"result": json.loads(out.read_text()), "stdout": proc.stdout}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_stops_and_resumes_where_it_was(tmp_path):
    """README's example with --checkpoint-dir: 10 steps in one go, and 6 steps then 4 more from
    the checkpoint, end with the same weights (the data position, the LR schedule and the
    random state carried over)."""
    whole = _example(tmp_path, "--steps", "10", "--save", str(tmp_path / "whole.pt"))
    ck = str(tmp_path / "ck")
    _example(tmp_path, "--steps", "10", "--stop-after", "6", "--checkpoint-dir", ck)
    again = _example(tmp_path, "--steps", "10", "--checkpoint-dir", ck, "--save", str(tmp_path / "again.pt"))
    assert "resumed from" in again["stdout"] and "step 6 of 10" in again["stdout"]
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "again.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole["result"]["precision"] == again["result"]["precision"] == "fp32"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_run_says_it_is_unfinished_and_a_rerun_with_nothing_to_do_says_so(tmp_path):
    """issue 46: --stop-after says the run is unfinished and how to go on; a rerun whose
    checkpoint is at the stop (or at --steps) says "nothing to do", and never prints nan."""
    ck = str(tmp_path / "ck")
    stopped = _example(tmp_path, "--steps", "6", "--stop-after", "3", "--checkpoint-dir", ck)["stdout"]
    assert "stopped early at step 3 of 6 (--stop-after 3)" in stopped and "without --stop-after" in stopped, stopped
    again = _example(tmp_path, "--steps", "6", "--stop-after", "3", "--checkpoint-dir", ck)["stdout"]
    assert "already at step 3 of 6" in again and "nothing to do" in again, again
    assert "nan" not in again and "stopped early" not in again, again
    finished = _example(tmp_path, "--steps", "6", "--checkpoint-dir", ck)["stdout"]
    assert "stopped early" not in finished and "nothing to do" not in finished and "samples/s" in finished, finished
    after = _example(tmp_path, "--steps", "6", "--checkpoint-dir", ck)["stdout"]
    assert "already at step 6 of 6" in after and "nothing to do" in after and "nan" not in after, after


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(240)
def test_readmes_command_without_numpy_warns_about_it_once(tmp_path):
    """issue 46: torch's "Failed to initialize NumPy" came 3 times in one 2-rank job (torchrun's
    process and each rank); the example's ranks leave it to torchrun's."""
    env = example_env()
    env["PYTHONPATH"] = os.pathsep.join([fake_missing_numpy(tmp_path), env["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "finetune.py"), "--steps", "2", "--batch-size", "4", "--num-samples", "64",
           "--eval-samples", "0", "--precision", "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env, cwd=tmp_path)
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, log
    assert (proc.stdout + proc.stderr).count("Failed to initialize NumPy") == 1, log
