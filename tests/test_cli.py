"""The ``cpuddp`` command line, run as a user runs it: ``python -m cpuddp ...`` in a subprocess.

Every subprocess has a timeout; the multi-rank runs use ``--nproc 2`` with tiny sweeps.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

import pytest

from cpuddp.bench import sweep as bench_sweep
from cpuddp.bench import launch as bench_launch
from cpuddp.backends.shm.protocol import check as shm_check


REPO = Path(__file__).resolve().parents[1]
TINY = ["-b", "1K", "-e", "16K", "-f", "4", "-w", "1", "-n", "2", "--ceiling-size", "1M", "--timeout", "120"]
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MV2_", "SLURM_", "TORCHELASTIC_", "I_MPI_", "HYDRA_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMP_NUM_THREADS", "CPUDDP_NUM_THREADS")


def clean_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """This environment without any launcher's variables, with the repo importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def cpuddp(*argv: str, env: Optional[Mapping[str, str]] = None, timeout: float = 150,
           cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpuddp", *argv], env=clean_env(env), cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(stdout: str) -> list[list[str]]:
    """The result rows: lines that start with a size (torch 2.8's gloo prints its own
    "[Gloo] Rank 0 is connected to ..." lines on stdout)."""
    return [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]


# --------------------------------------------------------------------------- top level


@pytest.mark.timeout(60)
def test_help_lists_commands() -> None:
    r = cpuddp("--help", timeout=50)
    assert r.returncode == 0
    assert "doctor" in r.stdout and "bench" in r.stdout
    r = cpuddp("bench", "--help", timeout=50)
    assert r.returncode == 0 and "--min-busbw" in r.stdout and "--nproc" in r.stdout


@pytest.mark.timeout(60)
def test_usage_errors_exit_2() -> None:
    assert cpuddp(timeout=50).returncode == 2  # no command
    assert cpuddp("bench", "allscatter", timeout=50).returncode == 2
    r = cpuddp("bench", "allreduce", "-b", "1M", "-e", "1K", timeout=50)
    assert r.returncode == 2 and "--min" in r.stderr


