"""One rank of ``cpuddp run`` on one node: pin to the planned CPUs, then run the script.

``python -m cpuddp.run.rank script.py [args]``, started by torch's elastic agent (torchrun)
for each local rank.  Before the script -- and so before torch and its OpenMP runtime load,
which read the affinity mask and ``OMP_NUM_THREADS`` once -- it sets this process's affinity
to entry ``LOCAL_RANK`` of ``CPUDDP_RANK_CPUS`` and ``OMP_NUM_THREADS`` to entry
``LOCAL_RANK`` of ``CPUDDP_RANK_THREADS`` (replacing torchrun's own ``1``).  Then the script
runs as ``__main__`` with ``sys.argv = [script, *args]``, as ``python script.py`` would run it.
Without those variables it only runs the script.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Mapping, MutableMapping, Optional, Sequence

from cpuddp.topology.model import format_cpulist, parse_cpulist

__all__ = ["rank_entry", "main"]


def rank_entry(environ: Mapping[str, str], var: str) -> Optional[str]:
    """This local rank's entry of ``var`` (``;``-separated, local rank order), or None.

    Raises ValueError naming the variables when the list does not match ``LOCAL_WORLD_SIZE``."""
    raw = environ.get(var, "").strip()
    if not raw:
        return None
    parts = raw.split(";")
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    world = int(environ.get("LOCAL_WORLD_SIZE", str(len(parts))))
    if len(parts) != world or not 0 <= local_rank < world:
        raise ValueError(f"{var}={raw!r} has {len(parts)} entries but LOCAL_WORLD_SIZE={world}, LOCAL_RANK={local_rank}: "
                         f"start the job with `cpuddp run`, or unset {var}")
    return parts[local_rank]


def pin_from_plan(environ: MutableMapping[str, str]) -> Optional[str]:
    """Apply ``CPUDDP_RANK_CPUS``/``CPUDDP_RANK_THREADS`` to this process; a line for the log."""
    cpus = rank_entry(environ, "CPUDDP_RANK_CPUS")
    threads = rank_entry(environ, "CPUDDP_RANK_THREADS")
    if threads:
        environ["OMP_NUM_THREADS"] = threads
    if cpus is None:
        return None
    mask = parse_cpulist(cpus)
    try:
        os.sched_setaffinity(0, mask)
    except (OSError, AttributeError) as exc:
        return f"could not pin to CPUs {format_cpulist(mask)} ({exc}); init_distributed() will try again"
    return None


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m cpuddp.run.rank script.py [args]")
    problem = pin_from_plan(os.environ)
    if problem:
        sys.stderr.write(f"cpuddp run: {problem}\n")
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
