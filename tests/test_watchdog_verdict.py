"""The watchdog's verdict as pure functions: a snapshot in, a verdict out; no store, no processes.

The multi-process behaviour (real ranks killed, stopped or raising) is in tests/test_failures.py;
these tables pin each rule of cpuddp.watchdog.verdict on its own.
"""

from __future__ import annotations

import dataclasses

import pytest

from cpuddp.errors import RendezvousError
from cpuddp.topology.here import host_identity, machine_of
from cpuddp.watchdog.store import parse_counter, parse_failed, parse_info, parse_ranks
from cpuddp.watchdog.verdict import (
    HeartbeatClock,
    PeerInfo,
    Snapshot,
    VerdictKind,
    decide,
    describe,
    linger_waiting,
    local_ranks,
    looks_like_comm_failure,
    ranks_to_watch,
    store_gone,
    why_silent,
)

HERE, THERE = "node7|boot1|net1|pid1", "node9|boot2|net2|pid2"
INFO = {0: PeerInfo(100, "node7", HERE), 1: PeerInfo(101, "node7", HERE), 2: PeerInfo(200, "node9", THERE)}


def snap(rank: int = 0, world: int = 3, **kw) -> Snapshot:
    kw.setdefault("info", INFO)
    return Snapshot(rank=rank, world=world, identity=HERE, **kw)


def test_nothing_known_and_not_a_comm_failure_is_no_verdict():
    s = snap()
    assert ranks_to_watch(s, comm_failure=False) == []
    assert decide(s, comm_failure=False) is None


def test_another_ranks_exception_is_blamed_at_once_without_watching():
    s = snap(failed=((1, "ValueError: bad batch 7"),))
    assert ranks_to_watch(s, comm_failure=True) == []
    v = decide(s, comm_failure=True)
    assert v.kind is VerdictKind.RAISED and v.ranks == (1,)
    assert v.message == "cpuddp: [rank0] lost rank(s) [1]: rank 1 (pid 101 on node7) raised ValueError: bad batch 7"


def test_the_first_failure_is_blamed_and_this_ranks_own_is_not():
    s = snap(failed=((2, "KeyError: 'x'"), (1, "RuntimeError: Connection closed by peer")))
    assert decide(s, True).ranks == (2,)
    own = snap(failed=((0, "ValueError: mine"),))
    assert ranks_to_watch(own, True) == [1, 2]  # nobody else known to have failed: watch them
    assert decide(own, False) is None


def test_a_local_peer_whose_pid_is_gone_died():
    v = decide(snap(exited=frozenset({1})), comm_failure=False)
    assert v.kind is VerdictKind.LOST and v.ranks == (1,)
    assert v.message == ("cpuddp: [rank0] lost rank(s) [1]: rank 1 (pid 101 on node7) died without a Python "
                         "exception (killed, a crash, or os._exit)")


def test_a_pid_on_another_host_says_nothing():
    # rank 2's pid lives in another PID namespace: "gone" here means nothing
    assert decide(snap(exited=frozenset({2})), comm_failure=False) is None


def test_death_takes_precedence_over_an_exception():
    v = decide(snap(exited=frozenset({1}), failed=((2, "ValueError: x"),)), comm_failure=True)
    assert v.kind is VerdictKind.LOST and v.ranks == (1,)


@pytest.mark.parametrize(
    "rank, silent, why",
    [
        (1, 0, "alive but not responding: stopped, or stuck holding the GIL"),  # rank 0 on this host
        (0, 2, "its host is down or unreachable, or it is stuck"),  # rank 2 elsewhere
    ],
)
def test_a_heartbeat_that_did_not_move_is_a_silent_rank(rank, silent, why):
    s = snap(rank=rank)
    others = [r for r in range(3) if r != rank]
    assert ranks_to_watch(s, comm_failure=True) == others
    beats = {r: (5, 5 if r == silent else 6) for r in others}
    v = decide(dataclasses.replace(s, heartbeats=beats, watched=3.4), comm_failure=True)
    assert v.kind is VerdictKind.LOST and v.ranks == (silent,)
    who = f"rank {silent} (pid {INFO[silent].pid} on {INFO[silent].host})"
    assert v.message == f"cpuddp: [rank{rank}] lost rank(s) [{silent}]: no heartbeat from {who} for 3 s ({why})"


def test_heartbeats_that_moved_are_no_verdict_and_unknown_pids_are_plain_ranks():
    moving = snap(heartbeats={1: (1, 2), 2: (7, 9)}, watched=0.5)
    assert decide(moving, comm_failure=True) is None
    v = decide(snap(info={}, heartbeats={1: (1, 2), 2: (0, 0)}, watched=3.0), comm_failure=True)
    assert v.message.endswith("no heartbeat from rank 2 for 3 s (its host is down or unreachable, or it is stuck)")


