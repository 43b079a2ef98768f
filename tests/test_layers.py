"""The package's layers only point down (docs/code.md draws them).

Every import of every module counts: at the top, inside a function, under ``TYPE_CHECKING``.
An area may import its own modules and the areas of the layers below its own, never one of its
layer or above; no module imports itself back through any chain; and each subpackage's
docstring says what it owns and what it may import, and the code keeps to that.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cpuddp"

#: Bottom first.  A module's area is the first name of its path under cpuddp/ (``backends``
#: for ``cpuddp/backends/shm/group.py``, ``distributed`` for ``cpuddp/distributed.py``); the
#: package's own ``__init__`` is "public names", the top.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {"base": ("errors", "_units", "_compat", "_package")},
    {"topology": ("topology",)},
    {"launchers": ("launchers",)},
    {"affinity": ("affinity",)},
    {"backends": ("backends", "shm")},
    {"watchdog": ("watchdog",)},
    {"session": ("distributed", "ddp_check", "ranks")},
    {"train": ("train",)},
    {"processes": ("_procs",)},
    {"testing": ("testing",), "bench": ("bench",), "doctor": ("doctor",), "run": ("run",),
     "lightning": ("lightning",)},
    {"command line": ("__main__",)},
    {"public names": ("__init__",)},
)

def _module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _imports(name: str) -> Iterator[tuple[str, str]]:
    """``(target module, name taken)`` for every cpuddp import in module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cpuddp":
                    yield alias.name, ""
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "cpuddp":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield (sub, "") if sub in MODULES else (source, alias.name)


def _area(module: str) -> str:
    first = module.split(".")[1] if "." in module else "__init__"
    for layer in LAYERS:
        for area, firsts in layer.items():
            if first in firsts:
                return area
    raise AssertionError(f"{module} is in no area of LAYERS: place cpuddp/{first} in a layer (and docs/code.md)")


def _level(area: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if area in layer)


def test_every_module_has_an_area_and_every_area_exists():
    areas = {_area(m) for m in MODULES}
    named = {a for layer in LAYERS for a in layer}
    assert areas == named, f"areas in LAYERS with no module: {sorted(named - areas)}"


def test_no_area_imports_its_own_layer_or_one_above():
    wrong = []
    for module in MODULES:
        mine = _area(module)
        for target, taken in _imports(module):
            theirs = _area(target)
            if theirs == mine or _level(theirs) < _level(mine):
                continue
            wrong.append(f"{module} ({mine}) imports {target}{'.' + taken if taken else ''} ({theirs})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def _cycle() -> list[str]:
    graph = {m: sorted({t for t, _ in _imports(m) if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return []

    for m in graph:
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_no_import_circle():
    circle = _cycle()
    assert not circle, "import circle: " + " -> ".join(circle)


def test_the_checks_can_fail(monkeypatch):
    """A made-up upward import and a made-up circle are both seen."""
    real = _imports

    def fake(name: str) -> Iterator[tuple[str, str]]:
        yield from real(name)
        if name == "cpuddp.errors":
            yield "cpuddp.distributed", "init_distributed"

    monkeypatch.setattr(f"{__name__}._imports", fake)
    with pytest.raises(AssertionError, match=r"cpuddp.errors \(base\) imports cpuddp.distributed"):
        test_no_area_imports_its_own_layer_or_one_above()
    assert "cpuddp.errors" in _cycle()


# --------------------------------------------------------------------------- the subpackages say so

SUBPACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and m != "cpuddp")


def _may_import(package: str) -> set[str]:
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert "Owns:" in doc, f"{package}'s docstring should say what it owns ('Owns: ...')"
    match = re.search(r"^May import: (.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    assert match, f"{package}'s docstring should say what it may import ('May import: ...')"
    return set(re.findall(r"cpuddp\.([\w.]+)", match.group(1)))


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_a_subpackage_imports_only_what_its_docstring_allows(package):
    allowed = {f"cpuddp.{n}" for n in _may_import(package)}
    mine = _area(package)
    for name in allowed:
        assert _level(_area(name)) < _level(mine), f"{package}'s docstring allows {name}, which is not below it"
    wrong = []
    for module in (m for m in MODULES if m == package or m.startswith(package + ".")):
        for target, _ in _imports(module):
            if target == package or target.startswith(package + "."):
                continue
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} imports {target}")
    assert not wrong, f"not in {package}'s 'May import:' list:\n" + "\n".join(wrong)


def test_at_most_a_dozen_modules_sit_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def test_every_module_named_in_a_string_exists():
    """Lookups by name (``sys.modules.get``, ``import_module``, a backend's ``module=``) are no
    arrows for the checks above: each name they use must still be a module of the package."""
    named = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            args = list(node.args) + [k.value for k in node.keywords if k.arg == "module"]
            func = ast.unparse(node.func)
            if func.endswith(("modules.get", "import_module")) or any(k.arg == "module" for k in node.keywords):
                named |= {(module, a.value) for a in args
                          if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("cpuddp.")}
    assert named, "the scan found no lookup by name: it is broken"
    missing = [f"{m} names {n}" for m, n in sorted(named) if n not in MODULES]
    assert not missing, "no such module:\n" + "\n".join(missing)
