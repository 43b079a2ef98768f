"""Table tests: each launcher family fed the variables its real launcher sets.

The sets below were captured with ``<launcher> -n 2 env`` on this kind of machine (MPICH 5,
Open MPI 5, Intel MPI 2021, torchrun 2.13) or taken from the launcher's documentation (Slurm,
MVAPICH2, Kubeflow); see ../shared/LANDSCAPE.md.
"""

from __future__ import annotations

import pickle

import pytest

from cpuddp import DistEnv, LauncherEnvError, detect
from cpuddp.launchers.env import DEFAULT_PORT, PORT_RANGE
from cpuddp.launchers.env import Provenance, Source
from cpuddp.launchers import READERS, derive_port, expand_nodelist, expand_tasks_per_node, is_loopback
from cpuddp.launchers.netif import is_loopback_address

MPICH_RANK1 = {
    "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9", "PMI_HOSTNAME": "vm",
    "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
}
IMPI_RANK1 = {
    "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
    "I_MPI_HYDRA_UUID": "f2090000-90d3-1b9d-d460-0600a41fb637", "I_MPI_PIN_MAPPING": "2:0 0,1 1",
    "HYDRA_BSTRAP_PROXY_ID": "0",
}
OMPI5_RANK1 = {
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-vm-2512@1", "PMIX_HOSTNAME": "vm",
}
TORCHRUN_RANK1 = {
    "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1",
}
# srun -N 4 -n 7 (2,2,2,1 tasks per node): global rank 5 is the second task on node 2.
SLURM_RANK5 = {
    "SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[01-03],gpu-a7",
    "SLURM_JOB_NODELIST": "node[01-03],gpu-a7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
    "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NNODES": "4",
}
MVAPICH_RANK3 = {
    "MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1",
    "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
}
KUBEFLOW_RANK2 = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


@pytest.mark.parametrize(
    "environ, expected",
    [
        pytest.param({}, dict(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="none",
                              master_addr="127.0.0.1", master_port=DEFAULT_PORT), id="nothing"),
        pytest.param(MPICH_RANK1, dict(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0,
                                       launcher="hydra", master_addr="127.0.0.1", master_port=DEFAULT_PORT,
                                       job_id=None), id="mpich"),
        pytest.param(IMPI_RANK1, dict(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="hydra",
                                      master_addr="127.0.0.1",
                                      master_port=derive_port("I_MPI_HYDRA_UUID=f2090000-90d3-1b9d-d460-0600a41fb637")),
                     id="intel-mpi"),
        pytest.param(OMPI5_RANK1, dict(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0,
                                       launcher="openmpi", job_id="PMIX_NAMESPACE=prterun-vm-2512@1",
                                       master_port=derive_port("PMIX_NAMESPACE=prterun-vm-2512@1")), id="openmpi"),
        pytest.param(TORCHRUN_RANK1, dict(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0,
                                          launcher="torchrun", master_addr="localhost", master_port=29500,
                                          agent_store=True), id="torchrun"),
        pytest.param(SLURM_RANK5, dict(rank=5, world_size=7, local_rank=1, local_world_size=2, node_rank=2,
                                       num_nodes=4, launcher="slurm", master_addr="node01",
                                       master_port=derive_port("slurm:4242.0")), id="slurm-2(x3),1"),
        pytest.param(MVAPICH_RANK3, dict(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1,
                                         num_nodes=2, launcher="mvapich", master_addr="10.0.0.1"), id="mvapich"),
        pytest.param(KUBEFLOW_RANK2, dict(rank=2, world_size=3, local_rank=0, local_world_size=1, node_rank=2,
                                          num_nodes=3, launcher="env", master_addr="job-master-0",
                                          master_port=23456), id="kubeflow"),
        pytest.param({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                     dict(rank=1, local_rank=1, local_world_size=2, launcher="env"), id="env-loopback"),
        pytest.param({"PMIX_RANK": "1", "PMIX_NAMESPACE": "ns", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "2"}, dict(rank=1, world_size=2, launcher="pmix"), id="bare-pmix"),
        pytest.param({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7", "SLURM_LOCALID": "0"},
                     dict(rank=0, world_size=1, launcher="none"), id="sbatch-script-without-srun"),
        pytest.param({**IMPI_RANK1, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "9"},
                     dict(rank=1, launcher="hydra"), id="mpirun-inside-sbatch"),
        pytest.param({**MPICH_RANK1, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"},
                     dict(master_addr="10.1.2.3", master_port=1234), id="user-master-wins"),
    ],
)
def test_detect_real_variable_sets(environ, expected):
    env = detect(environ)
    assert isinstance(env, DistEnv)
    for field, value in expected.items():
        assert getattr(env, field) == value, (field, env)


def test_multinode_mpi_leaves_master_addr_to_rank0_broadcast():
    env = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (env.node_rank, env.num_nodes, env.master_addr) == (1, 2, "")
    assert env.sources["master_addr"].startswith("pending")


def test_openmpi_node_rank_is_not_ompi_node_rank():
    # OMPI_COMM_WORLD_NODE_RANK is the rank among a node's processes; node 1 of 2 here.
    env = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_ADDR": "h0"})
    assert env.node_rank == 1 and env.num_nodes == 2


def test_derived_port_is_in_range_and_differs_between_jobs():
    ports = {derive_port(f"PMIX_NAMESPACE=prterun-vm-{i}@1") for i in range(200)}
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] for p in ports)
    assert len(ports) > 190  # rare collisions
    assert derive_port("x") == derive_port("x")


def test_readers_order_is_documented():
    assert [name for name, _ in READERS] == ["torchrun", "hydra", "pmix", "openmpi", "mvapich", "slurm", "env"]


BAD = [
    ({"PMI_RANK": "one", "PMI_SIZE": "2"}, "PMI_RANK", "'one'"),
    ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, "PMI_RANK", "'-1'"),
    ({"PMI_RANK": "2", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, "PMI_RANK", "'2'"),
    ({"PMI_RANK": "0", "PMI_SIZE": "0"}, "PMI_SIZE", "'0'"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "127.0.0.1"}, "WORLD_SIZE", "'0'"),
    ({"PMI_RANK": "0"}, "PMI_SIZE", "unset"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, "MPI_LOCALRANKID", "'2'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"}, "MASTER_PORT", "'http'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT", "'70000'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"}, "MASTER_PORT", "'0'"),
    ({**SLURM_RANK5, "SLURM_STEP_NODELIST": "node[01-03"}, "SLURM_STEP_NODELIST", "'node[01-03'"),
    ({k: v for k, v in SLURM_RANK5.items() if "NODELIST" not in k}, "SLURM_STEP_NODELIST", "unset"),
    ({**MPICH_RANK1, "RANK": "0"}, "RANK", "'0'"),
    ({**OMPI5_RANK1, "PMI_RANK": "0", "PMI_SIZE": "2"}, "OMPI_COMM_WORLD_RANK", "'1'"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR", "unset"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK", "unset"),
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "ns"}, "WORLD_SIZE", "unset"),
    ({**SLURM_RANK5, "SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE", "'2(x)'"),
    ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
      "NODE_RANK": "5"}, "NODE_RANK", "'5'"),
]


