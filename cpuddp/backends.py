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
source carries its branch's version, not torch's: set ``CPUDDP_CCL_SKIP_VERSION_CHECK=1``
to use one built against this torch.

Loading (:func:`load_backend`) imports torch first, then the backend's module, and checks
that the module registered the backend name with ``torch.distributed``.

Configuring (:func:`backend_env`, pure) returns the variables to export before
``init_process_group``; a variable the user set is never in it:

================================  ==========================================================
``CCL_LOCAL_RANK``/``_SIZE``      the launcher's local rank and size (ccl)
``CCL_PROCESS_LAUNCHER``          ``none`` unless launched by Intel MPI/MPICH Hydra (ccl)
``CCL_ATL_TRANSPORT``             ``mpi`` under Hydra, ``ofi`` otherwise (ccl)
``CCL_ATL_SHM``                   ``1`` for ofi on a single node (ccl)
``CCL_WORKER_COUNT``              ``1`` (ccl)
``CCL_WORKER_AFFINITY``           the pinning plan's ``ccl_worker_cpus`` (ccl)
``GLOO_SOCKET_IFNAME``            ``lo`` for a single-node job on loopback; otherwise the
                                  interface that routes to ``MASTER_ADDR`` (any backend:
                                  gloo groups are made beside ccl ones for CPU objects)
================================  ==========================================================

Environment variables read: the ones above (to leave the user's alone),
``CPUDDP_CCL_SKIP_VERSION_CHECK``.  Written: none (:func:`cpuddp.init_distributed` exports).
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
    it); ``environ`` is read for ``CPUDDP_CCL_SKIP_VERSION_CHECK``.
    """

    metadata: MetadataLookup
    find_module: ModuleFinder
    environ: Mapping[str, str] = field(default_factory=dict)


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


def _lookups(metadata: Any = None, find_module: Any = None, environ: Optional[Mapping[str, str]] = None) -> Lookups:
    return Lookups(
        metadata=_as_metadata(metadata),
        find_module=_as_finder(find_module),
        environ=os.environ if environ is None else environ,
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
        if skip:
            ok, built_for = True, f"version check skipped by {SKIP_VERSION_CHECK_VAR}=1"
        elif torch_version is None:
            problems.append((dist, version, module, f"{dist} {version} is installed and torch's version is unknown"))
            continue
        else:
            ok, built_for = ccl_pairing(version, torch_version)
        if not ok:
            problems.append((
                dist, version, module,
                f"{dist} {version} is built for {built_for}, not torch {torch_version} "
                f"(not imported: a wheel built for another torch can abort the interpreter)",
            ))
            continue
        if not lk.find_module(module):
            problems.append((dist, version, module, f"{dist} {version} is installed without its module {module} (a broken install)"))
            continue
        what = (
            f"{dist} {version} ({built_for}), torch {torch_version}" if skip
            else f"{dist} {version} matches torch {torch_version}"
        )
        return BackendStatus("ccl", True, what, version=version, module=module, devices=devices, distribution=dist)
    dist, version, module, _ = problems[0]
    text = "; ".join(w for _, _, _, w in problems)
    return BackendStatus("ccl", False, text, version=version, module=module, devices=devices, distribution=dist)


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

#: The launcher families that start ranks as MPI processes (the mpi backend needs one).
_MPI_LAUNCHERS = ("hydra", "openmpi", "pmix", "mvapich", "slurm")


def backend_status(name: str, *, metadata: Any = None, find_module: Any = None,
                   environ: Optional[Mapping[str, str]] = None) -> BackendStatus:
    """The :class:`BackendStatus` of one registered backend (see :func:`available_backends`)."""
    key = name.strip().lower()
    spec = BACKENDS.get(key)
    if spec is None:
        raise _unknown(name)
    return _status(spec, _lookups(metadata, find_module, environ))


def _status(spec: BackendSpec, lk: Lookups) -> BackendStatus:
    try:
        return _generic_status(spec, lk)
    except Exception as exc:  # one broken plug-in check must not hide the others
        return BackendStatus(spec.name, False, f"its check raised {type(exc).__name__}: {exc}",
                             module=spec.module, devices=spec.devices, distribution=spec.distribution)


def available_backends(*, metadata: Any = None, find_module: Any = None,
                       environ: Optional[Mapping[str, str]] = None) -> list[BackendStatus]:
    """Every registered backend: available or not, why, version and module.

    Cheap: reads package metadata and looks modules up without importing them (torch's own
    backends import ``torch.distributed``).  ``metadata`` (a mapping dist -> version or a
    function), ``find_module`` (a function or a set of module names) and ``environ`` replace
    the real lookups, for tests.
    """
    lk = _lookups(metadata, find_module, environ)
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
        f"{torch_version}: build intel/torch-ccl against this torch and export {SKIP_VERSION_CHECK_VAR}=1, "
        f"or pass backend='gloo'"
    )


def resolve_backend(
    requested: str,
    env: "DistEnv",
    *,
    metadata: Any = None,
    find_module: Any = None,
    environ: Optional[Mapping[str, str]] = None,
    device: Optional[str] = None,
) -> BackendChoice:
    """Pick the backend for ``requested`` ("auto", "ccl", "gloo", ... any registered name).

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
        return _auto(env, lk, (device or "cpu").strip().lower())
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


