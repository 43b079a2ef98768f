"""Reading this machine's :class:`~cpuddp.topology.Topology`: sysfs, /proc and the cgroup.

:func:`read_topology` (also :func:`cpuddp.topology.read_topology`; :mod:`cpuddp.topology.model`'s
docstring lists what is read and the fallbacks) is the only function in the package that reads
the CPU layout from the machine; each step below is one source, under an injectable filesystem ``root``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable, Optional

from . import here
from .model import LogicalCpu, PathLike, Topology, parse_cpulist

__all__ = ["read_topology"]

log = logging.getLogger("cpuddp.topology")


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> Optional[int]:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _mounts(root: Path) -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fstype, super options) from /proc/self/mountinfo."""
    text = _read(root / "proc/self/mountinfo") or ""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 1:
            continue
        out.append((_unescape(lf[3]), _unescape(lf[4]), rf[0], rf[2] if len(rf) > 2 else ""))
    return out


def _cgroup_dirs(root: Path, version: int, controller: str) -> list[Path]:
    """This process's cgroup directory for ``controller`` and its ancestors, leaf first."""
    groups = _read(root / "proc/self/cgroup") or ""
    rel = None
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        if version == 2 and hid == "0" and ctrls == "":
            rel = path
        elif version == 1 and controller in ctrls.split(","):
            rel = path
    if rel is None:
        return []
    for mroot, mpoint, fstype, opts in _mounts(root):
        if version == 2 and fstype != "cgroup2":
            continue
        if version == 1 and (fstype != "cgroup" or controller not in opts.split(",")):
            continue
        top = root / mpoint.lstrip("/")
        # Inside a cgroup namespace the mount's root is the namespace root; strip it.
        sub = rel
        if mroot not in ("/", "") and (sub == mroot or sub.startswith(mroot.rstrip("/") + "/")):
            sub = sub[len(mroot.rstrip("/")):]
        leaf = top / sub.lstrip("/")
        if not leaf.is_dir():
            leaf = top  # path not visible from here (namespaced container): use the mount
        dirs = [leaf]
        while dirs[-1] != top and top in dirs[-1].parents:
            dirs.append(dirs[-1].parent)
        return dirs
    return []


def _read_cgroup(root: Path) -> tuple[Optional[float], Optional[frozenset[int]], str]:
    """(quota in CPUs or None, effective cpuset or None, where they came from)."""
    v2 = _cgroup_dirs(root, 2, "")
    if any((d / "cpu.max").exists() for d in v2):
        quota, where = _quota_v2(v2)
    else:
        quota, where = _quota_v1(_cgroup_dirs(root, 1, "cpu"))
    return quota, _cpuset(root, v2), where


def _quota_v2(dirs: list[Path]) -> tuple[Optional[float], str]:
    """The lowest ``cpu.max`` quota among ``dirs`` (leaf first), in CPUs."""
    quota: Optional[float] = None
    where = "cgroup v2 cpu.max: max"
    for d in dirs:
        text = _read(d / "cpu.max")
        if text is None:
            continue
        parts = text.split()
        if len(parts) >= 1 and parts[0] != "max":
            try:
                q = int(parts[0]) / int(parts[1] if len(parts) > 1 else 100000)
            except (ValueError, ZeroDivisionError):
                continue
            if q > 0 and (quota is None or q < quota):
                quota, where = q, f"cgroup v2 {d / 'cpu.max'}"
    return quota, where


def _quota_v1(dirs: list[Path]) -> tuple[Optional[float], str]:
    """The lowest ``cpu.cfs_quota_us / cpu.cfs_period_us`` among ``dirs`` (leaf first)."""
    quota: Optional[float] = None
    where = "no cgroup CPU limit found"
    for d in dirs:
        q_us = _read_int(d / "cpu.cfs_quota_us")
        p_us = _read_int(d / "cpu.cfs_period_us")
        if q_us is None or p_us is None:
            continue
        if q_us > 0 and p_us > 0:
            q = q_us / p_us
            if quota is None or q < quota:
                quota, where = q, f"cgroup v1 {d / 'cpu.cfs_quota_us'}"
        elif quota is None:
            where = "cgroup v1 cpu.cfs_quota_us: -1"
    return quota, where


