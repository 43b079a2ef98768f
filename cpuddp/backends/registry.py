"""Which collective backend can run here, why, and how to load and configure it.

Choosing (:func:`resolve_backend`)::

    backend="auto"   :func:`cpuddp.backends.auto.auto_rule`: within a node shared memory
                     ("shm") when the node is eligible, its node-to-node leg on oneCCL when
                     the bindings work, else gloo; where shm cannot run, oneCCL across
                     nodes when it works, else gloo (on one node gloo: oneCCL measured
                     slower there).  With device="cuda": nccl when available, else gloo.
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
(:mod:`cpuddp.backends.ccl_probe`, cached per build and torch), and the binding is used when that
import succeeds -- "built for this torch (import probe passed)" -- and is never imported in
this interpreter when it fails.  ``CPUDDP_CCL_SKIP_VERSION_CHECK=1`` skips both checks and
trusts the binding.

Loading (:func:`load_backend`) imports torch first, then the backend's module, and checks
that the module registered the backend name with ``torch.distributed``.

Configuring (:func:`cpuddp.backends.settings.backend_env`, pure) returns the variables to export
before ``init_process_group``; a variable the user set is never in it (the table is in
:mod:`cpuddp.backends.settings`).  A first collective that fails is explained by
:func:`cpuddp.backends.failure.explain_collective_failure`.

The rest of the area lives beside this module (its package docstring lists it), and every
public name is importable from :mod:`cpuddp.backends`.

Environment variables read: ``CPUDDP_CCL_SKIP_VERSION_CHECK`` and :mod:`cpuddp.backends.ccl_probe`'s
(here), and :mod:`cpuddp.backends.settings`'s.  Written: none (:func:`cpuddp.init_distributed` exports).
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Tuple, Union

from cpuddp.errors import BackendError
from cpuddp.launchers.registry import starts_mpi_world

from .auto import AutoFacts, auto_rule, inter_leg
from .shm import api as shm_api
from .ccl import ccl_fix, ccl_status
from .types import (
    BackendChoice,
    BackendSpec,
    BackendStatus,
    ImportProbe,
    Lookups,
    ProbeResult,
    _lookups,
    _torch_version,
)

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

__all__ = [
    "BACKENDS",
    "available_backends",
    "backend_status",
    "resolve_backend",
    "load_backend",
    "register_backend",
    "unregister_backend",
    "leave_all",
    "abort_all",
]

log = logging.getLogger("cpuddp.backends")


# --------------------------------------------------------------------------- checks


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
    leave: Optional[Callable[[], None]] = None,
    abort: Optional[Callable[[str], None]] = None,
) -> BackendSpec:
    """Add a backend that ``init_distributed(backend=name)`` can use.

    Example, Alibaba's ACCL (already registered as ``"accl"``)::

        cpuddp.register_backend("accl", module="torch_accl", devices=("cuda",),
                                distribution="torch_accl")

    ``module`` is imported after torch and must register ``name`` with
    ``torch.distributed.Backend``.  ``replace=True`` overrides an existing entry.  ``leave`` and
    ``abort``: the backend's lifecycle hooks (:class:`~cpuddp.backends.types.BackendSpec`).
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
    spec = BackendSpec(key, module=module, devices=devs, distribution=distribution, probe=probe,
                       description=description, leave=leave, abort=abort)
    BACKENDS[key] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Remove a registry entry (no error when absent)."""
    BACKENDS.pop(name.strip().lower(), None)


def leave_all() -> None:
    """Every registered backend's ``leave`` hook (``cpuddp.shutdown``, before torch's teardown)."""
    for spec in list(BACKENDS.values()):
        if spec.leave is not None:
            spec.leave()


def abort_all(why: str) -> None:
    """Every registered backend's ``abort`` hook (the watchdog, when this rank raises)."""
    for spec in list(BACKENDS.values()):
        if spec.abort is not None:
            spec.abort(why)


def _shm_probe(lk: Lookups) -> Tuple[bool, str]:
    from cpuddp.backends.shm.check import probe

    return probe(lk)


register_backend("ccl", devices=("cpu", "xpu"), distribution="oneccl_bind_pt", probe=ccl_status,
                 description="Intel oneCCL through its PyTorch bindings (oneccl_bind_pt)")
register_backend("gloo", devices=("cpu", "cuda"), probe=_torch_probe("is_gloo_available", "torch was built without gloo"),
                 description="torch's built-in CPU backend")
register_backend("mpi", devices=("cpu", "cuda"),
                 probe=_torch_probe("is_mpi_available", "torch was built without MPI (build torch from source against an MPI)"),
                 description="torch's MPI backend (needs a torch built with MPI and an MPI launcher)")
register_backend("nccl", devices=("cuda",), probe=_nccl_probe, description="NVIDIA NCCL, for models on CUDA")
register_backend("accl", module="torch_accl", devices=("cuda",), distribution="torch_accl",
                 description="Alibaba ACCL plug-in (import torch_accl, backend 'accl')")
register_backend("shm", module="cpuddp.shm", devices=("cpu",), probe=_shm_probe, leave=shm_api.leave_all,
                 abort=shm_api.abort_all,
                 description="cpuddp's shared-memory collectives within a node, gloo or oneCCL between nodes "
                             "(cpuddp.shm)")

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
    are import-probed in a child process once per build, see :mod:`cpuddp.backends.ccl_probe`).
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


