"""How the shm backend scales with the node's rank count: every sweep at each N, gloo in the same run.

    python benchmarks/scale.py --nproc 2,4,8,16 --out results/          # a 16-core node
    python benchmarks/scale.py --nproc 2,4 -b 4K -e 64K --quick         # does the script work?
    python benchmarks/scale.py --nproc 2,4,8 --ddp --shard              # and the training runs

For each N of ``--nproc`` and each collective of ``--collectives`` (allreduce, reduce_scatter,
all_gather, broadcast, barrier), one ``cpuddp bench COLLECTIVE --nproc N --backend shm,gloo``
run: N local ranks, default pinning (each rank gets cores/N CPUs and as many threads), shm and
gloo interleaved in the same ranks (ABBA rounds, the median round), the memory-copy ceiling
measured with all N ranks copying at once.  Then one table per collective: a row per size, a
column per N, each cell ``shm us (x vs gloo)`` (x > 1: shm is faster), and under it each N's
peak shm busbw over the per-rank copy ceiling and its best time over the memory bound
(``cpuddp bench``'s ``bound`` column).  ``--ddp`` / ``--shard`` also run benchmarks/shm_ddp.py
and benchmarks/shard.py at each N (a short run each; their own tables).

Installs nothing and needs only torch: run it from the repository root.  Output: the tables on
stdout and in ``OUT/scale.md``, every bench run's JSON in ``OUT/scale_<collective>_<N>.json``,
and ``OUT/scale.json`` (the tables' numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "barrier")


def _bench(coll: str, n: int, opts: argparse.Namespace, out: Path) -> Optional[dict[str, Any]]:
    """One ``cpuddp bench`` run of ``coll`` on ``n`` ranks, shm and gloo; its JSON (None: it failed)."""
    path = out / f"scale_{coll}_{n}.json"
    cmd = [sys.executable, "-m", "cpuddp", "bench", coll, "--nproc", str(n), "--backend", "shm,gloo",
           "-b", opts.min, "-e", opts.max, "-f", str(opts.factor), "-w", str(opts.warmup), "-n", str(opts.iters),
           "--rounds", str(opts.rounds), "--ceiling-size", opts.ceiling_size, "--timeout", str(opts.timeout),
           "--json", str(path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    print("# " + " ".join(cmd[1:]), flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=opts.timeout + 30)
    except subprocess.TimeoutExpired:
        print(f"#   timed out after {opts.timeout + 30:g} s", flush=True)
        return None
    print(f"#   exit {done.returncode} in {time.monotonic() - t0:.1f} s", flush=True)
    if done.returncode != 0 or not path.exists():
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        return None
    return json.loads(path.read_text())


def _cells(result: dict[str, Any]) -> dict[int, dict[str, float]]:
    """size -> shm time (us), speed-up over gloo, shm busbw, time over the memory bound."""
    cells = {}
    for row in result["rows"]:
        shm, gloo = row["backends"]["shm"], row["backends"]["gloo"]
        cells[int(row["size"])] = {
            "shm_us": shm["time_us"], "gloo_us": gloo["time_us"],
            "x_gloo": gloo["time_us"] / shm["time_us"] if shm["time_us"] > 0 else 0.0,
            "busbw": shm["busbw"], "bound_x": shm["time_us"] / shm["bound_us"] if shm.get("bound_us") else 0.0,
        }
    return cells


def _summary(result: dict[str, Any], cells: dict[int, dict[str, float]]) -> dict[str, Any]:
    ceiling = result["meta"].get("ceiling") or {}
    peak = max((c["busbw"] for c in cells.values()), default=0.0)
    bounds = [c["bound_x"] for c in cells.values() if c["bound_x"] > 0]
    return {"peak_busbw": peak, "ceiling_gbps": ceiling.get("gbps"), "node_gbps": ceiling.get("node_gbps"),
            "peak_of_ceiling": peak / ceiling["gbps"] if ceiling.get("gbps") else None,
            "best_bound_x": min(bounds) if bounds else None}


def format_table(coll: str, ns: Sequence[int], cells: dict[int, dict[int, dict[str, float]]],
                 summaries: dict[int, dict[str, Any]]) -> list[str]:
    """A Markdown table: rows = size, columns = N, cells = shm us (x vs gloo); then per-N lines."""
    sizes = sorted({s for n in ns for s in cells.get(n, {})})
    lines = [f"### {coll}", "", "| size | " + " | ".join(f"N={n}" for n in ns) + " |",
             "|---:|" + "---:|" * len(ns)]
    for s in sizes:
        row = []
        for n in ns:
            c = cells.get(n, {}).get(s)
            row.append(f"{c['shm_us']:.1f} us ({c['x_gloo']:.2f}x)" if c else "-")
        lines.append(f"| {_size(s)} | " + " | ".join(row) + " |")
    peak = []
    for n in ns:
        m = summaries.get(n)
        if not m:
            peak.append("-")
            continue
        frac = f"{m['peak_of_ceiling']:.0%}" if m.get("peak_of_ceiling") is not None else "-"
        bound = f"{m['best_bound_x']:.1f}x" if m.get("best_bound_x") else "-"
        peak.append(f"{m['peak_busbw']:.2f} GB/s = {frac} of {m.get('ceiling_gbps') or 0:.1f}; bound {bound}")
    lines.append("| peak busbw / copy ceiling; best time / memory bound | " + " | ".join(peak) + " |")
    return lines + [""]


def _size(nbytes: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def _training(script: str, n: int, out: Path, quick: bool, timeout: float) -> int:
    """benchmarks/shm_ddp.py or shard.py at ``n`` ranks (short), its output on stdout."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--nproc", str(n), "--repeats", "1",
           "--out", str(out / f"{Path(script).stem}_{n}.json"), "--timeout", str(timeout)]
    if quick:
        cmd.append("--quick")
    if script == "shm_ddp.py":
        cmd += ["--backends", "gloo,shm", "--steps", "8", "--warmup", "2"]
    else:
        cmd += ["--models", "mlp", "--precisions", "fp32", "--steps", "6", "--warmup", "2"]
    print("# " + " ".join(cmd[1:]), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, timeout=timeout + 30).returncode
    except subprocess.TimeoutExpired:
        print(f"#   {script} timed out", flush=True)
        return 1


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", default="2,4,8,16", help="rank counts, comma-separated (default 2,4,8,16)")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("-b", "--min", default="4K")
    ap.add_argument("-e", "--max", default="16M")
    ap.add_argument("-f", "--factor", type=float, default=4)
    ap.add_argument("-w", "--warmup", type=int, default=3)
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ceiling-size", default="64M")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per bench run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--ddp", action="store_true", help="also benchmarks/shm_ddp.py at each N")
    ap.add_argument("--shard", action="store_true", help="also benchmarks/shard.py at each N")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 iterations, 1 round, no ceiling size")
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.warmup, opts.iters, opts.rounds, opts.ceiling_size = 1, 2, 1, "4M"
    try:
        opts.ns = [int(x) for x in opts.nproc.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--nproc {opts.nproc!r}: give rank counts like 2,4,8,16")
    if not opts.ns or min(opts.ns) < 2:
        ap.error(f"--nproc {opts.nproc!r}: every rank count must be 2 or more (one rank communicates nothing)")
    unknown = [c for c in opts.collectives.split(",") if c not in COLLECTIVES]
    if unknown:
        ap.error(f"--collectives: {', '.join(unknown)} not among {', '.join(COLLECTIVES)}")
    return opts


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = _parse(argv)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# scale: N = {opts.ns} on {os.cpu_count()} CPUs; shm vs gloo; {opts.min}..{opts.max} x{opts.factor:g}",
          flush=True)
    tables, report, failed = [], {}, 0
    for coll in opts.collectives.split(","):
        cells, sums = {}, {}
        for n in opts.ns:
            result = _bench(coll, n, opts, out)
            if result is None:
                failed += 1
                continue
            cells[n] = _cells(result)
            sums[n] = _summary(result, cells[n])
        tables += format_table(coll, opts.ns, cells, sums)
        report[coll] = {"cells": {str(n): {str(s): c for s, c in v.items()} for n, v in cells.items()},
                        "summary": {str(n): v for n, v in sums.items()}}
        (out / "scale.md").write_text("\n".join(tables) + "\n")  # so far: a run cut short keeps its tables
    for n in opts.ns:
        for flag, script in ((opts.ddp, "shm_ddp.py"), (opts.shard, "shard.py")):
            if flag:
                failed += _training(script, n, out, opts.quick, opts.timeout) != 0
    text = "\n".join(tables)
    print("\n" + text, flush=True)
    (out / "scale.md").write_text(text + "\n")
    (out / "scale.json").write_text(json.dumps({"nproc": opts.ns, "cpus": os.cpu_count(), "tables": report},
                                               indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
