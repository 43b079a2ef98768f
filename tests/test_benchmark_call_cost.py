"""benchmarks/call_cost.py runs as docs/benchmarks.md says: a line per collective with the slowest
rank's microseconds per call, the stages of an all_reduce with --phases, and a usage error for a
collective it does not know (real processes, 2 ranks on the shm backend)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "call_cost.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:  # pragma: no cover - the failure's own report
        pytest.fail(f"call_cost.py {' '.join(args)} did not finish in 180 s; output so far: {exc.stdout!r} {exc.stderr!r}")


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_a_line_per_collective_with_the_slowest_ranks_cost():
    done = _run("--calls", "30", "--repeats", "1", "--kinds", "all_reduce,reduce_scatter_single,barrier")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _lines(done.stdout)
    kinds = ["all_reduce", "reduce_scatter_single", "barrier"]
    for path in ("native data path", "Python data path"):  # each path's run, in that order
        mine = [r for r in rows if r.get("path", "").startswith(path)]
        assert [r["collective"] for r in mine] == kinds, done.stdout
        for r in mine:
            assert (r["ranks"], r["backend"], r["bytes"]) == (2, "shm", 4096)
            assert r["us_per_call"] > 0 and r["cpu_us_per_call"] >= 0 and "vCPU" in r["cpu"]
    ratios = [r for r in rows if "python_over_native" in r]
    assert [r["collective"] for r in ratios] == kinds and all(r["python_over_native"] > 0 for r in ratios)


def test_phases_split_an_all_reduce_on_every_rank():
    done = _run("--phases", "--calls", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _lines(done.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1], done.stdout
    for r in rows:
        assert 0 < r["round (wait for the peers)"] <= r["run (agreement, stream, data)"] <= r["cpuddp (all of it)"]
        assert r["cpuddp (all of it)"] <= r["total"]


def test_an_unknown_collective_is_a_usage_error_naming_it():
    done = _run("--kinds", "all_reduce,allreduce")
    assert done.returncode == 2
    assert "--kinds: allreduce not among all_reduce" in done.stderr
