"""Minimal install: prepare(shard=...) on 2 ranks under torchrun, a checkpoint saved and resumed.

    python -m torch.distributed.run --nproc-per-node 2 tests/minimal/shard_two_ranks.py full DIR
    python -m torch.distributed.run --nproc-per-node 2 tests/minimal/shard_two_ranks.py optimizer DIR

Run by ``.ci/minimal.sh test`` in a venv with torch and cpuddp only (no numpy): nothing on
this path may use torch's object collectives (``all_gather_object`` and the like need numpy).
Trains a few steps, saves with ``cpuddp.save_checkpoint``, trains on; then a fresh model and
optimizer, prepared the same way, load the checkpoint and train the same steps: the weights
must equal the uninterrupted run's.  Any exception exits non-zero and fails CI.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import cpuddp

SAVED_AT, MORE = 4, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 2))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, first: int, count: int) -> None:
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in cpuddp.unwrap(model).named_parameters()}


def _prepared(shard: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = cpuddp.prepare(model, optimizer, shard=shard)
    info = cpuddp.prepared_info(model)
    assert info is not None and info.shard == shard, info
    return model, optimizer


def main(shard: str, directory: str) -> int:
    env = cpuddp.init_distributed()
    assert env.world_size == 2, env
    model, optimizer = _prepared(shard)
    _steps(model, optimizer, 0, SAVED_AT)
    cpuddp.save_checkpoint(directory, step=SAVED_AT, model=model, optimizer=optimizer)
    _steps(model, optimizer, SAVED_AT, MORE)
    want = _weights(model)
    sharded = cpuddp.prepared_info(model).optimizer_sharded

    model, optimizer = _prepared(shard)
    resumed = cpuddp.load_checkpoint(directory, model=model, optimizer=optimizer)
    assert resumed is not None and resumed.step == SAVED_AT, resumed
    _steps(model, optimizer, SAVED_AT, MORE)
    got = _weights(model)
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name}: the resumed run's weights differ from the uninterrupted run's"
    assert sharded, f"shard={shard!r}: the optimizer state was not sharded"
    if cpuddp.is_main_process():
        print(f"ok: shard={shard!r} on 2 ranks ({cpuddp.get_session().backend}), checkpoint saved at step "
              f"{SAVED_AT} and resumed; weights after {SAVED_AT + MORE} steps equal the uninterrupted run's")
    cpuddp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
