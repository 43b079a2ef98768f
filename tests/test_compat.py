"""The supported torch range: one fact (cpuddp._compat.TESTED_TORCH), stated alike in
pyproject.toml and README, and a once-only log line for a torch outside it."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cpuddp import _compat

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "version, inside",
    [
        ("2.8.0", True),
        ("2.8.0+cu128", True),
        ("2.10.1", True),
        ("2.13.0+cpu", True),
        ("2.13.9", True),
        ("2.7.1", False),
        ("2.1.0", False),  # "2.1" > "2.08" as strings would say otherwise
        ("2.14.0", False),
        ("2.14.0.dev20260101+cpu", False),
        ("3.0.0", False),
        ("not-a-version", False),
    ],
)
def test_torch_range_note(version, inside):
    note = _compat.torch_range_note(version)
    assert (note is None) is inside
    if note is not None:
        assert version in note and "2.8 to 2.13" in note


def test_check_torch_version_logs_once(caplog):
    log = logging.getLogger("cpuddp.test_compat")
    with caplog.at_level(logging.WARNING, logger="cpuddp.test_compat"):
        first = _compat.check_torch_version(log, torch_version="2.99.0")
        again = _compat.check_torch_version(log, torch_version="2.99.0")
        inside = _compat.check_torch_version(log, torch_version="2.13.0")
    assert first == again and "2.99.0 is newer" in first and inside is None
    assert [r.getMessage() for r in caplog.records] == [first]


def test_the_running_torch_is_inside_the_range():
    import torch

    assert _compat.check_torch_version(torch_version=torch.__version__) is None


def _torch_requirement_text() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    (torch_req,) = [m for m in re.findall(r'"([^"]+)"', deps) if Requirement(m).name == "torch"]
    return torch_req


def _torch_requirement() -> Requirement:
    return Requirement(_torch_requirement_text())


def test_pyproject_and_readme_state_the_tested_range():
    (lo_major, lo_minor), (hi_major, hi_minor) = _compat.TESTED_TORCH
    spec = _torch_requirement().specifier
    assert f"{lo_major}.{lo_minor}.0" in spec and f"{hi_major}.{hi_minor}.99" in spec
    assert f"{lo_major}.{lo_minor - 1}.99" not in spec
    # no upper cap: pip must never downgrade a newer torch (to a CUDA build) to install cpuddp;
    # a newer torch runs and init_distributed() says once that it is untested
    assert f"{hi_major}.{hi_minor + 1}.0" in spec
    readme = (ROOT / "README.md").read_text()
    assert f"Supported torch: {lo_major}.{lo_minor} to {hi_major}.{hi_minor}" in readme
    assert f"`{_torch_requirement_text()}`" in readme


@pytest.mark.parametrize("version, old", [("2.7.1", True), ("2.1.0+cpu", True), ("2.8.0", False),
                                          ("2.13.0+cpu", False), ("2.14.0", False), ("weird", False)])
def test_older_than_tested(version, old):
    assert _compat.older_than_tested(version) is old


def test_init_refuses_a_torch_older_than_the_floor(monkeypatch):
    import torch

    import cpuddp
    from cpuddp.errors import BackendError

    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    with pytest.raises(BackendError, match=r"torch 2.7.1\+cpu is older than cpuddp supports"):
        cpuddp.init_distributed(environ={}, pin=False)
