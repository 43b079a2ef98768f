"""torchrun as ``cpuddp run`` starts it: ``python -m cpuddp.run.agent [torchrun's arguments]``.

torch's elastic agent (``torch.distributed.run``) itself, with one difference: under ``cpuddp
run`` (its report directory set, :data:`cpuddp.launchers.report.REPORT_DIR_ENV`) a failed job ends without
torchrun's traceback and ``ChildFailedError`` banner, and a Ctrl-C without the agent's
``SignalException`` traceback -- ``cpuddp run`` then ends the output with the root cause and its
fix, or with where the interrupted run resumes (:func:`cpuddp.launchers.report.ending`).  Pasted without
``cpuddp run`` it is plain torchrun, banner included.  Exit codes: torchrun's; 1 for a failed
job; 128 + the signal for one ended by a signal.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from cpuddp.launchers.report import ERROR_FILE_ENV, REPORT_DIR_ENV

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    quiet = bool(os.environ.get(REPORT_DIR_ENV))
    if quiet:  # where torchrun's @record copies the root cause's error file (else it logs that it cannot)
        os.environ.setdefault(ERROR_FILE_ENV, os.path.join(os.environ[REPORT_DIR_ENV], "agent.error"))
    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError:
        if not quiet:
            raise
        sys.exit(1)
    except SignalException as exc:
        if not quiet:
            raise
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