def test_heartbeats_are_not_read_when_the_failure_is_not_a_communication_failure():
    assert decide(snap(heartbeats={1: (0, 0), 2: (0, 0)}, watched=3.0), comm_failure=False) is None


def test_ranks_that_left_while_expected_in_a_collective():
    s = snap(done=frozenset({1, 2}))
    assert ranks_to_watch(s, True) == []  # nobody left in play
    v = decide(s, comm_failure=True)
    assert v.kind is VerdictKind.LEFT and v.ranks == (1, 2)
    assert v.message.startswith("cpuddp: [rank0] rank(s) [1, 2] already left the group (shutdown or exit)")
    assert decide(s, comm_failure=False) is None


def test_store_gone():
    known = {0: PeerInfo(4241, "node7", HERE)}
    v = store_gone(1, False, "10.0.0.7:29500: Connection refused", known)
    assert v.kind is VerdictKind.STORE_GONE
    assert v.message == ("cpuddp: [rank1] lost rank 0 (pid 4241 on node7), which hosts the rendezvous store "
                         "(at 10.0.0.7:29500: Connection refused); see rank 0's log")
    assert "lost rank 0, which hosts" in store_gone(1, False, "x", {}).message
    assert store_gone(0, False, "x", known) is None  # rank 0 hosts it: its own log says why
    assert "torchrun's agent at h:1" in store_gone(0, True, "h:1", known).message


def test_local_ranks_and_linger_waiting():
    assert local_ranks(INFO, HERE, 0) == [1]
    assert linger_waiting(4, done=[0, 1], failed=[2], exited=[]) == [3]
    assert linger_waiting(3, done=[0], failed=[], exited=[1, 2]) == []


def test_heartbeat_clock():
    clock = HeartbeatClock()
    clock.observe({1: 4, 2: 9}, now=10.0)
    clock.observe({1: 5, 2: 9}, now=12.0)
    assert not clock.all_silent([1, 2], now=13.5, stale=3.0)  # rank 1 moved 1.5 s ago
    assert clock.all_silent([2], now=13.5, stale=3.0)
    assert clock.all_silent([1, 2], now=15.0, stale=3.0)


def test_key_protocol_parsers():
    assert parse_ranks("0\n2\n", "k", 3) == {0, 2}
    assert parse_failed("1\tValueError: a\n0\tKeyError: b\n", "k", 3) == ((1, "ValueError: a"), (0, "KeyError: b"))
    assert parse_failed("1\tValueError: \x1b[31mred\n", "k", 2) == ((1, "ValueError:  [31mred"),)  # no escapes
    assert parse_info("0\t100\tnode7\tid0\n1\t101\tnode7\tid0\n", "k", 2) == {
        0: PeerInfo(100, "node7", "id0"), 1: PeerInfo(101, "node7", "id0")}
    assert parse_info("0\t100\tn\ti\n0\t100\tn\ti\n", "k", 1) == {0: PeerInfo(100, "n", "i")}  # a restart
    assert parse_ranks("", "k", 2) == set() and parse_info("", "k", 2) == {}


# Everything a rank of the job would never write is an error naming the key (tests/test_store_validation.py
# holds the tables for the other store keys).
@pytest.mark.parametrize("parser, text, what", [
    (parse_ranks, "bad\n", "its rank 'bad' is not a whole number"),
    (parse_ranks, "3\n", "its rank 3 is outside 0..2"),
    (parse_ranks, "-1\n", "is not a whole number"),
    (parse_failed, "x\ty\n", "its rank 'x' is not a whole number"),
    (parse_failed, "1\n", "not rank<TAB>description"),
    (parse_failed, "1\t" + "x" * 1001 + "\n", "not rank<TAB>description"),
    (parse_failed, "7\tValueError: a\n", "its rank 7 is outside 0..2"),
    (parse_info, "0\t100\tnode7\n", "a line of 3 tab-separated fields, not 4"),
    (parse_info, "1\tnope\tn\ti\n", "its pid 'nope' is not a whole number"),
    (parse_info, "1\t0\tn\ti\n", "its pid 0 is outside 1..4194303"),
    (parse_info, "1\t99999999\tn\ti\n", "its pid 99999999 is outside"),
    (parse_info, "5\t10\tn\ti\n", "its rank 5 is outside 0..2"),
    (parse_info, "1\t10\t\ti\n", "its hostname is not printable text"),
    (parse_info, "1\t10\tn\t" + "i" * 5000 + "\n", "its host identity is not printable text"),
    (parse_info, "1\t10\tn\ti\n1\t11\tn\ti\n", "rank 1 announced twice"),
])
def test_key_protocol_parsers_refuse_what_no_rank_writes(parser, text, what):
    with pytest.raises(RendezvousError) as info:
        parser(text, "cpuddp/watchdog/0/key", 3)
    msg = str(info.value)
    assert msg.startswith("store key cpuddp/watchdog/0/key holds ") and what in msg, msg
    assert "docs/security.md" in info.value.fix


