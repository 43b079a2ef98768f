"""A rank's error report: written whole, and where its launcher's parent can find it.

A rank that fails writes its report to up to three places:

* **its stderr, in one write** (:func:`print_whole`): the traceback and the message, so two
  ranks failing at once never interleave character by character.  It is the innermost
  ``sys.excepthook`` (torch's ``[rankN]:`` prefixer and cpuddp's watchdog wrap it).
* **torchrun's error file** (``TORCHELASTIC_ERROR_FILE``, which torch's elastic agent sets for
  each worker and reads when the worker fails): the message and its ``Fix:`` line then appear
  in torchrun's own failure summary (``traceback :``), and torchrun's "Root Cause" is the rank
  whose error came first (it orders by these timestamps, to the second; a failure that looks
  like a communication failure -- a consequence of a peer's -- is stamped one second later, so
  the peer's own error of the same second comes first).
* **``cpuddp run``'s report directory** (:data:`REPORT_DIR_ENV`: a private directory ``cpuddp
  run`` makes, mode 0700, owned by the user): ``rank<R>.<pid>.json``, which ``cpuddp run`` reads
  when the launcher exits non-zero and ends its output with the first failure's message
  (:func:`ending`).  ``save_checkpoint``/``load_checkpoint`` leave the step of the last
  checkpoint there too (:func:`note_checkpoint`), for the line that ends an interrupted run.

The report is recorded first thing -- before the watchdog marks the failure in the store and
aborts the local peers -- so the rank that failed first has the earliest time
(:func:`record_failure`, called by :mod:`cpuddp.run.rank` and by the watchdog's hook; once per
exception).  Light: no torch; every write is best-effort and never raises.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Mapping, Optional

from .mpi import abort_at_exit

__all__ = ["REPORT_DIR_ENV", "ERROR_FILE_ENV", "install", "print_whole", "write_whole", "record_failure",
           "note_checkpoint", "read_reports", "ending", "report_dir"]

#: Seconds a rank that raised lingers before ``MPI_Abort`` ends the job (MPI jobs only).
ABORT_LINGER = 1.5
#: The private directory ``cpuddp run`` makes for its ranks' reports.
REPORT_DIR_ENV = "CPUDDP_REPORT_DIR"
#: torch's elastic agent: where each worker may write its error (JSON), read by the agent.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: A report's message is cut to this many characters.
MAX_TEXT = 8000


# --------------------------------------------------------------------------- stderr, whole


def write_whole(text: str, stream: Any = None) -> None:
    """``text`` to ``stream`` (default ``sys.stderr``) as one write: one ``os.write`` on the
    stream's file descriptor (more only if the kernel takes part of it), after flushing what
    the stream holds.  A stream without a descriptor (a ``StringIO``: torch's prefixer) gets
    one ``write`` call."""
    stream = sys.stderr if stream is None else stream
    if stream is None:
        return
    try:
        stream.flush()
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            pass
        return
    data = text.encode(getattr(stream, "encoding", None) or "utf-8", "backslashreplace")
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


def print_whole(exc_type: type, exc: BaseException, tb: Any) -> None:
    """What ``sys.__excepthook__`` prints, as one write (:func:`write_whole`)."""
    import traceback

    write_whole("".join(traceback.format_exception(exc_type, exc, tb)))


def install() -> None:
    """Record uncaught exceptions (:func:`record_failure`) and print them whole
    (:func:`print_whole`): the base of ``sys.excepthook`` where Python's own is there; an
    excepthook someone else set is wrapped, so it still runs.  Where MPI was started, the process
    then ends with ``MPI_Abort`` (:func:`cpuddp.launchers.mpi.abort_at_exit`), as ``python -m
    mpi4py`` does.  Idempotent."""
    current = sys.excepthook
    if getattr(current, "_cpuddp_report", False):
        return
    printer = print_whole if current is sys.__excepthook__ else current

    def hook(exc_type: type, exc: BaseException, tb: Any) -> None:
        record_failure(exc_type, exc)
        printer(exc_type, exc, tb)
        # where MPI started: end with MPI_Abort, not in an MPI_Finalize that waits for peers -- after a
        # moment in which the other ranks' waits can see this rank's error and say so
        abort_at_exit(1, linger=ABORT_LINGER)

    hook._cpuddp_report = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# --------------------------------------------------------------------------- the records


def report_dir(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The report directory of :data:`REPORT_DIR_ENV` when it is a directory owned by this user
    that nobody else may write to (no symlink), else None: on a shared node a rank writes its
    report only where ``cpuddp run`` made it."""
    path = environ.get(REPORT_DIR_ENV, "")
    if not path:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def _rank(environ: Mapping[str, str]) -> Optional[int]:
    """This process's global rank as its launcher's variables give it (the launchers' own
    readers: :func:`cpuddp.launchers.registry.detect`); None where they do not add up."""
    from .registry import detect

    try:
        return detect(environ).rank
    except Exception:
        return None


def _message(exc_type: type, exc: Optional[BaseException]) -> str:
    text = f"{exc_type.__name__}: {exc}".rstrip() if exc is not None and str(exc) else exc_type.__name__
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def _write_json(path: str, data: dict[str, Any]) -> None:
    """``data`` to ``path`` atomically (a reader sees all of it or nothing), mode 0600."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


def _torchelastic_record(path: str, rank: Optional[int], message: str, when: float, secondary: bool) -> None:
    """torchrun's error file: its ``traceback :`` field shows ``py_callstack`` -- here the
    message and its fix (the rank printed the traceback itself)."""
    stamp = int(when) + (1 if secondary else 0)  # torchrun orders to the second (module doc)
    who = f"rank {rank}" if rank is not None else "this rank"
    data = {"message": {"message": message, "extraInfo": {"py_callstack": f"{who} (pid {os.getpid()}): {message}",
                                                         "timestamp": str(stamp)}}}
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(data))
    except OSError:
        pass


def record_failure(exc_type: type, exc: Optional[BaseException], environ: Mapping[str, str] = os.environ,
                   *, kind: str = "error", secondary: bool = False) -> None:
    """Record this rank's failure (``kind`` ``"error"``) or interruption (``"interrupted"``) in
    torchrun's error file and ``cpuddp run``'s report directory, where they are set; once per
    exception, never raises.  ``secondary``: the failure looks like a peer's consequence (the
    watchdog's judgement: a collective or the store broke)."""
    if exc is not None:
        if getattr(exc, "_cpuddp_reported", False):
            return
        try:
            exc._cpuddp_reported = True  # type: ignore[union-attr]
        except AttributeError:  # an exception type without a __dict__: recorded again, harmless
            pass
    try:
        when = time.time()
        rank = _rank(environ)
        message = _message(exc_type, exc)
        error_file = environ.get(ERROR_FILE_ENV, "")
        if error_file and kind == "error":
            _torchelastic_record(error_file, rank, message, when, secondary)
        where = report_dir(environ)
        if where is not None:
            attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            _write_json(os.path.join(where, f"rank{rank if rank is not None else 'x'}.{os.getpid()}.json"),
                        {"kind": kind, "rank": rank, "pid": os.getpid(), "host": _host(), "time": when,
                         "attempt": int(attempt) if attempt.isdigit() else 0, "message": message})
    except Exception:
        pass


def note_checkpoint(step: int, path: str, environ: Mapping[str, str] = os.environ) -> None:
    """Leave the step of the checkpoint just saved or loaded in the report directory (when this
    rank has one), for the line that ends an interrupted ``cpuddp run``."""
    where = report_dir(environ)
    if where is None:
        return
    rank = _rank(environ)
    _write_json(os.path.join(where, f"checkpoint.{rank if rank is not None else 'x'}.{os.getpid()}.json"),
                {"step": int(step), "path": str(path), "time": time.time()})


def _host() -> str:
    from cpuddp.topology.here import hostname

    return hostname()


# --------------------------------------------------------------------------- the reader (cpuddp run)


def read_reports(directory: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rank reports and the checkpoint notes in ``directory`` (unreadable files skipped)."""
    reports: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return reports, notes
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            (notes if name.startswith("checkpoint.") else reports).append(data)
    return reports, notes


def first_failure(reports: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The root cause: of the last attempt's errors, the one recorded first."""
    errors = [r for r in reports if r.get("kind") == "error"]
    if not errors:
        return None
    last = max(int(r.get("attempt", 0)) for r in errors)
    return min((r for r in errors if int(r.get("attempt", 0)) == last), key=lambda r: float(r.get("time", 0.0)))


def interrupted_line(notes: list[dict[str, Any]]) -> str:
    """The line that ends an interrupted run: where the same command goes on from."""
    if not notes:
        return ("cpuddp run: interrupted; no checkpoint was saved or loaded with cpuddp in this run, so the same "
                "command starts over (unless the script saves its own)")
    last = max(notes, key=lambda n: (float(n.get("time", 0.0)), int(n.get("step", 0))))
    return (f"cpuddp run: interrupted after the checkpoint of step {last.get('step')} ({last.get('path')}); "
            "run the same command to resume from it")


def ending(directory: str, code: int, interrupted: bool) -> Optional[str]:
    """What ``cpuddp run`` prints last when its launcher exited ``code`` (None: nothing): the
    interrupted line, or the first failure's message (ending with its ``Fix:``), or where to
    look when no rank left a report."""
    reports, notes = read_reports(directory)
    first = first_failure(reports)
    if interrupted or (first is None and any(r.get("kind") == "interrupted" for r in reports)):
        return interrupted_line(notes)
    if code == 0:
        return None
    if first is None:
        return (f"cpuddp run: the launcher exited with code {code} and no rank left an error report (a rank was "
                "killed, crashed or called os._exit -- dmesg shows the kernel's OOM kills): see the ranks' output above")
    rank = first.get("rank")
    who = f"rank {rank}" if rank is not None else "a rank"
    return f"cpuddp run: {who} (pid {first.get('pid')} on {first.get('host')}) failed first:\n{first.get('message')}"
