"""What every rank must know about the others before the process group forms.

At init, each rank publishes a :class:`HostRecord` (its host, the CPUs it may run on, what
its launcher said about its place on the node) through the rendezvous store and reads
everyone's: :func:`exchange` and :func:`gather_hosts`.  No collective, no pickle, no numpy:
plain JSON text under a key per rank.  :func:`layout` (pure) turns the records into this
rank's place on its node -- local rank, local size, node rank -- and the allowed CPU sets of
the ranks it shares the node with, which the pinning plan needs.  A shm group's ranks publish
the same record, with their pid and PID namespace, checked by the same :func:`parse_record`
and placed by the same :func:`layout` (:mod:`cpuddp.backends.shm.protocol.node`).

A rank that fails between two exchanges publishes its error in place of its value
(:func:`publish_error`), so the others raise at once naming it instead of waiting out the
timeout.

:func:`~cpuddp.topology.here.host_identity` is what tells hosts apart: hostname, boot id and
network namespace, so two network namespaces on one machine count as two hosts, as they do for
gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from cpuddp.errors import RendezvousError
from cpuddp.topology.here import allowed_cpus, host_identity, hostname_of, pid_namespace

from . import store_values
from .env import DistEnv, Provenance, Source
from .exports import NOTICE_AFTER

log = logging.getLogger("cpuddp")

__all__ = [
    "HostRecord",
    "Layout",
    "exchange",
    "Share",
    "sharing",
    "publish_error",
    "gather_hosts",
    "parse_record",
    "check_records",
    "layout",
    "pairwise_disjoint",
]

#: Marks a published value as a rank's error rather than its answer.
_ERROR = "!"


@dataclass(frozen=True)
class HostRecord:
    """One rank's facts, as published at init and by a shm group.  ``local_rank``/``local_size``:
    what the launcher said (None when it said nothing and cpuddp had to guess).  ``pid``/``pid_ns``:
    the rank's process and its PID namespace, which a shm group's records carry (None at init,
    and then absent from the JSON)."""

    rank: int
    host: str
    cpus: tuple[int, ...]
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    pid: Optional[int] = None
    pid_ns: Optional[str] = None

    @classmethod
    def here(cls, rank: int, local_rank: Optional[int], local_size: Optional[int], *,
             process: bool = False) -> "HostRecord":
        """This process's record; ``process``: with its pid and PID namespace."""
        pid, pid_ns = (os.getpid(), pid_namespace()) if process else (None, None)
        return cls(rank, host_identity(), allowed_cpus(), local_rank, local_size, pid, pid_ns)

    def to_json(self) -> str:
        d: dict[str, Any] = {"rank": self.rank, "host": self.host, "cpus": list(self.cpus),
                             "local_rank": self.local_rank, "local_size": self.local_size}
        if self.pid is not None or self.pid_ns is not None:
            d.update(pid=self.pid, pid_ns=self.pid_ns)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "HostRecord":
        """Read back :meth:`to_json`'s text (trusted: use :func:`parse_record` for a store's)."""
        d = json.loads(text)
        return cls(int(d["rank"]), str(d["host"]), tuple(int(c) for c in d["cpus"]),
                   d.get("local_rank"), d.get("local_size"), d.get("pid"), d.get("pid_ns"))

    @property
    def hostname(self) -> str:
        return hostname_of(self.host)


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


_RECORD = "a host record (JSON: rank, host, cpus, local_rank, local_size)"
_FIELDS = ("rank", "host", "cpus", "local_rank", "local_size")
_PROCESS_RECORD = "a host record (JSON: rank, host, cpus, local_rank, local_size, pid, pid_ns)"
_PROCESS_FIELDS = ("pid", "pid_ns")


def _optional_int(key: str, name: str, value: Any, lo: int, hi: int, raw: Any, want: str) -> Optional[int]:
    return None if value is None else store_values.int_field(key, name, value, lo, hi, expected=want, text=False,
                                                             whole=raw)


def _text(key: str, name: str, value: Any, raw: Any, want: str) -> str:
    """A text field: printable, 1..MAX_HOST characters (a host identity, a PID namespace)."""
    sv = store_values
    if not isinstance(value, str) or not value or len(value) > sv.MAX_HOST or not value.isprintable():
        raise sv.bad_value(key, f"its {name} {sv.shown(value, 40)} is not printable text of 1..{sv.MAX_HOST} "
                           "characters", raw, expected=want)
    return value


