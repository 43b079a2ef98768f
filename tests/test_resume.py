"""cpuddp.save_checkpoint / load_checkpoint: a run stopped and resumed goes on as if it had not
stopped -- bit-identical in fp32 at the same world size (one process, and 2 real ranks under
DDP), with the documented carry-over at another world size, and the same calls for a model
sharded by ``fully_shard`` (FSDP2) on 2 gloo ranks, whose checkpoint resumes on 2 ranks, on 1
and under DDP to the same weights."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cpuddp
from cpuddp.errors import CheckpointError
from cpuddp.train.checkpoint.ckpt_lock import release_directory
from cpuddp.train.checkpoint.load import list_checkpoints, load_checkpoint
from cpuddp.train.checkpoint.save import save_checkpoint

N, BATCH, SAVE_AT, TOTAL = 64, 4, 11, 20  # 2 ranks: 8 batches per epoch; saved in epoch 1 after 3 batches


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 2, (N,), generator=g), torch.arange(N))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 2))


def _setup(wrap: bool = True):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    trained = cpuddp.prepare(model, opt, ipex=False) if wrap else model
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    loader = cpuddp.shard(_data(), batch_size=BATCH, seed=7)
    return model, trained, opt, sched, loader


def _train(directory: str, total: int, save_at: int = 0, resume: bool = False) -> dict:
    """Train to step ``total`` (saving at ``save_at``; resuming first when asked): every rank's
    weights, random state and the sample ids it trained on, by epoch."""
    model, trained, opt, sched, loader = _setup()
    torch.manual_seed(1000 + cpuddp.get_rank())  # each rank its own dropout stream
    step, resumed, saved_loss = 0, None, None
    if resume:
        resumed = load_checkpoint(directory, model=trained, optimizer=opt, scheduler=sched, loader=loader)
        step = resumed.step
    seen: dict[int, list[int]] = {}
    while step < total:
        epoch = loader.epoch
        for x, y, idx in loader:
            loss = F.cross_entropy(trained(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            seen.setdefault(epoch, []).extend(idx.tolist())
            if step == save_at:
                saved_loss = loss.item()
                save_checkpoint(directory, step=step, model=trained, optimizer=opt, scheduler=sched, loader=loader,
                                extra={"note": "mid-epoch", "loss": saved_loss})
            if step >= total:
                break
    return {"params": [p.detach().clone() for p in model.parameters()], "rng": torch.get_rng_state(),
            "seen": seen, "lr": sched.get_last_lr(), "opt_step": float(opt.state_dict()["state"][0]["step"]),
            "saved_loss": saved_loss,
            "resumed": None if resumed is None else (resumed.step, resumed.extra, resumed.saved_world_size,
                                                      resumed.same_world)}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- one process


def test_resume_is_bit_identical_in_one_process(tmp_path) -> None:
    whole = _train(str(tmp_path / "a"), TOTAL)
    saved = _train(str(tmp_path / "b"), SAVE_AT, save_at=SAVE_AT)
    again = _train(str(tmp_path / "b"), TOTAL, resume=True)
    assert isinstance(saved["saved_loss"], float)
    assert again["resumed"] == (SAVE_AT, {"note": "mid-epoch", "loss": saved["saved_loss"]}, 1, True)
    assert _same(whole["params"], again["params"]) and torch.equal(whole["rng"], again["rng"])
    assert whole["lr"] == again["lr"] and whole["opt_step"] == again["opt_step"] == TOTAL
    # The resumed epoch went on after the samples already trained on, none twice.
    epoch = max(again["seen"])
    assert whole["seen"][epoch][-len(again["seen"][epoch]):] == again["seen"][epoch]


def test_nothing_saved_yet_is_a_fresh_start(tmp_path) -> None:
    model, _, opt, _, _ = _setup(wrap=False)
    assert load_checkpoint(str(tmp_path / "none"), model=model, optimizer=opt) is None
    (tmp_path / "empty").mkdir()
    assert load_checkpoint(str(tmp_path / "empty"), model=model) is None


def test_keep_the_newest_k_and_private_files(tmp_path) -> None:
    model, _, opt, _, _ = _setup(wrap=False)
    d = str(tmp_path / "ck")
    for step in (1, 2, 3, 4):
        path = save_checkpoint(d, step=step, model=model, optimizer=opt, keep=2)
        assert (os.stat(path).st_mode & 0o777) == 0o600
    assert [os.path.basename(p) for p in list_checkpoints(d)] == ["step-000000003.pt", "step-000000004.pt"]
    assert (os.stat(d).st_mode & 0o777) == 0o700  # created for this user only
    assert load_checkpoint(d, model=model).step == 4
    assert load_checkpoint(os.path.join(d, "step-000000003.pt"), model=model).step == 3  # a named one


def test_keep_counts_along_the_line_that_was_resumed(tmp_path) -> None:
    """Issue 37 #2: save 10 and 20, resume from 10, save 15 with keep=1.  The new checkpoint must
    stay (20 belongs to the line this run abandoned: moved aside, not counted, not resumed)."""
    model, _, opt, _, _ = _setup(wrap=False)
    d = str(tmp_path / "ck")
    p10 = save_checkpoint(d, step=10, model=model, optimizer=opt)
    save_checkpoint(d, step=20, model=model, optimizer=opt)
    assert load_checkpoint(p10, model=model, optimizer=opt).step == 10
    p15 = save_checkpoint(d, step=15, model=model, optimizer=opt, keep=1)
    assert os.path.exists(p15) and list_checkpoints(d) == [p15]
    assert load_checkpoint(d, model=model, optimizer=opt).step == 15
    (aside,) = [n for n in os.listdir(d) if n.startswith("abandoned-at-step-000000015.")]
    assert os.listdir(os.path.join(d, aside)) == ["step-000000020.pt"]  # kept for the user, out of the line
    assert load_checkpoint(os.path.join(d, aside, "step-000000020.pt"), model=model).step == 20
    p30 = save_checkpoint(d, step=30, model=model, keep=1)  # the line goes on; the aside is never pruned
    assert list_checkpoints(d) == [p30] and os.listdir(os.path.join(d, aside)) == ["step-000000020.pt"]


def test_wrong_arguments_are_clear_errors(tmp_path) -> None:
    model, _, opt, sched, loader = _setup(wrap=False)
    d = str(tmp_path)
    cases = [
        (dict(step=1, model=opt), r"model= must be a torch.nn.Module; got torch.optim.adamw.AdamW"),
        (dict(step=1, model=model, optimizer=model), r"optimizer= must be a torch.optim.Optimizer"),
        (dict(step=1, model=model, scheduler=object()), r"scheduler= needs state_dict\(\) and load_state_dict\(\)"),
        (dict(step=1, model=model, loader=DataLoader(_data())), r"loader= must be the loader cpuddp.shard\(\) returned"),
        (dict(step=-1, model=model), r"step= must be an int >= 0"),
        (dict(step=1, model=model, keep=0), r"keep= must be an int >= 1 or None"),
        (dict(step=1, model=model, extra={"f": open}), r"extra= cannot be stored safely"),
    ]
    for kwargs, match in cases:
        with pytest.raises(CheckpointError, match=match) as err:
            save_checkpoint(d, **kwargs)
        assert err.value.fix
    with pytest.raises(CheckpointError, match=r"the directory must be a str or os.PathLike; got torch.nn"):
        save_checkpoint(model, step=1, model=model)  # type: ignore[arg-type]
    save_checkpoint(d, step=1, model=model)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(d, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="not a cpuddp training checkpoint"):
        cpuddp.save_state_dict(model, tmp_path / "plain.pt")
        load_checkpoint(str(tmp_path / "plain.pt"), model=model)


def test_a_loader_over_other_data_is_refused(tmp_path) -> None:
    model, _, _, _, loader = _setup(wrap=False)
    next(iter(loader))
    save_checkpoint(str(tmp_path), step=1, model=model, loader=loader)
    other = cpuddp.shard(_data(), batch_size=BATCH, seed=8)
    with pytest.raises(CheckpointError, match=r"seed=7; this loader has seed=8"):
        load_checkpoint(str(tmp_path), model=model, loader=other)


# --------------------------------------------------------------------------- two ranks (DDP)


@pytest.mark.timeout(240)
def test_resume_is_bit_identical_on_two_ranks(run_distributed, tmp_path) -> None:
    whole = run_distributed(_train, 2, args=(str(tmp_path / "a"), TOTAL), timeout=90)
    run_distributed(_train, 2, args=(str(tmp_path / "b"), SAVE_AT, SAVE_AT), timeout=90)
    # One checkpoint file, rank 0's, beside the directory's record and writer lock (rank 0's too).
    assert sorted(os.listdir(tmp_path / "b")) == [".cpuddp-checkpoints.json", ".cpuddp-lock", f"step-{SAVE_AT:09d}.pt"]
    again = run_distributed(_train, 2, args=(str(tmp_path / "b"), TOTAL, 0, True), timeout=90)
    for rank in (0, 1):
        assert again[rank]["resumed"][0::2] == (SAVE_AT, 2)
        assert _same(whole[rank]["params"], again[rank]["params"]), f"rank {rank}: weights differ"
        assert torch.equal(whole[rank]["rng"], again[rank]["rng"]), f"rank {rank}: random state differs"
        epoch = max(again[rank]["seen"])
        assert whole[rank]["seen"][epoch][-len(again[rank]["seen"][epoch]):] == again[rank]["seen"][epoch]
    assert _same(again[0]["params"], again[1]["params"])  # and the ranks agree


def _epoch_after_resume(directory: str) -> dict:
    """Resume at this world size and train to the end of the saved epoch."""
    import logging

    model, trained, opt, sched, loader = _setup()
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cpuddp.checkpoint").addHandler(handler)
    r = load_checkpoint(directory, model=trained, optimizer=opt, scheduler=sched, loader=loader)
    before = [p.detach().clone() for p in model.parameters()]
    state = (r.step, loader.epoch, sched.last_epoch, float(opt.state_dict()["state"][0]["step"]))
    ids = [i for _, _, idx in loader for i in idx.tolist()]
    return {"state": state, "ids": ids, "params": before, "same_world": r.same_world, "said": said}


@pytest.mark.timeout(240)
def test_resume_at_another_world_size_carries_over_what_it_documents(run_distributed, tmp_path) -> None:
    d = str(tmp_path / "ck")
    saved = run_distributed(_train, 2, args=(d, SAVE_AT, SAVE_AT), timeout=90)
    epoch = SAVE_AT * 2 * BATCH // N  # 1
    consumed = saved[0]["seen"][epoch] + saved[1]["seen"][epoch]
    (one,) = run_distributed(_epoch_after_resume, 1, args=(d,), timeout=90)
    three = run_distributed(_epoch_after_resume, 3, args=(d,), timeout=90)
    for got in (one, *three):
        assert got["state"] == (SAVE_AT, epoch, SAVE_AT, float(SAVE_AT)) and not got["same_world"]
        assert _same(got["params"], saved[0]["params"])
    # The rest of the epoch: every sample not yet trained on, once (3 ranks pad to equal shares).
    assert sorted(consumed + one["ids"]) == list(range(N))
    rest = sum((t["ids"] for t in three), [])
    assert set(consumed) | set(rest) == set(range(N)) and not set(consumed) & set(rest)
    assert len(rest) - len(set(rest)) < 3  # only the padding repeats
    # Rank 0 says so (issue 37 #9): the world size changed, and what that means.
    for got, now in ((one, 1), (three[0], 3)):
        (line,) = [s for s in got["said"] if "resuming at world size" in s]
        assert f"resuming at world size {now} a checkpoint saved at world size 2" in line
        assert "samples consumed in the epoch" in line and "not bit-identical" in line
    assert not three[1]["said"] and not three[2]["said"]


# --------------------------------------------------------------------------- sharded (FSDP2)


def _fsdp_model(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    torch.manual_seed(0)
    model.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_weights(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _fsdp_save(directory: str) -> dict:
    world = cpuddp.get_world_size()
    model = _fsdp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(cpuddp.get_rank())
    for _ in range(3):
        loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = save_checkpoint(directory, step=3, model=model, optimizer=opt, extra={"layout": "fsdp"})
    return {"path": path, "full": _full_weights(model), "files": sorted(os.listdir(path))}


def _resume(directory: str, kind: str) -> dict:
    world = cpuddp.get_world_size()
    if kind == "fsdp":
        model = trained = _fsdp_model(world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trained = cpuddp.prepare(model, opt, ipex=False)
    r = load_checkpoint(directory, model=trained, optimizer=opt)
    weights = _full_weights(model) if kind == "fsdp" else {k: v.clone() for k, v in model.state_dict().items()}
    steps = {float(s["step"]) for s in opt.state.values()}
    return {"step": r.step, "extra": r.extra, "weights": weights, "opt_steps": steps}


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_resumes_on_two_ranks_one_rank_and_under_ddp(run_distributed, tmp_path) -> None:
    d = str(tmp_path / "ck")
    saved = run_distributed(_fsdp_save, 2, args=(d,), timeout=120)
    full = saved[0]["full"]
    assert saved[0]["path"] == os.path.join(d, "step-000000003") and ".metadata" in saved[0]["files"]
    assert "trainer.pt" in saved[0]["files"] and not [n for n in os.listdir(d) if n.startswith(".cpuddp-")
                                                  and n not in (".cpuddp-checkpoints.json", ".cpuddp-lock")]
    assert all((os.stat(os.path.join(d, "step-000000003", f)).st_mode & 0o777) == 0o600 for f in saved[0]["files"])
    for kind, world in (("fsdp", 2), ("fsdp", 1), ("ddp", 2), ("ddp", 1)):
        for r in run_distributed(_resume, world, args=(d, kind), timeout=120):
            assert (r["step"], r["extra"]) == (3, {"layout": "fsdp"}), (kind, world)
            assert _same_weights(r["weights"], full), (kind, world)
            assert r["opt_steps"] == {3.0}, (kind, world)
    # And in a plain process with no process group at all.
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    assert load_checkpoint(d, model=model).step == 3
    assert _same_weights(model.state_dict(), full)


@pytest.mark.timeout(240)
def test_a_ddp_checkpoint_resumes_into_a_sharded_model(run_distributed, tmp_path) -> None:
    d = str(tmp_path / "ck")
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    save_checkpoint(d, step=1, model=model, optimizer=opt)
    release_directory(d)  # this process (a notebook, say) hands the directory to the job it starts
    for r in run_distributed(_resume, 2, args=(d, "fsdp"), timeout=120):
        assert r["step"] == 1 and _same_weights(r["weights"], model.state_dict()) and r["opt_steps"] == {1.0}


# --------------------------------------------------------------------------- what a resume says


#: One process with no logging configured, as a plain script: a first run (nothing in the
#: directory), a save, then a resume; what it prints is what a user sees.
_SAY = r'''
import sys, torch, cpuddp
d = sys.argv[1]
model = torch.nn.Linear(2, 2)
print("LOADED", cpuddp.load_checkpoint(d, model=model), flush=True)
cpuddp.save_checkpoint(d, step=3, epoch=1, model=model)
print("LOADED", cpuddp.load_checkpoint(d, model=model).step, flush=True)
'''


@pytest.mark.timeout(120)
def test_a_resume_says_which_checkpoint_and_step_and_a_first_run_says_it_starts_at_0(tmp_path) -> None:
    """A successful load_checkpoint said nothing (its INFO record went nowhere) while a
    directory that does not exist warned: each says one line, where a plain script sees it."""
    import subprocess
    import sys

    from cpuddp.testing import clean_environ

    d = str(tmp_path / "ck")
    env = dict(clean_environ(os.environ), PYTHONPATH=os.path.dirname(os.path.dirname(cpuddp.__file__)))
    r = subprocess.run([sys.executable, "-c", _SAY, d], capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["LOADED None", "LOADED 3"], r.stdout
    said = [line for line in r.stderr.splitlines() if line.startswith("cpuddp:")]
    assert said == [f"cpuddp: no checkpoint in {d} (it does not exist): starting at step 0, as a first run does; if "
                    "this run should resume, check the path (the directory save_checkpoint() wrote)",
                    f"cpuddp: resumed from {os.path.join(d, 'step-000000003.pt')} at step 3, epoch 1 (saved by 1 "
                    "rank(s), now 1)"], r.stderr


def _resume_and_listen(directory: str) -> list[str]:
    """Resume on this rank; the checkpoint logger's records here (a handler of its own)."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("cpuddp.checkpoint")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    model = nn.Linear(2, 2)
    assert load_checkpoint(directory, model=model).step == 5
    return records


@pytest.mark.timeout(240)
def test_a_resume_on_two_ranks_is_said_once_on_rank_0(run_distributed, tmp_path) -> None:
    d = str(tmp_path / "ck")
    save_checkpoint(d, step=5, model=nn.Linear(2, 2))
    release_directory(d)
    said = run_distributed(_resume_and_listen, 2, args=(d,), timeout=120)
    line = f"cpuddp: resumed from {os.path.join(d, 'step-000000005.pt')} at step 5 (saved by 1 rank(s), now 2)"
    assert [[s for s in rank if "resumed from" in s] for rank in said] == [[line], []], said
    assert said[1] == [] and said[0][0].startswith("resuming at world size 2"), said  # rank 0's, each once
