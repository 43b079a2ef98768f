"""DDP training samples/s on the shared-memory backend vs gloo, same ranks count, interleaved runs.

    flock "$(python benchmarks/_heavy_lock.py)" python benchmarks/shm_ddp.py  # 2 ranks, 5 repeats
    python benchmarks/shm_ddp.py --backends gloo,shm,shm-async,shm-sync       # CPUDDP_SHM_ASYNC=1 / =0
    python benchmarks/shm_ddp.py --backends gloo,shm-python,shm                # the Python / native data path
    python benchmarks/shm_ddp.py --backends shm:1,shm:4,shm:25,shm:100         # DDP's bucket_cap_mb, by measurement
    python benchmarks/shm_ddp.py --quick                                      # does the script work?

Each run starts ``--nproc`` local ranks (``cpuddp.init_distributed(backend=...)``, default
pinning) that train the same 11 M-parameter MLP (1024-2048-2048-2048-10, fp32, SGD with
momentum, DDP with default buckets: ``cpuddp.prepare(model, opt)`` as README's loop does, or
plain ``DistributedDataParallel(model)`` with ``--wrap ddp``) on the same synthetic data, each rank its own batch of
``--batch``.  Per run, each rank measures

* ``samples/s``: every rank's samples over ``--steps`` timed steps after ``--warmup``;
* ``no-sync samples/s``: the same steps inside ``ddp.no_sync()`` (no allreduce at all), so
  ``1 - samples/s / no-sync samples/s`` is the share of the step that communication adds
  (what overlap with backward did not hide);
* ``allreduces alone``: DDP's own gradient buckets (same sizes and order) all-reduced back
  to back with nothing else running, ms per step; with the step time added by communication
  (sync minus no-sync) it gives the share of the allreduce time backward hid
  (``1 - added / alone``);
* a SHA-256 of the final parameters (equal across backends means bit-identical training).

Backends run interleaved (ABBA) ``--repeats`` times; the summary is the median.  Output:
``benchmarks/results/shm_ddp.json`` and a Markdown table on stdout (for docs/performance.md).
"""

from __future__ import annotations

import argparse
import hashlib
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


def rank_main(args: argparse.Namespace) -> None:
    import ctypes

    from cpuddp._procs import rank_setup

    rank_setup()  # die with the driver; answer its request for a stack if this rank hangs

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cpuddp

    backend, _, bucket = args.backend.partition(":")  # "shm:4": DDP buckets of 4 MB (bucket_cap_mb)
    ddp_kw = {"bucket_cap_mb": float(bucket)} if bucket else {}
    if backend == "shm-sync":  # the shm backend with every collective in the caller's thread
        os.environ["CPUDDP_SHM_ASYNC"], backend = "0", "shm"
    elif backend == "shm-async":  # the shm backend with its communication thread for 256 KiB and up
        os.environ["CPUDDP_SHM_ASYNC"], backend = "1", "shm"
    elif backend == "shm-python":  # the shm backend on its Python data path (CPUDDP_SHM_NATIVE=0)
        os.environ["CPUDDP_SHM_NATIVE"], backend = "0", "shm"
    cpuddp.init_distributed(backend=backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    if args.wrap == "prepare":  # what README's loop does: DDP with gradient_as_bucket_view=True
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        ddp = cpuddp.prepare(model, opt, **ddp_kw)
    else:
        ddp = DDP(model, **ddp_kw)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(args.batch, 1024, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
            for _ in range(8)]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    def timed(sync: bool) -> float:
        for i in range(args.warmup):
            step(i)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(args.steps):
            if sync:
                step(i)
            else:
                with ddp.no_sync():
                    step(i)
        dist.barrier()
        return n * args.batch * args.steps / (time.perf_counter() - t0)

    sps = timed(True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel() * 4)).hexdigest()
    nosync = timed(False)
    comm = comm_seconds(ddp, args)
    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "backend": str(dist.get_backend()), "samples_per_s": sps, "nosync_samples_per_s": nosync,
            "comm_ms_per_step": comm * 1e3, "buckets": len(ddp.reducer._get_zeros_like_grad_buckets()),
            "params_sha256": digest, "params": sum(p.numel() for p in model.parameters()),
            "threads": torch.get_num_threads()}))
    cpuddp.shutdown()


