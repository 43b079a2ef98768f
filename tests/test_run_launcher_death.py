"""Issue 37 #3: the ranks of ``cpuddp run`` end when their launcher dies.

``kill -9`` of ``cpuddp run`` (which becomes torchrun's agent, or ``mpirun``, by ``exec``) left
torchrun's and Open MPI's ranks training to the end, re-parented to init.  Each rank now
starts through :mod:`cpuddp.run.rank`, which ties it to the launcher's pid: the kernel's
parent-death signal where the launcher is its parent, a watching thread where a launcher's
helper is (``slurmstepd``, ``hydra_pmi_proxy``).  These tests start the real thing, kill it
with SIGKILL and require every rank gone within :data:`GONE_WITHIN` seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from example_util import example_env
from launchers_util import OMPI_ROOT_ENV, launcher_path

from cpuddp.errors import LauncherEnvError
from cpuddp.run.rank import LAUNCHER_HOST_ENV, LAUNCHER_PID_ENV, end_with_launcher, launcher_env
from cpuddp.topology import here

GONE_WITHIN = 5.0  # seconds from the launcher's SIGKILL to the last rank gone
START_TIMEOUT = 90.0  # for the ranks to write their pid files (torch's agent loads slowly on a busy 2-vCPU box)

# A rank that only loops: it writes its pid, then sleeps forever (a job that would never end).
LOOP = "import os, sys, time\nopen(os.path.join(sys.argv[1], f'pid.{os.getpid()}'), 'w').close()\nwhile True: time.sleep(0.1)\n"


def _rank_pids(out: Path, n: int, proc: subprocess.Popen, log: Path) -> list[int]:
    end = time.monotonic() + START_TIMEOUT
    while time.monotonic() < end:
        pids = [int(p.name.split(".")[1]) for p in out.glob("pid.*")]
        if len(pids) >= n:
            return pids
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited {proc.returncode} before {n} ranks started:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    pytest.fail(f"{n} ranks did not start within {START_TIMEOUT:.0f} s:\n{log.read_text()[-4000:]}")


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if here.pid_alive(p)]


def _kill_and_watch(proc: subprocess.Popen, pids: list[int], log: Path) -> None:
    """SIGKILL ``proc``; every pid of ``pids`` must be gone within GONE_WITHIN seconds."""
    try:
        proc.kill()
        proc.wait(10)
        end = time.monotonic() + GONE_WITHIN
        while _alive(pids) and time.monotonic() < end:
            time.sleep(0.05)
        left = _alive(pids)
        assert not left, (f"ranks {left} still run {GONE_WITHIN:g} s after the launcher (pid {proc.pid}) was killed\n"
                          f"{log.read_text()[-4000:]}")
    finally:
        for p in _alive(pids):  # a failing run leaves nothing behind
            os.kill(p, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _own_tmpdir(monkeypatch):
    """TMPDIR for what the test starts: a SIGKILLed ``cpuddp run`` cannot remove its report folder
    (``cpuddp-run-*``), so the test does.  A short path: Open MPI puts its sockets under TMPDIR."""
    import shutil
    import tempfile

    short = tempfile.mkdtemp(prefix="cpd-")
    monkeypatch.setenv("TMPDIR", short)
    yield
    shutil.rmtree(short, ignore_errors=True)


def _start(argv: list[str], tmp_path: Path, **extra: str) -> tuple[subprocess.Popen, Path, Path]:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "loop.py").write_text(LOOP)
    log = tmp_path / "log"
    env = example_env()
    env.update(extra)
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv + [str(tmp_path / "loop.py"), str(out)], stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=tmp_path, start_new_session=True)
    return proc, out, log


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_kill_9_of_cpuddp_run_ends_torchruns_ranks(tmp_path: Path) -> None:
    proc, out, log = _start([sys.executable, "-m", "cpuddp", "run", "--ranks-per-node", "2", "--allocator", "none"],
                            tmp_path)
    pids = _rank_pids(out, 2, proc, log)
    _kill_and_watch(proc, pids, log)


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["openmpi", "mpich"])
def test_kill_9_of_cpuddp_run_ends_mpis_ranks(kind: str, tmp_path: Path) -> None:
    """Open MPI's ``mpirun`` is its local ranks' parent (they outlived it); MPICH's
    ``hydra_pmi_proxy`` is (the proxy ends them itself, and the ranks watch the launcher too)."""
    exe = launcher_path(kind)
    extra = dict(OMPI_ROOT_ENV) if kind == "openmpi" else {}
    proc, out, log = _start([sys.executable, "-m", "cpuddp", "run", "--hosts", "localhost", "--ranks-per-node", "2",
                             "--allocator", "none", "--launcher", exe], tmp_path, **extra)
    pids = _rank_pids(out, 2, proc, log)
    _kill_and_watch(proc, pids, log)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_whose_launcher_is_not_its_parent_watches_it(tmp_path: Path) -> None:
    """The srun/Hydra shape: the launcher is not the rank's parent (a helper is); the rank's
    thread sees the launcher's pid end and ends the rank."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        extra = {LAUNCHER_PID_ENV: str(launcher.pid), LAUNCHER_HOST_ENV: here.host_identity(("pid",))}
        rank, out, log = _start([sys.executable, "-m", "cpuddp.run.rank"], tmp_path, **extra)
        pids = _rank_pids(out, 1, rank, log)
        _kill_and_watch(launcher, pids, log)
        rank.wait(10)
        assert rank.returncode == -signal.SIGKILL and f"the launcher (pid {launcher.pid}) is gone" in log.read_text()
    finally:
        launcher.kill()
        launcher.wait()


def test_end_with_launcher_ignores_a_launcher_on_another_host_and_takes_the_variables() -> None:
    env = {LAUNCHER_PID_ENV: "1", LAUNCHER_HOST_ENV: "elsewhere|boot|123", "KEEP": "1"}
    assert end_with_launcher(env) is None and env == {"KEEP": "1"}  # a child of the rank is no rank
    assert end_with_launcher({}) is None
    own = launcher_env()
    assert own == {LAUNCHER_PID_ENV: str(os.getpid()), LAUNCHER_HOST_ENV: here.host_identity(("pid",))}


def test_a_bad_launcher_pid_names_the_variable_and_the_fix() -> None:
    env = {LAUNCHER_PID_ENV: "abc", LAUNCHER_HOST_ENV: here.host_identity(("pid",))}
    with pytest.raises(LauncherEnvError, match=r"CPUDDP_LAUNCHER_PID='abc'.*fix: start the job with `cpuddp run`"):
        end_with_launcher(env)
