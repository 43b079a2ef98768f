"""``cpuddp bench``: collective bandwidth sweeps, reported the way nccl-tests reports them.

Usage::

    cpuddp bench allreduce --nproc 2                      # spawn 2 local ranks
    cpuddp bench all_gather -b 1K -e 64M -f 4 -n 20 -w 5  # sizes, iterations, warm-up
    torchrun --nproc-per-node 2 -m cpuddp bench reduce_scatter --dtype bfloat16
    mpiexec -n 4 cpuddp bench broadcast --json out.json --csv out.csv --plot out.png
    cpuddp bench allreduce --nproc 2 --min-busbw 1.0      # CI gate (exit code 4 below it)
    cpuddp bench allreduce --nproc 2 --compare-bare -b 16M -e 64M
    cpuddp bench allreduce --nproc 2 --backend gloo,shm   # both in one run, interleaved, with the ratio

Collectives: ``allreduce`` (alias ``all_reduce``), ``all_gather`` (``allgather``),
``broadcast``, ``reduce_scatter`` (``reducescatter``).

Launch: under any launcher each rank calls :func:`cpuddp.init_distributed` (so the
launcher's variables are read, the backend is chosen and threads pinned as in training).
With ``--nproc N`` and no launcher, this process starts N local ranks itself
(``python -m cpuddp bench ...`` with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``; it never
imports torch itself), kills them all when one fails or ``--timeout`` passes, and exits
with rank 0's code.

Columns, as in nccl-tests (NVIDIA/nccl-tests ``doc/PERFORMANCE.md``): ``size`` is the
bytes of the whole array (for all_gather and reduce_scatter: ``n`` times the per-rank
chunk, so sizes are rounded down to a multiple of ``n * itemsize``), ``count`` its
elements, ``time`` the per-iteration time in microseconds, ``algbw = size / time`` and
``busbw = algbw * factor`` in GB/s (1e9 bytes/s), with factor ``2(n-1)/n`` for allreduce,
``(n-1)/n`` for all_gather and reduce_scatter, ``1`` for broadcast.  ``#wrong`` counts
elements, summed over ranks, that differ from the expected result of one checked call
made after the timed loop (``--no-check`` skips it).

Time: each rank times ``--iters`` back-to-back calls after ``--warmup`` calls (a barrier
before each), divides by ``--iters``, and the reported time is the **maximum over ranks**
of that mean (the slowest rank bounds a synchronous step).  Only rank 0 prints and writes
files; comment lines start with ``#``.

The ceiling: before the sweep rank 0 times ``torch.Tensor.copy_`` of a large buffer
(``--ceiling-size``, default 256 MiB; median of 5) with the rank's own thread count and
prints that copy rate (bytes copied per second; the memory traffic is twice that) beside
the results, with each busbw as a fraction of it.

Exit codes: 0 success; 1 error (a rank failed, timed out, or a collective raised);
2 usage; 3 the correctness check found wrong elements; 4 the average bus bandwidth (over
all sizes, as nccl-tests' ``NCCL_TESTS_MIN_BW``) is below ``--min-busbw``.

``--compare-bare`` times, in the same processes and interleaved (ABBA order over
``--rounds`` rounds), the loop the sweep uses and a bare ``torch.distributed`` loop, and
prints the median busbw of each and their ratio: the check that cpuddp adds no overhead.

``--backend a,b,...`` times each backend in the same ranks (the default group is the first's;
the others get ``new_group(backend=...)``), ``--rounds`` rounds per size and backend in ABBA
order, and prints the median round of each and the speed-up of each over the first.  Rank
information is exchanged with two tensor collectives (:func:`exchange_json`), not
``all_gather_object``, which needs numpy.  Teardown is bounded (:data:`TEARDOWN_TIMEOUT`).

Environment read: the launcher's variables (see :mod:`cpuddp.launchers`);
``CPUDDP_BENCH_CHILD`` marks a rank started by ``--nproc`` (internal).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from .topology import format_cpulist

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "COLLECTIVES",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "EXIT_WRONG",
    "EXIT_BELOW_MIN",
    "Row",
    "parse_size",
    "format_size",
    "sweep_sizes",
    "bus_factor",
    "shape_size",
    "make_row",
    "format_rows",
    "summarize",
    "exit_code",
    "add_arguments",
    "run",
    "main",
]


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_WRONG = 3
EXIT_BELOW_MIN = 4

#: Canonical collective names and their aliases.
COLLECTIVES = ("allreduce", "all_gather", "broadcast", "reduce_scatter")
_ALIASES = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "reduce_scatter": "reduce_scatter",
    "reducescatter": "reduce_scatter",
}

#: dtype name -> (canonical torch attribute name, itemsize in bytes).
_DTYPES = {
    "float32": ("float32", 4), "float": ("float32", 4), "fp32": ("float32", 4),
    "float64": ("float64", 8), "double": ("float64", 8), "fp64": ("float64", 8),
    "float16": ("float16", 2), "half": ("float16", 2), "fp16": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "int8": ("int8", 1), "uint8": ("uint8", 1),
    "int32": ("int32", 4), "int": ("int32", 4),
    "int64": ("int64", 8), "long": ("int64", 8),
}

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}

CHILD_MARK = "CPUDDP_BENCH_CHILD"


# --------------------------------------------------------------------------- pure helpers


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864.  Units K, M, G (also KB/KiB...) are powers of 1024, as in nccl-tests."""
    s = str(text).strip().upper().replace(" ", "")
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i], s[i:]
    if unit not in _UNITS or not num:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit K, M or G (e.g. 1K, 64M)")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit K, M or G (e.g. 1K, 64M)") from None
    out = int(value * _UNITS[unit])
    if out <= 0 or value * _UNITS[unit] != out:
        raise ValueError(f"size {text!r} must be a positive whole number of bytes")
    return out


