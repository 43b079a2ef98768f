"""The auto rule (issue 23 item 2, issue 20 item 7): one pure function over (node layout,
backends that work, device); resolve_backend, backend_env and doctor all go through it."""

from __future__ import annotations

import pytest

from cpuddp.backends.shm.protocol import check as shm_check
from cpuddp.backends.auto import RULE, AutoFacts, auto_rule
from cpuddp.backends.shm.backend import shm_options
from cpuddp.backends.settings import backend_env
from cpuddp.backends.types import BackendChoice
from cpuddp.backends import resolve_backend
from cpuddp.launchers.env import DistEnv

GIB = 1 << 30
CCL_OK = "oneccl_bind_pt 2.13.0 matches torch 2.13.0"


def _facts(local: int, nodes: int, cpus: int, ccl: bool, device: str = "cpu", nccl: bool = False,
           environ: dict | None = None) -> AutoFacts:
    """The facts as resolve_backend gathers them: shm's verdict from shm_check.eligibility."""
    shm_ok, shm_why = shm_check.eligibility(local, environ or {}, machine="x86_64",
                                            free_bytes=lambda: 64 * GIB, node_cpus=cpus)
    return AutoFacts(local, nodes, shm_ok, shm_why, ccl, CCL_OK if ccl else "oneccl_bind_pt is not installed",
                     device, nccl, "nccl ok" if nccl else "no CUDA device")


# (ranks per node, nodes, node CPUs, ccl works, device) -> (backend, node-to-node leg)
CASES = [
    ((2, 1, 2, False, "cpu"), ("shm", None)),   # one node: shared memory
    ((2, 1, 2, True, "cpu"), ("shm", None)),    # ... even with working oneCCL (19x slower at 1 MiB)
    ((4, 1, 2, False, "cpu"), ("gloo", None)),  # oversubscribed: shm waits would steal CPUs
    ((4, 1, 2, True, "cpu"), ("gloo", None)),   # ... even with oneCCL: slower than gloo on one node
    ((1, 1, 8, True, "cpu"), ("gloo", None)),
    ((1, 1, 8, False, "cpu"), ("gloo", None)),  # a world of one
    ((2, 2, 2, False, "cpu"), ("shm", "gloo")),  # hierarchical: gloo between nodes
    ((2, 4, 8, True, "cpu"), ("shm", "ccl")),    # hierarchical: oneCCL between nodes
    ((1, 4, 8, True, "cpu"), ("ccl", None)),     # one rank per node: all of it is node-to-node
    ((1, 4, 8, False, "cpu"), ("gloo", None)),
    ((2, 2, 2, True, "cuda"), ("gloo", None)),  # CUDA without nccl
    ((2, 1, 2, False, "cuda"), ("gloo", None)),
]


@pytest.mark.parametrize("layout,expected", CASES, ids=[f"{c[0]}" for c in CASES])
def test_rule_over_layouts_and_working_backends(layout, expected):
    local, nodes, cpus, ccl, device = layout
    d = auto_rule(_facts(local, nodes, cpus, ccl, device))
    assert (d.backend, d.inter) == expected
    assert d.reason  # every decision says why


def test_cuda_with_nccl_takes_nccl():
    assert auto_rule(_facts(2, 2, 8, True, "cuda", nccl=True)).backend == "nccl"


def test_reasons_name_the_facts():
    d = auto_rule(_facts(2, 1, 2, True))
    assert "preferred to the working oneCCL" in d.reason and "ccl 6.99 ms" in d.reason
    d = auto_rule(_facts(2, 3, 4, False))
    assert "between the 3 nodes gloo" in d.reason and "oneccl_bind_pt is not installed" in d.reason
    d = auto_rule(_facts(4, 1, 2, False))
    assert d.reason.startswith("no shared memory (4 local ranks share 2 CPU(s)")


