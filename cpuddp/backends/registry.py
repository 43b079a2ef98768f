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

Each backend is one object (:class:`~cpuddp.backends.types.BackendSpec`; torch's own in
:mod:`cpuddp.backends.torch_backends`, oneCCL's :class:`~cpuddp.backends.ccl.CclBackend`, shm's
:class:`~cpuddp.backends.shm.backend.ShmBackend`): this module registers them and asks them,
never comparing a name.  Loading (:func:`load_backend`) imports torch first, then the backend's
module, and checks that the module registered the backend name with ``torch.distributed``.

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

import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from cpuddp.errors import BackendError

from .auto import AutoFacts, auto_rule
from .ccl import CclBackend, ccl_status
from .failure import explain_collective_failure
from .shm import api as shm_api
from .shm.protocol import check as shm_check
from .shm.backend import ShmBackend
from .torch_backends import GlooBackend, MpiBackend, NcclBackend, torch_probe
from .types import (
    BACKENDS,
    REQUEST_WORDS,
    BackendChoice,
    BackendName,
    BackendSpec,
    BackendStatus,
    ImportProbe,
    Lookups,
    ProbeResult,
    _lookups,
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
    "accepts",
    "explain_collective_failure",
]

log = logging.getLogger("cpuddp.backends")


# --------------------------------------------------------------------------- registry

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
    key = BackendName(name) if isinstance(name, str) else ""
    if not _NAME.match(key) or key in _REQUESTS:
        raise ValueError(
            f"backend name {name!r} is not valid: use lowercase letters, digits and '_', "
            f"starting with a letter, and not 'auto'"
        )
    if key in BACKENDS and not replace:
        raise ValueError(f"backend {key!r} is already registered; pass replace=True to override it")
    devs = (devices,) if isinstance(devices, str) else tuple(devices)
    if not devs:
        raise ValueError(f"backend {key!r}: devices must name at least one device type, e.g. ('cpu',)")
    return _add(BackendSpec(key, module=module, devices=devs, distribution=distribution, probe=probe,
                            description=description, leave=leave, abort=abort))


def _add(spec: BackendSpec) -> BackendSpec:
    BACKENDS[spec.name] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Remove a registry entry (no error when absent)."""
    BACKENDS.pop(BackendName(name), None)


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


def watch_all(check: Optional[Callable[[], Optional[str]]]) -> None:
    """Every registered backend's ``watch`` hook (the watchdog: its lost-rank check while it
    runs, None when it stops)."""
    for spec in list(BACKENDS.values()):
        if spec.watch is not None:
            spec.watch(check)


def backend_status(name: str, *, metadata: Any = None, find_module: Any = None,
                   environ: Optional[Mapping[str, str]] = None,
                   import_probe: Optional[ImportProbe] = None) -> BackendStatus:
    """The :class:`BackendStatus` of one registered backend (see :func:`available_backends`)."""
    spec = BACKENDS.get(BackendName(name))
    if spec is None:
        raise _unknown(name)
    return spec.status(_lookups(metadata, find_module, environ, import_probe))


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
    return [spec.status(lk) for spec in BACKENDS.values()]


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
    name = BackendName(requested)
    lk = _lookups(metadata, find_module, environ)
    special = _REQUESTS.get(name)
    if special is not None:
        return special(env, lk, (device or "cpu").strip().lower(), node_cpus, probe_torch, smallest_node)
    spec = BACKENDS.get(name)
    if spec is None:
        raise _unknown(requested)
    st = spec.status(lk)
    if not st.available:
        raise spec.refusal(st, lk)
    spec.check_request(env, device)
    return spec.named_choice(st, env, lk)


def _auto(env: "DistEnv", lk: Lookups, device: str, node_cpus: Optional[int] = None,
          probe_torch: bool = True, smallest_node: Optional[int] = None) -> BackendChoice:
    """Gather the facts :func:`cpuddp.backends.auto.auto_rule` needs, ask it, and let the backend
    it picked make the choice."""
    d = auto_rule(_auto_facts(env, lk, device, node_cpus, probe_torch, smallest_node))
    spec = BACKENDS.get(d.backend)
    if spec is None:  # the rule's fallback (gloo) was unregistered
        raise BackendError(f"backend='auto' found nothing to run: {d.reason}; {d.backend}: not registered",
                           fix="install a torch built with gloo (every PyPI build is), or name a backend")
    return spec.auto_choice(d.reason, d.inter, lk, probe_torch)


#: What ``backend=`` may ask for besides a backend's name: the rule's choice.
_REQUESTS: dict[str, Callable[..., BackendChoice]] = {BackendName.AUTO: _auto}
assert set(_REQUESTS) == REQUEST_WORDS, "types.REQUEST_WORDS (BackendChoice.named) names the same requests"


def accepts(requested: Any, live: str) -> bool:
    """Whether ``backend=requested`` is served by a live group of backend ``live``: a request for
    the rule's choice takes any; a name only its own."""
    if not isinstance(requested, str):
        return False
    name = BackendName(requested)
    return name in _REQUESTS or name == BackendName(live)


