"""topology: what CPUs this process may use (logical CPUs, cores, sockets, NUMA nodes, cgroup
limits, instruction-set features).

Owns: the model, pure (:mod:`.model`), and the one reader of the machine (:mod:`.read`).
May import: nothing else of cpuddp.  Everything that pins or sizes threads reads it.

This package is public: the names below are importable from ``cpuddp.topology``.
"""

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

__all__ = ["LogicalCpu", "Topology", "read_topology", "synthetic_topology", "cpu_features",
           "effective_cpu_count", "parse_cpulist", "format_cpulist"]
