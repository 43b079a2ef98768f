"""The backend decision in one pass (cpuddp.backends.decide): the requested backend and the proven
layout in, a frozen BackendPlan out; ranks that disagree stop before anything is carried out."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch.distributed as dist

from cpuddp.backends import decide
from cpuddp.backends import registry as backends
from cpuddp.backends.shm.api import ShmOptions
from cpuddp.backends.types import BackendChoice
from cpuddp.errors import BackendError
from cpuddp.launchers.env import DistEnv
from cpuddp.launchers.hosts import Layout, sharing

TD = datetime.timedelta(seconds=5)
#: 4 ranks on 2 nodes, this rank the first of the first node.
LAYOUT = Layout(rank=0, local_rank=0, local_world_size=2, node_rank=0, nodes=((0, 1), (2, 3)),
                local_cpus=(frozenset({0}), frozenset({1})))
ENV = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=2, num_nodes=2, master_addr="127.0.0.1")


def _share(store):
    """Rank 0's exchange over ``store``, where the test has written the other ranks' values."""
    return sharing(store, ENV.rank, ENV.world_size, TD)


def _options(env: DistEnv, plan: decide.BackendPlan):
    """The group's options the agreed backend's object builds from ``plan``."""
    return plan.choice.backend.group_options(env, plan)


def _shm_everywhere(monkeypatch, facts: dict) -> None:
    def pick(requested, env, **kw):
        facts.update(kw)
        return BackendChoice("shm", "auto: test", "cpuddp.shm", "auto", inter="ccl")

    monkeypatch.setattr(backends, "resolve_backend", pick)


def test_a_world_of_one_gets_a_frozen_plan_with_its_settings(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    plan = decide.decide_backend("gloo", DistEnv(), None, None, "b", {}, pin=False)
    assert (plan.name, plan.choice.inter, plan.pin_plan) == ("gloo", None, None)
    assert _options(DistEnv(), plan) is None
    assert plan.env == {"GLOO_SOCKET_IFNAME": "lo"}  # one node on loopback
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.env = {}  # type: ignore[misc]


def test_shm_agreed_by_every_rank_carries_its_leg_and_the_proven_layout(monkeypatch):
    facts: dict = {}
    _shm_everywhere(monkeypatch, facts)
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"b/{r}", "shm")
        store.set(f"b/inter/{r}", "ccl")
    plan = decide.decide_backend("auto", ENV, LAYOUT, _share(store), "b", {}, pin=False)
    assert (facts["node_cpus"], facts["smallest_node"]) == (2, 2)  # the proven layout's, not the launcher's
    assert _options(ENV, plan) == ShmOptions(inter="ccl", async_comm=False, local_size=2)
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"c/{r}", "shm")
        store.set(f"c/inter/{r}", "gloo" if r == 3 else "ccl")  # rank 3's node has no working bindings
    plan = decide.decide_backend("auto", ENV, LAYOUT, _share(store), "c", {}, pin=False)
    assert plan.choice.inter == _options(ENV, plan).inter == "gloo"
    assert "gloo after all" in plan.choice.reason


def test_ranks_that_disagree_stop_before_anything_is_carried_out(monkeypatch):
    """The agreement is the decision's last step and the steps before it are pure: a rank that
    disagrees has exported, pinned and loaded nothing when it raises."""
    import os

    from cpuddp.affinity import pin

    _shm_everywhere(monkeypatch, {})
    before = (dict(os.environ), pin.current_plan())
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"b/{r}", "gloo" if r == 2 else "shm")
    with pytest.raises(BackendError, match=r"rank 0: the ranks' backend choices differ: rank 0: shm, rank 2: gloo; "
                       r"1 rank\(s\) differ from this rank's 'shm'"):
        decide.decide_backend("auto", ENV, LAYOUT, _share(store), "b", {}, pin=True)
    assert (dict(os.environ), pin.current_plan()) == before


def test_shm_options_carry_the_pinning_plans_cpus(monkeypatch):
    """The rank's compute CPUs reach the shm group: its slots are allocated, and the rank planned,
    on their NUMA node (cpuddp.backends.shm.python.levels)."""
    _shm_everywhere(monkeypatch, {})
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"b/{r}", "shm")
        store.set(f"b/inter/{r}", "ccl")
    plan = decide.decide_backend("auto", ENV, LAYOUT, _share(store), "b", {}, pin=True)
    options = _options(ENV, plan)
    assert plan.pin_plan is not None and options.cpus == tuple(plan.pin_plan.cpus), (plan.pin_plan, options)


# --------------------------------------------------------------------------- issue 45's two leg bugs


def test_shm_with_a_oneccl_leg_gets_oneccls_settings_and_worker_cores(monkeypatch):
    """shm whose node-to-node leg is oneCCL exports oneCCL's settings and keeps its worker cores
    free, as backend="ccl" does (only a backend named "ccl" got them)."""
    from cpuddp.affinity import pin
    from cpuddp.backends import settings

    _shm_everywhere(monkeypatch, {})
    asked = []
    monkeypatch.setattr(settings, "ccl_env", lambda env, plan, environ, paths=None: {"CCL_WORKER_COUNT": "1"})
    monkeypatch.setattr(decide, "plan_for", lambda env, workers, **kw: asked.append(workers) or pin.plan_for(
        env, workers=workers, **kw))
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"b/{r}", "shm")
        store.set(f"b/inter/{r}", "ccl")
    plan = decide.decide_backend("auto", ENV, LAYOUT, _share(store), "b", {}, pin=True)
    assert plan.choice.inter == "ccl" and plan.env.get("CCL_WORKER_COUNT") == "1", plan.env
    assert asked == [1]  # the pinning plan makes room for oneCCL's worker (CCL_WORKER_COUNT's default)


def test_a_leg_the_user_set_differently_on_another_node_is_an_error_naming_both(monkeypatch):
    """CPUDDP_SHM_INTER is read before the agreement: nodes that set it differently stop at once
    naming each rank's leg, where they formed mismatched node-to-node groups and hung."""
    _shm_everywhere(monkeypatch, {})
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"b/{r}", "shm")
        store.set(f"b/inter/{r}", "ccl_set" if r < 2 else "gloo")  # node 1 set nothing: the rule's gloo
    with pytest.raises(BackendError, match=r"legs differ: rank 0: gloo \(CPUDDP_SHM_INTER\), rank 1: ccl "
                                           r"\(CPUDDP_SHM_INTER\)") as err:
        decide.decide_backend("auto", ENV, LAYOUT, _share(store), "b", {"CPUDDP_SHM_INTER": "gloo"}, pin=False)
    assert "set the same CPUDDP_SHM_INTER" in str(err.value)
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"c/{r}", "shm")
        store.set(f"c/inter/{r}", "gloo_set")
    plan = decide.decide_backend("auto", ENV, LAYOUT, _share(store), "c", {"CPUDDP_SHM_INTER": "gloo"}, pin=False)
    assert _options(ENV, plan).inter == "gloo"  # every rank set gloo: agreed