def _cpus(key: str, cpus: Any, raw: Any, want: str) -> tuple[int, ...]:
    """Distinct CPU numbers in 0..MAX_CPU-1, at most MAX_CPU of them."""
    sv = store_values
    if not isinstance(cpus, list) or len(cpus) > sv.MAX_CPU:
        raise sv.bad_value(key, f"its cpus are not a list of at most {sv.MAX_CPU} CPU numbers", raw, expected=want)
    numbers = tuple(sv.int_field(key, "CPU number", c, 0, sv.MAX_CPU, expected=want, text=False, whole=raw) for c in cpus)
    if len(set(numbers)) != len(numbers):
        raise sv.bad_value(key, "its cpus repeat a CPU", raw, expected=want)
    return numbers


def parse_record(key: str, raw: Any, rank: int, world_size: int, *, process: bool = False) -> HostRecord:
    """Rank ``rank``'s :class:`HostRecord` as read from the store under ``key`` (pure), every
    field checked: its own rank, a host identity of sane length, distinct CPU numbers in
    ``0..MAX_CPU-1``, a launcher's local rank/size within the world.  ``process``: the record
    also names its process, as a shm group's records do: a ``pid`` in ``1..MAX_PID-1`` and a
    ``pid_ns`` checked as the host is.  Raises :class:`RendezvousError` naming ``key`` and
    what was wrong."""
    sv = store_values
    want = _PROCESS_RECORD if process else _RECORD
    d = sv.json_object(key, raw, _FIELDS + _PROCESS_FIELDS if process else _FIELDS, expected=want)
    if sv.int_field(key, "rank", d["rank"], 0, world_size, expected=want, text=False, whole=raw) != rank:
        raise sv.bad_value(key, f"its rank {d['rank']} is not {rank}, the rank of its key", raw, expected=want)
    host = _text(key, "host", d["host"], raw, want)
    cpus = _cpus(key, d["cpus"], raw, want)
    local_size = _optional_int(key, "local_size", d["local_size"], 1, world_size + 1, raw, want)
    local_rank = _optional_int(key, "local_rank", d["local_rank"], 0, local_size or world_size, raw, want)
    if not process:
        return HostRecord(rank, host, cpus, local_rank, local_size)
    pid = sv.int_field(key, "pid", d["pid"], 1, sv.MAX_PID, expected=want, text=False, whole=raw)
    return HostRecord(rank, host, cpus, local_rank, local_size, pid, _text(key, "pid_ns", d["pid_ns"], raw, want))


def check_records(records: Sequence[HostRecord], world_size: int) -> None:
    """Raise unless ``records`` hold each rank of ``0..world_size-1`` exactly once."""
    ranks = sorted(r.rank for r in records)
    if ranks != list(range(world_size)):
        raise RendezvousError(
            f"the host records gathered at init are for ranks {store_values.shown(ranks)}, not each rank "
            f"of 0..{world_size - 1} once",
            fix=store_values.FIX,
        )


def layout(records: Sequence[HostRecord], rank: int) -> Layout:
    """This rank's :class:`Layout` (pure).  Ranks on one host are numbered locally in
    global-rank order, as every launcher does for block placement.  ``records``: one per
    rank of the world, ``rank`` among them (:func:`check_records`)."""
    check_records(records, len(records))
    if not 0 <= rank < len(records):
        raise RendezvousError(f"rank {rank} is not a rank of the {len(records)} host records",
                              fix=store_values.FIX)
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
        _wait_all(store, keys, timeout, rank, what)
    except Exception:
        missing = _missing(store, keys)
        shown = missing if len(missing) <= 16 else f"{missing[:16]} and {len(missing) - 16} more"
        raise RendezvousError(
            f"rank {rank}: rank(s) {shown} of {world_size} never reached the {what} exchange "
            f"within {timeout.total_seconds():.0f} s",
            fix=missing_fix(str(shown)) if missing_fix else
            f"start rank(s) {shown} (check the launcher's rank count and their logs), or fix the world size",
        ) from None
    raw = _get_all(store, keys)
    if len(raw) != len(keys):
        raise RendezvousError(f"rank {rank}: the store answered {len(raw)} values for the {len(keys)} keys of "
                              f"the {what} exchange", fix=store_values.FIX)
    values = [store_values.text_value(k, v) for k, v in zip(keys, raw)]
    for r, v in enumerate(values):
        if v.startswith(_ERROR) and r != rank:
            raise RendezvousError(
                f"rank {rank}: rank {r} failed during init: {_peer_error(v[len(_ERROR):])}",
                fix=f"see rank {r}'s log for the cause; every rank stops with it",
            )
    return values


