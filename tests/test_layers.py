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
#: for ``cpuddp/backends/shm/group/process_group.py``, ``distributed`` for ``cpuddp/distributed.py``); the
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

#: train's subpackages, bottom first: each imports only those below it; the modules at train's top
#: (prepare, loop, grads, progress) import any.
TRAIN_LAYERS = ("common", "precision", "sharding", "strategies", "checkpoint")

#: The shm backend's rooms, bottom first: each imports only those below it (and shm's doors,
#: ``api`` and ``backend``, modules of its parent); the doors import any room.
SHM = "cpuddp.backends.shm"
SHM_LAYERS = ("native", "protocol", "python", "routes", "cross", "group")


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
        if name == "cpuddp.train.common.rank0":
            yield "cpuddp.train.checkpoint.save", "save_checkpoint"
        if name == "cpuddp.backends.shm.protocol.segment":
            yield "cpuddp.backends.shm.routes.stream", "ShmWork"

    monkeypatch.setattr(f"{__name__}._imports", fake)
    with pytest.raises(AssertionError, match=r"cpuddp.errors \(base\) imports cpuddp.distributed"):
        test_no_area_imports_its_own_layer_or_one_above()
    assert "cpuddp.errors" in _cycle()
    assert _train_upward(MODULES) == ["cpuddp.train.common.rank0 imports cpuddp.train.checkpoint.save.save_checkpoint"]
    assert _shm_upward(MODULES) == ["cpuddp.backends.shm.protocol.segment imports "
                                    "cpuddp.backends.shm.routes.stream.ShmWork"]


# --------------------------------------------------------------------------- the subpackages say so

SUBPACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and m != "cpuddp")


