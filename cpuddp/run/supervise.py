"""``cpuddp run``'s last part: start the launcher, wait for it, and end the output with why it failed.

:func:`launch_and_report` makes a private report directory (``tempfile.mkdtemp``: mode 0700,
owned by the user, a name nobody can guess -- the node is shared), passes it to every rank
in :data:`cpuddp.launchers.report.REPORT_DIR_ENV`, starts the launcher as its child and waits.  When the
launcher exits non-zero, the last lines ``cpuddp run`` prints are the first failing rank's
message and its ``Fix:``, once (:func:`cpuddp.launchers.report.ending`); after Ctrl-C, one line saying
where the same command resumes.  The exit code is the launcher's (128 + the signal for one
ended by a signal).

The launcher is started by ``fork`` + ``exec`` so that it still is the process its ranks are
tied to (:func:`cpuddp.run.rank.end_with_launcher`: ``CPUDDP_LAUNCHER_PID`` is the launcher's
own pid), and it dies with ``cpuddp run`` (the kernel's parent-death signal): ``kill -9`` of
``cpuddp run`` still ends every rank.  Signals: Ctrl-C reaches the launcher and the ranks from
the terminal (they are in ``cpuddp run``'s process group), so ``cpuddp run`` only notes it and
waits; SIGTERM and SIGHUP it forwards to the launcher, which ends its ranks.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Mapping, Sequence

from cpuddp._procs import die_with_parent
from cpuddp.launchers.report import REPORT_DIR_ENV, ending, write_whole

from .rank import launcher_env

__all__ = ["launch_and_report", "FORWARDED"]

#: Signals ``cpuddp run`` passes on to the launcher (SIGINT comes to it from the terminal).
FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def launch_and_report(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``argv`` with ``env`` (see the module doc); its exit code."""
    directory = tempfile.mkdtemp(prefix="cpuddp-run-")
    try:
        pid = _spawn(argv, {**env, REPORT_DIR_ENV: directory})
        code, interrupted = _wait(pid)
        last = ending(directory, code, interrupted)
        if last:
            sys.stdout.flush()
            write_whole(last + "\n", sys.stderr)
        return code
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _spawn(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """The launcher, started as a child that keeps its pid through ``exec`` and dies with us."""
    import ctypes  # noqa: F401 -- loaded here, not in the forked child (die_with_parent uses it)

    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: only exec (or say why not)
        try:
            die_with_parent(parent)
            os.execvpe(argv[0], list(argv), {**env, **launcher_env()})
        except BaseException as exc:
            os.write(2, f"cpuddp run: cannot start {argv[0]}: {exc}\n".encode())
        os._exit(127)
    return pid


def _wait(pid: int) -> tuple[int, bool]:
    """Wait for the launcher: (its exit code, whether the job was interrupted meanwhile)."""
    seen: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        seen.append(signum)
        if signum in FORWARDED:
            try:
                os.kill(pid, signum)
            except OSError:
                pass

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, *FORWARDED)}
    try:
        _, status = os.waitpid(pid, 0)  # retried after each handler (PEP 475)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    code = os.waitstatus_to_exitcode(status)
    return (128 - code if code < 0 else code), bool(seen)
