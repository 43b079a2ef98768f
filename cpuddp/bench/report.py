"""What ``cpuddp bench`` prints and writes: the ``#`` header, the nccl-tests table and footer, the
backend-comparison table, CSV, JSON and PNG plots (pure formatting, except the writers; no torch).

Only rank 0 calls these; every line that is not a table row starts with ``#``.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from cpuddp._units import format_size

from .sweep import Row

if TYPE_CHECKING:  # pragma: no cover
    from .config import BenchConfig

__all__ = [
    "out", "header_lines", "format_row", "format_rows", "format_summary", "rows_to_csv", "plan_text",
    "backend_text", "data_paths_line", "format_backend_head", "format_backend_row", "backend_footer", "write_json", "write_outputs",
    "write_backend_outputs", "plot", "plot_backends",
]


def out(line: str = "") -> None:
    """One line on stdout, flushed (the ranks' output interleaves with the launcher's)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- the sweep table

# (title, unit, width) per column; rows use the same widths.
_COLUMNS = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6),
            ("root", "", 6), ("time", "(us)", 10), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7),
            ("bound", "(x)", 7), ("#wrong", "", 6))


def _head_line(which: int) -> str:
    text = "  ".join(f"{c[which]:>{c[2]}s}" for c in _COLUMNS).rstrip()
    return "#" + text[1:]


_HEAD = (_head_line(0), _head_line(1))


def _fmt_time(us: float) -> str:
    return f"{us:10.2f}" if us < 1e5 else f"{us:10.0f}"


def format_row(row: Row) -> str:
    """One table line, aligned with :data:`_HEAD`."""
    wrong = "N/A" if row.wrong < 0 else str(row.wrong)
    bound = f"{row.time_us / row.bound_us:7.1f}" if row.bound_us > 0 else f"{'-':>7s}"
    return (f"{row.size:12d}  {row.count:12d}  {row.type:>8s}  {row.redop:>6s}  {row.root:6d}  "
            f"{_fmt_time(row.time_us)}  {row.algbw:7.3f}  {row.busbw:7.3f}  {bound}  {wrong:>6s}")


def format_rows(rows: Sequence[Row]) -> list[str]:
    """The table header and rows."""
    return list(_HEAD) + [format_row(r) for r in rows]


def format_summary(summary: Mapping[str, Any]) -> list[str]:
    """Footer comment lines."""
    lines = []
    if summary["checked"]:
        lines.append(f"# Out of bounds values : {summary['wrong']} {'OK' if summary['wrong'] == 0 else 'FAILED'}")
    else:
        lines.append("# Out of bounds values : not checked (--no-check)")
    lines.append(f"# Avg bus bandwidth    : {summary['avg_busbw']:.3f} GB/s")
    lines.append(f"# Peak bus bandwidth   : {summary['peak_busbw']:.3f} GB/s at {format_size(summary['peak_size'])}")
    if summary.get("ceiling_gbps"):
        frac = summary["peak_fraction_of_ceiling"] or 0.0
        lines.append(f"# Memory-copy ceiling  : {summary['ceiling_gbps']:.2f} GB/s; peak busbw is {frac:.0%} of it")
    if summary.get("min_busbw") is not None:
        ok = summary["avg_busbw"] >= summary["min_busbw"]
        lines.append(f"# Min bus bandwidth    : {summary['min_busbw']:.3f} GB/s required: {'OK' if ok else 'FAILED'}")
    lines.append(f"# Exit code            : {summary['exit_code']}")
    return lines


def rows_to_csv(rows: Sequence[Row]) -> str:
    """CSV text: a header line, then one line per size (no comment lines)."""
    cols = ["size", "count", "type", "redop", "root", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "inplace",
            "bound_us"]
    lines = [",".join(cols)]
    for r in rows:
        lines.append(",".join(str(v) for v in (
            r.size, r.count, r.type, r.redop, r.root, f"{r.time_us:.3f}", f"{r.algbw:.6f}", f"{r.busbw:.6f}",
            r.wrong, int(r.inplace), f"{r.bound_us:.3f}")))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the header


def plan_text(plan: Any) -> Optional[str]:
    """One line about rank 0's pinning plan (its reason), for the header."""
    if plan is None:
        return None
    d = plan.as_dict() if hasattr(plan, "as_dict") else None
    if isinstance(d, dict):
        text = f"CPUs {d.get('cpulist', '?')}, {d.get('num_threads', '?')} thread(s)"
        return f"{text} ({d['reason']})" if d.get("reason") else text
    return str(plan)


