"""cpuddp.topology: CPU-list parsing, the sysfs/procfs reader on fake trees, features, counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional

import pytest

from cpuddp.topology import (
    LogicalCpu,
    Topology,
    cpu_features,
    effective_cpu_count,
    format_cpulist,
    parse_cpulist,
    read_topology,
    synthetic_topology,
)

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- cpu lists


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", set()),
        ("\n", set()),
        ("0", {0}),
        ("0-3", {0, 1, 2, 3}),
        ("0-3,8-11\n", {0, 1, 2, 3, 8, 9, 10, 11}),
        ("0,2,4", {0, 2, 4}),
        ("5,1-2", {1, 2, 5}),
        ("0-7:1/2", {0, 2, 4, 6}),
        ("0-7:2/4", {0, 1, 4, 5}),
    ],
)
def test_parse_cpulist(text: str, expected: set[int]) -> None:
    assert parse_cpulist(text) == frozenset(expected)


@pytest.mark.parametrize("bad", ["a", "3-1", "1-", "0-3:2", "0-3:0/2", "0-3:3/2", "-1"])
def test_parse_cpulist_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpulist(bad)


@pytest.mark.parametrize(
    "cpus, text",
    [(set(), ""), ({0}, "0"), ({0, 1, 2, 3, 8}, "0-3,8"), ({1, 3, 5}, "1,3,5"), ({7, 6, 5, 0}, "0,5-7")],
)
def test_format_cpulist_roundtrip(cpus: set[int], text: str) -> None:
    assert format_cpulist(cpus) == text
    assert parse_cpulist(text) == frozenset(cpus)


# --------------------------------------------------------------------------- fake trees


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_tree(
    root: Path,
    *,
    sockets: int,
    cores_per_socket: int,
    threads: int,
    offline: Iterable[int] = (),
    numa: Optional[dict[int, str]] = None,
    sysfs_topology: bool = True,
    cpuinfo_ids: bool = True,
    flags: str = "fpu sse avx2 avx512f avx512_bf16",
    cgroup: Optional[str] = None,
) -> frozenset[int]:
    """A /sys + /proc tree numbered like Linux on x86 servers; returns the online CPU set."""
    ncores = sockets * cores_per_socket
    total = ncores * threads
    off = set(offline)
    online = [c for c in range(total) if c not in off]
    cpu_dir = root / "sys/devices/system/cpu"
    _write(cpu_dir / "online", format_cpulist(online) + "\n")
    _write(cpu_dir / "possible", f"0-{total - 1}\n")
    blocks = []
    for c in range(total):
        core = c % ncores
        sock = core // cores_per_socket
        siblings = [core + t * ncores for t in range(threads)]
        if c in off:
            (cpu_dir / f"cpu{c}").mkdir(parents=True, exist_ok=True)  # offline: no topology/
            continue
        if sysfs_topology:
            t = cpu_dir / f"cpu{c}" / "topology"
            _write(t / "physical_package_id", f"{sock}\n")
            _write(t / "core_id", f"{core % cores_per_socket}\n")
            _write(t / "thread_siblings_list", format_cpulist(siblings) + "\n")
            _write(t / "core_cpus_list", format_cpulist(siblings) + "\n")
        else:
            (cpu_dir / f"cpu{c}").mkdir(parents=True, exist_ok=True)
        lines = [f"processor\t: {c}", "vendor_id\t: GenuineIntel"]
        if cpuinfo_ids:
            lines += [f"physical id\t: {sock}", f"core id\t\t: {core % cores_per_socket}"]
        if flags is not None:
            lines.append(f"flags\t\t: {flags}")
        blocks.append("\n".join(lines))
    _write(root / "proc/cpuinfo", "\n\n".join(blocks) + "\n")
    if numa is not None:
        for node, cpulist in numa.items():
            _write(root / f"sys/devices/system/node/node{node}/cpulist", cpulist + "\n")
    mountinfo = "25 1 0:22 / / rw - ext4 /dev/root rw\n"
    if cgroup == "v2":
        mountinfo += "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
        _write(root / "proc/self/cgroup", "0::/job/rank\n")
    elif cgroup == "v1":
        mountinfo += "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        mountinfo += "32 25 0:28 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
        _write(root / "proc/self/cgroup", "4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n1:name=systemd:/\n")
    _write(root / "proc/self/mountinfo", mountinfo)
    return frozenset(online)


def test_two_sockets_56_cores_hyperthreaded(tmp_path: Path) -> None:
    online = make_tree(tmp_path, sockets=2, cores_per_socket=56, threads=2, numa={0: "0-55,112-167", 1: "56-111,168-223"})
    topo = read_topology(tmp_path, allowed=online)
    assert topo.source == "sysfs"
    assert len(topo.cpus) == 224 and topo.online == frozenset(range(224))
    assert topo.physical_cores == 112
    assert topo.sockets == (0, 1) and topo.numa_nodes == (0, 1)
    assert topo.cpu(0).core == topo.cpu(112).core == 0
    assert topo.cpu(56).socket == 1 and topo.cpu(168).socket == 1 and topo.cpu(168).numa == 1
    cores = topo.cores()
    assert cores[0] == (0, 112) and cores[111] == (111, 223)
    assert list(cores)[:2] == [0, 1] and list(cores)[56] == 56  # socket 0's cores first
    assert effective_cpu_count(topo) == 224
    assert topo.quota is None


def test_container_allowed_4_of_64(tmp_path: Path) -> None:
    make_tree(tmp_path, sockets=1, cores_per_socket=64, threads=1)
    topo = read_topology(tmp_path, allowed={8, 9, 10, 11})
    assert len(topo.online) == 64
    assert topo.usable == frozenset({8, 9, 10, 11})
    assert effective_cpu_count(topo) == 4
    assert topo.physical_cores == 4


def test_offline_cpus_are_left_out(tmp_path: Path) -> None:
    online = make_tree(tmp_path, sockets=1, cores_per_socket=8, threads=1, offline={3, 6})
    topo = read_topology(tmp_path, allowed=range(8))  # a fake mask may name offline CPUs
    assert topo.online == online == frozenset({0, 1, 2, 4, 5, 7})
    assert [c.cpu for c in topo.cpus] == [0, 1, 2, 4, 5, 7]
    assert topo.usable == online
    assert effective_cpu_count(topo) == 6


def test_unequal_numa_nodes(tmp_path: Path) -> None:
    make_tree(tmp_path, sockets=1, cores_per_socket=12, threads=1, numa={0: "0-7", 1: "8-11"})
    topo = read_topology(tmp_path, allowed=range(12))
    assert [topo.cpu(c).numa for c in range(12)] == [0] * 8 + [1] * 4
    assert topo.numa_nodes == (0, 1)


def test_no_numa_dir_means_one_node_per_socket(tmp_path: Path) -> None:
    make_tree(tmp_path, sockets=2, cores_per_socket=2, threads=1)
    topo = read_topology(tmp_path, allowed=range(4))
    assert [topo.cpu(c).numa for c in range(4)] == [0, 0, 1, 1]
    assert any("NUMA" in n for n in topo.notes)


def test_cpuinfo_fallback_without_sysfs_topology(tmp_path: Path) -> None:
    make_tree(tmp_path, sockets=2, cores_per_socket=2, threads=2, sysfs_topology=False)
    topo = read_topology(tmp_path, allowed=range(8))
    assert topo.source == "/proc/cpuinfo"
    assert topo.physical_cores == 4
    assert topo.cpu(4).core == 0 and topo.cpu(6).socket == 1 and topo.cpu(6).core == 2


def test_flat_fallback_logs_a_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_tree(tmp_path, sockets=1, cores_per_socket=4, threads=1, sysfs_topology=False, cpuinfo_ids=False)
    with caplog.at_level("INFO", logger="cpuddp.topology"):
        topo = read_topology(tmp_path, allowed=range(4))
    assert topo.source == "flat"
    assert topo.physical_cores == 4 and topo.sockets == (0,)
    assert "its own core" in caplog.text and any("its own core" in n for n in topo.notes)


def test_flags_from_proc_cpuinfo(tmp_path: Path) -> None:
    make_tree(tmp_path, sockets=1, cores_per_socket=2, threads=1, flags="avx2 avx512f avx512_bf16 amx_tile amx_bf16")
    topo = read_topology(tmp_path, allowed=range(2))
    feats = cpu_features(topo)
    assert feats["avx512f"] and feats["avx512_bf16"] and feats["amx_tile"] and feats["amx_bf16"]
    assert not feats["amx_int8"]


def test_flags_fall_back_to_py_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.SimpleNamespace(get_cpu_info=lambda: {"flags": ["avx512f", "amxbf16"]})
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    make_tree(tmp_path, sockets=1, cores_per_socket=2, threads=1, flags=None)
    topo = read_topology(tmp_path, allowed=range(2))
    assert topo.flags == frozenset({"avx512f", "amxbf16"})
    assert cpu_features(topo)["amx_bf16"] and not cpu_features(topo)["amx_tile"]


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((), {"avx512f": False, "avx512_bf16": False, "amx_tile": False, "amx_bf16": False}),
        (("avx512f", "avx512_bf16"), {"avx512f": True, "avx512_bf16": True, "amx_tile": False, "amx_bf16": False}),
        (("AVX512F", "AVX512BF16", "AMXTILE"), {"avx512f": True, "avx512_bf16": True, "amx_tile": True, "amx_bf16": False}),
        (("avx512f", "amx_tile", "amx_bf16", "amx_int8"), {"avx512f": True, "avx512_bf16": False, "amx_tile": True, "amx_bf16": True}),
    ],
)
def test_cpu_features_table(flags: tuple[str, ...], expected: dict[str, bool]) -> None:
    got = cpu_features(flags)
    assert {k: got[k] for k in expected} == expected


# --------------------------------------------------------------------------- cgroups


@pytest.mark.parametrize(
    "leaf, parent, expected",
    [("max 100000\n", None, None), ("250000 100000\n", None, 2.5), ("400000 100000\n", "150000 100000\n", 1.5)],
)
def test_cgroup_v2_quota(tmp_path: Path, leaf: str, parent: Optional[str], expected: Optional[float]) -> None:
    make_tree(tmp_path, sockets=1, cores_per_socket=8, threads=1, cgroup="v2")
    _write(tmp_path / "sys/fs/cgroup/job/rank/cpu.max", leaf)
    _write(tmp_path / "sys/fs/cgroup/job/cpu.max", parent or "max 100000\n")
    _write(tmp_path / "sys/fs/cgroup/job/rank/cpuset.cpus.effective", "0-5\n")
    topo = read_topology(tmp_path, allowed=range(8))
    assert topo.quota == expected
    assert topo.cgroup_cpus == frozenset(range(6))
    assert topo.usable == frozenset(range(6))
    assert effective_cpu_count(topo) == (6 if expected is None else min(6, int(-(-expected // 1))))


def test_cgroup_v1_quota_and_cpuset(tmp_path: Path) -> None:
    make_tree(tmp_path, sockets=1, cores_per_socket=8, threads=1, cgroup="v1")
    d = tmp_path / "sys/fs/cgroup/cpu,cpuacct/docker/abc"
    _write(d / "cpu.cfs_quota_us", "300000\n")
    _write(d / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "sys/fs/cgroup/cpuset/docker/abc/cpuset.effective_cpus", "0-3\n")
    topo = read_topology(tmp_path, allowed=range(8))
    assert topo.quota == 3.0
    assert topo.cgroup_cpus == frozenset(range(4))
    assert effective_cpu_count(topo) == 3


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    make_tree(tmp_path, sockets=1, cores_per_socket=4, threads=1, cgroup="v1")
    d = tmp_path / "sys/fs/cgroup/cpu,cpuacct/docker/abc"
    _write(d / "cpu.cfs_quota_us", "-1\n")
    _write(d / "cpu.cfs_period_us", "100000\n")
    topo = read_topology(tmp_path, allowed=range(4))
    assert topo.quota is None and effective_cpu_count(topo) == 4


def test_cgroup_namespaced_path_falls_back_to_the_mount(tmp_path: Path) -> None:
    # Inside a container's cgroup namespace /proc/self/cgroup may name a path that is not
    # visible under the mount: the mount itself is this cgroup.
    make_tree(tmp_path, sockets=1, cores_per_socket=4, threads=1, cgroup="v2")
    _write(tmp_path / "sys/fs/cgroup/cpu.max", "100000 100000\n")
    topo = read_topology(tmp_path, allowed=range(4))
    assert topo.quota == 1.0 and effective_cpu_count(topo) == 1


# --------------------------------------------------------------------------- values


def test_effective_cpu_count_rounds_quota_up() -> None:
    topo = synthetic_topology(1, 8, quota=0.5)
    assert effective_cpu_count(topo) == 1
    assert effective_cpu_count(synthetic_topology(1, 8, quota=2.2)) == 3
    assert effective_cpu_count(synthetic_topology(1, 8, allowed={1, 2}, quota=6)) == 2


def test_synthetic_matches_linux_numbering() -> None:
    topo = synthetic_topology(2, 56, 2)
    assert len(topo.cpus) == 224 and topo.physical_cores == 112
    assert topo.cpu(0).core == topo.cpu(112).core
    assert topo.cpu(55).socket == 0 and topo.cpu(56).socket == 1
    unequal = synthetic_topology(2, [4, 2], numa_per_socket=2)
    assert [unequal.cpu(c).numa for c in range(6)] == [0, 0, 1, 1, 2, 3]


def test_topology_is_frozen_hashable_and_json_ready() -> None:
    import json

    topo = synthetic_topology(1, 2, 2, flags={"AVX512F"})
    with pytest.raises(Exception):
        topo.quota = 3  # type: ignore[misc]
    assert hash(topo) == hash(synthetic_topology(1, 2, 2, flags={"avx512f"}))
    assert topo.flags == frozenset({"avx512f"})
    data = json.loads(json.dumps(topo.as_dict()))
    assert data["physical_cores"] == 2 and data["logical_cpus"] == 4
    assert Topology(cpus=(LogicalCpu(0, 0),), online={0}, allowed={0}).cpu(5) == LogicalCpu(5, 5, 0, 0)


def test_bad_quota_rejected() -> None:
    with pytest.raises(ValueError, match="quota"):
        Topology(cpus=(), online={0}, allowed={0}, quota=0)


def test_read_topology_on_this_machine() -> None:
    topo = read_topology()
    assert topo.allowed == frozenset(os.sched_getaffinity(0))
    assert topo.usable and topo.usable <= topo.online
    assert 1 <= effective_cpu_count(topo) <= len(topo.online)
    assert set(cpu_features(topo)) >= {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


def test_import_is_light() -> None:
    code = (
        "import sys, cpuddp.topology, cpuddp.affinity; "
        "cpuddp.topology.read_topology(); "
        "bad = [m for m in ('cpuinfo', 'torch', 'mpi4py') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
