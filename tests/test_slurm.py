"""cpuddp under a real Slurm: srun, sbatch and salloc on a one-node and a two-node cluster.

The clusters (tests/slurm_util.py) are real Debian slurmctld/slurmd 22.05 daemons started once
per session and always stopped; the two-node one lives in network namespaces of its own.  Every
run goes through ``cpuddp.init_distributed()`` and a short DDP loop (tests/scripts/slurm_ddp.py)
whose ranks all-gather a checksum of the final parameters, so a rank that trained apart fails.
No test sets MASTER_ADDR, RANK or any SLURM_* variable: Slurm does.

Skipped with the reason without root, the packages or iproute2 -- failed instead when
CPUDDP_REQUIRE_SLURM=1 (.ci/run).  Every client call has a timeout, after which the cluster's
jobs are cancelled and the test fails with the output and the daemons' logs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_util import Cluster, Munge, check_prerequisites, make_root

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "slurm_ddp.py"
PY = sys.executable
RUN_TIMEOUT = 150.0  # seconds for one srun/sbatch/salloc (ranks import torch on 2 shared cores)
INIT_TIMEOUT = "60"  # seconds: cpuddp's rendezvous/collective timeout inside the ranks
KILLED_TIMEOUT = 90.0  # seconds within which a job with a killed task must be over


# --------------------------------------------------------------------------- clusters


@pytest.fixture(scope="session")
def slurm_root(request: pytest.FixtureRequest) -> Path:
    check_prerequisites(namespaces=False)
    root = make_root("cpuddp-slurm-")
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    return root


@pytest.fixture(scope="session")
def munge(slurm_root: Path, request: pytest.FixtureRequest) -> Munge:
    m = Munge(slurm_root)
    request.addfinalizer(m.stop)
    t0 = time.monotonic()
    m.start()
    print(f"\n[slurm] munged up in {time.monotonic() - t0:.2f} s", file=sys.stderr)
    return m


def _cluster(request: pytest.FixtureRequest, root: Path, munge: Munge, name: str, **kwargs) -> Cluster:
    (root / name).mkdir()
    cluster = Cluster(root / name, munge, **kwargs)
    request.addfinalizer(cluster.stop)  # before start: a half-started cluster is stopped too
    cluster.start()
    print(f"\n[slurm] cluster {name} up in {cluster.start_seconds:.2f} s", file=sys.stderr)
    return cluster


@pytest.fixture(scope="session")
def slurm_one_node(request, slurm_root, munge) -> Cluster:
    """One node, ``TaskPlugin=task/affinity`` (Slurm binds each task to its CPUs)."""
    return _cluster(request, slurm_root, munge, "one-node", nodes=1, task_plugin="task/affinity")


@pytest.fixture(scope="session")
def slurm_one_node_nobind(request, slurm_root, munge) -> Cluster:
    """One node, ``TaskPlugin=task/none`` (``--cpu-bind`` is ignored)."""
    return _cluster(request, slurm_root, munge, "one-node-task-none", nodes=1, task_plugin="task/none")


@pytest.fixture(scope="session")
def slurm_two_nodes(request, slurm_root, munge) -> Cluster:
    """Two nodes (n1, n2) in network namespaces, ``task/affinity``."""
    check_prerequisites(namespaces=True)
    return _cluster(request, slurm_root, munge, "two-nodes", nodes=2, task_plugin="task/affinity")


# --------------------------------------------------------------------------- helpers


def _outdir(cluster: Cluster, name: str) -> Path:
    out = cluster.root / "runs" / f"{name}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    return out


def _srun(cluster: Cluster, args: list[str], out: Path, *extra: str, timeout: float = RUN_TIMEOUT,
          check: bool = True) -> subprocess.CompletedProcess:
    return cluster.command(["srun", *args, PY, str(SCRIPT), str(out), *extra], timeout=timeout, check=check,
                           cwd=out, env=cluster.env(TEST_TIMEOUT=INIT_TIMEOUT))


def _sbatch(cluster: Cluster, out: Path, options: list[str], body: str, *, timeout: float = RUN_TIMEOUT) -> str:
    """Submit ``body`` as a batch script, wait for it, return its output (stdout and stderr)."""
    script = out / "job.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in options) + "set -e\n" + body)
    env = cluster.env(TEST_TIMEOUT=INIT_TIMEOUT, PY=PY, SCRIPT=str(SCRIPT))
    job = cluster.command(["sbatch", "--parsable", f"--output={out}/job.out", str(script)], cwd=out, env=env).stdout
    state, code = cluster.wait_job(job.strip().split(";")[0], timeout)
    output = (out / "job.out").read_text() if (out / "job.out").exists() else "(no job output)"
    if (state, code) != ("COMPLETED", "0:0"):
        pytest.fail(f"batch job {job.strip()} ended {state} with ExitCode={code}\n"
                    f"--- job output\n{output}\n{cluster.logs()}")
    return output


def _rows(out: Path, world: int, context: str = "") -> list[dict]:
    rows = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(world)), f"ranks that reported: {[r['rank'] for r in rows]}\n{context}"
    return rows


def _check_trained_together(rows: list[dict], world: int) -> None:
    """Every rank saw the same world and the same final parameters on every rank."""
    for r in rows:
        assert r["world_size"] == world, r
        assert len(r["checksums"]) == world and len(set(r["checksums"])) == 1, r
    assert len({r["checksums"][0] for r in rows}) == 1, [r["checksums"] for r in rows]


# --------------------------------------------------------------------------- srun


def test_srun_one_node(slurm_one_node: Cluster) -> None:
    out = _outdir(slurm_one_node, "srun-n2")
    res = _srun(slurm_one_node, ["-n", "2"], out)
    rows = _rows(out, 2, res.stdout + res.stderr)
    _check_trained_together(rows, 2)
    for r in rows:
        assert r["launcher"] == "slurm" and r["backend"], r
        assert (r["local_rank"], r["local_world_size"], r["node_rank"], r["num_nodes"]) == (r["rank"], 2, 0, 1), r
        assert r["master_addr"] == "127.0.0.1", r  # one node: the store stays on loopback
        assert r["hostname"] == r["slurmd_nodename"] == "n1", r
    # task/affinity: Slurm bound the two tasks to different CPUs, and cpuddp pinned inside them.
    assert [r["affinity_before"] for r in rows] == [[0], [1]], rows
    assert [r["affinity"] for r in rows] == [[0], [1]], rows


def test_srun_two_nodes(slurm_two_nodes: Cluster) -> None:
    out = _outdir(slurm_two_nodes, "srun-N2-n2")
    res = _srun(slurm_two_nodes, ["-N", "2", "-n", "2"], out)
    rows = _rows(out, 2, res.stdout + res.stderr)
    _check_trained_together(rows, 2)
    assert [r["hostname"] for r in rows] == ["n1", "n2"], rows
    for r in rows:
        assert r["launcher"] == "slurm", r
        assert (r["local_rank"], r["local_world_size"], r["node_rank"], r["num_nodes"]) == (0, 1, r["rank"], 2), r
        # Nobody set MASTER_ADDR: it is the first host of SLURM_STEP_NODELIST (n[1-2]).
        assert r["master_addr"] == "n1", r
    assert len({r["master_port"] for r in rows}) == 1, rows


def test_srun_two_nodes_two_tasks_each(slurm_two_nodes: Cluster) -> None:
    out = _outdir(slurm_two_nodes, "srun-N2-n4")
    res = _srun(slurm_two_nodes, ["-N", "2", "-n", "4"], out)
    rows = _rows(out, 4, res.stdout + res.stderr)
    _check_trained_together(rows, 4)
    # Block distribution: ranks 0,1 on n1 and 2,3 on n2; local ranks and pinning per node.
    assert [r["hostname"] for r in rows] == ["n1", "n1", "n2", "n2"], rows
    for r in rows:
        layout = (r["local_rank"], r["local_world_size"], r["node_rank"], r["num_nodes"])
        assert layout == (r["rank"] % 2, 2, r["rank"] // 2, 2), r
        assert r["master_addr"] == "n1", r
        assert r["affinity"] == [r["local_rank"]], r  # each node's two tasks on its two CPUs


# --------------------------------------------------------------------------- sbatch and salloc


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes"])
def test_sbatch_with_srun(nodes: int, request: pytest.FixtureRequest) -> None:
    cluster = request.getfixturevalue("slurm_one_node" if nodes == 1 else "slurm_two_nodes")
    out = _outdir(cluster, f"sbatch-srun-{nodes}")
    options = ["--ntasks=2"] if nodes == 1 else ["--nodes=2", "--ntasks-per-node=2"]
    world = 2 * nodes
    output = _sbatch(cluster, out, options, f'srun "$PY" "$SCRIPT" {out}\n')
    rows = _rows(out, world, output)
    _check_trained_together(rows, world)
    assert [r["node_rank"] for r in rows] == [rank // 2 for rank in range(world)], rows
    assert {r["master_addr"] for r in rows} == {"127.0.0.1" if nodes == 1 else "n1"}, rows


def test_sbatch_python_directly_is_one_process(slurm_one_node: Cluster) -> None:
    """The batch shell carries SLURM_PROCID=0 and SLURM_NTASKS=2 but no SLURM_STEP_ID: a
    script run there directly is one process (world 1), says why, and does not wait for a
    rank 1 that will never come."""
    out = _outdir(slurm_one_node, "sbatch-direct")
    body = f'env | grep "^SLURM_" | sort > {out}/batch.env\n"$PY" "$SCRIPT" {out}\n'
    output = _sbatch(slurm_one_node, out, ["--ntasks=2"], body)
    batch_env = dict(line.split("=", 1) for line in (out / "batch.env").read_text().splitlines())
    assert (batch_env["SLURM_PROCID"], batch_env["SLURM_NTASKS"]) == ("0", "2") and "SLURM_STEP_ID" not in batch_env
    (row,) = _rows(out, 1, output)
    assert (row["world_size"], row["launcher"]) == (1, "none"), row
    assert re.search(r"not an srun task.*single process", output, re.S), output


def test_step_with_fewer_tasks_than_the_job(slurm_one_node: Cluster) -> None:
    """``srun -n 1`` inside a job of --ntasks=2: the world is the step's one task."""
    out = _outdir(slurm_one_node, "sbatch-fewer")
    output = _sbatch(slurm_one_node, out, ["--ntasks=2"], f'srun -n 1 "$PY" "$SCRIPT" {out}\n')
    (row,) = _rows(out, 1, output)
    assert (row["world_size"], row["launcher"], row["local_world_size"]) == (1, "slurm", 1), row


