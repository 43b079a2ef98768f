"""A process's own job identity and the peer it meets (cpuddp/launchers/identity.py, issue 43)."""

from __future__ import annotations

import socket
import subprocess
import sys

from cpuddp.launchers.identity import JobIdentity, launcher_job, mismatch, peer_process, store_endpoint

A = JobIdentity("127.0.0.1:29500", "TORCHELASTIC_RUN_ID=x/w2", 2, "0/2:abc/1")


def test_an_identity_travels_and_comes_back_whole():
    assert JobIdentity.from_wire(A.wire()) == A
    assert JobIdentity.from_wire(A.wire().encode()) == A


def test_anything_else_on_the_wire_is_no_identity():
    for bad in (b"", b"{}", b"[1]", b"\xff", "x" * 5000, '{"store": 1, "job": "j", "world": 2, "group": "g"}',
                '{"store": "s", "job": "j", "world": 0, "group": "g"}', '{"store": "s", "job": "j", "world": true, "group": "g"}',
                '{"store": "s", "job": "j", "world": 2, "group": "g", "more": 1}', None):
        assert JobIdentity.from_wire(bad) is None, bad


def test_a_peer_of_another_store_job_world_or_group_is_named():
    assert mismatch(A, A) is None
    assert "did not state" in mismatch(A, None)
    assert "its rendezvous store is 127.0.0.1:29501" in mismatch(A, JobIdentity("127.0.0.1:29501", A.job, 2, A.group))
    assert "its job is" in mismatch(A, JobIdentity(A.store, "TORCHELASTIC_RUN_ID=y/w2", 2, A.group))
    assert "its world is '4'" in mismatch(A, JobIdentity(A.store, A.job, 4, A.group))
    assert "its group is" in mismatch(A, JobIdentity(A.store, A.job, 2, "0/2:abc/2"))


def test_one_store_under_two_names_is_one_store():
    assert mismatch(A, JobIdentity("localhost:29500", A.job, 2, A.group)) is None
    assert mismatch(A, JobIdentity("localhost:29501", A.job, 2, A.group)) is not None


def test_the_store_endpoint_is_read_through_prefix_stores():
    import torch.distributed as dist

    from failure_scripts.procs import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    assert store_endpoint(dist.PrefixStore("b", dist.PrefixStore("a", store))) == f"127.0.0.1:{port}"
    assert store_endpoint(dist.HashStore()) == "HashStore"


def test_the_launchers_job_key_is_the_rendezvous_words():
    assert launcher_job({"TORCHELASTIC_RUN_ID": "abc", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                         "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                         "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}).endswith("/w2")
    assert launcher_job({"WORLD_SIZE": "x", "RANK": "0"}) == "unknown"


def test_the_peer_process_is_held_by_what_the_kernel_named():
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(b"\0cpuddp-test-identity-" + str(id(srv)).encode())
    srv.listen(1)
    child = subprocess.Popen([sys.executable, "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX);"
                              f"s.connect({srv.getsockname()!r}); sys.stdin.read()"], stdin=subprocess.PIPE)
    conn, _ = srv.accept()
    proc = peer_process(conn)
    try:
        assert proc.pid == child.pid and proc.alive()
        child.stdin.close()
        child.wait(30)
        assert not proc.alive()
    finally:
        proc.close()
        conn.close()
        srv.close()
        if child.poll() is None:
            child.kill()
