"""testing: test DDP code on N gloo ranks in CI, ``run_distributed`` and the pytest plugin.

Owns: starting the ranks and collecting their results (:mod:`.world`), the rank side
(:mod:`.rank`), shipping the test's function to the ranks (:mod:`.ship`) and the pytest plugin
(:mod:`.plugin`: fixtures, marker, ini option).  Usage: :mod:`.world`'s docstring and
docs/testing.md.
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._package`, :mod:`cpuddp.launchers`, :mod:`cpuddp.distributed`,
:mod:`cpuddp._procs`.

This package is public: the names below are importable from ``cpuddp.testing``, each loaded
from its module on first use (a rank that imports :mod:`.rank` imports neither pytest nor the
parent's side).  pytest loads this package as a plugin (entry point ``pytest11: cpuddp``, or
``pytest_plugins = ["cpuddp.testing"]``): where pytest is installed, the plugin's hooks and
fixtures are among the names, bound here at import when pytest is already imported (pytest
reads a plugin's hooks from the module itself).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from cpuddp._package import lazy_names

# public name -> module of this package that defines it (loaded on first use)
_EXPORTS = {
    "run_distributed": "world",
    "clean_environ": "world",
    "is_launcher_variable": "world",
    "LAUNCHER_ENV_PREFIXES": "world",
    "LAUNCHER_ENV_NAMES": "world",
}
__all__ = list(_EXPORTS)

#: The plugin's hooks and fixtures (not in ``__all__``): handed on only where pytest is installed.
_PLUGIN = ("pytest_addoption", "pytest_configure", "clean_launcher_env", "_cpuddp_isolate_env", "run_distributed_fixture")
if importlib.util.find_spec("pytest") is not None:
    _EXPORTS.update(dict.fromkeys(_PLUGIN, "plugin"))

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

if "pytest" in sys.modules:  # loaded as pytest's plugin: pluggy reads hooks from the module's own names
    from .plugin import (  # noqa: F401
        _cpuddp_isolate_env,
        clean_launcher_env,
        pytest_addoption,
        pytest_configure,
        run_distributed_fixture,
    )

if TYPE_CHECKING:  # pragma: no cover  # noqa: F401 (names for type checkers)
    from .world import (
        LAUNCHER_ENV_NAMES,
        LAUNCHER_ENV_PREFIXES,
        clean_environ,
        is_launcher_variable,
        run_distributed,
    )
