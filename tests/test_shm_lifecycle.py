"""The shm group's lifecycle: formed again in the same processes (torchrun, mpiexec), used after
shutdown, forked, and handed over while a neighbour stalls the hand-over socket.

Every scenario runs real processes (tests/scripts/shm_lifecycle.py, under the real launcher or as
plain env:// ranks) with a timeout; each rank writes a JSON report the test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launchers_util
from shm_util import unshare_pid_or_skip

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "shm_lifecycle.py"


def _reports(outdir: Path, n: int, proc: subprocess.CompletedProcess | None = None) -> list[dict]:
    out = []
    for r in range(n):
        path = outdir / f"rank{r}.json"
        if path.exists():
            out.append(json.loads(path.read_text()))
        else:
            out.append({"missing": True, "log": (proc.stdout + proc.stderr)[-3000:] if proc else ""})
    return out


@pytest.mark.parametrize("kind", ["torchrun", "mpich"])
def test_init_shutdown_init_again_in_the_same_processes(kind, tmp_path):
    proc = launchers_util.run(kind, 2, [str(SCRIPT), "reinit", str(tmp_path)], timeout=240)
    for r in _reports(tmp_path, 2, proc):
        assert "crash" not in r and "missing" not in r, r
        for i in range(3):
            assert r[f"round{i}"].get("ok") == 3.0, r
        assert r["gloo"].get("ok") == 3.0, r
        beside = r["shm_beside_gloo"]
        assert beside.get("type") == "BackendError", r
        assert "while a 'gloo' process group exists" in beside["error"] and "cpuddp.shutdown()" in beside["error"]


def test_a_group_used_after_shutdown_says_so(tmp_path):
    proc = launchers_util.run("torchrun", 2, [str(SCRIPT), "after_shutdown", str(tmp_path)], timeout=180)
    for r in _reports(tmp_path, 2, proc):
        assert "crash" not in r and "missing" not in r, r
        assert r["before"].get("ok") == 3.0, r
        assert r["handle"].get("type") == "GroupShutDownError", r
        assert "was shut down" in r["handle"]["error"], r
        assert "was shut down" in r["ddp"].get("error", ""), r  # DDP's reducer gets the same error
        assert "NoneType" not in json.dumps(r), r


def _plain(mode: str, tmp_path: Path, prefix1: tuple = (), timeout: float = 120) -> list[dict]:
    from shm_util import launch_ranks

    return launch_ranks(SCRIPT, 2, mode, tmp_path, timeout=timeout, prefix=((), prefix1))


def test_a_forked_child_neither_uses_nor_ends_the_parents_group(tmp_path):
    for r in _plain("fork", tmp_path):
        assert "crash" not in r and "output" not in r, r
        assert r["child_exit"] == 0, r  # the child's collective raised GroupShutDownError (its exit code 0)
        assert r["after_child"].get("ok") == 3.0, r  # the child's atexit shutdown did not mark the parent left
        assert r["dataloader"].get("ok") == 8, r  # each rank's loader: 64 samples in batches of 8
        assert r["after_loader"].get("ok") == 3.0, r


#: Seconds the namespace's PID 1 lives on after rank 1 exits.  When PID 1 exits, the kernel kills
#: every process of the namespace -- the forked child too, and with it any lock it inherited -- so
#: it must outlive the rank, or the test could not fail (issue 37 #8: it exited with the rank).
PID1_LINGER = 6


def _pid_namespace_prefix() -> tuple:
    # sh is PID 1 of the namespace; it stays PID1_LINGER s after the rank, and the forked child with it
    return (*unshare_pid_or_skip(), "sh", "-c", f'"$@"; code=$?; sleep {PID1_LINGER}; exit $code', "sh")


@pytest.mark.parametrize("namespace", [False, True],
                         ids=["same-pid-namespace", "own-pid-namespace"])
def test_a_rank_whose_forked_child_outlives_it_is_seen_dead_at_once(tmp_path, namespace):
    """Rank 1 forks a child that lives on, then dies; rank 0 must see the death at once.  In
    another PID namespace rank 0 has no pid to look at, only rank 1's liveness lock: a child that
    kept it would keep rank 1 "alive" until the child ends."""
    prefix = _pid_namespace_prefix() if namespace else ()
    r0, r1 = _plain("fork_then_die", tmp_path, prefix1=prefix, timeout=120 + PID1_LINGER)
    assert r0.get("first", {}).get("ok") == 3.0, (r0, r1)
    if namespace:
        assert r0["pid_ns"] != r1.get("pid_ns"), "rank 1 did not run in a PID namespace of its own"
    second = r0["second"]
    assert "died" in second.get("error", ""), r0
    assert second["seconds"] < 2, r0  # not the group timeout (60 s): the liveness lock went with rank 1
    beat = float((tmp_path / "child.alive").read_text())
    assert beat >= r0["second_done_at"], "the forked child was gone before rank 0 saw rank 1's death: nothing was tested"


# --------------------------------------------------------------------------- a stalled hand-over

WATCH = r"""
import datetime, sys, time
import torch.distributed as dist
host, port, key, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
deadline = time.monotonic() + 60
while not store.check([key]) and time.monotonic() < deadline:
    time.sleep(0.002)
