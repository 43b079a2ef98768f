"""The shm engine's per-call work does not grow with the node's rank count, and stays exact.

* Op counts: each rank counts the aten ops (a ``TorchDispatchMode``) of small calls --
  all_reduce, reduce_scatter, all_gather, broadcast, barrier -- on 2, 4 and 8 real ranks
  (4 and 8 oversubscribe this machine's CPUs: structure, not speed).  8 ranks may need at most
  twice the ops of 2: the engine moves all slots in one op where it once ran one per peer --
  save one op per extra rank for a floating-point sum on the Python path (all_reduce,
  reduce_scatter), which adds in rank order, one row at a time, so that its bits are the native
  path's (cpuddp.backends.shm.python.ops).  On the native path a call runs no aten op at all.
* Correctness on 3, 4 and 8 ranks: every reduce op and dtype the engine takes, results
  bit-identical on every rank and equal to a reference computed in one process, for sizes
  that take one round, several rounds and uneven parts.
"""

from __future__ import annotations

import pytest

from cpuddp.testing import run_distributed

pytestmark = pytest.mark.slow

CALLS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")


def _count_ops(numel: int = 1024, reps: int = 3):
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((numel,), float(rank + 1))
    big = torch.ones(numel * n)
    out = torch.empty(numel)
    gathered = torch.empty(numel * n)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, big),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, x),
        "broadcast": lambda: dist.broadcast(x, 0),
        "barrier": lambda: dist.barrier(),
    }
    counts = {}
    for name, call in calls.items():
        call()  # warm: views, caches
        best = None
        for _ in range(reps):
            with Count() as c:
                call()
            best = len(c.ops) if best is None else min(best, len(c.ops))
            ops = c.ops
        counts[name] = (best, ops)
    return counts


def _op_counts(n: int) -> dict:
    res = run_distributed(_count_ops, n, backend="shm", timeout=300)
    return {name: max(r[name][0] for r in res) for name in CALLS}, res[0]


def test_eight_ranks_need_at_most_twice_the_ops_of_two():
    two, _ = _op_counts(2)
    four, _ = _op_counts(4)
    eight, detail = _op_counts(8)
    print("ops per call at 2/4/8 ranks:", {k: (two[k], four[k], eight[k]) for k in CALLS})
    rank_order = {"all_reduce": 8 - 2, "reduce_scatter": 8 - 2}  # float sums: one op per extra rank
    worse = [f"{name}: {eight[name]} aten ops at 8 ranks against {two[name]} at 2 (4 ranks: {four[name]}); "
             f"8 ranks ran {detail[name][1]}" for name in CALLS
             if eight[name] > 2 * max(two[name], 1) + rank_order.get(name, 0)]
    assert not worse, "\n".join(worse)


# --------------------------------------------------------------------------- exactness


def _reference_and_results(numels):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    ops = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
           "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX, "BAND": dist.ReduceOp.BAND,
           "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
    floats = ("float32", "float64", "bfloat16", "float16")
    ints = ("int32", "int64", "uint8", "int8", "bool")
    out = {"bad": [], "digests": {}}

    def data(r, numel, dtype):
        g = torch.Generator().manual_seed(1000 * r + numel)
        if dtype == torch.bool:
            return torch.rand(numel, generator=g) > 0.3
        if dtype.is_floating_point:
            return (torch.randn(numel, generator=g) * 3).to(dtype)  # not whole numbers: order shows
        return torch.randint(1, 9, (numel,), generator=g).to(dtype)

    def running(parts, op, dtype):
        fn = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
              "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
              "BXOR": torch.bitwise_xor}[op]
        acc = parts[0].clone()
        for p in parts[1:]:
            acc = fn(acc, p)
        return acc / n if op == "AVG" else acc

    for dname in floats + ints:
        dtype = getattr(torch, dname)
        for op in ops:
            if dname in floats and op in ("BAND", "BOR", "BXOR"):
                continue
            if dname in ints and op == "AVG":
                continue
            if dname == "bool" and op in ("PRODUCT",):
                continue
            for numel in numels:
                mine = data(rank, numel, dtype)
                everyone = [data(r, numel, dtype) for r in range(n)]
                want = running(everyone, op, dtype)
                # all_reduce on a strided view of the same values
                holder = torch.zeros(numel, 2, dtype=dtype)
                view = holder[:, 1]
                view.copy_(mine)
                dist.all_reduce(view, ops[op])
                # reduce_scatter of n parts of numel elements each
                rs_out = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(rs_out, torch.cat([data(rank, numel, dtype)] * n), ops[op])
                key = f"{dname}/{op}/{numel}"
                tol = dict(rtol=2e-2, atol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-6,
                                                                                                       atol=1e-6)
                for what, got in (("all_reduce", view), ("reduce_scatter", rs_out)):
                    if dtype.is_floating_point:
                        ok = torch.allclose(got.double(), want.double(), **tol, equal_nan=True)
                    else:
                        ok = torch.equal(got, want)
                    if not ok:
                        out["bad"].append(f"{what} {key}: differs from the reference")
                    out["digests"][f"{what} {key}"] = repr(got.tolist())  # exact: every value as a Python number
    # gather side: all_gather of every rank's bytes, broadcast from the last rank
    g = torch.empty(n * 1001, dtype=torch.float64)
    dist.all_gather_into_tensor(g, torch.full((1001,), float(rank), dtype=torch.float64))
    if not torch.equal(g, torch.arange(n, dtype=torch.float64).repeat_interleave(1001)):
        out["bad"].append("all_gather_into_tensor")
    lst = [torch.empty(77, dtype=torch.int16) for _ in range(n)]
    dist.all_gather(lst, torch.full((77,), rank, dtype=torch.int16))
    if any(not bool((t == r).all()) for r, t in enumerate(lst)):
        out["bad"].append("all_gather list")
    b = torch.full((3001,), float(rank))
    dist.broadcast(b, n - 1)
    if not bool((b == n - 1).all()):
        out["bad"].append("broadcast")
    return out