def header_lines(meta: Mapping[str, Any]) -> list[str]:
    """The ``#`` header from the run's metadata (pure)."""
    v = meta["versions"]
    lines = [
        f"# cpuddp bench {meta['collective']}: {meta['nranks']} ranks on {meta['nodes']} node(s), "
        f"launcher {meta['launcher']}",
        f"# backend: {backend_text(meta['backend'], meta.get('data_path'))}",
        f"# versions: cpuddp {v.get('cpuddp') or '?'}, torch {v.get('torch')}, python {v.get('python')}, "
        f"oneccl_bind_pt {v.get('oneccl_bind_pt') or '-'}, ipex {v.get('ipex') or '-'}",
        f"# sweep: {meta['min']} to {meta['max']} bytes by x{meta['factor']:g}, warm-up {meta['warmup']}, "
        f"iters {meta['iters']}, dtype {meta['dtype']}, {'in-place' if meta['inplace'] else 'out-of-place'}, "
        f"check {'on' if meta['check'] else 'off'}",
        "# time: max over ranks of the mean per-iteration time; GB/s = 1e9 B/s",
        f"# pinning: {'on' if meta['pin'] else 'off (--no-pin)'}"
        + (f"; rank 0's plan: {meta['pin_plan']}" if meta.get("pin_plan") else ""),
    ]
    ranks = meta["ranks"]
    for r, info in enumerate(ranks[:8]):
        lines.append(f"#   rank {r}: host {info['host']} pid {info['pid']} cpus {info['cpus'] or '?'} "
                     f"torch threads {info['torch_threads']} OMP_NUM_THREADS={info['OMP_NUM_THREADS'] or 'unset'}")
    if len(ranks) > 8:
        lines.append(f"#   ... and {len(ranks) - 8} more ranks (see --json)")
    c = meta.get("ceiling")
    if c:
        lines.append(f"# memory-copy ceiling: {c['gbps']:.2f} GB/s per rank with all {c.get('ranks', 1)} rank(s) "
                     f"copying at once (node: {c.get('node_gbps', c['gbps']):.2f} GB/s; {format_size(c['bytes'])} "
                     f"torch copy_, {c['threads']} thread(s), median of {c['reps']}; rank 0's range "
                     f"{c['min_gbps']:.2f}-{c['max_gbps']:.2f})")
        if meta["nranks"] > 1:
            lines.append("# bound: the time over the memory bound, every rank moving about "
                         "5x (allreduce), 3x (reduce_scatter), 2x (all_gather, broadcast) the size at the node's "
                         "copy bandwidth (1.0 = the hardware's limit)")
    if meta["nranks"] == 1:
        lines.append(f"# ONE RANK: no communication -- each call returns at once and no bandwidth or ceiling "
                     f"fraction means anything. Fix: cpuddp bench {meta['collective']} --nproc N (N local ranks), "
                     "or start it under a launcher")
    return lines


def backend_text(backend: str, data_path: Optional[str]) -> str:
    """``shm (native data path, avx2)``: a backend with the data path it measured, in the words of
    the job's header line; a backend that moves its own bytes (gloo) is its name alone."""
    return f"{backend} ({data_path})" if data_path and data_path != backend else backend


def data_paths_line(paths: Mapping[str, str]) -> str:
    """The backend comparison's ``# data paths:`` line: each backend and the data path it measured."""
    return "# data paths: " + "; ".join(f"{backend_text(b, p)}" for b, p in paths.items())


# --------------------------------------------------------------------------- the backend comparison


def format_backend_head(names: Sequence[str]) -> list[str]:
    """Header lines of the backend comparison: per backend time, busbw and #wrong, then ratios."""
    top = f"#{'size':>11s}  {'count':>12s}  {'type':>8s}"
    unit = f"#{'(B)':>11s}  {'(elements)':>12s}  {'':>8s}"
    for b in names:
        top += f"  {b[:10] + ' time':>15s}  {'busbw':>7s}  {'#wrong':>6s}"
        unit += f"  {'(us)':>15s}  {'(GB/s)':>7s}  {'':>6s}"
    for b in names[1:]:
        top += f"  {b[:8] + '/' + names[0][:8]:>17s}"
        unit += f"  {'(speed-up)':>17s}"
    return [top, unit]


def format_backend_row(row: Mapping[str, Any], names: Sequence[str]) -> str:
    """One line of the backend comparison (``row`` as :func:`~cpuddp.bench.sweep.backend_row` makes it)."""
    line = f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8s}"
    for b in names:
        r = row["backends"][b]
        wrong = "N/A" if r["wrong"] < 0 else str(r["wrong"])
        line += f"  {_fmt_time(r['time_us']):>15s}  {r['busbw']:7.3f}  {wrong:>6s}"
    for b in names[1:]:
        line += f"  {row['ratio'][b]:16.2f}x"
    return line


