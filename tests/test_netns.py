"""Two hosts simulated with network namespaces: gloo across a veth pair.

Each rank runs in its own network namespace (``ip netns``), joined by a veth pair
(10.77.0.1/24 and 10.77.0.2/24).  The hostname still resolves to 127.0.0.1, as on many
real clusters, and GLOO_SOCKET_IFNAME is not set: bare torch then makes gloo advertise
127.0.0.1 to the other host and ``init_process_group`` fails or hangs (pytorch issue 15592);
cpuddp picks the interface that routes to MASTER_ADDR and both ranks train.

Needs root and a working ``ip netns``; skips with the reason otherwise.  The fixture creates
uniquely named namespaces and always deletes them; every subprocess has a timeout and is
killed (by process group) when it overruns.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from netns_util import NetnsPair, describe as _describe, run_commands as _run_pair, veth_pair

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
ADDRS = ("10.77.0.1", "10.77.0.2")
PORT = 29500  # fresh namespaces: nothing else listens there
PASS_TIMEOUT = 150  # seconds for a run that must succeed (both ranks import torch on 2 cores)
FAIL_INIT_TIMEOUT = 8  # seconds: torch's own init timeout in the runs expected to fail
FAIL_TIMEOUT = 30  # seconds before a run expected to fail is killed

RANK_SCRIPT = r'''
import datetime, json, os, sys
mode, outdir = sys.argv[1], sys.argv[2]
timeout = float(os.environ["TEST_INIT_TIMEOUT"])
import torch
import torch.distributed as dist

if mode == "bare":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
else:
    import cpuddp
    # pin=False: the two simulated hosts share this machine's cores (pinning has its own tests)
    env = cpuddp.init_distributed(timeout=timeout, pin=False)

rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
for _ in range(5):
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
result = {
    "rank": rank,
    "world_size": dist.get_world_size(),
    "backend": str(dist.get_backend()),
    "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    "params": [p.detach().flatten().tolist() for p in model.parameters()],
}
with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
if mode == "bare":
    dist.destroy_process_group()
else:
    cpuddp.shutdown()
'''


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    """Two network namespaces joined by a veth pair; always deleted afterwards."""
    with veth_pair("cpd", ADDRS) as pair:
        yield pair


def _base_env(init_timeout: float) -> dict[str, str]:
    """A clean environment: no launcher variables, no GLOO_SOCKET_IFNAME from the caller."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        CPUDDP_LOG_LEVEL="INFO",
        TEST_INIT_TIMEOUT=str(init_timeout),
    )
    return env


def _commands(style: str, pair: NetnsPair, script: Path, mode: str, outdir: Path, init_timeout: float):
    commands, envs = [], []
    for rank, ns in enumerate(pair.namespaces):
        env = _base_env(init_timeout)
        if style == "kubeflow":
            env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=pair.addrs[0], MASTER_PORT=str(PORT))
            cmd = [sys.executable, str(script), mode, str(outdir)]
        else:
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                "--master-addr", pair.addrs[0], "--master-port", str(PORT), "--max-restarts", "0",
                str(script), mode, str(outdir),
            ]
        commands.append(["ip", "netns", "exec", ns, *cmd])
        envs.append(env)
    return commands, envs


def _results(outdir: Path) -> dict[int, dict]:
    out = {}
    for path in outdir.glob("rank*.json"):
        data = json.loads(path.read_text())
        out[data["rank"]] = data
    return out


@pytest.mark.timeout(PASS_TIMEOUT + 60)
@pytest.mark.parametrize("style", ["kubeflow", "torchrun"])
def test_cpuddp_trains_across_namespaces(netns_pair: NetnsPair, tmp_path: Path, style: str):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    outdir = tmp_path / "out"
    outdir.mkdir()
    commands, envs = _commands(style, netns_pair, script, "cpuddp", outdir, init_timeout=60)
    runs = _run_pair(commands, envs, tmp_path, PASS_TIMEOUT)
    assert [r.returncode for r in runs] == [0, 0], _describe(runs)
    results = _results(outdir)
    assert sorted(results) == [0, 1], _describe(runs)
    for rank, data in results.items():
        assert data["world_size"] == 2
        assert data["backend"] == "gloo"
        # cpuddp chose the veth (the interface that routes to MASTER_ADDR), not loopback
        assert data["gloo_socket_ifname"] == netns_pair.interfaces[rank], _describe(runs)
    assert results[0]["params"] == results[1]["params"], "DDP ranks ended with different parameters"


@pytest.mark.timeout(FAIL_TIMEOUT + 60)
@pytest.mark.parametrize("style", ["kubeflow", "torchrun"])
def test_bare_torch_fails_across_namespaces(netns_pair: NetnsPair, tmp_path: Path, style: str):
    """Plain init_process_group("gloo") cannot form the group: gloo advertises 127.0.0.1."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    outdir = tmp_path / "out"
    outdir.mkdir()
    commands, envs = _commands(style, netns_pair, script, "bare", outdir, init_timeout=FAIL_INIT_TIMEOUT)
    start = time.monotonic()
    runs = _run_pair(commands, envs, tmp_path, FAIL_TIMEOUT)
    elapsed = time.monotonic() - start
    assert elapsed < FAIL_TIMEOUT + 30  # bounded, whatever torch did
    results = _results(outdir)
    print(f"bare torch, {style}: " + "; ".join(
        f"host {i}: {'killed' if r.returncode is None else f'exit {r.returncode}'} after {r.seconds:.1f} s"
        for i, r in enumerate(runs)))
    succeeded = [r.returncode == 0 for r in runs]
    assert not (all(succeeded) and len(results) == 2), (
        "bare torch trained across the namespaces: the loopback-hostname trap is absent here\n" + _describe(runs)
    )
    assert any(r.returncode != 0 for r in runs)  # failed or killed after the timeout
