"""Failure modes under the real launchers (issue 8): a rank lost mid-training, and two jobs on
one machine.

Launchers come from ``CPUDDP_MPICH_MPIEXEC``, ``CPUDDP_OPENMPI_MPIRUN``, ``CPUDDP_IMPI_MPIEXEC``
(defaults under /work/launchers; a missing one skips, see tests/launchers_util.py) and torchrun
from this interpreter.  Each job runs in its own session and is killed whole on overrun; every
process carries a token in its environment, and no process with it may outlive the test.

What each launcher does when a rank dies (seen with these versions, and what the tests pin):

* torchrun: SIGTERMs the other ranks at once; its "Root Cause" names a SIGKILLed rank; when
  several ranks exit with code 1 it named the lowest -- the survivor, not the culprit -- until
  cpuddp wrote each rank's error to torchrun's error file (issue 46): it now names the culprit.
  The survivor's cpuddp line (printed before torchrun's SIGTERM lands) names the right one too.
* MPICH 5 (Hydra): a rank killed by a signal makes Hydra SIGKILL the others within
  milliseconds; its banner gives the PID of the node's *first* process, not the dead one, and no
  survivor lives to say more.  A rank that exits with an error does not stop the others: the
  survivor fails in its next collective and its cpuddp line names the culprit.
* Intel MPI (Hydra): leaves the survivors running; its banner names the killed rank, and so
  does the survivor's cpuddp line.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from failure_scripts.procs import Job, base_env, free_port, last_line, leftovers, script
from launchers_util import command

pytestmark = pytest.mark.launcher

TIMEOUT = 10  # CPUDDP_TIMEOUT for these jobs
START = 90.0  # s: bound on a 2-rank job's start-up (two torch imports on 2 busy cores)


def _job(kind: str, n: int, argv: list[str], **env: str) -> Job:
    cmd, extra = command(kind, n, argv)
    return Job(cmd, base_env(**{"CPUDDP_TIMEOUT": str(TIMEOUT), **extra, **env}))


def _finish_all(*jobs: Job, timeout: float) -> list:
    return [j.finish(timeout=timeout) for j in jobs]


# --------------------------------------------------------------------------- a rank lost


LOST = r"cpuddp: \[rank0\] lost rank\(s\) \[1\]: rank 1 \(pid (\d+) on [^)]*\) "


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "kind,mode",
    [("torchrun", "kill"), ("torchrun", "raise"), ("mpich", "kill"), ("mpich", "raise"), ("impi", "kill")],
    ids=lambda v: v,
)
def test_lost_rank_under_launcher(kind, mode):
    job = _job(kind, 2, [script("train_and_die.py")], MODE=mode, VICTIM="1", MASTER_PORT=str(free_port()))
    with job.start():
        died = float(job.wait_for(r"DYING 1 (\d+\.\d+)", timeout=START)[0].group(1))
        rc = job.finish(timeout=TIMEOUT + 30)
    token = job.env["CPUDDP_TEST_TOKEN"]
    out, err = job.stdout, job.stderr
    report = f"exit {rc}\nstdout:\n{out}\nstderr:\n{err[-5000:]}"
    assert rc not in (0, None), report
    assert job.ended - died <= TIMEOUT + 5, report  # every rank gone, and the launcher too
    assert not leftovers(token), report
    pids = {int(r): int(p) for r, p in re.findall(r"PID (\d) (\d+)", out)}
    ours = re.search(LOST + ("died without a Python exception" if mode == "kill" else r"raised ValueError: bad batch"), err)
    if ours:
        assert int(ours.group(1)) == pids[1], report
    if kind == "torchrun":
        if mode == "kill":
            # torchrun names a signalled rank itself; cpuddp's line may or may not beat its SIGTERM.
            assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9", err, re.S), report
        else:
            assert ours, report
            # torchrun's own "Root Cause" named rank 0 (the lowest); from the error file cpuddp
            # writes (issue 46), it names the culprit, with its message.
            assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\).*?traceback : rank 1 \(pid \d+\): "
                             r"ValueError: bad batch", err, re.S), report
    elif kind == "mpich":
        if mode == "kill":
            # Hydra SIGKILLs rank 0 at once; its banner's PID is the node's first process.
            assert "BAD TERMINATION" in out + err and "signal 9" in out + err, report
        else:
            assert ours, report
            assert last_line(err) == ours.group(0) + " at step 10", report
    elif kind == "impi":
        assert ours, report
        assert re.search(rf"RANK 1 PID {pids[1]} .*\n.*KILLED BY SIGNAL: 9", out + err), report


# --------------------------------------------------------------------------- two jobs, one machine


def _hold(kind: str, tmp: Path, name: str, **env: str) -> Job:
    return _job(kind, 2, [script("hold_group.py")], RELEASE_FILE=str(tmp / f"release-{name}"), **env)


def _release(tmp: Path, name: str) -> None:
    (tmp / f"release-{name}").write_text("go")


def _joined(job: Job) -> list[dict]:
    import json

    return sorted((json.loads(m.group(1)) for m in job.matching(r"JOINED (\{[^{}]*\})")), key=lambda r: r["rank"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["openmpi", "impi", "mpich"])
def test_second_job_on_the_same_port_fails_clearly(kind, tmp_path):
    """Job A holds the group; job B, told the same MASTER_PORT (MPICH: no port at all -- it has
    no job id, so both fall back to 29500), fails within seconds: its rank 0 cannot listen, its
    rank 1 reaches A's store and refuses to join.  A never notices (its all-reduce sums stay 2)."""
    port = {} if kind == "mpich" else {"MASTER_PORT": str(free_port())}
    a = _hold(kind, tmp_path, "a", **port)
    (tmp_path / "b-failed").mkdir()  # B's ranks wait for each other's errors: Open MPI ends the
    # job when its first rank exits, which could cut rank 1's message short
    b = _hold(kind, tmp_path, "b", FAIL_DIR=str(tmp_path / "b-failed"), FAIL_PEERS="2", **port)
    with a, b:
        a.start()
        first = [r for r in _joined_wait(a)]
        b.start()
        rc_b = b.finish(timeout=START)
        _release(tmp_path, "a")
        rc_a = a.finish(timeout=60)
    report = f"A exit {rc_a}:\n{a.output[-3000:]}\n\nB exit {rc_b}:\n{b.output[-5000:]}"
    p = first[0]["master_port"]
    assert rc_b not in (0, None), report
    assert not b.matching(r"JOINED "), report
    assert f"rank 0 cannot listen on MASTER_PORT={p}: the port is already in use" in b.stderr, report
    assert re.search(rf"rank 1 reached the store of another job at 127\.0\.0\.1:{p}", b.stderr), report
    assert rc_a == 0 and len(a.matching(r"DONE \d")) == 2, report
    assert not leftovers(a.env["CPUDDP_TEST_TOKEN"]) and not leftovers(b.env["CPUDDP_TEST_TOKEN"]), report


