"""The watchdog's store client and key protocol (see :mod:`cpuddp.watchdog`).

Keys, under ``cpuddp/watchdog/<attempt>/`` (``TORCHELASTIC_RESTART_COUNT``, else 0):

* ``info`` -- one ``rank<TAB>pid<TAB>hostname<TAB>host identity`` line per rank, appended once;
* ``hb/<rank>`` -- the rank's heartbeat counter, added to every interval;
* ``failed`` -- ``rank<TAB>Type: message`` per uncaught exception, in the order they happened;
* ``done`` -- ``rank`` per rank that called :func:`cpuddp.watchdog.stop`.

The parsers (:func:`parse_info`, :func:`parse_failed`, :func:`parse_ranks`) are pure; the
client is a second connection to the rendezvous store, every request bounded by ``op_timeout``.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterable
from typing import Any, Optional

from .watchdog_verdict import PeerInfo

__all__ = ["StoreClient", "parse_info", "parse_failed", "parse_ranks"]


def parse_ranks(text: str) -> set[int]:
    """The ranks at the start of each line (``done``, or ``failed``'s first column)."""
    out = set()
    for line in text.splitlines():
        head = line.split("\t", 1)[0].strip()
        if head.isdigit():
            out.add(int(head))
    return out


def parse_failed(text: str) -> tuple[tuple[int, str], ...]:
    """``failed`` -> ``((rank, "Type: message"), ...)`` in the order written."""
    out = []
    for line in text.splitlines():
        head, _, why = line.partition("\t")
        if head.strip().isdigit():
            out.append((int(head), why.strip()))
    return tuple(out)


def parse_info(text: str) -> dict[int, PeerInfo]:
    """``info`` -> rank -> :class:`PeerInfo` (malformed lines skipped)."""
    out = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = PeerInfo(int(parts[1]), parts[2], parts[3])
    return out


class StoreClient:
    """The watchdog's own connection to the rendezvous store, speaking the key protocol."""

    def __init__(self, store: Any, host: Any, port: Any, op_timeout: float) -> None:
        """``host``/``port``: the launcher's MASTER_ADDR/MASTER_PORT, used when ``store`` does
        not say where it is."""
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
        k = self.key(name)
        if not self.client.check([k]):
            return ""
        return self.client.get(k).decode(errors="replace")

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
        return parse_info(self.get_text("info"))

    def failed(self) -> tuple[tuple[int, str], ...]:
        return parse_failed(self.get_text("failed"))

    def done(self) -> set[int]:
        return parse_ranks(self.get_text("done"))

    def counters(self, ranks: Iterable[int]) -> dict[int, int]:
        """The heartbeat counters of ``ranks`` (0 for a rank that never beat)."""
        ranks = list(ranks)
        keys = [self.key(f"hb/{r}") for r in ranks]
        if keys and self.client.check(keys):
            values = self.client.multi_get(keys)
            return {r: int(v or b"0") for r, v in zip(ranks, values)}
        return {r: int(self.client.add(k, 0)) for r, k in zip(ranks, keys)}