#: ``share(name, value, what)``: this rank's :func:`exchange` with its place in the job, the store and
#: the timeout bound -- every rank's value of exchange ``name`` in rank order (``what`` names the
#: exchange in errors).
Share = Callable[[str, str, str], List[str]]


def sharing(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Optional[Share]:
    """:func:`exchange` over ``store`` for this rank of this job, as one callable (None without a
    store: a world of one): what the backend's agreement is handed (it never sees the store)."""
    if store is None:
        return None

    def share(name: str, value: str, what: str) -> list[str]:
        return exchange(store, name, rank, world_size, value, timeout, what=what)

    return share


def _wait_all(store: Any, keys: Sequence[str], timeout: datetime.timedelta, rank: int, what: str) -> None:
    """``store.wait(keys, timeout)``, saying after :data:`NOTICE_AFTER` seconds which ranks are
    late, where, and for how long this rank will wait: a rank whose peers never come is not
    silent for the whole timeout."""
    import time

    first = min(timeout.total_seconds(), NOTICE_AFTER)
    end = time.monotonic() + first
    while time.monotonic() < end:  # polled: a timed-out store.wait makes torch warn on stderr
        if store.check(list(keys)):
            return
        time.sleep(0.05)
    if first >= timeout.total_seconds():
        store.wait(keys, datetime.timedelta(seconds=0.01))  # raises with the store's own words
        return
    from .identity import store_endpoint  # identity's job key reads the launchers' registry

    late = _missing(store, keys)
    shown = late if len(late) <= 16 else f"{late[:16]} and {len(late) - 16} more"
    log.warning("cpuddp: rank %d waiting for rank(s) %s at %s (the %s exchange), up to %.0f s (CPUDDP_TIMEOUT)",
                rank, shown, store_endpoint(store), what, timeout.total_seconds())
    store.wait(keys, timeout - datetime.timedelta(seconds=first))


def _peer_error(text: str) -> str:
    """A peer's published error for a message: one line of printable text, at most 500 characters."""
    line = "".join(c if c.isprintable() else " " for c in " ".join(text.split()))
    return line if len(line) <= 500 else line[:497] + "..."


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
    records = [parse_record(_key(name, r), v, r, world_size) for r, v in enumerate(values)]
    check_records(records, world_size)
    return records


def launcher_local_size(env: DistEnv) -> Optional[int]:
    """The ranks on this node as the launcher's own variable says (None when none said it)."""
    said = env.sources.get("local_world_size")
    return env.local_world_size if said is not None and said.kind is Source.VARIABLE else None


def apply_layout(env: DistEnv, lay: Layout, source: Provenance) -> DistEnv:
    """``env`` with local rank, local size, node rank and node count from the hosts gathered
    (the hosts win: they are what the ranks share); a launcher that said otherwise is logged.

    Fewer ranks on this host than the launcher's own variable says is refused: the host records
    come from the job's store, which any local user can write, and believing it would send this
    node's traffic through gloo's sockets, which any local user can reach (docs/security.md)."""
    said = launcher_local_size(env)
    if said is not None and lay.local_world_size < said:
        var = env.sources["local_world_size"].detail
        raise RendezvousError(
            f"rank {env.rank}: {var}={said} says {said} ranks run on this node, but the host records in the "
            f"rendezvous store show {lay.local_world_size}: something else writes to this job's store",
            fix=f"{store_values.STORE_FIX}; if the launcher is wrong, fix {var}")
    found = {"local_rank": lay.local_rank, "local_world_size": lay.local_world_size,
             "node_rank": lay.node_rank, "num_nodes": lay.num_nodes}
    changes = {k: v for k, v in found.items() if getattr(env, k) != v}
    if not changes:
        return env
    sources = dict(env.sources)
    for key, value in changes.items():
        told = sources.get(key)
        loud = told is not None and told.kind in (Source.VARIABLE, Source.PENDING)
        (log.warning if loud and env.is_main else log.info)(
            "cpuddp: %s %d from the hosts gathered at init, not %d (%s)", key, value, getattr(env, key),
            told or "default")
        sources[key] = source
    return env.replace(sources=sources, **changes)
