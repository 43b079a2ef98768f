"""The watchdog's verdict as pure functions: a snapshot in, a verdict out; no store, no processes.

The multi-process behaviour (real ranks killed, stopped or raising) is in tests/test_failures.py;
these tables pin each rule of cpuddp.watchdog_verdict on its own.
"""

from __future__ import annotations

import dataclasses

import pytest

from cpuddp.watchdog_store import parse_failed, parse_info, parse_ranks
from cpuddp.watchdog_verdict import (
    HeartbeatClock, PeerInfo, Snapshot, VerdictKind, decide, describe, linger_waiting, local_ranks,
    looks_like_comm_failure, ranks_to_watch, store_gone,
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
    assert parse_ranks("0\n2\tx\nbad\n") == {0, 2}
    assert parse_failed("1\tValueError: a\n0\tKeyError: b\nx\ty\n") == ((1, "ValueError: a"), (0, "KeyError: b"))
    assert parse_info("0\t100\tnode7\tid0\n1\tnope\tn\ti\n2\t5\tshort\n") == {0: PeerInfo(100, "node7", "id0")}


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
