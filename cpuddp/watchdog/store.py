"""The watchdog's store client and key protocol (see :mod:`cpuddp.watchdog`).

Keys, under ``cpuddp/watchdog/<attempt>/`` (``TORCHELASTIC_RESTART_COUNT``, else 0):

* ``info`` -- one ``rank<TAB>pid<TAB>hostname<TAB>host identity`` line per rank, appended once;
* ``hb/<rank>`` -- the rank's heartbeat counter, added to every interval;
* ``failed`` -- ``rank<TAB>Type: message`` per uncaught exception, in the order they happened;
* ``done`` -- ``rank`` per rank that called :func:`cpuddp.watchdog.monitor.stop`.

The parsers (:func:`parse_info`, :func:`parse_failed`, :func:`parse_ranks`,
:func:`parse_counter`) are pure and strict: anything on a line that a rank of this job would not
have written (a rank outside the world, a non-numeric pid, a wrong field count, a huge value)
is a :class:`~cpuddp.errors.RendezvousError` naming the key, which the watchdog prints in place
of a verdict.  The client is a second connection to the rendezvous store, every request
bounded by ``op_timeout``.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterable
from typing import Any, Optional

from cpuddp.launchers.store_values import MAX_HOST, MAX_PID, MAX_VALUE, bad_value, int_field, text_value

from .verdict import PeerInfo

__all__ = ["StoreClient", "parse_info", "parse_failed", "parse_ranks", "parse_counter", "MAX_DESCRIPTION"]

#: The longest description of a failure accepted in ``failed`` (:func:`describe` writes at most 200).
MAX_DESCRIPTION = 1000
_DONE = "one rank per line"
_FAILED = "rank<TAB>Type: message lines"
_INFO = "rank<TAB>pid<TAB>hostname<TAB>host identity lines"


def _lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line]


def _printable(text: str) -> str:
    """Another rank's free text (an exception's first line) for a message: one printable line."""
    return "".join(c if c.isprintable() else " " for c in text)


def parse_ranks(text: str, key: str, world: int) -> set[int]:
    """``done`` -> the set of ranks, one per line; anything else on a line is an error naming ``key``."""
    return {int_field(key, "rank", line, 0, world, expected=_DONE, whole=line) for line in _lines(text)}


def parse_failed(text: str, key: str, world: int) -> tuple[tuple[int, str], ...]:
    """``failed`` -> ``((rank, "Type: message"), ...)`` in the order written; each line is
    ``rank<TAB>description`` with a rank of the world and at most :data:`MAX_DESCRIPTION` characters."""
    out = []
    for line in _lines(text):
        head, tab, why = line.partition("\t")
        rank = int_field(key, "rank", head, 0, world, expected=_FAILED, whole=line)
        if not tab or "\t" in why or len(why) > MAX_DESCRIPTION:
            raise bad_value(key, f"a line that is not rank<TAB>description (at most {MAX_DESCRIPTION} characters)",
                            line, expected=_FAILED)
        out.append((rank, _printable(why.strip())))
    return tuple(out)


def _info_line(key: str, line: str, world: int) -> tuple[int, PeerInfo]:
    parts = line.split("\t")
    if len(parts) != 4:
        raise bad_value(key, f"a line of {len(parts)} tab-separated fields, not 4", line, expected=_INFO)
    rank = int_field(key, "rank", parts[0], 0, world, expected=_INFO, whole=line)
    pid = int_field(key, "pid", parts[1], 1, MAX_PID, expected=_INFO, whole=line)
    for name, value in (("hostname", parts[2]), ("host identity", parts[3])):
        if not value or len(value) > MAX_HOST or not value.isprintable():
            raise bad_value(key, f"its {name} is not printable text of 1..{MAX_HOST} characters", line,
                            expected=_INFO)
    return rank, PeerInfo(pid, parts[2], parts[3])


def parse_info(text: str, key: str, world: int) -> dict[int, PeerInfo]:
    """``info`` -> rank -> :class:`PeerInfo`.  Every line is checked (4 fields, a rank of the
    world, a pid of 1..2**22-1, printable host fields); a rank announced twice with different
    facts is an error, the same line twice (a rank that started its watchdog again) is not."""
    out: dict[int, PeerInfo] = {}
    for line in _lines(text):
        rank, peer = _info_line(key, line, world)
        if out.get(rank, peer) != peer:
            raise bad_value(key, f"rank {rank} announced twice, as {out[rank]} and as {peer}", line,
                            expected=_INFO)
        out[rank] = peer
    return out


def parse_counter(key: str, raw: Any) -> int:
    """A heartbeat counter (``add``'s decimal text; empty: never beat)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return int_field(key, "heartbeat counter", raw, 0, 1 << 63, expected="a heartbeat counter")
    text = text_value(key, raw, limit=32, expected="a heartbeat counter")
    return int_field(key, "heartbeat counter", text or "0", 0, 1 << 63, expected="a heartbeat counter")


class StoreClient:
    """The watchdog's own connection to the rendezvous store, speaking the key protocol."""

    def __init__(self, store: Any, host: Any, port: Any, op_timeout: float, world: int) -> None:
        """``host``/``port``: the launcher's MASTER_ADDR/MASTER_PORT, used when ``store`` does
        not say where it is; ``world``: the world size, that every rank read is checked against."""
        self.world = int(world)
        base = getattr(store, "underlying_store", store)  # PrefixStore -> its TCPStore
        self.host = str(getattr(base, "host", "") or host)
        self.port = int(getattr(base, "port", 0) or port)
        self.op_timeout = op_timeout
        self.prefix = f"cpuddp/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.client = self._connect(base)

    def _connect(self, base: Any) -> Any:
        import torch.distributed as dist

        td = datetime.timedelta(seconds=self.op_timeout)
        if hasattr(base, "clone"):
            # Its own connection (one more per rank on the store's host), so a heartbeat is never
            # queued behind a long request of the main thread's.
            client = base.clone()
        else:
            client = dist.TCPStore(self.host, self.port, None, False, td, wait_for_workers=False)
        client.set_timeout(td)
        return client

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def key(self, name: str) -> str:
        return self.prefix + name

    def connect_error(self) -> Optional[str]:
        """A plain TCP connect (no request, so a dead store costs no error spew from torch):
        None when it succeeds, else ``host:port: why``."""
        try:
            with socket.create_connection((self.host, self.port), timeout=self.op_timeout):
                return None
        except OSError as exc:
            return f"{self.address}: {exc.strerror or exc}"

    def get_text(self, name: str) -> str:
        """The text under ``name`` ("" when unset), at most what ``world`` ranks could write."""
        k = self.key(name)
        if not self.client.check([k]):
            return ""
        limit = MAX_VALUE + self.world * (2 * MAX_HOST + MAX_DESCRIPTION + 64)
        return text_value(k, self.client.get(k), limit=limit)

    # -- writes

    def announce(self, rank: int, pid: int, hostname: str, identity: str) -> None:
        self.client.append(self.key("info"), f"{rank}\t{pid}\t{hostname}\t{identity}\n")

    def beat(self, rank: int) -> None:
        self.client.add(self.key(f"hb/{rank}"), 1)

    def mark_failed(self, rank: int, description: str) -> None:
        self.client.append(self.key("failed"), f"{rank}\t{description}\n")

    def mark_done(self, rank: int) -> None:
        self.client.append(self.key("done"), f"{rank}\n")

    # -- reads

    def info(self) -> dict[int, PeerInfo]:
        return parse_info(self.get_text("info"), self.key("info"), self.world)

    def failed(self) -> tuple[tuple[int, str], ...]:
        return parse_failed(self.get_text("failed"), self.key("failed"), self.world)

    def done(self) -> set[int]:
        return parse_ranks(self.get_text("done"), self.key("done"), self.world)

    def counters(self, ranks: Iterable[int]) -> dict[int, int]:
        """The heartbeat counters of ``ranks`` (0 for a rank that never beat)."""
        ranks = list(ranks)
        keys = [self.key(f"hb/{r}") for r in ranks]
        if keys and self.client.check(keys):
            values = self.client.multi_get(keys)
            return {r: parse_counter(k, v) for r, k, v in zip(ranks, keys, values)}
        return {r: parse_counter(k, self.client.get(k)) if self.client.check([k]) else 0 for r, k in zip(ranks, keys)}