def _joined_wait(job: Job) -> list[dict]:
    job.wait_for(r"JOINED \{", count=2, timeout=START)
    return _joined(job)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["openmpi", "impi"])
def test_jobs_without_a_port_derive_different_ports(kind, tmp_path):
    """Open MPI and Intel MPI give each job an id; with no MASTER_PORT two concurrent jobs
    derive different ports from it and both run, each in its own group."""
    a = _hold(kind, tmp_path, "a")
    b = _hold(kind, tmp_path, "b")
    with a, b:
        a.start()
        b.start()
        ja, jb = _joined_wait(a), _joined_wait(b)
        time.sleep(1.0)  # both groups busy at once
        _release(tmp_path, "a")
        _release(tmp_path, "b")
        rc_a, rc_b = _finish_all(a, b, timeout=60)
    report = f"A exit {rc_a}:\n{a.output[-3000:]}\n\nB exit {rc_b}:\n{b.output[-3000:]}"
    assert rc_a == 0 and rc_b == 0, report
    assert {r["master_port"] for r in ja} != {r["master_port"] for r in jb}, report
    assert ja[0]["job_id"] != jb[0]["job_id"], report
    for rows in (ja, jb):
        assert len({r["master_port"] for r in rows}) == 1 and len({r["job_id"] for r in rows}) == 1, report
    assert len(a.matching(r"DONE \d")) == 2 and len(b.matching(r"DONE \d")) == 2, report
