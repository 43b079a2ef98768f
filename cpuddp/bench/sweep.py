"""The nccl-tests arithmetic of ``cpuddp bench`` (pure, no torch): the sizes of a sweep, bus
bandwidth factors, result rows, the summary and the exit code.

Columns and factors as in NVIDIA/nccl-tests ``doc/PERFORMANCE.md``: ``algbw = size / time``,
``busbw = algbw * factor`` with ``2(n-1)/n`` for allreduce, ``(n-1)/n`` for all_gather,
reduce_scatter, gather, scatter and all_to_all, ``1`` for broadcast and reduce.  A barrier moves
nothing: one row of size 0, its time the point.

The memory bound (:func:`bound_seconds`): what the shm algorithm must move through memory, per
rank, at the node's copy bandwidth shared by every rank -- about 5x the size for an allreduce
(copy-in: read and write; reduce-scatter: read every rank's part; all-gather: read and write),
:data:`TRAFFIC` for the others.  A row's time over it says how far the run is from the
hardware, independent of nccl-tests' bus factor.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

__all__ = [
    "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_WRONG", "EXIT_BELOW_MIN", "COLLECTIVES", "DTYPES",
    "SPLIT", "Row", "sweep_sizes", "shaped_sizes", "bus_factor", "shape_size", "make_row", "summarize", "exit_code",
    "backend_row", "TRAFFIC", "bound_seconds",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_WRONG = 3
EXIT_BELOW_MIN = 4

#: Canonical collective names and their aliases.
COLLECTIVES = ("allreduce", "all_gather", "broadcast", "reduce_scatter", "reduce", "gather", "scatter",
               "all_to_all", "barrier")
ALIASES = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "reduce_scatter": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "all_to_all": "all_to_all",
    "alltoall": "all_to_all",
    "barrier": "barrier",
}
#: Collectives whose size is split among the ranks (a whole number of elements each).
SPLIT = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")

#: dtype name -> (canonical torch attribute name, itemsize in bytes).
DTYPES = {
    "float32": ("float32", 4), "float": ("float32", 4), "fp32": ("float32", 4),
    "float64": ("float64", 8), "double": ("float64", 8), "fp64": ("float64", 8),
    "float16": ("float16", 2), "half": ("float16", 2), "fp16": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "int8": ("int8", 1), "uint8": ("uint8", 1),
    "int32": ("int32", 4), "int": ("int32", 4),
    "int64": ("int64", 8), "long": ("int64", 8),
}


def sweep_sizes(minimum: int, maximum: int, factor: float) -> list[int]:
    """Sizes from ``minimum`` to ``maximum`` (inclusive when reached) multiplying by ``factor``."""
    if minimum <= 0 or maximum < minimum:
        raise ValueError(f"need 0 < --min <= --max, got --min {minimum} --max {maximum}")
    if minimum == maximum:
        return [minimum]
    if factor <= 1:
        raise ValueError(f"--factor must be greater than 1 when --min < --max, got {factor}")
    out, size = [], float(minimum)
    while size <= maximum * (1 + 1e-9):
        out.append(int(round(size)))
        size *= factor
    return out


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    n = nranks  # a world of one gets factor 1 (busbw = algbw; nccl-tests would print 0)
    if collective == "allreduce":
        return 2.0 * (n - 1) / n if n > 1 else 1.0
    if collective in SPLIT:
        return (n - 1) / n if n > 1 else 1.0
    if collective in ("broadcast", "reduce", "barrier"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


def shape_size(size: int, collective: str, nranks: int, itemsize: int) -> tuple[int, int]:
    """Round ``size`` down to what the collective can move: ``(bytes, elements)``.

    all_gather, reduce_scatter, gather, scatter and all_to_all need a whole number of elements
    per rank, so the total is a multiple of ``nranks * itemsize`` (at least one element per
    rank).  A barrier moves nothing.
    """
    if collective == "barrier":
        return 0, 0
    unit = itemsize * (nranks if collective in SPLIT else 1)
    nbytes = max(unit, (size // unit) * unit)
    return nbytes, nbytes // itemsize


def shaped_sizes(minimum: int, maximum: int, factor: float, collective: str, nranks: int,
                 itemsize: int) -> list[tuple[int, int]]:
    """The sweep's ``(bytes, elements)``, each shaped for the collective, without repeats."""
    out: list[tuple[int, int]] = []
    for s in sweep_sizes(minimum, maximum, factor):
        sc = shape_size(s, collective, nranks, itemsize)
        if sc not in out:
            out.append(sc)
    return out


