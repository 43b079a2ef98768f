"""Markdown tables for docs/benchmarks.md from a ``cpuddp bench --backend a,b`` JSON.

    python benchmarks/shm_tables.py benchmarks/results/allreduce_shm_vs_gloo_2ranks.json

Prints the run's configuration line, one row per size (time and busbw of each backend, the
speed-up of each over the first) and the memory-copy ceiling, so the docs' numbers come from
the result file and nothing is copied by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpuddp._units import format_size  # noqa: E402


def table(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    names = meta["backends"]
    first = names[0]
    head = ["size"] + [f"{b} time (µs)" for b in names] + [f"{b} busbw (GB/s)" for b in names]
    head += [f"{b} / {first}" for b in names[1:]] + ["#wrong"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for r in rows:
        cells = [format_size(r["size"])]
        cells += [f"{r['backends'][b]['time_us']:.1f}" for b in names]
        cells += [f"{r['backends'][b]['busbw']:.3f}" for b in names]
        cells += [f"**{r['ratio'][b]:.2f}x**" for b in names[1:]]
        cells += [str(sum(max(r["backends"][b]["wrong"], 0) for b in names))]
        lines.append("| " + " | ".join(cells) + " |")
    out = [f"{meta['collective']} {meta['dtype']}, {meta['nranks']} ranks, backends {', '.join(names)}; "
           f"{meta['iters']} timed calls x {len(rows[0]['backends'][first]['rounds_us'])} interleaved rounds per "
           f"size and backend, median round; torch {meta['versions']['torch']}", "", *lines]
    c = meta.get("ceiling")
    if c:
        peaks = {b: max(r["backends"][b]["busbw"] for r in rows) for b in names}
        out += ["", f"Memory-copy ceiling (rank 0, one thread): **{c['gbps']:.2f} GB/s**; peak busbw "
                + ", ".join(f"{b} {p:.2f} GB/s ({p / c['gbps']:.0%})" for b, p in peaks.items()) + "."]
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(table(json.loads(Path(path).read_text())))
        print()
