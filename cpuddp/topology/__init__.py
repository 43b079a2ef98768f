"""topology: what CPUs this process may use (logical CPUs, cores, sockets, NUMA nodes, cgroup
limits, instruction-set features).

Owns: the model, pure (:mod:`.model`), the one reader of the machine (:mod:`.read`), and
this process's facts on this node -- allowed CPUs, host identity, PID namespace, whether a
pid is alive -- (:mod:`.here`, which every other area reads them from).
May import: no other module of the package (standard library only).  Everything that pins or
sizes threads reads it.

This package is public: the names below are importable from ``cpuddp.topology``; standard
library only, so they are plain imports (docs/code.md, "Lazy names").
"""

from __future__ import annotations

from .model import (
    LogicalCpu,
    Topology,
    cpu_features,
    effective_cpu_count,
    format_cpulist,
    parse_cpulist,
    synthetic_topology,
)
from .read import read_topology

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
