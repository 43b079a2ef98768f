"""README's picture: shm against gloo, allreduce time per call and speed-up across message sizes.

    python benchmarks/plot_readme.py            # redraws docs/images/allreduce_shm_vs_gloo_2ranks.png

Draws from a ``cpuddp bench --backend gloo,shm --json`` result, by default the committed
``benchmarks/results/allreduce_shm_vs_gloo_2ranks.json`` (docs/benchmarks.md gives its command),
so the picture changes only when that file does; it runs no benchmark.  Left: the median time
per call of each backend (log scales); right: gloo's time over shm's at each size.  The title
names the collective, dtype, sizes, ranks, CPU, torch and shm's data path.  ``cpuddp bench``'s
JSON names neither the CPU nor the data path, so ``--cpu`` and ``--shm-path`` give them; for the
committed file the defaults below are the machine it was measured on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _plot import pyplot  # noqa: E402

from cpuddp._units import format_size  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "allreduce_shm_vs_gloo_2ranks.json"
DEFAULT_PNG = ROOT / "docs" / "images" / "allreduce_shm_vs_gloo_2ranks.png"
#: What the committed result file does not record: where and how its shm side ran.
DEFAULT_CPU = "AMD EPYC (Zen 4, AVX-512 with AVX512-BF16), 2 vCPUs"
DEFAULT_SHM_PATH = "Python data path"
#: Sizes whose speed-up is written on its bar.
MARKED = {1 << 10, 64 << 10, 1 << 20, 16 << 20}


def series(result: dict[str, Any]) -> tuple[list[int], dict[str, list[float]], list[float]]:
    """Sizes, each backend's median time per call (µs) and the second backend's speed-up over the first."""
    meta, rows = result["meta"], result["rows"]
    names = meta["backends"]
    if len(names) != 2:
        raise SystemExit(f"plot_readme: the result compares {names}; it needs two backends (cpuddp bench --backend gloo,shm)")
    times = {b: [r["backends"][b]["time_us"] for r in rows] for b in names}
    return [r["size"] for r in rows], times, [r["ratio"][names[1]] for r in rows]


def title(meta: dict[str, Any], sizes: Sequence[int], cpu: str, shm_path: str) -> str:
    names = meta["backends"]
    torch = meta["versions"]["torch"].split("+")[0]
    return (f"{meta['collective']} {meta['dtype']}, {format_size(sizes[0])} to {format_size(sizes[-1])}, "
            f"{meta['nranks']} ranks on one node: {names[1]} against {names[0]}\n"
            f"{cpu}, torch {torch}; {names[1]}'s {shm_path}; each rank pinned to one core")


def draw(result: dict[str, Any], path: Path, cpu: str, shm_path: str) -> Optional[Path]:
    plt = pyplot("README's shm-vs-gloo picture")
    if plt is None:
        return None
    sizes, times, speedup = series(result)
    meta = result["meta"]
    labels = [format_size(s).replace(" ", "\u2009") for s in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for (name, ys), style in zip(times.items(), ("s--", "o-")):
        left.plot(sizes, ys, style, label=f"{name}")
    left.set_yscale("log")
    left.set_ylabel("time per call, µs (median round)")
    right.bar(range(len(sizes)), speedup, color="tab:orange")
    right.axhline(1.0, color="grey", linestyle=":")
    right.set_ylabel(f"{meta['backends'][0]} time / {meta['backends'][1]} time")
    right.set_xticks(range(len(sizes)), labels, rotation=60, fontsize=8)
    right.set_xlabel("size")
    for i, (size, s) in enumerate(zip(sizes, speedup)):
        if size in MARKED or i == len(sizes) - 1:
            right.annotate(f"{s:.1f}x", (i, s), ha="center", va="bottom", fontsize=8)
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, labels, rotation=60, fontsize=8)
    left.minorticks_off()
    left.set_xlabel("size")
    left.legend()
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title(meta, sizes, cpu, shm_path), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", type=Path, default=DEFAULT_JSON, help="a cpuddp bench --backend a,b --json file")
    ap.add_argument("--out", type=Path, default=DEFAULT_PNG, help=f"the PNG (default {DEFAULT_PNG.relative_to(ROOT)})")
    ap.add_argument("--cpu", default=DEFAULT_CPU, help="the CPU the result was measured on, for the title")
    ap.add_argument("--shm-path", default=DEFAULT_SHM_PATH, help="shm's data path in that run, for the title")
    opts = ap.parse_args(argv)
    result = json.loads(opts.json.read_text())
    out = draw(result, opts.out, opts.cpu, opts.shm_path)
    if out is None:
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
