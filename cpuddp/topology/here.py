"""This process, on this node: the facts the kernel gives about the running process.

- :func:`allowed_cpus`: the CPUs this process may run on now (its affinity mask).
- :func:`hostname`: this host's name, as the kernel gives it.
- :func:`host_identity`, :func:`hostname_of` and :func:`machine_of`: what tells hosts apart
  (hostname, boot id, Linux namespaces), and the host and machine parts of such an identity.
- :func:`namespace_id` and :func:`pid_namespace`: the inode of one of this process's Linux
  namespaces.
- :func:`pid_alive`: whether a pid of this PID namespace is a live, non-zombie process.

Standard library only; psutil is imported inside :func:`allowed_cpus`, and only when asked.
Everything else in cpuddp reads these facts from here.
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["allowed_cpus", "hostname", "namespace_id", "pid_namespace", "host_identity", "hostname_of", "machine_of", "pid_alive"]


def allowed_cpus(*, ask_psutil: bool = False) -> tuple[int, ...]:
    """The CPUs this process may run on now, sorted (empty where the platform cannot say).
    ``ask_psutil``: where the os module has no affinity call, ask psutil's ``cpu_affinity()``."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        pass
    if ask_psutil and not hasattr(os, "sched_getaffinity"):
        try:
            import psutil

            return tuple(sorted(psutil.Process().cpu_affinity()))
        except Exception:
            pass
    return ()


def hostname() -> str:
    """This host's name (``socket.gethostname()``)."""
    return socket.gethostname()


def namespace_id(ns: str) -> str:
    """The inode number of this process's Linux namespace ``ns`` ("net", "pid", ...) as text,
    "" when unreadable."""
    with contextlib.suppress(OSError):
        return str(os.stat(f"/proc/self/ns/{ns}").st_ino)
    return ""


def pid_namespace() -> str:
    """This process's PID namespace (:func:`namespace_id`), "?" when unreadable."""
    return namespace_id("pid") or "?"


def host_identity(namespaces: tuple[str, ...] = ("net",)) -> str:
    """What distinguishes hosts: hostname, boot id and the given Linux namespaces (the
    network namespace by default; the watchdog adds "pid": two processes with the same
    identity then see each other's PIDs)."""
    parts = [hostname(), ""]  # a field each, empty when unreadable: machine_of reads field 2
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts[1] = f.read().strip()
    parts.extend(namespace_id(ns) for ns in namespaces)
    return "|".join(parts)


def hostname_of(identity: str) -> str:
    """The hostname part of a :func:`host_identity` (pure)."""
    return identity.split("|", 1)[0]


def machine_of(identity: str) -> str:
    """The machine part of a :func:`host_identity` (pure): its boot id -- one per running
    kernel, shared by every container on it, whatever their hostname -- else its hostname."""
    fields = identity.split("|")
    return f"boot:{fields[1]}" if len(fields) > 1 and fields[1] else f"host:{fields[0]}"


def pid_alive(pid: int) -> bool:
    """Is ``pid`` a live, non-zombie process?  Meaningful only for a process with this one's
    ``host_identity(("net", "pid"))`` (same host and PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
