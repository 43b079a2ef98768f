"""cpuddp.affinity: the pure planner on fake machines, the user-wins rules, apply/restore."""

from __future__ import annotations

import json
import logging
import os
import pickle
from itertools import combinations
from typing import Optional

import pytest

from cpuddp.affinity import (
    KMP_AFFINITY,
    PinPlan,
    apply_plan,
    current_plan,
    launcher_binding,
    pinned,
    plan_for,
    plan_pinning,
    restore,
)
from cpuddp.launchers.env import DistEnv
from cpuddp.errors import LauncherEnvError
from cpuddp.topology import LogicalCpu, Topology, synthetic_topology

XEON = synthetic_topology(2, 56, 2)  # 2 sockets x 56 cores, hyperthreaded: CPU c and c+112 are siblings


def plans(topo: Topology, n: int, **kw) -> list[PinPlan]:
    return [plan_pinning(topo, r, n, **kw) for r in range(n)]


def assert_disjoint(ps: list[PinPlan]) -> None:
    for a, b in combinations(ps, 2):
        assert not set(a.cpus + a.ccl_worker_cpus) & set(b.cpus + b.ccl_worker_cpus), (a, b)


# --------------------------------------------------------------------------- the pure planner


def test_one_rank_per_socket() -> None:
    p0, p1 = plans(XEON, 2)
    assert p0.cpus == tuple(range(56)) and p1.cpus == tuple(range(56, 112))
    assert p0.num_threads == p1.num_threads == 56
    assert p0.env["OMP_NUM_THREADS"] == "56"
    assert "split by socket" in p0.reason and "hyperthread siblings unused" in p0.reason
    assert not p0.warnings


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 56, 112])
def test_disjoint_physical_cores_within_allowed(n: int) -> None:
    ps = plans(XEON, n)
    assert_disjoint(ps)
    used = set().union(*(p.cpus for p in ps))
    assert used <= set(range(112))  # never a hyperthread sibling
    assert len(used) == 112  # every core used
    for p in ps:
        assert p.num_threads == len(p.cpus)
        if n >= 2:  # no rank straddles a socket
            assert len({XEON.cpu(c).socket for c in p.cpus}) == 1


def test_fewer_ranks_than_sockets_spans_them() -> None:
    (p,) = plans(XEON, 1)
    assert p.cpus == tuple(range(112)) and p.num_threads == 112


def test_uneven_ranks_stay_on_their_socket_and_warn() -> None:
    ps = plans(XEON, 3)
    assert [len(p.cpus) for p in ps] == [28, 28, 56]
    assert all(w.code == "unequal-shares" and "unequal shares (28 to 56 cores)" in str(w) for p in ps for w in p.warnings)
    assert str(ps[0].warnings[0]).endswith(". Fix: use a rank count that divides each socket's cores")


def test_deterministic() -> None:
    assert plans(XEON, 4) == plans(synthetic_topology(2, 56, 2), 4)


def test_use_hyperthreads() -> None:
    p0, p1 = plans(XEON, 2, use_hyperthreads=True)
    assert p0.cpus == tuple(range(56)) + tuple(range(112, 168))
    assert p0.num_threads == 112
    assert_disjoint([p0, p1])


def test_container_allowed_4_of_64() -> None:
    topo = synthetic_topology(1, 64, allowed={20, 21, 22, 23})
    ps = plans(topo, 2)
    assert [p.cpus for p in ps] == [(20, 21), (22, 23)]
    assert [p.num_threads for p in ps] == [2, 2]


def test_offline_cpus_unused() -> None:
    topo = synthetic_topology(1, 8, offline={2, 3}, allowed=range(8))
    ps = plans(topo, 2)
    assert [p.cpus for p in ps] == [(0, 1, 4), (5, 6, 7)]


