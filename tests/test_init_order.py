"""init_distributed()'s order and teardown: pin compute before the group forms, leave the
backend's threads on the process's CPUs, undo everything at shutdown, refuse a dying group."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch.distributed as dist

import cpuddp
from cpuddp import distributed
from cpuddp.errors import RendezvousError
from cpuddp.topology import parse_cpulist


def _thread_cpus() -> dict[int, frozenset[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        out[int(tid)] = parse_cpulist(line.split(":", 1)[1].strip())
        except OSError:
            pass
    return out


def _affinities() -> dict:
    plan = distributed.get_session().pin_plan
    threads = _thread_cpus()
    main = threads.pop(threading.get_native_id())
    return {"plan": sorted(plan.cpus), "main": sorted(main),
            "others": sorted(sorted(c) for c in threads.values()), "allowed": sorted(os.sched_getaffinity(0))}


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell compute from communication")
def test_compute_pinned_and_communication_threads_left_on_the_process_cpus(run_distributed):
    out = run_distributed(_affinities, 2, pin=True, timeout=90)
    for rank, r in enumerate(out):
        assert r["main"] == r["plan"] == r["allowed"], r  # compute: the rank's own cores
        # gloo's threads (and the store's, the watchdog's) started while init held this
        # thread on every CPU the process had, and nothing re-pinned them
        assert any(len(c) > len(r["plan"]) for c in r["others"]), r
    assert not set(out[0]["plan"]) & set(out[1]["plan"])


def test_shutdown_restores_what_init_exported(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    environ = {"UNRELATED": "1", "RANK": "0", "WORLD_SIZE": "1"}
    cpuddp.init_distributed(environ=environ, pin=True)
    try:
        assert environ["LOCAL_RANK"] == "0" and os.environ["KMP_BLOCKTIME"] == "1"
    finally:
        cpuddp.shutdown()
    assert environ == {"UNRELATED": "1", "RANK": "0", "WORLD_SIZE": "1"}
    assert "KMP_BLOCKTIME" not in os.environ and "OMP_NUM_THREADS" not in os.environ
    cpuddp.init_distributed(environ=environ, pin=False)  # and a second init starts clean
    cpuddp.shutdown()


def test_a_group_whose_teardown_hung_is_refused_not_adopted(monkeypatch):
    cpuddp.init_distributed(environ={}, pin=False)
    real = dist.destroy_process_group
    release = threading.Event()

    def hung_destroy(*a, **k):
        release.wait(30)
        real(*a, **k)

    monkeypatch.setattr(dist, "destroy_process_group", hung_destroy)
    try:
        cpuddp.shutdown(timeout=0.2)
        assert cpuddp.get_env() is None and dist.is_initialized()
        with pytest.raises(RendezvousError, match="could not be torn down"):
            cpuddp.init_distributed(environ={}, pin=False)
    finally:
        release.set()
        deadline = time.monotonic() + 10
        while dist.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.05)
    env = cpuddp.init_distributed(environ={}, pin=False)  # the old group is gone: a new one forms
    assert env.world_size == 1 and distributed._state.abandoned is None
    cpuddp.shutdown()
