"""cpuddp.backends.cache: the one lock-file and atomic-write helper (used by the import probe's cache)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpuddp.backends.cache import atomic_path, atomic_write_text, locked

HOLD = """\
import sys, time
from cpuddp.backends.cache import locked
with locked(sys.argv[1], wait=5) as held:
    print("held" if held else "free", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_atomic_write_replaces_whole_and_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "entry.json"
    target.write_text("old")
    assert atomic_write_text(target, "new") is True
    assert target.read_text() == "new"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            Path(tmp).write_text("half")
            raise RuntimeError("boom")
    assert target.read_text() == "new"  # a failed write never reaches the target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]


def test_atomic_write_to_a_missing_directory_says_false(tmp_path: Path) -> None:
    assert atomic_write_text(tmp_path / "missing" / "entry.json", "x") is False
    assert not (tmp_path / "missing").exists()


@pytest.mark.timeout(60)
def test_lock_is_exclusive_across_processes_and_bounded(tmp_path: Path) -> None:
    lock = tmp_path / "entry.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with locked(lock, wait=0.3) as held:
            assert held is False  # the other process holds it: waited, then ran unlocked
        assert 0.25 <= time.monotonic() - t0 < 2.5
    finally:
        holder.wait(timeout=30)
    with locked(lock, wait=0.3) as held:
        assert held is True  # released when the holder's block ended


def test_lock_in_an_unwritable_place_runs_the_block_unlocked(tmp_path: Path) -> None:
    with locked(tmp_path / "missing" / "x.lock", wait=0.1) as held:
        assert held is False
