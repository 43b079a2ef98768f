"""Building the shm engine's native library (stdlib only: setup.py and the tests import it).

``python -m cpuddp.backends.shm.native.build [OUT] [--sanitize address,undefined|thread] [--force]``
compiles :data:`SOURCES` with the C compiler (:func:`compiler`: ``$CC``, split as a shell would,
so ``CC="ccache gcc"`` and ``CC="python -m ziglang cc -target x86_64-linux-gnu.2.17"`` work; else
``cc``/``gcc``/``clang``) into a plain shared library with no Python tag (:data:`LIB_NAME`), next
to the sources by default -- the only place :mod:`cpuddp.backends.shm.native` loads it from.
Flags: optimised, position-independent, C11, no ``-ffast-math`` and no floating-point
contraction (the sums are the same bits on every rank and width), and no ``-march``: each vector
width is compiled into the library (a target region that GCC and clang both honour) and chosen
at run time.  The sources' digest is compiled in, so a library built from other sources (an
editable install whose C changed) is refused at load, never run.

Every build writes its **record** beside the library (:func:`record_path`, JSON): the compiler's
command, whether it worked, the compiler's first error line, the sources' digest and the
library's own.  :func:`explain` turns it into the reason the Python data path runs (``cpuddp
doctor``, the job's header), and the next build reuses a library whose sources, compiler command
and flags are the same and whose bytes are the ones recorded (a second ``pip install -e .``
compiles nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["HERE", "LIB_NAME", "SOURCES", "FLAGS", "BuildError", "compiler", "find_compiler", "digest",
           "first_error", "record_path", "read_record", "reusable", "explain", "build", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = "libcpuddp_shm.so"
#: the files the library is built from (engine.c includes kernels.h and layout.h)
SOURCES = ("engine.c", "kernels.h", "layout.h")
FLAGS = ("-O3", "-g0", "-std=c11", "-fPIC", "-shared", "-pthread", "-fno-fast-math", "-ffp-contract=off",
         "-fvisibility=default", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-function")
SANITIZERS = {"address,undefined": ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"),
              "thread": ("-fsanitize=thread", "-O1", "-g")}
#: the compilers tried, in order, when ``$CC`` is unset
DEFAULT_COMPILERS = ("cc", "gcc", "clang")
#: a record's ``reason`` when the build could not start (no compiler; a ``$CC`` that names none) or did not work
NO_COMPILER, BAD_CC, FAILED = "no-compiler", "bad-cc", "failed"
BUILD_CMD = "python -m cpuddp.backends.shm.native.build"


class BuildError(RuntimeError):
    """The library was not built; ``record`` is what was written beside where it would be."""

    def __init__(self, message: str, record: Dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def digest(where: str = HERE) -> str:
    """The first 16 hex digits of the SHA-256 of :data:`SOURCES` in ``where``."""
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(where, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def find_compiler(environ: Mapping[str, str] = os.environ) -> Tuple[Optional[List[str]], str]:
    """``(command, problem)``: the C compiler's command as a list (``$CC`` split as a shell
    would, its first word found on PATH), else the first of :data:`DEFAULT_COMPILERS` on PATH;
    ``(None, why)`` when there is none.  A ``$CC`` that names no program is that problem, never
    a silent fallback to another compiler."""
    raw = (environ.get("CC") or "").strip()
    if raw:
        try:
            words = shlex.split(raw)
        except ValueError as exc:
            return None, f"CC={raw!r} is not a command a shell could split ({exc})"
        found = shutil.which(words[0], path=environ.get("PATH"))
        if found is None:
            return None, f"CC={raw!r}: {words[0]!r} is no program on PATH"
        return [found, *words[1:]], ""
    for name in DEFAULT_COMPILERS:
        found = shutil.which(name, path=environ.get("PATH"))
        if found:
            return [found], ""
    return None, f"CC is unset and none of {', '.join(DEFAULT_COMPILERS)} is on PATH"


def compiler(environ: Mapping[str, str] = os.environ) -> Optional[List[str]]:
    """The C compiler's command (:func:`find_compiler`), or None."""
    return find_compiler(environ)[0]


