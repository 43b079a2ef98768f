"""DDP training throughput with cpuddp's core pinning, without pinning, and oversubscribed.

    python benchmarks/pinning.py --repeats 5 --steps 30            # the measurement
    python benchmarks/pinning.py --repeats 1 --steps 3 --out /tmp  # a smoke run

Model: a small transformer classifier in plain torch (``nn.TransformerEncoder``, 4 layers,
d_model 256, 4 heads, FFN 1024, sequence 128, vocabulary 8192, 2 classes), random tokens,
AdamW, DDP over gloo, ``--world`` ranks (default 2) on this machine.  Nothing is downloaded.

Setups, run interleaved (A B C A B C ...) so drift on a shared machine hits all alike:

- ``cpuddp``: ``cpuddp.init_distributed()`` with its default pinning (each rank on its own
  cores, threads = its cores); ``OMP_NUM_THREADS`` unset.
- ``unpinned``: ``init_distributed(pin=False)``, ``OMP_NUM_THREADS`` = CPUs / ranks (what
  torchrun's ``OMP_NUM_THREADS=1`` amounts to on 2 CPUs): right thread count, no affinity.
- ``oversubscribed``: ``init_distributed(pin=False)``, every rank with as many threads as
  there are CPUs (what a bare ``mpirun`` gives torch by default).

Each run: ``--warmup`` steps, then ``--steps`` timed steps; samples/s = ranks x batch x steps
/ the slowest rank's time.  Reported: medians over ``--repeats`` runs, min and max, and the
ratio to ``cpuddp``.  Output: a table on stdout (``#`` lines are comments), JSON and a PNG in
``--out`` (default ``benchmarks/results``).  Exit status 1 if a run failed or a loss was not
finite.  Every run is bounded by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402
from _plot import pyplot  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETUPS = ("cpuddp", "unpinned", "oversubscribed")

# Launcher variables that must not leak from the caller's environment into the ranks.
_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "I_MPI_", "HYDRA_", "MPI_LOCAL", "SLURM_", "MV2_", "TORCHELASTIC_")
_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME", "CPUDDP_NUM_THREADS"}


# --------------------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cpuddp
    from cpuddp._procs import rank_setup

    rank_setup()  # die with the driver; answer its request for a stack if this rank hangs
    setup = args.setup
    env = cpuddp.init_distributed(backend="gloo", timeout=args.timeout, pin=(setup == "cpuddp"))
    if setup != "cpuddp":
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.manual_seed(0)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(args.vocab, args.d_model)
            self.pos = nn.Parameter(torch.zeros(1, args.seq, args.d_model))
            layer = nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.head = nn.Linear(args.d_model, 2)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.emb(tokens) + self.pos).mean(dim=1))

    model = DDP(Classifier())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + env.rank)
    batches = [
        (torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen), torch.randint(0, 2, (args.batch,), generator=gen))
        for _ in range(4)
    ]

    def step(i: int) -> float:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    step_times, losses = [], []
    t0 = time.perf_counter()
    for i in range(args.steps):
        s = time.perf_counter()
        losses.append(step(i))
        step_times.append(time.perf_counter() - s)
    elapsed = time.perf_counter() - t0
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    info = {
        "rank": env.rank,
        "affinity": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "elapsed_s": elapsed,
        "median_step_s": statistics.median(step_times),
        "losses_finite": all(math.isfinite(v) for v in losses),
    }
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, info)
    if env.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {
            "setup": setup,
            "samples_per_s": env.world_size * args.batch * args.steps / float(slowest),
            "slowest_s": float(slowest),
            "params": params,
            "ranks": ranks,
            "pin_plan": cpuddp.get_session().chosen()["pin_plan"],
        }
        Path(args.result).write_text(json.dumps(result))
    cpuddp.shutdown()


# --------------------------------------------------------------------------- the driver


def _rank_environ(setup: str, world: int, ncpu: int) -> dict[str, str]:
    """The environment every rank of ``setup`` starts from (the launcher adds the rank variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES) and k not in _NAMES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if setup == "unpinned":
        env["OMP_NUM_THREADS"] = str(max(1, ncpu // world))
    elif setup == "oversubscribed":
        env["OMP_NUM_THREADS"] = str(ncpu)
    return env


def run_setup(setup: str, args: argparse.Namespace, ncpu: int) -> dict:
    """Start ``args.world`` ranks for one run of ``setup``; return rank 0's result."""
    from _ranks import run_ranks

    with tempfile.TemporaryDirectory(prefix="cpuddp-pinbench-") as tmp:
        result = Path(tmp) / "result.json"
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--setup", setup, "--result", str(result)]
        for name in ("steps", "warmup", "batch", "seq", "vocab", "d_model", "heads", "layers", "timeout"):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        codes = run_ranks(argv, args.world, args.timeout, environ=_rank_environ(setup, args.world, ncpu))
        # A rank stuck in teardown after the result was written still counts.
        if not result.exists():
            raise RuntimeError(f"{setup}: no result within {args.timeout} s (exit codes {codes}; their stderr is above)")
        return json.loads(result.read_text())


def plot_title(meta: dict, cpu: str | None = None) -> str:
    """What pinning.png shows: the workload, the layout, the CPU and torch (``cpu`` stands in for a
    result whose meta names the CPU without its generation)."""
    params = meta["model"].rsplit(", ", 1)[-1].split()[0]
    model = meta["model"]
    if params.isdigit():
        model = f"{model.split(':')[0]} ({int(params) / 1e6:.1f} M parameters)"
    return (f"DDP over gloo by pinning setup, {meta['world']} ranks x batch {meta['batch_per_rank']}, "
            f"medians of {meta['repeats']} interleaved runs\n{model}\n{cpu or meta['cpu_model']}, "
            f"{meta['cpus']} CPUs, torch {meta['torch'].split('+')[0]}")


def plot(medians: dict[str, float], samples: dict[str, list[float]], path: Path, title: str) -> None:
    plt = pyplot("pinning.png")
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    names = list(medians)
    ax.bar(names, [medians[n] for n in names], color=["#2a7", "#79b", "#c64"][: len(names)], alpha=0.8, label="median")
    for i, n in enumerate(names):
        ax.scatter([i] * len(samples[n]), samples[n], color="black", s=12, zorder=3, label="runs" if i == 0 else None)
        ax.annotate(f"{medians[n]:.1f}", (i, medians[n]), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="runs per setup (default 5)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--batch", type=int, default=8, help="samples per rank per step (default 8)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on one run, seconds (default 900)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma list, default {','.join(SETUPS)}")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="directory for pinning.json / .png")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--replot", action="store_true", help="redraw pinning.png from --out's pinning.json; runs nothing")
    ap.add_argument("--cpu", help="with --replot: the CPU for the title, where the result names it without generation")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.replot:
        doc = json.loads((Path(args.out) / "pinning.json").read_text())
        plot(doc["median"], doc["samples"], Path(args.out) / "pinning.png", plot_title(doc["meta"], args.cpu))
        return 0

    import torch

    setups = [s for s in args.setups.split(",") if s]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        ap.error(f"unknown setup(s) {sorted(unknown)}; choose from {SETUPS}")
    ncpu = len(os.sched_getaffinity(0))
    runs: list[dict] = []
    failed = False
    started = time.time()
    for rep in range(args.repeats):  # interleaved: A B C, A B C, ...
        for setup in setups:
            try:
                res = run_setup(setup, args, ncpu)
            except Exception as exc:
                print(f"# run {rep} {setup} FAILED: {exc}", file=sys.stderr)
                failed = True
                continue
            res["repeat"] = rep
            if not all(r["losses_finite"] for r in res["ranks"]):
                failed = True
            runs.append(res)
            layout = " ".join(f"r{r['rank']}:cpus={r['affinity']},threads={r['threads']}" for r in res["ranks"])
            print(f"# run {rep} {setup:<15} {res['samples_per_s']:8.2f} samples/s  {layout}", flush=True)

    samples = {s: [r["samples_per_s"] for r in runs if r["setup"] == s] for s in setups}
    samples = {s: v for s, v in samples.items() if v}
    medians = {s: statistics.median(v) for s, v in samples.items()}
    params = runs[0]["params"] if runs else None
    meta = {
        "command": " ".join(["python", "benchmarks/pinning.py", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpus": ncpu,
        "world": args.world,
        "batch_per_rank": args.batch,
        "seq": args.seq,
        "model": f"TransformerEncoder classifier: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
                 f"FFN {4 * args.d_model}, vocab {args.vocab}, {params} parameters",
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "wall_s": round(time.time() - started, 1),
    }
    base = medians.get("cpuddp")
    print(f"# torch {meta['torch']}, {meta['cpu_model']}, {ncpu} CPUs, {args.world} ranks x batch {args.batch}, "
          f"seq {args.seq}, {params} parameters")
    print(f"# {args.repeats} interleaved repeats of {args.steps} timed steps after {args.warmup} warm-up; medians")
    print("| setup | median samples/s | min | max | runs | vs cpuddp |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for s, v in samples.items():
        ratio = f"{medians[s] / base:.2f}x" if base else "n/a"
        print(f"| {s} | {medians[s]:.2f} | {min(v):.2f} | {max(v):.2f} | {len(v)} | {ratio} |")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pinning.json").write_text(json.dumps({"meta": meta, "median": medians, "samples": samples, "runs": runs}, indent=1))
    if medians:
        plot(medians, samples, out / "pinning.png", plot_title(meta))
    print(f"# wrote {out / 'pinning.json'} and {out / 'pinning.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
