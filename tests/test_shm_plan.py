"""cpuddp.backends.shm.protocol.node.plan_node: which ranks share a node, as a pure function of every rank's
``whoami`` record (host identity, allowed CPUs, pid, PID namespace).  The real groups are in
tests/test_shm.py."""

from __future__ import annotations

import pytest

from cpuddp.backends.shm.protocol.node import check_local_size, parse_who, plan_node
from cpuddp.errors import BackendError
from cpuddp.launchers.hosts import HostRecord


def who(*rows: tuple) -> list[HostRecord]:
    """Each row ``(host, pid, pid_ns, cpus)`` as its rank publishes it, read back as the group reads it."""
    published = [HostRecord(r, host, tuple(cpus), None, None, pid, ns).to_json() for r, (host, pid, ns, cpus) in
                 enumerate(rows)]
    return [parse_who(raw.encode(), f"who/{r}", r, len(rows)) for r, raw in enumerate(published)]


def test_two_ranks_on_one_host_share_memory():
    w = who(("A", 100, "ns1", [0]), ("A", 101, "ns1", [1]))
    p = plan_node(w, 1)
    assert (p.local, p.local_rank, p.local_size, p.node, p.nodes) == ((0, 1), 1, 2, 0, 1)
    assert p.peer_pids == {0: 100} and p.spin and p.whole_gloo is None


def test_two_by_two_nodes():
    w = who(("A", 1, "n", [0]), ("B", 2, "m", [0]), ("A", 3, "n", [1]), ("B", 4, "m", [1]))
    p = plan_node(w, 3)
    assert (p.local, p.local_rank, p.node, p.nodes) == ((1, 3), 1, 1, 2)
    assert p.grid == ((0, 2), (1, 3))  # grid[node][local rank]: the cross groups are its columns
    assert p.peer_pids == {1: 2} and p.whole_gloo is None


@pytest.mark.parametrize(
    "rows, reason",
    [
        ((("A", 1, "n", [0]),), None),  # a world of one: every collective is local
        ((("A", 1, "n", [0]), ("B", 2, "n", [0])), "gloo for every collective: one rank per node"),
        ((("A", 1, "n", [0]), ("A", 2, "n", [1]), ("B", 3, "n", [0])),
         "gloo for every collective: nodes run different numbers of ranks (2, 1)"),
    ],
)
def test_whole_gloo(rows, reason):
    assert plan_node(who(*rows), 0).whole_gloo == reason


def test_fewer_local_ranks_than_the_launcher_said_is_refused():
    """A store that hides a local peer would send the node's traffic through gloo's sockets."""
    p = plan_node(who(("A", 1, "n", [0]), ("B", 2, "n", [1])), 0)  # rank 1 claims another host
    with pytest.raises(BackendError, match="the launcher says 2 ranks run on this node, but the rendezvous store "
                                           "shows 1"):
        check_local_size(p, 2, 0)
    check_local_size(p, 1, 0)
    check_local_size(p, None, 0)  # the launcher said nothing
    check_local_size(plan_node(who(("A", 1, "n", [0]), ("A", 2, "n", [1])), 0), 1, 0)  # more local peers: proved at hand-over


def test_no_spin_when_ranks_outnumber_their_cpus_and_no_pids_across_pid_namespaces():
    p = plan_node(who(("A", 1, "ns1", [0]), ("A", 2, "ns2", [0])), 0)
    assert not p.spin  # two ranks, one allowed CPU between them
    assert p.peer_pids == {}  # another PID namespace: its pid means nothing here
    assert not plan_node(who(("A", 1, "n", []), ("A", 2, "n", [])), 0).spin  # CPUs unknown


@pytest.mark.parametrize("raw, what", [
    (b"A\t1\tn\t0", "not JSON"),  # not a host record
    (HostRecord(1, "A", (0,)).to_json().encode(), "missing ['pid', 'pid_ns']"),  # an init record: no process
    (HostRecord(1, "A", (0,), None, None, 1 << 22, "n").to_json().encode(), "its pid 4194304 is outside"),
])
def test_a_malformed_record_is_the_shm_set_ups_error_naming_its_key(raw, what):
    with pytest.raises(BackendError, match="store key who/1 holds") as caught:
        parse_who(raw, "who/1", 1, 2)
    assert what in str(caught.value) and "docs/security.md" in str(caught.value)


def test_pid_alive_counts_a_zombie_as_dead():
    """The one pid check the shm wait loop and the watchdog share (cpuddp.topology.here.pid_alive)."""
    import os
    import subprocess
    import sys
    import time

    from cpuddp.topology.here import pid_alive

    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while pid_alive(child.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.05)
    assert not pid_alive(child.pid)
    assert child.poll() == 0  # reaped now
    assert not pid_alive(child.pid)
