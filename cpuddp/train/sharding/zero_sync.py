"""``shard="optimizer"``: what the ranks agree on before they act -- when sharding starts, and
that every rank is in ``optimizer.state_dict()`` (:mod:`cpuddp.train.sharding.zero` does the sharding).

**When sharding starts.**  DDP rebuilds its gradient buckets once, after the first iteration;
the optimizer is sharded over the buckets' layout once it has settled.  Each step before
that, every rank says what it saw (:func:`local_verdict`: its code and a checksum of the
layout) in one all-reduce of three ``int64`` (:func:`agree_start`), and all ranks act on the
common verdict (:func:`decide_start`, pure): shard now, wait (and why), or stop because the
ranks' layouts differ.  No rank shards on its own.  A run still unsharded after
:data:`WARN_AFTER` steps gets a warning with the reason.  :class:`BucketLayout` keeps what this
rank saw (each bucket's parameters, and DDP's all-reduced buffers the first sharded step reads)
and asks the others.

**state_dict() is a collective once sharded** (it gathers every rank's share).  Called on
one rank only (``if rank == 0: torch.save(optimizer.state_dict(), path)``), that rank would
wait in a collective the others never make.  So a rank entering it says so in the process
group's store and waits there -- making no collective -- until every rank has entered
(:class:`StateDictGate`).  Each rank also writes there how many rounds of collectives it has
begun (a backward's gradients, a forward's buffers): a waiting rank that sees another begin
more rounds than itself knows that rank went on without the call, and raises at once naming
the fix.  A rank left waiting otherwise
(the others in a barrier, or gone) warns after :data:`WARN_WAIT` seconds and raises at the
store's timeout (the process group's).  The cost: one store write per backward once sharded.  Where torch gives no store, the gate stands open.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from cpuddp.errors import PrepareError, warn

__all__ = ["WARN_AFTER", "WARN_WAIT", "REASONS", "local_verdict", "decide_start", "agree_start",
           "BucketLayout", "StateDictGate", "ALONE_FIX"]

_log = logging.getLogger("cpuddp.prepare")

#: Steps without sharding after which shard="optimizer" warns (DDP settles after 2).
WARN_AFTER = 10
#: Seconds a rank waits in state_dict() for the others before it warns.
WARN_WAIT = 30.0
#: Why a rank cannot shard yet, by code (0: it can).
REASONS = {
    1: "no gradient reached DDP's communication hook since the last step (backward did not run through the "
       "model cpuddp.prepare() returned, or ran under no_sync only)",
    2: "DDP's gradient buckets changed since the last step (DDP rebuilds them once, after the first iteration)",
}
ALONE_FIX = ("call optimizer.state_dict() on every rank and write on one (`sd = optimizer.state_dict()`, "
             "then `if rank == 0: torch.save(sd, path)`), or save with cpuddp.save_checkpoint(...) on every rank")


def local_verdict(seen: dict[int, tuple[int, ...]], last: Optional[tuple]) -> tuple[int, int, tuple]:
    """``(code, checksum, layout)`` of this rank's step: ``seen`` maps each bucket index of this
    step's backward to its parameters' positions in the model; ``last``: the previous step's layout."""
    layout = tuple(sorted(seen.items()))
    if not layout:
        return 1, 0, layout
    crc = zlib.crc32(repr(layout).encode())
    return (0 if layout == last else 2), crc, layout


def decide_start(reduced: Sequence[int]) -> tuple[str, str]:
    """Pure: the common verdict from the all-reduced (MAX) ``[code, checksum, -checksum]``:
    ``("shard", "")``, ``("wait", reason)`` or ``("error", reason)``."""
    code, high, neg_low = (int(x) for x in reduced)
    if code:
        return "wait", REASONS.get(code, f"code {code}")
    if high != -neg_low:
        return "error", ("the ranks' DDP gradient buckets differ (the same layout on every rank was expected: "
                         "are the models the same on every rank?)")
    return "shard", ""


