"""A rank waiting for the job's store says so after a few seconds, as rank 0 says whom it waits
for: once, with the address it dials, what it waits for, and the fix -- not silent until the
timeout's error."""

from __future__ import annotations

import datetime
import time

import pytest

from cpuddp.errors import RendezvousError
from cpuddp.launchers import exports, rendezvous
from cpuddp.launchers.env import DistEnv
from failure_scripts.procs import PY, Job, base_env, free_port, leftovers, script


def _waits(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent", [False, True], ids=["rank-0-hosts-it", "torchrun-agent-hosts-it"])
def test_a_rank_waiting_for_the_store_says_where_what_and_the_fix_once(monkeypatch, caplog, agent):
    monkeypatch.setattr(exports, "NOTICE_AFTER", 0.3)
    port = free_port()  # nothing listens there
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, master_port=port,
                  launcher="torchrun" if agent else "env", agent_store=agent)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="cpuddp"), pytest.raises(RendezvousError) as err:
        rendezvous._connect(env, datetime.timedelta(seconds=2))
    assert time.monotonic() - start < 10
    whose = "the launcher's store (its agent hosts it)" if agent else "rank 0's store"
    who = "the launcher's agent" if agent else "rank 0"
    launcher = "torchrun / TorchElastic" if agent else "RANK/WORLD_SIZE (Kubeflow or exported by hand)"
    fix = (f"check that {who} started and that MASTER_ADDR/MASTER_PORT point at it (launcher: {launcher}); "
           "a firewall between nodes also causes this")
    assert _waits(caplog) == [f"cpuddp: rank 1 waiting for {whose} at 127.0.0.1:{port} (nothing there has "
                              f"answered yet), up to 2 s (CPUDDP_TIMEOUT); fix: {fix}"], caplog.text
    assert f"could not reach {whose} at 127.0.0.1:{port}" in str(err.value) and err.value.fix == fix


def test_a_timeout_shorter_than_the_notice_gets_the_error_alone(monkeypatch, caplog):
    monkeypatch.setattr(exports, "NOTICE_AFTER", 5.0)
    env = DistEnv(rank=1, world_size=2, master_port=free_port(), launcher="env")
    with caplog.at_level("WARNING", logger="cpuddp"), pytest.raises(RendezvousError):
        rendezvous._connect(env, datetime.timedelta(seconds=1))
    assert _waits(caplog) == []


@pytest.mark.timeout(120)
def test_rank_1_started_without_rank_0_says_so_after_5_s_and_joins_when_it_comes():
    """Real processes: rank 1 alone says, once, after about 5 s, that it waits for rank 0 (it was
    silent until its 300 s error); rank 0 started after that finds it, and both init."""
    common = base_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      CPUDDP_TIMEOUT="60", IMPORT_TORCH_FIRST="1")
    ranks = [Job([PY, script("init_only.py"), "gloo"], dict(common, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(2)]
    try:
        ranks[1].start()
        ready = float(ranks[1].wait_for(r"READY (\S+)", timeout=60)[0].group(1))
        said = ranks[1].wait_for(r"rank 1 waiting for rank 0's store", timeout=30)
        at = next(ln.t for ln in ranks[1].lines if "waiting for rank 0's store" in ln.text)
        ranks[0].start()
        codes = [j.finish(timeout=60) for j in ranks]
    finally:
        for j in ranks:
            j.__exit__()
    report = "\n".join(f"--- rank {r} ({c}):\n{j.output[-2000:]}" for r, (j, c) in enumerate(zip(ranks, codes)))
    assert codes == [0, 0] and all(f"OK rank {r} of 2" in j.stdout for r, j in enumerate(ranks)), report
    assert 4.5 <= at - ready < 20, (at - ready, report)
    assert len(said) == 1 and len(ranks[1].matching("waiting for")) == 1, report
    line = next(ln.text for ln in ranks[1].lines if "waiting for rank 0's store" in ln.text)
    assert f"at 127.0.0.1:{common['MASTER_PORT']}" in line and "up to 60 s (CPUDDP_TIMEOUT)" in line, line
    assert "fix: check that rank 0 started" in line, line
    assert not leftovers(common["CPUDDP_TEST_TOKEN"]), report
