"""One rank of a tests/test_shm_lifecycle.py scenario: ``python shm_lifecycle.py MODE OUTDIR``
under any launcher (torchrun, mpiexec) or as a plain env:// rank; writes ``OUTDIR/rank<r>.json``.

Modes:

* ``reinit``: three rounds of ``init_distributed("shm")`` -> collectives -> ``shutdown()`` in the
  same processes; then a gloo group, and ``init_distributed("shm")`` beside it must raise.
* ``after_shutdown``: a kept group handle and a DDP model used after ``shutdown()`` must raise
  the group's "shut down" error.
* ``fork``: a forked child may not use the parent's group, and its normal exit (atexit
  included) must not mark the parent as gone; a DataLoader with fork workers trains.
* ``fork_then_die``: rank 1 forks a child that outlives it (it writes the time to
  ``OUTDIR/child.alive`` every 0.05 s for :data:`CHILD_LIFE` s), then dies; rank 0 must learn of
  the death at once (rank 1 may run in a PID namespace of its own).
"""

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import cpuddp
from cpuddp.errors import BackendError, GroupShutDownError

mode, outdir = sys.argv[1], sys.argv[2]
CHILD_LIFE = 8.0  # seconds the forked child of fork_then_die lives on
report: dict = {}


def done(rank: int, code: int = 0) -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(code)


def step(name: str, fn) -> None:
    start = time.monotonic()
    try:
        report[name] = {"ok": fn()}
    except Exception as exc:  # noqa: BLE001 -- the test reads the message
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}
    report[name]["seconds"] = time.monotonic() - start


def collectives() -> float:
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    b = torch.arange(100) if rank == 0 else torch.zeros(100, dtype=torch.int64)
    dist.broadcast(b, src=0)
    assert b.sum().item() == 4950 and t[0].item() == n * (n + 1) / 2
    return t[0].item()


def reinit() -> int:
    rank = 0
    for i in range(3):
        env = cpuddp.init_distributed("shm", timeout=60)
        rank = env.rank
        assert dist.get_backend() == "shm", dist.get_backend()
        step(f"round{i}", collectives)
        if rank == 0 and i == 1:
            time.sleep(1.0)  # rank 1 re-joins while rank 0's store of this init still answers
        cpuddp.shutdown()
    env = cpuddp.init_distributed("gloo", timeout=60)
    step("gloo", collectives)
    step("shm_beside_gloo", lambda: cpuddp.init_distributed("shm", timeout=60).rank)
    cpuddp.shutdown()
    return rank


def after_shutdown() -> int:
    env = cpuddp.init_distributed("shm", timeout=60)
    group = dist.group.WORLD
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    step("before", collectives)
    cpuddp.shutdown()
    step("handle", lambda: group.allreduce([torch.ones(3)]).wait())
    step("ddp", lambda: model(torch.randn(2, 4)).sum().backward())
    return env.rank


def fork() -> int:
    env = cpuddp.init_distributed("shm", timeout=60)
    pid = os.fork()
    if pid == 0:  # the child: the parent's group is not its own; its exit must not end it
        code = 3
        try:
            dist.all_reduce(torch.ones(2))
        except GroupShutDownError:
            code = 0
        sys.exit(code)  # a normal exit: atexit (cpuddp.shutdown) runs in the child
    _, status = os.waitpid(pid, 0)
    report["child_exit"] = os.waitstatus_to_exitcode(status)
    step("after_child", collectives)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork")

    def train() -> int:
        steps = 0
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            steps += 1
        return steps

    step("dataloader", train)
    step("after_loader", collectives)
    return env.rank


def fork_then_die() -> int:
    env = cpuddp.init_distributed("shm", timeout=60)
    step("first", collectives)
    if env.rank == 1:
        if os.fork() == 0:  # outlives its parent, holding whatever it inherited; says it lives
            beat = os.path.join(outdir, "child.alive")
            end = time.monotonic() + CHILD_LIFE
            while time.monotonic() < end:
                with open(beat + ".tmp", "w") as f:
                    f.write(repr(time.time()))
                os.replace(beat + ".tmp", beat)
                time.sleep(0.05)
            os._exit(0)
        time.sleep(0.5)
        report["pid_ns"] = os.stat("/proc/self/ns/pid").st_ino
        done(1, 9)  # dies without leaving the group
    time.sleep(1.0)
    step("second", collectives)
    report["second_done_at"] = time.time()  # the child's heartbeat must be as late: it lived on
    report["pid_ns"] = os.stat("/proc/self/ns/pid").st_ino
    return env.rank


try:
    rank = {"reinit": reinit, "after_shutdown": after_shutdown, "fork": fork, "fork_then_die": fork_then_die}[mode]()
except Exception:  # noqa: BLE001
    report["crash"] = traceback.format_exc()
    rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
done(rank)
