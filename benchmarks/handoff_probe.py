"""Is a slow mode the engine's, or the machine's?  A cross-core hand-off with no cpuddp code.

    python benchmarks/handoff_probe.py                       # CPUs 0 and 1, 1 MiB, 12 blocks
    python benchmarks/handoff_probe.py --cpus 0,8 --blocks 20 --pause 0.5

Two processes, pinned to one CPU each, pass a float32 buffer back and forth through an
anonymous shared mapping: one writes it (``copy_``), the other reads it (``sum``), turn by turn
on a spin flag -- the data movement of a 2-rank shm round without the engine.  Each block is
``--iters`` hand-offs, then a pause (the CPUs idle, as between a benchmark's sizes or calls);
the block's median microseconds per hand-off are printed, one number per block, then the
spread.  On a machine whose cores stay put, the blocks agree; where a hypervisor moves virtual
CPUs between cores that share a cache and cores that do not, they fall in two modes, and so will
any shared-memory collective (docs/benchmarks.md: the 4-5x "slow mode" of 2-vCPU AMD EPYC VMs).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time
from typing import List, Optional, Sequence


def _side(me: int, flag: ctypes.c_int64, buf, src, blocks: int, iters: int, pause: float) -> List[float]:
    """This process's hand-offs: the median seconds of each block (its turns, waits included)."""
    medians = []
    for blk in range(blocks):
        times = []
        for i in range(blk * iters, (blk + 1) * iters):
            if i % 2 == me:
                t0 = time.perf_counter()
                while flag.value != i:
                    pass
                if me == 0:
                    buf.copy_(src)
                else:
                    buf.sum()
                flag.value = i + 1
                times.append(time.perf_counter() - t0)
            else:
                while flag.value != i + 1:
                    pass
        medians.append(statistics.median(times))
        time.sleep(pause)
    return medians


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default="0,1", help="the two CPUs, comma-separated (default 0,1)")
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes handed over (default 1 MiB)")
    ap.add_argument("--blocks", type=int, default=12, help="blocks of hand-offs (default 12)")
    ap.add_argument("--iters", type=int, default=400, help="hand-offs per block (default 400)")
    ap.add_argument("--pause", type=float, default=0.5, help="seconds idle after each block (default 0.5)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    cpus = [int(c) for c in args.cpus.split(",")]
    if len(cpus) != 2:
        ap.error(f"--cpus needs two CPUs, got {args.cpus!r}")

    import torch

    torch.set_num_threads(1)
    mm = mmap.mmap(-1, args.size + 4096, flags=mmap.MAP_SHARED)
    flag = ctypes.c_int64.from_buffer(mm, 0)
    buf = torch.frombuffer(mm, dtype=torch.float32, count=args.size // 4, offset=4096)
    src = torch.ones(args.size // 4)
    pid = os.fork()
    me = 0 if pid else 1
    os.sched_setaffinity(0, {cpus[me]})
    medians = _side(me, flag, buf, src, args.blocks, args.iters, args.pause)
    if not pid:
        os._exit(0)
    os.waitpid(pid, 0)
    us = [round(m * 1e6, 1) for m in medians]
    print(f"# hand-off of {args.size} bytes between CPUs {cpus[0]} and {cpus[1]}, median us per block:")
    print(" ".join(f"{u:g}" for u in us))
    print(f"# min {min(us):g}  median {statistics.median(us):g}  max {max(us):g}  max/min {max(us) / min(us):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": cpus, "size": args.size, "iters": args.iters, "pause": args.pause, "us": us}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