def test_opt_out_is_honoured():
    d = auto_rule(_facts(2, 2, 8, True, environ={"CPUDDP_SHM": "0"}))
    assert (d.backend, d.inter) == ("ccl", None) and "CPUDDP_SHM=0" in d.reason
    d = auto_rule(_facts(2, 1, 8, True, environ={"CPUDDP_SHM": "0"}))
    assert (d.backend, d.inter) == ("gloo", None) and "rather than the working oneCCL" in d.reason


def test_rule_sentence_names_every_path():
    for word in ("shm", "oneCCL", "gloo", "nccl", "between nodes"):
        assert word in RULE


# --------------------------------------------------------------------------- through resolve_backend


def _env(local: int, nodes: int) -> DistEnv:
    return DistEnv(rank=0, world_size=local * nodes, local_world_size=local, num_nodes=nodes, launcher="torchrun")


@pytest.mark.skipif(shm_check.eligibility(2, {}, node_cpus=2)[0] is False, reason="shm not eligible on this machine")
@pytest.mark.parametrize("ccl,leg", [(False, "gloo"), (True, "ccl")])
def test_resolve_backend_sets_the_leg(ccl, leg):
    md = {"torch": "2.13.0", **({"oneccl_bind_pt": "2.13.0"} if ccl else {})}
    mods = {"oneccl_bindings_for_pytorch"} if ccl else set()
    choice = resolve_backend("auto", _env(2, 2), metadata=md, find_module=mods, environ={}, node_cpus=2)
    assert (choice.name, choice.inter) == ("shm", leg)
    named = resolve_backend("shm", _env(2, 2), metadata=md, find_module=mods, environ={})
    assert named.inter == leg  # a named shm group takes the same leg
    assert resolve_backend("ccl", _env(2, 2), metadata=md, find_module=mods, environ={}).name == "ccl" if ccl else True


def test_doctor_light_path_agrees_with_init():
    """probe_torch=False (doctor without --torch) decides exactly as init does."""
    md = {"torch": "2.13.0"}
    for local, nodes in ((2, 1), (1, 2), (2, 2)):
        a = resolve_backend("auto", _env(local, nodes), metadata=md, find_module=set(), environ={}, node_cpus=2)
        b = resolve_backend("auto", _env(local, nodes), metadata=md, find_module=set(), environ={}, node_cpus=2,
                            probe_torch=False)
        assert (a.name, a.inter, a.reason) == (b.name, b.inter, b.reason)


# --------------------------------------------------------------------------- the shm group's options


def user_leg(choice, environ):
    """What decide asks of every choice before the agreement (shm: its CPUDDP_SHM_INTER)."""
    return choice.backend.with_user_settings(choice, environ)


def test_the_leg_travels_as_group_options_and_the_users_setting_wins(caplog):
    """The node-to-node leg is a process-group option (ShmOptions), never an exported variable;
    the user's CPUDDP_SHM_INTER is read once, before the agreement (the backend's
    with_user_settings, which decide asks of every choice)."""
    choice = BackendChoice("shm", "auto", "cpuddp.shm", inter="ccl")
    assert shm_options(choice).inter == "ccl"
    assert user_leg(choice, {}) is choice
    with caplog.at_level("INFO", logger="cpuddp.backends"):
        mine = user_leg(choice, {"CPUDDP_SHM_INTER": " GLOO "})
    assert (mine.inter, mine.inter_set, shm_options(mine).inter) == ("gloo", True, "gloo")
    assert "CPUDDP_SHM_INTER= GLOO  is your setting and is kept" in caplog.text
    assert shm_options(BackendChoice("shm", "auto", "cpuddp.shm")).inter == "gloo"  # one node: no leg
    assert user_leg(BackendChoice("gloo", "auto"), {"CPUDDP_SHM_INTER": "ccl"}).inter is None  # not shm
    opts = shm_options(choice, async_comm=True, local_size=2)
    assert (opts.async_comm, opts.local_size) == (True, 2)
    env = _env(2, 2)
    assert "CPUDDP_SHM_INTER" not in backend_env(env, choice, None, {"GLOO_SOCKET_IFNAME": "eth0"})