@pytest.mark.parametrize("environ, variable, shown", BAD)
def test_bad_environment_names_variable_value_launcher_and_fix(environ, variable, shown):
    with pytest.raises(LauncherEnvError) as info:
        detect(environ)
    err = info.value
    assert isinstance(err, ValueError)
    last = str(err).splitlines()[-1]
    assert last.startswith(f"{variable}={shown}"), str(err)
    assert "(from " in last and "fix:" in last, str(err)
    assert err.variable == variable
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.variable, clone.value, clone.launcher, str(clone)) == (err.variable, err.value, err.launcher, str(err))


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
        ("host[1,5-9]", ["host1", "host5", "host6", "host7", "host8", "host9"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("single", ["single"]),
        ("a,b[2-3],c", ["a", "b2", "b3", "c"]),
        ("rack1-n[1-2].cluster", ["rack1-n1.cluster", "rack1-n2.cluster"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-04", "node01]", "node[a-b]", "node[4-1]", "a,,b", "a,", "[1-2]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


@pytest.mark.parametrize(
    "value, expanded",
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2(x2)", [1, 2, 2]), (" 3(x1) ", [3])],
)
def test_expand_tasks_per_node(value, expanded):
    assert expand_tasks_per_node(value) == expanded


@pytest.mark.parametrize("bad", ["", "x", "2(x)", "0", "2(x0)", "2(3)"])
def test_expand_tasks_per_node_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_tasks_per_node(bad)


# (address, is loopback, is an IP address rather than a name)
LOOPBACK = [
    ("127.0.0.1", True, True), ("127.0.1.1", True, True), ("localhost", True, False), ("::1", True, True),
    ("[::1]", True, True), ("10.0.0.1", False, True), ("node01", False, False), ("", False, False),
    ("ip6-loopback", True, False), ("ip6-localhost", True, False), ("LocalHost", True, False),
    ("localhost6", True, False), ("::ffff:127.0.0.1", True, True), ("[::ffff:127.0.1.1]", True, True),
    ("::ffff:10.0.0.1", False, True), ("::1%lo", True, True), ("fe80::1%eth0", False, True),
    (" 127.0.0.1 ", True, True), ("localhost.example", False, False),
]


@pytest.mark.parametrize("addr, loop, address", LOOPBACK)
def test_is_loopback(addr, loop, address):
    assert is_loopback(addr) is loop
    # netif's address test is the same check, for addresses only (a name is not an address)
    assert is_loopback_address(addr) is (loop and address)


def test_an_ip6_loopback_master_addr_keeps_every_rank_on_this_host():
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "ip6-loopback"})
    assert (env.local_rank, env.local_world_size, env.num_nodes) == (1, 2, 1)
    assert env.sources["local_rank"] == "derived: MASTER_ADDR is loopback"


def test_sources_say_where_each_value_came_from_as_kind_and_text():
    env = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    src = env.sources
    assert (src["rank"].kind, src["rank"].detail, src["rank"]) == (Source.VARIABLE, "PMI_RANK", "PMI_RANK")
    assert src["node_rank"].kind is Source.DERIVED and src["node_rank"].startswith("derived: ")
    assert src["master_addr"].kind is Source.PENDING
    assert src["master_port"].kind is Source.DEFAULT and src["master_port"] == "default"
    assert detect({}).sources["rank"].kind is Source.DEFAULT
    # the text reads back to the same provenance (plain data: as_dict, doctor --json)
    plain = env.as_dict()["sources"]
    assert all(type(v) is str for v in plain.values())
    assert {k: Provenance.of(v) for k, v in plain.items()} == src
    assert all(Provenance.of(v).kind is src[k].kind for k, v in plain.items())
    clone = pickle.loads(pickle.dumps(env))
    assert clone.sources == src and clone.sources["master_addr"].kind is Source.PENDING
    with pytest.raises(ValueError, match="VARIABLE"):
        Provenance(Source.VARIABLE, "")
