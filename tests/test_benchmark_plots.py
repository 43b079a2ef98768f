"""The benchmark scripts never crash for a missing plotting library (issue 30: benchmarks/
frameworks.py exited 1 before printing its table when matplotlib was missing): each plot
function, with matplotlib made unimportable, returns without a plot and says why."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


CASES = {
    "frameworks": lambda m, tmp: m.plot({"hf": {"ratio": 1.0, "default": {"median": 1, "min": 1, "max": 1},
                                                 "cpuddp": {"median": 1, "min": 1, "max": 1}}}, tmp / "f.png",
                                        {"cpu": "cpu", "versions": {"torch": "2.13.0"}}),
    "pinning": lambda m, tmp: m.plot({"cpuddp": 1.0}, {"cpuddp": [1.0]}, tmp / "p.png", "title"),
    "netns_model": lambda m, tmp: m.plot(tmp / "n.png"),
    "train_throughput": lambda m, tmp: m.plot({}, tmp / "t.png", "title"),
    "plot_readme": lambda m, tmp: m.draw({}, tmp / "r.png", "cpu", "data path"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_matplotlib_no_plot_no_crash(name, tmp_path, monkeypatch, capsys) -> None:
    module = _load(name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert CASES[name](module, tmp_path) is None
    assert "matplotlib" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
