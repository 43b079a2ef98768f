"""The watchdog's decisions, as pure functions over plain data (no store, no processes, no clock).

:mod:`cpuddp.watchdog` reads the rendezvous store into a :class:`Snapshot` (who raised, who
left, each rank's pid/host/host identity, which local peers' pids are gone, and -- only when
:func:`ranks_to_watch` asks for it -- how each watched rank's heartbeat counter moved over a
measured time), then :func:`decide` turns it into a :class:`Verdict`, the line printed after
the traceback.  The order of precedence:

1. a local peer whose process is gone, or a peer whose heartbeat did not move: *lost*
   ("died without a Python exception" / "no heartbeat from ...", with :func:`why_silent`: a
   peer on this machine in another PID namespace is "died or stuck", never "its host is down");
2. else the first rank in ``failed`` other than this one: it *raised*;
3. else, for a communication failure, peers that called ``stop`` (``done``): they *left*;
4. else nothing is known: None.

Heartbeats are watched only when nobody is known to have died or raised, the exception looks
like a communication failure (:func:`looks_like_comm_failure`), and some peer is still in play.
:func:`store_gone` is the verdict when the store itself cannot be reached; :func:`linger_waiting`
and :class:`HeartbeatClock` decide how long rank 0 keeps the store up at exit.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from cpuddp.errors import first_line
from cpuddp.topology.here import machine_of

__all__ = [
    "PeerInfo", "Snapshot", "Verdict", "VerdictKind", "HeartbeatClock",
    "decide", "ranks_to_watch", "store_gone", "linger_waiting", "local_ranks",
    "looks_like_comm_failure", "describe", "why_silent",
]

# Words in an exception's text that mark a failure of the group rather than of the user's code.
COMM_WORDS = (
    "gloo", "connection", "peer", "timed out", "timeout", "store", "socket", "broken pipe",
    "ccl", "processgroup", "process group", "collective", "rendezvous",
    "shm", "died while",  # cpuddp.shm's "shm allreduce: rank(s) [1] ... died while rank 0 waited"
)


@dataclass(frozen=True)
class PeerInfo:
    """What a rank wrote to ``info`` at start: its pid, hostname and host identity."""

    pid: int
    host: str
    identity: str


@dataclass(frozen=True)
class Snapshot:
    """What one rank read from the store (and its own host) at one moment.

    ``failed``: ``(rank, "Type: message")`` in the order they were written (first in, first
    failed).  ``exited``: ranks on this host (same :attr:`identity`) whose pid is gone.
    ``heartbeats``: rank -> (counter when watching began, last counter read), over
    ``watched`` seconds; empty when nobody was watched.
    """

    rank: int
    world: int
    identity: str
    failed: tuple[tuple[int, str], ...] = ()
    done: frozenset[int] = frozenset()
    info: Mapping[int, PeerInfo] = field(default_factory=dict)
    exited: frozenset[int] = frozenset()
    heartbeats: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    watched: float = 0.0


class VerdictKind(str, enum.Enum):
    LOST = "lost"  # died (local pid gone) or silent (heartbeat stopped)
    RAISED = "raised"  # another rank's uncaught exception came first
    LEFT = "left"  # peers called stop() while this rank expected them in a collective
    STORE_GONE = "store_gone"  # the rendezvous store (and so its host) is gone


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    ranks: tuple[int, ...]
    message: str


def local_ranks(info: Mapping[int, PeerInfo], identity: str, rank: int) -> list[int]:
    """The other ranks on this host (same host identity): their pids can be checked here."""
    return [r for r, p in sorted(info.items()) if r != rank and p.identity == identity]


def _in_play(s: Snapshot) -> list[int]:
    """Peers neither this rank, nor known to have raised, nor to have left."""
    failed = {r for r, _ in s.failed}
    return [r for r in range(s.world) if r != s.rank and r not in failed and r not in s.done]


def _split(s: Snapshot) -> tuple[list[int], list[int], Optional[tuple[int, str]]]:
    """(dead local peers, the other peers in play, the first failure if it is not this rank's)."""
    dead, rest = [], []
    for r in _in_play(s):
        local = r in s.info and s.info[r].identity == s.identity
        (dead if local and r in s.exited else rest).append(r)
    first = s.failed[0] if s.failed else None
    return dead, rest, (first if first is not None and first[0] != s.rank else None)


def ranks_to_watch(s: Snapshot, comm_failure: bool) -> list[int]:
    """The peers whose heartbeats must be watched before :func:`decide` (none: decide at once)."""
    dead, rest, blamed = _split(s)
    return rest if comm_failure and not dead and blamed is None else []


def _who(s: Snapshot, r: int) -> str:
    p = s.info.get(r)
    return f"rank {r} (pid {p.pid} on {p.host})" if p is not None else f"rank {r}"


def why_silent(identity: str, peer: Optional[PeerInfo]) -> str:
    """Why a peer's heartbeat may have stopped, from where it runs relative to this rank
    (``identity``: this rank's ``host_identity(("net", "pid"))``).  A peer on this machine in
    another PID (or network) namespace -- a container -- is not a lost host: the machine is up,
    since this rank runs on it, and only its pid cannot be checked from here."""
    if peer is None:
        return "its host is down or unreachable, or it is stuck"
    if peer.identity == identity:  # its pid was checked: alive
        return "alive but not responding: stopped, or stuck holding the GIL"
    if machine_of(peer.identity) == machine_of(identity):
        return ("it runs on this machine in another PID or network namespace (a container), where its pid "
                "cannot be checked: it died, or it is stuck")
    return "its host is down or unreachable, or it is stuck"


def _lost(s: Snapshot, dead: list[int], stale: list[int]) -> Verdict:
    details = [f"{_who(s, r)} died without a Python exception (killed, a crash, or os._exit)" for r in dead]
    for r in stale:
        why = why_silent(s.identity, s.info.get(r))
        details.append(f"no heartbeat from {_who(s, r)} for {s.watched:.0f} s ({why})")
    ranks = tuple(sorted(dead + stale))
    return Verdict(VerdictKind.LOST, ranks,
                   f"cpuddp: [rank{s.rank}] lost rank(s) {list(ranks)}: " + "; ".join(details))


def decide(s: Snapshot, comm_failure: bool) -> Optional[Verdict]:
    """Who was lost, by precedence (see the module docstring); None when nobody is known to be."""
    dead, rest, blamed = _split(s)
    stale: list[int] = []
    if rest and comm_failure and not dead and blamed is None:
        stale = [r for r in rest if r in s.heartbeats and s.heartbeats[r][0] == s.heartbeats[r][1]]
    if dead or stale:
        return _lost(s, dead, stale)
    me = f"cpuddp: [rank{s.rank}]"
    if blamed is not None:
        r, why = blamed
        return Verdict(VerdictKind.RAISED, (r,), f"{me} lost rank(s) [{r}]: {_who(s, r)} raised {why}")
    if comm_failure and s.done:
        gone = sorted(s.done - {r for r, _ in s.failed} - {s.rank})
        if gone:
            return Verdict(VerdictKind.LEFT, tuple(gone),
                           f"{me} rank(s) {gone} already left the group (shutdown or exit) while this rank "
                           f"still expected them in a collective: the ranks ran different collectives")
    return None


def store_gone(rank: int, agent_store: bool, store_lost: Optional[str],
               known: Mapping[int, PeerInfo]) -> Optional[Verdict]:
    """The verdict when the store cannot be reached: torchrun's agent, or rank 0 (its host)."""
    me = f"cpuddp: [rank{rank}]"
    if agent_store:
        return Verdict(VerdictKind.STORE_GONE, (),
                       f"{me} the rendezvous store (torchrun's agent at {store_lost}) is gone: "
                       f"the agent or its node died; see the launcher's log")
    if rank == 0:
        return None
    p = known.get(0)
    who = f"rank 0 (pid {p.pid} on {p.host})" if p is not None else "rank 0"
    return Verdict(VerdictKind.STORE_GONE, (0,),
                   f"{me} lost {who}, which hosts the rendezvous store (at {store_lost}); see rank 0's log")


def linger_waiting(world: int, done: Iterable[int], failed: Iterable[int], exited: Iterable[int]) -> list[int]:
    """The ranks rank 0 still waits for at exit: not left, not failed, not exited."""
    gone = set(done) | set(failed) | set(exited)
    return [r for r in range(world) if r not in gone]


class HeartbeatClock:
    """Each rank's last heartbeat counter and the (caller's monotonic) time it last moved."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, float]] = {}

    def observe(self, counters: Mapping[int, int], now: float) -> None:
        for r, v in counters.items():
            if r not in self.seen or self.seen[r][0] != v:
                self.seen[r] = (v, now)

    def all_silent(self, ranks: Iterable[int], now: float, stale: float) -> bool:
        """True when none of ``ranks`` moved in the last ``stale`` seconds (all observed)."""
        return all(now - self.seen[r][1] >= stale for r in ranks)


# --------------------------------------------------------------------------- the exception


def looks_like_comm_failure(exc_type: type, exc: Optional[BaseException]) -> bool:
    """Does this exception look like a failure of the group (so peers are worth watching)?"""
    mod = getattr(exc_type, "__module__", "") or ""
    if mod.startswith("torch.distributed") or exc_type.__name__.startswith("Dist"):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    text = f"{exc_type.__name__} {exc}".lower()
    return any(w in text for w in COMM_WORDS)


def describe(exc_type: type, exc: Optional[BaseException]) -> str:
    """``Type: first line``, one line without tabs, at most 200 characters."""
    line = f"{exc_type.__name__}: {first_line(exc)}" if exc is not None else exc_type.__name__
    line = " ".join(line.split())  # one line, no tabs
    return line if len(line) <= 200 else line[:197] + "..."
