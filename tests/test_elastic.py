"""An elastic restart ends bit-identical to an uninterrupted run (issue 22, item 6).

Real torchrun (``--max-restarts 1 --nproc-per-node 2``), backend shm, the script
tests/failure_scripts/elastic_train.py: a small DDP model with BatchNorm trains 30 steps and
saves a checkpoint with ``cpuddp.save_state_dict`` every 10.  On torchrun's first attempt rank
1 dies before step 23 (SIGKILL, or ``os._exit``); torchrun restarts both ranks, which resume
from the step-20 checkpoint (``cpuddp.load_state_dict``) and finish.  The final weights and
buffers must equal, bit for bit, those of a run that was never interrupted -- and the restart
must really have resumed at step 20 (a run restarted from scratch would also match).

Every run is bounded by a timeout; a failure shows torchrun's output, each line prefixed with
its rank (``--tee 3``).  Measured on 2 vCPUs: about 10 s for the uninterrupted run, 15-18 s
for each interrupted one, 45 s for the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from failure_scripts.procs import base_env, script
from launchers_util import run

RUN_LIMIT = 240.0


def _train(tmp: Path, **extra: str) -> tuple[dict, str]:
    """One torchrun of the training script in ``tmp``: (rank 0's final state dict, output)."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = base_env(CKPT=str(tmp / "ckpt.pt"), OUT=str(tmp / "final.pt"), PYTHONWARNINGS="ignore::FutureWarning",
                   **extra)
    proc = run("torchrun", 2, ["--max-restarts", "1", "--tee", "3", "--log-dir", str(tmp / "logs"),
                               script("elastic_train.py")], timeout=RUN_LIMIT, env=env)
    output = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, f"torchrun failed:\n{output}"
    assert re.search(r"^\[default0\]:DONE 30$", proc.stdout, re.M), f"rank 0 did not finish:\n{output}"
    assert not [n for n in os.listdir(tmp) if n.startswith(".cpuddp-")], f"a temporary checkpoint file was left in {tmp}"
    return torch.load(tmp / "final.pt", weights_only=True), output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    state, output = _train(tmp_path_factory.mktemp("whole"))
    assert "DYING" not in output and "ATTEMPT 1" not in output, output
    return state


@pytest.mark.timeout(2 * RUN_LIMIT + 60)
@pytest.mark.parametrize("mode", ["kill", "exit"])
def test_a_rank_killed_mid_run_resumes_bit_identical(mode, uninterrupted, tmp_path):
    state, output = _train(tmp_path / mode, VICTIM="1", DIE_AT="23", MODE=mode)
    assert re.search(r"^\[default1\]:DYING 1 23$", output, re.M), f"rank 1 did not die at step 23:\n{output}"
    starts = set(re.findall(r"^\[default\d\]:ATTEMPT (\d) RANK (\d) START (\d+)$", output, re.M))
    assert starts == {("0", "0", "0"), ("0", "1", "0"), ("1", "0", "20"), ("1", "1", "20")}, \
        f"the restart did not resume both ranks from the step-20 checkpoint:\n{output}"
    assert int(state["step"]) == 30
    assert state.keys() == uninterrupted.keys()
    differ = [k for k in state if not torch.equal(state[k], uninterrupted[k])]
    assert not differ, f"after the restart, {differ} differ from the uninterrupted run's:\n{output}"
