"""Where the shm segment's pages are: each rank's slots are allocated by that rank (first touch,
so on its NUMA node), and ``move_pages`` says which node holds them.  The plan itself is tested
pure in tests/test_shm_numa_plan.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cpuddp.backends.shm import check as shm_check
from cpuddp.backends.shm.placement import PAGE, page_nodes, slot_nodes
from cpuddp.backends.shm.segment import Segment, create_segment
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

    from cpuddp.backends.shm.numa_plan import rank_node
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
    code = ("from cpuddp.backends.shm.segment import Segment, create_segment\n"
            "from cpuddp.backends.shm.placement import slot_nodes\n"
            "fd, _ = create_segment(2, 16384)\n"
            "seg = Segment(fd, 1, 2, 16384)\n"
            "print(slot_nodes(seg, 1))\n")
    out = subprocess.run(["numactl", f"--membind={node}", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "None":
        pytest.skip("move_pages(2) is unavailable here")
    assert out.stdout.strip() == f"{{{node}: 8}}", out.stdout