def backend_footer(names: Sequence[str], rows: Sequence[Mapping[str, Any]], ceiling: Optional[Mapping[str, Any]],
                   check: bool, wrong: int, code: int) -> list[str]:
    """Footer of the backend comparison: speed-ups, ceiling fractions, correctness, exit code."""
    lines = []
    for b in names[1:]:
        ratios = [r["ratio"][b] for r in rows]
        lines.append(f"# {b} vs {names[0]}: speed-up {min(ratios):.2f}x to {max(ratios):.2f}x, "
                     f"median {statistics.median(ratios):.2f}x; at {format_size(rows[-1]['size'])} {ratios[-1]:.2f}x")
    if ceiling:
        for b in names:
            peak = max(r["backends"][b]["busbw"] for r in rows)
            lines.append(f"# {b}: peak busbw {peak:.3f} GB/s = {peak / ceiling['gbps']:.0%} of the memory-copy ceiling")
    lines.append(f"# Out of bounds values : {wrong} {'OK' if not wrong else 'FAILED'}"
                 if check else "# Out of bounds values : not checked (--no-check)")
    lines.append(f"# Exit code            : {code}")
    return lines


# --------------------------------------------------------------------------- files


def write_json(path: str, result: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")


def write_outputs(cfg: BenchConfig, result: Mapping[str, Any], rows: Sequence[Row]) -> None:
    """The sweep's ``--json``, ``--csv`` and ``--plot``."""
    if cfg.json:
        write_json(cfg.json, result)
    if cfg.csv:
        with open(cfg.csv, "w") as f:
            f.write(rows_to_csv(rows))
    if cfg.plot:
        plot(result, cfg.plot)


def write_backend_outputs(cfg: BenchConfig, result: Mapping[str, Any]) -> None:
    """The backend comparison's ``--json``, ``--csv`` (a ``backend`` column first) and ``--plot``."""
    names, rows = result["meta"]["backends"], result["rows"]
    if cfg.json:
        write_json(cfg.json, result)
    if cfg.csv:
        with open(cfg.csv, "w") as f:
            f.write("backend," + rows_to_csv([]).splitlines()[0] + "\n")
            for b in names:
                for line in rows_to_csv([Row(**{k: v for k, v in r["backends"][b].items() if k != "rounds_us"})
                                         for r in rows]).splitlines()[1:]:
                    f.write(f"{b},{line}\n")
    if cfg.plot:
        plot_backends(result, cfg.plot)


def _size_axis(ax: Any, sizes: list[int], meta: Mapping[str, Any]) -> None:
    """The memory-copy ceiling line and the log2 size axis both plots share."""
    c = meta.get("ceiling")
    if c:
        ax.axhline(c["gbps"], color="grey", linestyle=":", label=f"memory copy {c['gbps']:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([format_size(s).replace(" ", "\u2009") for s in sizes], rotation=45 if len(sizes) > 9 else 0)
    ax.minorticks_off()
    ax.set_xlabel("size")


def _finish(fig: Any, ax: Any, title: str, legend_loc: str, path: str) -> None:
    import matplotlib.pyplot as plt

    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc=legend_loc)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.2))


def plot(result: Mapping[str, Any], path: str) -> None:
    """busbw and algbw against size, with the memory-copy ceiling, to a PNG."""
    rows, meta = result["rows"], result["meta"]
    sizes = [r["size"] for r in rows]
    fig, ax = _figure()
    ax.plot(sizes, [r["busbw"] for r in rows], "o-", label="busbw")
    ax.plot(sizes, [r["algbw"] for r in rows], "s--", alpha=0.6, label="algbw")
    _size_axis(ax, sizes, meta)
    ax.set_ylabel("GB/s")
    _finish(fig, ax, f"{meta['collective']} {meta['dtype']}, {meta['nranks']} ranks, "
            f"{backend_text(meta['backend'], meta.get('data_path'))}",
            "center left", path)


def plot_backends(result: Mapping[str, Any], path: str) -> None:
    """busbw of each backend against size, with the memory-copy ceiling, to a PNG."""
    rows, meta = result["rows"], result["meta"]
    sizes = [r["size"] for r in rows]
    fig, ax = _figure()
    for b in meta["backends"]:
        ax.plot(sizes, [r["backends"][b]["busbw"] for r in rows], "o-", label=f"{b} busbw")
    _size_axis(ax, sizes, meta)
    ax.set_ylabel("busbw (GB/s)")
    _finish(fig, ax, f"{meta['collective']} {meta['dtype']}, {meta['nranks']} ranks: {', '.join(meta['backends'])}",
            "upper left", path)