@pytest.mark.parametrize("raw, expected", [(b"12", 12), (b"", 0), (7, 7)])
def test_heartbeat_counter(raw, expected):
    assert parse_counter("hb/1", raw) == expected


@pytest.mark.parametrize("raw, what", [(b"abc", "is not a whole number"), (b"-3", "is not a whole number"),
                                       (b"1" * 40, "more than the 32 allowed"), (b"\xff", "not UTF-8")])
def test_heartbeat_counter_refuses(raw, what):
    with pytest.raises(RendezvousError, match=what):
        parse_counter("cpuddp/watchdog/0/hb/1", raw)


# A peer on this machine in another PID namespace (a container with --ipc=host --network=host)
# whose heartbeat stopped: the machine is up (this rank runs on it), only its pid is out of sight.
CONTAINER = "node7|boot1|net1|pid9"  # same boot id and netns as HERE, another PID namespace
OTHER_UTS = "box3|boot1|net5|pid8"  # a container with its own hostname and network, same kernel


@pytest.mark.parametrize("identity, why", [
    (HERE, "alive but not responding: stopped, or stuck holding the GIL"),
    (CONTAINER, "it runs on this machine in another PID or network namespace (a container), where its pid "
                "cannot be checked: it died, or it is stuck"),
    (OTHER_UTS, "it runs on this machine in another PID or network namespace"),
    (THERE, "its host is down or unreachable, or it is stuck"),
    ("node7||net1|pid9", "its host is down or unreachable"),  # no boot id here, another there: not known same
])
def test_why_silent(identity, why):
    assert why_silent(HERE, PeerInfo(5, "node7", identity)).startswith(why)


def test_a_silent_peer_in_another_pid_namespace_is_not_a_lost_host():
    info = {0: PeerInfo(100, "node7", HERE), 1: PeerInfo(7, "node7", CONTAINER)}
    s = Snapshot(rank=0, world=2, identity=HERE, info=info)
    assert local_ranks(info, HERE, 0) == []  # its pid means nothing here: never checked
    assert ranks_to_watch(s, comm_failure=True) == [1]
    v = decide(dataclasses.replace(s, heartbeats={1: (4, 4)}, watched=3.2), comm_failure=True)
    assert v.kind is VerdictKind.LOST and v.ranks == (1,)
    assert "host is down" not in v.message
    assert v.message.endswith("no heartbeat from rank 1 (pid 7 on node7) for 3 s (it runs on this machine in another "
                              "PID or network namespace (a container), where its pid cannot be checked: it died, "
                              "or it is stuck)")
    # a "gone" pid of that peer is never taken as its death (the pid is another namespace's)
    assert decide(dataclasses.replace(s, exited=frozenset({1})), comm_failure=False) is None


def test_machine_of():
    assert machine_of("node7|boot1|net1|pid1") == machine_of("other|boot1|net2|pid2") == "boot:boot1"
    assert machine_of("node7||net1") == "host:node7" and machine_of("node7") == "host:node7"


@pytest.mark.parametrize(
    "exc, comm",
    [
        (RuntimeError("Connection closed by peer [127.0.0.1]:41234"), True),
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error"), True),
        (ConnectionResetError("reset"), True),
        (TimeoutError(), True),
        (RuntimeError("shm allreduce: rank(s) [1] (pid [7]) on this node died while rank 0 waited"), True),
        (ValueError("bad batch 7"), False),
        (KeyError("loss"), False),
    ],
)
def test_looks_like_comm_failure(exc, comm):
    assert looks_like_comm_failure(type(exc), exc) is comm


def test_describe_is_one_short_line():
    assert describe(ValueError, ValueError("bad\tbatch\nsecond line")) == "ValueError: bad batch"
    assert describe(KeyboardInterrupt, None) == "KeyboardInterrupt"
    assert len(describe(ValueError, ValueError("x" * 500))) == 200


def test_host_identity_has_a_field_per_part():
    fields = host_identity(("net", "pid")).split("|")
    assert len(fields) == 4 and fields[0]
    assert machine_of(host_identity()) == machine_of(host_identity(("net", "pid")))
