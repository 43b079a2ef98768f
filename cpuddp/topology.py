"""What CPUs this process may use: logical CPUs, physical cores, sockets, NUMA nodes, limits.

:func:`read_topology` is the only function here that touches the machine.  It reads, under
an injectable filesystem ``root`` (``/`` by default, a temporary tree in tests):

- ``/sys/devices/system/cpu/online`` and, per online CPU, ``cpuN/topology/``
  (``physical_package_id``, ``core_cpus_list`` or ``thread_siblings_list``, ``core_id``);
- ``/sys/devices/system/node/nodeN/cpulist`` for NUMA nodes;
- ``/proc/cpuinfo`` for instruction-set ``flags`` (and for ``physical id``/``core id`` when
  sysfs has no topology, as in some sandboxes);
- ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` to find this process's cgroup, then
  ``cpu.max`` (v2) or ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` (v1), the lowest limit of
  the cgroup and its ancestors, and ``cpuset.cpus.effective`` / ``cpuset.effective_cpus``;
- ``os.sched_getaffinity(0)`` (psutil's ``cpu_affinity()`` where that is missing) for the
  allowed set.

Fallbacks, each recorded in :attr:`Topology.source` and logged on ``cpuddp.topology``: no
sysfs topology -> ``/proc/cpuinfo`` ids -> "each logical CPU is its own core on socket 0";
no NUMA directory -> one NUMA node per socket; no ``flags`` line -> py-cpuinfo (imported
only then: it is slow and may spawn a subprocess).

Everything else is pure: :class:`Topology` is a frozen value, and tests (or users) build
fake machines with :func:`synthetic_topology` or the constructor.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

__all__ = [
    "LogicalCpu",
    "Topology",
    "read_topology",
    "synthetic_topology",
    "cpu_features",
    "effective_cpu_count",
    "parse_cpulist",
    "format_cpulist",
]

log = logging.getLogger("cpuddp.topology")

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------- cpu lists


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel CPU list (``"0-3,8-11"``; ``"0-31:2/4"``: first 2 of every 4; ``""``).

    Raises ValueError naming the bad part, e.g. for ``"3-1"`` or ``"a"``.
    """
    out: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?", part)
        if not m:
            raise ValueError(f"bad CPU list item {part!r} in {text!r}: expected N, N-M or N-M:used/group")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"bad CPU range {part!r} in {text!r}: end is below start")
        if m.group(3) is None:
            out.update(range(lo, hi + 1))
        else:
            # Kernel syntax "a-b:used/group": in each group of `group` CPUs use the first `used`.
            used = int(m.group(3))
            group = int(m.group(4))
            if used < 1 or group < 1 or used > group:
                raise ValueError(f"bad CPU range {part!r} in {text!r}: need 1 <= used <= group")
            out.update(c for c in range(lo, hi + 1) if (c - lo) % group < used)
    return frozenset(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpulist`: ``{0,1,2,3,8}`` -> ``"0-3,8"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


# --------------------------------------------------------------------------- the value


@dataclass(frozen=True, order=True)
class LogicalCpu:
    """One logical CPU: ``core`` is the lowest logical CPU id among its hyperthread siblings,
    so it names the physical core uniquely across the machine."""

    cpu: int
    core: int
    socket: int = 0
    numa: int = 0


@dataclass(frozen=True)
class Topology:
    """A machine as seen by this process.

    ``cpus``: the online logical CPUs.  ``online``: their ids.  ``allowed``: the affinity
    mask (``os.sched_getaffinity``).  ``cgroup_cpus``: the cgroup's effective cpuset, or None
    when unknown.  ``quota``: the cgroup CPU bandwidth limit in CPUs (``1.5`` = 150 ms per
    100 ms), or None for no limit.  ``flags``: instruction-set flags, lower case, as
    ``/proc/cpuinfo`` spells them.  ``source``: how the core/socket layout was found.
    """

    cpus: tuple[LogicalCpu, ...]
    online: frozenset[int]
    allowed: frozenset[int]
    cgroup_cpus: Optional[frozenset[int]] = None
    quota: Optional[float] = None
    flags: frozenset[str] = frozenset()
    source: str = "given"
    notes: tuple[str, ...] = ()
    _by_cpu: Mapping[int, LogicalCpu] = field(default=None, init=False, repr=False, compare=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpus", tuple(sorted(self.cpus)))
        object.__setattr__(self, "online", frozenset(self.online))
        object.__setattr__(self, "allowed", frozenset(self.allowed))
        if self.cgroup_cpus is not None:
            object.__setattr__(self, "cgroup_cpus", frozenset(self.cgroup_cpus))
        object.__setattr__(self, "flags", frozenset(f.lower() for f in self.flags))
        object.__setattr__(self, "_by_cpu", {c.cpu: c for c in self.cpus})
        if self.quota is not None and not self.quota > 0:
            raise ValueError(f"Topology.quota must be a positive number of CPUs or None, got {self.quota!r}")

    def cpu(self, cpu_id: int) -> LogicalCpu:
        """The :class:`LogicalCpu` for ``cpu_id`` (a CPU the layout does not know is its own
        core on socket 0, NUMA node 0)."""
        found = self._by_cpu.get(cpu_id)
        return found if found is not None else LogicalCpu(cpu_id, cpu_id, 0, 0)

    @property
    def usable(self) -> frozenset[int]:
        """Logical CPUs this process may run on: allowed, online, and in the cgroup cpuset."""
        out = self.allowed & self.online
        if self.cgroup_cpus is not None and out & self.cgroup_cpus:
            out &= self.cgroup_cpus
        return out

    @property
    def base(self) -> frozenset[int]:
        """The CPUs any process of this container could be given: online ∩ cgroup cpuset.

        When :attr:`allowed` is narrower than this, something (a launcher's binding, taskset,
        numactl) narrowed this process.
        """
        out = self.online
        if self.cgroup_cpus is not None and out & self.cgroup_cpus:
            out &= self.cgroup_cpus
        return out

    def cores(self, cpus: Optional[Iterable[int]] = None) -> dict[int, tuple[int, ...]]:
        """Physical core -> its logical CPUs among ``cpus`` (default :attr:`usable`),
        ordered by (socket, NUMA node, core)."""
        pool = self.usable if cpus is None else frozenset(cpus)
        groups: dict[int, list[int]] = {}
        for c in sorted(pool):
            groups.setdefault(self.cpu(c).core, []).append(c)
        keys = sorted(groups, key=lambda k: (self.cpu(groups[k][0]).socket, self.cpu(groups[k][0]).numa, k))
        return {k: tuple(groups[k]) for k in keys}

    @property
    def sockets(self) -> tuple[int, ...]:
        """Socket ids with at least one online CPU."""
        return tuple(sorted({c.socket for c in self.cpus}))

    @property
    def numa_nodes(self) -> tuple[int, ...]:
        """NUMA node ids with at least one online CPU."""
        return tuple(sorted({c.numa for c in self.cpus}))

    @property
    def physical_cores(self) -> int:
        """Physical cores with at least one usable logical CPU."""
        return len(self.cores())

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``cpuddp doctor``) and logs."""
        return {
            "online": format_cpulist(self.online),
            "allowed": format_cpulist(self.allowed),
            "usable": format_cpulist(self.usable),
            "cgroup_cpus": None if self.cgroup_cpus is None else format_cpulist(self.cgroup_cpus),
            "quota": self.quota,
            "logical_cpus": len(self.cpus),
            "physical_cores": self.physical_cores,
            "sockets": list(self.sockets),
            "numa_nodes": list(self.numa_nodes),
            "effective_cpu_count": effective_cpu_count(self),
            "features": cpu_features(self),
            "source": self.source,
            "notes": list(self.notes),
            "cpus": [[c.cpu, c.core, c.socket, c.numa] for c in self.cpus],
        }


def synthetic_topology(
    sockets: int = 1,
    cores_per_socket: Union[int, Iterable[int]] = 2,
    threads_per_core: int = 1,
    *,
    numa_per_socket: int = 1,
    allowed: Optional[Iterable[int]] = None,
    offline: Iterable[int] = (),
    quota: Optional[float] = None,
    flags: Iterable[str] = (),
) -> Topology:
    """A fake machine numbered the way Linux numbers x86 servers.

    First threads of every core come first (socket 0's cores, then socket 1's ...), then the
    second threads in the same order: with 2 sockets x 56 cores x 2 threads, CPU 0 and CPU
    112 are siblings.  ``cores_per_socket`` may be a list for unequal sockets; each socket's
    cores are split into ``numa_per_socket`` contiguous NUMA nodes (the first ones get the
    remainder).  ``offline`` CPUs are left out of :attr:`Topology.cpus` and ``online``.
    """
    per_socket = [cores_per_socket] * sockets if isinstance(cores_per_socket, int) else list(cores_per_socket)
    if len(per_socket) != sockets:
        raise ValueError(f"cores_per_socket has {len(per_socket)} entries for {sockets} sockets")
    layout: list[tuple[int, int]] = []  # (socket, numa) per core, in core order
    for s, n in enumerate(per_socket):
        sizes = [n // numa_per_socket + (1 if i < n % numa_per_socket else 0) for i in range(numa_per_socket)]
        for i, size in enumerate(sizes):
            layout.extend([(s, s * numa_per_socket + i)] * size)
    ncores = len(layout)
    off = frozenset(offline)
    cpus = []
    for t in range(threads_per_core):
        for k, (s, numa) in enumerate(layout):
            cpu = t * ncores + k
            if cpu not in off:
                cpus.append(LogicalCpu(cpu, k, s, numa))
    online = frozenset(c.cpu for c in cpus)
    return Topology(
        cpus=tuple(cpus),
        online=online,
        allowed=online if allowed is None else frozenset(allowed),
        quota=quota,
        flags=frozenset(flags),
        source="synthetic",
    )


# --------------------------------------------------------------------------- features and counts


#: The features :func:`cpu_features` reports, with the spellings each source uses.
_FEATURES = {
    "avx2": ("avx2",),
    "avx512f": ("avx512f",),
    "avx512_vnni": ("avx512_vnni", "avx512vnni"),
    "avx512_bf16": ("avx512_bf16", "avx512bf16"),
    "amx_tile": ("amx_tile", "amxtile"),
    "amx_bf16": ("amx_bf16", "amxbf16"),
    "amx_int8": ("amx_int8", "amxint8"),
}


def cpu_features(topology_or_flags: Union[Topology, Iterable[str]]) -> dict[str, bool]:
    """Which of AVX2, AVX-512F, AVX512-VNNI, AVX512-BF16 and AMX (tile/bf16/int8) are present.

    Takes a :class:`Topology` or any iterable of flag names (``/proc/cpuinfo`` or py-cpuinfo
    spelling).  Keys: ``avx2``, ``avx512f``, ``avx512_vnni``, ``avx512_bf16``, ``amx_tile``,
    ``amx_bf16``, ``amx_int8``.
    """
    flags = topology_or_flags.flags if isinstance(topology_or_flags, Topology) else topology_or_flags
    have = {str(f).lower() for f in flags}
    return {name: any(s in have for s in spellings) for name, spellings in _FEATURES.items()}


def effective_cpu_count(topo: Topology) -> int:
    """CPUs this process can really use: the usable set, capped by the cgroup quota (rounded
    up, as the JVM and Go do), at least 1."""
    n = len(topo.usable) or len(topo.online) or 1
    if topo.quota is not None:
        n = min(n, max(1, math.ceil(topo.quota - 1e-9)))
    return max(1, n)


# --------------------------------------------------------------------------- the reader


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
    quota: Optional[float] = None
    where = "no cgroup CPU limit found"
    v2 = _cgroup_dirs(root, 2, "")
    v2_has_cpu = any((d / "cpu.max").exists() for d in v2)
    if v2_has_cpu:
        for d in v2:
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
        if quota is None:
            where = "cgroup v2 cpu.max: max"
    else:
        for d in _cgroup_dirs(root, 1, "cpu"):
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
    cpuset: Optional[frozenset[int]] = None
    for d in v2[:1]:
        text = _read(d / "cpuset.cpus.effective")
        if text is not None and text.strip():
            cpuset = parse_cpulist(text)
    if cpuset is None:
        for d in _cgroup_dirs(root, 1, "cpuset")[:1]:
            text = _read(d / "cpuset.effective_cpus") or _read(d / "cpuset.cpus")
            if text is not None and text.strip():
                cpuset = parse_cpulist(text)
    return quota, cpuset, where


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


def _allowed(online: frozenset[int]) -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    try:
        import psutil

        return frozenset(psutil.Process().cpu_affinity())
    except Exception:
        return online


def read_topology(root: PathLike = "/", *, allowed: Optional[Iterable[int]] = None) -> Topology:
    """Read this machine's :class:`Topology` (the only impure function in this module).

    ``root``: the filesystem root holding ``sys/`` and ``proc/`` (a fake tree in tests).
    ``allowed``: the affinity mask to record; default ``os.sched_getaffinity(0)``.
    """
    root = Path(root)
    cpu_dir = root / "sys/devices/system/cpu"
    notes: list[str] = []

    # Online CPUs.
    online_text = _read(cpu_dir / "online")
    if online_text is not None and online_text.strip():
        online = parse_cpulist(online_text)
    else:
        present = sorted(int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*")) if cpu_dir.is_dir() else []
        if present:
            online = frozenset(present)
            notes.append(f"{cpu_dir / 'online'} unreadable: took the cpuN directories as online")
        else:
            import psutil

            online = frozenset(range(psutil.cpu_count(logical=True) or os.cpu_count() or 1))
            notes.append(f"{cpu_dir} unreadable: took CPUs 0..{len(online) - 1} from psutil")

    # Sockets and cores: sysfs, else /proc/cpuinfo, else one core per logical CPU.
    cpuinfo_text = _read(root / "proc/cpuinfo") or ""
    blocks = _cpuinfo_blocks(cpuinfo_text)
    layout: dict[int, tuple[int, int]] = {}  # cpu -> (core, socket)
    source = "sysfs"
    for c in sorted(online):
        tdir = cpu_dir / f"cpu{c}" / "topology"
        pkg = _read_int(tdir / "physical_package_id")
        sib = _read(tdir / "core_cpus_list") or _read(tdir / "thread_siblings_list")
        if pkg is None or sib is None:
            layout = {}
            break
        try:
            siblings = parse_cpulist(sib) or frozenset([c])
        except ValueError:
            layout = {}
            break
        layout[c] = (min(siblings), max(pkg, 0))
    if not layout:
        source = "/proc/cpuinfo"
        by_id: dict[tuple[int, int], int] = {}
        for b in blocks:
            try:
                c, pkg, core_id = int(b["processor"]), int(b["physical id"]), int(b["core id"])
            except (KeyError, ValueError):
                layout = {}
                break
            if c in online:
                first = by_id.setdefault((pkg, core_id), c)
                layout[c] = (first, pkg)
        if not layout or set(layout) != set(online):
            layout = {c: (c, 0) for c in online}
            import psutil

            physical = psutil.cpu_count(logical=False)
            source = "flat"
            reason = (
                f"no core/socket ids in {cpu_dir}/cpuN/topology or /proc/cpuinfo: "
                f"treating each of the {len(online)} logical CPUs as its own core on socket 0"
            )
            if physical and physical < len(online):
                reason += f" (psutil counts {physical} physical cores, but not which CPUs share one)"
            notes.append(reason)
            log.info("cpuddp: %s", reason)

    # NUMA nodes: sysfs, else one node per socket.
    numa: dict[int, int] = {}
    node_dir = root / "sys/devices/system/node"
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
    cpus = tuple(
        LogicalCpu(c, core, sock, numa.get(c, sock)) for c, (core, sock) in sorted(layout.items())
    )

    # Flags: /proc/cpuinfo, else py-cpuinfo.
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
        allowed=frozenset(allowed) if allowed is not None else _allowed(online),
        cgroup_cpus=cpuset,
        quota=quota,
        flags=flags,
        source=source,
        notes=tuple(notes),
    )
    log.debug("cpuddp: topology %s", topo.as_dict())
    return topo
