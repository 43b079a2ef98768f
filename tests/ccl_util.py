"""The oneCCL bindings' test double (tests/fake_ccl), installed where a test wants it.

``fake_site(root, version)`` copies the double's module into ``root`` with a dist-info that
says ``oneccl_bind_pt <version>``: a directory to put on ``sys.path``.  A fresh copy per
test gives each its own files (the import probe's cache is keyed by them).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

DOUBLE = Path(__file__).resolve().parent / "fake_ccl"
MODULE = "oneccl_bindings_for_pytorch"


def fake_site(root: Path, version: Optional[str] = None, *, module_source: Optional[str] = None) -> Path:
    """A site directory holding the double as ``oneccl_bind_pt <version>`` (default: a source
    build's version that mismatches the installed torch, :data:`MISMATCHED_VERSION`);
    ``module_source`` replaces the double's code (for a module that must behave otherwise)."""
    version = MISMATCHED_VERSION if version is None else version
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"oneccl_bind_pt-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: oneccl_bind_pt\nVersion: {version}\n")
    shutil.copytree(DOUBLE / MODULE, root / MODULE, ignore=shutil.ignore_patterns("__pycache__"))
    if module_source is not None:
        (root / MODULE / "__init__.py").write_text(module_source)
    return root


def torch_minor_version() -> str:
    """``<major>.<minor>.0`` of the installed torch: a bindings version that matches it."""
    from importlib.metadata import version

    from packaging.version import Version

    rel = Version(version("torch")).release
    return f"{rel[0]}.{rel[1]}.0"


#: What a source build of intel/torch-ccl says it is, whatever torch it was built for (the
#: pure tests pair it with an injected torch 2.13).
SOURCE_BUILD_VERSION = "2.8.0+xpu"


def _mismatched_version() -> str:
    """A source build's version made to name another torch than the *installed* one
    (``2.7.0+xpu`` on torch 2.8), so the end-to-end tests always meet a version mismatch."""
    return "2.7.0+xpu" if torch_minor_version() == "2.8.0" else SOURCE_BUILD_VERSION


#: For end-to-end tests on the installed torch (see above); ``fake_site``'s default.
MISMATCHED_VERSION = _mismatched_version()
