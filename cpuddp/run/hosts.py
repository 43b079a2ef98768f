"""``cpuddp run``'s host lists: ``--hosts`` and ``--hostfile`` entries, with slot counts (pure).

One entry per host, in any of the forms MPI hostfiles use:

=====================  ==========================================================
``node1``              a name (or an IPv4 address)
``node1:4``            4 slots (MPICH/Intel MPI)
``node1 slots=4``      4 slots (Open MPI; ``max_slots=`` is accepted and ignored)
``fd00::2``            a bare IPv6 address: no slot count can follow it
``[fd00::3]:2``        an IPv6 address in brackets, with 2 slots
``fe80::1%eth0``       a link-local IPv6 address with its zone (bare or bracketed)
=====================  ==========================================================

``#`` starts a comment; blank lines are skipped; a host listed twice counts once.  A slot
count is the number of ranks on that host.  ``cpuddp run`` runs the same number on every
node, so :func:`ranks_from_slots` takes it as ``--ranks-per-node`` when every host gives the
same count, and refuses a list whose counts differ, that gives some hosts a count and not
others, or whose count contradicts ``--ranks-per-node``.  Every refusal is a
:class:`~cpuddp.affinity.job.RunPlanError` naming the line and the fix.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional, Sequence

from cpuddp.affinity.job import RunPlanError

__all__ = ["HostEntry", "parse_host", "parse_hostfile", "parse_hosts_option", "ranks_from_slots", "is_ipv6"]

_FORMS = "`node1`, `node1:2`, `node1 slots=2`, `fd00::2`, `[fd00::3]:2` or `fe80::1%eth0`"


@dataclass(frozen=True)
class HostEntry:
    """One host of the list and its slot count (None: not given)."""

    host: str
    slots: Optional[int] = None


def is_ipv6(host: str) -> bool:
    """Is ``host`` an IPv6 address (a zone such as ``%eth0`` allowed)?"""
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise RunPlanError(f"{where}: slot count {text!r} is not a whole number of 1 or more",
                           fix=f"one host per entry: {_FORMS}")
    return int(text)


def parse_host(token: str, where: str) -> HostEntry:
    """One ``host``, ``host:N``, bare IPv6 or ``[IPv6]:N`` token (see the module doc)."""
    token = token.strip()
    slots: Optional[str] = None
    if token.startswith("["):
        end = token.find("]")
        rest = token[end + 1:] if end >= 0 else ""
        if end < 0 or (rest and not rest.startswith(":")):
            raise RunPlanError(f"{where}: {token!r} is not `[IPv6 address]` or `[IPv6 address]:slots`",
                               fix=f"one host per entry: {_FORMS}")
        host, slots = token[1:end], (rest[1:] if rest else None)
        if not is_ipv6(host):
            raise RunPlanError(f"{where}: {host!r} in brackets is not an IPv6 address",
                               fix="brackets are for IPv6 addresses: [fd00::3]:2; write a name as node1:2")
    elif token.count(":") > 1:
        host = token
        if not is_ipv6(host):
            raise RunPlanError(f"{where}: {token!r} is neither a host name nor an IPv6 address",
                               fix=f"an IPv6 address with a slot count goes in brackets: [fd00::3]:2 ({_FORMS})")
    elif ":" in token:
        host, slots = token.split(":", 1)
    else:
        host = token
    if not host:
        raise RunPlanError(f"{where}: {token!r} names no host", fix=f"one host per entry: {_FORMS}")
    return HostEntry(host, _slots(slots, where) if slots is not None else None)


def _line_entry(line: str, where: str) -> HostEntry:
    words = line.split()
    entry = parse_host(words[0], where)
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if sep and key == "slots":
            if entry.slots is not None:
                raise RunPlanError(f"{where}: {line!r} gives the slot count twice", fix="give it once: node1 slots=2")
            entry = HostEntry(entry.host, _slots(value, where))
        elif not (sep and key == "max_slots"):
            raise RunPlanError(f"{where}: {word!r} in {line!r} is not understood",
                               fix=f"one host per line: {_FORMS}")
    return entry


def _unique(entries: Sequence[HostEntry]) -> list[HostEntry]:
    out: dict[str, HostEntry] = {}
    for e in entries:
        out.setdefault(e.host, e)
    return list(out.values())


def parse_hostfile(text: str, source: str = "--hostfile") -> list[HostEntry]:
    """The hosts of a hostfile, in order, each once (see the module doc)."""
    entries = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            entries.append(_line_entry(line, f"{source} line {n}"))
    if not entries:
        raise RunPlanError(f"{source} lists no hosts", fix="one host name per line")
    return _unique(entries)


def parse_hosts_option(value: str) -> list[HostEntry]:
    """``--hosts node1,node2:2,[fd00::3]:2,fe80::1%eth0``: comma-separated entries."""
    entries = [parse_host(t, f"--hosts {value}") for t in value.split(",") if t.strip()]
    if not entries:
        raise RunPlanError(f"--hosts {value!r} names no host", fix="--hosts node1,node2")
    return _unique(entries)


def ranks_from_slots(entries: Sequence[HostEntry], ranks_per_node: Optional[int], source: str) -> Optional[int]:
    """``--ranks-per-node`` as the host list's slot counts set it (None: the plan decides)."""
    given = {e.host: e.slots for e in entries if e.slots is not None}
    if not given:
        return ranks_per_node
    counts = sorted(set(given.values()))
    shown = ", ".join(f"{h}:{s}" for h, s in given.items())
    if len(given) < len(entries):
        bare = ", ".join(e.host for e in entries if e.slots is None)
        raise RunPlanError(f"{source} gives slot counts for some hosts ({shown}) but not for {bare}",
                           fix="give every host the same count (node1:2), or none and pass --ranks-per-node")
    if len(counts) > 1:
        raise RunPlanError(f"{source} gives different slot counts ({shown}); cpuddp run runs the same number of "
                           "ranks on every node", fix=f"give every host the same count, e.g. :{counts[0]}")
    if ranks_per_node is not None and ranks_per_node != counts[0]:
        raise RunPlanError(f"--ranks-per-node {ranks_per_node} contradicts {source}'s {counts[0]} slot(s) per host",
                           fix="drop one of them")
    return counts[0]
