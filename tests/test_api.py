"""The public API is pinned, and `import cpuddp` stays light."""

from __future__ import annotations

import subprocess
import sys

import cpuddp

HEAVY = ["torch", "intel_extension_for_pytorch", "oneccl_bindings_for_pytorch", "torch_ccl", "mpi4py",
         "transformers", "cpuinfo"]


def test_import_is_light():
    code = f"import sys, cpuddp; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_public_name_resolves():
    for name in cpuddp.__all__:
        assert getattr(cpuddp, name) is not None, name
