"""cpuddp.Progress: the lines it writes (terminal and not), its numbers, rank 0 only, light import."""

from __future__ import annotations

import io
import math
import re
import subprocess
import sys

import pytest

from cpuddp.train.progress import Progress, ProgressSummary, format_duration


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(progress: Progress, clock: Clock, losses: list, seconds_per_step: float = 0.5) -> None:
    for loss in losses:
        clock.now += seconds_per_step
        progress.update(loss=loss)


@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (5.4, "0:05"), (65, "1:05"), (3725, "1:02:05"),
                                           (math.nan, "?"), (-1, "?"), (math.inf, "?")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_plain_lines_every_n_steps_with_loss_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    p = Progress(10, samples_per_step=64, every=5, warmup=1, enabled=True, stream=out, clock=clock)
    _run(p, clock, [1.0] * 5 + [0.5] * 5)
    header, *lines = out.getvalue().splitlines()
    assert re.fullmatch(r"1 rank: rank 0 CPUs? [0-9,-]+ \(\d+ threads?\)", header), header
    # 4 timed steps of 0.5 s after the warm-up step: 64 * 4 / 2 = 128 samples/s; 5 steps left -> 2.5 s
    assert lines == [
        "step  5/10  loss 1.0000  128 samples/s  elapsed 0:02  ETA 0:02",
        "step 10/10  loss 0.5000  128 samples/s  elapsed 0:05  ETA 0:00",
    ]
    assert p.close() == ProgressSummary(steps=10, seconds=5.0, samples_per_s=128.0, loss=0.5)


def test_default_every_is_a_tenth_and_the_last_step_always_prints():
    clock, out = Clock(), io.StringIO()
    p = Progress(25, enabled=True, stream=out, clock=clock)
    assert p.every == 2
    _run(p, clock, [0.7] * 25)
    lines = out.getvalue().splitlines()[1:]
    assert len(lines) == 13 and lines[-1].startswith("step 25/25")
    assert "steps/s" in lines[-1]  # no samples_per_step: the rate is in steps


def test_terminal_redraws_one_line_in_place_and_ends_it():
    clock, out = Clock(), TtyStream()
    p = Progress(4, samples_per_step=8, every=2, warmup=0, enabled=True, stream=out, clock=clock)
    assert p.tty
    _run(p, clock, [0.9, 0.7, 0.5, 0.3])
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 2  # the header, the end
    frames = [f.rstrip("\n") for f in text.split("\r")[1:]]
    assert frames[1].startswith("[##########----------] 2/4  loss 0.8000  16.0 samples/s  ETA 0:01")
    assert frames[-1].startswith("[####################] 4/4  loss 0.4000  16.0 samples/s  took 0:02")


def test_terminal_redraws_at_most_ten_times_a_second():
    clock, out = Clock(), TtyStream()
    p = Progress(100, enabled=True, stream=out, clock=clock)
    _run(p, clock, [0.1] * 100, seconds_per_step=0.01)  # 1 s in all
    assert 5 <= out.getvalue().count("\r") <= 12
    assert "100/100" in out.getvalue().split("\r")[-1]


def test_a_shorter_line_blanks_out_the_longer_one_before_it():
    clock, out = Clock(), TtyStream()
    p = Progress(3, warmup=0, enabled=True, stream=out, clock=clock)
    clock.now += 1
    p.update(loss=123456.0)
    clock.now += 1
    p.update(loss=0.0)  # every=1 here: the loss text shrinks
    first, second = out.getvalue().split("\r")[1:3]
    assert len(second) >= len(first)


def test_close_before_the_end_finishes_the_terminal_line():
    clock, out = Clock(), TtyStream()
    p = Progress(10, warmup=0, enabled=True, stream=out, clock=clock)
    _run(p, clock, [0.5] * 3)
    summary = p.close()
    assert out.getvalue().endswith("\n") and summary.steps == 3
    assert p.close() is summary
    with pytest.raises(RuntimeError, match="after close"):
        p.update()


