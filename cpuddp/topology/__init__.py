"""topology: what CPUs this process may use (logical CPUs, cores, sockets, NUMA nodes, cgroup
limits, instruction-set features).

Owns: the model, pure (:mod:`.model`), the one reader of the machine (:mod:`.read`), and
this process's facts on this node -- allowed CPUs, host identity, PID namespace, whether a
pid is alive -- (:mod:`.here`, which every other area reads them from).
May import: :mod:`cpuddp._package` only (for the lazy names below).  Everything that pins or
sizes threads reads it.

This package is public: the names below are importable from ``cpuddp.topology``, each loaded from
its module on first use (importing one module of the area never imports the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpuddp._package import lazy_names

# public name -> module of this package that defines it (loaded on first use)
_EXPORTS = {
    "LogicalCpu": "model",
    "Topology": "model",
    "read_topology": "read",
    "synthetic_topology": "model",
    "cpu_features": "model",
    "effective_cpu_count": "model",
    "parse_cpulist": "model",
    "format_cpulist": "model",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

if TYPE_CHECKING:  # pragma: no cover  # noqa: F401 (names for type checkers)
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
