"""A short deterministic DDP training run that checkpoints with cpuddp.save_state_dict and
resumes from the last checkpoint when torchrun restarts it (tests/test_elastic.py).

Environment: ``CKPT`` (the checkpoint path), ``OUT`` (where rank 0 writes the final weights),
``STEPS`` (default 30), ``EVERY`` (checkpoint every N steps, default 10), ``VICTIM`` / ``DIE_AT``
/ ``MODE`` (``kill``: SIGKILL, ``exit``: ``os._exit(3)``): on torchrun's first attempt only,
rank ``VICTIM`` dies just before step ``DIE_AT`` (``DIE_AT=-1``: nobody dies).

The model holds its step in a buffer, so the checkpoint says where to resume and
``cpuddp.load_state_dict`` gives it to every rank.  Each step's batch depends only on the step
and the rank; SGD without momentum has no optimizer state.  So a run killed and resumed must
end bit-identical to an uninterrupted one.  Prints ``ATTEMPT <n> RANK <r> START <step>`` and,
on rank 0, ``DONE <steps>``; the victim prints ``DYING <rank> <step>``.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import cpuddp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, torch.randn(8, 4, generator=g)


def main() -> None:
    torch.set_num_threads(1)
    env = cpuddp.init_distributed(backend="shm", pin=False)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt, out = os.environ["CKPT"], os.environ["OUT"]
    steps, every = int(os.environ.get("STEPS", "30")), int(os.environ.get("EVERY", "10"))
    victim, die_at = int(os.environ.get("VICTIM", "1")), int(os.environ.get("DIE_AT", "-1"))

    torch.manual_seed(0)
    net = Net()
    if os.path.exists(ckpt):  # only rank 0 needs the file; the other ranks get it broadcast
        cpuddp.load_state_dict(net, ckpt)
    start = int(net.step)
    print(f"ATTEMPT {attempt} RANK {env.rank} START {start}", flush=True)
    model = cpuddp.prepare(net, ipex=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(start, steps):
        if attempt == 0 and step == die_at and env.rank == victim:
            print(f"DYING {env.rank} {step}", flush=True)
            if os.environ.get("MODE", "kill") == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        x, y = batch(step, env.rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        net.step.fill_(step + 1)
        if (step + 1) % every == 0:
            cpuddp.save_state_dict(model, ckpt)
    if env.rank == 0:
        torch.save(cpuddp.unwrap(model).state_dict(), out)
        print(f"DONE {steps}", flush=True)
    cpuddp.shutdown()


if __name__ == "__main__":
    main()