def test_a_leg_that_is_not_gloo_ccl_or_mpi_is_a_clear_error():
    from cpuddp.errors import BackendError

    with pytest.raises(BackendError, match=r"CPUDDP_SHM_INTER='nccl'.*\n.*CPUDDP_SHM_INTER to one of gloo, ccl, mpi"):
        user_leg(BackendChoice("shm", "auto", "cpuddp.shm", inter="gloo"), {"CPUDDP_SHM_INTER": "nccl"})


def test_ranks_that_disagree_on_the_leg_take_gloo_between_nodes():
    """Bindings on some nodes only: every rank takes shm with gloo between nodes (not a hang)."""
    import datetime

    import torch.distributed as dist

    from cpuddp.backends.agreement import agree_backend
    from cpuddp.launchers.hosts import sharing

    mine = BackendChoice("shm", "auto: test", "cpuddp.shm", "auto", inter="ccl")
    td = datetime.timedelta(seconds=5)
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=1, num_nodes=2)
    store = dist.HashStore()
    store.set("b/1", "shm")
    store.set("b/inter/1", "gloo")  # rank 1's node has no working bindings
    choice = agree_backend(mine, "auto", env, sharing(store, 0, 2, td), "b")
    assert (choice.name, choice.inter) == ("shm", "gloo") and "not every rank can take the same leg (ccl, gloo)" in choice.reason
    store = dist.HashStore()
    store.set("c/1", "shm")
    store.set("c/inter/1", "ccl")
    assert agree_backend(mine, "auto", env, sharing(store, 0, 2, td), "c").inter == "ccl"


def test_auto_reaches_one_answer_on_every_node_of_an_uneven_job():
    """3 ranks on 2 nodes: the node of 2 would take shm and the node of 1 gloo; the ranks must not
    disagree (a disagreement stops init, issue 35), so auto asks for 2+ ranks on every node."""
    from cpuddp.backends.registry import resolve_backend

    two = DistEnv(rank=0, world_size=3, local_rank=0, local_world_size=2, num_nodes=2)
    one = DistEnv(rank=2, world_size=3, local_rank=0, local_world_size=1, num_nodes=2)
    env = {"CPUDDP_SHM": "1"}
    got = [resolve_backend("auto", e, environ=env, node_cpus=8, smallest_node=1) for e in (two, one)]
    assert len({c.name for c in got}) == 1 and got[0].name != "shm", got
    assert "a node of this job runs 1 rank" in got[0].reason, got[0].reason
    assert resolve_backend("auto", two, environ=env, node_cpus=8, smallest_node=2).name == "shm"


def test_a_oneccl_leg_loads_the_bindings_as_backend_ccl_does(monkeypatch):
    """The node-to-node leg is formed by the ccl backend's object: bindings that do not match
    torch are refused with the reason (shm/cross/hierarchy.py imported oneccl_bindings_for_pytorch itself,
    skipping the version check -- a mismatched wheel can abort the interpreter -- and the old
    torch_ccl module name)."""
    import dataclasses
    import datetime
    import sys
    from types import SimpleNamespace

    from cpuddp.backends.shm.cross.hierarchy import cross_group
    from cpuddp.backends.types import BACKENDS
    from cpuddp.errors import BackendError

    said = "oneccl_bind_pt 2.8.0 was built for torch 2.8, not torch 2.13.0"
    monkeypatch.setitem(BACKENDS, "ccl", dataclasses.replace(BACKENDS["ccl"], probe=lambda lk: (False, said)))
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", None)  # importing it would raise ImportError
    with pytest.raises(BackendError, match="node-to-node leg is oneCCL, but oneccl_bind_pt 2.8.0 was built") as info:
        cross_group(object(), SimpleNamespace(node=0, nodes=2), datetime.timedelta(seconds=5), "ccl")
    assert "CPUDDP_SHM_INTER=gloo" in info.value.fix


