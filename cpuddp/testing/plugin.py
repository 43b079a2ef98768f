"""The pytest plugin: the ``run_distributed`` and ``clean_launcher_env`` fixtures, the
``distributed(...)`` marker and the ``cpuddp_isolate_env`` ini option (docs/testing.md).

pytest loads it from :mod:`cpuddp.testing`, which hands these names on (entry point
``pytest11: cpuddp``, or ``pytest_plugins = ["cpuddp.testing"]``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping, Optional

import pytest

from .world import is_launcher_variable, run_distributed

__all__ = ["pytest_addoption", "pytest_configure", "clean_launcher_env", "run_distributed_fixture"]


_MARKER_OPTIONS = ("world_size", "timeout", "backend", "env", "pin", "threads")


def _restore_environ(saved: Mapping[str, str]) -> None:
    """Make ``os.environ`` equal to ``saved`` again."""
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _marker_options(node: Any) -> dict[str, Any]:
    marker = node.get_closest_marker("distributed")
    if marker is None:
        return {}
    if len(marker.args) > 1:
        raise TypeError(f"@pytest.mark.distributed takes at most one positional argument (world_size), got {marker.args}")
    opts = dict(marker.kwargs)
    if marker.args:
        if "world_size" in opts:
            raise TypeError("@pytest.mark.distributed: world_size given both by position and by name")
        opts["world_size"] = marker.args[0]
    unknown = sorted(set(opts) - set(_MARKER_OPTIONS))
    if unknown:
        raise TypeError(f"@pytest.mark.distributed got unknown option(s) {unknown}; it takes {list(_MARKER_OPTIONS)}")
    return opts


def pytest_addoption(parser: Any) -> None:
    parser.addini(
        "cpuddp_isolate_env",
        "cpuddp: hide launcher variables (RANK, PMI_*, SLURM_*, ...) from every test and "
        "restore the environment after it, as the clean_launcher_env fixture does",
        type="bool",
        default=False,
    )


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(world_size=2, *, timeout=60, backend='gloo', env=None, pin=False, threads=1): "
        "defaults for the cpuddp run_distributed fixture",
    )


@pytest.fixture
def clean_launcher_env(monkeypatch: Any) -> Iterator[None]:
    """Hide every launcher variable during the test; restore the environment after it.

    Variables the test (or code it calls, such as ``init_distributed``) sets are removed
    afterwards, and those it hid or changed come back.
    """
    # Hiding goes through monkeypatch, and this teardown runs before monkeypatch's
    # (it is set up first): so a test's own monkeypatch.setenv("RANK", ...) unwinds in
    # the right order, and direct os.environ writes are undone here.
    saved = dict(os.environ)
    for key in [k for k in os.environ if is_launcher_variable(k)]:
        monkeypatch.delenv(key)
    yield
    _restore_environ(saved)


@pytest.fixture(autouse=True)
def _cpuddp_isolate_env(request: Any) -> None:
    if request.config.getini("cpuddp_isolate_env"):
        request.getfixturevalue("clean_launcher_env")


@pytest.fixture(name="run_distributed")
def run_distributed_fixture(request: Any, clean_launcher_env: None) -> Callable[..., list[Any]]:
    """``run_distributed(fn, world_size=None, **options)``, defaults from ``@pytest.mark.distributed``."""
    defaults = _marker_options(request.node)

    def runner(fn: Callable[..., Any], world_size: Optional[int] = None, **options: Any) -> list[Any]:
        __tracebackhide__ = True
        opts = {**defaults, **options}
        size = opts.pop("world_size", 2) if world_size is None else world_size
        opts.pop("world_size", None)
        return run_distributed(fn, size, **opts)

    return runner
