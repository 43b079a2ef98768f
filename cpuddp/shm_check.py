"""Can the shared-memory backend (:mod:`cpuddp.shm`) run here, and how much memory it reserves.

Pure and light (no torch import): :mod:`cpuddp.backends` and ``cpuddp doctor`` call it.

:func:`eligibility` ``(local_world_size, environ) -> (ok, reason)`` is what ``backend="auto"``
asks.  It says no, with the reason, when

* ``CPUDDP_SHM=0`` (the user opted out);
* the node runs fewer than 2 ranks (nothing to share);
* the CPU is not x86 (the data path relies on x86's total store order: a peer that sees a
  rank's arrival counter also sees the data stored before it; arm64 and POWER would need
  fences that Python cannot issue);
* the shared-memory directory (``CPUDDP_SHM_DIR``, default ``/dev/shm``) is missing, or has
  less free space than the segment needs (:func:`reservation_bytes`; Docker's default
  ``/dev/shm`` is 64 MiB: ``docker run --shm-size=...``).

Environment variables read: ``CPUDDP_SHM`` (``0`` opts out of auto), ``CPUDDP_SHM_DIR``,
``CPUDDP_SHM_SLOT`` (bytes per rank and buffer, default 1M; K/M/G suffixes as in
``cpuddp bench``).
"""

from __future__ import annotations

import os
import platform
from typing import Callable, Mapping, Optional, Tuple

__all__ = [
    "NAME",
    "DIR_VAR",
    "SLOT_VAR",
    "OPT_OUT_VAR",
    "DEFAULT_DIR",
    "DEFAULT_SLOT",
    "X86_MACHINES",
    "eligibility",
    "reservation_bytes",
    "slot_bytes",
    "shm_dir",
    "layout",
    "probe",
]

#: The backend's name for ``init_process_group`` and ``init_distributed(backend=...)``.
NAME = "shm"
DIR_VAR = "CPUDDP_SHM_DIR"
SLOT_VAR = "CPUDDP_SHM_SLOT"
OPT_OUT_VAR = "CPUDDP_SHM"
DEFAULT_DIR = "/dev/shm"
#: 1 MiB per rank and buffer: measured 25-35% faster than 4 or 64 MiB (the slots stay in L3).
DEFAULT_SLOT = 1 << 20
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})

PAGE = 4096
#: One arrival counter per rank, each on its own 128-byte line (adjacent-line prefetch pairs 64 B lines).
COUNTER_STRIDE = 128
HEADER_BYTES = PAGE


def slot_bytes(environ: Mapping[str, str]) -> int:
    """``CPUDDP_SHM_SLOT`` in bytes (a multiple of 4096, at least 4096), or the default."""
    raw = environ.get(SLOT_VAR)
    if raw is None or not raw.strip():
        return DEFAULT_SLOT
    from ._units import parse_size  # pure, no torch

    try:
        value = parse_size(raw)
    except ValueError:
        value = 0
    if value < PAGE or value % PAGE:
        raise ValueError(
            f"{SLOT_VAR}={raw!r} is not a size in bytes that is a multiple of 4096 (4K); "
            f"unset it for the default 1M, or set e.g. {SLOT_VAR}=4M"
        )
    return value


def shm_dir(environ: Mapping[str, str]) -> str:
    """Where the segment file is made: ``CPUDDP_SHM_DIR`` or ``/dev/shm``."""
    return environ.get(DIR_VAR) or DEFAULT_DIR


def layout(local_world_size: int, slot: int) -> Tuple[int, int, int]:
    """``(counters_offset, slots_offset, total_bytes)`` of one node's segment (pure).

    A header page, one counter line per rank, then two buffers (parities) of one slot per rank.
    """
    counters = HEADER_BYTES
    slots = counters + _round_up(COUNTER_STRIDE * local_world_size, PAGE)
    return counters, slots, slots + 2 * local_world_size * slot


def reservation_bytes(local_world_size: int, environ: Mapping[str, str]) -> int:
    """Bytes one node's segment reserves in the shared-memory directory."""
    return layout(local_world_size, slot_bytes(environ))[2]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _free_bytes(path: str) -> Optional[int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def eligibility(
    local_world_size: int,
    environ: Mapping[str, str],
    *,
    machine: Optional[str] = None,
    free_bytes: Optional[Callable[[str], Optional[int]]] = None,
    node_cpus: Optional[int] = None,
) -> Tuple[bool, str]:
    """Should ``backend="auto"`` use the shared-memory backend on this node?  ``(ok, reason)``.

    ``node_cpus``: the CPUs the node's ranks may use together (the union of their allowed
    sets, as gathered at init); more ranks than that is a no -- every waiting rank would sit
    on a CPU a peer needs (measured: 0.06x gloo at 4 MiB with 4 ranks on 2 CPUs).
    ``machine`` (``platform.machine()``) and ``free_bytes(dir)`` (free bytes, or None when the
    directory is missing) replace the real probes in tests.
    """
    from ._units import format_size

    opt = (environ.get(OPT_OUT_VAR) or "").strip().lower()
    if opt in ("0", "false", "no", "off"):
        return False, f"{OPT_OUT_VAR}={environ.get(OPT_OUT_VAR)} opts out of the shared-memory backend"
    if local_world_size < 2:
        return False, f"this node runs {local_world_size} rank(s): shared memory needs 2 or more"
    if node_cpus is not None and local_world_size > node_cpus:
        return False, (f"{local_world_size} local ranks share {node_cpus} CPU(s): shared-memory waits "
                       f"would take CPUs their peers need (gloo's sockets sleep instead)")
    arch = (machine if machine is not None else platform.machine()) or "unknown"
    if arch.lower() not in X86_MACHINES:
        return False, (f"the CPU is {arch}, not x86: the shared-memory backend relies on x86's store "
                       f"ordering and is not proven on {arch}")
    try:
        need = reservation_bytes(local_world_size, environ)
    except ValueError as exc:
        return False, str(exc)
    where = shm_dir(environ)
    free = (free_bytes or _free_bytes)(where)
    if free is None:
        return False, f"the shared-memory directory {where} does not exist (set {DIR_VAR} to a tmpfs)"
    if free < need:
        return False, (f"{where} has {format_size(free)} free, and {local_world_size} local ranks need "
                       f"{format_size(need)} (in Docker: --shm-size)")
    return True, (f"{local_world_size} local ranks on {arch}, {where} has {format_size(free)} free "
                  f"(needs {format_size(need)})")


def probe(lookups: object) -> Tuple[bool, str]:
    """The registry's check (:class:`cpuddp.backends.BackendSpec`), for a node of 2 ranks.

    The node's real rank count is known only at init; ``backend="auto"`` calls
    :func:`eligibility` with it.
    """
    environ = getattr(lookups, "environ", None) or os.environ
    ok, reason = eligibility(2, {k: v for k, v in environ.items() if k != OPT_OUT_VAR})
    if ok:
        return True, "x86 CPU and room in " + shm_dir(environ) + " (pure Python over torch ops; cpuddp.shm)"
    return False, reason
