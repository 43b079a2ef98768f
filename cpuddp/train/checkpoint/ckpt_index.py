"""Which checkpoints in a directory are this job's line: the record, the listing, keep= and the abandoned.

**The record.**  A save writes the names of the checkpoints cpuddp wrote in a directory into
``directory/.cpuddp-checkpoints.json`` (atomically, ``0600``), before the checkpoint itself
(one record write per save: the names of checkpoints that are gone leave it then).
Only a checkpoint named there, owned by this user, a regular file (or a directory holding DCP's
``.metadata``) and not a symbolic link (``lstat``) is one of ours (:func:`checkpoints`).  Any
other entry with a checkpoint's name -- a file another user planted in a shared directory such
as ``/tmp``, a symlink, a copy put there by hand -- is skipped and logged: it never counts for
``keep=``, it is never removed, and ``load_checkpoint(directory)`` never resumes it (a copy
loads by its own path).  The record is read without following a symlink and must be this
user's, with one name (no hard link), writable by nobody else.  A directory without a record
(written by cpuddp before it kept one) is read by ownership alone, a file with another hard link
skipped; its first save there adopts the checkpoints that pass.  The directory given here is the
real path :func:`cpuddp.train.checkpoint.paths.check_directory` returned (no symbolic link left
on it), so ``keep=`` and the moves never reach through a link.

**The line.**  The checkpoints of a directory are one line of training, their steps rising.
A save of step ``T`` moves every one of ours with a step above ``T`` -- saved by a run that
was later resumed from an earlier step, or by an earlier run that this one did not resume --
into ``directory/abandoned-at-step-T.<random>/``, with a warning (:func:`supersede`).  So
``keep=`` counts along the current line, the checkpoint just written is never pruned, and
``load_checkpoint(directory)`` resumes the newest of the current line.  Abandoned checkpoints
are kept (never pruned) for the user to inspect or delete.

Everything here runs on the process that does the directory's work (group rank 0), under the
directory's writer lock (:mod:`cpuddp.train.checkpoint.ckpt_lock`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Optional

from cpuddp.errors import CheckpointError

from .atomic import write_atomically
from .paths import open_own_file

__all__ = ["RECORD_FILE", "Checkpoint", "checkpoint_name", "checkpoints", "supersede", "note_new", "prune",
           "ABANDONED_PREFIX"]

_log = logging.getLogger("cpuddp.checkpoint")

#: In a checkpoint directory: the names of the checkpoints cpuddp wrote there.
RECORD_FILE = ".cpuddp-checkpoints.json"
RECORD_FORMAT = "cpuddp-checkpoints/1"
#: The folders a save moves an abandoned line's checkpoints into.
ABANDONED_PREFIX = "abandoned-at-step-"
_NAME = re.compile(r"\Astep-(\d{9,})(\.pt)?\Z")
_told: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Checkpoint:
    """One of our checkpoints in a directory."""

    step: int
    path: str
    sharded: bool


def checkpoint_name(step: int, sharded: bool) -> str:
    return f"step-{step:09d}" + ("" if sharded else ".pt")


def _tell(path: str, why: str, level: int = logging.WARNING) -> None:
    """Log why ``path`` is not taken as one of ours, once per process."""
    if (path, why) not in _told:
        _told.add((path, why))
        _log.log(level, "checkpoint %s skipped: %s", path, why)


# --------------------------------------------------------------------------- the record


def read_record(directory: str, check_permissions: bool = True) -> Optional[set[str]]:
    """The names in ``directory``'s record; None when it has none."""
    path = os.path.join(directory, RECORD_FILE)
    try:
        f = open_own_file(path, check_permissions=check_permissions)
    except FileNotFoundError:
        return None
    with f:
        raw = f.read(1 << 24)
    try:
        data = json.loads(raw.decode("utf-8"))
        names = data["checkpoints"] if data.get("format") == RECORD_FORMAT else None
        if not isinstance(names, list) or not all(isinstance(n, str) and _NAME.match(n) for n in names):
            raise ValueError("not a list of checkpoint names")
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path!r} is not cpuddp's record of this directory's checkpoints ({exc})", path=path,
                              fix=f"remove {path!r}: the next save writes a new one") from None
    return set(names)


def _write_record(directory: str, names: set[str], check_permissions: bool) -> None:
    data = json.dumps({"format": RECORD_FORMAT, "checkpoints": sorted(names)}, indent=1).encode()
    write_atomically(os.path.join(directory, RECORD_FILE), lambda f: f.write(data), check_permissions=check_permissions)


# --------------------------------------------------------------------------- the listing


def _complete_dir(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(os.path.join(path, ".metadata")).st_mode)
    except OSError:
        return False


