"""What every rank must know about the others before the process group forms.

At init, each rank publishes a :class:`HostRecord` (its host, the CPUs it may run on, what
its launcher said about its place on the node) through the rendezvous store and reads
everyone's: :func:`exchange` and :func:`gather_hosts`.  No collective, no pickle, no numpy:
plain JSON text under a key per rank.  :func:`layout` (pure) turns the records into this
rank's place on its node -- local rank, local size, node rank -- and the allowed CPU sets of
the ranks it shares the node with, which the pinning plan needs.

A rank that fails between two exchanges publishes its error in place of its value
(:func:`publish_error`), so the others raise at once naming it instead of waiting out the
timeout.

:func:`host_identity` is what tells hosts apart: hostname, boot id and network namespace, so
two network namespaces on one machine count as two hosts, as they do for gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .errors import RendezvousError

__all__ = [
    "host_identity",
    "pid_alive",
    "HostRecord",
    "Layout",
    "exchange",
    "publish_error",
    "gather_hosts",
    "layout",
    "pairwise_disjoint",
]

#: Marks a published value as a rank's error rather than its answer.
_ERROR = "!"


def host_identity(namespaces: tuple[str, ...] = ("net",)) -> str:
    """What distinguishes hosts: hostname, boot id and the given Linux namespaces (the
    network namespace by default; the watchdog adds "pid": two processes with the same
    identity then see each other's PIDs)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    for ns in namespaces:
        with contextlib.suppress(OSError):
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
    return "|".join(parts)


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


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on now (empty where the platform cannot say)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return ()


@dataclass(frozen=True)
class HostRecord:
    """One rank's facts, as published at init.  ``local_rank``/``local_size``: what the
    launcher said (None when it said nothing and cpuddp had to guess)."""

    rank: int
    host: str
    cpus: tuple[int, ...]
    local_rank: Optional[int] = None
    local_size: Optional[int] = None

    @classmethod
    def here(cls, rank: int, local_rank: Optional[int], local_size: Optional[int]) -> "HostRecord":
        return cls(rank, host_identity(), allowed_cpus(), local_rank, local_size)

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "host": self.host, "cpus": list(self.cpus),
                           "local_rank": self.local_rank, "local_size": self.local_size})

    @classmethod
    def from_json(cls, text: str) -> "HostRecord":
        d = json.loads(text)
        return cls(int(d["rank"]), str(d["host"]), tuple(int(c) for c in d["cpus"]),
                   d.get("local_rank"), d.get("local_size"))

    @property
    def hostname(self) -> str:
        return self.host.split("|", 1)[0]


@dataclass(frozen=True)
class Layout:
    """Where one rank sits, from everyone's records.  ``nodes``: the global ranks of each
    host, hosts ordered by their lowest rank.  ``local_cpus``: the allowed CPUs of the ranks
    on this rank's host, in local-rank order."""

    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nodes: tuple[tuple[int, ...], ...]
    local_cpus: tuple[frozenset[int], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)


def layout(records: Sequence[HostRecord], rank: int) -> Layout:
    """This rank's :class:`Layout` (pure).  Ranks on one host are numbered locally in
    global-rank order, as every launcher does for block placement."""
    by_rank = sorted(records, key=lambda r: r.rank)
    hosts: dict[str, list[HostRecord]] = {}
    for rec in by_rank:
        hosts.setdefault(rec.host, []).append(rec)
    nodes = tuple(tuple(r.rank for r in recs) for recs in hosts.values())
    mine = next(r for r in by_rank if r.rank == rank)
    here = hosts[mine.host]
    return Layout(
        rank=rank,
        local_rank=[r.rank for r in here].index(rank),
        local_world_size=len(here),
        node_rank=list(hosts).index(mine.host),
        nodes=nodes,
        local_cpus=tuple(frozenset(r.cpus) for r in here),
    )


def pairwise_disjoint(sets: Sequence[frozenset[int]]) -> bool:
    """True when no CPU is in two of ``sets`` (and none is empty)."""
    seen: set[int] = set()
    for s in sets:
        if not s or seen & s:
            return False
        seen |= s
    return True


# --------------------------------------------------------------------------- the exchange


def _key(name: str, rank: int) -> str:
    return f"{name}/{rank}"


def publish_error(store: Any, name: str, rank: int, error: BaseException) -> None:
    """Publish ``error`` as this rank's value of exchange ``name`` (best effort)."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[-1]
    with contextlib.suppress(Exception):
        if not store.check([_key(name, rank)]):
            store.set(_key(name, rank), _ERROR + f"{type(error).__name__}: {text}")


def exchange(store: Any, name: str, rank: int, world_size: int, value: str,
             timeout: datetime.timedelta, *, what: str = "init",
             missing_fix: Optional[Callable[[str], str]] = None) -> list[str]:
    """Publish ``value`` as this rank's part of exchange ``name``; return every rank's value
    in rank order.  Raises :class:`RendezvousError` naming the ranks that never published
    within ``timeout`` (``missing_fix(shown_ranks)`` words the fix), or the first rank that
    published an error instead."""
    store.set(_key(name, rank), value)
    keys = [_key(name, r) for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except Exception:
        missing = _missing(store, keys)
        shown = missing if len(missing) <= 16 else f"{missing[:16]} and {len(missing) - 16} more"
        raise RendezvousError(
            f"rank {rank}: rank(s) {shown} of {world_size} never reached the {what} exchange "
            f"within {timeout.total_seconds():.0f} s",
            fix=missing_fix(str(shown)) if missing_fix else
            f"start rank(s) {shown} (check the launcher's rank count and their logs), or fix the world size",
        ) from None
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in _get_all(store, keys)]
    for r, v in enumerate(values):
        if v.startswith(_ERROR) and r != rank:
            raise RendezvousError(
                f"rank {rank}: rank {r} failed during init: {v[len(_ERROR):]}",
                fix=f"see rank {r}'s log for the cause; every rank stops with it",
            )
    return values


def _get_all(store: Any, keys: Sequence[str]) -> list[Any]:
    try:
        return list(store.multi_get(keys))  # one round trip where the store has it
    except (AttributeError, NotImplementedError, RuntimeError):
        return [store.get(k) for k in keys]


def _missing(store: Any, keys: Sequence[str]) -> list[int]:
    out = []
    for r, key in enumerate(keys):
        try:
            if not store.check([key]):
                out.append(r)
        except Exception:
            out.append(r)
    return out


def gather_hosts(store: Any, name: str, mine: HostRecord, world_size: int,
                 timeout: datetime.timedelta, *, missing_fix: Optional[Callable[[str], str]] = None) -> list[HostRecord]:
    """Every rank's :class:`HostRecord`, in rank order (see :func:`exchange`)."""
    values = exchange(store, name, mine.rank, world_size, mine.to_json(), timeout, what="host",
                      missing_fix=missing_fix)
    return [HostRecord.from_json(v) for v in values]
