"""Test hygiene for cpuddp's own suite: no test may leak environment variables or a process group."""

from __future__ import annotations

import os
import sys

import pytest


# Set by pytest itself, and by torch on first use of an optimizer or torch.compile.
_SET_BY_TOOLS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def _no_leaks():
    before = dict(os.environ)
    yield
    leaked_group = False
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            leaked_group = True
            import cpuddp

            cpuddp.shutdown()
    after = dict(os.environ)
    changed = sorted(
        k for k in set(before) | set(after) if before.get(k) != after.get(k) and k not in _SET_BY_TOOLS
    )
    os.environ.clear()
    os.environ.update(before)
    if leaked_group:
        pytest.fail("the test left a process group initialized")
    if changed:
        pytest.fail(f"the test leaked environment variables: {changed}")
