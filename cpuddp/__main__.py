"""The ``cpuddp`` command line (also ``python -m cpuddp``).

Usage::

    cpuddp doctor [--json]              # what cpuddp sees here, and what it would do
    cpuddp bench COLLECTIVE [options]   # nccl-tests style sweep: allreduce, all_gather,
                                        # broadcast, reduce_scatter (see cpuddp.bench)
    cpuddp run [options] script.py ...  # plan ranks/CPUs/threads and launch (see cpuddp.run)

``cpuddp doctor`` never imports torch and answers in well under two seconds.
``cpuddp bench`` runs inside each rank of any launcher, or starts ``--nproc N`` local ranks.
Exit codes: 0 success, 1 error, 2 usage; ``bench`` also 3 (wrong results) and 4 (below
``--min-busbw``); ``doctor`` also 3 with ``--strict`` when it has warnings.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``cpuddp`` parser with its subcommands (imports nothing heavy)."""
    from cpuddp.bench import cli as bench
    from cpuddp.doctor import command as doctor

    p = argparse.ArgumentParser(prog="cpuddp", description="Distributed data-parallel PyTorch on CPU clusters.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    d = sub.add_parser("doctor", help="report the launcher, backends, CPU, pinning plan and warnings",
                       description=(doctor.__doc__ or "").split("\n\n")[0])
    doctor.add_arguments(d)
    b = sub.add_parser("bench", help="collective bandwidth sweep (allreduce, all_gather, broadcast, reduce_scatter)",
                       description=(bench.__doc__ or "").split("\n\n")[0],
                       epilog="Exit codes: 0 ok, 1 error, 2 usage, 3 wrong results, 4 below --min-busbw.")
    bench.add_arguments(b)
    from cpuddp.run import command as run

    r = sub.add_parser("run", help="size, pin and launch a training script (torchrun, srun or MPI)",
                       description=(run.__doc__ or "").split("\n\n")[0],
                       epilog="Exit codes: the launcher's; 2 for a request that cannot be met.")
    run.add_arguments(r)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``cpuddp`` console script; returns the exit code."""
    from . import _procs

    _procs.rank_setup()  # a rank started by `cpuddp bench --nproc`: die with it, answer SIGUSR1 with a stack
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from cpuddp.doctor import command as doctor

        return doctor.run(args)
    if args.command == "run":
        from cpuddp.run import command as run

        return run.run(args)
    from cpuddp.bench import cli as bench

    return bench.run(args, argv)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("CPUDDP_BENCH_CHILD"):
        # A rank started by `cpuddp bench --nproc`: its process group is already shut down;
        # skip interpreter teardown, where a rank has been seen to hang in destructors.
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
