"""What a shm rank pays while it waits for a late peer: CPU seconds and context switches.

    python benchmarks/wait_cost.py                 # 2 ranks, the peer 3 s late, 3 repeats

Rank 1 sleeps ``--late`` seconds before an all_reduce; rank 0 enters it at once and reports the
wait's wall time, its CPU time (user + system, ``getrusage``) and its voluntary context
switches -- the cost of the shm wait policy (cpuddp/backends/shm/protocol/wait.py) for a long wait.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _wait(late: float) -> dict:
    import resource
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(1024)
    dist.all_reduce(t)  # both in, warm
    if dist.get_rank() == 1:
        time.sleep(late)
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    dist.all_reduce(t)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "voluntary_switches": after.ru_nvcsw - before.ru_nvcsw,
            "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--late", type=float, default=3.0, help="seconds rank 1 is late (default 3)")
    ap.add_argument("--repeats", type=int, default=3)
    opts = ap.parse_args(argv)
    from cpuddp.testing import run_distributed

    runs = [run_distributed(_wait, 2, args=(opts.late,), backend="shm", timeout=120 + opts.late)[0]
            for _ in range(opts.repeats)]
    for r in runs:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
