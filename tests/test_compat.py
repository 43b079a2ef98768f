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
        ("2.14.1+cu130", True),
        ("2.15.0", True),
        ("2.15.0+cu132", True),
        ("2.7.1", False),
        ("2.1.0", False),  # "2.1" > "2.08" as strings would say otherwise
        ("2.16.0", False),
        ("2.16.0.dev20270101+cpu", False),
        ("3.0.0", False),
        ("not-a-version", False),
    ],
)
def test_torch_range_note(version, inside):
    note = _compat.torch_range_note(version)
    assert (note is None) is inside
    if note is not None:
        assert version in note and "2.8 to 2.15" in note


def test_check_torch_version_logs_once(caplog):
    log = logging.getLogger("cpuddp.test_compat")
    with caplog.at_level(logging.WARNING, logger="cpuddp.test_compat"):
        first = _compat.check_torch_version(log, torch_version="2.99.0")
        again = _compat.check_torch_version(log, torch_version="2.99.0")
        inside = _compat.check_torch_version(log, torch_version="2.15.0")
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


@pytest.mark.parametrize(
    "version, torch, ok, built_for",
    [
        ("2.8.0+cpu", "2.8.1", True, "torch 2.8"),
        ("2.8.0", "2.13.0+cpu", False, "torch 2.8"),
        ("2.13.10", "2.13.0+cpu", True, "torch 2.13"),
        ("1.9.0", "1.10.0", False, "torch 1.9"),  # "1.9" > "1.10" as strings, not as versions
        ("2.10.1", "2.1.0", False, "torch 2.10"),
        ("not-a-version", "2.8.0", False, "an unknown torch (its version 'not-a-version' is not a valid version)"),
        ("2.8.0", "garbage!", False, "torch 2.8"),
    ],
)
def test_torch_pairing_is_one_rule(version, torch, ok, built_for):
    from cpuddp.train.precision import ipex as _ipex
    from cpuddp.backends import ccl_pairing

    pairing = _compat.torch_pairing(version, torch)
    assert (pairing.ok, pairing.built_for) == (ok, built_for)
    assert (pairing.error is not None) == ("not-a-version" in version or "garbage" in torch)
    # every caller answers with it: IPEX's probe, the oneCCL bindings' check
    assert _ipex.check_versions(version, torch).usable is ok
    assert ccl_pairing(version, torch) == (ok, built_for)


def test_torch_pairing_exact_releases():
    exact = {(1, 12, 100): (1, 12, 1)}
    assert _compat.torch_pairing("1.12.100", "1.12.1", exact=exact) == (True, "torch 1.12.1 only", None)
    assert _compat.torch_pairing("1.12.100", "1.12.0", exact=exact).ok is False
    assert _compat.torch_pairing("1.12.100", "1.12.0").ok is True  # without the table: major.minor


def test_doctor_does_not_override_its_own_match(monkeypatch):
    # The bindings' exact pairs decide doctor's verdict once (1.12.0 is for torch 1.12.0 only).
    from cpuddp.doctor import command as doctor

    installed = {"torch": "1.12.1", "oneccl_bind_pt": "1.12.0", "intel_extension_for_pytorch": "1.12.300"}
    monkeypatch.setattr(doctor, "_dist_version", installed.get)
    v = doctor._versions()
    assert v["oneccl_bind_pt_matches_torch"] is False and v["oneccl_bind_pt_built_for"] == "torch 1.12.0 only"
    assert v["ipex_matches_torch"] is True and v["ipex_built_for"] == "torch 1.12"
