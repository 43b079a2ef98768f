"""The in-tree build backend (tools/cpuddp_build.py): an editable install needs no build environment,
says what pyproject.toml says, maps ``cpuddp`` to the checkout and compiles nothing the second time.

The hooks run as pip runs them: in a fresh interpreter whose working directory is a copy of the
checkout, with ``tools/`` (pyproject's ``backend-path``) first on ``sys.path``.  The wheel and
sdist hooks are setuptools' (test_shm_build.py builds real wheels; CI builds the release files).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cpuddp.backends.shm.native import build as nb

REPO = Path(__file__).resolve().parents[1]
NATIVE = Path("cpuddp", "backends", "shm", "native")


def _checkout(tmp_path: Path) -> Path:
    """A copy of what an editable install reads: pyproject, README, tools/ and the package."""
    src = tmp_path / "src"
    (src / "tools").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "tools/cpuddp_build.py"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "cpuddp", src / "cpuddp", ignore=shutil.ignore_patterns(
        "__pycache__", nb.LIB_NAME, os.path.basename(nb.record_path(nb.LIB_NAME)), ".libcpuddp_shm-*"))
    return src


def _hook(src: Path, call: str, env=None) -> str:
    """``cpuddp_build.<call>`` as pip's hook runner calls it; what the call returns, as JSON."""
    code = f"import json, cpuddp_build as b; print(json.dumps(b.{call}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(src / "tools"), **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_build_system_asks_for_nothing_and_names_the_in_tree_backend():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    system = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    assert system == {"requires": [], "build-backend": "cpuddp_build", "backend-path": ["tools"]}
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import cpuddp_build
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert cpuddp_build.get_requires_for_build_editable() == []  # Python 3.11+: tomllib
    assert cpuddp_build.get_requires_for_build_wheel() == ["setuptools>=70.1"]
    assert cpuddp_build.get_requires_for_build_sdist() == ["setuptools>=70.1"]


def test_the_editable_metadata_is_what_pyproject_says(tmp_path):
    tomllib = pytest.importorskip("tomllib")
    src = _checkout(tmp_path)
    dist_info = _hook(src, f"prepare_metadata_for_build_editable({str(tmp_path)!r})")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    from cpuddp import __version__

    assert dist_info == f"cpuddp-{__version__}.dist-info"
    meta = (tmp_path / dist_info / "METADATA").read_text()
    head, _, body = meta.partition("\n\n")
    fields = [line.split(": ", 1) for line in head.splitlines()]
    assert ["Version", __version__] in fields and ["Requires-Python", project["requires-python"]] in fields
    requires = [value for key, value in fields if key == "Requires-Dist"]
    expected = list(project["dependencies"]) + [f'{req}; extra == "{extra}"'
                                                for extra, reqs in project["optional-dependencies"].items()
                                                for req in reqs]
    assert requires == expected
    assert [v for k, v in fields if k == "Provides-Extra"] == list(project["optional-dependencies"])
    assert body == (REPO / "README.md").read_text()
    entry_points = (tmp_path / dist_info / "entry_points.txt").read_text()
    assert "[console_scripts]\ncpuddp = cpuddp.__main__:main\n" in entry_points
    assert "[pytest11]\ncpuddp = cpuddp.testing\n" in entry_points


def test_an_extra_keeps_a_requirements_own_marker():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import cpuddp_build
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert cpuddp_build._with_extra('tomli; python_version < "3.11"', "x") == \
        'tomli; (python_version < "3.11") and extra == "x"'
    assert cpuddp_build._with_extra("mpi4py", "mpi") == 'mpi4py; extra == "mpi"'


@pytest.mark.slow
def test_the_editable_wheel_maps_the_checkout_and_the_second_build_compiles_nothing(tmp_path):
    if nb.compiler() is None:
        pytest.skip("no C compiler")
    src = _checkout(tmp_path)
    ran = tmp_path / "ran"
    cc = tmp_path / "cc"  # the system compiler, leaving a mark each time it runs
    cc.write_text(f"#!/bin/sh\ntouch '{ran}'\nexec {nb.compiler()[0]} \"$@\"\n")
    cc.chmod(0o755)
    out = tmp_path / "wheels"
    out.mkdir()
    name = _hook(src, f"build_editable({str(out)!r})", env={"CC": str(cc)})
    assert ran.exists() and (src / NATIVE / nb.LIB_NAME).exists()  # built beside the sources
    assert nb.read_record(str(src / NATIVE / nb.LIB_NAME))["ok"] is True
    ran.unlink()
    assert _hook(src, f"build_editable({str(out)!r})", env={"CC": str(cc)}) == name
    assert not ran.exists()  # nothing changed: nothing compiled
    wheel = out / name
    assert name.endswith("-py3-none-any.whl")  # no binary inside: the library stays in the checkout
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert not any(n.endswith(".so") for n in names)
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
        assert all(n in record for n in names)
        z.extractall(tmp_path / "site")
    (pth,) = (tmp_path / "site").glob("*.pth")
    # the .pth as site.py runs it, in an interpreter that has no cpuddp of its own on its path
    code = (f"import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p] + [{str(tmp_path / 'site')!r}];"
            f"exec(open({str(pth)!r}).read()); import cpuddp; print(cpuddp.__file__)")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(src / "cpuddp" / "__init__.py")
