"""cpuddp.backends.shm.python.numa_plan: the node's reduction plan over its NUMA nodes, from fake
topologies (1, 2 and 4 NUMA nodes, uneven groups, unknown and ambiguous ranks).  Pure: the real
groups are in tests/test_shm_numa.py."""

from __future__ import annotations

import itertools

import pytest

from cpuddp.backends.shm.python.numa_plan import FORCE_VAR, forced_nodes, plan_numa, rank_node
from cpuddp.errors import BackendError
from cpuddp.topology import synthetic_topology


def numa_map(sockets: int, cores: int, numa_per_socket: int = 1) -> dict:
    """CPU -> NUMA node of a fake machine, as the group reads it from cpuddp.topology."""
    topo = synthetic_topology(sockets, cores, 2, numa_per_socket=numa_per_socket)
    return {c.cpu: c.numa for c in topo.cpus}


def pinned(numa: dict, per_rank: list) -> list:
    """Each rank's allowed CPUs: a list of CPU ids per rank."""
    assert all(c in numa for cpus in per_rank for c in cpus)
    return per_rank


def test_one_numa_node_is_the_single_level_plan():
    numa = numa_map(1, 8)
    plan = plan_numa(pinned(numa, [[0, 8], [1, 9], [2, 10], [3, 11]]), numa)
    assert not plan.two_level
    assert plan.groups == ((0, 1, 2, 3),) and plan.nodes == (0,) and plan.leaders == (0,)
    assert plan.rank_nodes == (0, 0, 0, 0)
    assert "every local rank is on NUMA node 0" in plan.reason


def test_two_sockets_two_groups():
    numa = numa_map(2, 4)  # node 0: CPUs 0-3 (+8-11), node 1: CPUs 4-7 (+12-15)
    plan = plan_numa([[0], [1], [4], [5]], numa)
    assert plan.two_level
    assert plan.groups == ((0, 1), (2, 3)) and plan.nodes == (0, 1) and plan.leaders == (0, 2)
    assert plan.parts == 2
    assert [plan.intra_owner(g, p) for g in (0, 1) for p in (0, 1)] == [0, 1, 2, 3]
    assert plan.my_parts(3) == (1,) and plan.group_of(3) == 1
    assert "2 on node 0, 2 on node 1" in plan.reason


def test_groups_follow_nodes_not_rank_order():
    """Ranks interleaved over the sockets: group by node, ascending node id, then local rank."""
    numa = numa_map(2, 4)
    plan = plan_numa([[4, 12], [0, 8], [5], [1]], numa)
    assert plan.groups == ((1, 3), (0, 2)) and plan.nodes == (0, 1) and plan.leaders == (1, 0)
    assert plan.rank_nodes == (1, 0, 1, 0)


def test_four_numa_nodes():
    numa = numa_map(2, 8, numa_per_socket=2)  # nodes 0..3 of 4 cores each
    cpus = [[c] for c in (0, 1, 4, 5, 8, 9, 12, 13)]
    plan = plan_numa(cpus, numa)
    assert plan.groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and plan.nodes == (0, 1, 2, 3)
    assert plan.leaders == (0, 2, 4, 6)


def test_uneven_groups_share_the_parts():
    """3 ranks on node 0, 1 on node 1: parts = 3; the lone rank of node 1 reduces all three parts
    of its group and owns sub-part 1 of each at the second level."""
    numa = numa_map(2, 4)
    plan = plan_numa([[0], [1], [2], [4]], numa)
    assert plan.groups == ((0, 1, 2), (3,)) and plan.parts == 3
    assert [plan.intra_owner(0, p) for p in range(3)] == [0, 1, 2]
    assert [plan.intra_owner(1, p) for p in range(3)] == [3, 3, 3]
    assert [plan.cross_owner(h, 2) for h in (0, 1)] == [2, 3]
    assert plan.my_parts(3) == (0, 1, 2)


@pytest.mark.parametrize("cpus, why", [
    ([[0], [1], [4], [0, 4]], "local rank 3 may run on NUMA nodes 0, 1"),       # spans both sockets
    ([[0], [1], [4], []], "local rank 3 has no CPUs listed"),                     # unknown
    ([[0], [99], [4], [5]], "local rank 1 runs on CPU 99, which the topology"),   # a CPU the map lacks
])
def test_an_unplaced_rank_gives_the_single_level_plan(cpus, why):
    numa = numa_map(2, 4)
    plan = plan_numa(cpus, numa)
    assert not plan.two_level and plan.groups == ((0, 1, 2, 3),) and plan.nodes == (None,)
    assert why in plan.reason


def test_unpinned_ranks_run_one_level():
    """The usual unpinned case: every rank may run on every CPU of two sockets."""
    numa = numa_map(2, 4)
    everything = sorted(numa)
    assert not plan_numa([everything] * 4, numa).two_level


def test_one_rank_per_node_is_one_level():
    numa = numa_map(2, 4, numa_per_socket=2)
    plan = plan_numa([[0], [2], [4], [6]], numa)
    assert not plan.two_level and "one local rank on each of 4 NUMA nodes" in plan.reason


def test_every_element_is_reduced_by_exactly_one_rank_at_each_level():
    """Over every grouping of up to 6 ranks on up to 3 nodes: the first-level owners of each
    (group, part) are members of the group, and the second level gives each (part, sub-part)
    one owner -- so the result cannot depend on which rank computes it."""
    for n in range(2, 7):
        for nodes in itertools.product(range(3), repeat=n):
            plan = plan_numa([[0]] * n, {0: 0}, forced=nodes)
            if not plan.two_level:
                continue
            for g, ranks in enumerate(plan.groups):
                assert all(plan.intra_owner(g, p) in ranks for p in range(plan.parts))
                assert {p for r in ranks for p in plan.my_parts(r)} == set(range(plan.parts))
            for p in range(plan.parts):
                owners = [plan.cross_owner(h, p) for h in range(len(plan.groups))]
                assert [plan.group_of(o) for o in owners] == list(range(len(plan.groups)))


def test_the_plan_is_the_same_whoever_computes_it():
    numa = numa_map(2, 4)
    cpus = [[5], [0], [1], [4], [6], [2]]
    assert plan_numa(cpus, numa) == plan_numa([list(c) for c in cpus], dict(reversed(list(numa.items()))))


def test_rank_node():
    numa = {0: 0, 1: 0, 2: 1}
    assert rank_node([1, 0], numa) == (0, "")
    assert rank_node([2], numa) == (1, "")
    assert rank_node([0, 2], numa)[0] is None


def test_forced_nodes():
    assert forced_nodes({}) is None and forced_nodes({FORCE_VAR: " "}) is None
    assert forced_nodes({FORCE_VAR: "0,0,1,1"}) == (0, 0, 1, 1)
    plan = plan_numa([[0]] * 4, {0: 0}, forced=forced_nodes({FORCE_VAR: "0,0,1,1"}))
    assert plan.groups == ((0, 1), (2, 3))
    for bad in ("0,x", "-1,0", ","):
        with pytest.raises(BackendError, match=FORCE_VAR):
            forced_nodes({FORCE_VAR: bad})
    with pytest.raises(BackendError, match="2 NUMA node"):
        plan_numa([[0]] * 4, {0: 0}, forced=(0, 1))
