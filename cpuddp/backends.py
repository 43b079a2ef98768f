"""Which collective backend can run here, why, and how to load and configure it.

Choosing (:func:`resolve_backend`)::

    backend="auto"   oneCCL ("ccl") when its bindings are installed, match this torch and
                     their module is present; gloo otherwise.  With device="cuda": nccl
                     when available, gloo otherwise.
    backend="ccl"    oneCCL or a BackendError naming the package and the versions found.
                     Never a silent fallback to gloo.
    backend=<name>   any name in BACKENDS ("gloo", "ccl", "mpi", "nccl", "accl", or one
                     added with register_backend); anything else is a BackendError that
                     lists the valid choices.

The oneCCL bindings are found by version *before* anything is imported, because importing a
wheel built for another torch can abort the interpreter ("Mismatch in kernel C++
signatures", undefined symbols).  The installed versions are read with
``importlib.metadata`` from the distributions ``oneccl_bind_pt`` (every wheel since 1.10)
and ``torch-ccl`` (older builds); the module is ``oneccl_bindings_for_pytorch`` from 1.12
on and ``torch_ccl`` before.  A binding matches when its major.minor is torch's, compared as
versions (``packaging.version``), plus the exact pairs Intel documents (1.12.0 is for torch
1.12.0 only, 1.12.100 for torch 1.12.1; likewise 2.0.100 and 2.3.100).  A binding built from
source carries its branch's version, not torch's (``2.8.0+xpu`` built against torch 2.13):
for a binding whose version names another torch, a child process imports it
(:mod:`cpuddp.ccl_probe`, cached per build and torch), and the binding is used when that
import succeeds -- "built for this torch (import probe passed)" -- and is never imported in
this interpreter when it fails.  ``CPUDDP_CCL_SKIP_VERSION_CHECK=1`` skips both checks and
trusts the binding.

Loading (:func:`load_backend`) imports torch first, then the backend's module, and checks
that the module registered the backend name with ``torch.distributed``.

Configuring (:func:`backend_env`, pure) returns the variables to export before
``init_process_group``; a variable the user set is never in it:

================================  ==========================================================
``CCL_LOCAL_RANK``/``_SIZE``      the launcher's local rank and size (ccl)
``CCL_PROCESS_LAUNCHER``          ``none`` unless launched by Intel MPI/MPICH Hydra (ccl)
``CCL_ATL_TRANSPORT``             ``mpi`` under Intel MPI's Hydra with Intel MPI's environment
                                  (``I_MPI_ROOT``/``ONEAPI_ROOT`` set, or the launching Intel
                                  MPI found), ``ofi`` otherwise (ccl)
``I_MPI_ROOT``                    the launching Intel MPI, when ``mpi`` was chosen from it (ccl)
``CCL_ATL_SHM``                   ``1`` for ofi on a single node (ccl)
``FI_PROVIDER_PATH``              libfabric's providers beside the installed oneCCL/Intel MPI
                                  (ccl)
``CCL_WORKER_COUNT``              ``1`` (ccl)
``CCL_WORKER_AFFINITY``           the pinning plan's ``ccl_worker_cpus``; none reserved: the
                                  rank's own last CPU(s) (ccl)
``GLOO_SOCKET_IFNAME``            ``lo`` for a single-node job on loopback; otherwise the
                                  interface that routes to ``MASTER_ADDR`` (any backend:
                                  gloo groups are made beside ccl ones for CPU objects)
================================  ==========================================================

A first collective that fails is explained by :func:`explain_collective_failure` (the
transport, its variables, the fix).

Environment variables read: the ones above (to leave the user's alone),
``CPUDDP_CCL_SKIP_VERSION_CHECK``, ``CCL_ROOT``, ``ONEAPI_ROOT``, Intel MPI's ``I_MPI_HYDRA_*``
(to tell its Hydra from MPICH's), and :mod:`cpuddp.ccl_probe`'s.  Written: none
(:func:`cpuddp.init_distributed` exports).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Collection,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from .errors import BackendError, LauncherEnvError
from .netif import Route, is_loopback_address

if TYPE_CHECKING:  # pragma: no cover
    from .env import DistEnv

__all__ = [
    "BackendStatus",
    "BackendChoice",
    "BackendSpec",
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

log = logging.getLogger("cpuddp.backends")

#: Distributions that carry the oneCCL bindings, in the order they are looked up.
#: ``oneccl_bind_pt`` is the wheel's name since 1.10 (whatever its module); ``torch-ccl``
#: (also spelled ``torch_ccl``) is what older source builds installed.
CCL_DISTRIBUTIONS: Tuple[str, ...] = ("oneccl_bind_pt", "torch-ccl", "torch_ccl")
#: From this version on the module is ``oneccl_bindings_for_pytorch``; before, ``torch_ccl``.
_CCL_RENAMED_AT = (1, 12)
#: Bindings Intel built for one torch patch release only (intel/torch-ccl README table; the
#: seeds: "1.12.0 prebuilt wheel does not work with PyTorch 1.12.1").  Others need major.minor.
_CCL_EXACT_TORCH = {
    (1, 12, 0): (1, 12, 0),
    (1, 12, 100): (1, 12, 1),
    (2, 0, 100): (2, 0, 1),
    (2, 3, 100): (2, 3, 1),
}
#: Intel's last oneCCL bindings release.
_CCL_LAST_RELEASE = (2, 8)
#: Set to 1 to accept oneCCL bindings whatever their version (a source build for this torch).
SKIP_VERSION_CHECK_VAR = "CPUDDP_CCL_SKIP_VERSION_CHECK"
_CPU_INDEX = "https://pytorch-extension.intel.com/release-whl/stable/cpu/us/"

MetadataLookup = Callable[[str], Optional[str]]
ModuleFinder = Callable[[str], bool]
#: (module, torch version) -> a verdict with ``ok``, ``summary()`` (see cpuddp.ccl_probe).
ImportProbe = Callable[[str, str], Any]


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class BackendStatus:
    """Whether one backend can run here, and why (or why not)."""

    name: str
    available: bool
    reason: str
    version: Optional[str] = None
    module: Optional[str] = None
    devices: Tuple[str, ...] = ("cpu",)
    #: The pip distribution whose version is ``version`` (None for torch's own backends).
    distribution: Optional[str] = None
    #: For ccl: what the verdict rests on -- "metadata", "import probe", or the skip variable.
    evidence: Optional[str] = None


@dataclass(frozen=True)
class BackendChoice:
    """What :func:`resolve_backend` picked: the name for ``init_process_group``, why, and
    the module :func:`load_backend` must import first (None for torch's own backends)."""

    name: str
    reason: str
    module: Optional[str] = None
    requested: str = "auto"
    version: Optional[str] = None
    distribution: Optional[str] = None
    #: True when :func:`resolve_backend` checked the module against torch (so
    #: :func:`load_backend` need not check again).
    verified: bool = False


@dataclass(frozen=True)
class Lookups:
    """What an availability check may consult, injectable for tests.

    ``metadata(dist)`` returns an installed distribution's version or None;
    ``find_module(name)`` says whether a top-level module can be found (without importing
    it); ``environ`` is read for ``CPUDDP_CCL_SKIP_VERSION_CHECK``;
    ``import_probe(module, torch_version)`` says whether ``import torch, <module>`` works,
    without importing it here (default: :func:`cpuddp.ccl_probe.check_import`, a cached
    child process).
    """

    metadata: MetadataLookup
    find_module: ModuleFinder
    environ: Mapping[str, str] = field(default_factory=dict)
    import_probe: Optional[ImportProbe] = None


ProbeResult = Union[bool, Tuple[bool, str], BackendStatus]


@dataclass(frozen=True)
class BackendSpec:
    """A registry entry.

    ``module`` is imported (after torch) before ``init_process_group`` and must register
    ``name`` with torch; ``devices`` are the tensor devices it serves; ``distribution`` is
    the pip distribution whose version is reported.  ``probe(lookups)`` replaces the
    default check (is ``module`` present?) and returns a bool, ``(bool, reason)`` or a
    :class:`BackendStatus`.
    """

    name: str
    module: Optional[str] = None
    devices: Tuple[str, ...] = ("cpu",)
    distribution: Optional[str] = None
    probe: Optional[Callable[[Lookups], ProbeResult]] = None
    description: str = ""


# --------------------------------------------------------------------------- lookups


def _default_metadata(dist: str) -> Optional[str]:
    from importlib import metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
    except Exception as exc:  # a broken dist-info must not break backend selection
        log.debug("metadata for %s unreadable: %s", dist, exc)
        return None


def _default_find_module(name: str) -> bool:
    top = name.split(".", 1)[0]
    if top in sys.modules:
        return True
    try:
        return importlib.util.find_spec(top) is not None  # finds, never executes
    except (ImportError, ValueError):
        return False


def _as_metadata(metadata: Union[None, Mapping[str, str], MetadataLookup]) -> MetadataLookup:
    if metadata is None:
        return _default_metadata
    if isinstance(metadata, Mapping):
        table = {_canon(k): v for k, v in metadata.items()}
        return lambda dist: table.get(_canon(dist))
    fn = metadata

    def lookup(dist: str) -> Optional[str]:
        try:
            return fn(dist)
        except Exception:  # PackageNotFoundError from a wrapped importlib.metadata.version
            return None

    return lookup


def _as_finder(find_module: Union[None, Collection[str], ModuleFinder]) -> ModuleFinder:
    if find_module is None:
        return _default_find_module
    if callable(find_module):
        return find_module  # type: ignore[return-value]
    names = {find_module} if isinstance(find_module, str) else set(find_module)
    return lambda name: name.split(".", 1)[0] in names


def _canon(dist: str) -> str:
    """PEP 503 normalized distribution name (``torch_ccl`` == ``torch-ccl``)."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def _lookups(metadata: Any = None, find_module: Any = None, environ: Optional[Mapping[str, str]] = None,
             import_probe: Optional[ImportProbe] = None) -> Lookups:
    return Lookups(
        metadata=_as_metadata(metadata),
        find_module=_as_finder(find_module),
        environ=os.environ if environ is None else environ,
        import_probe=import_probe,
    )


# --------------------------------------------------------------------------- versions


def _release(version: str) -> Optional[Tuple[int, ...]]:
    from packaging.version import InvalidVersion, Version

    try:
        rel = Version(version).release
    except InvalidVersion:
        return None
    return tuple(rel) + (0,) * (3 - len(rel))


def ccl_module_for(binding_version: str) -> str:
    """The module a oneCCL bindings version installs: ``torch_ccl`` before 1.12."""
    rel = _release(binding_version)
    if rel is not None and rel[:2] < _CCL_RENAMED_AT:
        return "torch_ccl"
    return "oneccl_bindings_for_pytorch"


def ccl_pairing(binding_version: str, torch_version: str) -> Tuple[bool, str]:
    """Does a oneCCL bindings version fit this torch?  Pure, compares numerically.

    Returns ``(ok, built_for)``, e.g. ``(False, "torch 2.8")`` or ``(True, "torch 1.12.1
    only")``; ``built_for`` says what the binding was made for.
    """
    b, t = _release(binding_version), _release(torch_version)
    if b is None:
        return False, f"an unknown torch (its version {binding_version!r} is not a valid version)"
    exact = _CCL_EXACT_TORCH.get(b[:3])
    built_for = f"torch {_dotted(exact)} only" if exact is not None else f"torch {_dotted(b[:2])}"
    if t is None:
        return False, built_for
    if exact is not None:
        return t[:3] == exact, built_for
    return b[:2] == t[:2], built_for


def _ccl_wheel_for(torch_version: str) -> Optional[str]:
    """The ``oneccl_bind_pt`` version to install for a torch, or None past Intel's last."""
    t = _release(torch_version)
    if t is None or t[:2] > _CCL_LAST_RELEASE:
        return None
    for b, tv in _CCL_EXACT_TORCH.items():
        if tv == t[:3]:
            return _dotted(b)
    if any(b[:2] == t[:2] for b in _CCL_EXACT_TORCH):
        return f"{_dotted(t[:2])}.0"
    return f"{_dotted(t[:2])}.*"


def _dotted(parts: Sequence[int]) -> str:
    return ".".join(str(p) for p in parts)


def _torch_version(lk: Lookups) -> Optional[str]:
    version = lk.metadata("torch")
    if version is None and "torch" in sys.modules:
        version = getattr(sys.modules["torch"], "__version__", None)
    return version


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- checks


def _ccl_probe(lk: Lookups) -> BackendStatus:
    devices = ("cpu", "xpu")
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    for dist in CCL_DISTRIBUTIONS:
        version = lk.metadata(dist)
        key = _canon(dist)
        if version is not None and key not in seen:
            seen.add(key)
            found.append((dist, version))
    if not found:
        return BackendStatus(
            "ccl", False,
            f"no oneCCL bindings are installed (no distribution {' or '.join(CCL_DISTRIBUTIONS[:2])}; "
            f"torch is {_torch_version(lk) or 'of unknown version'})",
            devices=devices, distribution=CCL_DISTRIBUTIONS[0],
        )
    torch_version = _torch_version(lk)
    skip = _truthy(lk.environ.get(SKIP_VERSION_CHECK_VAR))
    problems = []
    for dist, version in found:
        module = ccl_module_for(version)
        ok, what, evidence = _ccl_verdict(lk, dist, version, module, torch_version, skip)
        if not ok:
            problems.append((dist, version, module, what, evidence))
            continue
        return BackendStatus("ccl", True, what, version=version, module=module, devices=devices, distribution=dist,
                             evidence=evidence)
    dist, version, module, _, evidence = problems[0]
    text = "; ".join(p[3] for p in problems)
    return BackendStatus("ccl", False, text, version=version, module=module, devices=devices, distribution=dist,
                         evidence=evidence)


def _ccl_verdict(lk: Lookups, dist: str, version: str, module: str, torch_version: Optional[str],
                 skip: bool) -> Tuple[bool, str, Optional[str]]:
    """One installed binding: ``(usable, why, evidence)``, evidence being what decided:
    ``"metadata"``, ``"import probe"``, the skip variable, or None (a broken install).

    Its version decides when it names this torch; otherwise a child process that imports it
    does (:mod:`cpuddp.ccl_probe`), so a binding built for another torch is never imported
    in this interpreter."""
    if skip:
        if not lk.find_module(module):
            return False, f"{dist} {version} is installed without its module {module} (a broken install)", None
        return (True, f"{dist} {version} (version check skipped by {SKIP_VERSION_CHECK_VAR}=1), torch {torch_version}",
                SKIP_VERSION_CHECK_VAR)
    if torch_version is None:
        return False, f"{dist} {version} is installed and torch's version is unknown", "metadata"
    ok, built_for = ccl_pairing(version, torch_version)
    if not lk.find_module(module):
        named = "" if ok else f" is built for {built_for}, not torch {torch_version}, and"
        return False, f"{dist} {version}{named} is installed without its module {module} (a broken install)", None
    if ok:
        return True, f"{dist} {version} matches torch {torch_version}", "metadata"
    probe = lk.import_probe
    if probe is None:
        from .ccl_probe import check_import

        def probe(m: str, t: str) -> Any:
            return check_import(m, t, environ=lk.environ)

    verdict = probe(module, torch_version)
    if verdict.ok:
        return (True, f"{dist} {version} is built for this torch (import probe passed; its version names "
                f"{built_for}, torch is {torch_version})", "import probe")
    where = f"; verdict cached in {verdict.cache_file}" if getattr(verdict, "cache_file", None) else ""
    return (False, f"{dist} {version} is built for {built_for}, not torch {torch_version}, and importing it in a "
            f"child process failed -- {verdict.summary()} (not imported here: a binding built for another torch "
            f"can abort the interpreter{where})", "import probe")


def _torch_probe(check: str, what: str) -> Callable[[Lookups], BackendStatus]:
    def probe(lk: Lookups) -> Tuple[bool, str]:
        import torch.distributed as dist

        if not dist.is_available():
            return False, "torch was built without torch.distributed"
        ok = bool(getattr(dist, check, lambda: False)())
        return ok, (f"built into torch {_torch_version(lk)}" if ok else what)

    return probe  # type: ignore[return-value]


def _nccl_probe(lk: Lookups) -> Tuple[bool, str]:
    import torch

    ok, reason = _torch_probe("is_nccl_available", "torch was built without NCCL")(lk)  # type: ignore[misc]
    if ok and not torch.cuda.is_available():
        return False, "torch has NCCL but sees no CUDA device (torch.cuda.is_available() is False)"
    return ok, reason


def _generic_status(spec: BackendSpec, lk: Lookups) -> BackendStatus:
    version = lk.metadata(spec.distribution) if spec.distribution else None
    if spec.probe is not None:
        result = spec.probe(lk)
        if isinstance(result, BackendStatus):
            return result
        if isinstance(result, tuple):
            ok, reason = bool(result[0]), str(result[1])
        else:
            ok, reason = bool(result), ("the plug-in's check passed" if result else "the plug-in's check failed")
        return BackendStatus(spec.name, ok, reason, version, spec.module, spec.devices, spec.distribution)
    if spec.module is None:
        return BackendStatus(spec.name, True, "registered without a module or check", version, None, spec.devices, spec.distribution)
    pkg = f" ({spec.distribution} {version})" if version else (f" ({spec.distribution} is not installed)" if spec.distribution else "")
    if lk.find_module(spec.module):
        return BackendStatus(spec.name, True, f"module {spec.module} found{pkg}", version, spec.module, spec.devices, spec.distribution)
    return BackendStatus(spec.name, False, f"module {spec.module} not found{pkg}", version, spec.module, spec.devices, spec.distribution)


# --------------------------------------------------------------------------- registry

#: name -> :class:`BackendSpec`.  Extend it with :func:`register_backend`.
BACKENDS: dict[str, BackendSpec] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_backend(
    name: str,
    *,
    module: Optional[str] = None,
    devices: Sequence[str] = ("cpu",),
    distribution: Optional[str] = None,
    probe: Optional[Callable[[Lookups], ProbeResult]] = None,
    description: str = "",
    replace: bool = False,
) -> BackendSpec:
    """Add a backend that ``init_distributed(backend=name)`` can use.

    Example, Alibaba's ACCL (already registered as ``"accl"``)::

        cpuddp.register_backend("accl", module="torch_accl", devices=("cuda",),
                                distribution="torch_accl")

    ``module`` is imported after torch and must register ``name`` with
    ``torch.distributed.Backend``.  ``replace=True`` overrides an existing entry.
    """
    key = name.strip().lower() if isinstance(name, str) else ""
    if not _NAME.match(key) or key == "auto":
        raise ValueError(
            f"backend name {name!r} is not valid: use lowercase letters, digits and '_', "
            f"starting with a letter, and not 'auto'"
        )
    if key in BACKENDS and not replace:
        raise ValueError(f"backend {key!r} is already registered; pass replace=True to override it")
    devs = (devices,) if isinstance(devices, str) else tuple(devices)
    if not devs:
        raise ValueError(f"backend {key!r}: devices must name at least one device type, e.g. ('cpu',)")
    spec = BackendSpec(key, module=module, devices=devs, distribution=distribution, probe=probe, description=description)
    BACKENDS[key] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Remove a registry entry (no error when absent)."""
    BACKENDS.pop(name.strip().lower(), None)


def _shm_probe(lk: Lookups) -> Tuple[bool, str]:
    from .shm_check import probe

    return probe(lk)


register_backend("ccl", devices=("cpu", "xpu"), distribution="oneccl_bind_pt", probe=_ccl_probe,
                 description="Intel oneCCL through its PyTorch bindings (oneccl_bind_pt)")
register_backend("gloo", devices=("cpu", "cuda"), probe=_torch_probe("is_gloo_available", "torch was built without gloo"),
                 description="torch's built-in CPU backend")
register_backend("mpi", devices=("cpu", "cuda"),
                 probe=_torch_probe("is_mpi_available", "torch was built without MPI (build torch from source against an MPI)"),
                 description="torch's MPI backend (needs a torch built with MPI and an MPI launcher)")
register_backend("nccl", devices=("cuda",), probe=_nccl_probe, description="NVIDIA NCCL, for models on CUDA")
register_backend("accl", module="torch_accl", devices=("cuda",), distribution="torch_accl",
                 description="Alibaba ACCL plug-in (import torch_accl, backend 'accl')")
register_backend("shm", module="cpuddp.shm", devices=("cpu",), probe=_shm_probe,
                 description="cpuddp's shared-memory allreduce within a node, gloo for the rest (cpuddp.shm)")

#: The launcher families that start ranks as MPI processes (the mpi backend needs one).
_MPI_LAUNCHERS = ("hydra", "openmpi", "pmix", "mvapich", "slurm")


def backend_status(name: str, *, metadata: Any = None, find_module: Any = None,
                   environ: Optional[Mapping[str, str]] = None,
                   import_probe: Optional[ImportProbe] = None) -> BackendStatus:
    """The :class:`BackendStatus` of one registered backend (see :func:`available_backends`)."""
    key = name.strip().lower()
    spec = BACKENDS.get(key)
    if spec is None:
        raise _unknown(name)
    return _status(spec, _lookups(metadata, find_module, environ, import_probe))


def _status(spec: BackendSpec, lk: Lookups) -> BackendStatus:
    try:
        return _generic_status(spec, lk)
    except Exception as exc:  # one broken plug-in check must not hide the others
        return BackendStatus(spec.name, False, f"its check raised {type(exc).__name__}: {exc}",
                             module=spec.module, devices=spec.devices, distribution=spec.distribution)


def available_backends(*, metadata: Any = None, find_module: Any = None,
                       environ: Optional[Mapping[str, str]] = None,
                       import_probe: Optional[ImportProbe] = None) -> list[BackendStatus]:
    """Every registered backend: available or not, why, version and module.

    Cheap: reads package metadata and looks modules up without importing them (torch's own
    backends import ``torch.distributed``; oneCCL bindings whose version names another torch
    are import-probed in a child process once per build, see :mod:`cpuddp.ccl_probe`).
    ``metadata`` (a mapping dist -> version or a function), ``find_module`` (a function or a
    set of module names), ``environ`` and ``import_probe`` replace the real lookups, for tests.
    """
    lk = _lookups(metadata, find_module, environ, import_probe)
    return [_status(spec, lk) for spec in BACKENDS.values()]


# --------------------------------------------------------------------------- resolve


def _unknown(name: Any) -> BackendError:
    valid = ", ".join(["auto", *BACKENDS])
    return BackendError(
        f"unknown backend {name!r}; valid choices: {valid}",
        fix=f"pass backend= one of: {valid} -- or add it with cpuddp.register_backend({str(name).strip().lower()!r}, module=...)",
    )


def _ccl_fix(torch_version: Optional[str]) -> str:
    wheel = _ccl_wheel_for(torch_version or "")
    if wheel is not None:
        return (
            f'pip install "oneccl_bind_pt=={wheel}" --extra-index-url {_CPU_INDEX} '
            f"(Intel's index; the bindings are not on PyPI), or pass backend='gloo'"
        )
    return (
        f"Intel's last oneCCL bindings are for torch {_dotted(_CCL_LAST_RELEASE)}; none exist for torch "
        f"{torch_version}: build intel/torch-ccl against this torch (docs/backends.md; a build that imports "
        f"cleanly is accepted whatever its version; {SKIP_VERSION_CHECK_VAR}=1 skips every check), or pass "
        f"backend='gloo'"
    )


def resolve_backend(
    requested: str,
    env: "DistEnv",
    *,
    metadata: Any = None,
    find_module: Any = None,
    environ: Optional[Mapping[str, str]] = None,
    device: Optional[str] = None,
    node_cpus: Optional[int] = None,
) -> BackendChoice:
    """Pick the backend for ``requested`` ("auto", "ccl", "gloo", ... any registered name).

    ``node_cpus``: the CPUs this node's ranks may use together (known at init, from the hosts
    gathered); "auto" takes the shared-memory backend only when they do not outnumber them.

    ``device`` ("cpu" by default, or "cuda") steers "auto".  Nothing is imported except
    torch itself.  Raises :class:`~cpuddp.errors.BackendError` for an unknown name (listing
    the valid ones), and for a named backend that cannot run here (for ccl: naming the
    package and the versions found).  Never falls back from a named backend to another.
    """
    if not isinstance(requested, str):
        raise _unknown(requested)
    name = requested.strip().lower()
    lk = _lookups(metadata, find_module, environ)
    if name == "auto":
        return _auto(env, lk, (device or "cpu").strip().lower(), node_cpus)
    spec = BACKENDS.get(name)
    if spec is None:
        raise _unknown(requested)
    st = _status(spec, lk)
    if not st.available:
        if name == "ccl":
            torch_version = _torch_version(lk)
            raise BackendError(
                f"backend='ccl' was requested, but {st.reason}",
                fix=_ccl_fix(torch_version),
            )
        pkg = f" (pip distribution {st.distribution})" if st.distribution else ""
        raise BackendError(
            f"backend={name!r} was requested, but it cannot run here: {st.reason}",
            fix=f"install it{pkg}, or pass backend='auto' or 'gloo'",
        )
    if name == "mpi" and env.world_size > 1 and env.launcher not in _MPI_LAUNCHERS:
        raise BackendError(
            f"backend='mpi' needs ranks started by an MPI launcher, but this job was started by "
            f"{env.launcher!r} (each rank would be an MPI world of its own)",
            fix="launch with mpiexec/mpirun/srun --mpi, or pass backend='gloo'",
        )
    if device is not None and device.strip().lower() not in spec.devices:
        raise BackendError(
            f"backend={name!r} serves {', '.join(spec.devices)} tensors, not {device!r}",
            fix=f"pick a backend for {device!r} (auto does), or move the model",
        )
    return BackendChoice(name, f"requested; {st.reason}", st.module, name, st.version, st.distribution, True)


def _auto(env: "DistEnv", lk: Lookups, device: str, node_cpus: Optional[int] = None) -> BackendChoice:
    if device == "cuda":
        nccl = _status(BACKENDS["nccl"], lk) if "nccl" in BACKENDS else None
        if nccl is not None and nccl.available:
            return BackendChoice("nccl", f"auto: the model is on CUDA and {nccl.reason}", None, "auto")
        why = nccl.reason if nccl is not None else "nccl is not registered"
        return _auto_gloo(lk, f"the model is on CUDA but nccl cannot run ({why})")
    # A working oneCCL binding wins: installing (or building) it is the user's choice.  Then
    # the shared-memory backend where ranks share a node, then gloo.
    ccl = _status(BACKENDS["ccl"], lk) if "ccl" in BACKENDS else None
    if ccl is not None and ccl.available:
        return BackendChoice("ccl", f"auto: {ccl.reason}", ccl.module, "auto", ccl.version, ccl.distribution, True)
    why_not = ccl.reason if ccl is not None else "ccl is not registered"
    shm = _auto_shm(env, lk, node_cpus)
    if shm is not None and shm.available:
        return BackendChoice(shm.name, f"auto: {shm.reason} (no ccl: {why_not})", shm.module, "auto")
    if shm is not None:
        why_not = f"{why_not}; {shm.name}: {shm.reason}"
    return _auto_gloo(lk, why_not)


def _auto_shm(env: "DistEnv", lk: Lookups, node_cpus: Optional[int]) -> Optional[BackendStatus]:
    """The shared-memory backend's verdict for this node (None when it is not registered)."""
    from . import shm_check

    spec = BACKENDS.get(shm_check.NAME)
    if spec is None:
        return None
    ok, reason = shm_check.eligibility(env.local_world_size, lk.environ, node_cpus=node_cpus)
    return BackendStatus(spec.name, ok, reason, module=spec.module)


def _auto_gloo(lk: Lookups, why_not: str) -> BackendChoice:
    gloo = _status(BACKENDS["gloo"], lk) if "gloo" in BACKENDS else None
    if gloo is None or not gloo.available:
        raise BackendError(
            f"backend='auto' found nothing to run: {why_not}; gloo: "
            f"{gloo.reason if gloo else 'not registered'}",
            fix="install a torch built with gloo (every PyPI build is), or name a backend",
        )
    return BackendChoice("gloo", f"auto: gloo, because {why_not}", None, "auto")


# --------------------------------------------------------------------------- load


def load_backend(choice: Union[BackendChoice, str]) -> None:
    """Import torch, then ``choice.module`` (if any), and check it registered the backend.

    Refuses (BackendError) to import oneCCL bindings that do not match torch, even when
    handed a choice made elsewhere.  Any import failure is a BackendError naming the module.
    """
    if isinstance(choice, str):
        spec = BACKENDS.get(choice.strip().lower())
        if spec is None:
            raise _unknown(choice)
        choice = BackendChoice(spec.name, "by name", spec.module, spec.name)
    if choice.module is None:
        return
    import torch  # noqa: F401  -- first: the bindings link against the loaded libtorch
    import torch.distributed as dist

    if choice.name == "ccl" and not choice.verified and choice.module not in sys.modules:
        st = _status(BACKENDS["ccl"], _lookups()) if "ccl" in BACKENDS else None
        if st is None or not st.available or st.module != choice.module:
            reason = st.reason if st is not None else "ccl is not registered"
            raise BackendError(
                f"refusing to import {choice.module}: {reason}",
                fix=_ccl_fix(torch.__version__),
            )
    pkg = f"{choice.distribution} {choice.version}" if choice.distribution and choice.version else choice.module
    try:
        importlib.import_module(choice.module)
    except Exception as exc:
        raise BackendError(
            f"importing {choice.module} ({pkg}) for backend {choice.name!r} failed: {type(exc).__name__}: {exc}",
            fix=(f"reinstall {pkg} for torch {torch.__version__}" if choice.name == "ccl" else f"check the {pkg} install")
            + ", or pass backend='gloo'",
        ) from exc
    registered = [b.lower() for b in getattr(dist.Backend, "backend_list", [])]
    if registered and choice.name not in registered:
        raise BackendError(
            f"importing {choice.module} did not register backend {choice.name!r} with torch.distributed "
            f"(registered: {', '.join(registered)})",
            fix=f"check that {choice.module} is the plug-in for {choice.name!r} and built for torch {torch.__version__}",
        )
    log.debug("loaded %s for backend %s", choice.module, choice.name)


# --------------------------------------------------------------------------- environment

RouteLookup = Callable[[str], Optional[Union[Route, Tuple[str, str]]]]


def backend_env(
    env: "DistEnv",
    choice: Union[BackendChoice, str],
    plan: Any,
    environ: Mapping[str, str],
    *,
    route_lookup: Optional[RouteLookup] = None,
    ccl_paths: Optional["CclPaths"] = None,
) -> dict[str, str]:
    """The ``CCL_*``, ``FI_*``, ``I_MPI_ROOT`` and ``GLOO_SOCKET_IFNAME`` values to export
    for ``choice``; pure, given the lookups.

    Only variables absent from ``environ`` are returned (the user's setting wins).
    ``plan`` is the pinning plan (anything with a ``ccl_worker_cpus`` tuple) or None.
    ``route_lookup(master_addr)`` returns the local (interface, source address) that reaches
    rank 0; the default asks the kernel (:func:`cpuddp.netif.route_to`).  ``ccl_paths``
    says where Intel MPI and libfabric's providers are; the default looks
    (:func:`find_ccl_paths`).
    """
    name = choice if isinstance(choice, str) else choice.name
    name = name.strip().lower()
    out: dict[str, str] = {}
    if name == "ccl":
        out.update(ccl_env(env, plan, environ, paths=ccl_paths))
    out.update(gloo_env(env, environ, route_lookup=route_lookup))
    return out


def _worker_count(environ: Mapping[str, str]) -> int:
    raw = environ.get("CCL_WORKER_COUNT")
    if raw is None:
        return 1
    try:
        count = int(raw.strip(), 10)
    except ValueError:
        count = 0
    if count < 1:
        raise LauncherEnvError(
            "CCL_WORKER_COUNT must be a whole number of oneCCL worker threads per rank, at least 1",
            variable="CCL_WORKER_COUNT",
            value=raw,
            fix="export CCL_WORKER_COUNT=1 (the usual value), or unset it",
        )
    return count


@dataclass(frozen=True)
class CclPaths:
    """What :func:`ccl_env` needs from the filesystem (see :func:`find_ccl_paths`).

    ``impi_root``: the Intel MPI whose Hydra started this process, when that can be told
    for sure (None otherwise); ``provider_dir``: a directory of libfabric providers
    (``lib*-fi.so``) beside the installed oneCCL or Intel MPI, or None.
    """

    impi_root: Optional[str] = None
    provider_dir: Optional[str] = None


#: What oneCCL's MPI transport needs to find Intel MPI ("CCL/MPI uses Intel(R) MPI Library
#: but neither I_MPI_ROOT nor ONEAPI_ROOT is set" -> "failed to initialize ATL").
_IMPI_ROOT_VARS = ("I_MPI_ROOT", "ONEAPI_ROOT")
#: Intel MPI's Hydra exports these to its ranks; MPICH's Hydra does not.
_IMPI_HYDRA_PREFIXES = ("I_MPI_HYDRA_", "I_MPI_INFO_")
_FI_PROVIDER_GLOB = "lib*-fi.so"


def _intel_hydra(env: "DistEnv", environ: Mapping[str, str]) -> bool:
    return env.launcher == "hydra" and any(k.startswith(_IMPI_HYDRA_PREFIXES) for k in environ)


def ccl_settings(env: "DistEnv", plan: Any, environ: Mapping[str, str], *,
                 paths: Optional[CclPaths] = None) -> dict[str, Tuple[str, str]]:
    """Every value :func:`ccl_env` would set, each with why, before the user's settings are
    taken out (pure, given ``paths``).

    Transport: ``mpi`` only where oneCCL can initialise it -- ranks started by Intel MPI's
    Hydra, with Intel MPI's environment (``I_MPI_ROOT`` or ``ONEAPI_ROOT``) set or derivable
    from the Intel MPI that launched them (then ``I_MPI_ROOT`` is set too); ``ofi``
    everywhere else (torchrun, MPICH, Open MPI, Slurm, ...), with shared memory on one node.
    """
    if paths is None:
        paths = find_ccl_paths(environ)
    hydra = env.launcher == "hydra"
    want: dict[str, Tuple[str, str]] = {
        "CCL_LOCAL_RANK": (str(env.local_rank), "the launcher's local rank"),
        "CCL_LOCAL_SIZE": (str(env.local_world_size), "ranks on this host"),
        "CCL_WORKER_COUNT": ("1", "one oneCCL progress thread per rank"),
    }
    if not hydra:
        # oneCCL's default launcher is Hydra's PMI; elsewhere it must not wait for one
        # (Open MPI: "Invalid rank in internal_Group_incl" without these).
        want["CCL_PROCESS_LAUNCHER"] = ("none", f"no Hydra PMI under {env.launcher}")
    impi_root = next((environ[k] for k in _IMPI_ROOT_VARS if environ.get(k)), None)
    if _intel_hydra(env, environ) and (impi_root or paths.impi_root):
        want["CCL_ATL_TRANSPORT"] = ("mpi", "started by Intel MPI's Hydra, with Intel MPI's environment")
        if not impi_root and paths.impi_root:
            want["I_MPI_ROOT"] = (paths.impi_root, "the Intel MPI that started this rank (oneCCL's mpi transport needs it)")
    elif _intel_hydra(env, environ):
        want["CCL_ATL_TRANSPORT"] = ("ofi", "Intel MPI's Hydra, but no Intel MPI environment (I_MPI_ROOT, ONEAPI_ROOT) "
                                            "for oneCCL's mpi transport")
    elif hydra:
        want["CCL_ATL_TRANSPORT"] = ("ofi", "Hydra of MPICH, not Intel MPI: oneCCL's mpi transport needs Intel MPI")
    else:
        want["CCL_ATL_TRANSPORT"] = ("ofi", f"launched by {env.launcher}, not Intel MPI")
    transport = environ.get("CCL_ATL_TRANSPORT", want["CCL_ATL_TRANSPORT"][0]).strip().lower()
    if transport == "ofi" and env.single_node:
        want["CCL_ATL_SHM"] = ("1", "ofi on one node: shared memory between the ranks")
    if paths.provider_dir:
        want["FI_PROVIDER_PATH"] = (paths.provider_dir, "libfabric's providers beside the installed oneCCL / Intel MPI")
    count = _worker_count(environ)
    affinity = _worker_affinity(env, plan, count)
    if affinity is not None:
        want["CCL_WORKER_AFFINITY"] = (affinity, "the CPUs the pinning plan reserved for oneCCL's workers")
    return want


def ccl_env(env: "DistEnv", plan: Any, environ: Mapping[str, str], *,
            paths: Optional[CclPaths] = None) -> dict[str, str]:
    """oneCCL's settings for this launcher and pinning plan (pure, given ``paths``; see the
    module table).  Local rank 0 logs every value it sets and why."""
    want = ccl_settings(env, plan, environ, paths=paths)
    out = {k: v for k, (v, _) in want.items() if k not in environ}
    if out and env.local_rank == 0:
        log.info("cpuddp: oneCCL settings: %s", "; ".join(f"{k}={v} ({want[k][1]})" for k, v in out.items()))
    return out


def find_ccl_paths(environ: Mapping[str, str]) -> CclPaths:
    """Look for the Intel MPI that started this process and for libfabric's providers.

    ``impi_root``: under Intel MPI's Hydra only -- the prefix of the parent process
    (``<prefix>/bin/hydra_pmi_proxy``) when that prefix is an Intel MPI (it has
    ``bin/impi_info`` and ``lib/libmpi.so*``).  ``provider_dir``: the first directory that
    holds ``lib*-fi.so`` among ``$CCL_ROOT``'s and ``$I_MPI_ROOT``'s usual places, the
    oneCCL bindings' package (``lib/prov``, ``opt/mpi/libfabric/lib/prov``, ``lib``) and
    this Python environment's ``lib/prov`` and ``lib`` (where pip's ``oneccl-cpu`` and
    ``impi-rt`` put them) -- the last only when oneCCL or libfabric is installed there.
    """
    return CclPaths(impi_root=_launching_impi(environ), provider_dir=_provider_dir(environ))


def _launching_impi(environ: Mapping[str, str]) -> Optional[str]:
    if not any(k.startswith(_IMPI_HYDRA_PREFIXES) for k in environ):
        return None
    try:
        exe = os.readlink(f"/proc/{os.getppid()}/exe")
    except OSError:
        return None
    if os.path.basename(exe) != "hydra_pmi_proxy":
        return None
    prefix = os.path.dirname(os.path.dirname(exe))
    if os.path.isfile(os.path.join(prefix, "bin", "impi_info")) and _has(os.path.join(prefix, "lib"), "libmpi.so*"):
        return prefix
    return None


def _has(directory: str, pattern: str) -> bool:
    import glob

    return bool(glob.glob(os.path.join(glob.escape(directory), pattern)))


def _provider_dir(environ: Mapping[str, str]) -> Optional[str]:
    candidates: list[str] = []
    ccl_root = environ.get("CCL_ROOT")
    if ccl_root:
        candidates += [os.path.join(ccl_root, "lib", "prov"), os.path.join(ccl_root, "opt", "mpi", "libfabric", "lib", "prov"),
                       os.path.join(ccl_root, "lib")]
    impi_root = environ.get("I_MPI_ROOT")
    if impi_root:
        candidates += [os.path.join(impi_root, "opt", "mpi", "libfabric", "lib", "prov"),
                       os.path.join(impi_root, "libfabric", "lib", "prov"), os.path.join(impi_root, "lib", "prov")]
    for module in ("oneccl_bindings_for_pytorch", "torch_ccl"):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or ()) if spec is not None else ():
            candidates += [os.path.join(location, "lib", "prov"),
                           os.path.join(location, "opt", "mpi", "libfabric", "lib", "prov"), os.path.join(location, "lib")]
    lib = os.path.join(sys.prefix, "lib")
    if _has(lib, "libccl.so*") or _has(lib, "libfabric.so*"):
        candidates += [os.path.join(lib, "prov"), lib]
    return next((c for c in candidates if _has(c, _FI_PROVIDER_GLOB)), None)


