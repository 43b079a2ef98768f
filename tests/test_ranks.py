"""cpuddp.get_rank() & co. before, without and after init, and print0/log0 on real ranks."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cpuddp
from cpuddp.errors import LauncherEnvError

ROOT = Path(__file__).resolve().parents[1]


def _where() -> tuple[int, int, int, int]:
    return cpuddp.get_rank(), cpuddp.get_world_size(), cpuddp.get_local_rank(), cpuddp.get_local_world_size()


# --------------------------------------------------------------------------- before init, one process


def test_plain_python_is_rank_0_of_1(clean_launcher_env):
    assert _where() == (0, 1, 0, 1)


@pytest.mark.parametrize("environ, expected", [
    pytest.param({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"},
                 (1, 4, 1, 2), id="torchrun"),
    pytest.param({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 4, 1, 2), id="openmpi"),
    pytest.param({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
                 (2, 3, 0, 1), id="mpich"),
    pytest.param({"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                  "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[01-03],gpu-a7",
                  "SLURM_JOB_NODELIST": "node[01-03],gpu-a7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
                  "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NNODES": "4"}, (5, 7, 1, 2), id="srun"),
])
def test_before_init_the_launchers_values(clean_launcher_env, monkeypatch, environ, expected):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert _where() == expected


def test_a_half_set_launcher_environment_is_an_error(clean_launcher_env, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")  # WORLD_SIZE missing
    with pytest.raises(LauncherEnvError, match="WORLD_SIZE"):
        cpuddp.get_rank()
    with pytest.raises(LauncherEnvError, match="WORLD_SIZE"):
        cpuddp.print0("never printed")
    assert capsys.readouterr().out == ""


def test_a_process_group_wins_over_the_launcher(clean_launcher_env, monkeypatch):
    """A group the script formed itself (not cpuddp's): its rank and size; the launcher's local rank."""
    import torch.distributed as dist

    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert _where() == (0, 1, 1, 2)
    finally:
        dist.destroy_process_group()
    assert _where() == (1, 2, 1, 2)  # the group gone, the launcher's again


def test_print0_and_log0_on_rank_0(clean_launcher_env, monkeypatch, capsys, caplog):
    cpuddp.print0("a", 1, sep="-")
    assert capsys.readouterr().out == "a-1\n"
    with caplog.at_level(logging.INFO, logger="user.train"):
        cpuddp.log0("step %d", 3, logger="user.train")
        cpuddp.log0("careful", level="warning", logger=logging.getLogger("user.train"))
    assert [(r.name, r.levelname, r.getMessage(), r.filename) for r in caplog.records] == [
        ("user.train", "INFO", "step 3", "test_ranks.py"),  # the caller's line, not log0's
        ("user.train", "WARNING", "careful", "test_ranks.py"),
    ]
    with pytest.raises(ValueError, match="'LOUD'"):
        cpuddp.log0("x", level="LOUD")


def test_print0_and_log0_are_silent_on_other_ranks(clean_launcher_env, monkeypatch, capsys, caplog):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.DEBUG):
        cpuddp.print0("not on rank 1")
        cpuddp.log0("not on rank 1", level=logging.ERROR)
    assert capsys.readouterr().out == "" and not caplog.records


# --------------------------------------------------------------------------- real ranks


def _after_init() -> dict:
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    log = logging.getLogger("user.ranks")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out):
            cpuddp.print0("print0 from", cpuddp.get_rank())
            cpuddp.log0("log0 from %d", cpuddp.get_rank(), logger=log)
    finally:
        log.removeHandler(handler)
    return {"where": _where(), "stdout": out.getvalue(), "log": err.getvalue()}


@pytest.mark.timeout(120)
def test_after_init_on_two_ranks(run_distributed):
    r0, r1 = run_distributed(_after_init, 2, timeout=100)
    assert r0["where"] == (0, 2, 0, 2) and r1["where"] == (1, 2, 1, 2)
    assert (r0["stdout"], r0["log"]) == ("print0 from 0\n", "log0 from 0\n")
    assert (r1["stdout"], r1["log"]) == ("", "")


SCRIPT = """
import sys
import cpuddp

# one write per line: both ranks share torchrun's stdout pipe (print() writes piece by piece
# when Python runs unbuffered)
sys.stdout.write(f"where {cpuddp.get_rank()} {cpuddp.get_world_size()} {cpuddp.get_local_rank()} "
                 f"{cpuddp.get_local_world_size()}\\n")
sys.stdout.flush()
cpuddp.print0("print0 before init; torch imported:", "torch" in sys.modules)
cpuddp.init_distributed(backend="gloo", pin=False)
cpuddp.print0("print0 after init on rank", cpuddp.get_rank())
cpuddp.log0("log0 after init on rank %d", cpuddp.get_rank(), level="WARNING")
cpuddp.shutdown()
"""


@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_under_torchrun_before_and_after_init(tmp_path):
    from cpuddp.testing import clean_environ

    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = clean_environ(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env=env, cwd=tmp_path)
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, log
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("where")) == [
        "where 0 2 0 2", "where 1 2 1 2"], log
    # once per job, not per rank; before init without importing torch
    assert proc.stdout.count("print0 before init") == 1, log
    assert "print0 before init; torch imported: False" in proc.stdout, log
    assert proc.stdout.count("print0 after init") == 1 and "print0 after init on rank 0" in proc.stdout, log
    assert proc.stderr.count("log0 after init") == 1 and "log0 after init on rank 0" in proc.stderr, log


def test_log0_prints_where_logging_is_not_configured():
    """Issue 46: README's ``cpuddp.log0("launcher %s", ...)`` printed nothing in a script that
    configures no logging (Python drops an INFO record there); configured, logging decides."""
    code = ("import logging, cpuddp\n"
            "cpuddp.log0('launcher %s', 'plain')\n"
            "cpuddp.log0('hidden', level='DEBUG')\n"
            "logging.basicConfig(level=logging.WARNING, format='configured: %(message)s')\n"
            "cpuddp.log0('dropped: below WARNING')\n"
            "cpuddp.log0('kept', level='WARNING')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["launcher plain", "configured: kept"], done.stderr