def _cpuset(root: Path, v2: list[Path]) -> Optional[frozenset[int]]:
    """The cgroup's effective cpuset (v2, else v1), or None."""
    for d in v2[:1]:
        text = _read(d / "cpuset.cpus.effective")
        if text is not None and text.strip():
            return parse_cpulist(text)
    for d in _cgroup_dirs(root, 1, "cpuset")[:1]:
        text = _read(d / "cpuset.effective_cpus") or _read(d / "cpuset.cpus")
        if text is not None and text.strip():
            return parse_cpulist(text)
    return None


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks, cur = [], {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                blocks.append(cur)
                cur = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            cur[key.strip()] = value.strip()
    if cur:
        blocks.append(cur)
    return blocks


def _flags_from_cpuinfo(blocks: list[dict[str, str]]) -> Optional[frozenset[str]]:
    for b in blocks:
        for key in ("flags", "Features"):  # x86 / arm64
            if key in b:
                return frozenset(b[key].lower().split())
    return None


def _flags_from_py_cpuinfo() -> frozenset[str]:
    try:
        import cpuinfo  # py-cpuinfo: slow (may spawn a subprocess), so only as a fallback

        return frozenset(str(f).lower() for f in cpuinfo.get_cpu_info().get("flags", []))
    except Exception as exc:  # any failure here only costs us the feature flags
        log.info("cpuddp: could not read CPU flags with py-cpuinfo either: %s", exc)
        return frozenset()


def read_topology(root: PathLike = "/", *, allowed: Optional[Iterable[int]] = None) -> Topology:
    """Read this machine's :class:`Topology` (the only impure function of the topology modules).

    ``root``: the filesystem root holding ``sys/`` and ``proc/`` (a fake tree in tests).
    ``allowed``: the affinity mask to record; default ``os.sched_getaffinity(0)``.
    """
    root = Path(root)
    cpu_dir = root / "sys/devices/system/cpu"
    notes: list[str] = []
    online = _online(cpu_dir, notes)
    blocks = _cpuinfo_blocks(_read(root / "proc/cpuinfo") or "")
    layout, source = _layout(cpu_dir, online, blocks, notes)
    numa = _numa(root / "sys/devices/system/node", notes)
    cpus = tuple(
        LogicalCpu(c, core, sock, numa.get(c, sock)) for c, (core, sock) in sorted(layout.items())
    )
    flags = _flags_from_cpuinfo(blocks)
    if flags is None:
        notes.append("no flags line in /proc/cpuinfo: asked py-cpuinfo")
        flags = _flags_from_py_cpuinfo()
    quota, cpuset, where = _read_cgroup(root)
    if quota is not None:
        notes.append(f"CPU quota {quota:g} CPUs from {where}")
    topo = Topology(
        cpus=cpus,
        online=online,
        allowed=frozenset(allowed) if allowed is not None else frozenset(here.allowed_cpus(ask_psutil=True)) or online,
        cgroup_cpus=cpuset,
        quota=quota,
        flags=flags,
        source=source,
        notes=tuple(notes),
    )
    log.debug("cpuddp: topology %s", topo.as_dict())
    return topo


def _online(cpu_dir: Path, notes: list[str]) -> frozenset[int]:
    """The online CPUs: sysfs ``online``, else the cpuN directories, else psutil's count."""
    online_text = _read(cpu_dir / "online")
    if online_text is not None and online_text.strip():
        return parse_cpulist(online_text)
    present = sorted(int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*")) if cpu_dir.is_dir() else []
    if present:
        notes.append(f"{cpu_dir / 'online'} unreadable: took the cpuN directories as online")
        return frozenset(present)
    import psutil

    online = frozenset(range(psutil.cpu_count(logical=True) or os.cpu_count() or 1))
    notes.append(f"{cpu_dir} unreadable: took CPUs 0..{len(online) - 1} from psutil")
    return online


def _layout(cpu_dir: Path, online: frozenset[int], blocks: list[dict[str, str]],
            notes: list[str]) -> tuple[dict[int, tuple[int, int]], str]:
    """cpu -> (core, socket), and its source: sysfs, else /proc/cpuinfo, else flat."""
    layout = _layout_sysfs(cpu_dir, online)
    if layout:
        return layout, "sysfs"
    layout = _layout_cpuinfo(blocks, online)
    if layout and set(layout) == set(online):
        return layout, "/proc/cpuinfo"
    import psutil

    physical = psutil.cpu_count(logical=False)
    reason = (
        f"no core/socket ids in {cpu_dir}/cpuN/topology or /proc/cpuinfo: "
        f"treating each of the {len(online)} logical CPUs as its own core on socket 0"
    )
    if physical and physical < len(online):
        reason += f" (psutil counts {physical} physical cores, but not which CPUs share one)"
    notes.append(reason)
    log.info("cpuddp: %s", reason)
    return {c: (c, 0) for c in online}, "flat"


def _layout_sysfs(cpu_dir: Path, online: frozenset[int]) -> dict[int, tuple[int, int]]:
    layout: dict[int, tuple[int, int]] = {}
    for c in sorted(online):
        tdir = cpu_dir / f"cpu{c}" / "topology"
        pkg = _read_int(tdir / "physical_package_id")
        sib = _read(tdir / "core_cpus_list") or _read(tdir / "thread_siblings_list")
        if pkg is None or sib is None:
            return {}
        try:
            siblings = parse_cpulist(sib) or frozenset([c])
        except ValueError:
            return {}
        layout[c] = (min(siblings), max(pkg, 0))
    return layout


def _layout_cpuinfo(blocks: list[dict[str, str]], online: frozenset[int]) -> dict[int, tuple[int, int]]:
    layout: dict[int, tuple[int, int]] = {}
    by_id: dict[tuple[int, int], int] = {}
    for b in blocks:
        try:
            c, pkg, core_id = int(b["processor"]), int(b["physical id"]), int(b["core id"])
        except (KeyError, ValueError):
            return {}
        if c in online:
            first = by_id.setdefault((pkg, core_id), c)
            layout[c] = (first, pkg)
    return layout


def _numa(node_dir: Path, notes: list[str]) -> dict[int, int]:
    """cpu -> NUMA node from sysfs; empty (one node per socket) when there is none."""
    numa: dict[int, int] = {}
    if node_dir.is_dir():
        for nd in sorted(node_dir.glob("node[0-9]*")):
            text = _read(nd / "cpulist")
            if text is None:
                continue
            try:
                for c in parse_cpulist(text):
                    numa.setdefault(c, int(nd.name[4:]))
            except ValueError:
                continue
    if not numa:
        notes.append(f"no NUMA information in {node_dir}: one NUMA node per socket")
    return numa
