"""Issue 46 #4, "errors buried": a failed job ends with the root cause and its fix.

* ``cpuddp run`` (torchrun's agent on this node) ends its output with the first failing
  rank's message and its ``Fix:`` line, once, without torchrun's ``ChildFailedError`` banner
  (it used to end with 30 lines of that banner naming the wrong rank);
* under plain torchrun, torchrun's own summary names the rank that failed first as the root
  cause, with the message and its fix (it named the lowest rank, "To enable traceback see...");
* Ctrl-C of ``cpuddp run`` ends with one line saying where the same command resumes, no
  tracebacks (it printed one per rank and torchrun's ``SignalException``);
* a rank's traceback is one write (two ranks' reports never interleave).

Each end-to-end test starts the real launcher with a timeout and shows the output on failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from example_util import example_env

from cpuddp.launchers import report

RUN_TIMEOUT = 150.0  # seconds for a 2-rank job to fail and end (torch loads slowly on a busy 2-vCPU box)
START_TIMEOUT = 120.0

# Rank 1 fails with a cpuddp error (its fix on the last line); rank 0 dies of it in a collective.
FAILING = """\
import time, cpuddp, torch
import torch.distributed as dist
from cpuddp.errors import CheckpointError
env = cpuddp.init_distributed(timeout=60)
t = torch.zeros(1)
dist.all_reduce(t)
if env.rank == 1:
    time.sleep(0.3)
    raise CheckpointError("cannot write /nope/ckpt: no such directory", path="/nope",
                          fix="make /nope writable on rank 0's host")
for _ in range(600):
    dist.all_reduce(t)
    time.sleep(0.05)
"""
MESSAGE = "CheckpointError: cannot write /nope/ckpt: no such directory"
FIX = "Fix: make /nope writable on rank 0's host"

# Trains forever, a checkpoint every 3 steps; rank 0 writes the step of each to argv[2].
LOOPING = """\
import sys, time, cpuddp, torch
import torch.distributed as dist
env = cpuddp.init_distributed(timeout=60)
model = torch.nn.Linear(2, 2)
state = cpuddp.load_checkpoint(sys.argv[1], model=model)
step = state.step if state else 0
t = torch.zeros(1)
while True:
    step += 1
    dist.all_reduce(t)
    if step % 3 == 0:
        cpuddp.save_checkpoint(sys.argv[1], step=step, model=model)
        if env.rank == 0:
            open(sys.argv[2], "w").write(str(step))
    time.sleep(0.05)
"""


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=example_env(),
                              cwd=tmp_path, stdin=subprocess.DEVNULL, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`{' '.join(argv)}` did not finish in {RUN_TIMEOUT:.0f} s\n{exc.stdout}\n{exc.stderr}")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cpuddp_run_ends_with_the_first_failure_and_its_fix_once(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(FAILING)
    res = _run([sys.executable, "-m", "cpuddp", "run", "--ranks-per-node", "2", "--allocator", "none", "fail.py"],
               tmp_path)
    out = f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 1, out
    last = _lines(res.stderr)[-3:]
    assert last[0].startswith("cpuddp run: rank 1 (pid ") and last[0].endswith("failed first:"), out
    assert last[1:] == [MESSAGE, FIX], out
    assert res.stderr.count(f"\n{FIX}") == 1, out  # once unprefixed: the rank's own traceback says [rank1]: Fix
    assert "ChildFailedError" not in res.stderr and "Root Cause" not in res.stderr, out


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_plain_torchruns_root_cause_is_the_first_failure_with_its_fix(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(FAILING)
    res = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "fail.py"],
               tmp_path)
    out = f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 1, out
    root = res.stderr.split("Root Cause (first observed failure):", 1)[-1]
    assert "rank      : 1 (local_rank: 1)" in root, out
    assert "rank 1 (pid " in root and MESSAGE in root and FIX in root, out


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_of_cpuddp_run_ends_with_where_it_resumes(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text(LOOPING)
    ready = tmp_path / "ready"
    log = tmp_path / "log"
    argv = [sys.executable, "-m", "cpuddp", "run", "--ranks-per-node", "2", "--allocator", "none", "loop.py", "ck",
            str(ready)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=example_env(),
                                cwd=tmp_path, start_new_session=True)
    try:
        end = time.monotonic() + START_TIMEOUT
        while not ready.exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert ready.exists(), f"no checkpoint within {START_TIMEOUT:.0f} s (exit {proc.poll()}):\n{log.read_text()}"
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    lines = _lines(text)
    assert code == 130, text
    assert "Traceback" not in text and "SignalException" not in text, text
    assert lines[-1].startswith("cpuddp run: interrupted after the checkpoint of step "), text
    assert lines[-1].endswith("; run the same command to resume from it"), text
    step = int(lines[-1].split("step ", 1)[1].split(" ", 1)[0])
    assert step % 3 == 0 and step >= int(ready.read_text()), text


def test_a_ranks_traceback_is_one_write(tmp_path: Path) -> None:
    """stderr is a SOCK_SEQPACKET socket: each write() arrives as one message, so the messages
    show the writes.  Python's own hook writes a traceback in pieces (another rank's writes
    land between them); the rank's report is one."""
    script = tmp_path / "boom.py"
    script.write_text("def f():\n    raise ValueError('bad batch\\nsecond line')\nf()\n")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        proc = subprocess.Popen([sys.executable, "-m", "cpuddp.run.rank", str(script)], stderr=theirs,
                                stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=example_env(), cwd=tmp_path)
        theirs.close()
        try:
            code = proc.wait(60)
        finally:
            proc.kill()
        ours.settimeout(5)
        messages = []
        while True:
            data = ours.recv(1 << 20)
            if not data:
                break
            messages.append(data.decode())
    assert code == 1, messages
    whole = [m for m in messages if "Traceback (most recent call last)" in m]
    assert len(whole) == 1 and whole[0].rstrip().endswith("ValueError: bad batch\nsecond line"), messages


