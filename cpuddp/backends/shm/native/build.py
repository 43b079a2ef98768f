"""Building the shm engine's native library (stdlib only: setup.py and the tests import it).

``python -m cpuddp.backends.shm.native.build [OUT] [--sanitize address,undefined|thread]``
compiles :data:`SOURCES` with the system C compiler (``$CC``, else ``cc``) into a plain shared
library with no Python tag (:data:`LIB_NAME`), next to the sources by default -- the only place
:mod:`cpuddp.backends.shm.native` loads it from.  Flags: optimised, position-independent, C11,
no ``-ffast-math`` and no floating-point contraction (the sums are the same bits on every rank
and width), and no ``-march``: each vector width is compiled into the library (``#pragma GCC
target``) and chosen at run time.  The sources' digest is compiled in, so a library built from
other sources (an editable install whose C changed) is refused at load, never run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

__all__ = ["HERE", "LIB_NAME", "SOURCES", "FLAGS", "compiler", "digest", "build", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = "libcpuddp_shm.so"
#: the files the library is built from (engine.c includes kernels.h and layout.h)
SOURCES = ("engine.c", "kernels.h", "layout.h")
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-fno-fast-math", "-ffp-contract=off",
         "-fvisibility=default", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-function")
SANITIZERS = {"address,undefined": ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"),
              "thread": ("-fsanitize=thread", "-O1", "-g")}


def digest(where: str = HERE) -> str:
    """The first 16 hex digits of the SHA-256 of :data:`SOURCES` in ``where``."""
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(where, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def compiler() -> Optional[str]:
    """The C compiler to use: ``$CC`` if it names one on PATH, else ``cc``/``gcc``/``clang``; None if none."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        found = shutil.which(name.split()[0])
        if found:
            return found
    return None


def build(out: Optional[str] = None, sanitize: Optional[str] = None, where: str = HERE) -> str:
    """Compile the library to ``out`` (default: :data:`LIB_NAME` beside the sources), atomically
    (a temporary file in the same directory, then a rename); its path.  Raises ``RuntimeError``
    with the compiler's output when it fails or there is no compiler."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc/cc)")
    out = os.path.abspath(out or os.path.join(where, LIB_NAME))
    flags = list(FLAGS)
    if sanitize:
        if sanitize not in SANITIZERS:
            raise RuntimeError(f"--sanitize {sanitize!r}: use one of {', '.join(SANITIZERS)}")
        flags += SANITIZERS[sanitize]
    fd, tmp = tempfile.mkstemp(prefix=".libcpuddp_shm-", suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        cmd = [cc, *flags, f'-DCPUDDP_SRC_DIGEST="{digest(where)}"', "-o", tmp, os.path.join(where, "engine.c")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cpuddp.backends.shm.native.build",
                                     description="Build the shm engine's native library.")
    parser.add_argument("out", nargs="?", help=f"where to write it (default: {LIB_NAME} beside the sources)")
    parser.add_argument("--sanitize", choices=sorted(SANITIZERS), help="a sanitizer build (CI)")
    args = parser.parse_args(argv)
    try:
        print(build(args.out, args.sanitize))
    except RuntimeError as exc:
        print(f"cpuddp: could not build the shm engine's native library: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
