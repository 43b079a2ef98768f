"""launchers: where the launcher put this process, and how the ranks meet.

Owns: the facts of a launched process (:mod:`.env`: :class:`~cpuddp.DistEnv`), the readers of
every launcher's variables (:mod:`.readers`, :mod:`.parsers`) and :func:`detect`
(:mod:`.registry`, with the registry of readers), what init exports for the code after it (:mod:`.exports`), the hosts of the
job (:mod:`.hosts`), the network interface (:mod:`.netif`), the rendezvous store
(:mod:`.rendezvous`) and the checking of what is read from it (:mod:`.store_values`).
May import: :mod:`cpuddp.errors` only.

This package is public: the names below are importable from ``cpuddp.launchers``.
"""

from .parsers import derive_port, expand_nodelist, expand_tasks_per_node, is_loopback
from .readers import LauncherReader, PartialEnv, Variables
from .registry import (
    BACKEND_ENV_NAMES,
    BACKEND_ENV_PREFIXES,
    LAUNCHER_ENV_NAMES,
    LAUNCHER_ENV_PREFIXES,
    LAUNCHER_NAMES,
    READERS,
    clean_environ,
    detect,
    is_launcher_variable,
    register_launcher,
    registered_launchers,
    unregister_launcher,
)

__all__ = ["READERS", "LAUNCHER_NAMES", "LauncherReader", "PartialEnv", "Variables", "register_launcher",
           "unregister_launcher", "registered_launchers", "detect", "expand_nodelist", "expand_tasks_per_node",
           "derive_port", "is_loopback", "LAUNCHER_ENV_PREFIXES", "LAUNCHER_ENV_NAMES", "is_launcher_variable",
           "clean_environ", "BACKEND_ENV_PREFIXES", "BACKEND_ENV_NAMES"]
