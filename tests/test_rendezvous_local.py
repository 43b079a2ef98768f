"""A single-node job exposes nothing outside loopback (issue 8.4).

Two network namespaces joined by a veth pair (10.78.0.1/24 in A, 10.78.0.2/24 in B; both
created and always deleted by the fixture).  A 2-rank job runs in A, started by hand as one
node (``LOCAL_WORLD_SIZE=2``, no ``MASTER_ADDR``).  Once its group is up the test lists every
listening TCP socket in A (``ss -ltn``: the job is all that runs there) and each rank's own
(psutil), asserts they are all bound to 127.0.0.1, and connects to each port at 10.78.0.1
from B: every attempt must fail.  A control listener on 0.0.0.0 in A must be reachable from B,
so the failures mean something.

Needs root and a working ``ip netns``; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from failure_scripts.procs import PY, Job, base_env, leftovers, script
from netns_util import IP_TIMEOUT, veth_pair

pytestmark = [pytest.mark.netns]

ADDRS = ("10.78.0.1", "10.78.0.2")
PORT = 29500  # a fresh namespace: nothing else listens there
CONTROL_PORT = 29999
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.fixture
def two_namespaces():
    with veth_pair("cpd8", ADDRS, tools=("ip", "ss")) as pair:
        yield list(pair.namespaces), pair.interfaces


def _listening(ns: str) -> list[tuple[str, int]]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltn"], capture_output=True, text=True,
                         timeout=IP_TIMEOUT, check=True).stdout
    socks = []
    for line in out.splitlines():
        local = line.split()[3]  # State Recv-Q Send-Q Local:Port Peer:Port
        host, _, port = local.rpartition(":")
        socks.append((host.strip("[]").split("%")[0], int(port)))
    return socks


PROBE = r'''
import json, socket, sys
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
out = {}
for p in ports:
    try:
        socket.create_connection((host, p), timeout=2).close()
        out[p] = "connected"
    except OSError as exc:
        out[p] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''


def _probe(ns: str, host: str, ports: list[int]) -> dict[int, str]:
    out = subprocess.run(["ip", "netns", "exec", ns, PY, "-c", PROBE, host, *map(str, ports)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return {int(k): v for k, v in json.loads(out).items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend, user_ifname", [("gloo", False), ("gloo", True), ("auto", False)],
                         ids=["gloo-as-cpuddp-sets-it", "gloo-user-GLOO_SOCKET_IFNAME-veth", "shm"])
def test_single_node_job_listens_on_loopback_only(two_namespaces, tmp_path, backend, user_ifname):
    """``gloo-user-GLOO_SOCKET_IFNAME-veth`` is the control for the method: a user who points gloo
    at the veth keeps that choice, and the probe must then reach gloo's ports (not the store).
    On shared memory (auto's choice on one node) nothing but the store listens at all."""
    (ns_a, ns_b), (if_a, _) = two_namespaces
    extra = {"GLOO_SOCKET_IFNAME": if_a} if user_ifname else {}
    extra["HOLD_BACKEND"] = backend
    common = base_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(PORT), CPUDDP_TIMEOUT="30",
                      LISTEN_DIR=str(tmp_path), RELEASE_FILE=str(tmp_path / "release"), **extra)
    ranks = [Job(["ip", "netns", "exec", ns_a, PY, script("hold_group.py")],
                 dict(common, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    control = Job(["ip", "netns", "exec", ns_a, PY, "-c",
                   "import socket,time; s=socket.create_server(('0.0.0.0', %d)); print('UP', flush=True); "
                   "time.sleep(120)" % CONTROL_PORT], dict(common))
    try:
        for j in ranks:
            j.start()
        for j in ranks:
            j.wait_for(r"JOINED \{", timeout=120)
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"listen{r}.json").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        per_rank = [json.loads((tmp_path / f"listen{r}.json").read_text()) for r in range(2)]
        in_ns = _listening(ns_a)  # before the control listener: the job's sockets only
        control.start()
        control.wait_for(r"UP", timeout=60)
        ports = sorted({p for _, p in in_ns} | {p for r in per_rank for _, p in r["listening"]})
        reached = _probe(ns_b, ADDRS[0], ports + [CONTROL_PORT])
        joined = [json.loads(j.matching(r"JOINED (\{.*\})")[0].group(1)) for j in ranks]
        (tmp_path / "release").write_text("go")
        codes = [j.finish(timeout=60) for j in ranks]
    finally:
        for j in ranks + [control]:
            j.__exit__()
    report = (f"ss in {ns_a}: {in_ns}\nper rank: {per_rank}\nprobes from {ns_b}: {reached}\n"
              + "\n".join(f"--- rank {i} ({c}):\n{j.output[-2000:]}" for i, (j, c) in enumerate(zip(ranks, codes))))
    assert codes == [0, 0], report
    assert not leftovers(common["CPUDDP_TEST_TOKEN"]), report
    assert reached[CONTROL_PORT] == "connected", "the probe cannot reach namespace A at all:\n" + report
    assert PORT in {p for _, p in in_ns}, report  # the rendezvous store is among them
    if backend == "auto":  # shared memory: no gloo group, so no listener but the store
        assert {p for _, p in in_ns} == {PORT} and not any(r["listening"] for r in per_rank[1:]), report
    else:
        assert len(in_ns) >= 3, report  # the store, and each rank's gloo listener
    if user_ifname:
        gloo = [(h, p) for h, p in in_ns if p != PORT]
        assert gloo and all(h == ADDRS[0] and reached[p] == "connected" for h, p in gloo), report
        assert ("127.0.0.1", PORT) in in_ns and reached[PORT] != "connected", report
        assert all(j["gloo_socket_ifname"] == if_a for j in joined), report
        return
    for host, port in in_ns + [tuple(s) for r in per_rank for s in r["listening"]]:
        assert host in LOOPBACK, f"{host}:{port} listens beyond loopback\n{report}"
    for port in ports:
        assert reached[port] != "connected", f"port {port} is reachable from another namespace\n{report}"
    for j in joined:
        assert j["master_addr"] == "127.0.0.1", report
        # set by cpuddp.backends for a single-node job; gloo otherwise binds the hostname's address
        assert j["gloo_socket_ifname"] == "lo", report
