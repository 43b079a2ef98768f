"""The allreduce sweep behind docs/benchmarks.md.

Usage (from the repository root)::

    python benchmarks/allreduce.py                  # 2 local ranks, gloo, 1 KiB..64 MiB x4,
                                                    # writes benchmarks/results/allreduce_gloo_2ranks.*
    python benchmarks/allreduce.py -- -n 50         # anything after -- goes to `cpuddp bench`

It is a thin wrapper over ``cpuddp bench allreduce`` (see cpuddp/bench/cli.py); the same runs
can be typed by hand, and the exact commands are printed first.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the results (default benchmarks/results)")
    args = p.parse_args(argv)

    from cpuddp.bench import cli as bench

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"allreduce_gloo_{args.nproc}ranks"
    cmd = ["allreduce", "--nproc", str(args.nproc), "-b", "1K", "-e", "64M", "-f", "4", "-w", "3", "-n", "10",
           "--json", f"{stem}.json", "--csv", f"{stem}.csv", "--plot", f"{stem}.png", *extra]
    print("# cpuddp bench " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    return bench.main(cmd)


if __name__ == "__main__":
    sys.exit(main())