def test_salloc_then_srun(slurm_one_node: Cluster) -> None:
    out = _outdir(slurm_one_node, "salloc")
    shell = f'env | grep "^SLURM_" | sort > {out}/salloc.env && srun "$PY" "$SCRIPT" {out}'
    res = slurm_one_node.command(["salloc", "-n", "2", "sh", "-c", shell], timeout=RUN_TIMEOUT, cwd=out,
                                 env=slurm_one_node.env(TEST_TIMEOUT=INIT_TIMEOUT, PY=PY, SCRIPT=str(SCRIPT)))
    salloc_env = dict(line.split("=", 1) for line in (out / "salloc.env").read_text().splitlines())
    assert salloc_env["SLURM_NTASKS"] == "2" and "SLURM_PROCID" not in salloc_env, salloc_env
    rows = _rows(out, 2, res.stdout + res.stderr)
    _check_trained_together(rows, 2)
    assert all(r["launcher"] == "slurm" for r in rows), rows


# --------------------------------------------------------------------------- binding


@pytest.mark.parametrize("plugin", ["task/affinity", "task/none"])
def test_cpu_binding(plugin: str, request: pytest.FixtureRequest) -> None:
    """``--cpu-bind=map_cpu:1,0`` puts rank 0 on CPU 1, the opposite of cpuddp's own plan.
    task/affinity: Slurm's binding wins and cpuddp pins inside it.  task/none: Slurm ignores
    the option and cpuddp's own plan (rank 0 on CPU 0) applies."""
    cluster = request.getfixturevalue("slurm_one_node" if plugin == "task/affinity" else "slurm_one_node_nobind")
    out = _outdir(cluster, "bind")
    res = _srun(cluster, ["-n", "2", "--cpu-bind=map_cpu:1,0"], out)
    rows = _rows(out, 2, res.stdout + res.stderr)
    _check_trained_together(rows, 2)
    if plugin == "task/affinity":
        assert [r["affinity_before"] for r in rows] == [[1], [0]], rows
        assert [r["affinity"] for r in rows] == [[1], [0]], rows
        assert all("Slurm" in r["plan_reason"] for r in rows), rows
    else:
        assert [r["affinity_before"] for r in rows] == [[0, 1], [0, 1]], rows
        assert [r["affinity"] for r in rows] == [[0], [1]], rows
        assert not any("inside the set" in r["plan_reason"] for r in rows), rows


