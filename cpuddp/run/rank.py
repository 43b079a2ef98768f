"""One rank of ``cpuddp run``: end with the launcher, pin to the planned CPUs, then run the script.

``python -m cpuddp.run.rank script.py [args]``, what every engine of ``cpuddp run`` starts as
each rank (torchrun's agent, srun, the MPI launcher).

First it ties the rank to the launcher (:func:`end_with_launcher`): ``cpuddp run`` exports its
own pid (``CPUDDP_LAUNCHER_PID``; it then becomes the launcher by ``exec``, keeping the pid)
and its host (``CPUDDP_LAUNCHER_HOST``, :func:`cpuddp.topology.here.host_identity` with the PID
namespace).  A rank on that host whose parent is the launcher (torchrun's agent, Open MPI's
``mpirun`` on its own node) has the kernel kill it when the parent dies (``PR_SET_PDEATHSIG``);
one whose parent is a launcher's helper (``slurmstepd``, ``hydra_pmi_proxy``) watches the
launcher's pid from a thread (``pidfd_open``, else a poll every :data:`POLL` s) and ends
itself when it is gone.  ``kill -9`` of ``cpuddp run`` used to leave torchrun's and Open MPI's
ranks training to the end.  Ranks on other hosts are ended by the launcher's remote agents,
or fail when their peers are gone (docs/run.md).

Then, before the script -- and so before torch and its OpenMP runtime load,
which read the affinity mask and ``OMP_NUM_THREADS`` once -- it sets this process's affinity
to entry ``LOCAL_RANK`` of ``CPUDDP_RANK_CPUS`` and ``OMP_NUM_THREADS`` to entry
``LOCAL_RANK`` of ``CPUDDP_RANK_THREADS`` (replacing torchrun's own ``1``).  Then the script
runs as ``__main__`` with ``sys.argv = [script, *args]``, as ``python script.py`` would run it.
Without those variables it only runs the script.

A failure is reported (:mod:`cpuddp.launchers.report`) before anything else runs -- before
the watchdog's hook marks it and aborts the local peers -- so the rank that failed first has
the earliest report; the traceback is then printed whole (one write).  Under ``cpuddp run`` (its report
directory set), Ctrl-C ends the rank quietly with exit code 130, and so does whatever the
interruption makes the rank raise next (a collective whose peer left): ``cpuddp run`` says
"interrupted" once, instead of a traceback per rank.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
from typing import Mapping, MutableMapping, Optional, Sequence

from cpuddp._procs import die_with_parent, ignore_numpy_warning
from cpuddp.errors import LauncherEnvError
from cpuddp.launchers import report
from cpuddp.topology import here
from cpuddp.topology.model import format_cpulist, parse_cpulist

__all__ = ["rank_entry", "main", "launcher_env", "end_with_launcher", "LAUNCHER_PID_ENV", "LAUNCHER_HOST_ENV"]

#: The pid of the ``cpuddp run`` that started this rank (the launcher, after its ``exec``).
LAUNCHER_PID_ENV = "CPUDDP_LAUNCHER_PID"
#: The launcher's host: :func:`cpuddp.topology.here.host_identity` with the PID namespace.
LAUNCHER_HOST_ENV = "CPUDDP_LAUNCHER_HOST"
#: Seconds between two looks at the launcher where ``os.pidfd_open`` is missing.
POLL = 0.5
#: The exit code of a rank ended by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 128 + signal.SIGINT

_interrupted = threading.Event()  # this rank got SIGINT


def launcher_env() -> dict[str, str]:
    """The variables ``cpuddp run`` exports to its ranks just before it becomes the launcher."""
    return {LAUNCHER_PID_ENV: str(os.getpid()), LAUNCHER_HOST_ENV: here.host_identity(("pid",))}


def end_with_launcher(environ: MutableMapping[str, str]) -> Optional[str]:
    """End this rank when the launcher of :data:`LAUNCHER_PID_ENV` dies (see the module doc);
    how: ``"parent"`` (the kernel's parent-death signal), ``"watch"`` (a thread), or None (no
    launcher named, or one on another host or PID namespace).  Takes both variables out of
    ``environ``: a process the rank starts is not a rank."""
    raw = environ.pop(LAUNCHER_PID_ENV, "").strip()
    host = environ.pop(LAUNCHER_HOST_ENV, "")
    if not raw or host != here.host_identity(("pid",)):
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise LauncherEnvError(f"{LAUNCHER_PID_ENV} is not a process id", variable=LAUNCHER_PID_ENV, value=raw,
                               launcher="cpuddp run", fix=f"start the job with `cpuddp run`, or unset {LAUNCHER_PID_ENV}")
    pid = int(raw)
    if os.getppid() == pid and die_with_parent(pid):
        return "parent"
    threading.Thread(target=_watch, args=(pid,), name="cpuddp-launcher-watch", daemon=True).start()
    return "watch"


def _watch(pid: int) -> None:
    """Block until process ``pid`` is gone, then kill this one (as the kernel's signal would)."""
    try:
        import select

        fd = os.pidfd_open(pid)  # readable once the process has exited
        select.select([fd], [], [])
    except (AttributeError, OSError):  # no pidfd here (or the pid is gone already: then no wait)
        import time

        while here.pid_alive(pid):
            time.sleep(POLL)
    try:
        sys.stderr.write(f"cpuddp run: the launcher (pid {pid}) is gone; ending this rank (pid {os.getpid()})\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


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
    end_with_launcher(os.environ)
    problem = pin_from_plan(os.environ)
    if problem:
        sys.stderr.write(f"cpuddp run: {problem}\n")
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    report.install()
    ignore_numpy_warning()  # torchrun's process, which started this one, has said it
    run_script(script, quiet_interrupt=report.report_dir() is not None)


def _on_sigint(signum: int, frame: object) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def run_script(script: str, *, quiet_interrupt: bool) -> None:
    """Run ``script`` as ``__main__``.  An exception is reported first, then raised on (Python's
    hooks print it); with ``quiet_interrupt``, Ctrl-C -- and what it makes the script raise
    afterwards -- ends the rank with :data:`INTERRUPTED` and no traceback."""
    if quiet_interrupt and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt) or _interrupted.is_set()
        report.record_failure(type(exc), exc, kind="interrupted" if interrupted else "error")
        if interrupted and quiet_interrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher passes Ctrl-C on too: no traceback at exit
            sys.exit(INTERRUPTED)
        raise


if __name__ == "__main__":
    main()