# --------------------------------------------------------------------------- a failing first collective

#: oneCCL's messages for a transport that cannot start, and what to do about each.
_CCL_FAILURES: Tuple[Tuple[str, str], ...] = (
    ("neither I_MPI_ROOT nor ONEAPI_ROOT",
     "the mpi transport needs Intel MPI's environment: export CCL_ATL_TRANSPORT=ofi, or source Intel MPI's "
     "env/vars.sh (sets I_MPI_ROOT) and launch with its mpiexec"),
    ("providers 0",
     "libfabric found no provider: export FI_PROVIDER_PATH=<the directory holding lib*-fi.so, beside libccl.so or "
     "in Intel MPI's opt/mpi/libfabric/lib/prov>"),
    ("fi_getinfo",
     "libfabric found no usable provider: export FI_PROVIDER_PATH=<the directory holding lib*-fi.so>, or "
     "FI_PROVIDER=tcp"),
    ("Duplicate ranks",
     "oneCCL took every rank for rank 0: export CCL_PROCESS_LAUNCHER=none with CCL_LOCAL_RANK/CCL_LOCAL_SIZE "
     "(cpuddp sets them unless you did)"),
)
_CCL_VARS = ("CCL_ATL_TRANSPORT", "CCL_ATL_SHM", "CCL_PROCESS_LAUNCHER", "FI_PROVIDER_PATH", "FI_PROVIDER", "I_MPI_ROOT")


