"""What CPUs this process may use: logical CPUs, physical cores, sockets, NUMA nodes, limits.

This module is the model, and it is pure.  :func:`cpuddp.topology.read.read_topology` is the one
function of the area that touches the machine.  It reads, under
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
fake machines with :func:`synthetic_topology` or the constructor.  The reading itself, one
function per source, is in :mod:`cpuddp.topology.read`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

__all__ = [
    "LogicalCpu",
    "Topology",
    "synthetic_topology",
    "cpu_features",
    "effective_cpu_count",
    "parse_cpulist",
    "format_cpulist",
]

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
