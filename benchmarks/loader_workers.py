"""DataLoader workers under pinning: ``cpuddp.shard(..., num_workers=W, worker_threads=...)``.

    flock "$(python benchmarks/_heavy_lock.py)" python benchmarks/loader_workers.py  # the measurement
    python benchmarks/loader_workers.py --quick                                      # does it work?

Each rank (``torchrun --standalone``, pinned by ``cpuddp.init_distributed()``) trains a small
MLP with DDP on features its DataLoader computes per sample with numpy (``--work`` float32
matrix products of ``--size`` x ``--size``: a stand-in for decoding or augmentation that uses
BLAS).  Cases, interleaved, ``--repeats`` times each:

* ``workers=0``        -- the rank loads its own data;
* ``inherit``          -- ``num_workers=W``, ``worker_threads=None``: workers as torch starts them
  (the rank's ``OMP_NUM_THREADS``, numpy's BLAS pool as the rank had it; torch itself 1 thread);
* ``1 thread``         -- ``num_workers=W`` with cpuddp's default ``worker_threads=1``.

samples/s is every rank's samples over the timed steps (after ``--warmup``), slowest rank's
clock.  Prints a Markdown table (median, min-max) and writes ``benchmarks/results/loader_workers.json``.
Whether threadpoolctl is importable is recorded: without it cpuddp cannot shrink a BLAS pool
numpy already started.  ``#`` lines are progress.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CASES = (("workers=0", 0, "1"), ("inherit", None, "none"), ("1 thread", None, "1"))


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- one rank


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import Dataset

    import cpuddp

    class Features(Dataset):
        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            x = np.random.default_rng(i).standard_normal((args.size, args.size), dtype=np.float32)
            for _ in range(args.work):
                x = np.tanh(x @ x.T / args.size)
            return torch.from_numpy(x[0].copy()), i % 10

    env = cpuddp.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.size, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = cpuddp.prepare(model, opt, ipex=False)
    threads = None if args.worker_threads == "none" else int(args.worker_threads)
    loader = cpuddp.shard(Features(), batch_size=args.batch, num_workers=args.workers, worker_threads=threads,
                          persistent_workers=args.workers > 0)
    loss_fn = nn.CrossEntropyLoss()
    batches = iter(loader)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if env.rank == 0:
        Path(args.result).write_text(json.dumps({
            "samples_per_s": env.world_size * args.batch * args.steps / float(elapsed),
            "pin_plan": cpuddp.get_session().chosen()["pin_plan"],
        }))
    del batches
    cpuddp.shutdown()


# --------------------------------------------------------------------------- the driver


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run_case(args: argparse.Namespace, ranks: int, workers: int, worker_threads: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               __file__, "--rank-main", "--result", result, "--workers", str(workers),
               "--worker-threads", worker_threads, "--size", str(args.size), "--work", str(args.work),
               "--hidden", str(args.hidden), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CPUDDP_NUM_THREADS")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"case failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(Path(result).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--worker-threads", default="1", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=2, help="num_workers per rank (default 2)")
    p.add_argument("--ranks", default="1,2", help="rank counts to run (default 1,2)")
    p.add_argument("--size", type=int, default=192, help="numpy matrix side per sample (default 192)")
    p.add_argument("--work", type=int, default=2, help="matrix products per sample (default 2)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch (default 32)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 steps, 1 repeat")
    p.add_argument("--out", default=str(RESULTS / "loader_workers.json"))
    args = p.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
    import torch

    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_model": _cpu_model(),
            "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__, "python": platform.python_version(),
            "threadpoolctl": importlib.util.find_spec("threadpoolctl") is not None,
            "options": {k: v for k, v in vars(args).items() if k not in ("rank_main", "result", "worker_threads")}}
    log(f"torch {meta['torch']}, {meta['cpu_model']}, {meta['cpus']} CPUs, threadpoolctl: {meta['threadpoolctl']}")
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for name, workers, threads in CASES:
                w = args.workers if workers is None else workers
                r = run_case(args, ranks, w, threads)
                runs.append({"ranks": ranks, "case": name, "repeat": rep, **r})
                log(f"repeat {rep} ranks {ranks} {name}: {r['samples_per_s']:.1f} samples/s")
    rows = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        base = None
        for name, _, _ in CASES:
            v = [r["samples_per_s"] for r in runs if r["ranks"] == ranks and r["case"] == name]
            med = statistics.median(v)
            base = base or med
            rows.append({"ranks": ranks, "case": name, "median": med, "min": min(v), "max": max(v), "vs_workers0": med / base})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs, "summary": rows}, indent=1))
    print(f"| ranks | case (num_workers={args.workers}) | samples/s median | min-max | vs workers=0 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['case']} | {r['median']:.1f} | {r['min']:.1f}-{r['max']:.1f} | {r['vs_workers0']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
