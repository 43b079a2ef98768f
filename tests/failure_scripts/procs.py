"""Process plumbing for the failure tests: start jobs, read their output as it comes, bound
every wait, find leftovers.  Imported by the tests (not run as a script)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parents[1]
PY = sys.executable
TOKEN_VAR = "CPUDDP_TEST_TOKEN"


def script(name: str) -> str:
    return str(SCRIPTS / name)


def base_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus a unique token (to
    find leftovers by) and ``extra``."""
    from cpuddp.testing import clean_environ

    env = clean_environ(os.environ)
    for key in list(env):
        if key.startswith("CPUDDP_") or key in ("GLOO_SOCKET_IFNAME", "TORCH_CPP_LOG_LEVEL"):
            del env[key]
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=_package_root())
    env[TOKEN_VAR] = uuid.uuid4().hex
    env.update(extra)
    return env


def _package_root() -> str:
    """Where the cpuddp this process imported lives: the children import the same one."""
    import cpuddp

    return str(Path(cpuddp.__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@dataclass
class Line:
    t: float  # time.time() when read
    stream: str  # "out" or "err"
    text: str


@dataclass
class Job:
    """A started process group (a launcher, or one rank) whose output is collected live."""

    cmd: Sequence[str]
    env: dict[str, str]
    lines: list[Line] = field(default_factory=list)
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    ended: Optional[float] = None  # time.time() when it exited; None while running / killed
    killed: bool = False

    def start(self) -> "Job":
        self._cond = threading.Condition()
        self.started = time.time()
        self.proc = subprocess.Popen(
            list(self.cmd), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace",
        )
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, "out"), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, "err"), daemon=True),
        ]
        for t in self._readers:
            t.start()
        return self

    def _read(self, stream, name: str) -> None:
        for text in stream:
            with self._cond:
                self.lines.append(Line(time.time(), name, text.rstrip("\n")))
                self._cond.notify_all()

    @property
    def stdout(self) -> str:
        return "\n".join(ln.text for ln in self.lines if ln.stream == "out")

    @property
    def stderr(self) -> str:
        return "\n".join(ln.text for ln in self.lines if ln.stream == "err")

    @property
    def output(self) -> str:
        return "\n".join(ln.text for ln in self.lines)

    def matching(self, pattern: str) -> list[re.Match]:
        """Every match in every line (MPI launchers can glue two ranks' lines together)."""
        rx = re.compile(pattern)
        return [m for ln in self.lines for m in rx.finditer(ln.text)]

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 60.0) -> list[re.Match]:
        """Wait until ``count`` lines match ``pattern``; AssertionError after ``timeout`` s or
        when the job ends first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = self.matching(pattern)
                if len(found) >= count:
                    return found
                if self.proc.poll() is not None and not any(t.is_alive() for t in self._readers):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.2))
        raise AssertionError(f"{count} line(s) matching {pattern!r} did not come within {timeout} s "
                             f"(exit code {self.proc.poll()}):\n{self.output[-4000:]}")

    def finish(self, timeout: float) -> Optional[int]:
        """Wait at most ``timeout`` s for the exit; on overrun kill the whole session (every
        process the job started) and return None."""
        try:
            rc = self.proc.wait(timeout=timeout)
            self.ended = time.time()
        except subprocess.TimeoutExpired:
            self.killed = True
            kill_session(self.proc.pid)
            self.proc.wait(timeout=10)
            rc = None
        for t in self._readers:
            t.join(5)
        return rc

    def __enter__(self) -> "Job":  # does not start the job: ``with job.start():`` or start it inside
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.killed = True
            kill_session(self.proc.pid)
            self.proc.wait(timeout=10)


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the session this harness started for the job
    except (ProcessLookupError, PermissionError):
        pass


def leftovers(token: str, wait: float = 5.0) -> list[str]:
    """Processes still alive whose environment carries ``token`` (waits up to ``wait`` s for
    them to go).  Zombies count as gone."""
    import psutil

    deadline = time.monotonic() + wait
    while True:
        found = []
        for p in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if p.environ().get(TOKEN_VAR) == token:
                    found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])}")
            except (psutil.Error, OSError):
                continue
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def kill_leftovers(token: str) -> None:
    import psutil

    for p in psutil.process_iter():
        try:
            if p.environ().get(TOKEN_VAR) == token:
                p.kill()
        except (psutil.Error, OSError):
            continue


def run_parallel(fns: Sequence[Callable[[], object]], workers: int = 3) -> list[object]:
    """Call each function in a thread pool; results in order (exceptions are returned)."""
    from concurrent.futures import ThreadPoolExecutor

    def safe(fn: Callable[[], object]) -> object:
        try:
            return fn()
        except BaseException as exc:  # reported by the test that owns the result
            return exc

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(safe, fns))
