"""Where the shm segment's pages are: each rank's slots are allocated by that rank (first touch,
so on its NUMA node), and ``move_pages`` says which node holds them.  The plan itself is tested
pure in tests/test_shm_numa_plan.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cpuddp.backends.shm.protocol import check as shm_check
from cpuddp.backends.shm.protocol.placement import OS_PAGE as PAGE, page_nodes, slot_nodes
from cpuddp.backends.shm.protocol.segment import Segment, create_segment
from cpuddp.testing import run_distributed

SLOT = 4 * PAGE
SLOT_DEFAULT_PAGES = shm_check.DEFAULT_SLOT // PAGE  # a rank's slot in a group formed with the defaults


def _allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_creation_reserves_the_control_lines_and_each_rank_its_own_slots():
    """Local rank 0 allocates only the header, control lines and rings; each slot is allocated by
    the rank that maps it as its own (the kernel places a page where its allocator runs)."""
    n = 3
    _counters, slots_at, total = shm_check.layout(n, SLOT)
    fd, _token = create_segment(n, SLOT)
    segs = []
    try:
        assert os.fstat(fd).st_size == total
        assert _allocated(fd) == slots_at  # no slot yet: nobody has touched one
        for r in range(n):
            segs.append(Segment(os.dup(fd), r, n, SLOT))
            assert _allocated(fd) == slots_at + (r + 1) * 2 * SLOT, r  # rank r's two slots, no more
        assert segs[0].own_slots(1) == [(slots_at + SLOT, SLOT), (slots_at + (n + 1) * SLOT, SLOT)]
    finally:
        for s in segs:
            s.close()
        os.close(fd)


def test_page_nodes_of_an_unmapped_range_and_of_own_slots():
    n = 2
    fd, _token = create_segment(n, SLOT)
    seg = Segment(fd, 0, n, SLOT)
    try:
        got = slot_nodes(seg, 0)
        if got is None:
            pytest.skip("move_pages(2) is unavailable here")
        assert sum(got.values()) == 2 * SLOT // PAGE and all(node >= 0 for node in got), got
        assert page_nodes(seg.address(seg.own_slots(0)[0][0]), 1) == [min(got)]
    finally:
        seg.close()


def _my_slots_node():
    """In a rank: the NUMA nodes of this rank's slot pages, and the node its CPUs are on."""
    import torch.distributed as dist

    from cpuddp.backends.shm.python.numa_plan import rank_node
    from cpuddp.topology import read_topology
    from cpuddp.topology.here import allowed_cpus

    pg = dist.distributed_c10d._get_default_group()
    seg = pg._eng.seg
    numa = {c.cpu: c.numa for c in read_topology().cpus}
    dist.barrier()  # every rank has reserved its slots (the group formed), so reading a peer's maps it
    return {"mine": slot_nodes(seg, seg.local_rank), "node": rank_node(allowed_cpus(), numa)[0],
            "peers": {r: slot_nodes(seg, r) for r in range(seg.size)}}


@pytest.mark.slow
@pytest.mark.parametrize("pin", [False, True])
def test_each_ranks_slots_are_on_its_numa_node(pin):
    res = run_distributed(_my_slots_node, 2, backend="shm", timeout=120, pin=pin)
    if res[0]["mine"] is None:
        pytest.skip("move_pages(2) is unavailable here")
    for r, got in enumerate(res):
        if got["node"] is not None:  # a rank whose CPUs are on one NUMA node: its slots are there
            assert got["mine"] == {got["node"]: 2 * SLOT_DEFAULT_PAGES}, (r, got)
        assert got["peers"] == res[0]["peers"], "every rank sees the same placement"


