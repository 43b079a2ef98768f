"""cpuddp's build: pyproject.toml says everything but one step -- the shm engine's native library.

``pip install .`` and ``pip install -e .`` compile ``cpuddp/backends/shm/native/engine.c`` with
the system C compiler into a plain shared library beside it (no Python tag: one build serves
every Python and torch).  The step is optional: without a compiler, or when the compile fails,
the install goes on and the Python engine runs (``cpuddp doctor`` says which data path a node
takes, and why).
"""

import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.path.join("cpuddp", "backends", "shm", "native")


def _builder():
    """cpuddp/backends/shm/native/build.py, loaded by path (the package is not importable here)."""
    spec = importlib.util.spec_from_file_location("_cpuddp_native_build", os.path.join(HERE, NATIVE, "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithNative(build_py):
    """build_py, then the native library: into the build tree, or beside the sources (editable)."""

    def run(self):
        super().run()
        builder = _builder()
        target = os.path.join(HERE if self.editable_mode else self.build_lib, NATIVE)
        try:
            os.makedirs(target, exist_ok=True)
            path = builder.build(os.path.join(target, builder.LIB_NAME), where=os.path.join(HERE, NATIVE))
        except (RuntimeError, OSError) as exc:
            print(f"cpuddp: the shm engine's native library was not built ({exc}); the Python engine will run",
                  file=sys.stderr)
        else:
            print(f"cpuddp: built the shm engine's native library: {path}")


setup(cmdclass={"build_py": BuildPyWithNative})
