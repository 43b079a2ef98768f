"""HSDP on two simulated hosts: shard="full" shards within each host and replicates across them.

Two network namespaces joined by a veth pair (tests/netns_util.py), each a "node" running 2 ranks
under ``torchrun --nnodes 2 --nproc-per-node 2`` (oversubscribed: 4 ranks on this machine's
cores, ``pin=False``).  ``prepare(shard="full")`` must build the 2 x 2 mesh from the layout
cpuddp found (node, local rank) and train exactly as one process on all four ranks' batches
(fp32, relative loss difference <= 1e-5); every rank of a node holds a different half of each
parameter, and the two nodes hold the same halves.

Needs root and a working ``ip netns``; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from netns_util import NetnsPair, describe, run_commands, veth_pair

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
ADDRS = ("10.79.0.1", "10.79.0.2")
PORT = 29500
TIMEOUT = 300  # 4 ranks importing torch on 2 cores, oversubscribed
STEPS = 20

RANK_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
from torch import nn
import cpuddp

outdir, steps = sys.argv[1], int(sys.argv[2])
cpuddp.init_distributed(backend=os.environ["TEST_BACKEND"], pin=False, timeout=120)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
m = cpuddp.prepare(model, opt, shard="full", shard_blocks=[nn.Linear])
losses = []
for step in range(steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
    loss = nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(cpuddp.reduce_mean(loss.detach()).item())
local = {n: p.to_local().flatten().tolist() for n, p in model.named_parameters()}
with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "notes": list(cpuddp.prepared_info(m).notes), "losses": losses,
               "local": local, "placements": str(next(model.parameters()).placements)}, f)
cpuddp.shutdown()
'''


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    with veth_pair("cps", ADDRS) as pair:
        yield pair


def _env(backend: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TEST_BACKEND=backend)
    return env


def _reference(steps: int) -> list[float]:
    """One process on all four ranks' batches: what HSDP must reproduce."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        xs, ys = [], []
        for r in range(4):
            g = torch.Generator().manual_seed(1000 * step + r)
            xs.append(torch.randn(8, 16, generator=g))
            ys.append(torch.randn(8, 3, generator=g))
        per_rank = [nn.functional.mse_loss(model(x), y) for x, y in zip(xs, ys)]
        torch.stack(per_rank).mean().backward()
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(per_rank).mean().item())
    return losses


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_hsdp_across_two_namespace_hosts(netns_pair: NetnsPair, tmp_path: Path, backend: str):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    outdir = tmp_path / "out"
    outdir.mkdir()
    commands, envs = [], []
    for node, ns in enumerate(netns_pair.namespaces):
        commands.append(["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                         "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                         "--master-addr", netns_pair.addrs[0], "--master-port", str(PORT), "--max-restarts", "0",
                         str(script), str(outdir), str(STEPS)])
        envs.append(_env(backend))
    runs = run_commands(commands, envs, tmp_path, TIMEOUT)
    assert [r.returncode for r in runs] == [0, 0], describe(runs)
    results = {}
    for path in outdir.glob("rank*.json"):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    assert sorted(results) == [0, 1, 2, 3], describe(runs)
    assert any("HSDP 2 replicas x 2 shards" in n for n in results[0]["notes"]), results[0]["notes"]
    reference = _reference(STEPS)
    for rank, data in results.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(data["losses"], reference))
        assert worst <= 1e-5, f"rank {rank}: HSDP's loss differs from one process by {worst:.2e}"
    # ranks 0, 1 on node 0 and 2, 3 on node 1: the same local rank holds the same half on both nodes
    for name in results[0]["local"]:
        assert results[0]["local"][name] == results[2]["local"][name], f"{name}: replicas differ"
        assert results[1]["local"][name] == results[3]["local"][name], f"{name}: replicas differ"
        assert results[0]["local"][name] != results[1]["local"][name], f"{name}: not sharded within the node"
