"""``cpuddp bench``: collective bandwidth sweeps, reported the way nccl-tests reports them.

Usage::

    cpuddp bench allreduce --nproc 2                      # spawn 2 local ranks
    cpuddp bench all_gather -b 1K -e 64M -f 4 -n 20 -w 5  # sizes, iterations, warm-up
    torchrun --nproc-per-node 2 -m cpuddp bench reduce_scatter --dtype bfloat16
    mpiexec -n 4 cpuddp bench broadcast --json out.json --csv out.csv --plot out.png
    cpuddp bench allreduce --nproc 2 --min-busbw 1.0      # CI gate (exit code 4 below it)
    cpuddp bench allreduce --nproc 2 --backend gloo,shm   # both in one run, interleaved, with the ratio

Collectives: ``allreduce`` (alias ``all_reduce``), ``all_gather`` (``allgather``),
``broadcast``, ``reduce_scatter`` (``reducescatter``).

Launch: under any launcher each rank calls :func:`cpuddp.init_distributed` (so the
launcher's variables are read, the backend is chosen and threads pinned as in training).
With ``--nproc N`` and no launcher, this process starts N local ranks itself
(``python -m cpuddp bench ...`` with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``; it hosts their rendezvous store on a port
it holds for the whole run, as torchrun's agent does), stops them all when one fails or
``--timeout`` passes -- printing each running rank's Python stack first -- and exits with
rank 0's code (:mod:`cpuddp.bench_launch`).

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

``--backend a,b,...`` times each backend in the same ranks (the default group is the first's;
the others get ``new_group(backend=...)``), ``--rounds`` rounds per size and backend in ABBA
order, and prints the median round of each and the speed-up of each over the first.  Rank
information is exchanged with two tensor collectives (:func:`exchange_json`), not
``all_gather_object``, which needs numpy.  Teardown is bounded (:data:`TEARDOWN_TIMEOUT`).

Environment read: the launcher's variables (see :mod:`cpuddp.launchers`);
``CPUDDP_BENCH_CHILD`` marks a rank started by ``--nproc`` (internal).

The modules, by job: :mod:`~cpuddp.bench_cli` (options and where the run goes),
:mod:`~cpuddp.bench_sweep` (the nccl-tests arithmetic: sizes, bus factors, rows, summary,
exit code; pure), :mod:`~cpuddp.bench_report` (text table, CSV, JSON, plots),
:mod:`~cpuddp.bench_rank` (inside a rank: timing, collectives, checks) and
:mod:`~cpuddp.bench_launch` (``--nproc``).  Byte sizes: :mod:`cpuddp._units`.
"""


from __future__ import annotations

from typing import Any

from ._units import format_size, parse_size
from .bench_cli import add_arguments, main, parse_backends, run
from .bench_launch import CHILD_MARK, spawn
from .bench_rank import TEARDOWN_TIMEOUT, exchange_json, measure_copy_bandwidth, run_rank
from .bench_report import (
    format_backend_head,
    format_backend_row,
    format_row,
    format_rows,
    format_summary,
    header_lines,
    plot,
    plot_backends,
    rows_to_csv,
)
from .bench_sweep import (
    COLLECTIVES,
    EXIT_BELOW_MIN,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_WRONG,
    Row,
    backend_row,
    bus_factor,
    exit_code,
    make_row,
    shape_size,
    summarize,
    sweep_sizes,
)

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
    # defined in the submodules, importable from here as before the split:
    "CHILD_MARK",
    "TEARDOWN_TIMEOUT",
    "backend_row",
    "exchange_json",
    "format_backend_head",
    "format_backend_row",
    "format_row",
    "format_summary",
    "header_lines",
    "measure_copy_bandwidth",
    "parse_backends",
    "plot",
    "plot_backends",
    "rows_to_csv",
    "run_rank",
    "spawn",
]


def __getattr__(name: str) -> Any:
    # Deprecated, kept for one release: the bind-then-release port and the environment that went with it.
    if name in ("child_env", "free_port"):
        from . import bench_launch as launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
