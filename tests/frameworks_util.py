"""Shared by the framework tests (tests/test_frameworks.py, tests/test_shard_frameworks.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def need(*modules: str) -> None:
    """Skip (or, with CPUDDP_REQUIRE_FRAMEWORKS=1 as in CI, fail) unless every module imports."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"needs {', '.join(missing)}: pip install -e '.[frameworks]'"
        if os.environ.get("CPUDDP_REQUIRE_FRAMEWORKS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
