"""The launched process's environment, in and out: what :func:`cpuddp.init_distributed`
exports (and :func:`cpuddp.shutdown` puts back), and the job script's cpuddp settings.

- :class:`Exports` writes variables and logs each one, so shutdown (or a failed init) can put
  back exactly what cpuddp changed: the user's value wins unless the variable must describe
  this process (``RANK``, ``WORLD_SIZE``, ...), and then the change is a logged warning.
- :func:`timeout_from`: ``timeout=`` or ``CPUDDP_TIMEOUT`` (seconds), checked.
- :func:`configure_logging`: ``CPUDDP_LOG_LEVEL`` attaches a stderr handler to the ``cpuddp``
  logger at that level.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Optional, Union

from cpuddp.errors import LauncherEnvError

__all__ = ["Exports", "timeout_from", "configure_logging", "DEFAULT_TIMEOUT", "NOTICE_AFTER", "Timeout"]

log = logging.getLogger("cpuddp")

#: Default bound, in seconds, on the rendezvous and on every collective.
DEFAULT_TIMEOUT = 300.0

#: Seconds a rank waits -- for its peers in an exchange, for the job's store -- before it says
#: what it waits for, where, and for how long (once): no rank is silent for the whole timeout.
NOTICE_AFTER = 5.0

Timeout = Union[float, int, datetime.timedelta]


@dataclass
class Exports:
    """The variables one init exported, in order, with the values they replaced."""

    done: list[tuple[MutableMapping[str, str], str, Optional[str], str]] = field(default_factory=list)

    def export(self, environ: MutableMapping[str, str], values: Mapping[str, str], *, reason: str,
               strict: bool = False) -> None:
        """Export ``values``.  ``strict``: these must describe this process, so a differing
        user value is replaced (with a warning); otherwise the user's value wins (logged at
        debug)."""
        for key, value in values.items():
            old = environ.get(key)
            if old == value:
                continue
            if old is not None and not strict:
                log.debug("cpuddp: keeping the user's %s=%r (cpuddp would set %r: %s)", key, old, value, reason)
                continue
            if old is not None:
                log.warning("cpuddp: %s was %r; setting it to %r (%s)", key, old, value, reason)
            self.done.append((environ, key, old, value))
            environ[key] = value

    def unexport(self) -> None:
        """Put back what :meth:`export` changed, newest first, unless changed since."""
        for environ, key, old, value in reversed(self.done):
            if environ.get(key) != value:
                continue
            if old is None:
                environ.pop(key, None)
            else:
                environ[key] = old
        self.done.clear()


def configure_logging(environ: Mapping[str, str]) -> None:
    """``CPUDDP_LOG_LEVEL``: attach a stderr handler to the ``cpuddp`` logger (once)."""
    level = environ.get("CPUDDP_LOG_LEVEL", "").strip().upper()
    if not level or any(getattr(h, "_cpuddp", False) for h in log.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    handler._cpuddp = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(level if level.isalpha() else int(level))


def _timeout_error(msg: str, value: Optional[str]) -> LauncherEnvError:
    return LauncherEnvError(msg, variable="CPUDDP_TIMEOUT", value=value, launcher="the job script",
                            fix="export CPUDDP_TIMEOUT=300 (seconds), or unset it")


def timeout_from(timeout: Optional[Timeout], environ: Mapping[str, str]) -> datetime.timedelta:
    """``timeout`` (seconds or a timedelta), else ``CPUDDP_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`."""
    source = "timeout="
    if timeout is None:
        raw = environ.get("CPUDDP_TIMEOUT", "").strip()
        if raw:
            source = "CPUDDP_TIMEOUT"
            try:
                timeout = float(raw)
            except ValueError:
                raise _timeout_error("CPUDDP_TIMEOUT must be a number of seconds", raw) from None
        else:
            timeout = DEFAULT_TIMEOUT
    td = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0 and source == "CPUDDP_TIMEOUT":
        raise _timeout_error("CPUDDP_TIMEOUT must be a positive number of seconds", environ.get("CPUDDP_TIMEOUT"))
    if td.total_seconds() <= 0:
        raise ValueError(f"{source} must be positive, got {timeout!r}; pass seconds or a timedelta, e.g. timeout=300")
    return td
