"""Where each rank of the job runs -- its host, CPUs and threads -- as one line for rank 0 to print.

:func:`gather_places` asks every rank (one collective; :func:`cpuddp.prepare` calls it when it
wraps a model in DDP, so a training script gets it without a call of its own) and keeps the
answer; :func:`places_line` gives the line :class:`cpuddp.Progress` prints as its header and
the example prints in its summary, e.g. ``2 rank(s): rank 0 CPU 0 (1 thread), rank 1 CPU 1
(1 thread)``.  Without a gathered answer it shows this process alone, and says so when there
are other ranks.  A rank's CPUs are its affinity mask as the kernel has it (after pinning),
its threads torch's intra-op threads (``OMP_NUM_THREADS`` before torch is imported).  This
module imports torch only inside :func:`gather_places`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from cpuddp.affinity.job import RankPlace, rank_cpus_line
from cpuddp.ranks import get_rank, get_world_size
from cpuddp.topology import here

__all__ = ["local_place", "gather_places", "known_places", "places_line"]

_known: Optional[list[RankPlace]] = None


def _threads() -> int:
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    raw = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else len(_cpus())


def _cpus() -> tuple[int, ...]:
    return here.allowed_cpus() or tuple(range(os.cpu_count() or 1))


def local_place(rank: Optional[int] = None) -> RankPlace:
    """This process: its rank, host, CPUs and threads."""
    return RankPlace(get_rank() if rank is None else rank, here.hostname(), _cpus(), _threads())


def gather_places(group: Any = None) -> list[RankPlace]:
    """Every rank's place, in rank order (a collective: every rank of ``group`` calls it)."""
    global _known
    import json

    from .rank0 import all_gather_bytes

    mine = local_place()
    blob = json.dumps([mine.rank, mine.host, list(mine.cpus), mine.threads]).encode()
    places = [RankPlace(r, h, tuple(c), t) for r, h, c, t in (json.loads(b) for b in all_gather_bytes(blob, group))]
    _known = places
    return places


def known_places() -> Optional[list[RankPlace]]:
    """What :func:`gather_places` last gathered in this process (None: nothing yet)."""
    return list(_known) if _known is not None else None


def places_line() -> str:
    """``N rank(s): rank 0 CPUs ... (T threads), ...``: the gathered places, else this process's."""
    places = known_places()
    world = get_world_size()
    if places is not None and len(places) == world:
        return f"{world} rank(s): {rank_cpus_line(places)}"
    mine = rank_cpus_line([local_place()])
    if world == 1:
        return f"1 rank: {mine}"
    return f"{world} rank(s): {mine}; the others not gathered (cpuddp.prepare gathers them)"