def explain_collective_failure(backend_name: str, environ: Mapping[str, str], exc: BaseException) -> BackendError:
    """The :class:`BackendError` for a group whose first collective failed.

    Its last line names the transport, the variables that steer it (as they are in
    ``environ``) and the fix: a known oneCCL failure gets its own fix, anything else the
    ways to narrow it down.  ``exc`` is what the collective raised.
    """
    name = (backend_name or "").strip().lower()
    rank = environ.get("RANK", "?")
    said = " ".join(str(exc).split())
    if len(said) > 600:
        said = said[:600] + " ..."
    msg = f"rank {rank}: the {name} group formed, but its first all_reduce failed: {type(exc).__name__}: {said}"
    if name != "ccl":
        ifname = environ.get("GLOO_SOCKET_IFNAME")
        return BackendError(msg, fix=f"{name} over GLOO_SOCKET_IFNAME={ifname or 'unset'}: check that every rank's log "
                                     f"shows the same backend, that the hosts reach each other on that interface, "
                                     f"or pass backend='gloo' to rule {name} out")
    transport = environ.get("CCL_ATL_TRANSPORT", "ofi (oneCCL's default)")
    shown = ", ".join(f"{k}={environ[k]}" if environ.get(k) else f"{k} unset" for k in _CCL_VARS[1:])
    text = f"{exc}"
    fix = next((f for needle, f in _CCL_FAILURES if needle in text), None)
    # oneCCL prints its reason on stderr only; the exception says "failed to initialize ATL".
    mpi = transport.strip().lower() == "mpi"
    prov = environ.get("FI_PROVIDER_PATH")
    if fix is None and mpi and not any(environ.get(k) for k in _IMPI_ROOT_VARS):
        fix = _CCL_FAILURES[0][1]
    elif fix is None and not mpi and not (prov and _has(prov, _FI_PROVIDER_GLOB)):
        where = f"FI_PROVIDER_PATH={prov} holds no {_FI_PROVIDER_GLOB}" if prov else "FI_PROVIDER_PATH is unset"
        fix = f"{where}, so {_CCL_FAILURES[1][1]}"
    if fix is None:
        fix = (f"export CCL_LOG_LEVEL=info to see oneCCL's reason; try CCL_ATL_TRANSPORT={'ofi' if mpi else 'mpi'}"
               f"{'' if mpi else ' (under Intel MPI only)'}, or pass backend='gloo'")
    return BackendError(msg, fix=f"oneCCL transport CCL_ATL_TRANSPORT={transport} ({shown}): {fix}")


