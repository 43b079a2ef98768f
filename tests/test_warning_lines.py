"""Every user-facing warning names the user's line -- the file and line that called cpuddp --
at world size 1 and 2, whatever depth inside cpuddp or torch it is raised at (issue 45:
``cpuddp.errors.warn`` finds the first frame outside both; no hand-counted ``stacklevel``)."""

from __future__ import annotations

import importlib
import inspect
import os
import warnings

import pytest
import torch
from torch import nn

import cpuddp

HERE = os.path.abspath(__file__)


def _line_of(marker: str) -> int:
    """The line of this file that holds ``marker`` (a comment on the call expected in the warning)."""
    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    found = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# {marker}")]
    assert len(found) == 1, marker
    return found[0]


def _where(caught, text: str) -> list[tuple[str, int]]:
    return [(os.path.abspath(w.filename), w.lineno) for w in caught if text in str(w.message)]


def _no_bf16(monkeypatch) -> None:
    """A CPU without bf16, whatever this one has (prepare and autocast_for then warn)."""
    bf16 = importlib.import_module("cpuddp.train.precision.bf16")
    monkeypatch.setattr(bf16, "cpu_bf16_support", lambda: (False, "this CPU has no bf16 (test)"))
    monkeypatch.setattr(importlib.import_module("cpuddp.train.prepare"), "cpu_bf16_support", bf16.cpu_bf16_support)


def _checkpoint_warnings(tmp: str) -> list[tuple[str, int, int]]:
    """save_checkpoint and load_checkpoint in a directory others can write, check_permissions=False:
    where each warning points, and the lines of the calls."""
    os.makedirs(tmp, exist_ok=True)
    os.chmod(tmp, 0o777)
    model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpuddp.save_checkpoint(tmp, step=1, model=model, check_permissions=False)  # save
        cpuddp.load_checkpoint(tmp, model=model, check_permissions=False)  # load
    return _where(caught, "check_permissions=False: going on")


def _expect_checkpoint(found, every: bool = True) -> None:
    """Each warning names the save's or the load's line (``every``: both warned; else any may)."""
    assert found or not every, "no warning about the directory others can write"
    want = {(HERE, _line_of("save")), (HERE, _line_of("load"))}
    assert set(found) <= want, found
    assert not every or set(found) == want, found


def test_checkpoint_warnings_name_the_callers_line(tmp_path):
    _expect_checkpoint(_checkpoint_warnings(str(tmp_path / "shared")))


def test_deprecated_names_point_at_their_use():
    from cpuddp.launchers.env import DistEnv

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpuddp.Topology  # noqa: B018  # attr
        DistEnv(master_addr="127.0.0.1", master_port=29500, launcher="none").backend  # noqa: B018  # env
        cpuddp.autocast()  # autocast
    assert _where(caught, "cpuddp.Topology is deprecated") == [(HERE, _line_of("attr"))]
    assert _where(caught, "DistEnv.backend is deprecated") == [(HERE, _line_of("env"))]
    assert _where(caught, "cpuddp.autocast is deprecated") == [(HERE, _line_of("autocast"))]


def test_precision_warnings_name_the_callers_line(monkeypatch):
    _no_bf16(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpuddp.prepare(nn.Linear(2, 2), None, mixed_precision="bf16", ipex=False)  # prepare
        cpuddp.autocast_for(enabled=None)  # autocast_for
    assert _where(caught, "cpuddp.prepare:") == [(HERE, _line_of("prepare"))]
    assert _where(caught, "cpuddp.autocast_for:") == [(HERE, _line_of("autocast_for"))]


def test_a_loader_that_cannot_resume_mid_epoch_names_the_callers_line():
    data = torch.utils.data.TensorDataset(torch.arange(32.0))
    loader = cpuddp.shard(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    state = dict(loader.state_dict(), consumed=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)  # loader
    assert _where(caught, "restarts from its beginning") == [(HERE, _line_of("loader"))]


def _two_ranks(tmp: str):
    """At world size 2: the checkpoint warnings, and one raised in an optimizer hook (inside torch)."""
    import torch.distributed as dist

    found = {"checkpoint": _checkpoint_warnings(tmp)}  # a collective: every rank
    zero_sync = importlib.import_module("cpuddp.train.sharding.zero_sync")
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cpuddp.prepare(model, opt, shard="optimizer", ipex=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(zero_sync.WARN_AFTER):  # no backward: nothing to shard, so it warns
            opt.step()  # step
    found["hook"] = _where(caught, "still not sharded")
    return found


@pytest.mark.timeout(120)
def test_warnings_name_the_callers_line_at_world_size_2(run_distributed, tmp_path):
    ranks = run_distributed(_two_ranks, 2, args=(str(tmp_path / "shared"),), timeout=90)
    for rank, found in enumerate(ranks):
        _expect_checkpoint(found["checkpoint"], every=rank == 0)
        assert found["hook"] == [(HERE, _line_of("step"))], (rank, found["hook"])
