"""Failure modes as real processes (issue 8): malformed environments, a rank lost mid-training
without a launcher, and the watchdog that names it.

Every malformed case runs ``python failure_scripts/init_only.py`` with the case's environment and
checks: a non-zero exit, the last line of stderr (the variable and the fix), and the time from
the call to the error (at once, or within the configured timeout plus a margin).  The cases run
in parallel threads, once per module (``CPUDDP_FAILURE_TABLE=<file.json>`` writes the results).
``CPUDDP_RECORD_BARE_TORCH=1`` also records what bare ``torch.distributed.init_process_group("gloo")``
does with each environment (``CPUDDP_BARE_TORCH_JSON=<file>``; the table in
docs/troubleshooting.md) -- off by default, it costs a torch import per case.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import pytest

from failure_scripts.procs import (
    PY, Job, base_env, free_port, kill_session, last_line, leftovers, run_parallel, script,
)

FAST = 10.0  # s: an error that needs no waiting arrives within this, after the call (today that
# includes init_distributed's own `import torch`, 2-5 s here; with detection first, 0.1 s)
WAIT = 5  # s: CPUDDP_TIMEOUT in the cases that must wait
MARGIN = 3.0  # s: on top of WAIT
RUN_LIMIT = 90.0  # s: subprocess limit for one case (several start at once on 2 cores)
BARE_HANG = 8.0  # s after the call: bare torch is called hung (its own default is 30 min)


@dataclass(frozen=True)
class Case:
    name: str
    env: dict[str, str]
    last: tuple[str, ...]  # substrings the last line of stderr must hold
    error: str  # the exception class that must be raised
    args: tuple[str, ...] = ()
    waits: bool = False  # bounded by CPUDDP_TIMEOUT rather than immediate (timed after `import torch`)
    xfail_unless: Optional[str] = None  # a cpuddp.distributed attribute a lead patch adds


LOOP = {"MASTER_ADDR": "127.0.0.1"}
ONE_NODE_MPICH = {"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
         "SLURM_JOB_ID": "77"}

CASES = [
    # The foundation issue's cases.
    Case("rank not an integer", {"RANK": "abc", "WORLD_SIZE": "2", **LOOP}, ("RANK='abc'", "fix"),
         "LauncherEnvError"),
    Case("rank negative", {"RANK": "-1", "WORLD_SIZE": "2", **LOOP}, ("RANK='-1'", "fix"), "LauncherEnvError"),
    Case("rank out of range", {"RANK": "2", "WORLD_SIZE": "2", **LOOP}, ("RANK='2'", "WORLD_SIZE=2"),
         "LauncherEnvError"),
    Case("world size 0", {"RANK": "0", "WORLD_SIZE": "0", **LOOP}, ("WORLD_SIZE='0'", "fix"), "LauncherEnvError"),
    Case("PMI_RANK without PMI_SIZE", {"PMI_RANK": "0"}, ("PMI_SIZE=unset", "mpiexec"), "LauncherEnvError"),
    Case("local rank >= local world size",
         {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"},
         ("MPI_LOCALRANKID='2'", "fix"), "LauncherEnvError"),
    Case("port not an integer", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29x", **LOOP},
         ("MASTER_PORT='29x'", "fix"), "LauncherEnvError"),
    Case("port above 65535", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000", **LOOP},
         ("MASTER_PORT='70000'", "fix"), "LauncherEnvError"),
    Case("port 0", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0", **LOOP},
         ("MASTER_PORT='0'", "fix"), "LauncherEnvError"),
    Case("port in use on rank 0", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "{busy}", **LOOP},
         ("MASTER_PORT", "{busy}"), "RendezvousError"),
    Case("malformed Slurm node list",
         {**SLURM, "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[01-", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"},
         ("SLURM_STEP_NODELIST='node[01-'", "fix"), "LauncherEnvError"),
    Case("unknown backend name", {"RANK": "0", "WORLD_SIZE": "1", **LOOP}, ("nosuch", "gloo"), "BackendError",
         args=("nosuch",)),
    # Added by issue 8.
    Case("two launchers disagree (MPICH rank 0, Open MPI rank 1)",
         {"PMI_RANK": "0", "PMI_SIZE": "2", **ONE_NODE_MPICH, "OMPI_COMM_WORLD_RANK": "1",
          "OMPI_COMM_WORLD_SIZE": "2"},
         ("OMPI_COMM_WORLD_RANK='1'", "unset OMPI_COMM_WORLD_RANK"), "LauncherEnvError"),
    Case("stale RANK under mpiexec", {"PMI_RANK": "0", "PMI_SIZE": "2", **ONE_NODE_MPICH, "RANK": "1"},
         ("RANK='1'", "unset RANK"), "LauncherEnvError"),
    Case("multi-node Slurm step without a node list",
         {**SLURM, "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
         ("SLURM_STEP_NODELIST=unset", "MASTER_ADDR"), "LauncherEnvError"),
    Case("MASTER_ADDR does not resolve",
         {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
          "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "{free}"},
         ("MASTER_ADDR",), "RendezvousError"),
    Case("world of 2, rank 1 never starts",
         {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "{free}", **LOOP}, ("WORLD_SIZE=2", "[1]"),
         "RendezvousError", waits=True, xfail_unless="_missing_ranks"),
    Case("world of 2, rank 0 never starts",
         {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "{free}", **LOOP}, ("MASTER_ADDR", "MASTER_PORT"),
         "RendezvousError", waits=True, xfail_unless="_wait_listening"),  # torch's client retries past it
    Case("backend='ccl' without the oneCCL bindings", {"RANK": "0", "WORLD_SIZE": "1", **LOOP}, ("ccl",),
         "BackendError", args=("ccl",)),
    Case("stray NODE_RANK on one node",
         {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", **LOOP},
         ("NODE_RANK='1'", "fix"), "LauncherEnvError"),
    Case("torchrun variables half there", {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", **LOOP},
         ("WORLD_SIZE=unset", "torchrun"), "LauncherEnvError"),
    Case("CPUDDP_TIMEOUT not a number", {"RANK": "0", "WORLD_SIZE": "1", "CPUDDP_TIMEOUT": "5m", **LOOP},
         ("CPUDDP_TIMEOUT='5m'", "fix"), "LauncherEnvError"),
]


@dataclass
class Result:
    case: Case
    returncode: Optional[int]  # None: killed at the limit
    seconds: Optional[float]  # from the call (READY) to the error's line; None when the call never came
    stderr: str
    stdout: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def last(self) -> str:
        return last_line(self.stderr)

    def describe(self) -> str:
        return f"exit {self.returncode} after {self.seconds} s\nstdout:\n{self.stdout}\nstderr:\n{self.stderr[-3000:]}"


def _fill(env: dict[str, str], busy: int) -> dict[str, str]:
    free = free_port()
    return {k: v.replace("{busy}", str(busy)).replace("{free}", str(free)) for k, v in env.items()}


def _run(case: Case, busy: int, bare: bool = False) -> Result:
    env = _fill(case.env, busy)
    if bare:  # bare torch needs these set by hand; give them as a torch user would
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    full = base_env(**{"CPUDDP_TIMEOUT": str(WAIT), **env})
    if case.waits or os.environ.get("CPUDDP_FAILURE_IMPORT_TORCH") == "1":
        full["IMPORT_TORCH_FIRST"] = "1"  # timed from after `import torch`, as in a training script
    cmd = [PY, script("bare_torch_init.py"), *case.args] if bare else [PY, script("init_only.py"), *case.args]
    job = Job(cmd, full).start()
    ready: Optional[float] = None
    try:
        m = job.wait_for(r"^READY (\d+\.\d+)$", timeout=RUN_LIMIT)
        ready = float(m[0].group(1))
    except AssertionError:
        pass
    left = RUN_LIMIT if ready is None else (BARE_HANG if bare else WAIT + MARGIN + 30.0)
    rc = job.finish(timeout=left)
    # The time to the error is when the exception's line was printed (the interpreter's own
    # teardown after it is not the error's latency); without one, the exit.
    said = [ln.t for ln in job.lines if ln.stream == "err" and re.match(r"(cpuddp\.errors\.|\w+Error: )", ln.text)]
    end = said[0] if said else (job.ended if job.ended is not None else time.time())
    seconds = None if ready is None else round(end - ready, 2)
    return Result(case, rc, seconds, job.stderr, job.stdout, env)


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    busy = socket.create_server(("127.0.0.1", 0))  # "port in use": held for the whole run
    try:
        port = busy.getsockname()[1]
        out = run_parallel([lambda c=c: _run(c, port) for c in CASES], workers=3)
    finally:
        busy.close()
    dest = os.environ.get("CPUDDP_FAILURE_TABLE")
    if dest:  # the rows of docs/troubleshooting.md's table
        rows = [{"case": c.name, "exit": getattr(r, "returncode", None), "seconds": getattr(r, "seconds", None),
                 "last": getattr(r, "last", repr(r))} for c, r in zip(CASES, out)]
        with open(dest, "w") as f:
            json.dump(rows, f, indent=1)
    return {c.name: r for c, r in zip(CASES, out)}


@pytest.mark.timeout(10)
def test_at_least_15_cases():
    assert len(CASES) >= 15


@pytest.mark.timeout(240)  # the first test runs every case (in 3 threads)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_environment(case: Case, results: dict[str, Result]):
    r = results[case.name]
    if isinstance(r, BaseException):
        raise r

    def check(ok: bool, what: str) -> None:
        if ok:
            return
        if case.xfail_unless:
            from cpuddp import distributed

            if not hasattr(distributed, case.xfail_unless):
                pytest.xfail(f"{what} -- needs the lead's patch adding cpuddp.distributed.{case.xfail_unless}")
        raise AssertionError(f"{what}\n{r.describe()}")

    assert r.returncode not in (0, None), r.describe()
    assert r.seconds is not None, r.describe()
    assert f"cpuddp.errors.{case.error}" in r.stderr, r.describe()
    assert "Traceback" not in r.last, r.describe()
    for s in case.last:
        s = s.replace("{busy}", r.env.get("MASTER_PORT", ""))
        check(s in r.last, f"the last line lacks {s!r}: {r.last!r}")
    if case.waits:
        assert r.seconds >= WAIT * 0.8, f"returned before the timeout: {r.describe()}"
        check(r.seconds <= WAIT + MARGIN, f"the error came {r.seconds} s after the call (timeout {WAIT} s)")
    else:
        check(r.seconds <= FAST, f"the error came {r.seconds} s after the call")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_record_bare_torch(tmp_path):
    """What bare torch does with each environment, for docs/troubleshooting.md's table."""
    if os.environ.get("CPUDDP_RECORD_BARE_TORCH") != "1":
        pytest.skip("set CPUDDP_RECORD_BARE_TORCH=1 to record bare torch's behaviour (a torch import per case)")
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        out = run_parallel([lambda c=c: _run(c, port, bare=True) for c in CASES], workers=3)
    finally:
        busy.close()
    rows = []
    for case, r in zip(CASES, out):
        assert not isinstance(r, BaseException), r
        if r.returncode is None:
            behaviour = f"hangs (killed {BARE_HANG:.0f} s after the call; torch waits 30 min)"
        elif r.returncode == 0:
            behaviour = "succeeds (" + last_line(r.stdout) + ")"
        else:
            behaviour = f"exit {r.returncode} after {r.seconds} s: {r.last[:200]}"
        rows.append({"case": case.name, "behaviour": behaviour})
    dest = os.environ.get("CPUDDP_BARE_TORCH_JSON", str(tmp_path / "bare_torch.json"))
    with open(dest, "w") as f:
        json.dump(rows, f, indent=1)
    print(json.dumps(rows, indent=1))