@pytest.mark.parametrize("n", [3, 4, 8])
def test_oversubscribed_every_op_and_dtype_bit_identical_across_ranks(n):
    numels = (1, 37, 70001)  # 70001 floats: several rounds of a 64 KiB slot, uneven parts
    res = run_distributed(_reference_and_results, n, args=(numels,), backend="shm", timeout=900,
                          env={"CPUDDP_SHM_SLOT": "64K"})
    for r, got in enumerate(res):
        assert got["bad"] == [], (r, got["bad"][:10])
        assert got["digests"] == res[0]["digests"], f"rank {r}'s results differ from rank 0's"


# --------------------------------------------------------------------------- AVG on the whole-gloo path


def _avg_on_whole_gloo():
    import os

    import torch
    import torch.distributed as dist

    import cpuddp.shm  # noqa: F401  (registers "shm")
    from cpuddp.launchers import identity

    rank, n = dist.get_rank(), dist.get_world_size()
    # every rank on a host of its own, as init would have proven it: the group runs gloo for everything
    endpoint = identity.store_endpoint(dist.distributed_c10d._get_default_store())
    proven = identity.proven_hosts(endpoint, n)
    identity.remember_hosts(endpoint, [f"node{r}" for r in range(n)])
    said, os.environ["LOCAL_WORLD_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE"), "1"  # what a launcher would say
    try:
        pg = dist.new_group(list(range(n)), backend="shm")
    finally:
        if proven is not None:
            identity.remember_hosts(endpoint, proven)
        if said is not None:
            os.environ["LOCAL_WORLD_SIZE"] = said
    out = {"reason": getattr(pg, "reason", None)}
    # what the gloo group underneath is asked for (torch 2.13's gloo averages right; 2.8's returns
    # the sum for an AVG reduce_scatter: on any torch, gloo must never be asked for AVG)
    gloo, asked = pg._world._gloo, []

    class Spy:
        def __getattr__(self, name):
            def call(*args):
                asked.extend(str(a.reduceOp.op) for a in args if hasattr(a, "reduceOp"))
                return getattr(gloo, name)(*args)
            return call

    pg._world._gloo = Spy()
    parts = torch.arange(n * 3, dtype=torch.float32) * (rank + 1)  # rank r: r+1 times 0..3n-1
    mean = torch.arange(n * 3, dtype=torch.float32) * (n + 1) / 2
    got = torch.empty(3)
    dist.reduce_scatter_tensor(got, parts, op=dist.ReduceOp.AVG, group=pg)
    out["reduce_scatter_tensor"] = (got.tolist(), mean[rank * 3:rank * 3 + 3].tolist())
    lst = torch.empty(3)
    dist.reduce_scatter(lst, list(parts.view(n, 3)), op=dist.ReduceOp.AVG, group=pg)
    out["reduce_scatter"] = (lst.tolist(), mean[rank * 3:rank * 3 + 3].tolist())
    t = parts.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
    out["all_reduce"] = (t.tolist(), mean.tolist())
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG, group=pg)
        out["int_avg"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["int_avg"] = f"{type(exc).__name__}: {exc}"
    out["asked"] = asked
    return out


def test_avg_is_a_sum_divided_on_the_whole_gloo_path_too():
    res = run_distributed(_avg_on_whole_gloo, 2, backend="gloo", timeout=120)
    for r, got in enumerate(res):
        assert "gloo for every collective" in str(got["reason"]), got["reason"]
        for what in ("reduce_scatter_tensor", "reduce_scatter", "all_reduce"):
            assert got[what][0] == got[what][1], (r, what, got[what])
        assert "average of integers" in got["int_avg"], got["int_avg"]
        assert got["asked"] and not any("AVG" in op for op in got["asked"]), got["asked"]
