"""Does a oneCCL binding import cleanly into this torch?  Asked in a child process, answered once.

A binding built from source carries its branch's version (``2.8.0+xpu``), not the version of
the torch it was compiled against, so its metadata cannot say whether it fits.  Importing it
here to find out is not an option: a binding built for another torch can abort the
interpreter.  So :func:`check_import` runs ``import torch, <module>`` in a child process
with a bounded time, and keeps the verdict in a per-user cache keyed by the binding's files
(path, size, modification time) and torch's version: only the first start of a new build
pays (a few seconds), and a rebuild or a new torch asks again.

Several ranks on one host start at once: the first takes a lock file beside the cache entry
and probes; the others wait for its verdict.  The entry is written to a temporary file and
renamed into place, so a reader never sees half of one (both through
:mod:`cpuddp.backends.cache`).  A cache directory that cannot be
written costs a probe per start, nothing else.

Environment variables read: ``XDG_CACHE_HOME`` (the cache is ``$XDG_CACHE_HOME/cpuddp``,
else ``~/.cache/cpuddp``), ``CPUDDP_CCL_PROBE_TIMEOUT`` (seconds the child may take; default
60).  The child inherits the environment and this interpreter's ``sys.path``.  Imports only
the standard library.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from cpuddp.errors import LauncherEnvError, how_it_ended

from .cache import atomic_write_text, locked

__all__ = ["ImportVerdict", "check_import", "probe_import", "cache_dir", "package_files", "TIMEOUT_VAR"]

TIMEOUT_VAR = "CPUDDP_CCL_PROBE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
#: What the child runs: this interpreter's sys.path, torch first, then the module, which must
#: register the backend with torch.distributed.
_CHILD = """\
import json, sys
sys.path[:] = json.loads(sys.argv[1])
import importlib
import torch
import torch.distributed as dist
importlib.import_module(sys.argv[2])
names = [b.lower() for b in getattr(dist.Backend, "backend_list", [])]
if sys.argv[3] not in names:
    print(f"{sys.argv[2]} imported, but registered no backend {sys.argv[3]!r} with torch.distributed "
          f"(registered: {', '.join(names)})")
    sys.exit(3)
print(f"import torch {torch.__version__}, {sys.argv[2]}: ok")
"""
_TAIL_LINES = 8
_TAIL_CHARS = 1200
_VERSION = 1  # of the cache entry's layout


@dataclass(frozen=True)
class ImportVerdict:
    """What the child said: ``ok``, why not (``detail``), its last lines (``output``)."""

    ok: bool
    detail: str
    output: str = ""
    seconds: float = 0.0
    cached: bool = False
    cache_file: Optional[str] = None

    def summary(self) -> str:
        """One line: the detail, then what the child printed last."""
        said = " | ".join(line.strip() for line in self.output.splitlines() if line.strip())
        return f"{self.detail}: {said}" if said else self.detail


# --------------------------------------------------------------------------- where


def cache_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/cpuddp``, else ``~/.cache/cpuddp``."""
    base = environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(base) if base and os.path.isabs(base) else Path(environ.get("HOME") or Path.home()) / ".cache"
    return root / "cpuddp"


def package_files(module: str, path: Optional[Sequence[str]] = None) -> Optional[list[Path]]:
    """The files that make up top-level ``module`` as installed (on ``path``, default
    ``sys.path``), located without importing it: its ``__init__.py`` (or module file), the
    compiled extensions beside it and the shared libraries in its ``lib/``.  None when the
    module cannot be found."""
    import importlib.machinery

    try:
        spec = importlib.machinery.PathFinder.find_spec(module, None if path is None else list(path))
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    files: list[Path] = []
    if spec.origin and os.path.isfile(spec.origin):
        files.append(Path(spec.origin))
    for location in spec.submodule_search_locations or ():
        pkg = Path(location)
        files.extend(sorted(pkg.glob("*.so")))
        files.extend(sorted(p for p in pkg.glob("lib/*.so*") if p.is_file()))
    return files or None


def _key(files: Sequence[Path], torch_version: str, python: str) -> dict:
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f), st.st_size, st.st_mtime_ns])
    return {"v": _VERSION, "files": stats, "torch": torch_version, "python": python}


