"""One writer per checkpoint directory, and a directory checkpoint replaced safely (issue 37 #3, #7).

- Two real jobs: job A (a process) saves into a directory and keeps running; job B (2 gloo
  ranks) saving there gets a ``CheckpointError`` naming A's host and pid on every rank, while
  B's own two ranks never conflict; once A exits, B saves.
- A sharded checkpoint (``fully_shard`` in a real 1-rank gloo group) replaced by a save of the
  same step, the saving process killed (``os._exit``) at each point of the replacement: before
  the first rename, between the two renames, after the second, while the old one is removed.
  Afterwards the step loads (the old weights or the new ones, never nothing), and no
  ``.cpuddp-*`` directory is left.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from cpuddp.topology.here import hostname
from cpuddp.train.checkpoint.ckpt_lock import hold_directory, release_directory
from cpuddp.train.checkpoint.load import list_checkpoints, load_checkpoint
from cpuddp.train.checkpoint.save import save_checkpoint

# --------------------------------------------------------------------------- two jobs, one directory

_JOB_A = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    import cpuddp
    cpuddp.save_checkpoint(sys.argv[1], step=1, model=nn.Linear(2, 2))
    print("HELD", os.getpid(), flush=True)
    sys.stdin.read()          # holds the directory until the test closes stdin
""")


def _save_or_error(directory: str) -> str:
    try:
        save_checkpoint(directory, step=2, model=nn.Linear(2, 2))
        return "saved"
    except Exception as exc:  # reported to the test
        return f"{type(exc).__name__}: {exc}"