def _judge(path: str, st: os.stat_result, record: Optional[set[str]], others: bool) -> Optional[str]:
    """Why the entry at ``path`` is not one of our checkpoints (None: it is)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link (checkpoints are never loaded or removed through one)"
    if st.st_uid != os.geteuid() and not others:
        return f"owned by uid {st.st_uid}, not by you (another user put it there)"
    if record is not None and os.path.basename(path) not in record:
        return (f"cpuddp did not write it here (not in {RECORD_FILE}); pass its path to load it, "
                "remove it yourself if unwanted")
    if stat.S_ISREG(st.st_mode):
        if record is None and st.st_nlink > 1:
            return "a file with another hard link, in a directory cpuddp keeps no record of"
        return None
    if stat.S_ISDIR(st.st_mode):
        return None if _complete_dir(path) else "a directory without DCP's .metadata (not a complete checkpoint)"
    return "not a regular file or directory"


def checkpoints(directory: str, *, check_permissions: bool = True, others: bool = False,
                record: Optional[set[str]] = None, use_record: bool = True) -> list[Checkpoint]:
    """Our checkpoints in ``directory``, oldest first (see the module doc); the others logged.

    ``others``: take checkpoints other users own too (a load with ``check_permissions=False``).
    ``record``: the record already read; ``use_record=False``: judge by ownership alone."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    if record is None and use_record:
        record = read_record(directory, check_permissions)
    found = []
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        why = _judge(path, st, record, others)
        if why is None and stat.S_ISDIR(st.st_mode) == bool(m.group(2)):
            why = "its kind does not match its name (a step-N.pt directory or a step-N file)"
        if why is None:
            found.append(Checkpoint(int(m.group(1)), path, sharded=stat.S_ISDIR(st.st_mode)))
        else:
            _tell(path, why, logging.INFO if RECORD_FILE in why else logging.WARNING)  # a copy of the user's: INFO
    return sorted(found, key=lambda c: (c.step, c.path))


# --------------------------------------------------------------------------- changes (rank 0, locked)


def _ours_now(directory: str, check_permissions: bool) -> tuple[list[Checkpoint], set[str]]:
    """Our checkpoints and the record's names; a directory without a record adopts what is ours
    (its record not yet written)."""
    record = read_record(directory, check_permissions)
    if record is None:
        adopted = checkpoints(directory, use_record=False)
        if adopted and (directory, "adopted") not in _told:
            _told.add((directory, "adopted"))
            _log.info("%s: adopting %d checkpoint(s) saved before cpuddp kept a record there", directory,
                      len(adopted))
        return adopted, {os.path.basename(c.path) for c in adopted}
    return checkpoints(directory, record=record), record


def supersede(directory: str, step: int, check_permissions: bool = True) -> list[str]:
    """Move our checkpoints with a step above ``step`` into ``abandoned-at-step-<step>.<random>/``
    and out of the record; return their new paths (see the module doc)."""
    ours, record = _ours_now(directory, check_permissions)
    later = [c for c in ours if c.step > step]
    if not later:
        return []
    aside = tempfile.mkdtemp(prefix=f"{ABANDONED_PREFIX}{step:09d}.", dir=directory)
    moved = []
    for c in later:
        name = os.path.basename(c.path)
        os.rename(c.path, os.path.join(aside, name))
        moved.append(os.path.join(aside, name))
        record.discard(name)
    _write_record(directory, record, check_permissions)
    _log.warning("saving step %d in %s: moved %d checkpoint(s) of later steps (%s), from a line of training this "
                 "run did not go on from, to %s; load_checkpoint() now resumes this run's line; delete them when "
                 "not needed", step, directory, len(later), ", ".join(os.path.basename(p) for p in moved), aside)
    return moved


def note_new(directory: str, name: str, check_permissions: bool = True) -> None:
    """Record ``name`` as ours before it is written (a save that dies leaves a name without a file:
    harmless); names whose checkpoint is gone (pruned, removed by hand) leave the record here."""
    _, record = _ours_now(directory, check_permissions)
    kept = {n for n in record if os.path.lexists(os.path.join(directory, n))} | {name}
    if kept != record or not os.path.lexists(os.path.join(directory, RECORD_FILE)):
        _write_record(directory, kept, check_permissions)


def _remove(c: Checkpoint) -> bool:
    """Remove our checkpoint ``c`` (checked again: a regular file or directory of ours, no symlink)."""
    try:
        st = os.lstat(c.path)
    except FileNotFoundError:
        return True
    if st.st_uid != os.geteuid() or stat.S_ISLNK(st.st_mode):
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(c.path, ignore_errors=True)
        return not os.path.lexists(c.path)
    try:
        os.unlink(c.path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
    return True


def prune(directory: str, keep: Optional[int], written: str, check_permissions: bool = True) -> list[str]:
    """Remove all but the newest ``keep`` of our checkpoints, never ``written`` (the one just saved);
    return what was removed."""
    if keep is None:
        return []
    ours, _ = _ours_now(directory, check_permissions)
    line = [c for c in ours if c.path != written]
    old = line[:max(0, len(line) - (keep - 1))]
    return [c.path for c in old if _remove(c)]  # their names leave the record at the next save
