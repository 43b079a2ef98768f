"""The shm engine's one-op reductions over every rank's slot (``ops.rows_reducer``), in one
process: the same result whatever the thread count and wherever the output lives (so a call
gives the same bits run to run), rank order everywhere: torch's one op where its kernel keeps
that order, a rank-order loop where it would not (floating-point sums, float16/bfloat16, the
bitwise ops) -- the native data path's order (tests/test_shm_native.py)."""

from __future__ import annotations

import pytest
import torch

from cpuddp.backends.shm.python.ops import rows_reducer

FNS = (torch.add, torch.mul, torch.minimum, torch.maximum)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8,
          torch.bool)


def _rows(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        data = torch.rand(n, k + 64, generator=g) > 0.5
    elif dtype.is_floating_point:
        data = (torch.randn(n, k + 64, generator=g) * 3).to(dtype)
    else:
        data = torch.randint(0, 5, (n, k + 64), generator=g).to(dtype)
    return data[:, 3:3 + k]  # rows a slot apart, as the engine's view


def _loop(rows: torch.Tensor, fn) -> torch.Tensor:
    acc = rows[0].clone()
    for r in rows[1:]:
        fn(acc, r, out=acc)
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
def test_same_bits_for_every_thread_count_and_output_place(fn, dtype):
    red = rows_reducer(fn, dtype)
    rows = _rows(8, 100003, dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3, 8):
            torch.set_num_threads(t)
            out = torch.empty(100003 + 7, dtype=dtype)[7:]
            red(rows, out)
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_every_reduction_runs_in_rank_order(n):
    exact = [(torch.mul, d) for d in DTYPES] + [(torch.minimum, d) for d in DTYPES]
    exact += [(torch.maximum, d) for d in DTYPES] + [(torch.add, d) for d in DTYPES]
    exact += [(torch.bitwise_xor, torch.int32), (torch.bitwise_and, torch.uint8), (torch.bitwise_or, torch.bool)]
    for fn, dtype in exact:
        rows = _rows(n, 5001, dtype, seed=n)
        out = torch.empty(5001, dtype=dtype)
        rows_reducer(fn, dtype)(rows, out)
        assert torch.equal(out, _loop(rows, fn)), (fn.__name__, dtype, n)
    for dtype in (torch.float32, torch.float64):  # rows of every magnitude: any other order rounds otherwise
        rows = _rows(n, 5001, dtype, seed=n) * torch.logspace(-6, 6, n, dtype=dtype)[:, None]
        out = torch.empty(5001, dtype=dtype)
        rows_reducer(torch.add, dtype)(rows, out)
        assert torch.equal(out, _loop(rows, torch.add)), (dtype, n)
