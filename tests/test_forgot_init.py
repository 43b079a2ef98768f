"""Forgetting ``init_distributed()`` under a launcher (issue 46): ``prepare()`` and ``shard()``
used to return a bare module and every batch on each rank -- two unsynchronised models trained
to different weights and the job exited 0.  Now they raise, naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpuddp
from cpuddp.errors import PrepareError

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_RANK1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}


def _launched(monkeypatch, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_prepare_and_shard_under_a_launcher_without_a_group_raise_with_the_fix(monkeypatch):
    import torch

    _launched(monkeypatch, TORCHRUN_RANK1)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(PrepareError, match=r"rank 1 of 2 \(WORLD_SIZE=2\), but no process group exists") as err:
        cpuddp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "cpuddp.init_distributed()" in err.value.fix
    with pytest.raises(PrepareError, match=r"cpuddp.shard\(\): the launcher says this is rank 1 of 2"):
        cpuddp.shard(list(range(10)), batch_size=2)


def test_a_world_of_one_and_explicit_choices_still_work(monkeypatch):
    import torch

    model = torch.nn.Linear(4, 4)
    assert cpuddp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1)) is not None  # no launcher
    _launched(monkeypatch, dict(TORCHRUN_RANK1, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1"))
    assert len(list(cpuddp.shard(list(range(10)), batch_size=2))) == 5
    _launched(monkeypatch, TORCHRUN_RANK1)
    assert len(list(cpuddp.shard(list(range(10)), batch_size=2, num_replicas=2, rank=1))) == 3  # the user's split


def test_under_torchrun_every_rank_stops_and_the_job_fails(tmp_path):
    from cpuddp.testing import clean_environ
    from failure_scripts.procs import free_port

    script = tmp_path / "forgot.py"
    script.write_text("import torch, cpuddp\nm = torch.nn.Linear(4, 4)\n"
                      "cpuddp.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))\nprint('trained alone')\n")
    env = clean_environ(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "--max-restarts", "0", str(script)],
                          env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "trained alone" not in out, out
    assert "but no process group exists" in out and "call cpuddp.init_distributed() before it" in out, out[-3000:]


# --------------------------------------------------------------------------- a file that is not a checkpoint


@pytest.mark.parametrize("content", [b"loss 0.548\nstep 10\n", b"\x80\x04\x95" + b"garbage" * 10, "pickled object"])
def test_a_file_that_is_not_a_checkpoint_is_named_never_loaded_with_weights_only_false(tmp_path, content):
    """torch's own error says "re-running torch.load with weights_only set to False will likely
    succeed" -- advice that runs whatever the file holds (issue 46)."""
    import pickle

    import torch

    from cpuddp.errors import CheckpointError

    path = tmp_path / "results.pt"
    path.write_bytes(pickle.dumps(Path("/etc")) if content == "pickled object" else content)
    path.chmod(0o600)
    model = torch.nn.Linear(2, 2)
    for load in (lambda: cpuddp.load_checkpoint(str(path), model=model), lambda: cpuddp.load_state_dict(model, path)):
        with pytest.raises(CheckpointError, match="is not a checkpoint") as err:
            load()
        text = str(err.value)  # torch's own error is not shown under it (raise ... from None)
        assert str(path) in text and "weights_only" not in text, text
        assert err.value.__cause__ is None and err.value.__suppress_context__


def test_a_checkpoint_directory_that_does_not_exist_is_said_not_silent(tmp_path, caplog):
    import torch

    model = torch.nn.Linear(2, 2)
    assert cpuddp.load_checkpoint(str(tmp_path / "ckpt-typo"), model=model) is None
    said = [r for r in caplog.records if "ckpt-typo" in r.getMessage()]
    assert said and said[0].levelname == "WARNING", caplog.text
    assert "(it does not exist): starting at step 0" in said[0].getMessage()
