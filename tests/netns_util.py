"""Two test hosts on one machine: network namespaces joined by a veth pair.

Shared by the tests that need hosts with their own addresses (tests/test_netns.py,
tests/test_rendezvous_local.py).  Everything is created under unique names and always deleted,
with whatever the test left running inside; without root or a working ``ip netns`` the test
skips and says why.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

IP_TIMEOUT = 15  # seconds, for each `ip` command


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=check)


@dataclass(frozen=True)
class NetnsPair:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    addrs: tuple[str, str]


def delete_namespaces(namespaces: list[str]) -> None:
    """Kill what is left in our own namespaces (only processes a test started live there), by
    pid, then delete them (which deletes their veth ends)."""
    for ns in namespaces:
        try:
            pids = ip("netns", "pids", ns, check=False).stdout.split()
        except subprocess.TimeoutExpired:
            pids = []
        for pid in pids:
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            ip("netns", "del", ns, check=False)


@contextlib.contextmanager
def veth_pair(prefix: str, addrs: tuple[str, str], *, tools: tuple[str, ...] = ("ip",)) -> Iterator[NetnsPair]:
    """Namespaces ``{prefix}-{token}-a/b`` with ``addrs[0]`` and ``addrs[1]`` (/24 for IPv4,
    /64 for IPv6) on a veth pair (and ``lo`` up in each); ``prefix`` at most 8 characters
    (interface names are <= 15)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux-only")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(f'`{t}`' for t in missing)} (iproute2)")
    token = secrets.token_hex(3)
    namespaces = (f"{prefix}-{token}-a", f"{prefix}-{token}-b")
    interfaces = (f"{prefix}{token}a", f"{prefix}{token}b")
    created: list[str] = []
    try:
        for ns in namespaces:
            try:
                ip("netns", "add", ns)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                detail = getattr(exc, "stderr", "") or str(exc)
                pytest.skip(f"`ip netns add` is unavailable here: {detail.strip()}")
            created.append(ns)
        ip("link", "add", interfaces[0], "netns", namespaces[0], "type", "veth",
           "peer", "name", interfaces[1], "netns", namespaces[1])
        for ns, ifname, addr in zip(namespaces, interfaces, addrs):
            if ":" in addr:  # IPv6: no duplicate-address detection, so the address works at once
                ip("-n", ns, "addr", "add", f"{addr}/64", "dev", ifname, "nodad")
            else:
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield NetnsPair(namespaces, interfaces, addrs)
    finally:
        delete_namespaces(created)


@contextlib.contextmanager
def hosts_file(namespace: str, text: str) -> Iterator[None]:
    """Give ``namespace`` its own /etc/hosts: ``ip netns exec`` bind-mounts
    /etc/netns/NAME/hosts over /etc/hosts for the commands it runs."""
    folder = os.path.join("/etc/netns", namespace)
    os.makedirs(folder, exist_ok=True)
    try:
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write(text)
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class RankRun:
    returncode: Optional[int]  # None: killed after the timeout
    seconds: float  # until it exited (or was killed)
    log: str


def run_commands(commands: list[list[str]], envs: list[dict[str, str]], logdir: Path, timeout: float) -> list[RankRun]:
    """Start one command per namespace, wait at most ``timeout`` s in all, kill leftovers."""
    procs, logs = [], []
    start = time.monotonic()
    ended: dict[int, float] = {}
    codes: dict[int, Optional[int]] = {}
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            log = open(logdir / f"host{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = start + timeout
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i], codes[i] = time.monotonic() - start, p.returncode
            time.sleep(0.2)
    finally:
        for i, p in enumerate(procs):
            if i in ended:
                continue
            ended[i], codes[i] = time.monotonic() - start, None
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session this test started for it
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()
    return [
        RankRun(codes.get(i), ended.get(i, 0.0), (logdir / f"host{i}.log").read_text(errors="replace"))
        for i in range(len(procs))
    ]


def describe(runs: list[RankRun]) -> str:
    return "\n".join(
        f"--- host {i} (exit {r.returncode} after {r.seconds:.1f} s) ---\n{r.log[-3000:]}" for i, r in enumerate(runs)
    )
