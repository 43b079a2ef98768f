"""Every collective of the shm group against gloo's result, on 2, 3 and 4 real ranks (3 and 4
oversubscribe this machine's CPUs: correctness only), in every layout.

Each case runs on the shm group (the default group) and on a gloo group of the same ranks with
the same values; the results must be equal element for element.  The values are small whole
numbers, so every sum and product is exact in every dtype and any reduction order.  On the shm
side each rank holds its tensors in a layout of its own (contiguous, a strided view into a
bigger tensor, a transposed tensor: rank r and case k take layout ``(r + k) % 3``), so ranks
with the same values in different layouts must still agree; memory outside a view must keep
its sentinel.  On the gloo side the tensors are contiguous (gloo gets strided tensors wrong,
which is why the shm group never hands it one).  The cases are in tests/shm_cases.py (the
namespace-hosts run, tests/test_shm.py, uses them too).
"""

from __future__ import annotations

import pytest

from cpuddp.testing import run_distributed

pytestmark = pytest.mark.slow


def _every_collective(numels, dtypes):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # a rank imports its helpers from tests/
    from shm_cases import every_collective

    return every_collective(numels, dtypes)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_matches_gloo_in_every_layout(n):
    numels = (0, 1, 13, 300001) if n == 2 else (1, 300001)
    dtypes = ("float32", "int64", "bfloat16") if n == 2 else ("float32",)
    res = run_distributed(_every_collective, n, args=(numels, dtypes), backend="shm", timeout=600)
    for r in res:
        assert r["bad"] == [], r["bad"][:20]
        assert not r["gloo_inside"], "a one-node shm group made a gloo group"  # so every call above was shm's
        assert r["shm_calls"] > 50, r