def test_unequal_numa_nodes_deal_ranks_by_size() -> None:
    # one socket, 48 + 8 cores in two NUMA nodes: 7 ranks -> 6 on the big node, 1 on the small
    cpus = tuple(LogicalCpu(c, c, socket=0, numa=0 if c < 48 else 1) for c in range(56))
    topo = Topology(cpus=cpus, online=range(56), allowed=range(56))
    ps = plans(topo, 7)
    assert [len(p.cpus) for p in ps] == [8] * 7
    assert all(len({topo.cpu(c).numa for c in p.cpus}) == 1 for p in ps)
    assert "split by NUMA node" in ps[0].reason
    two = plans(topo, 2)
    assert [len(p.cpus) for p in two] == [48, 8]
    assert two[0].warnings[0].code == "unequal-shares" and "unequal shares" in str(two[0].warnings[0])


def test_unequal_sockets() -> None:
    topo = synthetic_topology(2, [40, 16])
    ps = plans(topo, 4)
    assert [len(p.cpus) for p in ps] == [14, 13, 13, 16]
    assert_disjoint(ps)


def test_ccl_workers_reserved() -> None:
    ps = plans(XEON, 4, ccl_workers=2)
    assert_disjoint(ps)
    p = ps[1]
    assert p.ccl_worker_cpus == (28, 29) and p.cpus == tuple(range(30, 56))
    assert p.num_threads == 26
    assert p.env["CCL_WORKER_COUNT"] == "2" and p.env["CCL_WORKER_AFFINITY"] == ",".join(["28,29"] * 4)


def test_ccl_workers_not_reserved_when_no_core_left() -> None:
    """Issue 23: the default of 1 worker with 1 core per rank is no warning (0 is refused by
    oneCCL, so there is nothing to suggest); a user's count above 1 warns with a value that fits."""
    ps = plans(synthetic_topology(1, 2), 2, ccl_workers=1)
    assert [p.cpus for p in ps] == [(0,), (1,)]
    assert all(p.ccl_worker_cpus == () and "CCL_WORKER_AFFINITY" not in p.env for p in ps)
    assert all(p.warnings == () for p in ps)
    ps = plans(synthetic_topology(1, 2), 2, ccl_workers=3)
    w = ps[0].warnings[0]
    assert w.code == "ccl-workers-unreserved" and "CCL_WORKER_COUNT=3" in w.message
    assert w.fix.startswith("CCL_WORKER_COUNT=1 (oneCCL's default; it refuses 0)") and "=0" not in w.fix
    ps = plans(synthetic_topology(1, 4), 1, ccl_workers=4)  # 4 cores, 4 workers: 3 would leave one
    assert ps[0].warnings[0].fix.startswith("CCL_WORKER_COUNT=3,")


def test_more_ranks_than_cores_warns_and_shares() -> None:
    topo = synthetic_topology(1, 2)
    ps = plans(topo, 5)
    assert [p.cpus for p in ps] == [(0,), (1,), (0,), (1,), (0,)]
    assert all(p.num_threads == 1 for p in ps)
    w = ps[0].warnings[0]
    assert w.code == "oversubscribed" and w.message.startswith("oversubscribed: 5 local ranks on 2 cores")
    assert w.fix == "start at most 2 ranks per node, or give the job more CPUs"
    assert str(w) == f"{w.message}. Fix: {w.fix}"


def test_more_ranks_than_cores_uses_siblings_first() -> None:
    topo = synthetic_topology(1, 2, 2)  # CPUs 0,2 and 1,3 are siblings
    ps = plans(topo, 4)
    assert [p.cpus for p in ps] == [(0,), (2,), (1,), (3,)]
    assert ps[0].warnings[0].code == "hyperthreads-shared" and "hyperthread siblings" in str(ps[0].warnings[0])
    assert not any(w.code == "oversubscribed" or "oversubscribed" in str(w) for w in ps[0].warnings)


