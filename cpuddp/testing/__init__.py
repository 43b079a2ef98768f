"""testing: test DDP code on N gloo ranks in CI, ``run_distributed`` and the pytest plugin.

Owns: starting the ranks and collecting their results (:mod:`.world`), the rank side
(:mod:`.rank`), shipping the test's function to the ranks (:mod:`.ship`) and the pytest plugin
(:mod:`.plugin`: fixtures, marker, ini option).  Usage: :mod:`.world`'s docstring and
docs/testing.md.
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.launchers`, :mod:`cpuddp.distributed`,
:mod:`cpuddp._procs`.

This package is public: the names below are importable from ``cpuddp.testing``, and pytest
loads it as a plugin (entry point ``pytest11: cpuddp``, or ``pytest_plugins = ["cpuddp.testing"]``):
the plugin's hooks and fixtures are handed on here when pytest is installed.
"""

from .world import (
    LAUNCHER_ENV_NAMES,
    LAUNCHER_ENV_PREFIXES,
    clean_environ,
    is_launcher_variable,
    run_distributed,
)

try:
    import pytest  # noqa: F401  (run_distributed works without pytest; the plugin needs it)
except ImportError:  # pragma: no cover
    pass
else:
    from .plugin import (  # noqa: F401  (pytest finds them on this module)
        _cpuddp_isolate_env,
        clean_launcher_env,
        pytest_addoption,
        pytest_configure,
        run_distributed_fixture,
    )

__all__ = ["run_distributed", "clean_environ", "is_launcher_variable", "LAUNCHER_ENV_PREFIXES", "LAUNCHER_ENV_NAMES"]
