"""Minimal install: ``cpuddp.testing.run_distributed`` without pytest -- results, and a failing rank.

    python tests/minimal/run_distributed_check.py

Run by ``.ci/minimal.sh test`` in a venv with torch and cpuddp only; exits non-zero on failure.
"""

from __future__ import annotations

import sys


def _sum_of_ranks() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()


def _rank_1_fails() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 says no")
    dist.barrier()


def main() -> int:
    from cpuddp.errors import RankFailedError
    from cpuddp.testing import run_distributed

    import run_distributed_check as me  # by its module name (the script's folder is on sys.path): the ranks import it

    results = run_distributed(me._sum_of_ranks, 2, timeout=60)
    assert results == [3.0, 3.0], results
    try:
        run_distributed(me._rank_1_fails, 2, timeout=60)
    except RankFailedError as err:
        assert err.rank == 1 and "rank 1 says no" in str(err.traceback), err
    else:
        raise AssertionError("run_distributed did not raise for a failing rank")
    print(f"ok: run_distributed returned {results} and reported rank 1's ValueError")
    return 0


if __name__ == "__main__":
    sys.exit(main())
