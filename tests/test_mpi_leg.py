"""The shm group's node-to-node leg over MPI (mpi4py), across network-namespace hosts, launched by
each MPI's own mpiexec (tests/mpi_netns.py; the ranks: tests/scripts/mpi_leg.py).

MPICH, Open MPI and Intel MPI (PyPI's, as .ci/launchers.sh installs them) with mpi4py: every
collective checked against exact values on every rank, on 2 and 3 hosts of 1 and 2 ranks; DDP and
``shard="optimizer"`` follow the gloo leg's losses; a rank that raises, and ranks that call
different collectives, end every rank with a clear error; an MPI that cannot serve the leg falls
back to gloo, with the reason (or is an error where the user required it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpi_netns import libmpi, netns_hosts, run_mpi

pytestmark = [pytest.mark.netns, pytest.mark.launcher, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "mpi_leg.py"
KINDS = ("mpich", "openmpi", "impi")
#: (MPI, hosts, ranks per host): every layout on MPICH (one rank per host, the two-level path, an
#: odd count of hosts); Open MPI and Intel MPI (their own ABIs under the one mpi4py) on 2 x 2,
#: which takes every collective through both the node part and the leg
LAYOUTS = [(kind, hosts_n, ppn) for kind in KINDS
           for hosts_n, ppn in ([(2, 1), (2, 2), (3, 1)] if kind == "mpich" else [(2, 2)])]


def _env(kind: str, **extra: str) -> dict[str, str]:
    env = {"MPI4PY_LIBMPI": libmpi(kind), "OMP_NUM_THREADS": "1", "CPUDDP_TIMEOUT": "120"}
    env.update(extra)
    return env


def _reports(out: Path, n: int, run) -> list[dict]:
    found = []
    for r in range(n):
        f = out / f"rank{r}.json"
        found.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "missing": True})
    assert all(not f.get("missing") for f in found), f"ranks wrote no report (exit {run.returncode}):\n" + run.output[-4000:]
    return found


def test_without_master_addr_a_wrong_mpi_is_named(tmp_path):
    """rank 0's address is asked over MPI: an mpi4py whose MPI is not the launcher's says so."""
    run, out = _job("mpich", 2, 1, "leg", tmp_path, timeout=120, MPI4PY_LIBMPI=libmpi("openmpi"))
    assert run.returncode not in (0, None)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert reports and all("MASTER_ADDR is not set" in r.get("error", "") for r in reports), reports
    assert all("not the launcher's" in r["error"] for r in reports), reports


def _job(kind: str, hosts_n: int, ppn: int, mode: str, tmp_path: Path, timeout: float = 240, **env: str):
    out = tmp_path / f"{mode}-{kind}-{hosts_n}x{ppn}-{env.get('CPUDDP_SHM_INTER', 'auto')}"
    out.mkdir()
    with netns_hosts(hosts_n, out) as hosts:
        run = run_mpi(kind, hosts, ppn, [str(SCRIPT), mode, str(out)], _env(kind, **env), out / "launcher.log",
                      timeout)
    return run, out


@pytest.mark.parametrize("kind, hosts_n, ppn", LAYOUTS)
def test_every_collective_on_the_mpi_leg(kind, hosts_n, ppn, tmp_path):
    run, out = _job(kind, hosts_n, ppn, "collectives", tmp_path, CPUDDP_SHM_INTER="mpi", MPI_LEG_BACKEND="shm")
    reports = _reports(out, hosts_n * ppn, run)
    for r in reports:
        assert r.get("ok"), r.get("traceback") or r
        assert r["bad"] == [], r["bad"][:10]
        assert r["leg"].startswith("MPI ("), r
        # ranks sharing a node with the native library take a small all_reduce and a barrier straight
        # to the native calls and the leg (cross/direct.py); one rank per node has no node part
        assert r["direct"] == ("CrossDirect" if ppn > 1 and "native" in r["data_path"] else "NoneType"), r
    assert len({r["digest"] for r in reports}) == 1, "ranks hold different bits"
    assert run.returncode == 0, run.output[-3000:]


# --------------------------------------------------------------------------- chosen by auto


@pytest.mark.parametrize("hosts_n, ppn", [(2, 1), (2, 2)])
def test_auto_takes_the_mpi_leg_under_an_mpi_launcher(hosts_n, ppn, tmp_path):
    run, out = _job("mpich", hosts_n, ppn, "leg", tmp_path)
    for r in _reports(out, hosts_n * ppn, run):
        assert r.get("ok"), r.get("traceback") or r
        assert r["backend"] == "shm" and r["leg"].startswith("MPI (MPICH"), r
        if ppn == 2:
            assert "native data path" in r["data_path"] or "Python data path" in r["data_path"], r
    assert run.returncode == 0, run.output[-3000:]


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("shard", ["", "optimizer"])
def test_ddp_on_the_mpi_leg_follows_the_gloo_legs_losses(shard, tmp_path):
    got = {}
    for leg in ("gloo", "mpi"):
        run, out = _job("mpich", 2, 2, "train", tmp_path, CPUDDP_SHM_INTER=leg, MPI_LEG_SHARD=shard)
        reports = _reports(out, 4, run)
        assert all(r.get("ok") for r in reports), [r.get("traceback") for r in reports]
        assert len({r["weights"] for r in reports}) == 1, f"{leg}: the ranks' weights differ"
        assert all(r["leg"].lower().startswith(leg) for r in reports), reports[0]["leg"]
        got[leg] = reports[0]["losses"]
    assert got["mpi"] == pytest.approx(got["gloo"], rel=1e-5, abs=1e-6), got


def test_the_mpi_leg_takes_calls_from_the_communication_thread_and_a_comm_hook(tmp_path):
    """MPI started with THREAD_MULTIPLE: the group's communication thread (CPUDDP_SHM_ASYNC=1)
    issues the leg's calls, and DDP's bf16 comm hook chains its collectives on them."""
    run, out = _job("mpich", 2, 2, "train", tmp_path, CPUDDP_SHM_INTER="mpi", CPUDDP_SHM_ASYNC="1",
                    MPI_LEG_HOOK="bf16")
    reports = _reports(out, 4, run)
    assert all(r.get("ok") for r in reports), [r.get("traceback") for r in reports]
    assert len({r["weights"] for r in reports}) == 1, "the ranks' weights differ"
    assert all(0 < x < 10 for x in reports[0]["losses"]), reports[0]["losses"]


# --------------------------------------------------------------------------- failures


def test_a_rank_that_raises_ends_every_rank_with_its_error(tmp_path):
    run, out = _job("mpich", 2, 2, "raises", tmp_path, timeout=120, CPUDDP_SHM_INTER="mpi")
    assert run.returncode not in (0, None), run.output[-3000:]
    assert run.seconds < 60, f"the job took {run.seconds:.0f} s to end"
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    raised = [r for r in reports if r.get("error", "").startswith("ValueError")]
    assert [r["rank"] for r in raised] == [3], reports
    for r in reports:  # every other rank ended too, its output naming rank 3's error
        if r["rank"] != 3:
            assert r.get("error"), r
            assert f"cpuddp: [rank{r['rank']}] lost rank(s) [3]: rank 3" in run.output, run.output[-3000:]


def test_ranks_that_call_different_collectives_get_a_mismatch_naming_both(tmp_path):
    run, out = _job("mpich", 2, 1, "mismatch", tmp_path, timeout=120, CPUDDP_SHM_INTER="mpi", MPI_LEG_BACKEND="shm")
    assert run.returncode not in (0, None)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert reports and all("CallMismatch" in r.get("error", "") for r in reports), reports
    for r in reports:
        assert "rank 0: all_reduce(SUM, float32, 3 elements)" in r["error"], r["error"]
        assert "rank 1: all_reduce(SUM, float32, 4 elements)" in r["error"], r["error"]


@pytest.mark.parametrize("cleanup", [True, False])
def test_a_killed_rank_ends_the_job_without_orphans(cleanup, tmp_path):
    """The launcher ends the job at once and names the process it lost (Hydra: "BAD
    TERMINATION"); told not to (``-disable-auto-cleanup``), the ranks waiting on the MPI leg see
    the lost rank through the watchdog within seconds and end with cpuddp's error, which names it."""
    out = tmp_path / f"killed-{cleanup}"
    out.mkdir()
    env = _env("mpich", CPUDDP_SHM_INTER="mpi", MPI_LEG_KILL="1")
    with netns_hosts(2, out) as hosts:
        extra = [] if cleanup else ["-disable-auto-cleanup"]
        run = run_mpi("mpich", hosts, 2, [str(SCRIPT), "raises", str(out)], env, out / "launcher.log", 120,
                      launcher_args=extra)
        left = _left_after(hosts, 30.0)
    assert run.returncode not in (0, None), run.output[-3000:]
    assert run.seconds < 60, f"the job took {run.seconds:.0f} s to end"
    assert left == [[], []], f"processes left in the hosts 30 s after the launcher ended: {left}"
    if cleanup:
        assert "BAD TERMINATION" in run.output, run.output[-3000:]
        return
    # rank 3's host: rank 2 sees its local peer die (or Hydra's proxy ends it too); the other host's
    # ranks learn it from the watchdog (rank 2's error, or the two ranks' silent heartbeats) and end
    # with cpuddp's error naming them
    reports = {r["rank"]: r for r in (json.loads(f.read_text()) for f in out.glob("rank*.json"))}
    assert "MPI leg" in reports[0]["error"] and "lost rank(s) [" in reports[0]["error"], reports[0]
    assert "local rank 0 gave up" in reports[1]["error"], reports[1]
    if 2 in reports:
        assert "rank(s) [3] (local rank 1" in reports[2]["error"] and "died" in reports[2]["error"], reports[2]


def _left_after(hosts, seconds: float) -> list:
    """The processes left in the hosts' namespaces, once none is left or ``seconds`` passed."""
    import subprocess
    import time

    deadline = time.monotonic() + seconds
    while True:
        left = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                for ns in hosts.namespaces]
        if not any(left) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