def test_explicit_threads_win() -> None:
    p = plan_pinning(XEON, 0, 2, omp_num_threads=8)
    assert p.num_threads == 8 and len(p.cpus) == 56 and p.env["OMP_NUM_THREADS"] == "8"
    q = plan_pinning(synthetic_topology(1, 2), 0, 2, omp_num_threads=4)
    assert q.num_threads == 4 and q.warnings[0].code == "threads-exceed-cpus"
    assert "threads will share CPUs" in str(q.warnings[0]) and not q.warnings[0].fix


def test_quota_caps_threads() -> None:
    topo = synthetic_topology(1, 16, quota=4)
    ps = plans(topo, 2)
    assert [len(p.cpus) for p in ps] == [8, 8]
    assert [p.num_threads for p in ps] == [2, 2]
    assert "quota" in ps[0].reason


def test_bound_by_launcher_uses_whole_set() -> None:
    topo = synthetic_topology(1, 8, allowed={4, 5})
    p = plan_pinning(topo, 1, 4, bound_by="Open MPI")
    assert p.cpus == (4, 5) and p.num_threads == 2
    wide = plan_pinning(synthetic_topology(1, 8, allowed=range(6)), 0, 4, bound_by="Open MPI")
    assert wide.cpus == tuple(range(6)) and wide.num_threads == 2  # 8 cores / 4 ranks
    assert "may be shared" in wide.reason