def format_size(nbytes: float) -> str:
    """1048576 -> ``"1 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(nbytes)} B"


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
    if collective in ("all_gather", "reduce_scatter"):
        return (n - 1) / n if n > 1 else 1.0
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


def shape_size(size: int, collective: str, nranks: int, itemsize: int) -> tuple[int, int]:
    """Round ``size`` down to what the collective can move: ``(bytes, elements)``.

    all_gather and reduce_scatter need a whole number of elements per rank, so the total is
    a multiple of ``nranks * itemsize`` (at least one element per rank).
    """
    unit = itemsize * (nranks if collective in ("all_gather", "reduce_scatter") else 1)
    nbytes = max(unit, (size // unit) * unit)
    return nbytes, nbytes // itemsize


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


def make_row(collective: str, nranks: int, nbytes: int, count: int, dtype: str, seconds: float,
             wrong: int, inplace: bool) -> Row:
    """Turn a measured time into a row (pure)."""
    algbw = nbytes / 1e9 / seconds if seconds > 0 else 0.0
    busbw = algbw * bus_factor(collective, nranks)
    redop = "sum" if collective in ("allreduce", "reduce_scatter") else "none"
    root = 0 if collective == "broadcast" else -1
    return Row(nbytes, count, dtype, redop, root, seconds * 1e6, algbw, busbw, wrong, inplace)


# (title, unit, width) per column; rows use the same widths.
_COLUMNS = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6),
            ("root", "", 6), ("time", "(us)", 10), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7),
            ("#wrong", "", 6))


def _head_line(which: int) -> str:
    text = "  ".join(f"{c[which]:>{c[2]}s}" for c in _COLUMNS).rstrip()
    return "#" + text[1:]


_HEAD = (_head_line(0), _head_line(1))


def _fmt_time(us: float) -> str:
    return f"{us:10.2f}" if us < 1e5 else f"{us:10.0f}"


def format_row(row: Row) -> str:
    """One table line, aligned with :data:`_HEAD`."""
    wrong = "N/A" if row.wrong < 0 else str(row.wrong)
    return (f"{row.size:12d}  {row.count:12d}  {row.type:>8s}  {row.redop:>6s}  {row.root:6d}  "
            f"{_fmt_time(row.time_us)}  {row.algbw:7.3f}  {row.busbw:7.3f}  {wrong:>6s}")


def format_rows(rows: Sequence[Row]) -> list[str]:
    """The table header and rows."""
    return list(_HEAD) + [format_row(r) for r in rows]


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
    cols = ["size", "count", "type", "redop", "root", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "inplace"]
    lines = [",".join(cols)]
    for r in rows:
        lines.append(",".join(str(v) for v in (
            r.size, r.count, r.type, r.redop, r.root, f"{r.time_us:.3f}", f"{r.algbw:.6f}", f"{r.busbw:.6f}",
            r.wrong, int(r.inplace))))
    return "\n".join(lines) + "\n"


def child_env(environ: Mapping[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment of local rank ``rank`` started by ``--nproc`` (pure)."""
    from .launchers import clean_environ

    env = clean_environ(environ)  # no launcher variables leak into the ranks --nproc starts
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        CHILD_MARK: "1",
    })
    return env


# --------------------------------------------------------------------------- argument parsing


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _collective_arg(text: str) -> str:
    try:
        return _ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown collective {text!r}; choose from {', '.join(COLLECTIVES)}") from None


def _dtype_arg(text: str) -> str:
    try:
        return _DTYPES[text.lower()][0]
    except KeyError:
        names = sorted({v[0] for v in _DTYPES.values()})
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(names)}") from None


def parse_backends(text: str) -> list[str]:
    """``"gloo, shm"`` -> ``["gloo", "shm"]`` (lowercase, in order; no repeats)."""
    names = [b.strip().lower() for b in str(text).split(",")]
    if not names or any(not b for b in names):
        raise ValueError(f"--backend {text!r} must name one backend or several separated by commas, e.g. gloo,shm")
    repeated = sorted({b for b in names if names.count(b) > 1})
    if repeated:
        raise ValueError(f"--backend {text!r} names {', '.join(repeated)} more than once")
    return names