# --------------------------------------------------------------------------- a rank lost, no launcher


def _plain_job(mode: str, victim: int, timeout: int = 10) -> tuple[list[Job], dict[str, str]]:
    port = free_port()
    common = base_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      CPUDDP_TIMEOUT=str(timeout), MODE=mode, VICTIM=str(victim))
    jobs = [Job([PY, script("train_and_die.py")], dict(common, RANK=str(r), LOCAL_RANK=str(r))).start()
            for r in range(2)]
    return jobs, common


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode,victim,expect",
    [
        ("kill", 1, r"cpuddp: \[rank0\] lost rank\(s\) \[1\]: rank 1 \(pid (\d+) on .*\) died without a Python exception"),
        ("kill", 0, r"cpuddp: \[rank1\] lost rank 0(?: \(pid (\d+) on [^)]*\))?, which hosts the rendezvous store"),
        ("stop", 1, r"cpuddp: \[rank0\] lost rank\(s\) \[1\]: no heartbeat from rank 1 \(pid (\d+) on .*\) for \d s "
                    r"\(alive but not responding"),
    ],
    ids=["rank1-killed", "rank0-store-host-killed", "rank1-hung"],
)
def test_lost_rank_without_launcher(mode, victim, expect):
    """Ranks started by hand (as Kubeflow or a script would): the survivor exits non-zero within
    the timeout -- a hung rank can only be noticed at the timeout, plus the watchdog's look at
    the heartbeats -- and its last line names the lost rank."""
    from cpuddp.watchdog import monitor as watchdog

    timeout = 5 if mode == "stop" else 10
    bound = timeout + (watchdog.STALE + 2 if mode == "stop" else 0)
    jobs, common = _plain_job(mode, victim, timeout)
    try:
        died = float(jobs[victim].wait_for(r"^DYING \d+ (\d+\.\d+)$", timeout=90)[0].group(1))
        survivor_rc = jobs[1 - victim].finish(timeout=bound + 20)
        if mode == "stop":
            kill_session(jobs[victim].proc.pid)
        victim_rc = jobs[victim].finish(timeout=20)
    finally:
        for j in jobs:
            j.__exit__()
    survivor = jobs[1 - victim]
    codes = {victim: victim_rc, 1 - victim: survivor_rc}
    report = "\n".join(f"--- rank {i} (exit {codes[i]}):\n{j.output[-3000:]}" for i, j in enumerate(jobs))
    assert survivor_rc not in (0, None), report
    assert victim_rc not in (0, None), report
    assert survivor.ended - died <= bound, f"{survivor.ended - died:.1f} s\n{report}"
    last = last_line(survivor.stderr)
    m = re.search(expect, last)
    assert m, f"last line: {last!r}\n{report}"
    if m.group(1):
        assert int(m.group(1)) == int(jobs[victim].matching(r"^PID \d+ (\d+)$")[0].group(1)), report
    assert not leftovers(common["CPUDDP_TEST_TOKEN"]), report