def _entry_path(root: Path, module: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return root / f"ccl-import-{module}-{digest}.json"


def probe_timeout(environ: Mapping[str, str]) -> float:
    """``CPUDDP_CCL_PROBE_TIMEOUT`` in seconds (default 60); a bad value is an error."""
    raw = environ.get(TIMEOUT_VAR)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise LauncherEnvError(
            "the oneCCL import probe's time limit must be a positive number of seconds",
            variable=TIMEOUT_VAR, value=raw, fix=f"export {TIMEOUT_VAR}=60, or unset it",
        )
    return value


# --------------------------------------------------------------------------- probe


def probe_import(module: str, *, backend: str = "ccl", timeout: float = DEFAULT_TIMEOUT,
                 environ: Optional[Mapping[str, str]] = None, python: Optional[str] = None,
                 path: Optional[Sequence[str]] = None) -> ImportVerdict:
    """Run ``import torch, <module>`` in a child with ``timeout`` seconds; never cached.  The
    child's environment is this process's, with ``environ``'s values on top."""
    env = {**os.environ, **(environ or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    argv = [python or sys.executable, "-c", _CHILD, json.dumps(list(sys.path if path is None else path)), module, backend]
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return ImportVerdict(False, f"the import probe could not start ({exc})")
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return ImportVerdict(False, f"the import probe did not finish in {timeout:g} s (killed)",
                             _tail(out), time.monotonic() - t0)
    seconds = time.monotonic() - t0
    if proc.returncode == 0:
        return ImportVerdict(True, "import probe passed", _tail(out), seconds)
    return ImportVerdict(False, f"the import probe {how_it_ended(proc.returncode)}", _tail(out), seconds)


def _tail(raw: Optional[bytes]) -> str:
    text = (raw or b"").decode("utf-8", "replace")
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    tail = "\n".join(lines[-_TAIL_LINES:])
    return tail[-_TAIL_CHARS:]


# --------------------------------------------------------------------------- cached


def check_import(module: str, torch_version: str, *, backend: str = "ccl",
                 environ: Optional[Mapping[str, str]] = None, python: Optional[str] = None,
                 path: Optional[Sequence[str]] = None) -> ImportVerdict:
    """The verdict on ``import torch, <module>`` for this build of the module and this torch:
    from the cache, or from a child process (whose verdict is then cached).  ``path``
    (default ``sys.path``) is where the module is looked for, here and in the child."""
    environ = os.environ if environ is None else environ
    timeout = probe_timeout(environ)
    path = list(sys.path if path is None else path)
    files = package_files(module, path)
    if files is None:
        return ImportVerdict(False, f"module {module} cannot be found")
    python = python or sys.executable
    try:
        key = _key(files, torch_version, python)
    except OSError as exc:
        return ImportVerdict(False, f"the files of {module} cannot be read ({exc})")
    root = cache_dir(environ)
    entry = _entry_path(root, module, key)
    cached = _read(entry, key)
    if cached is not None:
        return cached
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return probe_import(module, backend=backend, timeout=timeout, environ=environ, python=python, path=path)
    with locked(entry.with_suffix(".lock"), wait=timeout + 30.0):
        cached = _read(entry, key)  # another rank may have probed while this one waited
        if cached is not None:
            return cached
        verdict = probe_import(module, backend=backend, timeout=timeout, environ=environ, python=python, path=path)
        _write(entry, key, verdict)
    return ImportVerdict(verdict.ok, verdict.detail, verdict.output, verdict.seconds, False, str(entry))


def _read(entry: Path, key: dict) -> Optional[ImportVerdict]:
    try:
        data = json.loads(entry.read_text())
        if data.get("key") != key:
            return None
        v = data["verdict"]
        return ImportVerdict(bool(v["ok"]), str(v["detail"]), str(v.get("output", "")), float(v.get("seconds", 0.0)),
                             True, str(entry))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(entry: Path, key: dict, verdict: ImportVerdict) -> None:
    data = {"key": key, "verdict": asdict(verdict), "written": time.time()}
    atomic_write_text(entry, json.dumps(data, indent=1))  # an unwritable cache costs a probe per start
