"""End to end: 2 real ranks under torchrun, MPICH, Open MPI and Intel MPI each pin themselves.

Each rank reads os.sched_getaffinity(0) (and every thread's mask) and torch.get_num_threads()
after pinning.  Launchers are found through CPUDDP_MPICH_MPIEXEC, CPUDDP_OPENMPI_MPIRUN and
CPUDDP_IMPI_MPIEXEC (default: the developer layout under /work/launchers); a missing one
skips, unless CPUDDP_REQUIRE_LAUNCHERS=1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launchers_util import OMPI_ROOT_ENV, launcher_path

REPO = Path(__file__).resolve().parents[1]
EXPECTED_LAUNCHER = {"torchrun": "torchrun", "mpich": "hydra", "impi": "hydra", "openmpi": "openmpi"}

# Each rank calls cpuddp.init_distributed() (pin=True is the default), as a user would.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    before = sorted(os.sched_getaffinity(0))
    omp_before = os.environ.get("OMP_NUM_THREADS")
    import torch
    import cpuddp
    from cpuddp import affinity

    env = cpuddp.init_distributed(backend="gloo", timeout=60)
    plan = cpuddp.distributed.get_session().pin_plan
    x = torch.randn(128, 128)
    (x @ x).sum().item()  # start torch's thread pool under the plan
    masks = []
    for tid in os.listdir("/proc/self/task"):
        try:
            masks.append(sorted(os.sched_getaffinity(int(tid))))
        except OSError:
            pass
    row = {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "launcher": env.launcher,
        "affinity_before": before,
        "omp_before": omp_before,
        "affinity": sorted(os.sched_getaffinity(0)),
        "thread_masks": masks,
        "threads": torch.get_num_threads(),
        "omp_after": os.environ.get("OMP_NUM_THREADS"),
        "plan": plan.as_dict(),
        "current_is_plan": affinity.current_plan() == plan,
    }
    with open(os.path.join(os.environ["CPUDDP_RESULT_DIR"], "rank%d.json" % env.rank), "w") as f:
        json.dump(row, f)
    cpuddp.shutdown()
    """
)

# Variables a launcher (or an earlier run) may have left in this process's environment.
_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "I_MPI_", "HYDRA_", "MPI_LOCAL", "SLURM_", "MV2_", "TORCHELASTIC_")
_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME", "CPUDDP_NUM_THREADS"}


def _env(result_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES) and k not in _NAMES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["CPUDDP_RESULT_DIR"] = str(result_dir)
    env.update(extra)
    return env


def _command(kind: str, script: str) -> tuple[list[str], dict[str, str]]:
    if kind == "torchrun":
        torchrun = Path(sys.executable).with_name("torchrun")
        head = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
        # --standalone: a free port per run, so concurrent runs do not collide on 29500.
        return [*head, "--standalone", "--nproc-per-node", "2", script], {}
    exe = launcher_path(kind)
    if kind == "openmpi":
        return [exe, "-n", "2", sys.executable, script], dict(OMPI_ROOT_ENV)
    return [exe, "-n", "2", sys.executable, script], {}


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["torchrun", "mpich", "openmpi", "impi"])
def test_each_rank_pinned_to_its_own_cores(kind: str, tmp_path: Path) -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip(f"needs 2 CPUs for 2 disjoint ranks, this process may use {sorted(allowed)}")
    script = tmp_path / "pin_rank.py"
    script.write_text(SCRIPT)
    cmd, extra = _command(kind, str(script))
    proc = subprocess.Popen(cmd, env=_env(tmp_path, extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{kind}: 2 ranks did not finish in 150 s\n{out}\n{err}")
    log = f"{kind} exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert proc.returncode == 0, log
    rows = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["local_rank"] for r in rows] == [0, 1], log
    for r in rows:
        assert r["launcher"] == EXPECTED_LAUNCHER[kind], r
        assert r["affinity"] == r["plan"]["cpus"], r
        # compute threads (main + torch's pool) on the plan; communication threads (gloo's, the
        # store's, the watchdog's) on the mask the launcher gave, never re-pinned
        assert all(m in (r["affinity"], r["affinity_before"]) for m in r["thread_masks"]), r
        assert sum(m == r["affinity"] for m in r["thread_masks"]) >= r["threads"], r
        assert r["threads"] == r["plan"]["num_threads"] == len(r["affinity"]), r
        assert r["omp_after"] == str(r["threads"]), r
        assert set(r["affinity"]) <= set(r["affinity_before"]), r  # inside the launcher's binding
        assert r["current_is_plan"], r
        if len(allowed) == 2:  # this 2-CPU machine: one core and one thread per rank
            assert len(r["affinity"]) == 1 and r["threads"] == 1, r
    assert not set(rows[0]["affinity"]) & set(rows[1]["affinity"]), rows
    print(json.dumps([{k: r[k] for k in ("rank", "affinity_before", "omp_before", "affinity", "threads")}
                      for r in rows]))
