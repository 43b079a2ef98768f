"""launchers: where the launcher put this process, and how the ranks meet.

Owns: the facts of a launched process (:mod:`.env`: :class:`~cpuddp.DistEnv`), the readers of
every launcher's variables (the interface and what they share in :mod:`.readers`, one module
per launcher, ``read_<launcher>.py``; :mod:`.parsers`) and :func:`detect` (:mod:`.registry`,
with the registry of readers, the one list of the built-ins), what init exports for the code
after it (:mod:`.exports`), the hosts of the job (:mod:`.hosts`), the network interface
(:mod:`.netif`), the rendezvous store (:mod:`.rendezvous`), the checking of what is read
from it (:mod:`.store_values`) and what a failing rank tells its launcher (:mod:`.report`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._package`, :mod:`cpuddp.topology.here`.

This package is public: the names below are importable from ``cpuddp.launchers``, each loaded from
its module on first use (importing one module of the area never imports the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpuddp._package import lazy_names

# public name -> module of this package that defines it (loaded on first use)
_EXPORTS = {
    "READERS": "registry",
    "LAUNCHER_NAMES": "registry",
    "LauncherReader": "readers",
    "PartialEnv": "readers",
    "Variables": "readers",
    "register_launcher": "registry",
    "unregister_launcher": "registry",
    "registered_launchers": "registry",
    "detect": "registry",
    "expand_nodelist": "parsers",
    "expand_tasks_per_node": "parsers",
    "derive_port": "parsers",
    "is_loopback": "parsers",
    "LAUNCHER_ENV_PREFIXES": "registry",
    "LAUNCHER_ENV_NAMES": "registry",
    "is_launcher_variable": "registry",
    "clean_environ": "registry",
    "BACKEND_ENV_PREFIXES": "registry",
    "BACKEND_ENV_NAMES": "registry",
    "Provenance": "env",
    "Source": "env",
}

__all__ = list(_EXPORTS)
# READERS is rebound by every (un)registration: asked of its module at every access
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, fresh=("READERS",))

if TYPE_CHECKING:  # pragma: no cover  # noqa: F401 (names for type checkers)
    from .env import Provenance, Source
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
