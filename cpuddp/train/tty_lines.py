"""Other output while a progress bar is drawn on a terminal: it ends the bar's line first.

:class:`cpuddp.Progress` redraws its bar in place (``\\r``), leaving the cursor at the end of
the bar; a line printed then -- a ``print``, a warning, a log record such as prepare's
``precision: ...`` decision -- would continue the bar's line and be overdrawn by the next
redraw.  While a :class:`LineGuard` is on, what this process writes to a terminal through
``sys.stdout``, ``sys.stderr`` or a ``logging.StreamHandler`` that writes to a terminal goes
through a proxy: before the first character the guard's ``hide`` blanks the bar's line, and
after a write that ends a line its ``show`` draws the bar again below it.  What other
processes write, and C code writing to the file descriptor itself, passes by it.
Only the standard library: :mod:`cpuddp.train.progress` imports no torch.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterator

__all__ = ["LineGuard"]


def _is_tty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed stream
        return False


def _stream_handlers() -> Iterator[logging.StreamHandler]:
    """Every ``StreamHandler`` attached to a logger (the root and every named one)."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler):
                yield handler


class _EndsBar:
    """A terminal stream whose writes first end the bar's line (see the module doc)."""

    def __init__(self, raw: Any, guard: "LineGuard") -> None:
        self._raw = raw
        self._guard = guard

    def write(self, text: str) -> int:
        if text:
            self._guard.hide()
        n = self._raw.write(text)
        if text.endswith("\n"):
            self._raw.flush()
            self._guard.midline = False
            self._guard.show()
        elif text:
            self._guard.midline = True
        return n

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, buffer, ...
        return getattr(self._raw, name)


class LineGuard:
    """Routes this process's terminal output through :class:`_EndsBar` between :meth:`install`
    and :meth:`remove` (both may be called any number of times).  ``hide()`` is called before
    a write, ``show()`` after a write that ends a line.  ``midline``: the last write left the
    cursor mid-line (a bar drawn then goes on the next line)."""

    def __init__(self, hide: Callable[[], None], show: Callable[[], None]) -> None:
        self.hide = hide
        self.show = show
        self.midline = False
        self._proxies: dict[int, _EndsBar] = {}  # id(raw stream) -> its proxy
        self._swapped: list[tuple[Any, str, Any, _EndsBar]] = []  # (owner, attribute, raw, proxy)

    @property
    def on(self) -> bool:
        return bool(self._swapped)

    def install(self) -> None:
        """Put a proxy in front of ``sys.stdout``/``sys.stderr`` and the logging stream handlers
        that write to a terminal (a no-op when on already, or when none does)."""
        if self.on:
            return
        for name in ("stdout", "stderr"):
            self._swap(sys, name, getattr(sys, name))
        for handler in _stream_handlers():
            self._swap(handler, "stream", handler.stream)

    def remove(self) -> None:
        """Put every stream back (one replaced since by someone else stays as it is)."""
        for owner, attribute, raw, proxy in reversed(self._swapped):
            if getattr(owner, attribute, None) is proxy:
                setattr(owner, attribute, raw)
        self._swapped.clear()
        self._proxies.clear()
        self.midline = False

    def _swap(self, owner: Any, attribute: str, raw: Any) -> None:
        if isinstance(raw, _EndsBar) or not _is_tty(raw):
            return
        proxy = self._proxies.setdefault(id(raw), _EndsBar(raw, self))
        setattr(owner, attribute, proxy)
        self._swapped.append((owner, attribute, raw, proxy))