# --------------------------------------------------------------------------- fallbacks


MASTER = "10.82.0.1"  # rank 0's host (tests/mpi_netns.py): where MPI cannot tell the ranks


def test_an_mpi4py_without_a_library_leaves_the_leg_on_gloo_with_the_reason(tmp_path):
    run, out = _job("mpich", 2, 2, "leg", tmp_path, MPI4PY_LIBMPI="/nonexistent/libmpi.so.12", MASTER_ADDR=MASTER,
                    CPUDDP_LOG_LEVEL="INFO")
    for r in _reports(out, 4, run):
        assert r.get("ok") and r["leg"] == "gloo", r
    assert "no MPI leg: mpi4py found no MPI library" in run.output, run.output[-3000:]


def test_a_required_mpi_leg_that_cannot_run_is_a_clear_error(tmp_path):
    run, out = _job("mpich", 2, 1, "leg", tmp_path, timeout=120, MPI4PY_LIBMPI="/nonexistent/libmpi.so.12",
                    CPUDDP_SHM_INTER="mpi", MPI_LEG_BACKEND="shm", MASTER_ADDR=MASTER)
    assert run.returncode not in (0, None)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert reports and all("CPUDDP_SHM_INTER=mpi" in r.get("error", "") for r in reports), reports
    assert all("mpi4py found no MPI library" in r["error"] for r in reports), reports


def test_an_mpi4py_that_loads_another_mpi_than_the_launchers_leaves_the_leg_on_gloo(tmp_path):
    other = libmpi("openmpi")
    run, out = _job("mpich", 2, 2, "leg", tmp_path, timeout=180, MPI4PY_LIBMPI=other, MASTER_ADDR=MASTER)
    for r in _reports(out, 4, run):
        assert r.get("ok") and r["leg"].startswith("gloo (not MPI"), r
        assert "not the launcher's" in r["leg"], r