@pytest.mark.timeout(60)
def test_console_script_if_installed() -> None:
    exe = shutil.which("cpuddp") or shutil.which("cpuddp", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the cpuddp console script is not installed (pip install -e .)")
    r = subprocess.run([exe, "doctor", "--json"], env=clean_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and json.loads(r.stdout)["format"] == "cpuddp-doctor/1"


# --------------------------------------------------------------------------- bench


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_allreduce_nproc2_outputs(tmp_path: Path) -> None:
    out = {k: tmp_path / f"out.{k}" for k in ("json", "csv", "png")}
    plot = importlib.util.find_spec("matplotlib") is not None  # the [bench] extra
    r = cpuddp("bench", "allreduce", "--nproc", "2", *TINY,
               "--json", str(out["json"]), "--csv", str(out["csv"]), *(["--plot", str(out["png"])] if plot else []))
    assert r.returncode == 0, r.stdout + r.stderr
    # torch 2.8's gloo prints "[Gloo] Rank 0 is connected to ..." on stdout itself: not ours
    lines = [line for line in r.stdout.splitlines() if not line.startswith("[Gloo]")]
    # Only rank 0 prints: one header, and every non-table line is a comment.
    assert sum(line.startswith("# cpuddp bench allreduce") for line in lines) == 1
    assert "2 ranks" in lines[0]
    auto = "shm" if shm_check.eligibility(2, os.environ)[0] else "gloo"  # backend="auto" on one node
    for needle in (f"# backend: {auto}", "# versions: cpuddp", "torch threads", "# memory-copy ceiling",
                   "# Out of bounds values : 0 OK", "# Avg bus bandwidth"):
        assert needle in r.stdout, needle
    rows = table_rows(r.stdout)
    assert [int(x[0]) for x in rows] == [1024, 4096, 16384]
    assert all(x[2] == "float32" and x[-1] == "0" for x in rows)  # type, #wrong

    data = json.loads(out["json"].read_text())
    assert data["meta"]["nranks"] == 2 and data["meta"]["collective"] == "allreduce"
    assert len(data["meta"]["ranks"]) == 2 and data["meta"]["ceiling"]["gbps"] > 0
    assert [row["size"] for row in data["rows"]] == [1024, 4096, 16384]
    assert all(row["busbw"] == pytest.approx(row["algbw"]) for row in data["rows"])  # 2(n-1)/n = 1
    assert data["summary"]["exit_code"] == 0
    with out["csv"].open() as f:
        recs = list(csv.DictReader(f))
    assert [int(x["size"]) for x in recs] == [1024, 4096, 16384]
    if plot:
        assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("native", [None, "0"])
def test_bench_and_doctor_name_the_same_data_path(tmp_path: Path, native: Optional[str]) -> None:
    """`cpuddp bench` names the data path it measured, in its header and its JSON, and it is the
    one `cpuddp doctor --ranks 2` names for the same 2 ranks (native and its width, or Python
    and why)."""
    extra = {"CPUDDP_SHM_NATIVE": native or ""}  # "": unset (clean_env keeps the caller's variables)
    doc = cpuddp("doctor", "--ranks", "2", "--json", env=extra, timeout=100)
    assert doc.returncode == 0, doc.stderr
    report = json.loads(doc.stdout)
    auto = report["backends"]["auto"]["name"]
    shm = next(b for b in report["backends"]["backends"] if b["name"] == "shm")
    out = tmp_path / "b.json"
    r = cpuddp("bench", "allreduce", "--nproc", "2", "-b", "1K", "-e", "1K", "-w", "1", "-n", "1", "--no-ceiling",
               "--timeout", "120", "--json", str(out), env=extra, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads(out.read_text())["meta"]
    assert meta["backend"] == auto, (meta["backend"], auto)
    if auto != "shm":
        assert meta["data_path"] == auto and f"# backend: {auto}\n" in r.stdout
        return
    assert f"# backend: shm ({meta['data_path']})" in r.stdout, r.stdout
    said = shm["data_path"]  # "native (avx2)" or "python (<why>)"
    if shm["native"]:
        width = said[len("native ("):].split(")")[0].split(":")[0]
        assert meta["data_path"] == f"native data path, {width}", (meta["data_path"], said)
    else:
        assert meta["data_path"].startswith("Python data path: "), (meta["data_path"], said)
        if native == "0":
            assert said == "python (CPUDDP_SHM_NATIVE=0)" and meta["data_path"].endswith("CPUDDP_SHM_NATIVE=0")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_min_busbw_sets_exit_code() -> None:
    r = cpuddp("bench", "reduce_scatter", "--nproc", "2", *TINY, "--inplace", "-d", "bfloat16",
               "--min-busbw", "1000000")
    assert r.returncode == bench_sweep.EXIT_BELOW_MIN, r.stdout + r.stderr
    assert "# Min bus bandwidth" in r.stdout and "FAILED" in r.stdout
    rows = table_rows(r.stdout)
    assert rows and all(x[2] == "bfloat16" and x[3] == "sum" and x[-1] == "0" for x in rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", ["reduce", "gather", "scatter", "all_to_all", "barrier"])
def test_bench_every_other_collective_on_gloo_and_shm_checks_its_result(collective: str) -> None:
    r = cpuddp("bench", collective, "--nproc", "2", *TINY, "--backend", "gloo,shm", "--rounds", "1",
               "--no-ceiling", timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# Out of bounds values : 0 OK" in r.stdout, r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and not line.startswith(("#", "["))]
    assert rows, r.stdout
    if collective == "barrier":  # it moves nothing: one row of size 0
        assert len(rows) == 1 and rows[0][0] == "0", rows


@pytest.mark.timeout(60)
def test_bench_compare_bare_is_a_usage_error_that_says_why() -> None:
    r = cpuddp("bench", "allreduce", "--compare-bare", timeout=50)
    assert r.returncode == 2
    assert "--compare-bare was removed" in r.stderr and "same initialised, pinned processes" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_single_process_without_launcher() -> None:
    r = cpuddp("bench", "broadcast", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--no-ceiling", timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 ranks" in r.stdout and "launcher none" in r.stdout
    (row,) = table_rows(r.stdout)
    assert row[3:5] == ["none", "0"] and row[-1] == "0"  # redop, root, #wrong


@pytest.mark.timeout(60)
def test_bench_nproc_refused_under_a_launcher() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    r = cpuddp("bench", "allreduce", "--nproc", "2", env=env, timeout=50)
    assert r.returncode == 2
    assert "rank 0 of 2 under hydra" in r.stderr and "Fix:" in r.stderr


SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
assert os.environ["WORLD_SIZE"] == "2" and os.environ["MASTER_ADDR"] == "127.0.0.1"
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(7)
if sys.argv[1] == "ok":
    sys.exit(0)
SIMULATED_HANG = 60  # seconds; the spawner kills this rank long before
time.sleep(SIMULATED_HANG)
"""


@pytest.mark.timeout(60)
def test_spawn_kills_the_others_when_a_rank_fails(capfd: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    code = bench_launch.spawn(2, ["fail"], timeout=50, environ=clean_env(), grace=0.5,
                       program=[sys.executable, "-c", SCRIPT])
    assert code == bench_sweep.EXIT_ERROR
    assert time.monotonic() - t0 < 20
    assert "rank 1 exited with code 7" in capfd.readouterr().err


#: Rank 1 hangs before the benchmark starts; rank 0 runs the real `python -m cpuddp bench ...`
#: and so waits for rank 1 in the rendezvous, as the ranks of a hung run do.
HANG = """
import os, runpy, sys, time
from cpuddp import _procs

def rank_1_hangs_here():
    time.sleep(SIMULATED_HANG)

SIMULATED_HANG = 120  # seconds; the spawner must end this rank long before
if os.environ["RANK"] == "1":
    _procs.rank_setup()
    rank_1_hangs_here()
sys.argv = ["cpuddp", *sys.argv[1:]]
runpy.run_module("cpuddp", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawn_prints_the_stack_of_each_hung_rank_and_leaves_no_process(capfd: pytest.CaptureFixture[str]) -> None:
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    code = bench_launch.spawn(2, ["bench", "allreduce", *TINY[:-2], "--timeout", "100"], timeout=20, environ=clean_env(),
                       program=[sys.executable, "-c", HANG])
    assert code == bench_sweep.EXIT_ERROR
    assert time.monotonic() - t0 < 60
    err = capfd.readouterr().err
    assert "timed out after 20 s (--timeout)" in err
    head0 = err.index("rank 0 (pid")
    head1 = err.index("rank 1 (pid")
    assert "init_distributed" in err[head0:head1], err  # rank 0: the real bench, waiting in the rendezvous
    assert "in rank_1_hangs_here" in err[head1:], err
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and
            p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())
            and "multiprocessing.forkserver" not in " ".join(p.cmdline())]
    assert not left, [p.cmdline() for p in left]


@pytest.mark.timeout(60)
def test_spawn_timeout_and_success(capfd: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert bench_launch.spawn(2, ["hang"], timeout=1.0, environ=clean_env(), program=[sys.executable, "-c", SCRIPT]) == 1
    assert time.monotonic() - t0 < 20
    assert "timed out" in capfd.readouterr().err
    assert bench_launch.spawn(2, ["ok"], timeout=30, environ=clean_env(), program=[sys.executable, "-c", SCRIPT]) == 0


# --------------------------------------------------------------------------- doctor


@pytest.mark.timeout(60)
def test_doctor_text() -> None:
    r = cpuddp("doctor", env={"OMP_NUM_THREADS": "2"}, timeout=50)
    assert r.returncode == 0, r.stderr
    for heading in ("Launcher", "Versions", "Backends", "CPU", "Threads", "A job here", "Warnings"):
        assert f"\n{heading}" in r.stdout, heading
    assert "none (no launcher)" in r.stdout and "OMP_NUM_THREADS=2" in r.stdout
    assert "\nPinning plan" not in r.stdout  # from a shell: the job's plan, not this 1-process one


@pytest.mark.timeout(60)
def test_doctor_json_and_speed() -> None:
    best = float("inf")
    for _ in range(2):  # the machine is shared: take the better of two
        t0 = time.monotonic()
        r = cpuddp("doctor", "--json", timeout=50)
        best = min(best, time.monotonic() - t0)
        assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["launcher"]["ok"] and data["launcher"]["name"] == "none"
    assert data["cpu"]["logical_cpus"] >= 1 and "avx512_bf16" in data["cpu"]["features"]
    assert data["versions"]["torch"]
    assert best < 2.0, f"cpuddp doctor --json took {best:.2f} s"


@pytest.mark.timeout(60)
def test_doctor_under_fake_launcher() -> None:
    # A rank of a 2-node Intel MPI / MPICH job, without MASTER_ADDR.
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    quiet = cpuddp("doctor", "--json", env=env, timeout=50)
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout  # rank 2 of 4: rank 0 reports
    r = cpuddp("doctor", "--json", "--all-ranks", env=env, timeout=50)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    la = data["launcher"]
    assert la["ok"] and la["name"] == "hydra" and la["env"]["rank"] == 2 and la["env"]["num_nodes"] == 2
    assert [p["rank"] for p in data["pinning"]["plans"]] == [2, 3]
    assert "master-addr-missing" in [w["code"] for w in data["warnings"]]
    strict = cpuddp("doctor", "--strict", "--all-ranks", env=env, timeout=50)
    assert strict.returncode == 3 and "MASTER_ADDR" in strict.stdout


@pytest.mark.timeout(60)
def test_doctor_shows_launcher_error() -> None:
    r = cpuddp("doctor", env={"RANK": "1"}, timeout=50)
    assert r.returncode == 0
    assert "no usable launcher environment" in r.stdout and "WORLD_SIZE" in r.stdout


@pytest.mark.timeout(120)
def test_doctor_under_torchrun_prints_one_report_with_every_rank() -> None:
    """Issue 30: `torchrun ... cpuddp doctor` printed one full report per rank, interleaved."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "cpuddp", "doctor"], env=clean_env(None), cwd=REPO, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("cpuddp doctor  (") == 1, r.stdout
    assert "rank 0 of 2" in r.stdout and "Pinning plan: 2 local rank(s) of this node" in r.stdout