# --------------------------------------------------------------------------- failures


def test_task_killed_mid_run_fails_the_job(slurm_one_node: Cluster) -> None:
    """Rank 1 SIGKILLs itself before step 2 (no --kill-on-bad-exit): rank 0 must not wait
    forever in the allreduce -- it exits non-zero and srun reports both, within the timeout."""
    out = _outdir(slurm_one_node, "killed")
    t0 = time.monotonic()
    res = _srun(slurm_one_node, ["-n", "2"], out, "--die", "1:2", timeout=KILLED_TIMEOUT, check=False)
    took = time.monotonic() - t0
    text = res.stdout + res.stderr
    assert res.returncode != 0, text
    assert "rank 1: killing myself" in text, text
    assert re.search(r"task 1: Killed", text), text
    assert re.search(r"task 0: Exited with exit code [1-9]", text), text
    assert not list(out.glob("rank*.json")), text
    print(f"[slurm] the job with a killed task ended in {took:.1f} s", file=sys.stderr)


# --------------------------------------------------------------------------- MPI's PMI inside Slurm


# Measured under `srun --mpi=pmi2 -n 2` (job 4, step 0) on the one-node cluster, rank 1.
PMI2_TASK_ENV = {
    "PMI_FD": "13", "PMI_JOBID": "4.0", "PMI_RANK": "1", "PMI_SIZE": "2",
    "SLURM_JOB_ID": "4", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
}