#: Bytes of memory traffic per rank per byte of the collective's size, shm's algorithm (reads +
#: writes: a copy of S bytes moves 2S): allreduce copy-in 2, reduce-scatter 1, all-gather 2.
TRAFFIC = {"allreduce": 5.0, "reduce_scatter": 3.0, "reduce": 3.0, "all_gather": 2.0, "gather": 2.0,
           "scatter": 2.0, "broadcast": 2.0, "all_to_all": 4.0, "barrier": 0.0}


def bound_seconds(collective: str, nranks: int, nbytes: int, node_copy_gbps: Optional[float]) -> float:
    """The least time the algorithm can take on a node whose ranks copy ``node_copy_gbps`` GB/s
    together (bytes copied; the traffic is twice that): every rank moves ``TRAFFIC * nbytes``.
    0.0 when there is no bound (one rank, a barrier, no ceiling)."""
    if nranks < 2 or not node_copy_gbps or not nbytes:
        return 0.0
    return TRAFFIC[collective] * nbytes * nranks / (2.0 * node_copy_gbps * 1e9)


@dataclass
class Row:
    """One line of the table."""

    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int
    inplace: bool = True
    bound_us: float = 0.0  # the memory bound (bound_seconds), 0 when none


def make_row(collective: str, nranks: int, nbytes: int, count: int, dtype: str, seconds: float,
             wrong: int, inplace: bool, node_copy_gbps: Optional[float] = None) -> Row:
    """Turn a measured time into a row (pure); with the node's copy bandwidth, its memory bound."""
    algbw = nbytes / 1e9 / seconds if seconds > 0 else 0.0
    busbw = algbw * bus_factor(collective, nranks)
    redop = "sum" if collective in ("allreduce", "reduce_scatter", "reduce") else "none"
    root = 0 if collective in ("broadcast", "reduce", "gather", "scatter") else -1
    bound = bound_seconds(collective, nranks, nbytes, node_copy_gbps)
    return Row(nbytes, count, dtype, redop, root, seconds * 1e6, algbw, busbw, wrong, inplace, bound * 1e6)


def summarize(rows: Sequence[Row], min_busbw: Optional[float] = None,
              ceiling_gbps: Optional[float] = None) -> dict[str, Any]:
    """Totals for the footer and the exit code (pure)."""
    wrong = sum(r.wrong for r in rows if r.wrong > 0)
    avg = statistics.fmean(r.busbw for r in rows) if rows else 0.0
    peak = max(rows, key=lambda r: r.busbw) if rows else None
    out: dict[str, Any] = {
        "wrong": wrong,
        "checked": any(r.wrong >= 0 for r in rows),
        "avg_busbw": avg,
        "peak_busbw": peak.busbw if peak else 0.0,
        "peak_size": peak.size if peak else 0,
        "min_busbw": min_busbw,
        "ceiling_gbps": ceiling_gbps,
        "peak_fraction_of_ceiling": (peak.busbw / ceiling_gbps) if (peak and ceiling_gbps) else None,
    }
    out["exit_code"] = exit_code(out["wrong"], avg, min_busbw)
    return out


def exit_code(wrong: int, avg_busbw: float, min_busbw: Optional[float]) -> int:
    """3 when elements were wrong, else 4 when the average busbw is below the minimum, else 0."""
    if wrong > 0:
        return EXIT_WRONG
    if min_busbw is not None and avg_busbw < min_busbw:
        return EXIT_BELOW_MIN
    return EXIT_OK


def backend_row(names: Sequence[str], rows: Mapping[str, Row], times: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Merge one size's rows (one per backend) into a comparison row; ratio = first's time / other's."""
    first = rows[names[0]]
    out: dict[str, Any] = {"size": first.size, "count": first.count, "type": first.type, "backends": {}, "ratio": {}}
    for b in names:
        out["backends"][b] = dict(asdict(rows[b]), rounds_us=[t * 1e6 for t in times[b]])
    for b in names[1:]:
        out["ratio"][b] = first.time_us / rows[b].time_us if rows[b].time_us > 0 else 0.0
    return out
