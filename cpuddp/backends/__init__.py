"""backends: which collective backend can run here, why, and how to load and configure it.

Owns: the registry and the choice (:mod:`.registry`, the rule of ``backend="auto"`` in
:mod:`.auto`), the backend's part of init in one call (:mod:`.start`): the decision
(:mod:`.decide`: agreed by every rank, one ``BackendPlan``), carried out to a group formed and
proven (:mod:`.forming`), the data it passes around (:mod:`.types`), the oneCCL bindings
(:mod:`.ccl`, the import probe :mod:`.ccl_probe` and its cache :mod:`.cache`), the variables
exported before ``init_process_group`` (:mod:`.settings`), the explanation of a first collective
that fails (:mod:`.failure`), and cpuddp's own shared-memory backend (:mod:`.shm`; its public
door is :mod:`cpuddp.shm`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._units`, :mod:`cpuddp._compat`, :mod:`cpuddp.topology`,
:mod:`cpuddp.launchers`, :mod:`cpuddp.affinity`.

This package is public: the names below are importable from ``cpuddp.backends``.  None of them
imports torch or a binding, so they are plain imports (docs/code.md, "Lazy names").
"""

from __future__ import annotations

from .ccl import CCL_DISTRIBUTIONS, SKIP_VERSION_CHECK_VAR, ccl_module_for, ccl_pairing
from .registry import (
    BACKENDS,
    available_backends,
    backend_status,
    explain_collective_failure,
    load_backend,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from .settings import CclPaths, backend_env, ccl_env, ccl_settings, find_ccl_paths, gloo_env
from .types import BackendChoice, BackendName, BackendSpec, BackendStatus, Lookups, backend_for

__all__ = [
    "BackendStatus",
    "BackendChoice",
    "BackendName",
    "BackendSpec",
    "backend_for",
    "Lookups",
    "BACKENDS",
    "available_backends",
    "backend_status",
    "resolve_backend",
    "load_backend",
    "backend_env",
    "ccl_env",
    "ccl_settings",
    "CclPaths",
    "find_ccl_paths",
    "explain_collective_failure",
    "gloo_env",
    "register_backend",
    "unregister_backend",
    "ccl_pairing",
    "ccl_module_for",
    "CCL_DISTRIBUTIONS",
    "SKIP_VERSION_CHECK_VAR",
]
