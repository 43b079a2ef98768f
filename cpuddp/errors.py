"""The exceptions cpuddp raises.

Every error speaks in one voice: what was found (the variable, its value and the launcher
that set it), why it is wrong, and -- on the last line of the message -- what to do.  They
carry structured fields and pickle cleanly, because they cross process boundaries (a rank's
error is reported by the parent in :mod:`cpuddp.testing`).

A warning speaks from the same place: :func:`warn` names the user's line -- the first frame
outside cpuddp and torch -- whatever depth inside cpuddp (a checkpoint path check four calls
down) or torch (a hook that runs during ``backward()`` or ``optimizer.step()``) raises it, so no
caller counts a ``stacklevel``: Python 3.12's ``skip_file_prefixes`` where it exists, else a
walk up the stack.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Optional, Type

__all__ = [
    "CpuddpError",
    "LauncherEnvError",
    "BackendError",
    "GroupShutDownError",
    "RendezvousError",
    "PrepareError",
    "CheckpointError",
    "RankFailedError",
    "first_line",
    "how_it_ended",
]  # warn (below) is cpuddp's own, not a public name


def how_it_ended(code: Optional[int]) -> str:
    """A child process's exit status in words: "exited with code 3", "was killed by signal 6
    (SIGABRT)", "ended (exit status unknown)" for None."""
    if code is None:
        return "ended (exit status unknown)"
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (what error messages quote)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class CpuddpError(Exception):
    """Base class of every cpuddp error."""

    def __init__(self, msg: str, *, fix: Optional[str] = None) -> None:
        self.msg = msg
        self.fix = fix
        super().__init__(self._render())

    def _render(self) -> str:
        if self.fix:
            return f"{self.msg}\nFix: {self.fix}"
        return self.msg

    def _fields(self) -> dict[str, Any]:
        return {"fix": self.fix}

    def __reduce__(self):  # keep structured fields across pickling
        return (_rebuild, (type(self), self.msg, self._fields()))


def _rebuild(cls: type, msg: str, fields: dict[str, Any]) -> CpuddpError:
    return cls(msg, **fields)


class LauncherEnvError(CpuddpError, ValueError):
    """The launcher's environment is half-set, inconsistent or malformed.

    ``variable``/``value`` name the offending environment variable and what it held,
    ``launcher`` the launcher family that set it.
    """

    def __init__(
        self,
        msg: str,
        *,
        variable: Optional[str] = None,
        value: Optional[str] = None,
        launcher: Optional[str] = None,
        fix: Optional[str] = None,
    ) -> None:
        self.variable = variable
        self.value = value
        self.launcher = launcher
        super().__init__(msg, fix=fix)

    def _render(self) -> str:
        # The last line always names the variable, its value, the launcher and the fix,
        # because that is the line a launcher's log shows when it cuts the output short.
        if self.variable is None:
            return super()._render()
        value = "unset" if self.value is None else repr(self.value)
        src = f" (from {self.launcher})" if self.launcher else ""
        last = f"{self.variable}={value}{src}"
        if self.fix:
            last += f" -- fix: {self.fix}"
        return f"{self.msg}\n{last}"

    def _fields(self) -> dict[str, Any]:
        return {"variable": self.variable, "value": self.value, "launcher": self.launcher, "fix": self.fix}


class BackendError(CpuddpError, RuntimeError):
    """The requested collective backend cannot run here (missing, mismatched, unknown)."""


class GroupShutDownError(BackendError):
    """A process group was used after it was shut down (or by a forked child of its rank)."""


class RendezvousError(CpuddpError, RuntimeError):
    """Forming the process group failed: port in use, peer missing, address unreachable."""


class PrepareError(CpuddpError, RuntimeError):
    """``prepare()`` was asked for something it cannot do (e.g. bf16 on a CPU without it)."""


class CheckpointError(CpuddpError, RuntimeError):
    """A checkpoint cannot be written or read: a wrong argument, an unsafe place, a full disk.

    ``path`` is the file or directory concerned (None for an argument error).
    """

    def __init__(self, msg: str, *, path: Optional[str] = None, fix: Optional[str] = None) -> None:
        self.path = path
        super().__init__(msg, fix=fix)

    def _fields(self) -> dict[str, Any]:
        return {"path": self.path, "fix": self.fix}


class RankFailedError(CpuddpError, RuntimeError):
    """A rank of a multi-process run raised, died or did not finish in time.

    ``rank`` is the failing rank (or None when several hung), ``traceback`` its formatted
    traceback as text.
    """

    def __init__(
        self,
        msg: str,
        *,
        rank: Optional[int] = None,
        traceback: Optional[str] = None,
        fix: Optional[str] = None,
    ) -> None:
        self.rank = rank
        self.traceback = traceback
        super().__init__(msg, fix=fix)

    def _render(self) -> str:
        parts = [self.msg]
        if self.traceback:
            parts.append(self.traceback.rstrip())
        text = "\n".join(parts)
        if self.fix:
            text += f"\nFix: {self.fix}"
        return text

    def _fields(self) -> dict[str, Any]:
        return {"rank": self.rank, "traceback": self.traceback, "fix": self.fix}


# --------------------------------------------------------------------------- warnings

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def internal_prefixes() -> tuple[str, ...]:
    """The directories whose frames a warning skips: cpuddp's, and torch's when it is imported."""
    torch = sys.modules.get("torch")
    where: Optional[str] = getattr(torch, "__file__", None)
    if not where:
        return (_HERE,)
    return (_HERE, os.path.dirname(os.path.abspath(where)) + os.sep)


def user_stacklevel(prefixes: tuple[str, ...], skip: int = 1) -> int:
    """The ``stacklevel`` of the first frame outside ``prefixes`` above the caller's ``skip``-th
    frame (1: the function calling this one), as ``warnings.warn`` counts from its caller."""
    frame = sys._getframe(skip + 1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(prefixes):
        frame = frame.f_back
        while frame.f_back is not None and _importlib(frame):  # warnings.warn does not count these
            frame = frame.f_back
        level += 1
    return level


def _importlib(frame) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` naming the user's line (see the module doc)."""
    prefixes = internal_prefixes()
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=prefixes)
        return
    warnings.warn(message, category, stacklevel=user_stacklevel(prefixes, skip=1) + 1)