def test_slurm_pmi2_variables_are_read_as_slurm() -> None:
    """Pure (no cluster): Slurm's PMI-2 variables do not make the task a Hydra rank, whose
    reader lacks the local size; PMI variables of another job still go to Hydra's reader."""
    from cpuddp.launchers import detect

    env = detect(PMI2_TASK_ENV)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 1, 2, 1, 2)
    hydra = {**PMI2_TASK_ENV, "PMI_JOBID": "kvs_123", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert detect(hydra).launcher == "hydra"


def test_srun_mpi_pmi2(slurm_one_node: Cluster) -> None:
    """``srun --mpi=pmi2`` adds Slurm's PMI-2 variables (PMI_RANK, PMI_SIZE, PMI_FD,
    PMI_JOBID=<job>.<step>) to each task; cpuddp still takes the job from Slurm."""
    out = _outdir(slurm_one_node, "pmi2")
    res = _srun(slurm_one_node, ["-n", "2", "--mpi=pmi2"], out)
    rows = _rows(out, 2, res.stdout + res.stderr)
    _check_trained_together(rows, 2)
    for r in rows:
        assert (r["launcher"], r["pmi_rank"]) == ("slurm", str(r["rank"])), r
        assert (r["local_rank"], r["local_world_size"]) == (r["rank"], 2), r


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes"])
@pytest.mark.parametrize("kind", ["mpich", "impi"])
def test_mpi_library_finds_slurm_pmi2(kind: str, nodes: int, request: pytest.FixtureRequest) -> None:
    """The MPI libraries of the PyPI wheels (``mpich``, ``impi-rt``) start under ``srun
    --mpi=pmi2`` as one world of 2, with no I_MPI_PMI_LIBRARY and no libpmi2 package: they
    speak PMI-2 to slurmstepd.  Intel MPI across nodes needs its lib directory on
    LD_LIBRARY_PATH (libfabric.so.1; what its mpivars does).  Without ``--mpi=pmi2`` each task
    is a world of 1.  Open MPI needs ``--mpi=pmix``: Debian's pmix plugin wants libpmix2, not
    installed here, so it is not tested."""
    from launchers_util import launcher_path

    cluster = request.getfixturevalue("slurm_one_node" if nodes == 1 else "slurm_two_nodes")
    libdir = Path(launcher_path(kind)).parent.parent / "lib"
    assert (libdir / "libmpi.so.12").is_file(), f"no libmpi.so.12 in {libdir}, next to the {kind} launcher"
    env = cluster.env(LD_LIBRARY_PATH=str(libdir)) if kind == "impi" else cluster.env()
    if kind == "mpich" and nodes > 1:
        # Our two nodes share one kernel and /dev/shm: MPICH's UCX may take them for one host
        # and try shared memory across their PID namespaces ("Shared memory error",
        # "Endpoint timeout").  Real nodes do not; TCP is what two machines would use.
        env["UCX_TLS"] = "tcp,self"
    out = _outdir(cluster, f"mpi-{kind}")
    res = cluster.command(["srun", "-N", str(nodes), "-n", "2", "--mpi=pmi2", PY, str(REPO / "tests/scripts/slurm_mpi.py"),
                           str(libdir / "libmpi.so.12")], timeout=RUN_TIMEOUT, cwd=out, env=env)
    rows = sorted((json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["sum"]) for r in rows] == [(0, 2, 3), (1, 2, 3)], res.stdout + res.stderr


#: slurmstepd's complaint when its PMI-2 server split a client's request (see the test below)
PMI2_SHORT_READ = "mpi/pmi2: value not properly terminated in client request"


@pytest.mark.parametrize("kind", ["mpich", "impi"])
def test_srun_pmi2_takes_the_mpi_leg_between_nodes(kind: str, slurm_two_nodes: Cluster) -> None:
    """Two nodes of 2 tasks under ``srun --mpi=pmi2``: auto's shm group takes the MPI leg (mpi4py
    over the MPI wheel's library, which speaks PMI-2 to slurmstepd), and every collective on it
    gives the exact values on every rank (tests/scripts/mpi_leg.py)."""
    from launchers_util import launcher_path

    libdir = Path(launcher_path(kind)).parent.parent / "lib"
    env = slurm_two_nodes.env(MPI4PY_LIBMPI=str(libdir / "libmpi.so.12"), UCX_TLS="tcp,self", OMP_NUM_THREADS="1",
                              CPUDDP_TIMEOUT=str(INIT_TIMEOUT))
    if kind == "impi":
        env["LD_LIBRARY_PATH"] = str(libdir)  # libfabric.so.1 beside it (what its mpivars does)
    for attempt in (1, 2):
        out = _outdir(slurm_two_nodes, f"mpi-leg-{kind}-{attempt}")
        # --kill-on-bad-exit: a task that dies (MPI_Init's abort) ends the step, not the timeout
        res = slurm_two_nodes.command(["srun", "-N", "2", "-n", "4", "--mpi=pmi2", "--kill-on-bad-exit=1", PY,
                                       str(REPO / "tests/scripts/mpi_leg.py"), "collectives", str(out)],
                                      timeout=RUN_TIMEOUT, cwd=out, env=env, check=False, stop_on=PMI2_SHORT_READ)
        if PMI2_SHORT_READ not in res.stderr + res.stdout:
            break
        # Slurm 22.05's PMI-2 server (slurmstepd) sometimes reads a long PMI put in two pieces on a
        # loaded machine and parses the second as a request of its own; MPI_Init then fails, or
        # waits for an answer that never comes, on every rank (seen in full CI runs and beside a
        # second pytest worker, never alone): the step ends as soon as slurmstepd says so, and
        # runs once more; a second time, the test fails.
    reports = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2, 3], res.stdout[-2000:] + res.stderr[-3000:]
    for r in reports:
        assert r.get("ok"), r.get("traceback") or r
        assert r["backend"] == "shm" and r["leg"].startswith("MPI ("), r
        assert r["bad"] == [], r["bad"][:10]
    assert len({r["digest"] for r in reports}) == 1
