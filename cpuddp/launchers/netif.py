"""Which local network interface reaches rank 0: the value for ``GLOO_SOCKET_IFNAME``.

gloo binds each rank to the address its hostname resolves to.  Where the hostname resolves
to 127.0.0.1 or 127.0.1.1 (a common ``/etc/hosts`` setup, pytorch issue 15592), every rank
advertises loopback and ranks on other hosts can never connect: ``init_process_group``
times out with "Connection refused" from one rank and hangs on the others.  The interface
that routes to ``MASTER_ADDR`` is the one the other hosts can reach this rank on.

How it is found, in two steps:

1. :func:`source_address` asks the kernel which local address it would use to reach
   ``MASTER_ADDR``: a UDP socket ``connect()`` picks the route and the source address
   without sending a packet.
2. :func:`interface_for_source` maps that address to an interface name, given the
   interface table (``psutil.net_if_addrs()``).  It is pure, so it is tested with tables.

:func:`route_to` does both.  Nothing here reads or writes environment variables.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Union

from .parsers import is_loopback

__all__ = ["Route", "interface_for_source", "source_address", "route_to", "is_loopback_address"]

log = logging.getLogger("cpuddp.netif")

# A port for the UDP connect; nothing is sent, any port works (9 is "discard").
_PROBE_PORT = 9


class Route(NamedTuple):
    """The local side of the route to an address: interface name and source address."""

    interface: str
    source: str


def _normalize(addr: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    """``ip_address`` of ``addr``, ignoring an IPv6 zone (``fe80::1%eth0``) and brackets."""
    text = addr.strip().strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback_address(addr: str) -> bool:
    """True for a loopback IP address (127.0.0.0/8, ``::1``, ``::ffff:127.x.y.z``); a name,
    even ``localhost``, is not an address.  The loopback test itself is
    :func:`cpuddp.launchers.is_loopback`, cpuddp's one copy of it."""
    return _normalize(addr) is not None and is_loopback(addr)


def _address_of(entry: Any) -> str:
    return entry if isinstance(entry, str) else str(getattr(entry, "address", ""))


def interface_for_source(
    interfaces: Mapping[str, Iterable[Any]],
    source: str,
    *,
    up: Optional[Mapping[str, bool]] = None,
) -> Optional[str]:
    """The interface in ``interfaces`` that holds the address ``source``, or None.

    ``interfaces`` maps an interface name to its addresses: strings, or objects with an
    ``address`` attribute (``psutil.net_if_addrs()``).  ``up`` (name -> is up) breaks a tie
    when several interfaces hold the address; otherwise the first name in sorted order wins.
    """
    want = _normalize(source)
    if want is None:
        return None
    found = [
        name
        for name in sorted(interfaces)
        if any(_normalize(_address_of(a)) == want for a in interfaces[name])
    ]
    if not found:
        return None
    if up is not None:
        found.sort(key=lambda name: not up.get(name, True))
    return found[0]


Resolver = Callable[..., list]


def source_address(dest: str, *, resolver: Optional[Resolver] = None) -> Optional[str]:
    """The local address the kernel would use to reach ``dest`` (a name or an address).

    Resolves ``dest`` and ``connect()``s a UDP socket to each result in turn; no packet is
    sent.  Returns None when ``dest`` does not resolve or no result is routable.
    """
    resolver = socket.getaddrinfo if resolver is None else resolver
    try:
        infos = resolver(dest.strip().strip("[]"), _PROBE_PORT, 0, socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        log.debug("source_address: %r does not resolve: %s", dest, exc)
        return None
    for family, type_, proto, _, sockaddr in infos:
        with contextlib.suppress(OSError):
            with socket.socket(family, type_, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0]).split("%", 1)[0]
    return None


def route_to(dest: str) -> Optional[Route]:
    """The interface and source address this host uses to reach ``dest``, or None."""
    source = source_address(dest)
    if source is None:
        return None
    import psutil

    try:
        table = psutil.net_if_addrs()
        stats = {name: st.isup for name, st in psutil.net_if_stats().items()}
    except (OSError, RuntimeError) as exc:  # no /proc/net, or a sandbox without netlink
        log.debug("route_to: cannot list the interfaces: %s", exc)
        return None
    name = interface_for_source(table, source, up=stats)
    if name is None:
        log.debug("route_to: no interface holds %s (the source address to %s)", source, dest)
        return None
    return Route(name, source)
