"""Why a process group's first collective failed, in one :class:`~cpuddp.errors.BackendError`.

:func:`explain_collective_failure` names the transport, the variables that steer it (as they
are in the rank's environment) and the fix: a known oneCCL failure gets its own, anything
else the ways to narrow it down.  Pure: it reads the mapping it is given and, for the
libfabric provider directory, the filesystem.
"""

from __future__ import annotations

from typing import Mapping, Tuple

from cpuddp.errors import BackendError

from .settings import _FI_PROVIDER_GLOB, _IMPI_ROOT_VARS, _has
from .types import backend_for, failed_line

__all__ = ["explain_collective_failure", "ccl_failure"]

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
    """The :class:`BackendError` for a group whose first collective failed: the backend's own
    explanation (:meth:`~cpuddp.backends.types.BackendSpec.explain_failure`).

    Its last line names the transport, the variables that steer it (as they are in
    ``environ``) and the fix: a known oneCCL failure gets its own fix, anything else the
    ways to narrow it down.  ``exc`` is what the collective raised.
    """
    return backend_for(backend_name or "").explain_failure(environ, exc)


def ccl_failure(name: str, environ: Mapping[str, str], exc: BaseException) -> BackendError:
    """oneCCL's explanation (:class:`cpuddp.backends.ccl.CclBackend`): the transport, its
    variables, and a known failure's fix or the ways to narrow it down."""
    msg = failed_line(name, environ, exc)
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


