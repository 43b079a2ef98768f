"""``cpuddp run``'s runtime settings: a faster allocator and OpenMP settings that match the plan.

Each has an off switch and a default set by ``benchmarks/run_settings.py`` on a 2-vCPU AMD
EPYC with AVX2, no AVX-512 (docs/performance.md, "cpuddp run's runtime settings"): on by
default only where it measured a gain.

- ``--allocator {auto,jemalloc,tcmalloc,none}``: ``LD_PRELOAD`` of a system tcmalloc
  (Debian's ``libtcmalloc-minimal4``) or jemalloc (``libjemalloc2``), found in the usual
  library directories; never downloaded.  ``auto`` (the default): tcmalloc when installed,
  else nothing -- tcmalloc measured 1.14x on README's example and no gain or loss beyond the
  noise on the 10 M-parameter MLP; jemalloc measured no gain (1.03x, 0.96x), so it is used
  only when named.
- ``--omp {auto,on,off}``: Intel OpenMP (``libiomp5`` in torch's lib directory) gets
  ``KMP_AFFINITY=granularity=fine,compact,1,0`` and ``KMP_BLOCKTIME=1``; GNU OpenMP (PyPI's
  torch) gets ``OMP_PROC_BIND=close`` and ``OMP_PLACES=cores``: one thread per core of the
  rank's own CPUs (each rank starts already pinned, so the places are its cores).  Off by
  default: GNU OpenMP's binding measured 0.89x on README's example and 0.99x on the MLP.

A variable the user already set is kept (the user wins) and reported.  Finding torch's
OpenMP runtime lists torch's ``lib`` directory without importing torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

from cpuddp.affinity.plan import KMP_AFFINITY, KMP_BLOCKTIME

from cpuddp.affinity.job import RunPlanError

__all__ = ["ALLOCATORS", "AUTO_ALLOCATORS", "LIB_DIRS", "DEFAULTS", "find_allocator", "openmp_runtime", "settings_env"]

#: The allocator libraries tried, by name, in order.
ALLOCATORS = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
}
#: Where system libraries live (Debian/Ubuntu multiarch, RHEL, /usr/local, a conda env).
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib", "/usr/local/lib64")
#: jemalloc settings IPEX's launcher used: keep freed pages (training reallocates the same sizes).
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000"
#: Defaults measured by benchmarks/run_settings.py (docs/performance.md): on only where they helped.
DEFAULTS = {"allocator": "auto", "omp": "off"}
#: What ``--allocator auto`` tries: only what measured a gain here.
AUTO_ALLOCATORS = ("tcmalloc",)


def _dirs(environ: Mapping[str, str]) -> list[str]:
    extra = [os.path.join(environ[v], "lib") for v in ("CONDA_PREFIX", "VIRTUAL_ENV") if environ.get(v)]
    return [*extra, *LIB_DIRS]


def find_allocator(name: str, environ: Mapping[str, str],
                   exists: Callable[[str], bool] = os.path.isfile) -> Optional[str]:
    """The path of allocator ``name`` (``jemalloc``/``tcmalloc``; ``auto``: :data:`AUTO_ALLOCATORS`), or None."""
    names = list(AUTO_ALLOCATORS) if name == "auto" else [name]
    for n in names:
        for d in _dirs(environ):
            for lib in ALLOCATORS[n]:
                path = os.path.join(d, lib)
                if exists(path):
                    return path
    return None


def openmp_runtime(lib_files: Optional[Iterable[str]] = None) -> str:
    """``"intel"`` (libiomp5), ``"gnu"`` (libgomp) or ``"unknown"``, from the files of torch's
    ``lib`` directory (default: listed without importing torch)."""
    if lib_files is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return "unknown"
        lib_files = _list(Path(next(iter(spec.submodule_search_locations))) / "lib")
    files = list(lib_files)
    if any(f.startswith("libiomp5") for f in files):
        return "intel"
    if any(f.startswith("libgomp") for f in files):
        return "gnu"
    return "unknown"


def _list(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def settings_env(allocator: str, omp: str, environ: Mapping[str, str], *, allocator_path: Optional[str],
                 runtime: str) -> tuple[dict[str, str], list[str]]:
    """The variables to add for ``--allocator``/``--omp`` (pure), and a note for each choice.

    Raises :class:`RunPlanError` when ``--allocator jemalloc``/``tcmalloc`` is asked for by
    name and is not installed."""
    env: dict[str, str] = {}
    notes: list[str] = []
    if allocator != "none":
        if allocator_path is None:
            if allocator != "auto":
                pkg = "libjemalloc2" if allocator == "jemalloc" else "libtcmalloc-minimal4"
                raise RunPlanError(f"--allocator {allocator}: no {ALLOCATORS[allocator][0]} in {', '.join(_dirs(environ))}",
                                   fix=f"apt-get install {pkg} (or your system's package), or --allocator none")
            notes.append("allocator: the system's (no libtcmalloc_minimal.so.4 found; apt-get install libtcmalloc-minimal4)")
        else:
            pre = environ.get("LD_PRELOAD", "")
            env["LD_PRELOAD"] = allocator_path + (f":{pre}" if pre else "")
            if "jemalloc" in allocator_path and not environ.get("MALLOC_CONF"):
                env["MALLOC_CONF"] = JEMALLOC_CONF
            notes.append(f"allocator: LD_PRELOAD={allocator_path}")
    if omp == "on":
        wanted = ({"KMP_AFFINITY": KMP_AFFINITY, "KMP_BLOCKTIME": KMP_BLOCKTIME} if runtime == "intel"
                  else {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"})
        for k, v in wanted.items():
            if environ.get(k):
                notes.append(f"keeping the user's {k}={environ[k]} (cpuddp run would set {v})")
            else:
                env[k] = v
        notes.append(f"OpenMP ({runtime}): " + ", ".join(f"{k}={v}" for k, v in wanted.items()))
    return env, notes

