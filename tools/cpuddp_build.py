"""cpuddp's build backend (PEP 517 and PEP 660), in the source tree (pyproject.toml's ``backend-path``).

Editable installs are built here, with the standard library alone: ``pip install -e .`` needs no
build environment (pip's isolation installs nothing), writes the package's metadata from
pyproject.toml, builds the shm engine's native library beside its sources (nothing is compiled
when the sources, the compiler command and the flags did not change: ``native/build.py``) and
gives pip a wheel whose ``.pth`` maps ``cpuddp`` to the checkout.  A second ``pip install -e .``
therefore costs pip's own start and its dependency check, not a setuptools environment.

Wheels and sdists are setuptools' (``setup.py`` tags each wheel for the library it carries):
their hooks ask for setuptools and hand the call to ``setuptools.build_meta``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import os
import re
import sys
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (this file is in tools/)
NATIVE = os.path.join("cpuddp", "backends", "shm", "native")
PACKAGE = "cpuddp"
#: what the wheel and sdist hooks need (setuptools 70.1 carries bdist_wheel itself)
SETUPTOOLS = "setuptools>=70.1"


# -- wheels and sdists: setuptools ---------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return [SETUPTOOLS]


def get_requires_for_build_sdist(config_settings=None):
    return [SETUPTOOLS]


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    from setuptools import build_meta
    return build_meta.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    from setuptools import build_meta
    return build_meta.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    from setuptools import build_meta
    return build_meta.build_sdist(sdist_directory, config_settings)


# -- editable installs: the standard library -----------------------------------------------------

def get_requires_for_build_editable(config_settings=None):
    return [] if sys.version_info >= (3, 11) else ["tomli"]  # pyproject.toml's reader before tomllib


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    project = _project()
    dist_info = _dist_info(project)
    os.makedirs(os.path.join(metadata_directory, dist_info), exist_ok=True)
    for name, data in _dist_info_files(project).items():
        with open(os.path.join(metadata_directory, dist_info, name), "wb") as f:
            f.write(data)
    return dist_info


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    _build_native()
    finder = f"__editable___{PACKAGE}_finder"
    files = {
        f"__editable__.{PACKAGE}.pth": f"import {finder}; {finder}.install()\n".encode(),
        f"{finder}.py": _FINDER.format(package=PACKAGE, path=HERE).encode(),
    }
    dist_info = _dist_info(project)
    files.update({f"{dist_info}/{name}": data for name, data in _dist_info_files(project).items()})
    name = f"{_escape(project['name'])}-{project['version']}-py3-none-any.whl"
    _write_wheel(os.path.join(wheel_directory, name), files, f"{dist_info}/RECORD")
    return name


_FINDER = '''"""Finds the package {package!r} in its checkout (cpuddp's editable install: tools/cpuddp_build.py)."""
import sys
from importlib.machinery import PathFinder

PATH = {path!r}


class _Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != {package!r}:
            return None
        return PathFinder.find_spec(fullname, [PATH])


def install():
    if _Finder not in sys.meta_path:
        sys.meta_path.append(_Finder)
'''


def native_module(name):
    """cpuddp/backends/shm/native/NAME.py, loaded by path (the package is not importable in a build)."""
    spec = importlib.util.spec_from_file_location(f"_cpuddp_native_{name}", os.path.join(HERE, NATIVE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_native(target):
    """The native library in the folder ``target`` (kept when current): its path, or None where it
    was not built (the Python engine runs; the reason is said here and recorded beside it)."""
    builder = native_module("build")
    try:
        os.makedirs(target, exist_ok=True)
        path, reused = builder.build(os.path.join(target, builder.LIB_NAME), where=os.path.join(HERE, NATIVE))
    except (builder.BuildError, OSError) as exc:
        print(f"cpuddp: the shm engine's native library was not built ({exc}); the Python engine will run",
              file=sys.stderr)
        return None
    print(f"cpuddp: {'kept the current' if reused else 'built the'} shm engine's native library: {path}",
          file=sys.stderr)
    return path


def _build_native():
    """The native library beside the sources (an editable install's)."""
    build_native(os.path.join(HERE, NATIVE))


def _project():
    """pyproject.toml's [project] table, its dynamic version read from cpuddp/_package.py."""
    try:
        import tomllib
    except ImportError:  # Python 3.9 and 3.10: get_requires_for_build_editable asked for tomli
        import tomli as tomllib
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        project = dict(tomllib.load(f)["project"])
    with open(os.path.join(HERE, PACKAGE, "_package.py"), encoding="utf-8") as f:
        project["version"] = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)
    return project


def _escape(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def _dist_info(project):
    return f"{_escape(project['name'])}-{project['version']}.dist-info"


def _dist_info_files(project):
    """METADATA, WHEEL and entry_points.txt for ``project`` (core metadata 2.1)."""
    license = project.get("license", {})
    lines = [("Metadata-Version", "2.1"), ("Name", project["name"]), ("Version", project["version"]),
             ("Summary", project.get("description", "")),
             ("License", license if isinstance(license, str) else license.get("text", "")),
             ("Requires-Python", project.get("requires-python", "")),
             ("Description-Content-Type", "text/markdown")]
    lines += [("Requires-Dist", req) for req in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        lines.append(("Provides-Extra", extra))
        lines += [("Requires-Dist", _with_extra(req, extra)) for req in reqs]
    with open(os.path.join(HERE, project["readme"]), encoding="utf-8") as f:
        readme = f.read()
    metadata = "".join(f"{key}: {value}\n" for key, value in lines if value) + "\n" + readme
    entry_points = io.StringIO()
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    for group, entries in groups.items():
        entry_points.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n")
    wheel = "Wheel-Version: 1.0\nGenerator: cpuddp_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    return {"METADATA": metadata.encode(), "WHEEL": wheel.encode(), "entry_points.txt": entry_points.getvalue().encode()}


def _with_extra(req, extra):
    """``req`` for ``extra`` only (its own marker, if any, kept beside it)."""
    spec, _, marker = req.partition(";")
    condition = f'extra == "{extra}"'
    return f"{spec.strip()}; ({marker.strip()}) and {condition}" if marker.strip() else f"{spec.strip()}; {condition}"


def _write_wheel(path, files, record_name):
    """A wheel at ``path`` holding ``files`` (name -> bytes) and their RECORD."""
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
            sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={sha},{len(data)}")
        z.writestr(record_name, "\n".join(record + [f"{record_name},,"]) + "\n")
