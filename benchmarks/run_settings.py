"""``cpuddp run``'s runtime settings, each with and without: which deserve to be on by default.

    python benchmarks/run_settings.py --repeats 5            # the measurement (docs/performance.md)
    python benchmarks/run_settings.py --repeats 1 --quick    # a smoke run

Settings (``cpuddp run`` options), each against ``baseline`` (``--allocator none --omp off``):

- ``jemalloc``: ``--allocator jemalloc`` (``LD_PRELOAD`` of Debian's libjemalloc2, IPEX's ``MALLOC_CONF``);
- ``tcmalloc``: ``--allocator tcmalloc`` (libtcmalloc-minimal4);
- ``omp``: ``--omp on`` (GNU OpenMP: ``OMP_PROC_BIND=close``, ``OMP_PLACES=cores``; Intel
  OpenMP: ``KMP_AFFINITY``, ``KMP_BLOCKTIME=1``).

Workloads, both started by ``cpuddp run --ranks-per-node 2`` (each rank pinned to its core):

- ``finetune``: README's example, ``examples/finetune.py --steps S --eval-samples 0 --precision fp32`` (its
  samples/s, warm-up steps left out);
- ``mlp``: a 10.5 M-parameter MLP (1024 -> 2048 -> 2048 -> 2048 -> 10, ReLU), batch 64 per
  rank, AdamW, DDP; samples/s over ``--mlp-steps`` timed steps after 5 warm-up steps.

Runs are interleaved (every setting once per round, ``--repeats`` rounds) so drift on a
shared machine hits all alike; reported: the median samples/s, min and max, and the ratio of
medians to ``baseline``.  JSON goes to ``--out`` (default ``benchmarks/results/run_settings.json``).
Each run is bounded by ``--timeout`` seconds; a failed run exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "baseline": ["--allocator", "none", "--omp", "off"],
    "jemalloc": ["--allocator", "jemalloc", "--omp", "off"],
    "tcmalloc": ["--allocator", "tcmalloc", "--omp", "off"],
    "omp": ["--allocator", "none", "--omp", "on"],
}


def mlp_rank(out: str, steps: int) -> None:
    """One rank of the ``mlp`` workload (started by ``cpuddp run``)."""
    import time

    import torch

    import cpuddp

    env = cpuddp.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ddp = cpuddp.prepare(model, opt)
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    cpuddp.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    cpuddp.barrier()
    took = time.perf_counter() - t0
    if env.rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"samples_per_s": env.world_size * 64 * steps / took, "params": nparams}))
    cpuddp.shutdown()


def one_run(setting: str, workload: str, args: argparse.Namespace, tmp: Path) -> float:
    result = tmp / f"{setting}-{workload}.json"
    result.unlink(missing_ok=True)
    if workload == "finetune":
        script = [str(REPO / "examples" / "finetune.py"), "--steps", str(args.steps), "--eval-samples", "0", "--precision", "fp32",
                  "--log-every", str(args.steps), "--result-json", str(result)]
    else:
        script = [str(Path(__file__).resolve()), "--mlp-rank", str(result), "--mlp-steps", str(args.mlp_steps)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "KMP_", "LD_PRELOAD", "MALLOC_CONF"))}
    cmd = [sys.executable, "-m", "cpuddp", "run", "--ranks-per-node", "2", *SETTINGS[setting], *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=REPO)
    if proc.returncode != 0 or not result.exists():
        sys.stderr.write(f"# {setting} {workload} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n")
        raise SystemExit(1)
    return float(json.loads(result.read_text())["samples_per_s"])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120, help="finetune steps (default 120)")
    ap.add_argument("--mlp-steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 20 finetune steps, 5 MLP steps")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "run_settings.json"))
    ap.add_argument("--mlp-rank", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mlp_rank:
        mlp_rank(args.mlp_rank, args.mlp_steps)
        return 0
    if args.quick:
        args.steps, args.mlp_steps = 20, 5
    runs: dict[str, dict[str, list[float]]] = {w: {s: [] for s in SETTINGS} for w in ("finetune", "mlp")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for setting in SETTINGS:
                for workload in runs:
                    v = one_run(setting, workload, args, Path(tmp))
                    runs[workload][setting].append(v)
                    print(f"# round {r + 1} {workload:8s} {setting:9s} {v:9.1f} samples/s", flush=True)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = f"{cpu_name()}, {os.cpu_count()} CPUs, " + ("AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2")
    print(f"# CPU: {cpu}; 2 ranks (cpuddp run --ranks-per-node 2); medians of {args.repeats} interleaved runs")
    print(f"{'workload':9s} {'setting':9s} {'median':>9s} {'min':>9s} {'max':>9s} {'vs baseline':>11s}")
    table = {}
    for workload, by in runs.items():
        base = statistics.median(by["baseline"])
        for setting, vals in by.items():
            med = statistics.median(vals)
            table.setdefault(workload, {})[setting] = {"median": med, "min": min(vals), "max": max(vals),
                                                        "ratio": med / base, "runs": vals}
            print(f"{workload:9s} {setting:9s} {med:9.1f} {min(vals):9.1f} {max(vals):9.1f} {med / base:10.3f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu, "repeats": args.repeats, "finetune_steps": args.steps,
                                          "mlp_steps": args.mlp_steps, "results": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
