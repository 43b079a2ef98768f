"""Minimal install: 2-rank init under torchrun, prepare, a few steps; the ranks end identical.

    python -m torch.distributed.run --nproc-per-node 2 tests/minimal/train_two_ranks.py

Run by ``.ci/minimal.sh test`` in a venv with torch and cpuddp only (no numpy, no pytest).
Any exception -- an ImportError included -- exits non-zero and fails CI.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import cpuddp


def main() -> int:
    env = cpuddp.init_distributed()
    assert env.world_size == 2 and env.launcher == "torchrun", env
    assert dist.is_initialized() and dist.get_world_size() == 2

    torch.manual_seed(env.rank)  # different on each rank: DDP must broadcast rank 0's weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = cpuddp.prepare(model, optimizer)
    info = cpuddp.prepared_info(model)
    assert info is not None and info.ddp, info

    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)),
                                          torch.arange(64) % 2)
    losses = []
    for x, y in cpuddp.shard(data, batch_size=8, seed=0):  # 4 steps per rank, different shards
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(cpuddp.reduce_mean(loss.item()))

    # Gradients were averaged: both ranks hold the same weights after different batches.
    flat = torch.cat([p.detach().flatten() for p in cpuddp.unwrap(model).parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1]), "the ranks' weights differ after DDP steps"
    if cpuddp.is_main_process():
        print(f"ok: 2 ranks ({cpuddp.get_session().backend}), {len(losses)} DDP steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"weights identical on both ranks")
    cpuddp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