def _worker_affinity(env: "DistEnv", plan: Any, count: int) -> Optional[str]:
    """``CCL_WORKER_AFFINITY`` from the plan's CPUs for this rank's oneCCL workers.

    oneCCL reads one list for *all* local ranks, pins worker ``i`` of local rank ``r`` to
    entry ``r * count + i``, and rejects a list of any other length.  Each process reads only
    its own slots, from its own environment, so this rank's CPUs fill every slot.
    """
    cpus = tuple(getattr(plan, "ccl_worker_cpus", None) or ()) if plan is not None else ()
    if not cpus:
        # No CPU to spare: the workers share this rank's own cores.  Left unset, oneCCL's
        # "auto" counts from the node's last core and puts local rank 0's worker on the core
        # of the last local rank (seen with 2 ranks on 2 CPUs: each rank's worker on the
        # other's compute core).
        own = tuple(getattr(plan, "cpus", None) or ()) if plan is not None else ()
        if not own:
            return None
        cpus = tuple(own[-1 - (i % len(own))] for i in range(count))
    if len(cpus) != count:
        if env.local_rank == 0:
            log.warning(
                "cpuddp: the pinning plan reserves %d CPU(s) for oneCCL workers, but CCL_WORKER_COUNT is %d; "
                "leaving CCL_WORKER_AFFINITY unset",
                len(cpus), count,
            )
        return None
    return ",".join(str(int(c)) for c in cpus * max(env.local_world_size, 1))