def test_rate_and_eta_unknown_during_warmup():
    clock, out = Clock(), io.StringIO()
    p = Progress(10, samples_per_step=4, every=1, warmup=2, enabled=True, stream=out, clock=clock)
    _run(p, clock, [0.5, 0.5])
    assert math.isnan(p.rate()) and math.isnan(p.eta())
    assert out.getvalue().splitlines()[1] == "step  1/10  loss 0.5000  elapsed 0:00  ETA ?"
    _run(p, clock, [0.5])
    assert p.rate() == pytest.approx(8.0) and p.eta() == pytest.approx(3.5)


def test_disabled_writes_nothing_but_still_measures():
    clock, out = Clock(), TtyStream()
    p = Progress(4, samples_per_step=2, every=4, warmup=0, enabled=False, stream=out, clock=clock)
    with p:
        _run(p, clock, [1.0, 2.0, 3.0, 4.0])
    assert out.getvalue() == ""
    assert p.close().samples_per_s == pytest.approx(4.0) and p.close().loss == pytest.approx(2.5)


TORCHRUN_2 = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("environ, main", [
    ({}, True),
    (dict(TORCHRUN_2, RANK="0", LOCAL_RANK="0"), True),
    (dict(TORCHRUN_2, RANK="1", LOCAL_RANK="1"), False),
])
def test_only_rank_0_writes_by_default(clean_launcher_env, monkeypatch, environ, main):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert Progress(3).enabled is main


def _ranks_progress() -> tuple[bool, str]:
    buf = io.StringIO()
    p = Progress(2, enabled=None, stream=buf, every=1)
    p.update(loss=1.0)
    p.update(loss=1.0)
    return p.enabled, buf.getvalue()


def test_only_rank_0_writes_in_a_process_group(run_distributed):
    (main0, out0), (main1, out1) = run_distributed(_ranks_progress, 2, timeout=60)
    assert main0 and out0.count("\n") == 3
    assert out0.startswith("2 rank(s): rank 0 ") and "the others not gathered" in out0.splitlines()[0]
    assert not main1 and out1 == ""


def _header_after_prepare() -> str:
    from torch import nn

    import cpuddp

    cpuddp.prepare(nn.Linear(2, 2))  # wraps in DDP: gathers every rank's CPUs and threads
    buf = io.StringIO()
    Progress(2, stream=buf).close()
    return buf.getvalue()


def test_the_header_names_every_rank_once_prepare_has_gathered_them(run_distributed):
    out0, out1 = run_distributed(_header_after_prepare, 2, timeout=60)
    assert re.fullmatch(r"2 rank\(s\): rank 0 CPUs? [0-9,-]+ \(1 thread\), rank 1 CPUs? [0-9,-]+ \(1 thread\)\n", out0), out0
    assert out1 == ""


def test_a_resumed_run_counts_on_from_its_start():
    clock, out = Clock(), io.StringIO()
    p = Progress(10, start=6, samples_per_step=2, warmup=1, enabled=True, stream=out, clock=clock, header=False)
    assert p.step == 6 and p.every == 1 and math.isnan(p.rate())
    _run(p, clock, [0.5] * 4)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step  7/10") and lines[-1].startswith("step 10/10")
    assert p.rate() == pytest.approx(4.0)  # after the warm-up step: 3 steps of 0.5 s, 2 samples each
    with pytest.raises(ValueError, match="start must be an int from 0 to total"):
        Progress(10, start=11)


def test_header_off_or_given():
    out = io.StringIO()
    Progress(2, enabled=True, stream=out, header=False).close()
    assert out.getvalue() == ""
    Progress(2, enabled=True, stream=out, header="my own line").close()
    assert out.getvalue() == "my own line\n"


