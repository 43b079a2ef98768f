"""When bf16 pays on this CPU: a training step's time in fp32 and under bf16 autocast, per model.

    python benchmarks/precision.py                 # 1 rank x all cores, and 2 ranks x 1 core each
    python benchmarks/precision.py --quick         # does the script work?

Models (random weights, AdamW, cross-entropy), from small to BERT-sized:

- ``example``: README's example, ``examples/finetune.py``'s PairEncoder (0.29 M parameters),
  batch 32, 40 tokens;
- ``mlp``: a 10.5 M-parameter MLP (1024 -> 2048 -> 2048 -> 2048 -> 10), batch 32;
- ``encoder``: a 2-layer ``nn.TransformerEncoder`` (d 512, 8 heads, FFN 2048; 6.3 M), batch 16,
  128 tokens;
- ``bert``: the BERT-style cross-encoder of ``--size bench`` (``TinyBert``, 11.2 M, vocabulary
  30522), batch 16, 128 tokens.

Each case runs in one process (``1x``: one rank with every usable core as threads) or under
``torch.distributed.run`` (``2x``: two DDP ranks of one thread each, cpuddp's pinning).  Inside,
after 3 warm-up steps of each precision, ``--rounds`` rounds alternate fp32 and bf16 (the order
flips every round), each timing ``--steps`` steps between barriers; a precision's figure is the
median over its rounds, and the ratio (fp32 time / bf16 time: above 1, bf16 is faster) is taken
from the same rounds.  Output: a Markdown table on stdout (CPU named), JSON in
``benchmarks/results/precision.json``.
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
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("example", "mlp", "encoder", "bert")


def build(name: str) -> tuple[Any, Any]:
    """(model, a function returning one batch's loss)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    sys.path.insert(0, str(ROOT / "examples"))
    import finetune  # noqa: E402

    torch.manual_seed(0)
    if name == "example":
        model, _ = finetune.build_model("torch", "small")
        data = finetune.build_dataset(512, 40)
        batch = {k: torch.stack([data[i][k] for i in range(32)]) for k in data[0]}
        return model, lambda m: m(**batch)["loss"]
    if name == "bert":
        model, _ = finetune.build_model("torch", "bench")
        data = finetune.build_dataset(256, 128)
        batch = {k: torch.stack([data[i][k] for i in range(16)]) for k in data[0]}
        return model, lambda m: m(**batch)["loss"]
    if name == "mlp":
        model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                              nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
        x, y = torch.randn(32, 1024), torch.randint(0, 10, (32,))
        return model, lambda m: F.cross_entropy(m(x), y)
    layer = nn.TransformerEncoderLayer(512, 8, 2048, 0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    x, y = torch.randn(16, 128, 512), torch.randint(0, 512, (16,))
    return model, lambda m: F.cross_entropy(m(x).mean(1), y)


def worker(name: str, steps: int, rounds: int, out: str) -> None:
    """One rank: time fp32 and bf16 steps of model ``name``, alternating; rank 0 writes JSON."""
    import torch

    import cpuddp

    env = cpuddp.init_distributed()
    model, loss_of = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trained = cpuddp.prepare(model, opt, ipex=False)  # fp32 weights; autocast is toggled below

    def run(bf16: bool, n: int) -> float:
        cpuddp.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_of(trained)
            loss.float().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        cpuddp.barrier()
        return (time.perf_counter() - t0) / n

    run(False, 3)
    run(True, 3)
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for r in range(rounds):
        for bf16 in ((False, True) if r % 2 == 0 else (True, False)):
            times["bf16" if bf16 else "fp32"].append(run(bf16, steps))
    if env.rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"times": times, "params": nparams, "threads": torch.get_num_threads(),
                                         "world_size": env.world_size, "torch": torch.__version__}))
    cpuddp.shutdown()


def case(name: str, ranks: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"{name}-{ranks}.json")
    me = [str(Path(__file__).resolve()), "--worker", name, "--steps", str(args.steps), "--rounds", str(args.rounds),
          "--out", out]
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(ranks)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(launch + me, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        sys.stderr.write(f"# {name} x{ranks} failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n")
        raise SystemExit(1)
    r = json.loads(Path(out).read_text())
    fp32, bf16 = statistics.median(r["times"]["fp32"]), statistics.median(r["times"]["bf16"])
    ratios = [f / b for f, b in zip(r["times"]["fp32"], r["times"]["bf16"])]
    return {**r, "model": name, "ranks": ranks, "fp32_s": fp32, "bf16_s": bf16, "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    have = [n for f, n in (("avx2", "AVX2"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if f in flags]
    return ", ".join(have) or "no AVX2"


def markdown(rows: list[dict[str, Any]], cpu: str) -> str:
    lines = [f"{cpu} ({cpu_flags()}), {os.cpu_count()} vCPUs, torch {rows[0]['torch'] if rows else '?'}; "
             "step time, median of the rounds; ratio = fp32 time / bf16 time (above 1: bf16 faster), "
             "median (min-max) over the rounds",
             "", "| model | parameters | ranks x threads | fp32 ms/step | bf16 ms/step | bf16 speed vs fp32 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f} M | {r['world_size']} x {r['threads']} | "
                     f"{r['fp32_s'] * 1e3:.1f} | {r['bf16_s'] * 1e3:.1f} | {r['ratio']:.2f}x "
                     f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ranks", default="1,2", help="comma-separated: 1 (one process, all cores), 2 (two DDP ranks)")
    ap.add_argument("--steps", type=int, default=5, help="steps timed per round (default 5)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each precision (default 6)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="1 step, 2 rounds")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.rounds, args.out)
        return 0
    if args.quick:
        args.steps, args.rounds = 1, 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpuddp-precision-") as tmp:
        for name in args.models.split(","):
            for ranks in (int(x) for x in args.ranks.split(",")):
                rows.append(case(name, ranks, args, tmp))
                r = rows[-1]
                print(f"# {name} {r['world_size']}x{r['threads']}: fp32 {r['fp32_s'] * 1e3:.1f} ms, "
                      f"bf16 {r['bf16_s'] * 1e3:.1f} ms, {r['ratio']:.2f}x", file=sys.stderr, flush=True)
    cpu = cpu_name()
    RESULTS.mkdir(exist_ok=True)
    meta = {"cpu": cpu, "flags": cpu_flags(), "vcpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")}}
    (RESULTS / "precision.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(markdown(rows, cpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
