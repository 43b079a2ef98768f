"""Sharded data parallel on CPU: DDP vs torch's ZeRO and FSDP2 vs ``prepare(shard=...)``, same run.

    flock "$(python benchmarks/_heavy_lock.py)" python benchmarks/shard.py           # the table of docs/performance.md
    flock "$(python benchmarks/_heavy_lock.py)" python benchmarks/shard.py --memory  # the peak-RSS case (>1 GiB of state)
    python benchmarks/shard.py --quick                                               # does the script work?

Cases (each ``--nproc`` local ranks x 1 thread, default pinning, AdamW, the same data):

* ``ddp-gloo``: ``prepare(model, opt)`` on ``backend="gloo"``;
* ``ddp``: ``prepare(model, opt)`` on cpuddp's backend (``--backend``, default ``auto``: shm on one node);
* ``torch-zero``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW,
  parameters_as_bucket_view=True)``, as torch ships it, on cpuddp's backend;
* ``torch-fsdp2``: ``fully_shard`` on every Linear / encoder layer, then the root, torch's
  defaults (bf16: ``MixedPrecisionPolicy(param_dtype=bfloat16)``), on cpuddp's backend;
* ``torch-fsdp2-gloo``: the same on ``backend="gloo"`` (what the shm engine buys FSDP2);
* ``shard-optimizer``, ``shard-full``: ``prepare(model, opt, shard=...)`` on cpuddp's backend.

Models: ``mlp`` (10.5 M parameters, 1024-2048-2048-2048-10, batch 32 per rank) and ``encoder``
(a 4-layer transformer encoder, d 256, 4 heads, FFN 1024, vocabulary 30522, sequence 128,
batch 8 per rank, 11.0 M parameters); ``fp32`` and ``bf16`` (``mixed_precision="bf16"`` /
autocast).  ``--memory`` runs ``big`` instead (an MLP 1024-2048x65-10, 270 M parameters: 4.0 GiB
of parameters, gradients and Adam state in fp32) for the peak RSS.

Per run, rank 0 reports: samples/s (every rank's samples over ``--steps`` timed steps),
``optimizer.step()`` ms (its hooks included: shard="optimizer"'s all-gather, ZeRO's
broadcasts), the optimizer state bytes and the peak RSS of each rank, and a profile of two
more steps split into compute, optimizer, collectives (the calls and their waits), copies
(copy/cat/split kernels: FSDP2's flat buffers) and the rest.  Runs are interleaved (the case
order reverses every repeat) ``--repeats`` times; the summary is the median.  Output:
``benchmarks/results/shard.json`` (``shard_memory.json``), a Markdown table on stdout and, when
matplotlib is installed, ``shard.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("ddp-gloo", "ddp", "torch-zero", "torch-fsdp2-gloo", "torch-fsdp2", "shard-optimizer", "shard-full")
BATCH = {"mlp": 32, "encoder": 8, "big": 32}


# --------------------------------------------------------------------------- inside a rank


def build_model(name: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name in ("mlp", "big"):
        width, hidden = (2048, 3) if name == "mlp" else (2048, 65)
        layers: list[nn.Module] = [nn.Linear(1024, width), nn.ReLU()]
        for _ in range(hidden - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))
    return Encoder()


def _encoder_class() -> Any:
    import torch
    from torch import nn

    class Encoder(nn.Module):
        """Embedding, 4 post-norm encoder layers, mean pooling, a 2-way classifier."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(30522, 256)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, activation=torch.nn.functional.gelu,
                                           batch_first=True) for _ in range(4))
            self.head = nn.Linear(256, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return self.head(h.mean(dim=1))

    return Encoder


def Encoder() -> Any:  # noqa: N802 - a factory named like the class it builds
    return _encoder_class()()


def batches(name: str, rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    b = BATCH[name]
    if name == "encoder":
        return [(torch.randint(0, 30522, (b, 128), generator=g), torch.randint(0, 2, (b,), generator=g))
                for _ in range(4)]
    return [(torch.randn(b, 1024, generator=g), torch.randint(0, 10, (b,), generator=g)) for _ in range(4)]


def setup(case: str, model: Any, bf16: bool) -> tuple[Any, Any, Any]:
    """(module to call, optimizer, autocast context factory) for one case."""
    import contextlib

    import torch
    from torch import nn

    import cpuddp

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if case in ("ddp-gloo", "ddp", "shard-optimizer", "shard-full"):
        shard = {"shard-optimizer": "optimizer", "shard-full": "full"}.get(case)
        m = cpuddp.prepare(model, opt, shard=shard, mixed_precision="bf16" if bf16 else None)
        return m, opt, contextlib.nullcontext  # prepare's own autocast
    if case == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        m = DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, fused=True,
                                      parameters_as_bucket_view=True)
        return m, opt, autocast
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for sub in model.modules():
        if isinstance(sub, (nn.TransformerEncoderLayer, nn.Linear)) and sub is not model:
            if not any(isinstance(p, nn.TransformerEncoderLayer) for p in _parents(model, sub)):
                fully_shard(sub, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt, autocast


def _parents(root: Any, target: Any) -> list:
    """The modules on the path from ``root`` down to ``target`` (exclusive)."""
    for name, m in root.named_modules():
        if m is target:
            parts = name.split(".")
            return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return []


def state_bytes(opt: Any) -> int:
    import torch

    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local optimizer there
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                v = v.to_local() if hasattr(v, "to_local") else v
                total += v.numel() * v.element_size()
    return total


CATEGORIES = (
    ("collectives", ("c10d::", "gloo:", "cpuddp::shard::", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce",
                     "broadcast", "barrier", "wait", "shm")),
    ("copies", ("aten::copy_", "aten::cat", "split_with_sizes", "chunk_cat", "all_gather_copy", "aten::_to_copy",
                "aten::clone", "aten::contiguous")),
    ("optimizer", ("adam", "Optimizer.", "_foreach")),
)


def classify(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return category
    if name.startswith("aten::"):
        return "compute"
    return "rest"


def profile_steps(step: Any, steps: int) -> dict[str, float]:
    """ms per step by category: the main thread's operator self times, and the wall time not in them
    ("rest": Python, waits no operator records)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            with record_function("bench::step"):
                step(i)
        wall = time.perf_counter() - t0
    events = prof.events()
    main = next(e.thread for e in events if e.name == "bench::step")  # the profiler's own thread numbering
    out = {"compute": 0.0, "optimizer": 0.0, "collectives": 0.0, "copies": 0.0}
    for evt in events:
        if evt.thread != main or evt.name == "bench::step":
            continue
        cat = "collectives" if evt.name.startswith("FSDP::") and "copy" not in evt.name else classify(evt.name)
        if cat in out:
            out[cat] += evt.self_cpu_time_total / 1e3  # us -> ms
    out = {k: v / steps for k, v in out.items()}
    out["rest"] = max(0.0, 1e3 * wall / steps - sum(out.values()))
    return out


def rank_main(a: argparse.Namespace) -> None:
    import resource

    from cpuddp._procs import rank_setup

    rank_setup()  # die with the driver; answer its request for a stack if this rank hangs

    import torch
    import torch.distributed as dist

    import cpuddp
    from cpuddp.train.sharding.shard import running_allocator

    cpuddp.init_distributed(backend="gloo" if a.case.endswith("-gloo") else a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(a.model)
    params = sum(p.numel() for p in model.parameters())
    m, opt, autocast = setup(a.case, model, a.precision == "bf16")
    data = batches(a.model, rank)
    opt_seconds = [0.0]

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        with autocast():
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        t = time.perf_counter()
        opt.step()
        opt_seconds[0] += time.perf_counter() - t
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    opt_seconds[0] = 0.0
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(i)
    dist.barrier()
    seconds = time.perf_counter() - t0
    mine = {"opt_ms": 1e3 * opt_seconds[0] / a.steps, "state_bytes": state_bytes(opt),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    breakdown = profile_steps(step, a.profile_steps) if a.profile_steps else {}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(a.result).write_text(json.dumps({
            "backend": str(dist.get_backend()), "samples_per_s": world * BATCH[a.model] * a.steps / seconds,
            "opt_ms": max(r["opt_ms"] for r in every), "state_bytes": max(r["state_bytes"] for r in every),
            "rss_mb": max(r["rss_mb"] for r in every), "loss": float(loss.detach()), "breakdown_ms": breakdown,
            "params": params,
            "threads": torch.get_num_threads(), "allocator": running_allocator()}))
    cpuddp.shutdown()


# --------------------------------------------------------------------------- the driver


def run_case(case: str, model: str, precision: str, opts: argparse.Namespace) -> dict[str, Any]:
    from _ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        cmd = [sys.executable, __file__, "--rank-main", "--case", case, "--model", model, "--precision", precision,
               "--backend", opts.backend, "--result", result, "--steps", str(opts.steps[model]),
               "--warmup", str(opts.warmup), "--profile-steps", str(opts.profile_steps)]
        # CPUDDP_PRECISION_TRIAL=0: prepare's bf16 is bf16 from the first step, as torch's autocast is in
        # the other cases (the trial would time fp32 steps inside the timed window)
        extra = {"OMP_NUM_THREADS": "1", "CPUDDP_PRECISION_TRIAL": "0",
                 **({"LD_PRELOAD": opts.allocator} if opts.allocator else {})}
        codes = run_ranks(cmd, opts.nproc, opts.timeout, extra=extra)
        if any(codes):
            raise SystemExit(f"{case} {model} {precision} failed: exit codes {codes}")
        return json.loads(Path(result).read_text())


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in runs) for k in ("samples_per_s", "opt_ms", "state_bytes", "rss_mb")}
    sps = [r["samples_per_s"] for r in runs]
    keys = runs[0]["breakdown_ms"].keys()
    med["breakdown_ms"] = {k: statistics.median(r["breakdown_ms"][k] for r in runs) for k in keys}
    return {**med, "min": min(sps), "max": max(sps), "backend": runs[0]["backend"], "params": runs[0]["params"]}


def table(summary: dict[str, dict[str, Any]], cases: Sequence[str]) -> list[str]:
    """Markdown rows: one per (model, precision, case); ratios against ``ddp`` of the same run."""
    lines = ["| model | precision | case | backend | samples/s (min-max) | vs DDP on cpuddp | optimizer.step ms | "
             "optimizer state / rank | peak RSS / rank | compute / optimizer / collectives / copies / rest, ms per step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, by_case in summary.items():
        model, precision = key.split("/")
        ref = by_case.get("ddp")
        for case in cases:
            s = by_case.get(case)
            if s is None:
                continue
            ratio = f"{s['samples_per_s'] / ref['samples_per_s']:.2f}x" if ref else "-"
            state = f"{s['state_bytes'] / 2**20:.0f} MiB" + (f" ({s['state_bytes'] / ref['state_bytes']:.2f}x)" if ref else "")
            rss = f"{s['rss_mb']:.0f} MB" + (f" ({s['rss_mb'] / ref['rss_mb']:.2f}x)" if ref else "")
            b = s["breakdown_ms"]
            parts = " / ".join(f"{b[k]:.1f}" for k in ("compute", "optimizer", "collectives", "copies", "rest")) if b else "-"
            lines.append(f"| {model} | {precision} | {case} | {s['backend']} | {s['samples_per_s']:.1f} "
                         f"({s['min']:.1f}-{s['max']:.1f}) | {ratio} | {s['opt_ms']:.1f} | {state} | {rss} | {parts} |")
    return lines


def plot(summary: dict[str, dict[str, Any]], cases: Sequence[str], path: Path, cpu: str) -> Optional[str]:
    """A bar chart of samples/s relative to DDP on cpuddp; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    keys = list(summary)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4))
    width = 0.8 / len(cases)
    for i, case in enumerate(cases):
        vals = [summary[k][case]["samples_per_s"] / summary[k]["ddp"]["samples_per_s"]
                if case in summary[k] and "ddp" in summary[k] else 0 for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=case)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys)
    ax.set_ylabel("samples/s relative to DDP on cpuddp")
    ax.set_title(f"2 ranks x 1 thread, AdamW; {cpu}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--models", default="mlp,encoder")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--memory", action="store_true", help="the peak-RSS case: the 270 M-parameter MLP, fp32")
    ap.add_argument("--backend", default="auto", help="cpuddp's backend for every case but the -gloo ones")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--allocator", default="", help="a malloc library to LD_PRELOAD in every rank (tcmalloc, "
                    "jemalloc: a path); default: glibc's malloc")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: mlp 30, encoder 8, big 4)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    for hidden in ("--rank-main", "--case", "--model", "--precision", "--result"):
        ap.add_argument(hidden, action="store_true" if hidden == "--rank-main" else None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.rank_main:
        opts.steps = int(opts.steps)
        rank_main(opts)
        return 0
    return drive(opts)


def drive(opts: argparse.Namespace) -> int:
    cases = opts.cases.split(",")
    models = ["big"] if opts.memory else opts.models.split(",")
    precisions = ["fp32"] if opts.memory else opts.precisions.split(",")
    if opts.memory:
        cases = [c for c in cases if c in ("ddp", "torch-fsdp2", "shard-optimizer", "shard-full")]
    steps = {"mlp": 30, "encoder": 8, "big": 4}
    opts.steps = {m: opts.steps or steps[m] for m in models}
    out = Path(opts.out or RESULTS / ("shard_memory.json" if opts.memory else "shard.json"))
    if opts.quick:
        opts.steps, opts.warmup, opts.repeats, opts.profile_steps = {m: 2 for m in models}, 1, 1, 1
        out = Path(tempfile.mkdtemp()) / out.name
    runs: dict[str, dict[str, list]] = {f"{m}/{p}": {c: [] for c in cases} for m in models for p in precisions}
    for i in range(opts.repeats):
        for key in runs:
            model, precision = key.split("/")
            for case in (cases if i % 2 == 0 else cases[::-1]):
                r = run_case(case, model, precision, opts)
                runs[key][case].append(r)
                print(f"# repeat {i + 1}/{opts.repeats} {key} {case}: {r['samples_per_s']:.1f} samples/s, "
                      f"step {r['opt_ms']:.1f} ms, state {r['state_bytes'] / 2**20:.0f} MiB, RSS {r['rss_mb']:.0f} MB",
                      flush=True)
    summary = {key: {c: summarize(rs) for c, rs in by_case.items() if rs} for key, by_case in runs.items()}
    from _machine import cpu_model

    cpu = cpu_model()
    alloc = runs[next(iter(runs))][cases[0]][0].get("allocator")
    print(f"\n{opts.nproc} ranks x 1 thread, AdamW, median of {opts.repeats} interleaved runs; {cpu}; malloc: {alloc}\n")
    print("\n".join(table(summary, cases)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "nproc": opts.nproc,
                 "allocator": runs[next(iter(runs))][cases[0]][0].get("allocator"),
                 "steps": opts.steps, "warmup": opts.warmup, "repeats": opts.repeats, "python": platform.python_version()},
        "runs": runs, "summary": summary}, indent=2) + "\n")
    why = plot(summary, cases, out.with_suffix(".png"), cpu)
    print(f"\n# {why or 'plot: ' + str(out.with_suffix('.png'))}; data: {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
