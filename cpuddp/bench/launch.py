"""``cpuddp bench --nproc N``: start N local ranks (``python -m cpuddp bench ...``), watch them, stop them.

The ranks are started by :class:`cpuddp._procs.LocalWorld`, the launcher ``cpuddp.testing``
uses too: this process hosts the rendezvous store on a socket it binds itself (no port is
chosen by bind-then-release), each rank's environment is this one minus every launcher's
variables plus the rank's (and :data:`CHILD_MARK`).  When a rank fails the others get
``grace`` seconds, then are stopped; all are stopped after ``timeout``.  Before stopping a
rank that is still running, its Python stack is printed on stderr, naming the rank -- so a
hang says where it hangs.
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional, Sequence

from cpuddp import _procs

from .sweep import EXIT_ERROR

__all__ = ["CHILD_MARK", "spawn"]

#: Marks a rank started by ``--nproc`` (internal).
CHILD_MARK = "CPUDDP_BENCH_CHILD"

_NO_STACK = "(no Python stack: the rank had not reached Python code yet, or did not answer SIGUSR1)"


def spawn(nproc: int, argv: Sequence[str], *, timeout: float, environ: Optional[Mapping[str, str]] = None,
          grace: float = 10.0, program: Optional[Sequence[str]] = None) -> int:
    """Run ``python -m cpuddp <argv>`` (or ``program + argv``) as ``nproc`` local ranks.

    Returns rank 0's exit code, or 1 when any rank failed while rank 0 succeeded, or was
    stopped.  Rank 0's output goes to this stdout; every rank's stderr to this stderr.
    """
    cmd = [*(program or (sys.executable, "-m", "cpuddp")), *argv]
    with _procs.LocalWorld(nproc, timeout, environ, extra={CHILD_MARK: "1"}) as world:
        try:  # the world stops every rank on the way out, also on KeyboardInterrupt
            for r in range(nproc):
                _procs.start_command(world, r, cmd, quiet=r != 0)
            exits = _procs.wait_exit_codes(world.procs, timeout, grace)
            if exits.timed_out or exits.gave_up:
                _report_stuck(world, exits, timeout)
                return EXIT_ERROR
        finally:
            world.stop()
    codes = [c if c is not None else -1 for c in exits.codes]
    if codes[0] == 0 and any(codes):
        return EXIT_ERROR
    if codes[0] < 0:  # killed by a signal
        return EXIT_ERROR
    return codes[0]


def _report_stuck(world: _procs.LocalWorld, exits: _procs.Exits, timeout: float) -> None:
    """Say why the run ends early, with the Python stack of every rank still running."""
    if exits.gave_up and exits.first_failure is not None:
        why = f"rank {exits.first_failure[0]} exited with code {exits.first_failure[1]}"
    else:
        why = f"timed out after {timeout:g} s (--timeout)"
    sys.stderr.write(f"# cpuddp bench: {why}; killing the remaining ranks\n")
    live = [r for r, c in enumerate(exits.codes) if c is None]
    stacks = world.dump_stacks(live)
    for r in live:
        sys.stderr.write(f"# cpuddp bench: rank {r} (pid {world.procs[r].pid}) was still running; "
                         f"its Python stack:\n{stacks[r] or _NO_STACK}\n")
    sys.stderr.flush()
