"""cpuddp.launchers.hosts: the records ranks exchange at init, the layout they imply, and the exchange
itself (on a real in-process store), plus what the pinning plan makes of the gathered CPUs."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from cpuddp.affinity import pin as affinity
from cpuddp.launchers import hosts
from cpuddp.backends.agreement import agree_backend
from cpuddp.launchers.env import DistEnv
from cpuddp.errors import BackendError, RendezvousError
from cpuddp.topology import synthetic_topology

TD = datetime.timedelta(seconds=5)


def _rec(rank: int, host: str, cpus: tuple[int, ...]) -> hosts.HostRecord:
    return hosts.HostRecord(rank, host, cpus)


def test_record_round_trips_through_json():
    rec = hosts.HostRecord(3, "node|boot|42", (0, 2, 4), 1, 2)
    assert hosts.HostRecord.from_json(rec.to_json()) == rec
    assert rec.hostname == "node"


def test_layout_round_robin_placement_on_two_hosts():
    recs = [_rec(0, "a", (0,)), _rec(1, "b", (0,)), _rec(2, "a", (1,)), _rec(3, "b", (1,))]
    lay = hosts.layout(recs, 3)
    assert (lay.local_rank, lay.local_world_size, lay.node_rank, lay.num_nodes) == (1, 2, 1, 2)
    assert lay.nodes == ((0, 2), (1, 3))
    assert lay.local_cpus == (frozenset({0}), frozenset({1}))


def test_pairwise_disjoint():
    assert hosts.pairwise_disjoint([frozenset({0}), frozenset({1, 2})])
    assert not hosts.pairwise_disjoint([frozenset({0, 1}), frozenset({1})])
    assert not hosts.pairwise_disjoint([frozenset(), frozenset({1})])


def test_exchange_returns_every_value_in_rank_order():
    store = dist.HashStore()
    results = {}

    def rank(r: int) -> None:
        results[r] = hosts.exchange(store, "x", r, 3, f"v{r}", TD)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {r: ["v0", "v1", "v2"] for r in range(3)}


def test_exchange_names_missing_ranks_after_the_timeout():
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank\(s\) \[1, 2\] of 3 never reached the host exchange"):
        hosts.exchange(store, "x", 0, 3, "v", datetime.timedelta(seconds=0.5), what="host")
    assert time.monotonic() - start < 5


def test_a_rank_waiting_for_late_peers_says_whom_where_and_for_how_long(monkeypatch, caplog):
    """Issue 46: a rank whose peers do not come says so within seconds -- once -- not after the
    whole timeout; a peer that comes late still completes the exchange (a real TCP store)."""
    import socket

    monkeypatch.setattr(hosts, "NOTICE_AFTER", 0.3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    late = threading.Timer(1.0, lambda: dist.TCPStore("127.0.0.1", port, 2, False).set(hosts._key("x", 1), "v1"))
    late.start()
    try:
        with caplog.at_level("WARNING", logger="cpuddp"):
            assert hosts.exchange(store, "x", 0, 2, "v0", datetime.timedelta(seconds=20), what="host") == ["v0", "v1"]
    finally:
        late.cancel()
    said = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert said == [f"cpuddp: rank 0 waiting for rank(s) [1] at 127.0.0.1:{port} (the host exchange), up to 20 s "
                    "(CPUDDP_TIMEOUT)"], said


def test_exchange_raises_at_once_on_a_peer_error():
    store = dist.HashStore()
    hosts.publish_error(store, "x", 1, ValueError("bad thing\nFix: do this"))
    with pytest.raises(RendezvousError, match=r"rank 1 failed during init: ValueError: Fix: do this"):
        hosts.exchange(store, "x", 0, 2, "v", TD)


def test_plan_stays_inside_disjoint_launcher_sets():
    topo = synthetic_topology(1, 8, 1, allowed=[4, 5, 6, 7])
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="env")
    plan = affinity.plan_for(env, environ={}, topology=topo,
                             local_cpus=[frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})])
    assert plan.cpus == (4, 5, 6, 7) and plan.num_threads == 4
    assert "disjoint" in plan.reason
    # the same ranks sharing one set split it
    shared = synthetic_topology(1, 8, 1)
    plan = affinity.plan_for(env, environ={}, topology=shared, local_cpus=[frozenset(range(8))] * 2)
    assert plan.cpus == (4, 5, 6, 7)


def test_ranks_whose_auto_choices_differ_stop_naming_each_choice_never_gloo():
    """A store value is never a reason to change backend: a rank that read another's choice as
    gloo (a neighbour can write it: issue 35) stops, naming both choices."""
    from cpuddp.backends.types import BackendChoice

    store = dist.HashStore()
    store.set("b/1", "gloo")  # rank 1 chose gloo
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(BackendError, match=r"rank 0: the ranks' backend choices differ: rank 0: shm, rank 1: gloo; "
                       r"1 rank\(s\) differ from this rank's 'shm'") as err:
        agree_backend(BackendChoice("shm", "auto: test", None, "auto"), "auto", env, hosts.sharing(store, 0, 2, TD), "b")
    assert "writes to its rendezvous store" in err.value.fix and "backend='gloo'" in err.value.fix
    store.set("c/1", "gloo")
    with pytest.raises(BackendError, match=r"choices differ \(backend='shm' on this rank\): rank 0: shm, rank 1: gloo"):
        agree_backend(BackendChoice("shm", "by name", None, "shm"), "shm", env, hosts.sharing(store, 0, 2, TD), "c")