def _start_job_a(d: str) -> tuple:
    """Job A (``_JOB_A``) saving into ``d`` and holding it: the process and its "HELD <pid>" line."""
    a = subprocess.Popen([sys.executable, "-c", _JOB_A, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return a, a.stdout.readline().split()


@pytest.mark.timeout(240)
def test_a_second_job_in_the_same_directory_is_named_and_stopped(run_distributed, tmp_path) -> None:
    d = str(tmp_path / "ck")
    a, line = _start_job_a(d)
    try:
        assert line[:1] == ["HELD"], f"job A did not save: {line} {a.stderr.read() if a.poll() is not None else ''}"
        pid = line[1]
        told = run_distributed(_save_or_error, 2, args=(d,), timeout=120)
        assert told[0].startswith("CheckpointError: another job writes checkpoints in"), told
        assert told[1].startswith("CpuddpError:") and "another job writes checkpoints" in told[1], told
        for t in told:
            assert f"pid {pid} on host {hostname()!r}" in t, t
        # issue 46: every rank gives the one fix, rank 0's (rank 1 added a contradictory one)
        fixes = [[line for line in t.splitlines() if line.startswith("Fix:")] for t in told]
        assert len(fixes[0]) == 1 and fixes[1] == fixes[0], told
        assert "checkpoint directory of its own" in fixes[0][0], told
    finally:
        a.stdin.close()
        a.wait(60)
        a.stdout.close()
        a.stderr.close()
    assert run_distributed(_save_or_error, 2, args=(d,), timeout=120) == ["saved", "saved"]
    assert [os.path.basename(p) for p in list_checkpoints(d)] == ["step-000000001.pt", "step-000000002.pt"]


def test_a_load_beside_a_running_writer_reads_the_newest_and_names_the_writer(tmp_path, caplog) -> None:
    """An evaluation process loads a running job's directory: it reads, never takes the directory
    from its writer, and says who writes there; the writer saves on."""
    d = str(tmp_path / "ck")
    a, line = _start_job_a(d)
    try:
        assert line[:1] == ["HELD"], f"job A did not save: {line}"
        with caplog.at_level("WARNING", logger="cpuddp.checkpoint"):
            got = load_checkpoint(d, model=nn.Linear(2, 2))
        assert got is not None and got.step == 1, got
        assert f"another job writes checkpoints in {d!r} (pid {line[1]} on host" in caplog.text, caplog.text
        assert "CheckpointError: another job writes" in _hold_in_child(d), "job A lost its lock"
    finally:
        a.stdin.close()
        a.wait(60)
        a.stdout.close()
        a.stderr.close()
    assert _hold_in_child(d) == "held"  # this process's load kept nothing


def _hold_in_child(directory: str) -> str:
    code = "import sys\nfrom cpuddp.train.checkpoint.ckpt_lock import hold_directory\nhold_directory(sys.argv[1])\nprint('held')"
    res = subprocess.run([sys.executable, "-c", code, directory], capture_output=True, text=True, timeout=60)
    return res.stdout.strip() or res.stderr.strip().splitlines()[-2]


def test_the_lock_survives_another_descriptor_closing_and_is_handed_on(tmp_path) -> None:
    """A plain POSIX lock would drop when this process closes any descriptor of the file (a backup
    reading the directory); the writer's lock must not."""
    d = str(tmp_path)
    hold_directory(d)
    with open(os.path.join(d, ".cpuddp-lock"), "rb") as f:
        f.read()
    assert _hold_in_child(d).startswith(f"cpuddp.errors.CheckpointError: another job writes checkpoints in {d!r}")
    assert release_directory(d) and _hold_in_child(d) == "held"


# --------------------------------------------------------------------------- a directory checkpoint replaced


_SHARDED_SAVE = textwrap.dedent("""
    import os, shutil, sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import cpuddp
    directory, seed, crash, port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    final = os.path.join(directory, "step-000000005")
    rename, rmtree = os.rename, shutil.rmtree

    def crashing_rename(src, dst):
        if crash == "before_first_rename" and ".old." in str(dst):
            os._exit(17)
        rename(src, dst)
        if crash == "between_the_renames" and ".old." in str(dst):
            os._exit(17)
        if crash == "after_the_second_rename" and str(dst) == final:
            os._exit(17)

    def crashing_rmtree(path, *args, **kwargs):
        if crash == "while_removing_the_old" and ".old." in str(path):
            os._exit(17)
        rmtree(path, *args, **kwargs)

    os.rename, shutil.rmtree = crashing_rename, crashing_rmtree
    cpuddp.save_checkpoint(directory, step=5, model=model)
    dist.destroy_process_group()
    print("SAVED", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_save(directory: str, seed: int, crash: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SHARDED_SAVE, directory, str(seed), crash, str(_free_port())],
                          capture_output=True, text=True, timeout=120)


def _weights(seed: int) -> dict:
    torch.manual_seed(seed)
    return nn.Linear(4, 2).state_dict()


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("first") / "ck")
    res = _sharded_save(d, 1, "none")
    assert res.returncode == 0 and "SAVED" in res.stdout, res.stdout + res.stderr
    return d


@pytest.mark.timeout(180)
@pytest.mark.parametrize("crash, lands", [("before_first_rename", False), ("between_the_renames", False),
                                          ("after_the_second_rename", True), ("while_removing_the_old", True)])
def test_a_directory_checkpoint_replaced_survives_a_crash_at_any_point(saved_once, tmp_path, crash, lands) -> None:
    d = str(tmp_path / "ck")
    shutil.copytree(saved_once, d, symlinks=True)
    res = _sharded_save(d, 2, crash)
    assert res.returncode == 17, f"the save did not die {crash}: {res.stdout}{res.stderr}"
    model = nn.Linear(4, 2)
    resumed = load_checkpoint(d, model=model)
    assert resumed is not None and resumed.step == 5, (crash, os.listdir(d))
    want = _weights(2 if lands else 1)
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want), crash
    assert not [n for n in os.listdir(d) if n.startswith(".cpuddp-") and n.endswith(".tmp")], os.listdir(d)
    assert [os.path.basename(p) for p in list_checkpoints(d)] == ["step-000000005"]
