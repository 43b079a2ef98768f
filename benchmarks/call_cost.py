"""What one small collective costs a rank: wall and CPU microseconds per call, and where they go.

    python benchmarks/call_cost.py                        # 2 ranks, 4 KiB, every collective, both data paths
    python benchmarks/call_cost.py --nproc 4 --bytes 65536 --calls 2000
    python benchmarks/call_cost.py --paths native          # the native data path only
    python benchmarks/call_cost.py --phases               # all_reduce split into its phases (Python path)

Each rank runs ``--calls`` back-to-back calls of each collective on a ``--bytes`` float32 tensor
(after 200 warm-up calls) and reports the median over ``--repeats`` blocks of its wall time
and its CPU time (user + system, ``getrusage``) per call; a line per collective gives the
slowest rank's.  At small sizes the data moves in a few microseconds: the rest is per-call work
(torch's dispatch, the checks, the agreement, the waits), the same at every rank count, which
is what decides a 4 KiB all_reduce or FSDP2's many small collectives.  Each rank is pinned to
one CPU (rank modulo the CPUs it may use: 4 ranks on 2 CPUs share them; ``--no-pin`` leaves
them be).  On the shm backend ``--paths`` runs the shm engine's data paths one after the other
in this run -- ``native`` (cpuddp/backends/shm/native) and ``python`` (``CPUDDP_SHM_NATIVE=0``)
-- each line names its path (the group's own word for it), and a last line per collective gives
``python / native``: a ratio from one run.  ``--phases`` times the stages of an all_reduce on a
shm group's Python path (torch's dispatch, cpuddp's checks, the agreement, the round's wait,
the data) with timers around them (they add about 1 µs each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Optional, Sequence

KINDS = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single", "barrier")


def _costs(kinds: Sequence[str], numel: int, calls: int, repeats: int, pin: bool = True) -> dict:
    import os
    import resource
    import time

    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[dist.get_rank() % len(cpus)]})
    t, big = torch.ones(numel), torch.ones(numel * n)
    # FSDP2's collectives; torch 2.13 renamed them (the old names warn), earlier releases have only those
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    run = {"all_reduce": lambda: dist.all_reduce(t), "broadcast": lambda: dist.broadcast(t, 0),
           "all_gather_single": lambda: gather(big, t), "reduce_scatter_single": lambda: scatter(t, big),
           "barrier": dist.barrier}
    out = {}
    for kind in kinds:
        one = run[kind]
        for _ in range(200):
            one()
        walls, cpus = [], []
        for _ in range(repeats):
            dist.barrier()
            r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(calls):
                one()
            r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            walls.append((w1 - w0) / calls * 1e6)
            cpus.append(((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)) / calls * 1e6)
        out[kind] = (statistics.median(walls), statistics.median(cpus))
    out["path"] = getattr(dist.distributed_c10d._get_default_group(), "data_path", "") or "-"
    return out


def _phases(numel: int, calls: int) -> dict:
    """Microseconds per all_reduce in each stage (timers around the shm group's methods)."""
    import time

    import torch
    import torch.distributed as dist

    from cpuddp.backends.shm.group import calls as shm_calls
    from cpuddp.backends.shm.protocol import channel
    from cpuddp.backends.shm.routes import executor, route_node

    acc: dict = {}
    clock = time.perf_counter

    def timed(cls, name: str, label: str) -> None:
        inner = getattr(cls, name)

        def wrapper(*a, **k):
            t0 = clock()
            try:
                return inner(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + clock() - t0

        setattr(cls, name, wrapper)

    timed(shm_calls.Collectives, "allreduce", "cpuddp (all of it)")
    timed(executor.Executor, "run", "run (agreement, stream, data)")
    timed(route_node.NodeRoute, "_all_reduce", "data path")
    timed(channel.Channel, "agree", "post the call")
    timed(channel.Channel, "round", "round (wait for the peers)")
    t = torch.ones(numel)
    for _ in range(200):
        dist.all_reduce(t)
    dist.barrier()
    acc.clear()  # after the barrier: its wait for the peers is no all_reduce's (it made "round" > "run")
    t0 = clock()
    for _ in range(calls):
        dist.all_reduce(t)
    total = clock() - t0
    return {"total": total / calls * 1e6, **{k: v / calls * 1e6 for k, v in acc.items()}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", default="shm")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes per rank's tensor (float32; default 4096)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per block (default 2000)")
    ap.add_argument("--repeats", type=int, default=5, help="blocks; the median is reported (default 5)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--phases", action="store_true", help="time the stages of a shm all_reduce instead")
    ap.add_argument("--paths", default=None,
                    help="the shm engine's data paths to run, in this order (default native,python; python "
                         "where the native library does not load)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="leave the ranks unpinned")
    opts = ap.parse_args(argv)
    from cpuddp.testing import run_distributed

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _machine import cpu_model

    numel = max(1, opts.bytes // 4)
    head = {"cpu": cpu_model(), "ranks": opts.nproc, "backend": opts.backend, "bytes": numel * 4}
    if opts.phases:
        res = run_distributed(_phases, opts.nproc, args=(numel, opts.calls), backend="shm", timeout=600,
                              env={"CPUDDP_SHM_NATIVE": "0"})  # its timers are around the Python path's stages
        for rank, r in enumerate(res):
            print(json.dumps({**head, "rank": rank, **{k: round(v, 1) for k, v in r.items()}}))
        return 0
    kinds = [k.strip() for k in opts.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds: {', '.join(bad)} not among {', '.join(KINDS)}")
    if opts.paths is None:
        from cpuddp.backends.shm import native

        opts.paths = "native,python" if native.status({})[0] else "python"
    paths = [p.strip() for p in opts.paths.split(",") if p.strip()] if opts.backend == "shm" else [""]
    if any(p not in _PATHS for p in paths):
        ap.error(f"--paths: {opts.paths} is not a list of {', '.join(_PATHS)}")
    walls: dict = {}
    for path in paths:
        env = {"CPUDDP_SHM_NATIVE": _PATHS[path]} if path else None
        res = run_distributed(_costs, opts.nproc, args=(kinds, numel, opts.calls, opts.repeats, opts.pin),
                              backend=opts.backend, timeout=600, env=env)
        for kind in kinds:
            wall = max(r[kind][0] for r in res)
            cpu = max(r[kind][1] for r in res)
            walls[(path, kind)] = wall
            print(json.dumps({**head, **({"path": res[0]["path"]} if path else {}), "collective": kind,
                              "us_per_call": round(wall, 1), "cpu_us_per_call": round(cpu, 1)}))
    if set(paths) == set(_PATHS):
        for kind in kinds:
            print(json.dumps({**head, "collective": kind,
                              "python_over_native": round(walls[("python", kind)] / walls[("native", kind)], 2)}))
    return 0


#: --paths: CPUDDP_SHM_NATIVE for each
_PATHS = {"native": "1", "python": "0"}


if __name__ == "__main__":
    sys.exit(main())
