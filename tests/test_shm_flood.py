"""Another user floods the shm hand-over socket (issue 35, item 5).

The hand-over socket has an abstract name anyone on the host can read (``/proc/net/unix``) and
connect to.  ~150 connections from another uid used to fill its listen backlog of 8: the local
peer's connect failed at once and both ranks stopped with "...in different network
namespaces?".  Now local rank 0 drops a stranger right after ``accept()`` (its uid checked,
``SO_PEERCRED``) faster than it connects, the backlog is the system's largest, and a peer whose
connect meets a full backlog waits its turn: init succeeds, and rank 0 logs the flood with its
uid.  A backlog that stays full until the timeout is an error naming the flood.

Real processes and a real second user (root makes ``cpuddp-intruder``, as tests/test_shm_faults.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

#: standard library only: it runs as another user, who cannot read the job's virtual environment.
#: Waits for the socket's name, then connects without end (non-blocking, as fast as it can),
#: holding its last COUNT connections and saying nothing on any; marks ".flooding" once COUNT are
#: in and it met a full backlog (or 5 s passed: a fast host may drain the backlog as fast as this fills it).
FLOOD = r"""
import collections, json, os, socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 60
while not os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.002)
addr = b"\0cpuddp-shm-" + open(path).read().encode()
held, made, full, refused = collections.deque(), 0, 0, ""
start = time.monotonic()
end = start + 40
while time.monotonic() < end and not os.path.exists(path + ".stop"):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.setblocking(False)
    try:
        c.connect(addr)
        made += 1
        held.append(c)
    except BlockingIOError:
        full += 1
        c.close()
    except OSError as exc:  # the listener is gone: the hand-over is over
        refused = str(exc)
        c.close()
        break
    while len(held) > count:
        held.popleft().close()
    if made >= count and (full or time.monotonic() - start > 5) and not os.path.exists(path + ".flooding"):
        open(path + ".flooding", "w").close()
print(json.dumps({"connected": made, "backlog_full": full, "uid": os.geteuid(), "stopped": refused}), flush=True)
"""

#: rank code: init_distributed(backend="shm"); rank 0 tells the flooder the socket's name (a real
#: one reads /proc/net/unix; the test's must not flood the sockets of other jobs on this host), rank 1
#: asks for the segment only once the flood is on (``late``: only after the group timeout)
RANK = r"""
import json, os, sys, time
import cpuddp, torch, torch.distributed as dist
import cpuddp.backends.shm.protocol.handover as h
path, late, fetch, serve = sys.argv[1], sys.argv[2] == "True", h._fetch, h._create_and_serve
class Telling:
    def __init__(self, store):
        self.store = store
    def set(self, key, value):
        self.store.set(key, value)
        if key.startswith("seg/"):
            open(path + ".tmp", "w").write(value.split("\t")[1])
            os.rename(path + ".tmp", path)
    def __getattr__(self, name):
        return getattr(self.store, name)
def gated(*a, **k):
    deadline = time.monotonic() + 60
    while not os.path.exists(path + ".flooding") and time.monotonic() < deadline:
        time.sleep(0.005)
    if late:
        time.sleep(float(os.environ["CPUDDP_TIMEOUT"]) + 1)
    return fetch(*a, **k)