# --------------------------------------------------------------------------- the watchdog in process


class _FakeEnv:
    def __init__(self, rank: int, world: int, port: int) -> None:
        self.rank, self.world_size, self.master_addr, self.master_port = rank, world, "127.0.0.1", port
        self.agent_store = False


@pytest.mark.timeout(60)
def test_watchdog_heartbeats_hooks_and_stop(monkeypatch):
    """start/stop in this process against a real TCPStore: heartbeats move, hooks are
    installed and restored, stop is bounded even after the store is gone."""
    import datetime
    import sys
    import threading

    import torch.distributed as dist

    from cpuddp.watchdog import monitor as watchdog

    monkeypatch.delenv("CPUDDP_WATCHDOG", raising=False)
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    before = (sys.excepthook, threading.excepthook)
    try:
        watchdog.start(_FakeEnv(1, 2, port), server, interval=0.1)
        assert watchdog.running()
        assert sys.excepthook is not before[0] and threading.excepthook is not before[1]
        key = "cpuddp/watchdog/0/hb/1"
        first = int(server.get(key))
        time.sleep(0.5)
        assert int(server.get(key)) > first
        info = server.get("cpuddp/watchdog/0/info").decode()
        assert info.startswith(f"1\t{os.getpid()}\t")
        # rank 0 never wrote anything: it has no pid on record and no heartbeat, so it is lost
        t = time.monotonic()
        assert "no heartbeat from rank 0" in (watchdog.diagnose(comm_failure=True) or "")
        assert time.monotonic() - t < watchdog.STALE + 2
        t = time.monotonic()
        watchdog.stop()
        assert time.monotonic() - t < 3
        assert not watchdog.running()
        assert (sys.excepthook, threading.excepthook) == before
        assert server.get("cpuddp/watchdog/0/done").decode() == "1\n"
        # a world of one, or CPUDDP_WATCHDOG=0: nothing starts
        watchdog.start(_FakeEnv(0, 1, port), server)
        assert not watchdog.running()
        monkeypatch.setenv("CPUDDP_WATCHDOG", "0")
        watchdog.start(_FakeEnv(1, 2, port), server)
        assert not watchdog.running()
    finally:
        watchdog.stop()
        del server