def _backends_arg(text: str) -> list[str]:
    try:
        return parse_backends(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``cpuddp bench`` (short forms as in nccl-tests)."""
    p.add_argument("collective", type=_collective_arg, metavar="COLLECTIVE",
                   help="allreduce, all_gather, broadcast or reduce_scatter")
    p.add_argument("-b", "--min", type=_size_arg, default=parse_size("1K"), metavar="SIZE",
                   help="smallest size, bytes with optional K/M/G (default 1K)")
    p.add_argument("-e", "--max", type=_size_arg, default=parse_size("64M"), metavar="SIZE",
                   help="largest size (default 64M)")
    p.add_argument("-f", "--factor", type=float, default=2.0, help="multiply the size by this (default 2)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls per size (default 5)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("-d", "--dtype", type=_dtype_arg, default="float32", help="element type (default float32)")
    p.add_argument("--inplace", action="store_true",
                   help="all_gather/reduce_scatter: the input is a slice of the output (allreduce and "
                        "broadcast are always in place in torch)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    p.add_argument("--backend", default="auto", type=_backends_arg,
                   help="collective backend for init_distributed (default auto); several, comma-separated "
                        "(e.g. gloo,shm), are timed in the same run, interleaved, with their ratio")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin threads (init_distributed pin=False)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="start N local ranks (only without a launcher)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                   help="--nproc: kill the ranks after this long; also the rendezvous timeout (default 900)")
    p.add_argument("--min-busbw", type=float, default=None, metavar="GBPS",
                   help="exit 4 when the average bus bandwidth is below this (GB/s)")
    p.add_argument("--ceiling-size", type=_size_arg, default=parse_size("256M"), metavar="SIZE",
                   help="buffer for the memory-copy ceiling (default 256M)")
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip the memory-copy ceiling")
    p.add_argument("--json", metavar="PATH", help="write header, rows and summary as JSON")
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    p.add_argument("--plot", metavar="PNG", help="plot busbw and algbw against size (needs matplotlib)")
    p.add_argument("--compare-bare", action="store_true",
                   help="interleave the sweep's timed loop with a bare torch.distributed loop and compare "
                        "(writes --json only)")
    p.add_argument("--rounds", type=int, default=5, help="--compare-bare: rounds per size (default 5)")


def _validate(args: argparse.Namespace) -> Optional[str]:
    if args.iters < 1 or args.warmup < 0:
        return "--iters must be >= 1 and --warmup >= 0"
    if args.nproc is not None and args.nproc < 1:
        return "--nproc must be >= 1"
    if args.rounds < 1:
        return "--rounds must be >= 1"
    if isinstance(args.backend, str):
        args.backend = parse_backends(args.backend)
    if len(args.backend) > 1 and args.compare_bare:
        return "--compare-bare times one backend; pass a single --backend with it"
    try:
        sweep_sizes(args.min, args.max, args.factor)
    except ValueError as e:
        return str(e)
    if args.plot and not args.compare_bare:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            return "--plot needs matplotlib, which is not installed. Fix: pip install 'cpuddp[bench]'"
    return None


# --------------------------------------------------------------------------- the spawner


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(nproc: int, argv: Sequence[str], *, timeout: float, environ: Optional[Mapping[str, str]] = None,
          grace: float = 10.0, program: Optional[Sequence[str]] = None) -> int:
    """Run ``python -m cpuddp <argv>`` (or ``program + argv``) as ``nproc`` local ranks.

    Returns rank 0's exit code, or 1 when any rank failed while rank 0 succeeded.  When a
    rank exits non-zero the others get ``grace`` seconds to finish, then are killed; all are
    killed after ``timeout`` seconds.  Rank 0's output goes to this stdout; every rank's
    stderr to this stderr.
    """
    environ = os.environ if environ is None else environ
    port = free_port()
    cmd = [*(program or (sys.executable, "-m", "cpuddp")), *argv]
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nproc):
            procs.append(subprocess.Popen(
                cmd, env=child_env(environ, r, nproc, port),
                stdout=None if r == 0 else subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        first_fail: Optional[tuple[int, int]] = None
        fail_deadline = math.inf
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            for r, c in enumerate(codes):
                if c not in (None, 0) and first_fail is None:
                    first_fail = (r, c)
                    fail_deadline = now + grace
            if now > deadline or now > fail_deadline:
                why = (f"rank {first_fail[0]} exited with code {first_fail[1]}" if now <= deadline and first_fail
                       else f"timed out after {timeout:g} s (--timeout)")
                sys.stderr.write(f"# cpuddp bench: {why}; killing the remaining ranks\n")
                _kill(procs)
                return EXIT_ERROR
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        if codes[0] == 0 and any(codes):
            return EXIT_ERROR
        if codes[0] < 0:  # killed by a signal
            return EXIT_ERROR
        return codes[0]
    finally:  # also on KeyboardInterrupt: no rank outlives this process
        _kill(procs)


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - nothing more we can do
            pass


# --------------------------------------------------------------------------- inside a rank


def _init(backend: str, timeout: float, pin: bool) -> Any:
    """Form the process group with :func:`cpuddp.init_distributed`; return its DistEnv."""
    import torch.distributed as dist

    from .distributed import init_distributed

    env = init_distributed(backend, timeout=min(timeout, 300.0), pin=pin)
    if not dist.is_initialized():
        # A single process with no launcher: a world of one still runs the collectives.
        dist.init_process_group(env.backend or "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return env


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


@dataclass
class _Op:
    """The buffers and the calls for one size.

    ``call`` is what the sweep times with :func:`_timed`; ``bare(warmup, iters)`` is the same
    collective in a bare ``torch.distributed`` loop written out inline (``--compare-bare``).
    """

    call: Callable[[], Any]
    bare: Callable[[int, int], float]
    fill: Callable[[], None]
    result: Callable[[], "torch.Tensor"]
    expected: Callable[[], "torch.Tensor"]


def _pattern(count: int, rank: int, dtype: "torch.dtype") -> "torch.Tensor":
    """Small whole numbers (0-4): their sums stay exact up to 31 ranks in int8, 64 in bfloat16."""
    import torch

    return ((torch.arange(count, dtype=torch.int64) + rank) % 5).to(dtype)


def _make_op(collective: str, count: int, dtype: "torch.dtype", inplace: bool, rank: int, n: int,
             group: Any = None) -> _Op:
    """The buffers and calls of one size, on ``group`` (None: the default group)."""
    import torch
    import torch.distributed as dist

    # torch 2.13 renamed the tensor forms (the old names warn); use the new ones when present.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    chunk = count // n
    lo, hi = rank * chunk, (rank + 1) * chunk

    def summed() -> torch.Tensor:
        total = torch.zeros(count, dtype=torch.float64)
        for r in range(n):
            total += _pattern(count, r, torch.float64)
        return total

    # Each collective's ``bare`` loop is written out in full on purpose: it is the reference that
    # ``--compare-bare`` sets cpuddp's timed loop against, so it must share none of that loop's
    # code (a helper taking a callable would just be cpuddp's loop again).
    if collective == "allreduce":
        buf = torch.zeros(count, dtype=dtype)

        def fill() -> None:
            buf.copy_(_pattern(count, rank, dtype))

        def bare(warmup: int, iters: int) -> float:
            dist.barrier()
            for _ in range(warmup):
                dist.all_reduce(buf, group=group)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf, group=group)
            return (time.perf_counter() - start) / iters

        return _Op(lambda: dist.all_reduce(buf, group=group), bare, fill, lambda: buf, summed)

    if collective == "broadcast":
        buf = torch.zeros(count, dtype=dtype)

        def fill() -> None:
            buf.copy_(_pattern(count, 0, dtype) if rank == 0 else torch.full((count,), 7, dtype=dtype))

        def bare(warmup: int, iters: int) -> float:
            dist.barrier()
            for _ in range(warmup):
                dist.broadcast(buf, 0, group=group)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.broadcast(buf, 0, group=group)
            return (time.perf_counter() - start) / iters

        return _Op(lambda: dist.broadcast(buf, 0, group=group), bare, fill, lambda: buf,
                   lambda: _pattern(count, 0, torch.float64))

    if collective == "all_gather":
        out = torch.zeros(count, dtype=dtype)
        inp = out[lo:hi] if inplace else torch.zeros(chunk, dtype=dtype)

        def fill() -> None:
            out.fill_(7)
            inp.copy_(_pattern(chunk, rank, dtype))

        def expected() -> torch.Tensor:
            return torch.cat([_pattern(chunk, r, torch.float64) for r in range(n)])

        def bare(warmup: int, iters: int) -> float:
            dist.barrier()
            for _ in range(warmup):
                all_gather(out, inp, group=group)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                all_gather(out, inp, group=group)
            return (time.perf_counter() - start) / iters

        return _Op(lambda: all_gather(out, inp, group=group), bare, fill, lambda: out, expected)

    if collective == "reduce_scatter":
        inp = torch.zeros(count, dtype=dtype)
        out = inp[lo:hi] if inplace else torch.zeros(chunk, dtype=dtype)

        def fill() -> None:
            inp.copy_(_pattern(count, rank, dtype))
            if not inplace:
                out.fill_(7)

        def bare(warmup: int, iters: int) -> float:
            dist.barrier()
            for _ in range(warmup):
                reduce_scatter(out, inp, group=group)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                reduce_scatter(out, inp, group=group)
            return (time.perf_counter() - start) / iters

        return _Op(lambda: reduce_scatter(out, inp, group=group), bare, fill, lambda: out, lambda: summed()[lo:hi])

    raise ValueError(f"unknown collective {collective!r}")


def _timed(call: Callable[[], Any], warmup: int, iters: int) -> float:
    """Mean seconds per call on this rank: ``warmup`` calls, a barrier, ``iters`` timed calls.

    This is the loop every sweep row is measured with.
    """
    import torch.distributed as dist

    dist.barrier()
    for _ in range(warmup):
        call()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sum_over_ranks(value: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _check(op: _Op, dtype: "torch.dtype") -> int:
    """Elements on this rank that differ from the expected result of one call."""
    import torch

    op.fill()
    op.call()
    got = op.result().to(torch.float64)
    want = op.expected()
    rtol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}.get(dtype, 0.0)
    bad = ~torch.isclose(got, want, rtol=rtol, atol=0.0)
    return int(bad.sum().item())


def measure_copy_bandwidth(nbytes: int, reps: int = 5) -> dict[str, Any]:
    """Median rate of ``dst.copy_(src)`` over ``reps`` runs of ``nbytes`` (GB/s = 1e9 B/s copied)."""
    import torch

    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    dst.copy_(src)  # first touch and warm-up
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        rates.append(n * 4 / 1e9 / dt)
    return {"gbps": statistics.median(rates), "bytes": n * 4, "reps": reps, "threads": torch.get_num_threads(),
            "min_gbps": min(rates), "max_gbps": max(rates),
            "how": "torch.Tensor.copy_ of a float32 buffer, median; GB/s = bytes copied / 1e9 / s "
                   "(memory traffic is twice that: read + write)"}


def _versions() -> dict[str, Optional[str]]:
    import importlib.metadata as md

    import torch

    out: dict[str, Optional[str]] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist_name, key in (("cpuddp", "cpuddp"), ("oneccl_bind_pt", "oneccl_bind_pt"),
                           ("intel_extension_for_pytorch", "ipex")):
        try:
            out[key] = md.version(dist_name)
        except md.PackageNotFoundError:
            out[key] = None
    if out["cpuddp"] is None:
        import cpuddp

        out["cpuddp"] = getattr(cpuddp, "__version__", None)
    return out


def _rank_info() -> dict[str, Any]:
    import torch

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = []
    return {"host": socket.gethostname(), "pid": os.getpid(), "cpus": format_cpulist(cpus),
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def header_lines(meta: Mapping[str, Any]) -> list[str]:
    """The ``#`` header from the run's metadata (pure)."""
    v = meta["versions"]
    lines = [
        f"# cpuddp bench {meta['collective']}: {meta['nranks']} ranks on {meta['nodes']} node(s), "
        f"launcher {meta['launcher']}",
        f"# backend: {meta['backend']}",
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
        lines.append(f"# memory-copy ceiling: {c['gbps']:.2f} GB/s (rank 0, {format_size(c['bytes'])} torch copy_, "
                     f"{c['threads']} thread(s), median of {c['reps']}; range {c['min_gbps']:.2f}-{c['max_gbps']:.2f})")
    return lines


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


def plot(result: Mapping[str, Any], path: str) -> None:
    """busbw and algbw against size, with the memory-copy ceiling, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    meta = result["meta"]
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(sizes, [r["busbw"] for r in rows], "o-", label="busbw")
    ax.plot(sizes, [r["algbw"] for r in rows], "s--", alpha=0.6, label="algbw")
    _size_axis(ax, sizes, meta)
    ax.set_ylabel("GB/s")
    _finish(fig, ax, f"{meta['collective']} {meta['dtype']}, {meta['nranks']} ranks, {meta['backend']}",
            "center left", path)


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_rank(args: argparse.Namespace) -> int:
    """The benchmark inside one rank (every rank runs this; rank 0 prints)."""
    env = _init(args.backend[0], args.timeout, args.pin)
    finished = False
    try:
        code = _run_rank(args, env)
        finished = True
        return code
    finally:
        _teardown(finished)


#: Seconds the teardown waits for torch's destroy_process_group before abandoning it.
TEARDOWN_TIMEOUT = 10.0


def _teardown(finished: bool, limit: float = TEARDOWN_TIMEOUT) -> None:
    """Leave the group; a barrier first only when this rank finished (a failed peer would hang it).

    Bounded: a ``destroy_process_group`` that hangs (a peer gone mid-collective) is abandoned
    after ``limit`` seconds on a daemon thread, with a line on stderr.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if finished:
            dist.barrier()
    finally:
        from .distributed import shutdown

        shutdown()  # bounded: it abandons a torch teardown that hangs
        if dist.is_initialized():
            _bounded(dist.destroy_process_group, limit, "destroy_process_group")


def _bounded(fn: Callable[[], Any], limit: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread; True when it returned within ``limit`` seconds."""
    import threading

    t = threading.Thread(target=fn, name=f"cpuddp-bench-{what}", daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        sys.stderr.write(f"# cpuddp bench: {what} did not return within {limit:g} s; leaving it\n")
        return False
    return True


def exchange_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order, through two tensor collectives.

    Not ``all_gather_object``: that needs numpy, which a bare torch install lacks (issue 11).
    """
    import torch
    import torch.distributed as dist

    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    n = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(x.item()) for x in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    got = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(got, padded, group=group)
    return [json.loads(bytes(g[:int(k.item())].tolist()).decode()) for g, k in zip(got, sizes)]


def _run_rank(args: argparse.Namespace, env: Any) -> int:
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    main_rank = rank == 0
    # torch has only in-place forms of all_reduce and broadcast.
    args.inplace = bool(args.inplace or args.collective in ("allreduce", "broadcast"))
    dtype = _torch_dtype(args.dtype)
    itemsize = _DTYPES[args.dtype][1]
    infos = exchange_json(_rank_info())

    plan = getattr(env, "pin_plan", None) if env is not None else None
    ceiling = None
    if args.ceiling:
        if main_rank:
            ceiling = measure_copy_bandwidth(args.ceiling_size)
        dist.barrier()
    backend = str(dist.get_backend())
    chosen = getattr(env, "backend", None) if env is not None else None
    meta: dict[str, Any] = {
        "collective": args.collective, "nranks": n,
        "nodes": len({i["host"] for i in infos}),
        "launcher": getattr(env, "launcher", None) or ("env" if n > 1 else "none"),
        "backend": backend if not chosen or chosen == backend else f"{chosen} (process group: {backend})",
        "versions": _versions(), "min": args.min, "max": args.max, "factor": args.factor,
        "warmup": args.warmup, "iters": args.iters, "dtype": args.dtype, "inplace": args.inplace,
        "check": args.check, "pin": args.pin,
        "pin_plan": _plan_text(plan), "pin_plan_dict": plan.as_dict() if hasattr(plan, "as_dict") else None,
        "ranks": infos, "ceiling": ceiling, "time": "max over ranks of mean per-iteration time",
        "env": env.as_dict() if hasattr(env, "as_dict") else None,
    }
    if main_rank:
        for line in header_lines(meta):
            _out(line)

    shaped: list[tuple[int, int]] = []
    for s in sweep_sizes(args.min, args.max, args.factor):
        sc = shape_size(s, args.collective, n, itemsize)
        if sc not in shaped:
            shaped.append(sc)

    if args.compare_bare:
        return _compare(args, shaped, dtype, rank, n, main_rank, meta)
    if len(args.backend) > 1:
        return _compare_backends(args, shaped, dtype, rank, n, main_rank, meta)

    rows: list[Row] = []
    if main_rank:
        for line in format_rows([]):
            _out(line)
    for nbytes, count in shaped:
        op = _make_op(args.collective, count, dtype, args.inplace, rank, n)
        local = _timed(op.call, args.warmup, args.iters)
        seconds = _max_over_ranks(local)
        wrong = _sum_over_ranks(_check(op, dtype)) if args.check else -1
        row = make_row(args.collective, n, nbytes, count, args.dtype, seconds, wrong, args.inplace)
        rows.append(row)
        if main_rank:
            _out(format_row(row))
        del op

    summary = summarize(rows, args.min_busbw, ceiling["gbps"] if ceiling else None)
    if main_rank:
        for line in format_summary(summary):
            _out(line)
        result = {"format": "cpuddp-bench/1", "meta": meta, "rows": [asdict(r) for r in rows], "summary": summary}
        _write_outputs(args, result, rows)
    return summary["exit_code"]


def _plan_text(plan: Any) -> Optional[str]:
    """One line about rank 0's pinning plan (its reason), for the header."""
    if plan is None:
        return None
    d = plan.as_dict() if hasattr(plan, "as_dict") else None
    if isinstance(d, dict):
        text = f"CPUs {d.get('cpulist', '?')}, {d.get('num_threads', '?')} thread(s)"
        return f"{text} ({d['reason']})" if d.get("reason") else text
    return str(plan)


def _write_json(path: str, result: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")


def _write_outputs(args: argparse.Namespace, result: Mapping[str, Any], rows: Sequence[Row]) -> None:
    if args.json:
        _write_json(args.json, result)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(rows_to_csv(rows))
    if args.plot:
        plot(result, args.plot)


def _compare(args: argparse.Namespace, shaped: Sequence[tuple[int, int]], dtype: "torch.dtype", rank: int,
             n: int, main_rank: bool, meta: dict[str, Any]) -> int:
    """Interleave the sweep's loop (A) and a bare torch.distributed loop (B) in ABBA order.

    Reports the median and the best (fastest) round of each; on a noisy machine the best
    is the steadier estimate of what each loop costs.
    """
    out_rows = []
    if main_rank:
        _out(f"# compare: the sweep's timed loop (cpuddp) vs a bare torch.distributed loop, same processes, "
             f"interleaved ABBA, {args.rounds} round(s) of each; busbw of the median and of the best round")
        _out("#       size  cpuddp median  bare median   ratio  cpuddp best   bare best   ratio")
        _out("#        (B)         (GB/s)       (GB/s)                (GB/s)      (GB/s)")
    factor = bus_factor(args.collective, n)
    for nbytes, count in shaped:
        op = _make_op(args.collective, count, dtype, args.inplace, rank, n)
        a_times, b_times = [], []
        for i in range(args.rounds):
            for which in (("a", "b") if i % 2 == 0 else ("b", "a")):
                if which == "a":
                    a_times.append(_max_over_ranks(_timed(op.call, args.warmup, args.iters)))
                else:
                    b_times.append(_max_over_ranks(op.bare(args.warmup, args.iters)))

        def bw(seconds: float) -> float:
            return nbytes / 1e9 / seconds * factor

        row = {"size": nbytes, "count": count,
               "cpuddp_busbw": bw(statistics.median(a_times)), "bare_busbw": bw(statistics.median(b_times)),
               "cpuddp_best_busbw": bw(min(a_times)), "bare_best_busbw": bw(min(b_times)),
               "cpuddp_times_us": [t * 1e6 for t in a_times], "bare_times_us": [t * 1e6 for t in b_times]}
        row["ratio"] = row["cpuddp_busbw"] / row["bare_busbw"]
        row["best_ratio"] = row["cpuddp_best_busbw"] / row["bare_best_busbw"]
        out_rows.append(row)
        if main_rank:
            _out(f"{nbytes:12d}  {row['cpuddp_busbw']:13.3f}  {row['bare_busbw']:11.3f}  {row['ratio']:6.3f}  "
                 f"{row['cpuddp_best_busbw']:11.3f}  {row['bare_best_busbw']:10.3f}  {row['best_ratio']:6.3f}")
        del op
    worst = max((abs(1 - r["ratio"]) for r in out_rows), default=0.0)
    worst_best = max((abs(1 - r["best_ratio"]) for r in out_rows), default=0.0)
    if main_rank:
        _out(f"# largest difference: medians {worst:.1%}, best rounds {worst_best:.1%} "
             f"(target: within 5%; the machine's noise shows in the spread of rounds, see --json)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"format": "cpuddp-bench-compare/1", "meta": meta, "compare": out_rows,
                           "max_abs_difference": worst, "max_abs_difference_best": worst_best},
                          f, indent=2, default=str)
                f.write("\n")
    return EXIT_OK


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
    """One line of the backend comparison (``row`` as :func:`backend_row` makes it)."""
    line = f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8s}"
    for b in names:
        r = row["backends"][b]
        wrong = "N/A" if r["wrong"] < 0 else str(r["wrong"])
        line += f"  {_fmt_time(r['time_us']):>15s}  {r['busbw']:7.3f}  {wrong:>6s}"
    for b in names[1:]:
        line += f"  {row['ratio'][b]:16.2f}x"
    return line


def backend_row(names: Sequence[str], rows: Mapping[str, Row], times: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Merge one size's rows (one per backend) into a comparison row; ratio = first's time / other's."""
    first = rows[names[0]]
    out: dict[str, Any] = {"size": first.size, "count": first.count, "type": first.type, "backends": {}, "ratio": {}}
    for b in names:
        out["backends"][b] = dict(asdict(rows[b]), rounds_us=[t * 1e6 for t in times[b]])
    for b in names[1:]:
        out["ratio"][b] = first.time_us / rows[b].time_us if rows[b].time_us > 0 else 0.0
    return out


def _compare_backends(args: argparse.Namespace, shaped: Sequence[tuple[int, int]], dtype: "torch.dtype",
                      rank: int, n: int, main_rank: bool, meta: dict[str, Any]) -> int:
    """Time each backend of ``--backend a,b,...`` in the same ranks, interleaved, size by size.

    The first backend is the default group's; each other one gets a group of all ranks made with
    ``new_group(backend=...)``.  Per size and backend: ``--rounds`` rounds of the sweep's timed
    loop in ABBA order, the median round reported (max over ranks, as in the sweep).
    """
    import torch.distributed as dist

    from .backends import load_backend

    names = list(args.backend)
    groups: dict[str, Any] = {names[0]: None}
    for b in names[1:]:
        load_backend(b)
        groups[b] = dist.new_group(backend=b)
    if main_rank:
        _out(f"# compare backends: {', '.join(names)} in the same {n} ranks; per size {args.rounds} round(s) of "
             f"{args.iters} timed calls each, interleaved (ABBA), median round; ratio = {names[0]} time / other's")
        for line in format_backend_head(names):
            _out(line)
    out_rows: list[dict[str, Any]] = []
    wrong_total = 0
    for nbytes, count in shaped:
        ops = {b: _make_op(args.collective, count, dtype, args.inplace, rank, n, groups[b]) for b in names}
        times: dict[str, list[float]] = {b: [] for b in names}
        for i in range(args.rounds):
            for b in (names if i % 2 == 0 else names[::-1]):
                times[b].append(_max_over_ranks(_timed(ops[b].call, args.warmup, args.iters)))
        rows = {}
        for b in names:
            wrong = _sum_over_ranks(_check(ops[b], dtype)) if args.check else -1
            wrong_total += max(wrong, 0)
            rows[b] = make_row(args.collective, n, nbytes, count, args.dtype, statistics.median(times[b]), wrong,
                               args.inplace)
        row = backend_row(names, rows, times)
        out_rows.append(row)
        if main_rank:
            _out(format_backend_row(row, names))
        del ops
    code = EXIT_WRONG if wrong_total else EXIT_OK
    if main_rank:
        for b in names[1:]:
            ratios = [r["ratio"][b] for r in out_rows]
            _out(f"# {b} vs {names[0]}: speed-up {min(ratios):.2f}x to {max(ratios):.2f}x, "
                 f"median {statistics.median(ratios):.2f}x; at {format_size(out_rows[-1]['size'])} {ratios[-1]:.2f}x")
        ceiling = meta.get("ceiling")
        if ceiling:
            for b in names:
                peak = max(r["backends"][b]["busbw"] for r in out_rows)
                _out(f"# {b}: peak busbw {peak:.3f} GB/s = {peak / ceiling['gbps']:.0%} of the memory-copy ceiling")
        _out(f"# Out of bounds values : {wrong_total} {'OK' if not wrong_total else 'FAILED'}"
             if args.check else "# Out of bounds values : not checked (--no-check)")
        _out(f"# Exit code            : {code}")
        result = {"format": "cpuddp-bench-backends/1", "meta": dict(meta, backends=names), "rows": out_rows}
        if args.json:
            _write_json(args.json, result)
        if args.csv:
            with open(args.csv, "w") as f:
                f.write("backend," + rows_to_csv([]).splitlines()[0] + "\n")
                for b in names:
                    for line in rows_to_csv([Row(**{k: v for k, v in r["backends"][b].items() if k != "rounds_us"})
                                             for r in out_rows]).splitlines()[1:]:
                        f.write(f"{b},{line}\n")
        if args.plot:
            plot_backends(result, args.plot)
    return code


def plot_backends(result: Mapping[str, Any], path: str) -> None:
    """busbw of each backend against size, with the memory-copy ceiling, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta = result["rows"], result["meta"]
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for b in meta["backends"]:
        ax.plot(sizes, [r["backends"][b]["busbw"] for r in rows], "o-", label=f"{b} busbw")
    _size_axis(ax, sizes, meta)
    ax.set_ylabel("busbw (GB/s)")
    _finish(fig, ax, f"{meta['collective']} {meta['dtype']}, {meta['nranks']} ranks: {', '.join(meta['backends'])}",
            "upper left", path)


# --------------------------------------------------------------------------- entry points


def _under_launcher(environ: Mapping[str, str]) -> Optional[str]:
    """A description of the multi-rank launch this process is part of, or None."""
    try:
        from .env import detect

        env = detect(environ)
    except Exception as e:  # a half-set environment: let the ranks report it properly
        return f"the launcher environment is not usable ({str(e).splitlines()[0]})"
    if env.world_size > 1:
        return f"this process is rank {env.rank} of {env.world_size} under {env.launcher}"
    return None


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``cpuddp bench`` with parsed ``args`` (``argv`` is what the ranks re-run under --nproc)."""
    problem = _validate(args)
    if problem:
        sys.stderr.write(f"cpuddp bench: error: {problem}\n")
        return EXIT_USAGE
    if args.nproc is not None and not os.environ.get(CHILD_MARK):
        launched = _under_launcher(os.environ)
        if launched:
            sys.stderr.write(f"cpuddp bench: error: --nproc starts its own ranks, but {launched}.\n"
                             "Fix: drop --nproc under a launcher, or run without the launcher.\n")
            return EXIT_USAGE
        return spawn(args.nproc, list(argv), timeout=args.timeout)
    try:
        return run_rank(args)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        import traceback

        from .errors import CpuddpError

        rank = os.environ.get("RANK", "?")
        if not isinstance(e, CpuddpError):  # cpuddp's own errors already say what to do
            traceback.print_exc()
        sys.stderr.write(f"cpuddp bench: rank {rank} failed: {type(e).__name__}: {e}\n")
        return EXIT_ERROR


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``cpuddp bench ...`` as a function (``argv`` without the leading ``bench``)."""
    p = argparse.ArgumentParser(prog="cpuddp bench", description="Collective bandwidth sweep (nccl-tests style).")
    add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    return run(args, ["bench", *argv])
