"""Pure parsers for the launchers' values: Slurm host lists and tasks per node, the port a
job id stands for, and whether an address is loopback.

No I/O and no name resolution: each is a function of its text, tested with tables
(``tests/test_launchers.py``).  :mod:`cpuddp.launchers` re-exports them.
"""

from __future__ import annotations

import ipaddress
import re
import zlib

from .env import PORT_RANGE

__all__ = ["expand_nodelist", "expand_tasks_per_node", "derive_port", "is_loopback", "LOOPBACK_NAMES", "positive_int"]

_NODELIST_TOKEN = re.compile(r"([^,\[\]]+)(?:\[([^\[\]]*)\])?([^,\[\]]*)")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: ``node[01-04,07],gpu-a[1-2]`` -> node01..node04, node07, gpu-a1, gpu-a2.

    Zero padding is kept (``[08-10]`` -> 08, 09, 10).  Raises ValueError on malformed input.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("the node list is empty")
    hosts: list[str] = []
    pos = 0
    while pos < len(text):
        m = _NODELIST_TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"unexpected {text[pos:]!r} in {nodelist!r}")
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            if "[" in text[m.end():m.end() + 1] or "]" in prefix:
                raise ValueError(f"unbalanced brackets in {nodelist!r}")
            hosts.append(prefix + suffix)
        else:
            for item in ranges.split(","):
                hosts.extend(prefix + n + suffix for n in _expand_range(item, nodelist))
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise ValueError(f"unexpected {text[pos:]!r} in {nodelist!r}")
            pos += 1
            if pos == len(text):
                raise ValueError(f"trailing comma in {nodelist!r}")
    return hosts


def _expand_range(item: str, whole: str) -> list[str]:
    item = item.strip()
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
    if not m:
        raise ValueError(f"bad range {item!r} in {whole!r}")
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if int(hi) < int(lo):
        raise ValueError(f"descending range {item!r} in {whole!r}")
    width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
    return [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]


def expand_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's compressed tasks-per-node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in value.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"cannot parse tasks per node {value!r} (at {part!r})")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def derive_port(job_id: str, port_range: tuple[int, int] = PORT_RANGE) -> int:
    """Map a job id to a port every rank computes alike (CRC32, stable across processes)."""
    lo, hi = port_range
    return lo + zlib.crc32(job_id.encode()) % (hi - lo)


#: Host names every usual /etc/hosts maps to a loopback address (Debian's and RHEL's).
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "localhost4", "localhost4.localdomain4",
                            "localhost6", "localhost6.localdomain6", "ip6-localhost", "ip6-loopback"})


def is_loopback(addr: str) -> bool:
    """True for a loopback address or name, by text (no name resolution): 127.0.0.0/8, ``::1``,
    an IPv4-mapped ``::ffff:127.x.y.z``, with or without brackets or an IPv6 zone
    (``::1%lo``), and the usual loopback names (:data:`LOOPBACK_NAMES`, any case).

    The one loopback check of cpuddp: :mod:`cpuddp.launchers.netif`, :mod:`cpuddp.backends`,
    :mod:`cpuddp.launchers.rendezvous` and ``cpuddp doctor`` use it.
    """
    text = addr.strip().strip("[]").split("%", 1)[0].lower()
    if text in LOOPBACK_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def positive_int(raw: str, variable: str, *, why: str, fix: str, first_of_list: bool = False) -> int:
    """``raw`` (the value of ``variable``) as an integer >= 1 -- its first comma-separated item
    with ``first_of_list`` (``OMP_NUM_THREADS=8,2`` lists nested levels); otherwise a
    :class:`~cpuddp.errors.LauncherEnvError` naming the variable, its value, ``why`` and ``fix``."""
    from cpuddp.errors import LauncherEnvError

    text = raw.split(",")[0] if first_of_list else raw
    try:
        value = int(text.strip(), 10)
    except ValueError:
        value = 0
    if value < 1:
        raise LauncherEnvError(why, variable=variable, value=raw, fix=fix)
    return value
