"""End to end: 2 real ranks under each real launcher, each calling init_distributed()."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cpuddp.backends.shm.protocol import check as shm_check
from launchers_util import run

SCRIPT = str(Path(__file__).parent / "scripts" / "allreduce_demo.py")
# What backend="auto" picks for 2 ranks on this node (no oneCCL bindings here).
AUTO_ONE_NODE = "shm" if shm_check.eligibility(2, os.environ)[0] else "gloo"
EXPECTED_LAUNCHER = {"torchrun": "torchrun", "mpich": "hydra", "impi": "hydra", "openmpi": "openmpi"}


def results(outdir: Path) -> list[dict]:
    rows = [json.loads(p.read_text()) for p in outdir.glob("rank*.json")]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.launcher
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["torchrun", "mpich", "openmpi", "impi"])
def test_init_distributed_under_real_launcher(kind, tmp_path):
    proc = run(kind, 2, [SCRIPT], timeout=120, env={"CPUDDP_RESULT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = results(tmp_path)
    assert [r["rank"] for r in rows] == [0, 1], proc.stdout + proc.stderr
    for r in rows:
        assert r["allreduce_ok"], r
        assert r["launcher"] == EXPECTED_LAUNCHER[kind]
        assert (r["world_size"], r["local_world_size"], r["node_rank"]) == (2, 2, 0)
        assert r["local_rank"] == r["rank"]
        assert r["backend"] == AUTO_ONE_NODE, r  # backend="auto": shared memory when it can run
        assert r["same_env_twice"]
        ex = r["exported"]
        assert ex["RANK"] == str(r["rank"]) and ex["WORLD_SIZE"] == "2" and ex["LOCAL_RANK"] == str(r["rank"])
        assert ex["MASTER_ADDR"] and ex["MASTER_PORT"]
    assert rows[0]["exported"]["MASTER_PORT"] == rows[1]["exported"]["MASTER_PORT"]