@pytest.mark.timeout(60)
def test_watchdog_excepthook_names_the_first_failure():
    """Two ranks in subprocesses share a store; rank 1 raises, rank 0 then fails in a
    'collective': rank 0's last line names rank 1 and its error, at once (no sampling)."""
    code = r'''
import datetime, os, sys, time, torch.distributed as dist
from cpuddp.watchdog import monitor as watchdog
rank, port = int(sys.argv[1]), int(sys.argv[2])
class E: pass
e = E(); e.rank, e.world_size, e.master_addr, e.master_port, e.agent_store = rank, 2, "127.0.0.1", port, False
store = dist.TCPStore("127.0.0.1", port, None, rank == 0, datetime.timedelta(seconds=10), wait_for_workers=False)
watchdog.start(e, store)
store.add("up", 1)
while int(store.add("up", 0)) < 2: time.sleep(0.05)
if rank == 1:
    raise ValueError("bad batch 7")
while not store.check(["cpuddp/watchdog/0/failed"]): time.sleep(0.05)
t = time.monotonic()
try:
    raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
finally:
    print(f"RAISED {t}", flush=True)
'''
    port = free_port()
    env = base_env()
    jobs = [Job([PY, "-c", code, str(r), str(port)], env).start() for r in range(2)]
    try:
        codes = [j.finish(timeout=40) for j in jobs]
    finally:
        for j in jobs:
            j.__exit__()
    report = "\n".join(f"--- {i} ({c}):\n{j.output}" for i, (j, c) in enumerate(zip(jobs, codes)))
    assert codes == [1, 1], report
    assert re.search(r"cpuddp: \[rank0\] lost rank\(s\) \[1\]: rank 1 \(pid \d+ on .*\) raised ValueError: bad batch 7$",
                     last_line(jobs[0].stderr)), report
    assert "ValueError: bad batch 7" in last_line(jobs[1].stderr), report  # the culprit adds nothing
    assert jobs[0].ended - jobs[0].started < 30, report