def agree_start(code: int, crc: int, group: Any) -> tuple[str, str]:
    """Every rank's verdict combined (one all-reduce of three int64): see :func:`decide_start`."""
    t = torch.tensor([code, crc, -crc], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return decide_start(t.tolist())


def _store_of(group: Any) -> Any:
    """The process group's store (torch keeps it privately; None where this torch does not)."""
    try:
        import torch.distributed.distributed_c10d as c10d

        pg = group if group is not None else c10d._get_default_group()
        return c10d._world.pg_map[pg][1]
    except Exception:  # noqa: BLE001 - any torch without it: the gate stands open
        return None


class StateDictGate:
    """Every rank must be in ``state_dict()`` before its collectives start (see the module)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.store = _store_of(group)
        self.calls = 0  # state_dict() calls this rank made while sharded
        self.rounds = 0  # collective rounds (a backward's gradients, a forward's buffers) this rank began
        self.prefix = ""
        if self.store is not None:  # a name every rank shares, new for each gate
            n = torch.tensor([self.store.add("cpuddp/zero/gates", 1) if self.rank == 0 else 0], dtype=torch.int64)
            src = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast(n, src=src, group=group)
            self.prefix = f"cpuddp/zero/{int(n.item())}"

    def begin_round(self) -> None:
        """Before a round of collectives outside state_dict(): say so (one store write)."""
        self.rounds += 1
        if self.store is not None:
            self.store.set(f"{self.prefix}/rounds/{self.rank}", str(self.rounds))

    def _past(self, mine: int) -> Optional[int]:
        """A rank that began more rounds than ``mine`` (it went on without this state_dict() call)."""
        for r in range(self.world):
            key = f"{self.prefix}/rounds/{r}"
            if r != self.rank and self.store.check([key]) and int(self.store.get(key)) > mine:
                return r
        return None

    def enter(self) -> None:
        """Wait (no collective) until every rank has entered this state_dict() call."""
        call, self.calls = self.calls, self.calls + 1
        if self.store is None or self.world == 1:
            return
        key = f"{self.prefix}/state_dict/{call}"
        self.store.add(key, 1)
        start, warned, delay = time.monotonic(), False, 0.001
        limit = self.store.timeout.total_seconds()
        while self.store.add(key, 0) < self.world:
            other = self._past(self.rounds)
            if other is not None:
                raise PrepareError(
                    f"shard='optimizer': optimizer.state_dict() gathers every rank's share of the optimizer state, "
                    f"so every rank must call it; rank {self.rank} did, rank {other} went on training instead.",
                    fix=ALONE_FIX)
            waited = time.monotonic() - start
            if waited > limit:
                raise PrepareError(
                    f"shard='optimizer': rank {self.rank} waited {waited:.0f} s in optimizer.state_dict() for the "
                    "other ranks; it is a collective (it gathers every rank's share).", fix=ALONE_FIX)
            if waited > WARN_WAIT and not warned:
                warned = True
                warn(f"cpuddp shard='optimizer': rank {self.rank} has waited {WARN_WAIT:.0f} s in "
                     f"optimizer.state_dict() for the other ranks (it gathers every rank's share): if only some "
                     f"ranks call it, {ALONE_FIX}.", RuntimeWarning)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


class BucketLayout:
    """DDP's gradient buckets as this rank saw them in the backwards since the last step, and
    whether every rank saw the same settled layout (then the optimizer may be sharded over it)."""

    def __init__(self, model: Any, group: Any) -> None:
        self.group = group
        self.seen: dict[int, tuple] = {}  # bucket index -> its parameters, this backward
        self.reduced: dict[int, torch.Tensor] = {}  # bucket index -> DDP's all-reduced buffer (unsharded steps)
        self.waiting: Optional[str] = None  # why the last step ran unsharded (every rank agreed on it)
        self._last: Optional[tuple] = None  # the layout of the previous step
        self._position = {id(p): i for i, p in enumerate(model.parameters())}

    def saw(self, index: int, params: tuple, buffer: Optional[torch.Tensor] = None) -> None:
        """A bucket went through the hook (with its buffer, while unsharded: the step reads it)."""
        self.seen[index] = params
        if buffer is not None:
            self.reduced[index] = buffer

    def forget(self) -> None:
        """A step is done: the next backward's buckets start afresh (DDP drops the old ones when it rebuilds)."""
        self.seen, self.reduced = {}, {}

    def agree(self, steps: int) -> bool:
        """Shard now?  When every rank saw the same settled layout (one all-reduce); else say why
        not (:attr:`waiting`; a warning after :data:`WARN_AFTER` steps); :class:`PrepareError`
        when the ranks' layouts differ.  The warning names the caller's caller's caller (the step)."""
        seen = {i: tuple(self._position.get(id(p), -1) for p in ps) for i, ps in self.seen.items()}
        code, crc, layout = local_verdict(seen, self._last)
        self._last = layout
        verdict, why = agree_start(code, crc, self.group)
        if verdict == "error":
            raise PrepareError(f"shard='optimizer' cannot shard: {why}", fix="prepare the same model on every rank")
        self.waiting = None if verdict == "shard" else why
        if verdict != "shard" and steps == WARN_AFTER:
            warn(f"cpuddp shard='optimizer': the optimizer is still not sharded after {steps} steps "
                 f"(every rank steps the whole optimizer state, as DDP does): {why}", RuntimeWarning)
        return verdict == "shard"