def comm_seconds(ddp: Any, args: argparse.Namespace) -> float:
    """Seconds per step of DDP's allreduces alone: every gradient bucket DDP formed (same
    sizes, same order), all-reduced back to back with no backward running, the slowest rank's
    mean over ``--steps``."""
    import torch
    import torch.distributed as dist

    buckets = [b.buffer() for b in ddp.reducer._get_zeros_like_grad_buckets()]  # private: DDP's bucket buffers

    def once() -> None:
        for b in buckets:
            dist.all_reduce(b)

    for _ in range(args.warmup):
        once()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        once()
    took = torch.tensor([(time.perf_counter() - t0) / args.steps])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def run_case(backend: str, opts: argparse.Namespace) -> dict[str, Any]:
    from _ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        cmd = [sys.executable, __file__, "--rank-main", "--backend", backend, "--result", result,
               "--batch", str(opts.batch), "--steps", str(opts.steps), "--warmup", str(opts.warmup),
               "--wrap", opts.wrap]
        codes = run_ranks(cmd, opts.nproc, opts.timeout)
        if any(codes):
            raise SystemExit(f"a {backend} run failed: exit codes {codes}")
        return json.loads(Path(result).read_text())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="gloo,shm")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    ap.add_argument("--wrap", choices=("prepare", "ddp"), default="prepare",
                    help="prepare: cpuddp.prepare(model, opt) (README's loop; DDP with gradient_as_bucket_view); "
                         "ddp: plain DistributedDataParallel(model) (default: prepare)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(RESULTS / "shm_ddp.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.rank_main:
        rank_main(opts)
        return 0
    if opts.quick:
        opts.steps, opts.warmup, opts.repeats = 2, 1, 1
        opts.out = os.path.join(tempfile.mkdtemp(), "shm_ddp.json")
    backends = opts.backends.split(",")
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    for i in range(opts.repeats):
        for b in (backends if i % 2 == 0 else backends[::-1]):
            r = run_case(b, opts)
            runs[b].append(r)
            print(f"# repeat {i + 1}/{opts.repeats} {b}: {r['samples_per_s']:.1f} samples/s "
                  f"(no-sync {r['nosync_samples_per_s']:.1f})", flush=True)
    summary = {}
    for b in backends:
        sps = [r["samples_per_s"] for r in runs[b]]
        nos = [r["nosync_samples_per_s"] for r in runs[b]]
        summary[b] = {"samples_per_s": statistics.median(sps), "min": min(sps), "max": max(sps),
                      "nosync_samples_per_s": statistics.median(nos),
                      "comm_share": 1 - statistics.median(sps) / statistics.median(nos),
                      **_overlap(runs[b], opts),
                      "digests": sorted({r["params_sha256"] for r in runs[b]})}
    base = backends[0]
    from _machine import cpu_model

    cpu = cpu_model()
    print(f"\n{opts.nproc} ranks, {runs[base][0]['params'] / 1e6:.1f} M-parameter MLP ({opts.wrap}), batch {opts.batch} per rank, "
          f"{opts.steps} steps, median of {opts.repeats}; {cpu}\n")
    print("| backend | samples/s (min-max) | vs " + base + " | no-sync samples/s | communication share of a step | "
          "allreduces alone, ms/step | added to a step, ms | hidden by backward | parameters |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ref = summary[base]["digests"]
    for b in backends:
        s = summary[b]
        same = "identical to " + base if s["digests"] == ref and len(ref) == 1 else ("reference" if b == base else "differ")
        print(f"| {b} | {s['samples_per_s']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | "
              f"{s['samples_per_s'] / summary[base]['samples_per_s']:.3f}x | {s['nosync_samples_per_s']:.1f} | "
              f"{s['comm_share']:.1%} | {s['comm_alone_ms']:.1f} | {s['comm_added_ms']:.1f} | {_hidden_text(s['hidden_share'])} | "
              f"{same if b != base else 'reference'} |")
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "nproc": opts.nproc,
                 "batch": opts.batch, "steps": opts.steps, "warmup": opts.warmup, "repeats": opts.repeats,
                 "wrap": opts.wrap, "python": platform.python_version()},
        "runs": runs, "summary": summary}, indent=2) + "\n")
    return 0


def _overlap(runs: Sequence[dict[str, Any]], opts: argparse.Namespace) -> dict[str, float]:
    """Medians of: DDP's allreduces alone (ms per step); what communication added to a step
    (step time minus no-sync step time, ms); the share of the allreduce time that backward hid
    (1 - added / alone; 0 = none hidden, negative = a step paid more than the allreduces)."""
    per_step = opts.nproc * opts.batch  # samples per step
    alone = [r["comm_ms_per_step"] for r in runs]
    added = [1e3 * per_step * (1 / r["samples_per_s"] - 1 / r["nosync_samples_per_s"]) for r in runs]
    hidden = [1 - a / c for a, c in zip(added, alone)]
    return {"comm_alone_ms": statistics.median(alone), "comm_added_ms": statistics.median(added),
            "hidden_share": statistics.median(hidden)}


def _hidden_text(share: float) -> str:
    """A negative share means a step paid more than the allreduces themselves: none hidden."""
    return f"{share:.0%}" if share > 0 else f"none ({share:.0%})"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
