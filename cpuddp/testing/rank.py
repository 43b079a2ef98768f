"""The rank side of :func:`cpuddp.testing.run_distributed`: what each spawned process runs
(:func:`rank_main`), how it reports back to the parent, and how it exits."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
import traceback as _tb
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from cpuddp import _procs

from .ship import ModuleRef, RankFinder

__all__ = ["Report", "rank_main", "trim_stack"]


class Report(NamedTuple):
    """A rank's failure, as it sends it to the parent."""

    stage: str  # "load" (unpickling fn), "init" (joining the group), "run" (fn), "report" (pickling the result)
    summary: str  # the exception's first line: "ValueError: boom"
    traceback: str
    when: float  # time.monotonic() in the rank: system-wide, so comparable across ranks


def _send(conn: Connection, message: Any) -> None:
    # Plain pickle, by value: the default ForkingPickler would move tensors through shared
    # memory handed over by this process, which is gone by the time the parent reads them.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def rank_main(
    conn: Connection, rank_env: dict[str, str], payload: bytes, refs: dict[str, ModuleRef],
    backend: str, timeout: float, pin: bool, threads: int,
) -> None:
    os.environ.clear()
    os.environ.update(rank_env)
    _procs.rank_setup()  # die with the parent; Python stacks on SIGUSR1 and on a crash
    stage = "load"
    try:
        if refs:
            sys.meta_path.insert(0, RankFinder(refs, fallback=False))
            sys.meta_path.append(RankFinder(refs, fallback=True))
        fn, args, kwargs = pickle.loads(payload)
        stage = "init"
        import torch

        if not pin:
            torch.set_num_threads(threads)
        from cpuddp.distributed import init_distributed, shutdown

        init_distributed(backend, timeout=timeout, pin=pin)
        stage = "run"
        result = fn(*args, **kwargs)
        stage = "report"
        _send(conn, ("ok", result))
    except BaseException as exc:
        summary = "".join(_tb.format_exception_only(type(exc), exc)).strip().splitlines()
        tb = exc.__traceback__
        if stage == "run" and tb is not None and tb.tb_next is not None:
            tb = tb.tb_next  # start the traceback at fn, not at this harness
        text = "".join(_tb.format_exception(type(exc), exc, tb))
        with contextlib.suppress(Exception):
            _send(conn, ("error", Report(stage, summary[0] if summary else type(exc).__name__, text, time.monotonic())))
        _exit_now(1, cleanly=False)  # no teardown: the group may be broken, and a hung teardown helps nobody
    conn.close()
    shutdown()
    _exit_now(0, cleanly=True)


def _exit_now(code: int, *, cleanly: bool) -> None:
    """Exit without the interpreter's finalization (tearing torch down takes seconds on a
    loaded machine, and has hung), after the atexit handlers when ``cleanly`` (coverage
    data, logging), and after stopping any process fn started and left running."""
    if cleanly:
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        import psutil

        kids = psutil.Process().children(recursive=True)
        for k in kids:
            with contextlib.suppress(psutil.Error):
                k.terminate()
        _, left = psutil.wait_procs(kids, timeout=_procs.KILL_AFTER)
        for k in left:
            with contextlib.suppress(psutil.Error):
                k.kill()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def trim_stack(text: str) -> str:
    """Drop the frames below fn (this harness, multiprocessing's bootstrap) from a faulthandler dump."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith("  File ") and line.endswith(" in rank_main") and __file__ in line:
            skipping = True
        elif not line.startswith("  File "):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out).strip()