# --------------------------------------------------------------------------- the pieces, in process


def _private(tmp_path: Path) -> Path:
    d = tmp_path / "reports"
    d.mkdir(mode=0o700)
    return d


def test_the_first_failure_is_the_earliest_of_the_last_attempt(tmp_path: Path) -> None:
    d = _private(tmp_path)
    rows = [("rank0.1.json", {"kind": "error", "rank": 0, "pid": 1, "host": "h", "time": 20.0, "attempt": 1,
                              "message": "DistBackendError: peer gone"}),
            ("rank1.2.json", {"kind": "error", "rank": 1, "pid": 2, "host": "h", "time": 19.5, "attempt": 1,
                              "message": "ValueError: bad batch"}),
            ("rank1.3.json", {"kind": "error", "rank": 1, "pid": 3, "host": "h", "time": 5.0, "attempt": 0,
                              "message": "old attempt"})]
    for name, data in rows:
        (d / name).write_text(json.dumps(data))
    (d / "rank0.9.json").write_text('{"kind": "err')  # half a file: skipped
    assert report.ending(str(d), 1, False) == "cpuddp run: rank 1 (pid 2 on h) failed first:\nValueError: bad batch"
    assert report.ending(str(d), 0, False) is None


def test_no_report_says_where_to_look_and_an_interrupt_without_checkpoint_says_it_starts_over(tmp_path: Path) -> None:
    d = _private(tmp_path)
    assert "no rank left an error report" in report.ending(str(d), 1, False)
    assert "starts over" in report.ending(str(d), 130, True)
    report.note_checkpoint(6, "ck/step-000000006.pt", {report.REPORT_DIR_ENV: str(d), "RANK": "0"})
    assert report.ending(str(d), 130, True) == ("cpuddp run: interrupted after the checkpoint of step 6 "
                                                "(ck/step-000000006.pt); run the same command to resume from it")


def test_a_report_goes_only_to_a_private_directory_of_this_user(tmp_path: Path) -> None:
    d = _private(tmp_path)
    assert report.report_dir({report.REPORT_DIR_ENV: str(d)}) == str(d)
    d.chmod(0o733)  # others may write there: not ours alone
    assert report.report_dir({report.REPORT_DIR_ENV: str(d)}) is None
    link = tmp_path / "link"
    link.symlink_to(d)
    d.chmod(0o700)
    assert report.report_dir({report.REPORT_DIR_ENV: str(link)}) is None
    assert report.report_dir({}) is None
    report.record_failure(ValueError, ValueError("x"), {report.REPORT_DIR_ENV: str(link), "RANK": "0"})
    assert not list(d.iterdir())


@pytest.mark.launcher
@pytest.mark.timeout(200)
def test_cpuddp_run_says_torchs_numpy_warning_once(tmp_path: Path) -> None:
    """issue 46: without numpy, torch warns "Failed to initialize NumPy" in every process that
    imports it; under ``cpuddp run`` torchrun's process says it, its ranks do not again."""
    from example_util import fake_missing_numpy

    (tmp_path / "uses_torch.py").write_text("import torch\nprint('ran', torch.__version__)\n")
    env = example_env()
    env["PYTHONPATH"] = os.pathsep.join([fake_missing_numpy(tmp_path), env["PYTHONPATH"]])
    res = subprocess.run([sys.executable, "-m", "cpuddp", "run", "--ranks-per-node", "2", "--allocator", "none",
                          "uses_torch.py"], capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    out = f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 0 and res.stdout.count("ran ") == 2, out
    assert (res.stdout + res.stderr).count("Failed to initialize NumPy") == 1, out
