"""Start-up cost: `import cpuddp` vs `import torch`, and init_distributed() vs a bare
init_process_group for 2 gloo ranks, interleaved in one run (medians of --repeats).

    python benchmarks/startup.py --repeats 10 --json benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

WORKER = r"""
import os, sys, time
mode = sys.argv[1]
import torch, torch.distributed as dist
import cpuddp
t0 = time.perf_counter()
if mode == "bare":
    dist.init_process_group("gloo", init_method="env://")
else:
    cpuddp.init_distributed(pin=(mode == "cpuddp"))
t1 = time.perf_counter()
print(f"{t1 - t0:.6f}", flush=True)
if mode == "bare":
    dist.destroy_process_group()
else:
    cpuddp.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_import(stmt: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", stmt], check=True, timeout=120)
    return time.perf_counter() - t0


def time_init(mode: str, world: int = 2) -> float:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, mode], env=env, stdout=subprocess.PIPE, text=True))
    times = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        if p.returncode:
            raise RuntimeError(f"{mode} worker failed with {p.returncode}")
        times.append(float(out.strip().splitlines()[-1]))
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    imports = {"python -c pass": "pass", "import cpuddp": "import cpuddp", "import torch": "import torch"}
    inits = ["bare", "cpuddp-nopin", "cpuddp"]
    samples: dict[str, list[float]] = {k: [] for k in [*imports, *[f"init {m}" for m in inits]]}
    for _ in range(args.repeats):  # interleaved: each repeat measures every case once
        for name, stmt in imports.items():
            samples[name].append(time_import(stmt))
        for m in inits:
            samples[f"init {m}"].append(time_init(m))
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"# {args.repeats} interleaved repeats, medians; torch {__import__('torch').__version__}, {os.cpu_count()} CPUs")
    print(f"{'case':<24}{'median s':>10}{'min s':>10}{'max s':>10}")
    for k, v in samples.items():
        print(f"{k:<24}{med[k]:>10.3f}{min(v):>10.3f}{max(v):>10.3f}")
    print(f"# import cpuddp / import torch = {med['import cpuddp'] / med['import torch']:.2f}")
    print(f"# init cpuddp (pinning) / bare init_process_group = {med['init cpuddp'] / med['init bare']:.2f}")
    print(f"# init cpuddp (pin=False) / bare init_process_group = {med['init cpuddp-nopin'] / med['init bare']:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "samples": samples, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
