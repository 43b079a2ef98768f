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
from dataclasses import dataclass
from typing import Iterator

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
    """Namespaces ``{prefix}-{token}-a/b`` with ``addrs[0]/24`` and ``addrs[1]/24`` on a veth
    pair (and ``lo`` up in each); ``prefix`` at most 8 characters (interface names are <= 15)."""
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
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield NetnsPair(namespaces, interfaces, addrs)
    finally:
        delete_namespaces(created)