def _may_import(package: str) -> set[str]:
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert "Owns:" in doc, f"{package}'s docstring should say what it owns ('Owns: ...')"
    match = re.search(r"^May import: (.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    assert match, f"{package}'s docstring should say what it may import ('May import: ...')"
    return set(re.findall(r"cpuddp\.([\w.]+)", match.group(1)))


def _train_level(module: str) -> int:
    """The layer of a module of train among :data:`TRAIN_LAYERS` (train's top: above them all)."""
    parts = module.split(".")
    sub = parts[2] if len(parts) > 3 or (len(parts) == 3 and MODULES[module].name == "__init__.py") else None
    return TRAIN_LAYERS.index(sub) if sub in TRAIN_LAYERS else len(TRAIN_LAYERS)


def _shm_level(module: str) -> int:
    """The layer of a module of the shm backend among :data:`SHM_LAYERS` (shm's doors and its
    ``__init__``: above them all)."""
    parts = module.split(".")
    return SHM_LAYERS.index(parts[3]) if len(parts) > 3 and parts[3] in SHM_LAYERS else len(SHM_LAYERS)


def _in_shm(module: str) -> bool:
    return module == SHM or module.startswith(SHM + ".")


def _below(name: str, package: str) -> bool:
    """Is ``name`` in a layer below ``package``'s (inside train and shm: a lower subpackage)?"""
    if _area(name) == _area(package) == "train":
        return _train_level(name) < _train_level(package)
    if _in_shm(name) and _in_shm(package):
        return _shm_level(name) < _shm_level(package)
    return _level(_area(name)) < _level(_area(package))


def _parents_module(name: str, package: str) -> bool:
    """Is ``name`` a module (not a package) of a package that encloses ``package`` -- the
    interface a subpackage implements (``backends.shm`` implements ``backends.types``' backend),
    or a door of its own (``backends.shm.api``)?  The circle test keeps that module from
    importing the subpackage back."""
    return (package.startswith(name.rpartition(".")[0] + ".") and name in MODULES
            and MODULES[name].name != "__init__.py")


def _shm_upward(modules: dict[str, Path]) -> list[str]:
    wrong = []
    for module in (m for m in modules if _in_shm(m) and _shm_level(m) < len(SHM_LAYERS)):
        for target, taken in _imports(module):
            if _in_shm(target) and target != SHM and _shm_level(target) > _shm_level(module) \
                    and not _parents_module(target, module.rpartition(".")[0]):
                wrong.append(f"{module} imports {target}{'.' + taken if taken else ''}")
    return wrong


def test_shm_rooms_import_only_those_below():
    assert set(SHM_LAYERS) == {m.split(".")[3] for m in SUBPACKAGES if m.startswith(SHM + ".")}
    wrong = _shm_upward(MODULES)
    assert not wrong, "shm: imports that point up or sideways (SHM_LAYERS):\n" + "\n".join(wrong)


#: a private of the group (or of an engine) reached from a route, as the review grepped for it:
#: ``g._run(``, ``group._local(``, ``self.g._queues(``, ``eng._cap(``
_GROUP_PRIVATE = re.compile(r"(?:g|group)\._\w")


def test_no_shm_route_reaches_into_the_group():
    """The routes and the hierarchy run a call through the executor the group hands them
    (``routes/executor.py``), never through a private of the group."""
    assert _GROUP_PRIVATE.search("return self.g._run(kind)") and not _GROUP_PRIVATE.search("self.ex.run(kind)")
    wrong = [f"{m}:{i}: {line.strip()}" for m, path in MODULES.items()
             if m.startswith((SHM + ".routes", SHM + ".cross"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if _GROUP_PRIVATE.search(line)]
    assert not wrong, "shm routes that reach into the group:\n" + "\n".join(wrong)


def _train_upward(modules: dict[str, Path]) -> list[str]:
    wrong = []
    for module in (m for m in modules if m.startswith("cpuddp.train.")):
        for target, taken in _imports(module):
            if target.startswith("cpuddp.train.") and _train_level(target) > _train_level(module):
                wrong.append(f"{module} imports {target}{'.' + taken if taken else ''}")
    return wrong


def test_train_subpackages_import_only_those_below():
    assert set(TRAIN_LAYERS) == {m.split(".")[2] for m in SUBPACKAGES if m.startswith("cpuddp.train.")}
    wrong = _train_upward(MODULES)
    assert not wrong, "train: imports that point up or sideways (TRAIN_LAYERS):\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_a_subpackage_imports_only_what_its_docstring_allows(package):
    allowed = {f"cpuddp.{n}" for n in _may_import(package)}
    for name in allowed:
        assert _below(name, package) or _parents_module(name, package), (
            f"{package}'s docstring allows {name}, which is not below it (nor a module of its parent package)")
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


# --------------------------------------------------------------------------- one owner for each fact
#
# Each check below is a pure function of ``{module: source}``, so a made-up module shows that it
# can fail (``test_the_owner_checks_can_fail``).

SOURCES = {m: p.read_text() for m, p in MODULES.items()}

HERE = "cpuddp.topology.here"

#: What this process may use and who it is on this node: read by one module only.  A call of the
#: attribute, or a string constant that is no docstring, counts as a read.
FACT_CALLS = {"sched_getaffinity": HERE, "cpu_affinity": HERE, "gethostname": HERE}
FACT_STRINGS = {"/proc/self/ns": HERE, "boot_id": HERE}

#: Names each defined once, at the top of their owner, and imported from the owner, never from a
#: module that re-exports them.
OWNERS = {
    "allowed_cpus": HERE, "hostname": HERE, "host_identity": HERE, "hostname_of": HERE, "machine_of": HERE,
    "pid_alive": HERE, "pid_namespace": HERE, "namespace_id": HERE,
    "HostRecord": "cpuddp.launchers.hosts", "parse_record": "cpuddp.launchers.hosts",
    "STORE_FIX": "cpuddp.launchers.store_values",
    "agree_backend": "cpuddp.backends.agreement",
    "BenchConfig": "cpuddp.bench.config", "RunConfig": "cpuddp.run.command",
    "DoctorConfig": "cpuddp.doctor.command", "PrepareOptions": "cpuddp.train.strategies.options",
}

#: The command-line edges: only they parse arguments; below them a typed config travels.
ARGPARSE_EDGES = {"cpuddp.__main__", "cpuddp.bench.cli", "cpuddp.run.command", "cpuddp.doctor.command",
                  # `python -m cpuddp.backends.shm.native.build`: setup.py and CI build the library with it
                  "cpuddp.backends.shm.native.build"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _fact_readers(sources: dict[str, str]) -> list[str]:
    wrong = []
    for module, source in sources.items():
        tree = ast.parse(source)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = FACT_CALLS.get(node.func.attr)
                if owner and module != owner:
                    wrong.append(f"{module}:{node.lineno} calls {node.func.attr} (owner: {owner})")
                if (node.func.attr == "kill" and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)
                        and node.args[1].value == 0 and module != HERE):
                    wrong.append(f"{module}:{node.lineno} asks whether a pid is alive (owner: {HERE}.pid_alive)")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for text, owner in FACT_STRINGS.items():
                    if text in node.value and module != owner:
                        wrong.append(f"{module}:{node.lineno} reads {text} (owner: {owner})")
    return wrong


def test_one_module_reads_this_processs_facts():
    wrong = _fact_readers(SOURCES)
    assert not wrong, "facts of this process read outside their owner:\n" + "\n".join(wrong)


def _defined_at_top(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _owner_breaches(sources: dict[str, str]) -> list[str]:
    wrong = []
    defined = {name: [] for name in OWNERS}
    for module, source in sources.items():
        tree = ast.parse(source)
        for name in _defined_at_top(tree) & set(OWNERS):
            defined[name].append(module)
    for name, where in defined.items():
        if where != [OWNERS[name]]:
            wrong.append(f"{name} is defined in {sorted(where) or 'no module'} (owner: {OWNERS[name]})")
    for module in sources:
        for target, taken in _imports_in(module, sources[module]):
            if taken in OWNERS and target != OWNERS[taken] and module != OWNERS[taken]:
                wrong.append(f"{module} imports {taken} from {target} (owner: {OWNERS[taken]})")
        for line, target, name in _attributes(module, sources[module]):
            if name in OWNERS and target != OWNERS[name]:
                wrong.append(f"{module}:{line} reads {target}.{name} (owner: {OWNERS[name]})")
    return wrong


def _imports_in(module: str, source: str) -> Iterator[tuple[str, str]]:
    if module in MODULES and SOURCES.get(module) == source:
        yield from _imports(module)
        return
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source_mod = ".".join(base + [node.module])
            for alias in node.names:
                yield source_mod, alias.name


def test_each_shared_name_has_one_owner():
    wrong = _owner_breaches(SOURCES)
    assert not wrong, "\n".join(wrong)


def _bound_modules(module: str, source: str) -> dict[str, str]:
    """Names bound to a module of the package by ``from ... import module``."""
    is_package = module in MODULES and MODULES[module].name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    bound = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            src = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{src}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{src}.{alias.name}"
    return bound


def _attributes(module: str, source: str) -> Iterator[tuple[int, str, str]]:
    """``(line, module, name)`` for each ``module.name`` read through a bound module."""
    bound = _bound_modules(module, source)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            yield node.lineno, bound[node.value.id], node.attr


def _private_crossings(sources: dict[str, str]) -> list[str]:
    """``from cpuddp.x import _name`` and ``x._name`` across areas (a private module such as
    ``cpuddp._compat`` is a module, not a private name)."""
    wrong = []
    for module, source in sources.items():
        mine = _area(module)
        for target, taken in _imports_in(module, source):
            if taken.startswith("_") and not taken.startswith("__") and _area(target) != mine:
                wrong.append(f"{module} imports {target}.{taken}")
        for line, target, name in _attributes(module, source):
            if name.startswith("_") and not name.startswith("__") and _area(target) != mine:
                wrong.append(f"{module}:{line} uses {target}.{name}")
    return wrong


def test_no_private_name_crosses_an_area():
    wrong = _private_crossings(SOURCES)
    assert not wrong, "private names used from another area:\n" + "\n".join(wrong)


def _oversized(sources: dict[str, str], module_limit: int = 500, function_limit: int = 60) -> list[str]:
    wrong = []
    for module, source in sources.items():
        if source.count("\n") > module_limit:
            wrong.append(f"{module}: {source.count(chr(10))} lines (limit {module_limit})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > function_limit:
                    wrong.append(f"{module}:{node.lineno} {node.name}: {length} lines (limit {function_limit})")
    return wrong


def test_no_module_over_500_lines_and_no_function_over_60():
    wrong = _oversized(SOURCES)
    assert not wrong, "split these:\n" + "\n".join(wrong)


def _globals(sources: dict[str, str], module: str = "cpuddp.distributed") -> list[str]:
    return [f"{module}:{n.lineno} global {', '.join(n.names)}"
            for n in ast.walk(ast.parse(sources[module])) if isinstance(n, ast.Global)]


def test_the_session_state_lives_in_one_object():
    wrong = _globals(SOURCES)
    assert not wrong, "the session's state belongs to its one object:\n" + "\n".join(wrong)


def _names_written_twice(sources: dict[str, str], module: str = "cpuddp.launchers.readers") -> list[str]:
    """A reader records where a value came from as it reads it; a variable's name written again
    into ``sources`` is a second copy that can drift."""
    wrong = []
    for node in ast.walk(ast.parse(sources[module])):
        values = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                and ast.unparse(node.func.value).endswith("sources"):
            values = [k.value for k in node.keywords] + list(node.args)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and ast.unparse(t.value).endswith("sources") for t in node.targets):
            values = [node.value]
        for value in values:
            names = [c.value for c in ast.walk(value) if isinstance(c, ast.Constant)
                     and isinstance(c.value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]+", c.value)]
            if names:
                wrong.append(f"{module}:{node.lineno} writes {', '.join(names)} into sources")
    return wrong


def test_readers_name_each_variable_once():
    readers = [m for m in SOURCES if m == "cpuddp.launchers.readers" or m.startswith("cpuddp.launchers.read_")]
    assert len(readers) > 1, "the scan found no launcher's reader: it is broken"
    wrong = [w for module in readers for w in _names_written_twice(SOURCES, module)]
    assert not wrong, "\n".join(wrong)


def _argparse_users(sources: dict[str, str]) -> list[str]:
    return sorted({m for m, s in sources.items() for n in ast.walk(ast.parse(s))
                   if ((isinstance(n, ast.Import) and any(a.name == "argparse" for a in n.names))
                       or (isinstance(n, ast.ImportFrom) and n.module == "argparse"))
                   and m not in ARGPARSE_EDGES})


def test_only_the_command_line_edges_parse_arguments():
    wrong = _argparse_users(SOURCES)
    assert not wrong, f"argparse below the edges (pass a typed config instead): {wrong}"


def _untyped_options(sources: dict[str, str]) -> list[str]:
    """Parameters named ``options`` in cpuddp/train whose annotation is no typed, frozen config:
    missing, or a mapping (``Mapping``, ``dict``, ``Any``).  prepare() reads its keyword arguments
    once into ``PrepareOptions`` and hands that down (docs/code.md: a frozen config built once)."""
    loose = ("Mapping", "dict", "Dict", "Any")
    wrong = []
    for module, source in sources.items():
        if not module.startswith("cpuddp.train."):
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]:
                if arg.arg != "options":
                    continue
                note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if not note or any(word in note for word in loose):
                    wrong.append(f"{module}:{node.lineno} takes options: {note or '(no annotation)'}")
    return wrong


def test_train_passes_its_options_typed():
    wrong = _untyped_options(SOURCES)
    assert not wrong, "an untyped options mapping crosses cpuddp/train (pass PrepareOptions):\n" + "\n".join(wrong)


def test_the_owner_checks_can_fail():
    made_up = {
        "cpuddp.train.made_up": (
            '"""Reads os.sched_getaffinity in its docstring: that is no read."""\n'
            "import os, argparse\n"
            "from ..launchers.hosts import allowed_cpus\n"
            "from ..affinity.pin import _set_affinity\n"
            "from .. import affinity\n"
            "def allowed_cpus():\n    global X\n    return os.sched_getaffinity(0), open('/proc/self/ns/pid')\n"
            "os.kill(1, 0)\n"
            "affinity._secret()\n"
            "from ..launchers import hosts\nhosts.pid_alive(1)\n"
        ),
        "cpuddp.launchers.readers": 'out.sources.update(rank="RANK")\nout.sources["x"] = v.first("A_B") or ""\n',
        "cpuddp.distributed": "def f():\n    global _current\n",
        "cpuddp.run.made_up": "from argparse import Namespace\n",
    }
    assert len(_fact_readers(made_up)) == 3
    assert any("allowed_cpus is defined in" in w for w in _owner_breaches({**SOURCES, **made_up}))
    assert any("imports allowed_cpus from cpuddp.launchers.hosts" in w for w in _owner_breaches(made_up))
    assert any("reads cpuddp.launchers.hosts.pid_alive" in w for w in _owner_breaches(made_up))
    assert len(_private_crossings(made_up)) == 2
    assert _oversized(made_up, module_limit=3, function_limit=2)
    assert _globals(made_up) and _globals(made_up, "cpuddp.train.made_up")
    assert len(_names_written_twice(made_up)) == 2
    assert _argparse_users(made_up) == ["cpuddp.run.made_up", "cpuddp.train.made_up"]
    loose = {"cpuddp.train.made_up": "def f(options: Mapping[str, Any]): pass\ndef g(x, options): pass\n"
                                     "def h(*, options: dict): pass\ndef k(options: PrepareOptions): pass\n",
             "cpuddp.run.made_up": "def f(options: dict): pass\n"}
    assert [w.split(" takes")[0] for w in _untyped_options(loose)] == [
        "cpuddp.train.made_up:1", "cpuddp.train.made_up:2", "cpuddp.train.made_up:3"]


def _mpi4py_importers(sources: dict[str, str]) -> list[str]:
    """Modules that import mpi4py: one owns MPI's start (cpuddp.launchers.mpi), every other asks it."""
    found = set()
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "mpi4py" for n in names):
                found.add(module)
    return sorted(found)


def test_one_module_imports_mpi4py():
    assert _mpi4py_importers(SOURCES) == ["cpuddp.launchers.mpi"]
    assert _mpi4py_importers({"cpuddp.x": "def f():\n    from mpi4py import MPI\n"}) == ["cpuddp.x"]
