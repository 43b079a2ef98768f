"""Shipping ``fn`` to the ranks of :func:`cpuddp.testing.run_distributed`: pickling the call,
and the import hooks that let a rank load the user's modules from the files the parent loaded
them from -- rewriting ``assert`` statements where pytest did (``--import-mode=importlib`` too).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pickle
import pickletools
import sys
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["LOAD_FIX", "dumps_call", "ModuleRef", "module_refs", "RankFinder"]

LOAD_FIX = (
    "define fn (and the classes of its arguments) at module level in a module the ranks can "
    "import: a test module, conftest.py or a package on sys.path; not a lambda, a nested "
    "function or a module made at run time"
)


def dumps_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    if not callable(fn):
        raise TypeError(f"run_distributed: fn must be callable, got {type(fn).__name__}")
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"run_distributed: cannot pickle fn {getattr(fn, '__qualname__', fn)!r} or its arguments "
            f"({type(exc).__name__}: {exc}); {LOAD_FIX}"
        ) from exc


class ModuleRef(NamedTuple):
    file: Optional[str]  # None for a namespace package
    path: Optional[list[str]]  # __path__ of a package, else None
    rewrite: bool  # pytest rewrote its asserts in the parent


def module_refs(payload: bytes, fn: Any) -> dict[str, ModuleRef]:
    """The user's modules the payload refers to, with the files the parent loaded them from.

    The ranks need them when pytest imported a test module in a way plain ``import`` cannot
    repeat (``--import-mode=importlib``), and to rewrite asserts as pytest did."""
    names = {getattr(fn, "__module__", None)}
    for op, arg, _ in pickletools.genops(payload):
        if isinstance(arg, str):
            names.add(arg.split(" ")[0] if op.name in ("GLOBAL", "INST") else arg)
    names = {n for n in names if isinstance(n, str) and n in sys.modules and n not in ("__main__", "__mp_main__")}
    for name in list(names):  # and their parent packages
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    skip = _installed_roots()
    refs: dict[str, ModuleRef] = {}
    for name in sorted(names):
        mod = sys.modules.get(name)
        file = getattr(mod, "__file__", None)
        path = getattr(mod, "__path__", None)
        if mod is None or (file is None and path is None):
            continue
        if file is not None and not file.endswith(".py"):
            continue
        where = file or next(iter(path), "")  # type: ignore[arg-type]
        if not where or os.path.abspath(where).startswith(skip):
            continue
        loader = getattr(getattr(mod, "__spec__", None), "loader", None)
        refs[name] = ModuleRef(file, list(path) if path is not None else None, type(loader).__name__ == "AssertionRewritingHook")
    return refs


def _installed_roots() -> tuple[str, ...]:
    import site
    import sysconfig

    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            roots.add(sysconfig.get_paths()[key])
    with contextlib.suppress(Exception):
        roots.update(site.getsitepackages())
    with contextlib.suppress(Exception):
        roots.add(site.getusersitepackages())
    return tuple(os.path.abspath(r) + os.sep for r in roots if r)


class _RankLoader(importlib.machinery.SourceFileLoader):
    """Loads a user module from the parent's file; rewrites asserts when pytest did."""

    def __init__(self, fullname: str, path: str, rewrite: bool) -> None:
        super().__init__(fullname, path)
        self.rewrite = rewrite

    def get_code(self, fullname: str) -> Any:
        source = self.get_data(self.path)
        if self.rewrite:
            try:  # pytest's own rewriter (a private API: fall back to plain asserts if it moves)
                from _pytest.assertion.rewrite import rewrite_asserts

                tree = ast.parse(source, filename=self.path)
                rewrite_asserts(tree, source, self.path, None)
                return compile(tree, self.path, "exec", dont_inherit=True)
            except Exception:
                pass
        return compile(source, self.path, "exec", dont_inherit=True)


class RankFinder(importlib.abc.MetaPathFinder):
    """First in ``sys.meta_path``: the modules pytest rewrote.  Last (``fallback``): any user
    module the normal import system cannot find, e.g. under ``--import-mode=importlib``."""

    def __init__(self, refs: dict[str, ModuleRef], fallback: bool) -> None:
        self.refs = refs
        self.fallback = fallback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        ref = self.refs.get(fullname)
        if ref is None or not (self.fallback or ref.rewrite):
            return None
        if ref.file is None:
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = list(ref.path or [])
            return spec
        return importlib.util.spec_from_file_location(
            fullname, ref.file, loader=_RankLoader(fullname, ref.file, ref.rewrite), submodule_search_locations=ref.path
        )
