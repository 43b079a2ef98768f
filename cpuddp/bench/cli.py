"""``cpuddp bench``: collective bandwidth sweeps, reported the way nccl-tests reports them.

Usage::

    cpuddp bench allreduce --nproc 2                      # spawn 2 local ranks
    cpuddp bench all_gather -b 1K -e 64M -f 4 -n 20 -w 5  # sizes, iterations, warm-up
    torchrun --nproc-per-node 2 -m cpuddp bench reduce_scatter --dtype bfloat16
    mpiexec -n 4 cpuddp bench broadcast --json out.json --csv out.csv --plot out.png
    cpuddp bench allreduce --nproc 2 --min-busbw 1.0      # CI gate (exit code 4 below it)
    cpuddp bench allreduce --nproc 2 --backend gloo,shm   # both in one run, interleaved, with the ratio

Collectives: ``allreduce`` (alias ``all_reduce``), ``all_gather`` (``allgather``),
``broadcast``, ``reduce_scatter`` (``reducescatter``), ``reduce``, ``gather``, ``scatter``
(root 0), ``all_to_all`` (``alltoall``, the single-tensor form) and ``barrier`` (one row of
size 0: its time is the point).

Launch: under any launcher each rank calls :func:`cpuddp.init_distributed` (so the
launcher's variables are read, the backend is chosen and threads pinned as in training).
With ``--nproc N`` and no launcher, this process starts N local ranks itself
(``python -m cpuddp bench ...`` with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``; it hosts their rendezvous store on a port
it holds for the whole run, as torchrun's agent does), stops them all when one fails or
``--timeout`` passes -- printing each running rank's Python stack first -- and exits with
rank 0's code (:mod:`cpuddp.bench.launch`).

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
information is exchanged with two tensor collectives (:func:`cpuddp.bench.rank.exchange_json`), not
``all_gather_object``, which needs numpy.  Teardown is bounded (:data:`cpuddp.bench.rank.TEARDOWN_TIMEOUT`).

Environment read: the launcher's variables (see :mod:`cpuddp.launchers`);
``CPUDDP_BENCH_CHILD`` marks a rank started by ``--nproc`` (internal).

This module is the command line: its options, their checks, and where the run goes (this rank,
or ``--nproc`` local ranks).  It turns the parsed options into a
:class:`~cpuddp.bench.config.BenchConfig` once; the rest of the run takes that config.  It
imports nothing heavy.  The other modules of :mod:`cpuddp.bench`
are listed in its docstring.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Optional, Sequence

from cpuddp._units import parse_size

from .config import BenchConfig, parse_backends
from .sweep import ALIASES, COLLECTIVES, DTYPES, EXIT_ERROR, EXIT_USAGE, sweep_sizes

__all__ = ["add_arguments", "run", "main"]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _collective_arg(text: str) -> str:
    try:
        return ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown collective {text!r}; choose from {', '.join(COLLECTIVES)}") from None


def _dtype_arg(text: str) -> str:
    try:
        return DTYPES[text.lower()][0]
    except KeyError:
        names = sorted({v[0] for v in DTYPES.values()})
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(names)}") from None


def _backends_arg(text: str) -> list[str]:
    try:
        return parse_backends(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Removed(argparse.Action):
    """A retired option: giving it is a usage error that says why and what to do instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(f"{'/'.join(self.option_strings)} was removed: {self.why}")


_COMPARE_BARE_GONE = (
    "it timed the sweep's loop against an inline torch.distributed loop in the same initialised, pinned "
    "processes, so it could not show what cpuddp adds. To measure cpuddp's cost, time your own "
    "torch.distributed script with and without cpuddp.init_distributed(); to compare backends, use --backend a,b"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``cpuddp bench`` (short forms as in nccl-tests)."""
    p.add_argument("collective", type=_collective_arg, metavar="COLLECTIVE",
                   help=", ".join(COLLECTIVES[:-1]) + " or " + COLLECTIVES[-1])
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
    p.add_argument("--rounds", type=int, default=5, help="--backend a,b: rounds per size and backend (default 5)")
    p.add_argument("--compare-bare", action=_Removed, why=_COMPARE_BARE_GONE)


def _validate(cfg: BenchConfig) -> Optional[str]:
    if cfg.iters < 1 or cfg.warmup < 0:
        return "--iters must be >= 1 and --warmup >= 0"
    if cfg.nproc is not None and cfg.nproc < 1:
        return "--nproc must be >= 1"
    if cfg.rounds < 1:
        return "--rounds must be >= 1"
    try:
        sweep_sizes(cfg.min, cfg.max, cfg.factor)
    except ValueError as e:
        return str(e)
    if cfg.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            return "--plot needs matplotlib, which is not installed. Fix: pip install 'cpuddp[bench]'"
    return None


def _under_launcher(environ: Mapping[str, str]) -> Optional[str]:
    """A description of the multi-rank launch this process is part of, or None."""
    try:
        from cpuddp.launchers.registry import detect

        env = detect(environ)
    except Exception as e:  # a half-set environment: let the ranks report it properly
        return f"the launcher environment is not usable ({str(e).splitlines()[0]})"
    if env.world_size > 1:
        return f"this process is rank {env.rank} of {env.world_size} under {env.launcher}"
    return None


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``cpuddp bench`` with parsed ``args`` (``argv`` is what the ranks re-run under --nproc).

    ``args`` becomes a :class:`~cpuddp.bench.config.BenchConfig` here, once; everything below
    takes that config.
    """
    from .launch import CHILD_MARK, spawn

    cfg = BenchConfig.from_args(args)
    problem = _validate(cfg)
    if problem:
        sys.stderr.write(f"cpuddp bench: error: {problem}\n")
        return EXIT_USAGE
    if cfg.nproc is not None and not os.environ.get(CHILD_MARK):
        launched = _under_launcher(os.environ)
        if launched:
            sys.stderr.write(f"cpuddp bench: error: --nproc starts its own ranks, but {launched}.\n"
                             "Fix: drop --nproc under a launcher, or run without the launcher.\n")
            return EXIT_USAGE
        return spawn(cfg.nproc, list(argv), timeout=cfg.timeout)
    try:
        from .rank import run_rank

        return run_rank(cfg)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        import traceback

        from cpuddp.errors import CpuddpError

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