@pytest.mark.parametrize("kwargs, word", [({"total": 0}, "total"), ({"total": 5, "every": 0}, "every"),
                                          ({"total": 5, "warmup": -1}, "warmup"),
                                          ({"total": 5, "samples_per_step": 0}, "samples_per_step")])
def test_bad_arguments_name_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Progress(**kwargs)


def test_import_is_light():
    code = "import sys, cpuddp.train.progress; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_exported_from_cpuddp():
    import cpuddp

    assert cpuddp.Progress is Progress and "Progress" in cpuddp.__all__


# --------------------------------------------------------------------------- other lines while the bar is drawn


def _screen(text: str) -> list[str]:
    """What a terminal shows after ``text``: ``\\r`` goes back to the line's start, ``\\n`` to a
    new line, any other character overwrites the one under the cursor."""
    lines, col = [[]], 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append([])
            col = 0
        else:
            line = lines[-1]
            line[col:col + 1] = [ch]
            col += 1
    return ["".join(line).rstrip() for line in lines]


def test_a_print_or_a_log_line_while_the_bar_is_drawn_ends_its_line_first(monkeypatch):
    """issue 46: prepare's "precision: ..." line overprinted the bar.  A line written meanwhile
    (print, a logging handler on the terminal) blanks the bar's line; the bar is drawn below it."""
    import logging

    clock, term = Clock(), TtyStream()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    log = logging.getLogger("cpuddp.test_progress_lines")
    handler = logging.StreamHandler(term)
    log.addHandler(handler)
    log.propagate = False
    try:
        p = Progress(4, warmup=0, enabled=True, header="header", clock=clock)
        _run(p, clock, [0.9])
        print("a print")
        log.warning("precision: fp32 kept")
        _run(p, clock, [0.7, 0.5, 0.3])
    finally:
        log.removeHandler(handler)
        log.propagate = True
    screen = _screen(term.getvalue())
    assert screen[:3] == ["header", "a print", "precision: fp32 kept"], screen
    assert screen[3].startswith("[####################] 4/4") and screen[4:] == [""], screen
    assert sys.stdout is term and sys.stderr is term and handler.stream is term  # all put back at the end


def test_close_puts_the_streams_back_and_ends_a_blanked_bar(monkeypatch):
    clock, term = Clock(), TtyStream()
    monkeypatch.setattr(sys, "stderr", term)
    p = Progress(10, warmup=0, enabled=True, header=False, clock=clock)
    _run(p, clock, [0.5] * 2)
    sys.stderr.write("half a line")  # no newline: the bar stays blanked
    p.close()
    assert sys.stderr is term
    screen = _screen(term.getvalue())
    assert screen[0] == "half a line" and screen[1].startswith("[####----------------]  2/10") and screen[2:] == [""], \
        screen


_PTY_SCRIPT = """
import logging, time
from cpuddp.train.progress import Progress
p = Progress(3, warmup=0, enabled=True, header="header")
p.update(loss=0.5)
logging.getLogger("cpuddp.precision").warning("precision: fp32 kept")  # as prepare's trial says it
time.sleep(0.15)
p.update(loss=0.4)
p.update(loss=0.3)
"""


def test_on_a_real_terminal_the_precision_line_does_not_overprint_the_bar(tmp_path):
    """The same in a process whose stdout and stderr are a pseudo-terminal, the log record going
    to logging's last-resort handler (no handler configured), as in examples/finetune.py."""
    import os
    import pty
    import select
    import time

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.Popen([sys.executable, "-c", _PTY_SCRIPT], stdin=slave, stdout=slave, stderr=slave,
                            env=env, cwd=tmp_path)
    os.close(slave)
    out, deadline = b"", time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        proc.kill() if proc.poll() is None else None
        proc.wait(30)
    screen = _screen(out.decode(errors="replace"))
    assert proc.returncode == 0, out
    assert screen[:2] == ["header", "precision: fp32 kept"], screen
    assert screen[2].startswith("[####################] 3/3"), screen
