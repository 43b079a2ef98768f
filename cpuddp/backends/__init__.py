"""backends: which collective backend can run here, why, and how to load and configure it.

Owns: the registry and the choice (:mod:`.registry`, the rule of ``backend="auto"`` in
:mod:`.auto`), the data it passes around (:mod:`.types`), the oneCCL bindings (:mod:`.ccl`,
the import probe :mod:`.ccl_probe` and its cache :mod:`.cache`), the variables exported before
``init_process_group`` (:mod:`.settings`), the explanation of a first collective that fails
(:mod:`.failure`), and cpuddp's own shared-memory backend (:mod:`.shm`; its public door is
:mod:`cpuddp.shm`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._units`, :mod:`cpuddp._compat`, :mod:`cpuddp._package`,
:mod:`cpuddp.topology`, :mod:`cpuddp.launchers`, :mod:`cpuddp.affinity`.

This package is public: the names below are importable from ``cpuddp.backends``, each loaded
from its module on first use (importing one module of the area never imports the rest; none
of these names imports torch or a binding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpuddp._package import lazy_names

# public name -> module of this package that defines it (loaded on first use)
_EXPORTS = {
    "BackendStatus": "types",
    "BackendChoice": "types",
    "BackendSpec": "types",
    "Lookups": "types",
    "BACKENDS": "registry",
    "available_backends": "registry",
    "backend_status": "registry",
    "resolve_backend": "registry",
    "load_backend": "registry",
    "backend_env": "settings",
    "ccl_env": "settings",
    "ccl_settings": "settings",
    "CclPaths": "settings",
    "find_ccl_paths": "settings",
    "explain_collective_failure": "failure",
    "gloo_env": "settings",
    "register_backend": "registry",
    "unregister_backend": "registry",
    "ccl_pairing": "ccl",
    "ccl_module_for": "ccl",
    "CCL_DISTRIBUTIONS": "ccl",
    "SKIP_VERSION_CHECK_VAR": "ccl",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

if TYPE_CHECKING:  # pragma: no cover  # noqa: F401 (names for type checkers)
    from .ccl import CCL_DISTRIBUTIONS, SKIP_VERSION_CHECK_VAR, ccl_module_for, ccl_pairing
    from .failure import explain_collective_failure
    from .registry import (
        BACKENDS,
        available_backends,
        backend_status,
        load_backend,
        register_backend,
        resolve_backend,
        unregister_backend,
    )
    from .settings import CclPaths, backend_env, ccl_env, ccl_settings, find_ccl_paths, gloo_env
    from .types import BackendChoice, BackendSpec, BackendStatus, Lookups
