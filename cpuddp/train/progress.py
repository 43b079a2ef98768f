"""``Progress``: what a custom training loop shows while it runs -- on rank 0 only.

    progress = cpuddp.Progress(steps, samples_per_step=env.world_size * batch_size)
    for step in range(steps):
        ...
        progress.update(loss=loss.item())
    summary = progress.close()        # steps, seconds, samples_per_s, loss

It starts with a header line: each rank's CPUs and threads (gathered by
:func:`cpuddp.prepare` when it wraps the model in DDP; :mod:`cpuddp.train.common.layout`)::

    2 rank(s): rank 0 CPU 0 (1 thread), rank 1 CPU 1 (1 thread)

On a terminal it then redraws one line in place (at most ten times a second)::

    [#########-----------]  450/1000  loss 0.4127  612 samples/s  ETA 0:53

A line this process prints meanwhile (``print``, a warning, a log record such as prepare's
``precision: ...``) blanks the bar's line first and the bar is drawn again below it
(:mod:`.tty_lines`), so neither overprints the other.

Anywhere else -- a log file, CI, a launcher that pipes the output -- it writes a plain line
every ``every`` steps (default: a tenth of the run) and at the last step::

    step  500/1000  loss 0.3890  608 samples/s  elapsed 0:49  ETA 0:50

``loss`` is the mean of the last ``every`` values given to :meth:`Progress.update` on this
rank (no collective: reducing over the ranks is the loop's business, see
:func:`cpuddp.reduce_mean`).  samples/s and the ETA leave out the first ``warmup`` steps,
which pay for one-time start-up work (allocations, DDP's first bucket rebuild).

Only global rank 0 writes (torch.distributed's rank when a group exists, else the
launcher's, from :func:`cpuddp.detect`); every rank may call it, and every rank gets a
:class:`ProgressSummary` of its own measurements from :meth:`Progress.close`.  It never
imports torch and needs nothing beyond the standard library.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Callable, Optional, Union

from cpuddp.ranks import get_rank

from .common.layout import places_line
from .tty_lines import LineGuard

__all__ = ["Progress", "ProgressSummary", "format_duration"]

#: On a terminal, the line is redrawn at most this often (seconds); the last step always is.
_REDRAW_EVERY = 0.1
_BAR_WIDTH = 20


@dataclass(frozen=True)
class ProgressSummary:
    """The numbers of one run, as :meth:`Progress.close` measured them on this rank."""

    steps: int
    seconds: float  # wall time from the Progress's creation to close()
    samples_per_s: float  # after the warm-up steps; nan when unknown
    loss: float  # mean of the last ``every`` losses given; nan when none were
    ranks: str = field(default="", compare=False)  # each rank's CPUs and threads: the header's line


def format_duration(seconds: float) -> str:
    """``65`` -> ``"1:05"``, ``3725`` -> ``"1:02:05"``; ``"?"`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _is_main_process() -> bool:
    """Global rank 0: torch.distributed's rank when a group exists, else the launcher's
    (:func:`cpuddp.get_rank`; a half-set launcher environment raises, as everywhere)."""
    return get_rank() == 0


class Progress:
    """A progress line for a loop of ``total`` steps; see the module doc.

    ``samples_per_step`` (every rank's samples in one step) turns step times into samples/s;
    without it the rate is in steps/s.  ``header``: True writes the ranks' CPUs and threads
    first (the module doc), a string writes that instead, False nothing.  ``start``: the
    steps already done (a run resumed from a checkpoint): the line counts on from there.  ``enabled`` (default: global rank 0) and ``stream``
    (default: stderr) say whether and where to write; ``tty`` overrides the stream's own
    ``isatty()``.  ``clock`` is for tests.
    """

    def __init__(
        self,
        total: int,
        *,
        samples_per_step: Optional[int] = None,
        every: Optional[int] = None,
        warmup: int = 1,
        enabled: Optional[bool] = None,
        stream: Optional[IO[str]] = None,
        tty: Optional[bool] = None,
        clock: Callable[[], float] = time.perf_counter,
        header: Union[bool, str] = True,
        start: int = 0,
    ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an int >= 1 (the number of steps). Got {total!r} instead.")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an int >= 1 or None (a tenth of total). Got {every!r} instead.")
        if samples_per_step is not None and samples_per_step <= 0:
            raise ValueError(f"samples_per_step must be positive or None. Got {samples_per_step!r} instead.")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0. Got {warmup!r} instead.")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= total:
            raise ValueError(f"start must be an int from 0 to total ({total}): the steps already done (a resumed "
                             f"run). Got {start!r} instead.")
        self.total = total
        self.start = start
        self.every = every if every is not None else max(1, round((total - start) / 10))
        self.samples_per_step = samples_per_step
        self.warmup = max(0, min(warmup, total - start - 1))
        self.enabled = _is_main_process() if enabled is None else bool(enabled)
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self._clock = clock
        self._start = clock()
        self._warm_at: Optional[float] = self._start if self.warmup == 0 else None
        self._losses: deque = deque(maxlen=self.every)
        self._step = start
        self._drawn_at = -math.inf
        self._width = 0  # the bar's length on the terminal; 0: no bar there
        self._hidden = False  # blanked for another line (tty_lines): drawn again after it
        self._guard = LineGuard(self._hide, self._show)
        self._closed: Optional[ProgressSummary] = None
        self.ranks = places_line()
        if self.enabled and header:
            self.stream.write((header if isinstance(header, str) else self.ranks) + "\n")
            self.stream.flush()

    # ----------------------------------------------------------------- measuring

    @property
    def step(self) -> int:
        """Steps done so far."""
        return self._step

    @property
    def loss(self) -> float:
        """Mean of the last ``every`` losses given (nan before the first)."""
        return sum(self._losses) / len(self._losses) if self._losses else math.nan

    def rate(self, now: Optional[float] = None) -> float:
        """samples/s (steps/s without ``samples_per_step``) after the warm-up; nan before."""
        if self._warm_at is None:
            return math.nan
        timed = self._step - self.start - self.warmup
        seconds = (self._clock() if now is None else now) - self._warm_at
        if timed <= 0 or seconds <= 0:
            return math.nan
        return timed * (self.samples_per_step or 1) / seconds

    def eta(self, now: Optional[float] = None) -> float:
        """Seconds left at the current rate (nan before the warm-up is over)."""
        rate = self.rate(now)
        if not math.isfinite(rate) or rate <= 0:
            return math.nan
        return (self.total - self._step) * (self.samples_per_step or 1) / rate

    # ----------------------------------------------------------------- updating

    def update(self, steps: int = 1, *, loss: Optional[float] = None) -> None:
        """Count ``steps`` more steps done, with this step's ``loss`` (a float) if given."""
        if self._closed is not None:
            raise RuntimeError("Progress.update() after close()")
        now = self._clock()
        before = self._step
        self._step = min(self.total, self._step + steps)
        if loss is not None:
            self._losses.append(float(loss))
        if self._warm_at is None and self._step >= self.start + self.warmup:
            self._warm_at = now
        if not self.enabled:
            return
        last = self._step >= self.total
        if self.tty:
            if last or now - self._drawn_at >= _REDRAW_EVERY:
                self._draw(self._tty_line(now), end="\n" if last else "")
                self._drawn_at = now
        elif last or self._step // self.every > before // self.every:
            self._draw(self._plain_line(now), end="\n")

    def close(self) -> ProgressSummary:
        """Finish the line (on a terminal) and return this rank's :class:`ProgressSummary`."""
        if self._closed is None:
            now = self._clock()
            if self.enabled and self.tty and self._step < self.total and (self._width or self._hidden):
                self._draw(self._tty_line(now), end="\n")  # a loop that stopped early
            self._guard.remove()
            self._closed = ProgressSummary(self._step, now - self._start, self.rate(now), self.loss, self.ranks)
        return self._closed

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- drawing

    def _fields(self, now: float) -> str:
        n = len(str(self.total))
        parts = [f"{self._step:>{n}}/{self.total}"]
        if self._losses:
            parts.append(f"loss {self.loss:.4f}")
        rate = self.rate(now)
        unit = "samples/s" if self.samples_per_step else "steps/s"
        if math.isfinite(rate):
            parts.append(f"{rate:.0f} {unit}" if rate >= 100 else f"{rate:.1f} {unit}")
        return "  ".join(parts)

    def _tty_line(self, now: float) -> str:
        done = int(_BAR_WIDTH * self._step / self.total)
        bar = "#" * done + "-" * (_BAR_WIDTH - done)
        tail = f"ETA {format_duration(self.eta(now))}" if self._step < self.total \
            else f"took {format_duration(now - self._start)}"
        line = f"[{bar}] {self._fields(now)}  {tail}"
        columns = shutil.get_terminal_size((80, 24)).columns
        return line[: max(10, columns - 1)]  # a wrapped line cannot be redrawn in place

    def _plain_line(self, now: float) -> str:
        return (f"step {self._fields(now)}  elapsed {format_duration(now - self._start)}"
                f"  ETA {format_duration(self.eta(now)) if self._step < self.total else '0:00'}")

    def _draw(self, line: str, end: str) -> None:
        if self.tty:
            pad = " " * max(0, self._width - len(line))  # blank out a longer previous line
            lead = "\r"
            if self._guard.midline:  # another write left the cursor mid-line: the bar goes below it
                lead, self._guard.midline = "\n", False
            self.stream.write(lead + line + pad + end)
            self._width, self._hidden = (0 if end else len(line)), False
            if end:
                self._guard.remove()
            else:
                self._guard.install()  # until the bar's line ends, other lines end it first
        else:
            self.stream.write(line + end)
        self.stream.flush()

    def _hide(self) -> None:
        """Blank the bar's line before another line is written to the terminal (tty_lines)."""
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width, self._hidden = 0, True

    def _show(self) -> None:
        """Draw the bar again below a line written while it was blanked."""
        if self._hidden and self._closed is None:
            self._draw(self._tty_line(self._clock()), end="")
