"""``cpuddp run`` with the real engines: torchrun's agent on this node (README's example learns,
ranks on disjoint CPUs; a restart), MPICH, Open MPI and Intel MPI with a host list, and srun inside
``salloc -N 2`` on the two-node Slurm cluster of tests/test_slurm.py (network namespaces).

Every run has a timeout and the failing run's output (the ranks' tracebacks) in its message.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from example_util import EXAMPLES, example_env
from launchers_util import launcher_path

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
RANK_SCRIPT = REPO / "tests" / "scripts" / "slurm_ddp.py"  # one JSON per rank: affinity, plan, checksums
SHORT = ["--steps", "160", "--eval-samples", "1000", "--log-every", "20"]  # as tests/test_example_learns.py
RUN = [sys.executable, "-m", "cpuddp", "run"]


def _run(argv: list[str], tmp_path: Path, timeout: float, **extra: str) -> subprocess.CompletedProcess:
    env = example_env()
    env.update(extra)
    try:
        # stdin from /dev/null: Intel MPI's mpiexec forwards stdin, and stops (SIGTTIN) reading a
        # terminal from outside the foreground process group.
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`{' '.join(argv)}` did not finish in {timeout:.0f} s\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"`{' '.join(argv)}` exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def _rows(out: Path, world: int, context: str) -> list[dict]:
    rows = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(world)), context
    for r in rows:
        assert len(set(r["checksums"])) == 1, r  # trained together
    return rows


@pytest.mark.timeout(300)
def test_one_node_example_learns_on_disjoint_cpus(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = _run([*RUN, "--ranks-per-node", "2", str(EXAMPLES / "finetune.py"), *SHORT, "--result-json", str(out)],
                tmp_path, 260, CPUDDP_LOG_LEVEL="INFO")
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert "engine: torchrun" in proc.stdout and "--nproc-per-node 2" in proc.stdout, log
    r = json.loads(out.read_text())
    assert (r["world_size"], r["launcher"], r["replicas_identical"]) == (2, "torchrun", True), log
    assert r["accuracy"] >= 0.8 and r["first_loss"] - r["loss"] > 0.15, log
    pinned = re.findall(r"pinned to CPUs (\S+) with (\d+) threads \((.*?)\)$", proc.stderr, re.M)
    assert len(pinned) == 2 and {p[0] for p in pinned} == {"0", "1"}, log  # disjoint: one core each
    assert all("cpuddp run's plan" in p[2] for p in pinned), log


@pytest.mark.timeout(200)
def test_ranks_follow_the_plan(tmp_path: Path) -> None:
    """Each rank starts already pinned (before torch loads) and init_distributed() keeps the set."""
    proc = _run([*RUN, "--ranks-per-node", "2", str(RANK_SCRIPT), str(tmp_path)], tmp_path, 180, TEST_TIMEOUT="60")
    rows = _rows(tmp_path, 2, proc.stdout + proc.stderr)
    assert [r["affinity_before"] for r in rows] == [[0], [1]], rows
    assert [r["affinity"] for r in rows] == [[0], [1]] and [r["threads"] for r in rows] == [1, 1], rows


@pytest.mark.timeout(200)
def test_the_printed_command_runs_when_pasted_into_a_shell(tmp_path: Path) -> None:
    """Issue 30: `cpuddp run --dry-run` printed `'CPUDDP_RANK_CPUS=0;1' torchrun ...`, which bash
    cannot run (rc 127).  The line it prints now, run by bash, starts the planned job."""
    dry = _run([*RUN, "--dry-run", "--ranks-per-node", "2", str(RANK_SCRIPT), str(tmp_path)], tmp_path, 60)
    line = dry.stdout.strip().splitlines()[-1]
    assert line.startswith(("CPUDDP_RANK_CPUS='0;1' ", "LD_PRELOAD=")), dry.stdout
    _run(["bash", "-c", line], tmp_path, 180, TEST_TIMEOUT="60")
    rows = _rows(tmp_path, 2, line)
    assert [r["affinity_before"] for r in rows] == [[0], [1]], rows  # each rank started on its planned CPU


@pytest.mark.timeout(240)
def test_torchrun_restart_completes(tmp_path: Path) -> None:
    """--max-restarts 1: rank 1 fails on the first attempt; the agent restarts both and the job ends 0."""
    script = tmp_path / "fail_once.py"
    script.write_text(
        "import os, sys\n"
        "marker = sys.argv[1]\n"
        "if os.environ['RANK'] == '1' and not os.path.exists(marker):\n"
        "    open(marker, 'w').close()\n"
        "    sys.exit('rank 1: failing on purpose (first attempt)')\n"
        "import torch, cpuddp\n"
        "env = cpuddp.init_distributed(timeout=60)\n"
        "t = torch.ones(1)\n"
        "torch.distributed.all_reduce(t)\n"
        "print(f\"rank {env.rank} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} sum {t.item():g}\", flush=True)\n"
        "cpuddp.shutdown()\n")
    proc = _run([*RUN, "--ranks-per-node", "2", "--max-restarts", "1", str(script), str(tmp_path / "failed")],
                tmp_path, 220)
    assert (tmp_path / "failed").exists(), proc.stderr
    assert sorted(re.findall(r"rank (\d) attempt (\d) sum (\d)", proc.stdout)) == [("0", "1", "2"), ("1", "1", "2")], \
        proc.stdout + proc.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["mpich", "openmpi", "impi"])
def test_mpi_host_list(kind: str, tmp_path: Path) -> None:
    """``--hosts localhost``: the MPI launcher named by --launcher, with its own binding flags
    (MPICH ``-bind-to core:1``, Open MPI ``--map-by ppr:2:node:PE=1 --bind-to core``, Intel MPI
    ``I_MPI_PIN_DOMAIN=1:compact``); each rank bound to its own core and init_distributed()
    pinned inside that set."""
    from launchers_util import OMPI_ROOT_ENV

    exe = launcher_path(kind)
    extra = dict(OMPI_ROOT_ENV) if kind == "openmpi" else {}
    if kind == "impi":  # Intel MPI's libraries sit next to its launcher (what its mpivars sets)
        extra["LD_LIBRARY_PATH"] = str(Path(exe).parent.parent / "lib")
    proc = _run([*RUN, "--hosts", "localhost", "--ranks-per-node", "2", "--launcher", exe, str(RANK_SCRIPT),
                 str(tmp_path)], tmp_path, 180, TEST_TIMEOUT="60", **extra)
    flag = {"mpich": "-bind-to core:1", "openmpi": "--map-by ppr:2:node:PE=1 --bind-to core",
            "impi": "I_MPI_PIN_DOMAIN 1:compact"}[kind]
    assert f"engine: {kind}" in proc.stdout and flag in proc.stdout, proc.stdout
    rows = _rows(tmp_path, 2, proc.stdout + proc.stderr)
    assert all(r["launcher"] == ("openmpi" if kind == "openmpi" else "hydra") for r in rows), rows
    assert sorted(r["affinity"] for r in rows) == [[0], [1]], rows  # the launcher bound each rank to one core
    assert all("inside the set" in r["plan_reason"] for r in rows), rows


def test_salloc_two_nodes_through_srun(request: pytest.FixtureRequest) -> None:
    """`salloc -N 2 -c 2 cpuddp run script`: one srun step, one rank per node with its 2 CPUs
    (Slurm's CPUs per task sets the rank count; without -c, salloc grants 1 CPU per node here)."""
    import time

    from test_slurm import INIT_TIMEOUT, PY, RUN_TIMEOUT

    cluster = request.getfixturevalue("slurm_two_nodes")
    out = cluster.root / "runs" / f"cpuddp-run-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    res = cluster.command(["salloc", "-N", "2", "-c", "2", PY, "-m", "cpuddp", "run", str(RANK_SCRIPT), str(out)],
                          timeout=RUN_TIMEOUT, cwd=out, env=cluster.env(TEST_TIMEOUT=INIT_TIMEOUT))
    text = res.stdout + res.stderr
    assert "engine: srun" in text and "--nodes=2 --ntasks-per-node=1 --ntasks=2 --cpus-per-task=2" in text, text
    rows = _rows(out, 2, text)
    assert [r["hostname"] for r in rows] == ["n1", "n2"], rows
    assert all(r["launcher"] == "slurm" and r["num_nodes"] == 2 for r in rows), rows


from test_slurm import munge, slurm_root, slurm_two_nodes  # noqa: E402,F401  (the cluster fixtures)
