"""The environment a backend needs before ``init_process_group``: pure, given the lookups.

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

Each backend says which of these are its own (:meth:`~cpuddp.backends.types.BackendSpec.settings`:
oneCCL's for ccl, and for shm the leg's); the shm group takes its own settings as process-group
options, not variables (:meth:`cpuddp.backends.shm.backend.ShmBackend.group_options`).

Environment variables read: the ones above (to leave the user's alone), ``CCL_ROOT``,
``ONEAPI_ROOT``, Intel MPI's ``I_MPI_HYDRA_*`` (to tell its Hydra from MPICH's).  Written:
none (:func:`cpuddp.init_distributed` exports).  Loopback is :func:`cpuddp.launchers.is_loopback`'s
call; ``CCL_WORKER_COUNT``/``CCL_WORKER_AFFINITY`` are :mod:`cpuddp.affinity.ccl_workers`'s.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Tuple, Union

from cpuddp.affinity.ccl_workers import (
    DEFAULT_WORKERS,
    WORKER_AFFINITY_VAR,
    WORKER_COUNT_VAR,
    worker_affinity,
    worker_count,
)
from cpuddp.launchers.netif import Route, is_loopback_address
from cpuddp.launchers.parsers import is_loopback

from .types import BackendChoice, BackendName

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

__all__ = ["RouteLookup", "CclPaths", "backend_env", "ccl_settings", "ccl_env", "find_ccl_paths", "gloo_env"]

log = logging.getLogger("cpuddp.backends")

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
    for ``choice`` (oneCCL's for the ccl backend and for shm with a oneCCL leg); pure, given the lookups.

    Only variables absent from ``environ`` are returned (the user's setting wins).
    ``plan`` is the pinning plan (anything with a ``ccl_worker_cpus`` tuple) or None.
    ``route_lookup(master_addr)`` returns the local (interface, source address) that reaches
    rank 0; the default asks the kernel (:func:`cpuddp.launchers.netif.route_to`).  ``ccl_paths``
    says where Intel MPI and libfabric's providers are; the default looks
    (:func:`find_ccl_paths`).
    """
    if isinstance(choice, str):
        choice = BackendChoice(BackendName(choice), "named")
    out = choice.backend.settings(env, choice, plan, environ, paths=ccl_paths)  # shm: its leg's
    out.update(gloo_env(env, environ, route_lookup=route_lookup))
    return out


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
    want: dict[str, Tuple[str, str]] = {
        "CCL_LOCAL_RANK": (str(env.local_rank), "the launcher's local rank"),
        "CCL_LOCAL_SIZE": (str(env.local_world_size), "ranks on this host"),
        WORKER_COUNT_VAR: (str(DEFAULT_WORKERS), "one oneCCL progress thread per rank"),
    }
    if env.launcher != "hydra":
        # oneCCL's default launcher is Hydra's PMI; elsewhere it must not wait for one
        # (Open MPI: "Invalid rank in internal_Group_incl" without these).
        want["CCL_PROCESS_LAUNCHER"] = ("none", f"no Hydra PMI under {env.launcher}")
    want.update(_transport(env, environ, paths))
    transport = environ.get("CCL_ATL_TRANSPORT", want["CCL_ATL_TRANSPORT"][0]).strip().lower()
    if transport == "ofi" and env.single_node:
        want["CCL_ATL_SHM"] = ("1", "ofi on one node: shared memory between the ranks")
    if paths.provider_dir:
        want["FI_PROVIDER_PATH"] = (paths.provider_dir, "libfabric's providers beside the installed oneCCL / Intel MPI")
    affinity = _worker_affinity(env, plan, worker_count(environ))
    if affinity is not None:
        want[WORKER_AFFINITY_VAR] = (affinity, "the CPUs the pinning plan reserved for oneCCL's workers")
    return want


def _transport(env: "DistEnv", environ: Mapping[str, str], paths: CclPaths) -> dict[str, Tuple[str, str]]:
    """``CCL_ATL_TRANSPORT`` (and ``I_MPI_ROOT`` when mpi is chosen from the launching Intel MPI)."""
    impi_root = next((environ[k] for k in _IMPI_ROOT_VARS if environ.get(k)), None)
    intel = _intel_hydra(env, environ)
    if intel and (impi_root or paths.impi_root):
        out = {"CCL_ATL_TRANSPORT": ("mpi", "started by Intel MPI's Hydra, with Intel MPI's environment")}
        if not impi_root and paths.impi_root:
            out["I_MPI_ROOT"] = (paths.impi_root, "the Intel MPI that started this rank (oneCCL's mpi transport needs it)")
        return out
    if intel:
        why = "Intel MPI's Hydra, but no Intel MPI environment (I_MPI_ROOT, ONEAPI_ROOT) for oneCCL's mpi transport"
    elif env.launcher == "hydra":
        why = "Hydra of MPICH, not Intel MPI: oneCCL's mpi transport needs Intel MPI"
    else:
        why = f"launched by {env.launcher}, not Intel MPI"
    return {"CCL_ATL_TRANSPORT": ("ofi", why)}


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


def _worker_affinity(env: "DistEnv", plan: Any, count: int) -> Optional[str]:
    """``CCL_WORKER_AFFINITY`` from the plan's CPUs for this rank's oneCCL workers, built by
    :func:`cpuddp.affinity.ccl_workers.worker_affinity` (the string the plan itself exports)."""
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
    return worker_affinity(cpus, env.local_world_size)


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
    if env.single_node and (not addr or is_loopback(addr)):
        return {"GLOO_SOCKET_IFNAME": "lo"}
    if not addr:
        return {}
    if is_loopback(addr):
        if env.local_rank == 0:
            log.warning(
                "cpuddp: MASTER_ADDR=%s is loopback but the job spans %d nodes; not choosing GLOO_SOCKET_IFNAME",
                addr, env.num_nodes,
            )
        return {}
    lookup = route_lookup
    if lookup is None:
        from cpuddp.launchers.netif import route_to

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