def _auto(env: "DistEnv", lk: Lookups, device: str) -> BackendChoice:
    if device == "cuda":
        nccl = _status(BACKENDS["nccl"], lk) if "nccl" in BACKENDS else None
        if nccl is not None and nccl.available:
            return BackendChoice("nccl", f"auto: the model is on CUDA and {nccl.reason}", None, "auto")
        why = nccl.reason if nccl is not None else "nccl is not registered"
        return _auto_gloo(lk, f"the model is on CUDA but nccl cannot run ({why})")
    ccl = _status(BACKENDS["ccl"], lk) if "ccl" in BACKENDS else None
    if ccl is not None and ccl.available:
        return BackendChoice("ccl", f"auto: {ccl.reason}", ccl.module, "auto", ccl.version, ccl.distribution, True)
    return _auto_gloo(lk, ccl.reason if ccl is not None else "ccl is not registered")


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
) -> dict[str, str]:
    """The ``CCL_*`` and ``GLOO_SOCKET_IFNAME`` values to export for ``choice``; pure.

    Only variables absent from ``environ`` are returned (the user's setting wins).
    ``plan`` is the pinning plan (anything with a ``ccl_worker_cpus`` tuple) or None.
    ``route_lookup(master_addr)`` returns the local (interface, source address) that reaches
    rank 0; the default asks the kernel (:func:`cpuddp.netif.route_to`).
    """
    name = choice if isinstance(choice, str) else choice.name
    name = name.strip().lower()
    out: dict[str, str] = {}
    if name == "ccl":
        out.update(ccl_env(env, plan, environ))
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


def ccl_env(env: "DistEnv", plan: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """oneCCL's settings for this launcher and pinning plan (pure; see the module table)."""
    hydra = env.launcher == "hydra"
    want: dict[str, str] = {
        "CCL_LOCAL_RANK": str(env.local_rank),
        "CCL_LOCAL_SIZE": str(env.local_world_size),
        "CCL_WORKER_COUNT": "1",
    }
    if not hydra:
        # oneCCL's default launcher is Hydra's PMI; elsewhere it must not wait for one
        # (Open MPI: "Invalid rank in internal_Group_incl" without these).
        want["CCL_PROCESS_LAUNCHER"] = "none"
    want["CCL_ATL_TRANSPORT"] = "mpi" if hydra else "ofi"
    transport = environ.get("CCL_ATL_TRANSPORT", want["CCL_ATL_TRANSPORT"]).strip().lower()
    if transport == "ofi" and env.single_node:
        want["CCL_ATL_SHM"] = "1"
    count = _worker_count(environ)
    affinity = _worker_affinity(env, plan, count)
    if affinity is not None:
        want["CCL_WORKER_AFFINITY"] = affinity
    return {k: v for k, v in want.items() if k not in environ}


def _worker_affinity(env: "DistEnv", plan: Any, count: int) -> Optional[str]:
    """``CCL_WORKER_AFFINITY`` from the plan's CPUs for this rank's oneCCL workers.

    oneCCL reads one list for *all* local ranks, pins worker ``i`` of local rank ``r`` to
    entry ``r * count + i``, and rejects a list of any other length.  Each process reads only
    its own slots, from its own environment, so this rank's CPUs fill every slot.
    """
    cpus = tuple(getattr(plan, "ccl_worker_cpus", None) or ()) if plan is not None else ()
    if not cpus:
        return None
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
