"""Test hygiene for cpuddp's own suite: no test may leak environment variables or a process group."""

from __future__ import annotations

import os
import sys

import pytest


# Set by pytest itself for each test.
_SET_BY_TOOLS = {"PYTEST_CURRENT_TEST"}


@pytest.fixture(scope="session", autouse=True)
def _torch_process_defaults():
    """Let torch write its once-per-process default of ``TORCHINDUCTOR_CACHE_DIR`` before any test.

    torch's ``cache_dir()`` puts its default into ``os.environ`` the first time anything imports
    the inductor: torch 2.13's ``torch._dynamo.package`` at the first optimizer, torch 2.8 on
    ``import intel_extension_for_pytorch`` (a module-level ``@torch.compile``).  Whichever test
    came first was then blamed for a leak it did not make.  Calling it here, once, makes that
    write happen before the leak check's first snapshot; a test that changes the variable is
    still caught.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()


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