def _is_loopback_host(addr: str) -> bool:
    a = addr.strip().strip("[]").lower()
    return a in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback") or is_loopback_address(a)


def gloo_env(
    env: "DistEnv",
    environ: Mapping[str, str],
    *,
    route_lookup: Optional[RouteLookup] = None,
) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` unless the user set it (pure, given ``route_lookup``).

    Single-node job with a loopback ``MASTER_ADDR``: ``lo``, so gloo's connections never
    leave loopback (and a hostname that resolves to nothing or to another host's address
    cannot misroute them).  Otherwise: the interface that routes to ``MASTER_ADDR``, so a
    hostname that resolves to 127.0.x.1 does not make gloo advertise loopback to other
    hosts (pytorch issue 15592).
    """
    if "GLOO_SOCKET_IFNAME" in environ:
        return {}
    addr = (env.master_addr or "").strip()
    if env.single_node and (not addr or _is_loopback_host(addr)):
        return {"GLOO_SOCKET_IFNAME": "lo"}
    if not addr:
        return {}
    if _is_loopback_host(addr):
        if env.local_rank == 0:
            log.warning(
                "cpuddp: MASTER_ADDR=%s is loopback but the job spans %d nodes; not choosing GLOO_SOCKET_IFNAME",
                addr, env.num_nodes,
            )
        return {}
    lookup = route_lookup
    if lookup is None:
        from .netif import route_to

        lookup = route_to
    route = lookup(addr)
    if route is None:
        if env.local_rank == 0:
            log.warning(
                "cpuddp: cannot tell which interface reaches MASTER_ADDR=%s; gloo will use the address "
                "this host's name resolves to. If ranks hang in init, export GLOO_SOCKET_IFNAME=<interface>",
                addr,
            )
        return {}
    interface, source = route[0], route[1]
    if is_loopback_address(source) and not env.single_node:
        if env.local_rank == 0:
            log.warning(
                "cpuddp: MASTER_ADDR=%s is reached over loopback from this host (it resolves to %s here), "
                "but the job spans %d nodes; not choosing GLOO_SOCKET_IFNAME. Export MASTER_ADDR as an "
                "address the other hosts can reach, or GLOO_SOCKET_IFNAME=<interface>",
                addr, source, env.num_nodes,
            )
        return {}
    return {"GLOO_SOCKET_IFNAME": interface}