open(out + ".tmp", "w").write(store.get(key).decode().split("\t")[1])
import os; os.rename(out + ".tmp", out)
"""

#: standard library only: it may run as another user, who cannot read the job's virtual environment
KNOCK = r"""
import json, os, socket, sys, time
path = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.002)
name = open(path).read()
conns = []
for _ in range(3):  # connect and say nothing
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(b"\0cpuddp-shm-" + name.encode())
    conns.append(c)
open(path + ".knocked", "w").close()  # now rank 1 may ask for the segment
print(json.dumps({"connected": len(conns), "uid": os.geteuid()}), flush=True)
time.sleep(20)
"""


def _python_for(uid: int | None) -> str:
    if uid is None:
        return sys.executable
    from test_shm_faults import _system_python

    return _system_python()


@pytest.mark.parametrize("who", ["same-user", "other-user"])
def test_a_neighbour_that_connects_to_the_hand_over_and_says_nothing_delays_nobody(tmp_path, who):
    from failure_scripts.procs import free_port
    from cpuddp.testing import clean_environ

    uid = None
    if who == "other-user":
        import tempfile

        from test_shm_faults import _intruder_uid

        uid = _intruder_uid()
        tmp_path = Path(tempfile.mkdtemp(prefix="cpuddp-stall-", dir="/tmp"))  # pytest's is private to root
        os.chmod(tmp_path, 0o777)  # the neighbour leaves its mark there
    port = free_port()
    for name, text in (("watch.py", WATCH), ("knock.py", KNOCK)):
        (tmp_path / name).write_text(text)
        os.chmod(tmp_path / name, 0o644)
    name_file = tmp_path / "socket-name"
    watcher = subprocess.Popen([sys.executable, str(tmp_path / "watch.py"), "127.0.0.1", str(port),
                                "default_pg/0//cpu//shm/1/seg/0", str(name_file)], env=clean_environ(os.environ),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    knocker = subprocess.Popen([_python_for(uid), str(tmp_path / "knock.py"), str(name_file)], user=uid, group=uid,
                               env={"PATH": "/usr/bin:/bin"}, cwd="/tmp", stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    procs = []
    for r in range(2):
        e = clean_environ(os.environ)
        e.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        # rank 1 asks for the segment only once the neighbour's three silent connections are in
        code = ("import os, sys, time, json, torch, torch.distributed as dist, cpuddp.shm\n"
                "import cpuddp.backends.shm.protocol.handover as h\n"
                "gate, fetch, t = sys.argv[1] + '.knocked', h._fetch, {}\n"
                "def gated(*a, **k):\n"
                "    while not os.path.exists(gate): time.sleep(0.005)\n"
                "    t['gate'] = time.monotonic()\n"
                "    return fetch(*a, **k)\n"
                "h._fetch = gated\n"
                "dist.init_process_group('shm'); t1 = time.monotonic(); x = torch.ones(3); dist.all_reduce(x)\n"
                "dist.barrier(); print(json.dumps({'after_gate_s': t1 - t.get('gate', t1), 'sum': x[0].item()}))")
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(name_file)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        if r == 0:
            time.sleep(0.5)  # the store is up before the other rank and the staller knock
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in (*procs, watcher, knocker):
            if p.poll() is None:
                p.kill()
                p.wait()
    knocked = knocker.communicate(timeout=10)[0]
    results = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert '"connected": 3' in knocked, (knocked, watcher.communicate(timeout=10)[0])
    assert all(res["sum"] == 2.0 for res in results), outs
    # rank 1 asked after the neighbour's silent connections: served at once, not after them (a
    # staller used to hold init for the whole group timeout, 300 s)
    assert results[1]["after_gate_s"] < 1.0, outs
    if who == "other-user":
        assert "refused a connection to the hand-over socket" in outs[0] and "another user" in outs[0], outs[0]