# --------------------------------------------------------------------------- the MPI leg


MPI_OK = "mpi4py with MPICH Version: 5.0.2"


def _mpi_facts(local: int, nodes: int, mpi: bool, ccl: bool = False, environ: dict | None = None) -> AutoFacts:
    import dataclasses

    return dataclasses.replace(_facts(local, nodes, 8, ccl, environ=environ), mpi_ok=mpi,
                               mpi_why=MPI_OK if mpi else "mpi4py is not installed (pip install cpuddp[mpi])",
                               single_rank_node=local < 2, shm_opted_out=(environ or {}).get("CPUDDP_SHM") == "0")


@pytest.mark.parametrize("local, nodes, mpi, ccl, expected", [
    (2, 2, True, False, ("shm", "mpi")),   # hierarchical: MPI between nodes
    (2, 2, True, True, ("shm", "mpi")),    # ... before a working oneCCL
    (2, 2, False, True, ("shm", "ccl")),
    (2, 2, False, False, ("shm", "gloo")),
    (1, 3, True, False, ("shm", "mpi")),   # one rank per node: every collective over MPI
    (1, 3, True, True, ("shm", "mpi")),
    (1, 3, False, True, ("ccl", None)),
    (1, 3, False, False, ("gloo", None)),
    (2, 1, True, False, ("shm", None)),    # one node: no leg
    (1, 1, True, False, ("gloo", None)),   # a world of one
])
def test_the_mpi_leg_comes_first_between_nodes(local, nodes, mpi, ccl, expected):
    d = auto_rule(_mpi_facts(local, nodes, mpi, ccl))
    assert (d.backend, d.inter) == expected, d.reason
    if expected[1] == "mpi":
        assert MPI_OK in d.reason
    if nodes > 1 and not mpi:
        assert "no MPI leg: mpi4py is not installed" in d.reason


def test_opting_out_of_shm_keeps_single_rank_nodes_off_the_mpi_leg():
    d = auto_rule(_mpi_facts(1, 2, True, environ={"CPUDDP_SHM": "0"}))
    assert (d.backend, d.inter) == ("gloo", None)


def _job(launcher: str, nodes: int = 2) -> DistEnv:
    return DistEnv(rank=0, world_size=2 * nodes, local_rank=0, local_world_size=2, node_rank=0, num_nodes=nodes,
                   master_addr="10.0.0.1", master_port=29500, launcher=launcher)


def test_the_mpi_legs_status_needs_an_mpi_launcher_and_a_library():
    from cpuddp.backends.registry import leg_status
    from cpuddp.backends.types import _lookups
    from cpuddp.launchers.mpi import MpiLibrary

    def found(ok: bool):
        lk = _lookups(environ={})
        import dataclasses

        return dataclasses.replace(lk, mpi_library=lambda environ: MpiLibrary(ok, "MPICH Version: 5.0.2" if ok else "",
                                                                              "" if ok else "no library here"))

    st = leg_status("mpi", _job("hydra"), found(True))
    assert st.available and st.reason == MPI_OK
    st = leg_status("mpi", _job("hydra"), found(False))
    assert not st.available and st.reason == "no library here"
    st = leg_status("mpi", _job("torchrun"), found(True))
    assert not st.available and "started by torchrun, not by an MPI launcher" in st.reason
    st = leg_status("mpi", _job("hydra", nodes=1), found(True))
    assert not st.available and "one node" in st.reason


def test_the_leg_may_be_set_to_mpi():
    choice = user_leg(BackendChoice("shm", "auto", "cpuddp.shm", inter="gloo"), {"CPUDDP_SHM_INTER": "MPI"})
    assert (choice.inter, choice.inter_set) == ("mpi", True)
    assert shm_options(choice).require_leg
