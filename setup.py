"""cpuddp's build: pyproject.toml says everything but one step -- the shm engine's native library.

``pip install .`` (and ``pip wheel``, ``python -m build``) compile
``cpuddp/backends/shm/native/engine.c`` with the C compiler (``$CC``, which may hold arguments,
else ``cc``) into a plain shared library in the wheel (no Python tag: one build serves every
Python and torch), and write its build record beside it.  The step is optional: without a
compiler, or when the compile fails, the install goes on, the Python engine runs and ``cpuddp
doctor`` says why (from the record).  ``pip install -e .`` does not come here: pyproject.toml's
backend (``tools/cpuddp_build.py``) builds the library beside the sources, and keeps one whose
sources, compiler and flags did not change.

A wheel is tagged for what it carries: ``py3-none-<platform>``, the platform read from the
library built (its machine and the newest glibc it needs: ``native/elf.py``), so one wheel per
platform serves every Python 3 and torch; ``py3-none-any`` when no library was built.  ``CC``
picks the target: docs/install.md builds the manylinux 2.17 wheels with zig's C compiler.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools older than 70.1 (pip install --no-build-isolation in an older venv)
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.path.join("cpuddp", "backends", "shm", "native")
sys.path.insert(0, os.path.join(HERE, "tools"))
from cpuddp_build import build_native, native_module  # noqa: E402 - pyproject's backend, beside this file


class BuildPyWithNative(build_py):
    """build_py, then the native library into the build tree (editable installs: tools/cpuddp_build.py)."""

    def run(self):
        super().run()
        self.distribution.cpuddp_native_library = build_native(os.path.join(self.build_lib, NATIVE))


class WheelForItsLibrary(bdist_wheel):
    """A wheel tagged for the library it carries (py3-none-<platform>), or py3-none-any without one."""

    def run(self):
        if not self.skip_build:
            self.run_command("build")
        elif not hasattr(self.distribution, "cpuddp_native_library"):  # built by an earlier command
            built = os.path.join(self.get_finalized_command("build_py").build_lib, NATIVE, native_module("build").LIB_NAME)
            self.distribution.cpuddp_native_library = built if os.path.exists(built) else None
        self.root_is_pure = self._library() is None
        if not self.root_is_pure:  # install's root goes to platlib, the wheel's root (Root-Is-Purelib: false)
            self.distribution.has_ext_modules = lambda: True
        super().run()

    def get_tag(self):
        library = self._library()
        if library is None:
            return "py3", "none", "any"
        elf = native_module("elf")
        return "py3", "none", elf.platform_tag(elf.read_file(library))

    def _library(self):
        """The library the build put in the build tree (an editable install's is beside the sources)."""
        path = getattr(self.distribution, "cpuddp_native_library", None)
        lib_dir = os.path.abspath(self.get_finalized_command("build_py").build_lib)
        if path is None or not os.path.abspath(path).startswith(lib_dir + os.sep):
            return None
        return path


setup(cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": WheelForItsLibrary})
