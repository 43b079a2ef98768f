"""The shm engine's shared facts, defined once in ``cpuddp/backends/shm/native/layout.h``.

* Python reads the file (no compiler, no library) and its form is held: a broken table is an
  error naming its line;
* every name of it is defined there only -- no Python module of the shm backend assigns one,
  no C file defines one again (engine.c, kernels.h and the C tests include it);
* a loaded library was built from it (every value, the structs' sizes), and one built from
  another ``layout.h`` is refused, naming the word; a library built by hand without the source
  digest gets its group token from its own bytes.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cpuddp.backends.shm import native
from cpuddp.backends.shm.native import build as native_build
from cpuddp.backends.shm.native import layout

REPO = Path(__file__).resolve().parents[1]
SHM = REPO / "cpuddp" / "backends" / "shm"
C_SOURCES = [SHM / "native" / "engine.c", SHM / "native" / "kernels.h",
             *sorted((REPO / "tests" / "native").glob("*.c"))]


def test_the_header_reads_as_tables_and_field_lists():
    v = layout.VALUES
    assert (v["PAGE"], v["LINE"], v["RING"], v["DESC"]) == (4096, 128, 16, 64)
    assert layout.C_ARRIVED == 0 and layout.MAGIC == 0x6370756464707368 and layout.RC_BUSY == v["RC_BUSY"]
    assert layout.STATE_FIELDS[:2] == ("seq", "epoch") and layout.ENTRY_FIELDS[0] == "kind"
    assert len(layout.STATE_FIELDS) == 7 and len(layout.ENTRY_FIELDS) == 6
    assert native.ENTRY_WORDS == layout.DESC_WORDS + 6 and native.ISAS == ("scalar", "avx2", "avx512")


@pytest.mark.parametrize("text, words", [
    ('#define CPUDDP_SHM_SIZES(X) \\\n    X(PAGE, 4096, "ok") \\\n    X(LINE, oops, "no literal")\n',
     ["x.h:1", "CPUDDP_SHM_SIZES", "oops"]),
    ('#define CPUDDP_SHM_SIZES(X) \\\n    X(PAGE, 4096, "a") \\\n    X(PAGE, 8192, "b")\n', ["PAGE is defined twice"]),
    ('\n\n#define CPUDDP_SHM_STATE_FIELDS(F) \\\n    F(Seq, "capitals")\n', ["x.h:3", "STATE_FIELDS"]),
])
def test_a_broken_table_is_an_error_naming_its_line(text, words):
    with pytest.raises(ValueError) as err:
        layout.parse(text, "x.h")
    for word in words:
        assert word in str(err.value)


def _assigned_at_top(path: Path) -> set:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
    return names


def test_every_name_of_the_layout_is_defined_in_layout_h_only():
    names = set(layout.VALUES)
    again = [f"{p.relative_to(REPO)}: {sorted(_assigned_at_top(p) & names)}" for p in sorted(SHM.rglob("*.py"))
             if p.name != "layout.py" and _assigned_at_top(p) & names]
    pattern = re.compile(r"#\s*define\s+(\w+)\b|\b(\w+)\s*=\s*-?\d")
    for path in C_SOURCES:
        text = path.read_text()
        found = {a or b for a, b in pattern.findall(text)} & names
        if found:
            again.append(f"{path.relative_to(REPO)}: {sorted(found)}")
    assert not again, "layout.h's names defined again:\n" + "\n".join(again)


def test_the_check_of_the_names_can_fail(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("C_ARRIVED = 0\nx = 1\n")
    assert _assigned_at_top(module) & set(layout.VALUES) == {"C_ARRIVED"}


def test_the_loaded_library_was_built_from_this_layout():
    try:
        lib = native.load()
    except native.Unavailable as exc:
        pytest.skip(f"no native library here: {exc}")
    assert native._layout_problem(lib) is None
    assert lib.layout_count() == len(layout.VALUES) and lib.state_size() == 8 * len(layout.STATE_FIELDS)
    assert lib.entry_size() == 8 * native.ENTRY_WORDS


@pytest.fixture(scope="module")
def hand_built(tmp_path_factory) -> Path:
    """A library built by hand (no source digest: it reads ``unknown``) from the sources with
    one number of layout.h changed (WAIT_CHECK_NS)."""
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    where = tmp_path_factory.mktemp("hand_built")
    for name in native_build.SOURCES:
        shutil.copy(Path(native_build.HERE) / name, where / name)
    header = where / "layout.h"
    text, n = re.subn(r"X\(WAIT_CHECK_NS, \d+,", "X(WAIT_CHECK_NS, 30000000,", header.read_text())
    assert n == 1
    header.write_text(text)
    path = where / native_build.LIB_NAME
    flags = [f for f in native_build.FLAGS if not f.startswith(("-W", "-O"))] + ["-O0"]  # quick to build
    subprocess.run([*cc, *flags, "-o", str(path), str(where / "engine.c")], check=True)
    return path


def test_a_library_built_from_another_layout_is_refused_naming_the_word(hand_built, monkeypatch):
    lib = native._Lib(str(hand_built))
    assert native._layout_problem(lib) == "its WAIT_CHECK_NS is 30000000, this package's 20000000"

    def no_sources(where: str = native_build.HERE) -> str:  # an install without the C sources
        raise FileNotFoundError(where)

    monkeypatch.setattr(native_build, "digest", no_sources)
    got, why = native._load(str(hand_built.parent))
    assert got is None and "built from another layout.h (its WAIT_CHECK_NS is 30000000" in why, why
    assert "pip install again" in why


def test_a_library_built_without_the_source_digest_gets_a_token_from_its_own_bytes(hand_built):
    """The token a group agrees on: the digest's number; a library without one (by hand, loaded
    only where the sources are absent) is known by its bytes, never refused by a ValueError."""
    lib = native._Lib(str(hand_built))
    assert lib.digest() == b"unknown"
    token = native._token(lib)
    assert 0 < token < (1 << 63) and token == native._token(lib)
    try:
        mine = native.load()
    except native.Unavailable:
        return
    assert token != native._token(mine)
