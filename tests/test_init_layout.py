"""init_distributed() on real host layouts, each host a network namespace of our own.

- ``localhost`` resolving to ``::1`` first (the namespace's own hosts file, as on many Debian
  and RHEL hosts): the store listens on IPv6 and the job runs.
- Two ranks on one host launched Kubeflow-style (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` =
  the host's non-loopback address, no local rank): the hosts gathered at init make them local
  ranks 0 and 1 of 2, pinned to disjoint CPUs.
- Two hosts with IPv6 addresses only: the job trains across them.
- A rank that fails during init (an unknown backend) makes the other fail within seconds,
  naming it, instead of waiting out the timeout.

Each namespace is fresh, so port 29500 is free in it.  Needs root and ``ip netns``; skips
with the reason otherwise.  Every run is bounded and its processes killed at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from netns_util import NetnsPair, describe, hosts_file, run_commands, veth_pair

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
PORT = "29500"
RUN_TIMEOUT = 150  # seconds for a run that must succeed (both ranks import torch on 2 cores)

RANK_SCRIPT = r'''
import json, os, sys
outdir = sys.argv[1]
import torch
import torch.distributed as dist
import cpuddp

backend = os.environ.get("TEST_BACKEND", "gloo")
env = cpuddp.init_distributed(backend, timeout=float(os.environ.get("TEST_TIMEOUT", "60")),
                              pin=os.environ.get("TEST_PIN") == "1")
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1000 + env.rank)
for _ in range(3):
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
plan = cpuddp.distributed.get_session().pin_plan
with open(os.path.join(outdir, f"rank{env.rank}.json"), "w") as f:
    json.dump({
        "rank": env.rank, "local_rank": env.local_rank, "local_world_size": env.local_world_size,
        "num_nodes": env.num_nodes, "node_rank": env.node_rank,
        "cpus": list(plan.cpus) if plan else None, "threads": torch.get_num_threads(),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
    }, f)
cpuddp.shutdown()
'''


def _env(rank: int, master: str, **extra: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", CPUDDP_LOG_LEVEL="INFO",
               RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=master, MASTER_PORT=PORT, **extra)
    return env


def _run(tmp_path: Path, namespaces: list[str], envs: list[dict[str, str]], timeout: float = RUN_TIMEOUT):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    outdir = tmp_path / "out"
    outdir.mkdir()
    commands = [["ip", "netns", "exec", ns, sys.executable, str(script), str(outdir)] for ns in namespaces]
    runs = run_commands(commands, envs, tmp_path, timeout)
    results = {}
    for path in outdir.glob("rank*.json"):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    return runs, results


@pytest.fixture
def pair() -> NetnsPair:
    with veth_pair("cpl", ("10.79.0.1", "10.79.0.2")) as p:
        yield p


@pytest.fixture
def pair6() -> NetnsPair:
    with veth_pair("cp6", ("fd79::1", "fd79::2")) as p:
        yield p


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_localhost_resolving_to_ipv6_first(pair: NetnsPair, tmp_path: Path):
    ns = pair.namespaces[0]
    with hosts_file(ns, "::1 localhost ip6-localhost ip6-loopback\n127.0.0.1 localhost\n"):
        runs, results = _run(tmp_path, [ns, ns], [_env(0, "localhost"), _env(1, "localhost")])
    assert [r.returncode for r in runs] == [0, 0], describe(runs)
    assert "cannot listen on ::1" not in runs[0].log
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_two_ranks_on_one_host_kubeflow_style_get_disjoint_cores(pair: NetnsPair, tmp_path: Path):
    ns, addr = pair.namespaces[0], pair.addrs[0]
    envs = [_env(r, addr, TEST_PIN="1") for r in (0, 1)]
    runs, results = _run(tmp_path, [ns, ns], envs)
    assert [r.returncode for r in runs] == [0, 0], describe(runs)
    assert [(d["local_rank"], d["local_world_size"], d["num_nodes"]) for d in (results[0], results[1])] == [
        (0, 2, 1), (1, 2, 1)], describe(runs)
    cpus0, cpus1 = set(results[0]["cpus"]), set(results[1]["cpus"])
    if len(os.sched_getaffinity(0)) >= 2:
        assert cpus0 and cpus1 and not cpus0 & cpus1, (cpus0, cpus1)
        assert results[0]["threads"] == len(cpus0) and results[1]["threads"] == len(cpus1)
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_ipv6_only_hosts(pair6: NetnsPair, tmp_path: Path):
    envs = [_env(r, pair6.addrs[0]) for r in (0, 1)]
    runs, results = _run(tmp_path, list(pair6.namespaces), envs)
    assert [r.returncode for r in runs] == [0, 0], describe(runs)
    assert [(d["node_rank"], d["num_nodes"]) for d in (results[0], results[1])] == [(0, 2), (1, 2)]
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.timeout(90)
def test_a_rank_failing_in_init_stops_the_other_at_once(pair: NetnsPair, tmp_path: Path):
    ns, addr = pair.namespaces[0], pair.addrs[0]
    envs = [_env(0, addr, TEST_TIMEOUT="300"), _env(1, addr, TEST_TIMEOUT="300", TEST_BACKEND="no-such-backend")]
    start = time.monotonic()
    runs, _ = _run(tmp_path, [ns, ns], envs, timeout=60)
    assert time.monotonic() - start < 60, describe(runs)  # not the 300 s timeout
    assert runs[0].returncode not in (0, None) and runs[1].returncode not in (0, None), describe(runs)
    assert "rank 1 failed during init" in runs[0].log and "no-such-backend" in runs[0].log, describe(runs)