def test_numactl_membind_is_honoured():
    """A rank run under ``numactl --membind=N`` gets its slots on node N (the policy of the
    allocating process applies: nothing in cpuddp overrides it)."""
    if shutil.which("numactl") is None:
        pytest.skip("numactl is not installed")
    probe = subprocess.run(["numactl", "--show"], capture_output=True, text=True, timeout=30)
    nodes = [ln.split(":", 1)[1].split() for ln in probe.stdout.splitlines() if ln.startswith("membind:")]
    if probe.returncode != 0 or not nodes:
        pytest.skip(f"numactl cannot run here: {probe.stderr[:200]}")
    node = nodes[0][-1]
    code = ("from cpuddp.backends.shm.protocol.segment import Segment, create_segment\n"
            "from cpuddp.backends.shm.protocol.placement import slot_nodes\n"
            "fd, _ = create_segment(2, 16384)\n"
            "seg = Segment(fd, 1, 2, 16384)\n"
            "print(slot_nodes(seg, 1))\n")
    out = subprocess.run(["numactl", f"--membind={node}", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "None":
        pytest.skip("move_pages(2) is unavailable here")
    assert out.stdout.strip() == f"{{{node}: 8}}", out.stdout


# --------------------------------------------------------------------------- the two-level all_reduce

NUMELS = (1, 37, 5000, 70001)  # 70001 floats: several rounds of a 64 KiB slot, uneven parts


def _inputs(rank: int, numel: int, dtype):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 10 ** (rank % 3)).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def _all_reduces():
    """In a rank: each case's all_reduce, twice (the same bits both times), and what ran."""
    import ctypes
    import hashlib

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()
    out = {"two_level": pg._eng.levels is not None, "reason": pg.reason, "digests": {}, "values": {}}
    cases = [(torch.float32, dist.ReduceOp.SUM), (torch.float64, dist.ReduceOp.SUM), (torch.int64, dist.ReduceOp.SUM),
             (torch.float32, dist.ReduceOp.MAX), (torch.int32, dist.ReduceOp.PRODUCT), (torch.float32, dist.ReduceOp.AVG)]
    for dtype, op in cases:
        for numel in NUMELS:
            key = f"{dtype}/{op}/{numel}"
            got = []
            for _ in range(2):
                t = _inputs(rank, numel, dtype)
                if op == dist.ReduceOp.PRODUCT:
                    t = t.remainder(3) + 1
                dist.all_reduce(t, op=op)
                got.append(hashlib.sha256(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).hexdigest())
            out["digests"][key] = got
            out["values"][key] = t.tolist() if numel < 100 else t[:: max(1, numel // 97)].tolist()
    out["mixed"] = _mixed(rank, dist.get_world_size())
    return out


def _mixed(rank: int, n: int) -> list:
    """The two-level all_reduce between one-level collectives (the rounds of each share the two
    buffers): what differs from the exact integer result, by call."""
    import torch
    import torch.distributed as dist

    wrong = []
    for i, numel in enumerate((5, 40001)):
        t = torch.arange(numel, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(t)
        if not torch.equal(t, torch.arange(numel, dtype=torch.int64) * (n * (n + 1) // 2)):
            wrong.append(f"all_reduce {i}")
        part = torch.empty(numel, dtype=torch.int64)
        dist.reduce_scatter_tensor(part, torch.full((numel * n,), rank + 1, dtype=torch.int64))
        if not bool((part == n * (n + 1) // 2).all()):
            wrong.append(f"reduce_scatter {i}")
        every = torch.empty(numel * n, dtype=torch.int64)
        dist.all_gather_into_tensor(every, torch.full((numel,), rank, dtype=torch.int64))
        if not torch.equal(every, torch.arange(n).repeat_interleave(numel)):
            wrong.append(f"all_gather {i}")
        b = torch.full((numel,), rank, dtype=torch.int64)
        dist.broadcast(b, n - 1)
        if not bool((b == n - 1).all()):
            wrong.append(f"broadcast {i}")
    return wrong


def _reference(n: int, key: str):
    import torch

    dtype_name, op, numel = key.split("/")
    dtype = getattr(torch, dtype_name.split(".")[1])
    rows = torch.stack([_inputs(r, int(numel), dtype) for r in range(n)]).double()
    if "PRODUCT" in op:
        rows = rows.remainder(3) + 1
        return rows.prod(0)
    if "MAX" in op:
        return rows.amax(0)
    total = rows.sum(0)
    return total / n if "AVG" in op else total


def _check_all_reduces(res: list, n: int) -> None:
    import torch

    for r, got in enumerate(res):
        assert got["mixed"] == [], (r, got["mixed"])
        for key, (first, second) in got["digests"].items():
            assert first == second, f"rank {r}: {key} gave different bits twice"
        assert got["digests"] == res[0]["digests"], f"rank {r}'s results differ from rank 0's"
    for key, values in res[0]["values"].items():
        want = _reference(n, key)
        numel = int(key.split("/")[2])
        want = want if numel < 100 else want[:: max(1, numel // 97)]
        torch.testing.assert_close(torch.tensor(values, dtype=torch.float64), want, rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("nodes", ["0,0,1", "0,1,0,1", "1,1,0,0", "2,0,1,0,2"])
def test_the_two_level_all_reduce_is_exact_and_the_same_on_every_rank(nodes):
    """A fake multi-NUMA plan on this machine (``CPUDDP_SHM_NUMA``, oversubscribed ranks): every
    op and dtype, one round and several, uneven parts, 2 and 3 groups, groups in and out of rank
    order; bit-identical across ranks and calls; between one-level collectives."""
    n = len(nodes.split(","))
    res = run_distributed(_all_reduces, n, backend="shm", timeout=300,
                          env={"CPUDDP_SHM_SLOT": "64K", "CPUDDP_SHM_NUMA": nodes})
    assert all(r["two_level"] for r in res), [r["reason"] for r in res]
    assert "two levels" in res[0]["reason"], res[0]["reason"]
    _check_all_reduces(res, n)


@pytest.mark.slow
def test_one_level_without_the_plan_and_the_same_results_within_rounding():
    one = run_distributed(_all_reduces, 4, backend="shm", timeout=300, env={"CPUDDP_SHM_SLOT": "64K"})
    assert not any(r["two_level"] for r in one), [r["reason"] for r in one]
    _check_all_reduces(one, 4)
    two = run_distributed(_all_reduces, 4, backend="shm", timeout=300,
                          env={"CPUDDP_SHM_SLOT": "64K", "CPUDDP_SHM_NUMA": "0,0,1,1"})
    for key, digests in one[0]["digests"].items():
        if "int" in key or "MAX" in key:  # exact ops: the same bits on either path
            assert two[0]["digests"][key] == digests, key


@pytest.mark.slow
def test_a_numa_override_that_does_not_fit_the_node_is_a_clear_error_on_every_rank():
    from cpuddp.errors import RankFailedError

    with pytest.raises(RankFailedError, match="CPUDDP_SHM_NUMA names 4 NUMA node") as info:
        run_distributed(_all_reduces, 3, backend="shm", timeout=120, env={"CPUDDP_SHM_NUMA": "0,0,1,2"})
    assert "Fix: give one NUMA node per local rank" in str(info.value)


def _own_override():
    """In a rank: a group formed while this rank's CPUDDP_SHM_NUMA differs from its peers' --
    each rank contributes only its own entry (rank 1 says node 1 in its copy) -- and a store
    rewrite of every key the group left."""
    import os

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    os.environ["CPUDDP_SHM_NUMA"] = {0: "0,0,1", 1: "0,1,1", 2: "0,0,1"}[rank]
    pg = dist.new_group(list(range(3)), backend="shm")
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t, group=pg)
    return {"reason": pg.reason, "two_level": pg._eng.levels is not None, "sum": t[0].item(),
            "groups": pg._eng.levels.plan.groups if pg._eng.levels is not None else None}


@pytest.mark.slow
def test_every_rank_plans_from_the_segment_each_from_its_own_node():
    """The NUMA nodes travel through the segment (never the store, which others can write): every
    rank plans the same groups from the same words, each rank's word its own."""
    res = run_distributed(_own_override, 3, backend="shm", timeout=180)
    for got in res:
        assert got["sum"] == 6.0 and got["two_level"], got
        assert got["groups"] == ((0,), (1, 2)), got
    assert len({got["reason"] for got in res}) == 1, res


def _with_compute_cpus():
    """In a rank: a group whose options name this rank's compute CPUs (what the pinning plan
    gives), CPU 99 -- one this machine lacks -- for rank 2."""
    import torch
    import torch.distributed as dist

    from cpuddp.backends.shm.api import ShmOptions
    from cpuddp.topology.here import allowed_cpus

    rank = dist.get_rank()
    before = allowed_cpus()
    cpus = {0: (0,), 1: (min(1, max(before)),), 2: (99,)}[rank]
    pg = dist.new_group(list(range(3)), backend="shm", pg_options=ShmOptions(cpus=cpus))
    t = torch.ones(5)
    dist.all_reduce(t, group=pg)
    return {"reason": pg.reason, "sum": t.tolist(), "restored": allowed_cpus() == before}


@pytest.mark.slow
def test_the_options_compute_cpus_place_the_rank_and_the_forming_thread_gets_its_mask_back():
    res = run_distributed(_with_compute_cpus, 3, backend="shm", timeout=180)
    for got in res:
        assert got["sum"] == [3.0] * 5 and got["restored"], got
        assert "one level: local rank 2 runs on CPU 99, which the topology does not place" in got["reason"], got
