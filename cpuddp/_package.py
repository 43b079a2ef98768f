"""The package's own facts and mechanics: its version, and public names loaded on first use.

``__version__`` is written here once (pyproject.toml reads it).  :func:`lazy_names` gives a
package the ``__getattr__`` and ``__dir__`` (PEP 562) that load each public name from its module
on first use, where that keeps an import light that people pay for: ``cpuddp`` itself (its
names import torch), ``cpuddp.launchers`` (every area imports one of its modules) and
``cpuddp.testing`` (pytest imports it in every session); docs/code.md, "Lazy names", has the
measurements.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping, Tuple

__version__ = "0.1.0"

__all__ = ["__version__", "lazy_names"]


def lazy_names(package: str, exports: Mapping[str, str],
               fresh: Tuple[str, ...] = ()) -> Tuple[Callable[[str], Any], Callable[[], list]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public ``name`` lives in
    ``package + "." + exports[name]``.  A loaded name is kept in the package, so later accesses
    (``cpuddp.reduce_mean`` in a training loop) are plain attribute reads; a name in ``fresh``,
    which its module rebinds (:data:`cpuddp.launchers.READERS` after ``register_launcher``), is
    asked of the module at every access instead.  Any other name is an ``AttributeError``
    (which also lets ``from package import submodule`` find a submodule)."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        if name not in fresh:
            namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