h._fetch = gated
h._create_and_serve = lambda store, *a, **k: serve(Telling(store), *a, **k)
start = time.monotonic()
cpuddp.init_distributed(backend="shm", pin=False)
x = torch.ones(3)
dist.all_reduce(x)
print(json.dumps({"sum": x[0].item(), "backend": dist.get_backend(), "init_s": time.monotonic() - start}), flush=True)
cpuddp.shutdown()
"""


def _other_user_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="cpuddp-flood-", dir="/tmp"))  # pytest's tmp_path is private to root
    os.chmod(d, 0o777)  # the other user leaves its marks there
    return d


def _run_flooded(late: bool, timeout: int) -> dict:
    """A 2-rank init_distributed(backend="shm") while another user floods the hand-over socket;
    rank 1 asks for the segment once the flood is on (``late``: only after the group timeout)."""
    from failure_scripts.procs import free_port
    from cpuddp.testing import clean_environ
    from test_shm_faults import _intruder_uid, _system_python

    uid = _intruder_uid()
    run = _other_user_dir()
    for name, text in (("flood.py", FLOOD), ("rank.py", RANK)):
        (run / name).write_text(text)
        os.chmod(run / name, 0o644)
    name_file = run / "socket-name"
    port = free_port()
    flooder = subprocess.Popen([_system_python(), str(run / "flood.py"), str(name_file), "150"], user=uid, group=uid,
                               env={"PATH": "/usr/bin:/bin"}, cwd="/tmp", stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    procs = []
    for r in range(2):
        e = clean_environ(os.environ)
        e.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", CPUDDP_TIMEOUT=str(timeout))
        procs.append(subprocess.Popen([sys.executable, str(run / "rank.py"), str(name_file), str(late)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if r == 0:
            time.sleep(0.5)  # the store is up before the other rank connects
    outs = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append("TIMED OUT (killed)\n" + p.communicate()[0])
    finally:
        (run / "socket-name.stop").touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    flood_out = flooder.communicate(timeout=60)[0]
    shutil.rmtree(run, ignore_errors=True)
    flood = json.loads(flood_out.strip().splitlines()[-1])
    assert flood["uid"] == uid and flood["connected"] >= 150, (flood_out, outs)
    return {"outs": outs, "codes": [p.returncode for p in procs], "uid": uid, "flood": flood}


def test_another_users_flood_of_the_hand_over_socket_cannot_stop_init_and_is_logged_with_its_uid():
    res = _run_flooded(late=False, timeout=60)
    outs, uid = res["outs"], res["uid"]
    for r, out in enumerate(outs):
        assert res["codes"][r] == 0, f"rank {r} failed:\n{out[-4000:]}"
        got = json.loads(out.strip().splitlines()[-1])
        assert got["sum"] == 2.0 and got["backend"] == "shm", out
    # rank 0 named the flood: the other user's uid and how many of its connections it refused
    assert "refused a connection to the hand-over socket" in outs[0] and "another user" in outs[0], outs[0]
    assert f"connections from uid {uid}" in outs[0], outs[0]


# --------------------------------------------------------------------------- a backlog that stays full


def test_a_backlog_that_stays_full_is_named_as_busy_not_as_another_network_namespace():
    """A peer whose connect meets a full backlog waits for its turn until the deadline, then says
    the socket is busy (and by whom, where local rank 0 published it) -- never "namespaces?"."""
    from cpuddp.backends.shm.protocol import handover
    from cpuddp.errors import BackendError

    name = os.urandom(16).hex()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(b"\0cpuddp-shm-" + name.encode())
    srv.listen(0)
    fillers = []
    for _ in range(4):  # fill the backlog; nobody accepts
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(b"\0cpuddp-shm-" + name.encode())
        except BlockingIOError:
            c.close()
            break
        fillers.append(c)
    try:
        start = time.monotonic()
        with pytest.raises(BackendError) as err:
            handover._connect(name, time.monotonic() + 1.5, lambda: "2000 connections from uid 999 (x)", "127.0.0.1:1")
        waited = time.monotonic() - start
    finally:
        for c in fillers:
            c.close()
        srv.close()
    text = str(err.value)
    assert "hand-over socket busy" in text and "2000 connections from uid 999" in text, text
    assert "different network namespaces" not in text, text
    assert 1.0 < waited < 10, waited


def test_rank0_names_the_flood_in_its_error_when_the_peer_never_comes():
    """Local rank 0 under a flood from another uid, its peer asking only after the group timeout:
    rank 0's error says the socket was busy, with the uid and the count of refused connections."""
    res = _run_flooded(late=True, timeout=6)
    r0 = res["outs"][0]
    assert res["codes"][0] != 0, r0
    assert "did not ask for the segment within the group timeout" in r0 and "hand-over socket busy" in r0, r0
    assert f"connections from uid {res['uid']}" in r0, r0


@pytest.mark.parametrize("raw, want", [
    (b"999\t150", {999: 150}),
    (b"999\t150\n1000\t3", {999: 150, 1000: 3}),
    (b"", {}),
    (b"\x1b[2Jboom\t1", {}),  # a store value is not trusted: only numbers are shown
    (b"-1\t5\n12\tx\n1\t2\t3", {}),
    (b"9" * 40 + b"\t1", {}),
])
def test_the_published_flood_count_is_checked_before_a_peer_shows_it(raw, want):
    from cpuddp.backends.shm.protocol.offer import busy_text, parse_busy

    assert parse_busy(raw) == want
    if want:
        assert busy_text(want).startswith(f"{max(want.values())} connections from uid")