def first_error(stderr: str, returncode: int) -> str:
    """The line of a failed compile a user should read first: the first that says ``error``,
    else the first it printed, else that it printed nothing."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line[:300]
    if lines:
        return lines[0][:300]
    return f"it exited with status {returncode} and printed nothing"


def record_path(library: str) -> str:
    """Where the build record of ``library`` lives: beside it, ``libcpuddp_shm.build.json``."""
    return os.path.splitext(library)[0] + ".build.json"


def read_record(library: str) -> Optional[Dict[str, Any]]:
    """The build record of ``library``, or None (none, or not a record)."""
    try:
        with open(record_path(library), encoding="utf-8") as f:
            record = json.loads(f.read(65536))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "ok" in record else None


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def reusable(record: Optional[Mapping[str, Any]], key: str, library_sha: Optional[str]) -> bool:
    """May the library already there serve a build of ``key``?  Only when its record says it
    was built with this key (sources, compiler command, flags) and its bytes are the recorded ones."""
    return bool(record and record.get("ok") and record.get("key") == key and library_sha
                and record.get("library") == library_sha)


def explain(record: Optional[Mapping[str, Any]], compiler_now: Optional[Sequence[str]]) -> str:
    """Why there is no library, from its build record and the compiler found now (a pure function)."""
    fix = f"build it with '{BUILD_CMD}'"
    if record is None:
        return f"no native library was built here (no build record: this copy was never installed by pip); {fix}"
    if record.get("ok"):
        return (f"its library is missing, though its build record says '{record.get('compiler')}' built it; "
                f"pip install again, or {fix}")
    if record.get("reason") == NO_COMPILER:
        if compiler_now:
            return (f"this install was built where there was no C compiler ({record.get('error')}), and "
                    f"{compiler_now[0]} is here now (a wheel built without one, perhaps from pip's cache): pip install "
                    f"--no-cache-dir --force-reinstall --no-deps cpuddp, or {fix}")
        return f"pip install found no C compiler ({record.get('error')}); install one (gcc) and pip install again"
    if record.get("reason") == BAD_CC:
        return (f"the native build could not start: {record.get('error')}; set CC to a C compiler (or unset it) "
                f"and pip install again, or {fix}")
    return (f"the native build failed: {record.get('compiler')}: {record.get('error')}; fix that and pip install "
            f"again, or run '{BUILD_CMD}' to see the compiler's whole output")


def _write_record(library: str, record: Dict[str, Any]) -> None:
    path = record_path(library)
    fd, tmp = tempfile.mkstemp(prefix=".libcpuddp_shm-", suffix=".json", dir=os.path.dirname(path))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _failed(out: str, record: Dict[str, Any], message: str) -> BuildError:
    """Record a failed build (and remove the library it was to replace: it is not this build's)."""
    if os.path.exists(out):
        os.unlink(out)
    _write_record(out, record)
    return BuildError(message, record)


def _flags(sanitize: Optional[str], where: str) -> List[str]:
    flags = list(FLAGS)
    if sanitize:
        if sanitize not in SANITIZERS:
            raise BuildError(f"--sanitize {sanitize!r}: use one of {', '.join(SANITIZERS)}", {})
        flags += SANITIZERS[sanitize]
    return flags + [f'-DCPUDDP_SRC_DIGEST="{digest(where)}"']


def build(out: Optional[str] = None, sanitize: Optional[str] = None, where: str = HERE,
          environ: Mapping[str, str] = os.environ, reuse: bool = True) -> Tuple[str, bool]:
    """Compile the library to ``out`` (default: :data:`LIB_NAME` beside the sources), atomically
    (a temporary file in the same directory, then a rename), and write its record; ``(its path,
    reused)`` -- reused: the library there was built with the same sources, compiler command and
    flags (:func:`reusable`), so nothing was compiled.  Raises :class:`BuildError` (its record
    written) when there is no compiler or the compile fails."""
    out = os.path.abspath(out or os.path.join(where, LIB_NAME))
    cc, problem = find_compiler(environ)
    record: Dict[str, Any] = {"ok": False, "sources": digest(where), "compiler": environ.get("CC") or None}
    if cc is None:
        record.update(reason=BAD_CC if record["compiler"] else NO_COMPILER, error=problem)
        raise _failed(out, record, problem)
    flags = _flags(sanitize, where)
    source = os.path.join(where, "engine.c")
    key = hashlib.sha256(json.dumps([cc, flags, record["sources"]]).encode()).hexdigest()[:16]
    record.update(compiler=record["compiler"] or cc[0], key=key,
                  command=shlex.join([*cc, *flags, "-o", os.path.basename(out), source]))
    if reuse and os.path.exists(out) and reusable(read_record(out), key, _sha256(out)):
        return out, True
    fd, tmp = tempfile.mkstemp(prefix=".libcpuddp_shm-", suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        done = subprocess.run([*cc, *flags, "-o", tmp, source], capture_output=True, text=True)
        if done.returncode != 0:
            record.update(reason=FAILED, error=first_error(done.stderr, done.returncode))
            raise _failed(out, record, f"{record['command']} failed ({done.returncode}):\n{done.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    record.update(ok=True, reason=None, error=None, library=_sha256(out))
    _write_record(out, record)
    return out, False


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=BUILD_CMD, description="Build the shm engine's native library.")
    parser.add_argument("out", nargs="?", help=f"where to write it (default: {LIB_NAME} beside the sources)")
    parser.add_argument("--sanitize", choices=sorted(SANITIZERS), help="a sanitizer build (CI)")
    parser.add_argument("--force", action="store_true", help="compile even when the library there is current")
    args = parser.parse_args(argv)
    try:
        path, reused = build(args.out, args.sanitize, reuse=not args.force)
    except BuildError as exc:
        print(f"cpuddp: could not build the shm engine's native library: {exc}", file=sys.stderr)
        return 1
    if reused:
        print(f"cpuddp: {path} is current (same sources, compiler and flags): not compiled again "
              "(--force compiles it)", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