@pytest.mark.parametrize(
    "kw, match",
    [({"local_rank": 2, "local_world_size": 2}, "local_rank"), ({"local_rank": 0, "local_world_size": 0}, "local_rank"),
     ({"local_rank": 0, "local_world_size": 1, "omp_num_threads": 0}, "omp_num_threads"),
     ({"local_rank": 0, "local_world_size": 1, "ccl_workers": -1}, "ccl_workers")],
)
def test_bad_arguments(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_pinning(XEON, **kw)


def test_empty_usable_set() -> None:
    with pytest.raises(ValueError, match="no usable CPUs"):
        plan_pinning(synthetic_topology(1, 2, allowed={7}), 0, 1)


def test_plan_is_plain_data() -> None:
    p = plan_pinning(XEON, 0, 4, ccl_workers=1)
    assert json.loads(json.dumps(p.as_dict()))["cpulist"] == "1-27"
    assert pickle.loads(pickle.dumps(p)) == p
    hash(p)
    # DistEnv no longer carries the plan (launcher facts only); the plan's own plain data does.
    assert json.loads(json.dumps({"pin_plan": p.as_dict()}))["pin_plan"]["num_threads"] == 27


# --------------------------------------------------------------------------- the user wins


def denv(launcher: str, local_rank: int = 0, local_world_size: int = 2) -> DistEnv:
    return DistEnv(rank=local_rank, world_size=local_world_size, local_rank=local_rank,
                   local_world_size=local_world_size, launcher=launcher)


TWO = synthetic_topology(1, 2)


def test_torchrun_default_omp_is_replaced() -> None:
    p = plan_for(denv("torchrun"), environ={"OMP_NUM_THREADS": "1"}, topology=synthetic_topology(1, 8))
    assert p.num_threads == 4 and p.replace_env == ("OMP_NUM_THREADS",)
    assert "torchrun's default" in p.reason


def test_torchrun_single_process_omp_is_the_users() -> None:
    p = plan_for(denv("torchrun", 0, 1), environ={"OMP_NUM_THREADS": "1"}, topology=synthetic_topology(1, 8))
    assert p.num_threads == 1 and p.replace_env == ()


@pytest.mark.parametrize("launcher", ["hydra", "openmpi", "slurm", "env", "none"])
def test_explicit_omp_wins(launcher: str) -> None:
    p = plan_for(denv(launcher), environ={"OMP_NUM_THREADS": "3"}, topology=synthetic_topology(1, 8))
    assert p.num_threads == 3 and p.env["OMP_NUM_THREADS"] == "3" and len(p.cpus) == 4


def test_cpuddp_num_threads_wins_over_everything() -> None:
    environ = {"OMP_NUM_THREADS": "1", "CPUDDP_NUM_THREADS": "1"}
    p = plan_for(denv("torchrun"), environ=environ, topology=synthetic_topology(1, 8))
    assert p.num_threads == 1 and p.replace_env == ()


def test_nested_omp_list_takes_first_level() -> None:
    p = plan_for(denv("hydra"), environ={"OMP_NUM_THREADS": "2,1"}, topology=synthetic_topology(1, 8))
    assert p.num_threads == 2


@pytest.mark.parametrize("value", ["0", "abc", "-2"])
def test_bad_omp_num_threads(value: str) -> None:
    with pytest.raises(LauncherEnvError) as e:
        plan_for(denv("hydra"), environ={"OMP_NUM_THREADS": value}, topology=TWO)
    assert e.value.variable == "OMP_NUM_THREADS" and e.value.value == value
    assert "OMP_NUM_THREADS" in str(e.value).splitlines()[-1]


def backend_workers(name: str, environ: dict) -> int:
    """The worker cores the backend's object keeps free: what init passes ``plan_for``."""
    from cpuddp.backends import BackendChoice, backend_for

    return backend_for(name).worker_cores(BackendChoice(name, "test"), environ)


def test_ccl_backend_reserves_worker_count() -> None:
    topo = synthetic_topology(1, 8)
    two = {"CCL_WORKER_COUNT": "2"}
    p = plan_for(denv("hydra"), workers=backend_workers("ccl", two), environ=two, topology=topo)
    assert p.ccl_worker_cpus == (0, 1) and p.cpus == (2, 3)
    default = plan_for(denv("hydra"), workers=backend_workers("ccl", {}), environ={}, topology=topo)
    assert default.ccl_worker_cpus == (0,)
    assert plan_for(denv("hydra"), workers=backend_workers("gloo", two), environ=two, topology=topo).ccl_worker_cpus == ()


@pytest.mark.parametrize(
    "launcher, environ, expected",
    [
        ("hydra", {"I_MPI_PIN_MAPPING": "2:0 0,1 1"}, "Intel MPI"),
        ("hydra", {"I_MPI_PIN_MAPPING": "2:0 0,1 1", "I_MPI_PIN": "off"}, None),
        ("hydra", {"I_MPI_PIN_DOMAIN": "core"}, "Intel MPI"),
        ("hydra", {"HYDRA_USER_PROVIDED_BINDING": "1"}, "MPICH"),
        ("hydra", {}, None),
        ("openmpi", {}, "Open MPI"),
        ("pmix", {}, "Open MPI"),
        ("slurm", {"SLURM_CPU_BIND_TYPE": "mask_cpu:"}, "Slurm"),
        ("slurm", {"SLURM_CPU_BIND_TYPE": "none"}, None),
        ("mvapich", {}, "MVAPICH2"),
        ("mvapich", {"MV2_ENABLE_AFFINITY": "0"}, None),
        ("torchrun", {"I_MPI_PIN_MAPPING": "x", "SLURM_CPU_BIND_TYPE": "cores"}, None),
        ("env", {}, None),
    ],
)
def test_launcher_binding(launcher: str, environ: dict, expected: Optional[str]) -> None:
    got = launcher_binding(environ, launcher)
    assert (got is None) if expected is None else (got is not None and got.startswith(expected))


def test_open_mpi_bound_rank_plans_inside_its_core() -> None:
    # Open MPI bound local rank 1 to CPU 1: plan there, do not split {1} among 2 ranks.
    topo = synthetic_topology(1, 2, allowed={1})
    p = plan_for(denv("openmpi", 1), environ={}, topology=topo)
    assert p.cpus == (1,) and p.num_threads == 1 and not p.warnings
    assert "Open MPI" in p.reason


def test_intel_mpi_bound_rank_plans_inside_its_domain() -> None:
    topo = synthetic_topology(1, 8, allowed={0, 1, 2, 3})
    p = plan_for(denv("hydra", 0), environ={"I_MPI_PIN_MAPPING": "2:0 0,1 4"}, topology=topo)
    assert p.cpus == (0, 1, 2, 3) and p.num_threads == 4


def test_taskset_around_the_job_is_split() -> None:
    # `taskset -c 2-5 torchrun --nproc-per-node 2`: both ranks see {2..5}; split it.
    topo = synthetic_topology(1, 8, allowed={2, 3, 4, 5})
    ps = [plan_for(denv("torchrun", r), environ={}, topology=topo) for r in range(2)]
    assert [p.cpus for p in ps] == [(2, 3), (4, 5)]
    assert "narrower than the node's" in ps[0].reason


def test_mpich_without_binding_splits() -> None:
    ps = [plan_for(denv("hydra", r), environ={}, topology=TWO) for r in range(2)]
    assert [p.cpus for p in ps] == [(0,), (1,)] and [p.num_threads for p in ps] == [1, 1]


# --------------------------------------------------------------------------- applying it


@pytest.fixture
def real_plan() -> PinPlan:
    cpu = min(os.sched_getaffinity(0))
    return PinPlan(local_rank=0, cpus=(cpu,), num_threads=1, reason="test",
                   env={"OMP_NUM_THREADS": "1", "KMP_AFFINITY": KMP_AFFINITY, "KMP_BLOCKTIME": "1"})


def test_apply_and_restore(real_plan: PinPlan) -> None:
    import torch

    before_aff, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    environ = {"KMP_BLOCKTIME": "200", "UNRELATED": "x"}
    state = apply_plan(real_plan, environ)
    try:
        assert os.sched_getaffinity(0) == set(real_plan.cpus)
        assert torch.get_num_threads() == 1
        assert current_plan() is real_plan
        assert environ["OMP_NUM_THREADS"] == "1"
        assert environ["KMP_AFFINITY"] == KMP_AFFINITY
        assert environ["KMP_BLOCKTIME"] == "200"  # the user's value is kept
    finally:
        restore(state)
    assert os.sched_getaffinity(0) == before_aff
    assert torch.get_num_threads() == before_threads
    assert environ == {"KMP_BLOCKTIME": "200", "UNRELATED": "x"}
    assert current_plan() is None
    restore(state)  # twice is harmless


def test_threads_started_before_are_moved(real_plan: PinPlan) -> None:
    import threading

    seen: dict[str, set[int]] = {}
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait(10)
        seen["aff"] = os.sched_getaffinity(0)
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    with pinned(real_plan, environ={}):
        go.set()
        done.wait(10)
    t.join(10)
    assert seen["aff"] == set(real_plan.cpus)


def test_conflicts_logged_and_launcher_default_replaced(real_plan: PinPlan, caplog: pytest.LogCaptureFixture) -> None:
    plan = PinPlan(local_rank=0, cpus=real_plan.cpus, num_threads=1,
                   env={"OMP_NUM_THREADS": "1", "KMP_AFFINITY": "compact"}, replace_env=("OMP_NUM_THREADS",))
    environ = {"OMP_NUM_THREADS": "7", "KMP_AFFINITY": "scatter"}
    with caplog.at_level(logging.INFO, logger="cpuddp.affinity"):
        with pinned(plan, environ=environ):
            assert environ == {"OMP_NUM_THREADS": "1", "KMP_AFFINITY": "scatter"}
    assert environ == {"OMP_NUM_THREADS": "7", "KMP_AFFINITY": "scatter"}
    assert "keeping the user's KMP_AFFINITY='scatter'" in caplog.text
    assert "replacing OMP_NUM_THREADS='7'" in caplog.text


def test_pinned_restores_on_error(real_plan: PinPlan) -> None:
    import torch

    before = os.sched_getaffinity(0), torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with pinned(real_plan, environ={}):
            raise RuntimeError("boom")
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
    assert current_plan() is None


def test_warnings_logged_once(real_plan: PinPlan, caplog: pytest.LogCaptureFixture) -> None:
    plan = PinPlan(local_rank=0, cpus=real_plan.cpus, num_threads=1, warnings=("oversubscribed: test 123",))
    with caplog.at_level(logging.WARNING, logger="cpuddp.affinity"):
        for _ in range(3):
            with pinned(plan, environ={}):
                pass
    assert caplog.text.count("oversubscribed: test 123") == 1


def test_unpinnable_plan_warns_not_raises(caplog: pytest.LogCaptureFixture) -> None:
    import torch

    before = torch.get_num_threads()
    plan = PinPlan(local_rank=0, cpus=(100000,), num_threads=1)
    with caplog.at_level(logging.WARNING, logger="cpuddp.affinity"):
        with pinned(plan, environ={}):
            assert torch.get_num_threads() == 1
    assert "could not pin" in caplog.text
    assert torch.get_num_threads() == before


def test_plan_for_real_machine_single_process() -> None:
    p = plan_for(DistEnv(), environ={})
    assert set(p.cpus) <= os.sched_getaffinity(0)
    assert p.num_threads == len(p.cpus) >= 1


def test_ccl_worker_affinity_matches_backends() -> None:
    # cpuddp.backends exports CCL_WORKER_AFFINITY before the plan is applied: same string, no conflict.
    backends = pytest.importorskip("cpuddp.backends")
    topo = synthetic_topology(1, 8)
    for r in range(2):
        e = denv("hydra", r)
        p = plan_for(e, workers=backend_workers("ccl", {}), environ={}, topology=topo)
        assert backends.ccl_env(e, p, {})["CCL_WORKER_AFFINITY"] == p.env["CCL_WORKER_AFFINITY"]


def test_plan_warnings_are_records_with_the_same_text() -> None:
    from cpuddp.affinity import WARNING_CODES, PinWarning

    p = plans(synthetic_topology(1, 2), 5)[0]
    (w,) = p.warnings
    assert isinstance(w, PinWarning) and w.code in WARNING_CODES
    d = p.as_dict()
    assert d["warnings"] == [str(w)] and d["warning_records"] == [w.as_dict()]
    assert PinWarning.coerce(w.as_dict()) == w
    assert json.loads(json.dumps(d))["warning_records"][0]["code"] == "oversubscribed"
    text = PinPlan(local_rank=0, cpus=(0,), num_threads=1, warnings=("plain text",)).warnings[0]
    assert (text.code, text.message, text.fix, str(text)) == ("other", "plain text", "", "plain text")
    assert pickle.loads(pickle.dumps(p)) == p


@pytest.mark.parametrize("bad", ["0", "-1", "two", "", "2,3"])
def test_ccl_worker_count_has_one_rule(bad: str) -> None:
    # oneCCL refuses CCL_WORKER_COUNT < 1 ("incorrect CCL_WORKER_COUNT 0"): the planner and the
    # backend's settings read it with the same parser, so both refuse the same values.
    backends = pytest.importorskip("cpuddp.backends")
    topo = synthetic_topology(1, 8)
    environ = {"CCL_WORKER_COUNT": bad}
    with pytest.raises(LauncherEnvError) as planned:
        plan_for(denv("hydra"), workers=backend_workers("ccl", environ), environ=environ, topology=topo)
    with pytest.raises(LauncherEnvError) as exported:
        backends.ccl_env(denv("hydra"), None, {"CCL_WORKER_COUNT": bad})
    for info in (planned, exported):
        assert info.value.variable == "CCL_WORKER_COUNT" and info.value.value == bad
    # a backend that is not ccl does not read it
    assert plan_for(denv("hydra"), workers=backend_workers("gloo", environ), environ=environ,
                    topology=topo).ccl_worker_cpus == ()
