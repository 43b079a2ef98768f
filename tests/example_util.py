"""Running ``examples/``: shared by tests/test_example_learns.py and tests/test_loop.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def example_env() -> dict:
    """This process's environment without any launcher's variables, with the repository on
    ``PYTHONPATH``: an example run as a fresh job."""
    from cpuddp.testing import clean_environ

    env = clean_environ(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def paraphrase_data() -> ModuleType:
    """``examples/paraphrase_data.py``, imported by name as the example imports it."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import paraphrase_data as pd
    finally:
        sys.path.remove(str(EXAMPLES))
    return pd


def fake_missing_numpy(tmp_path: Path) -> str:
    """A directory whose ``numpy`` fails to import as a missing one does (README's install has no
    numpy; torch then warns "Failed to initialize NumPy" at import): put it first on PYTHONPATH."""
    pkg = tmp_path / "no-numpy" / "numpy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return str(pkg.parent)
