"""The node's proof (cpuddp/launchers/proof.py): the ranks of a host check, over a socket only
this user can use, that the store's host records are the ones their peers wrote (issue 35).

The ranks here are threads of one process sharing a HashStore -- the channel is a real abstract
Unix socket between them; tests/test_init_attack.py runs the whole attack against real ranks."""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import threading
import time
from typing import Optional

import pytest

from cpuddp.errors import RendezvousError
from cpuddp.launchers.hosts import HostRecord
from cpuddp.launchers.identity import JobIdentity
from cpuddp.launchers.proof import check_roles, node_roles, prove_node

TD = datetime.timedelta(seconds=20)
HOST, OTHER = "h|boot|net:1", "g|boot2|net:2"


def _records(*hosts: str) -> list[HostRecord]:
    return [HostRecord(r, h, (r,), r, len(hosts)) for r, h in enumerate(hosts)]


def _run(store, wrote: list[HostRecord], read: list[list[HostRecord]], jobs: Optional[list] = None) -> list:
    """Each rank r (a thread) proves with ``wrote[r]`` as its own record and ``read[r]`` as the
    store's (``jobs[r]``: the job identity it states, by default the store's)."""
    out: list = [None] * len(wrote)

    def rank(r: int) -> None:
        try:
            prove_node(store, "p", wrote[r], read[r], len(wrote), TD, identity=jobs[r] if jobs else None)
            out[r] = "ok"
        except Exception as exc:  # noqa: BLE001
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(wrote))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank of the proof hung"
    return out


def test_roles_follow_the_hosts_read():
    assert node_roles(_records(HOST, OTHER, HOST), HOST) == (0, 2)
    lead = "lead " + "a" * 32
    check_roles(2, (0, 2), [lead, "alone", "join 0"])
    check_roles(1, (1,), [lead, "alone", "join 0"])
    with pytest.raises(RendezvousError, match="put rank 2 on this host, but rank 2 published the role 'alone'"):
        check_roles(0, (0, 2), [lead, "alone", "alone"])
    with pytest.raises(RendezvousError, match="put rank 1 on another host, but rank 1 published the role 'join 0'"):
        check_roles(0, (0, 2), [lead, "join 0", "join 0"])
    with pytest.raises(RendezvousError, match="rank 0 on this host, but rank 0 published the role 'lead x'"):
        check_roles(2, (0, 2), ["lead x", "alone", "join 0"])


def test_genuine_records_pass_on_every_rank():
    import torch.distributed as dist

    recs = _records(HOST, HOST, OTHER, HOST)
    assert _run(dist.HashStore(), recs, [recs] * 4) == ["ok"] * 4


def test_a_rank_of_another_job_of_this_user_is_refused_whatever_the_store_says():
    """The store rewritten so job B's rank 1 meets job A's leader (issue 43): the same uid, the
    records the store gave both alike -- each side's own job identity tells them apart."""
    import torch.distributed as dist

    recs = _records(HOST, HOST)
    a, b = JobIdentity("127.0.0.1:29500", "nojobid/w2", 2, "init"), JobIdentity("127.0.0.1:29501", "nojobid/w2", 2, "init")
    out = _run(dist.HashStore(), recs, [recs, recs], jobs=[a, b])
    assert all(isinstance(e, RendezvousError) for e in out), out
    assert "is not a rank of this job (its rendezvous store is 127.0.0.1:29501" in str(out[0]), out[0]
    assert "writes to its rendezvous store at 127.0.0.1:29500" in str(out[0])
    assert "ended the private check" in str(out[1]) or "is not a rank of this job" in str(out[1]), out[1]
    assert _run(dist.HashStore(), recs, [recs, recs], jobs=[a, a]) == ["ok", "ok"]  # one job: as before


def test_a_record_the_store_changed_stops_every_rank_of_the_host_naming_it():
    import torch.distributed as dist

    recs = _records(HOST, HOST, HOST)
    forged = list(recs)
    forged[1] = dataclasses.replace(recs[1], cpus=(0,))  # what a neighbour wrote over rank 1's record
    out = _run(dist.HashStore(), recs, [forged, recs, forged])
    assert all(isinstance(e, RendezvousError) for e in out), out
    assert "the store's host record of rank 1" in str(out[0]) and "is not the one rank 1 wrote" in str(out[0])
    assert "writes to its rendezvous store" in str(out[0]) and "ended the private check" in str(out[1])


def test_a_rank_whose_own_record_was_rewritten_stops_at_once():
    import torch.distributed as dist

    recs = _records(HOST, HOST)
    forged = [recs[0], dataclasses.replace(recs[1], cpus=(0,))]
    with pytest.raises(RendezvousError, match="the store's host record of rank 1 is not the one rank 1 wrote"):
        prove_node(dist.HashStore(), "p", recs[1], forged, 2, TD)


def test_a_stranger_at_the_leaders_socket_is_refused_and_the_proof_still_completes(caplog):
    import pwd

    import torch.distributed as dist

    from test_shm_faults import _intruder_uid, _system_python

    uid = _intruder_uid()
    assert pwd.getpwuid(uid)
    store = dist.HashStore()
    recs = _records(HOST, HOST)
    knocks = []

    def stranger() -> None:  # another user connects to the leader's socket 40 times while it waits
        deadline = time.monotonic() + 20
        while not store.check(["p/0"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        name = store.get("p/0").decode().split(" ", 1)[1]
        code = ("import socket,time\nfor _ in range(40):\n s=socket.socket(socket.AF_UNIX)\n"
                f" s.connect(b'\\0cpuddp-proof-{name}')\n time.sleep(0.01)\n")
        knocks.append(subprocess.run([_system_python(), "-c", code], user=uid, group=uid, env={"PATH": "/usr/bin"},
                                     capture_output=True, text=True, timeout=60))
        store.set("go", "1")

    t = threading.Thread(target=stranger)
    t.start()
    out: list = [None, None]

    def member() -> None:
        store.wait(["go"], TD)
        try:
            prove_node(store, "p", recs[1], recs, 2, TD)
            out[1] = "ok"
        except Exception as exc:  # noqa: BLE001
            out[1] = exc

    m = threading.Thread(target=member)
    m.start()
    with caplog.at_level("WARNING", logger="cpuddp"):
        prove_node(store, "p", recs[0], recs, 2, TD)
    m.join(60)
    t.join(60)
    assert knocks and knocks[0].returncode == 0, knocks
    assert out[1] == "ok", out
    assert f"uid {uid} (another user)" in caplog.text, caplog.text


def test_the_leader_stops_at_once_when_a_member_fails_and_says_why():
    """A member that fails after the roles are published (here: it never connects, and publishes
    its error where init's next exchange reads it) stops the leader at once, with its error,
    not after the timeout."""
    import torch.distributed as dist

    from cpuddp.launchers.hosts import publish_error

    store = dist.HashStore()
    recs = _records(HOST, HOST)
    store.set("p/1", "join 0")  # rank 1 published its role, then failed
    publish_error(store, "b", 1, RuntimeError("rank 1 could not go on"))
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="rank 0: rank 1 failed during init: RuntimeError: rank 1 could not go on"):
        prove_node(store, "p", recs[0], recs, 2, TD, errors="b")
    assert time.monotonic() - start < 5