def resolve_backend(
    requested: str,
    env: "DistEnv",
    *,
    metadata: Any = None,
    find_module: Any = None,
    environ: Optional[Mapping[str, str]] = None,
    device: Optional[str] = None,
    node_cpus: Optional[int] = None,
    probe_torch: bool = True,
    smallest_node: Optional[int] = None,
) -> BackendChoice:
    """Pick the backend for ``requested`` ("auto", "ccl", "gloo", ... any registered name).

    ``node_cpus``: the CPUs this node's ranks may use together (known at init, from the hosts
    gathered); "auto" takes the shared-memory backend only when they do not outnumber them.
    ``smallest_node``: the fewest ranks any node runs (known at init); "auto" takes shm only when
    every node runs 2+, so the ranks of an uneven job agree (:mod:`cpuddp.backends.decide`).
    ``probe_torch=False`` (``cpuddp doctor`` without ``--torch``): gloo is taken as built in
    rather than checked by importing torch; the rule is the same (:mod:`cpuddp.backends.auto`).

    ``device`` ("cpu" by default, or "cuda") steers "auto".  Nothing is imported except torch
    itself.  Raises :class:`~cpuddp.errors.BackendError` for an unknown name (listing the valid
    ones), and for a named backend that cannot run here (for ccl: the package and versions
    found).  Never falls back from a named backend to another."""
    if not isinstance(requested, str):
        raise _unknown(requested)
    name = requested.strip().lower()
    lk = _lookups(metadata, find_module, environ)
    if name == "auto":
        return _auto(env, lk, (device or "cpu").strip().lower(), node_cpus, probe_torch, smallest_node)
    spec = BACKENDS.get(name)
    if spec is None:
        raise _unknown(requested)
    st = _status(spec, lk)
    if not st.available:
        if name == "ccl":
            torch_version = _torch_version(lk)
            raise BackendError(
                f"backend='ccl' was requested, but {st.reason}",
                fix=ccl_fix(torch_version),
            )
        pkg = f" (pip distribution {st.distribution})" if st.distribution else ""
        raise BackendError(
            f"backend={name!r} was requested, but it cannot run here: {st.reason}",
            fix=f"install it{pkg}, or pass backend='auto' or 'gloo'",
        )
    if name == "mpi" and env.world_size > 1 and not starts_mpi_world(env.launcher):
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
    inter = shm_inter(env, lk) if name == "shm" else None
    return BackendChoice(name, f"requested; {st.reason}", st.module, name, st.version, st.distribution, True, inter)


def _auto(env: "DistEnv", lk: Lookups, device: str, node_cpus: Optional[int] = None,
          probe_torch: bool = True, smallest_node: Optional[int] = None) -> BackendChoice:
    """Gather the facts :func:`cpuddp.backends.auto.auto_rule` needs, ask it, and check the answer."""
    facts = _auto_facts(env, lk, device, node_cpus, probe_torch, smallest_node)
    d = auto_rule(facts)
    if d.backend == "gloo":
        return _auto_gloo(lk, d.reason, probe_torch)
    if d.backend == "ccl":
        ccl = _status(BACKENDS["ccl"], lk)
        return BackendChoice("ccl", f"auto: {d.reason}", ccl.module, "auto", ccl.version, ccl.distribution, True)
    spec = BACKENDS.get(d.backend)
    return BackendChoice(d.backend, f"auto: {d.reason}", spec.module if spec else None, "auto", inter=d.inter)


def _auto_facts(env: "DistEnv", lk: Lookups, device: str, node_cpus: Optional[int], probe_torch: bool,
                smallest_node: Optional[int] = None) -> AutoFacts:
    if device == "cuda":
        if not probe_torch:
            return AutoFacts(env.local_world_size, env.num_nodes, False, "", False, "", device,
                             False, "not probed without torch")
        nccl = _status(BACKENDS["nccl"], lk) if "nccl" in BACKENDS else None
        return AutoFacts(env.local_world_size, env.num_nodes, False, "", False, "", device,
                         bool(nccl and nccl.available), nccl.reason if nccl else "nccl is not registered")
    ccl = _status(BACKENDS["ccl"], lk) if "ccl" in BACKENDS else None
    shm = _auto_shm(env, lk, node_cpus, smallest_node)
    return AutoFacts(
        env.local_world_size, max(1, env.num_nodes),
        bool(shm and shm.available), shm.reason if shm else "shm is not registered",
        bool(ccl and ccl.available), ccl.reason if ccl else "ccl is not registered", device)


def shm_inter(env: "DistEnv", lk: Optional[Lookups] = None) -> Optional[str]:
    """The node-to-node leg for a named ``backend="shm"``: the same rule as auto's."""
    lk = lk or _lookups()
    ccl = _status(BACKENDS["ccl"], lk) if "ccl" in BACKENDS else None
    return inter_leg(env.num_nodes, bool(ccl and ccl.available), ccl.reason if ccl else "")[0]


def _auto_shm(env: "DistEnv", lk: Lookups, node_cpus: Optional[int],
              smallest_node: Optional[int] = None) -> Optional[BackendStatus]:
    """The shared-memory backend's verdict for this node (None when it is not registered)."""
    from cpuddp.backends.shm import check as shm_check

    spec = BACKENDS.get(shm_check.NAME)
    if spec is None:
        return None
    ok, reason = shm_check.eligibility(env.local_world_size, lk.environ, node_cpus=node_cpus)
    if ok and smallest_node is not None and smallest_node < 2:
        ok, reason = False, (f"a node of this job runs {smallest_node} rank: auto takes shared memory only where "
                             "every node runs 2 or more (backend='shm' runs such a layout, over gloo)")
    return BackendStatus(spec.name, ok, reason, module=spec.module)


def _auto_gloo(lk: Lookups, why_not: str, probe_torch: bool = True) -> BackendChoice:
    if not probe_torch and "gloo" in BACKENDS:  # doctor without torch: built into every PyPI torch
        return BackendChoice("gloo", f"auto: gloo, because {why_not}", None, "auto")
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
                fix=ccl_fix(torch.__version__),
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
