"""Can the shared-memory backend (:mod:`cpuddp.shm`) run here, and how much memory it reserves.

Pure and light (no torch import): :mod:`cpuddp.backends` and ``cpuddp doctor`` call it.

:func:`eligibility` ``(local_world_size, environ) -> (ok, reason)`` is what ``backend="auto"``
asks.  It says no, with the reason, when

* ``CPUDDP_SHM=0`` (the user opted out);
* the node runs fewer than 2 ranks (nothing to share);
* the CPU is not x86 and this rank's native library (:mod:`cpuddp.backends.shm.native`) cannot
  run: the Python data path relies on x86's total store order (a peer that sees a rank's
  arrival counter also sees the data stored before it); on aarch64 the shm group runs on the
  native data path only, whose loads and stores order themselves (acquire/release), and the
  Python engine's own steps take the library's fence;
* the memory the segment needs (:func:`reservation_bytes`) is more than the memory available
  (``MemAvailable``, and the cgroup's ``memory.max`` headroom where one is set).

The segment is an anonymous ``memfd`` handed from local rank 0 to its peers over a Unix socket
(no file in ``/dev/shm``, so Docker's 64 MiB ``--shm-size`` does not limit it).

Environment variables read: ``CPUDDP_SHM`` (``0`` opts out of auto), ``CPUDDP_SHM_SLOT`` (bytes
per rank and buffer, default 1M; K/M/G suffixes as in ``cpuddp bench``).  ``CPUDDP_SHM_DIR`` is
not read: nothing is created in a directory.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Callable, Mapping, Optional, Tuple

__all__ = [
    "NAME",
    "SLOT_VAR",
    "OPT_OUT_VAR",
    "DEFAULT_SLOT",
    "X86_MACHINES",
    "eligibility",
    "NATIVE_ONLY",
    "native_fix",
    "reservation_bytes",
    "slot_bytes",
    "layout",
    "ring_offset",
    "probe",
]

#: The backend's name for ``init_process_group`` and ``init_distributed(backend=...)``.
NAME = "shm"
SLOT_VAR = "CPUDDP_SHM_SLOT"
OPT_OUT_VAR = "CPUDDP_SHM"
#: 1 MiB per rank and buffer: 25-35% faster than 4 or 64 MiB on a 2-vCPU AMD EPYC, AVX2 (the slots stay in L3).
DEFAULT_SLOT = 1 << 20
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})
#: :func:`eligibility`'s words where a CPU that is not x86 cannot take the native data path
NATIVE_ONLY = "there the shared-memory backend runs on its native data path only"


def slot_bytes(environ: Mapping[str, str]) -> int:
    """``CPUDDP_SHM_SLOT`` in bytes (a multiple of 4096, at least 4096), or the default."""
    raw = environ.get(SLOT_VAR)
    if raw is None or not raw.strip():
        return DEFAULT_SLOT
    from cpuddp._units import parse_size  # pure, no torch

    try:
        value = parse_size(raw)
    except ValueError:
        value = 0
    page = _sizes().PAGE
    if value < page or value % page:
        raise ValueError(
            f"{SLOT_VAR}={raw!r} is not a size in bytes that is a multiple of 4096 (4K); "
            f"unset it for the default 1M, or set e.g. {SLOT_VAR}=4M"
        )
    return value


def layout(local_world_size: int, slot: int) -> Tuple[int, int, int]:
    """``(counters_offset, slots_offset, total_bytes)`` of one node's segment (pure).

    A header page, one control line per rank, the descriptor rings, then two buffers
    (parities) of one slot per rank; the sizes are ``layout.h``'s (:mod:`cpuddp.backends.shm.native.layout`).
    """
    s = _sizes()
    counters = s.PAGE
    slots = ring_offset(local_world_size) + _round_up(s.RING * s.DESC * local_world_size, s.PAGE)
    return counters, slots, slots + 2 * local_world_size * slot


def ring_offset(local_world_size: int) -> int:
    """Offset of the descriptor rings (entry-major: rank r's entry i at ``+ (i * local ranks + r) * DESC``)."""
    s = _sizes()
    return s.PAGE + _round_up(s.LINE * local_world_size, s.PAGE)


def reservation_bytes(local_world_size: int, environ: Mapping[str, str]) -> int:
    """Bytes one node's segment reserves in the shared-memory directory."""
    return layout(local_world_size, slot_bytes(environ))[2]


def _sizes() -> Any:
    """layout.h's reader, loaded when a size is first asked for, not when the registry imports
    this module (it brings the native binding's package, and ctypes, with it)."""
    from ..native import layout

    return layout


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _meminfo_available(text: str) -> Optional[int]:
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_headroom(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """``memory.max - memory.current`` of this process's cgroup (v2), or None where unlimited/unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join(root, rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError, StopIteration):
        return None


def available_memory() -> Optional[int]:
    """Bytes a new segment can take: ``MemAvailable``, capped by the cgroup's headroom; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            avail = _meminfo_available(f.read())
    except OSError:
        avail = None
    room = [v for v in (avail, _cgroup_headroom()) if v is not None]
    return min(room) if room else None


def eligibility(
    local_world_size: int,
    environ: Mapping[str, str],
    *,
    machine: Optional[str] = None,
    free_bytes: Optional[Callable[[], Optional[int]]] = None,
    node_cpus: Optional[int] = None,
    native_unavailable: Optional[Callable[[Mapping[str, str]], Optional[str]]] = None,
) -> Tuple[bool, str]:
    """Should ``backend="auto"`` use the shared-memory backend on this node?  ``(ok, reason)``.

    ``node_cpus``: the CPUs the node's ranks may use together (the union of their allowed
    sets, as gathered at init); more ranks than that is a no -- every waiting rank would sit
    on a CPU a peer needs (measured: 0.06x gloo at 4 MiB with 4 ranks on a 2-vCPU AMD EPYC, AVX2).
    ``machine`` (``platform.machine()``) and ``free_bytes()`` (available memory, or None when
    unknown: then the reservation at init decides) replace the real probes in tests, as does
    ``native_unavailable(environ)`` (why this rank's group would not take the native data path,
    or None: :func:`cpuddp.backends.shm.native.unavailable`, asked on CPUs that are not x86 only).
    """
    from cpuddp._units import format_size

    opt = (environ.get(OPT_OUT_VAR) or "").strip().lower()
    if opt in ("0", "false", "no", "off"):
        return False, f"{OPT_OUT_VAR}={environ.get(OPT_OUT_VAR)} opts out of the shared-memory backend"
    if local_world_size < 2:
        return False, f"this node runs {local_world_size} rank(s): shared memory needs 2 or more"
    if node_cpus is not None and local_world_size > node_cpus:
        return False, (f"{local_world_size} local ranks share {node_cpus} CPU(s): shared-memory waits "
                       f"would take CPUs their peers need (gloo's sockets sleep instead)")
    arch = (machine if machine is not None else platform.machine()) or "unknown"
    path = ""
    if arch.lower() not in X86_MACHINES:
        why = (native_unavailable or _native_unavailable)(environ)
        if why is not None:
            return False, (f"the CPU is {arch}: {NATIVE_ONLY} (the Python one relies on x86's store ordering), "
                           f"and it cannot run here: {why}")
        path = " (native data path)"
    try:
        need = reservation_bytes(local_world_size, environ)
    except ValueError as exc:
        return False, str(exc)
    free = (free_bytes or available_memory)()
    if free is not None and free < need:
        return False, (f"{format_size(free)} of memory is available, and {local_world_size} local ranks need "
                       f"{format_size(need)} for the segment (lower {SLOT_VAR}, or give the job more memory)")
    room = "unknown memory" if free is None else f"{format_size(free)} of memory available"
    return True, f"{local_world_size} local ranks on {arch}{path}, {room} (needs {format_size(need)})"


def native_fix(environ: Mapping[str, str], arch: str) -> str:
    """What lets shm run on ``arch`` (not x86) where this rank would take the Python data path."""
    from cpuddp.errors import BackendError

    from .. import native

    try:
        off = native.setting(environ) is False
    except BackendError as exc:
        return exc.fix or f"unset {native.VAR}"
    if off:
        return f"unset {native.VAR} (on {arch} shm runs on the native data path, where its library loads)"
    return ("build the native library: pip install cpuddp again where a C compiler is, or 'python -m "
            f"cpuddp.backends.shm.native.build', or install cpuddp's {arch} wheel")


def _native_unavailable(environ: Mapping[str, str]) -> Optional[str]:
    """Why this rank would not take the native data path (None: it would); loads the library
    once (ctypes, no torch)."""
    from .. import native

    return native.unavailable(environ)


def probe(lookups: object) -> Tuple[bool, str]:
    """The registry's check (:class:`cpuddp.backends.BackendSpec`), for a node of 2 ranks.

    The node's real rank count is known only at init; ``backend="auto"`` calls
    :func:`eligibility` with it.
    """
    environ = getattr(lookups, "environ", None) or os.environ
    ok, reason = eligibility(2, {k: v for k, v in environ.items() if k != OPT_OUT_VAR})
    if not ok:
        return False, reason
    arch = platform.machine() or "unknown"
    if arch.lower() in X86_MACHINES:
        return True, "x86 CPU and memory for the segment"
    return True, f"{arch} CPU with the native data path, and memory for the segment"
