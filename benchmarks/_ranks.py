"""Start a benchmark's local ranks with cpuddp's own launcher (:class:`cpuddp._procs.LocalWorld`).

The ranks meet at a store this process hosts on a port it holds (no bind-then-release race),
and a rank still running at the deadline has its Python stack printed before it is stopped
(a rank's main calls :func:`cpuddp._procs.rank_setup` first to answer).
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional, Sequence


def run_ranks(cmd: Sequence[str], nproc: int, timeout: float, *, environ: Optional[Mapping[str, str]] = None,
              extra: Optional[Mapping[str, str]] = None, quiet: bool = True) -> list[int]:
    """Run ``cmd`` as ``nproc`` local ranks; their exit codes (-1: stopped at ``timeout``).
    ``quiet``: drop the stdout of every rank but 0 (stderr always shows)."""
    from cpuddp import _procs

    with _procs.LocalWorld(nproc, timeout, environ, extra=extra or {}) as world:
        for r in range(nproc):
            _procs.start_command(world, r, cmd, quiet=quiet and r != 0)
        exits = _procs.wait_exit_codes(world.procs, timeout, grace=10.0)
        live = [r for r, c in enumerate(exits.codes) if c is None]
        for r, stack in world.dump_stacks(live).items():
            sys.stderr.write(f"# rank {r} was still running after {timeout:g} s; its Python stack:\n"
                             f"{stack or '(none: it had not reached Python code)'}\n")
        world.stop()
    return [c if c is not None else -1 for c in exits.codes]