def _auto_facts(env: "DistEnv", lk: Lookups, device: str, node_cpus: Optional[int], probe_torch: bool,
                smallest_node: Optional[int] = None) -> AutoFacts:
    """The facts of the rule, each asked of the backend it is about (unregistered: not available)."""
    if device == "cuda":
        nccl = _status_of(BackendName.NCCL, lk) if probe_torch else None
        return AutoFacts(env.local_world_size, env.num_nodes, False, "", False, "", device,
                         bool(nccl and nccl.available),
                         (nccl.reason if nccl else "nccl is not registered") if probe_torch
                         else "not probed without torch")
    ccl = _status_of(BackendName.CCL, lk)
    shm = BACKENDS.get(BackendName.SHM)
    shm_st = shm.auto_status(env, lk, node_cpus, smallest_node) if shm is not None else None
    mpi = leg_status(BackendName.MPI, env, lk)
    return AutoFacts(
        env.local_world_size, max(1, env.num_nodes),
        bool(shm_st and shm_st.available), shm_st.reason if shm_st else "shm is not registered",
        bool(ccl and ccl.available), ccl.reason if ccl else "ccl is not registered", device,
        mpi_ok=mpi.available, mpi_why=mpi.reason,
        single_rank_node=smallest_node is not None and smallest_node < 2,
        shm_opted_out=(lk.environ.get(shm_check.OPT_OUT_VAR) or "").strip() == "0")


def leg_status(name: str, env: "DistEnv", lk: Lookups) -> BackendStatus:
    """Whether backend ``name`` can carry the shm group's leg between nodes here (not asked on
    one node, where there is no leg)."""
    spec = BACKENDS.get(name)
    if spec is None:
        return BackendStatus(name, False, f"{name} is not registered")
    if env.num_nodes <= 1:
        return BackendStatus(name, False, "one node: no leg between nodes")
    return spec.leg_status(env, lk)


def _status_of(name: str, lk: Lookups) -> Optional[BackendStatus]:
    spec = BACKENDS.get(name)
    return spec.status(lk) if spec is not None else None


# --------------------------------------------------------------------------- the built-in backends


_add(CclBackend(BackendName.CCL, devices=("cpu", "xpu"), distribution="oneccl_bind_pt", probe=ccl_status,
                description="Intel oneCCL through its PyTorch bindings (oneccl_bind_pt)"))
_add(GlooBackend(BackendName.GLOO, devices=("cpu", "cuda"),
                 probe=torch_probe("is_gloo_available", "torch was built without gloo"),
                 description="torch's built-in CPU backend"))
_add(MpiBackend(BackendName.MPI, devices=("cpu", "cuda"),
                probe=torch_probe("is_mpi_available",
                                  "torch was built without MPI (build torch from source against an MPI)"),
                description="torch's MPI backend (needs a torch built with MPI and an MPI launcher)"))
_add(NcclBackend(BackendName.NCCL, devices=("cuda",), description="NVIDIA NCCL, for models on CUDA"))
register_backend(BackendName.ACCL, module="torch_accl", devices=("cuda",), distribution="torch_accl",
                 description="Alibaba ACCL plug-in (import torch_accl, backend 'accl')")
_add(ShmBackend(BackendName.SHM, module="cpuddp.shm", devices=("cpu",), probe=shm_check.probe, leave=shm_api.leave_all,
                abort=shm_api.abort_all, watch=shm_api.watch_lost,
                description="cpuddp's shared-memory collectives within a node, gloo or oneCCL between nodes "
                            "(cpuddp.shm)"))


# --------------------------------------------------------------------------- load


def load_backend(choice: Union[BackendChoice, str]) -> None:
    """Import torch, then ``choice.module`` (if any), and check it registered the backend.

    Refuses (BackendError) to import oneCCL bindings that do not match torch, even when
    handed a choice made elsewhere.  Any import failure is a BackendError naming the module.
    """
    if isinstance(choice, str):
        spec = BACKENDS.get(BackendName(choice))
        if spec is None:
            raise _unknown(choice)
        choice = BackendChoice(spec.name, "by name", spec.module, spec.name)
    choice.backend.load(choice)
