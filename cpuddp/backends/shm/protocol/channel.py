"""The node's channel: the segment protocol of one shm group behind one object, with one
lifecycle state.

Owns: the group's :class:`Lifecycle` (forming, live, broken, left, closed) and, once the
segment is mapped, the :class:`Channel` over it -- the agreement of each call (post its
descriptor, compare it with every peer's), the rounds, the abort word, leaving and closing.
The data paths (:mod:`cpuddp.backends.shm.python.local`, :mod:`~cpuddp.backends.shm.python.levels`,
:mod:`~cpuddp.backends.shm.cross.hierarchy`) need two calls of it: :meth:`Channel.agree` a call,
:meth:`Channel.round` a round.  The pieces it drives: :mod:`~cpuddp.backends.shm.protocol.segment`
(the mapping, the liveness locks), :mod:`~cpuddp.backends.shm.protocol.descriptor` (the descriptor rings),
:mod:`~cpuddp.backends.shm.protocol.wait` (the one wait policy).
May import: the shm modules named above, torch.distributed, cpuddp.errors.

**Publish, then count.** A rank makes a thing visible to its peers only by raising a counter
after it: the descriptor of call ``seq`` is written into the rank's ring entry, then its
``posted`` word is raised to ``seq``; its data for round ``e`` is written into its slots, then
its ``arrived`` word is raised to ``e``; a peer reads an entry or a slot only after it saw the
counter reach that value. On x86 the plain stores and loads keep that order (x86 keeps stores in
order and loads in order); on any other CPU (aarch64) the channel is handed the native library's
full fence (``fence``), called after each counter it waited for and before each counter it
raises -- the group forms there only on the native data path, so each rank of a group that runs
has it (:mod:`cpuddp.backends.shm.group.arch`). A rank writes a ring entry again only after
every peer's ``checked`` word passed the call that used it, and a slot buffer only two rounds
later, after every peer arrived at the round in between (which it does only after its reads).
Leaving raises ``checked`` past any call and sets the line's state word to *left*, so no peer
waits for a rank that is gone.

**Lifecycle.**  ``FORMING`` until the group is set up; ``LIVE``; ``BROKEN`` after any error of
a call (kept: every later call raises it at once, and the abort word stops the peers);
``LEFT`` after ``shutdown``/``destroy_process_group``/``cpuddp.shutdown`` (peers waiting for this
rank stop at once; use raises :class:`~cpuddp.errors.GroupShutDownError`); ``CLOSED`` once the
segment is unmapped.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional, Sequence, Tuple

import torch.distributed as dist

from cpuddp.errors import GroupShutDownError

from .descriptor import Call, Ring, describe
from ..native import Counters
from ..native.layout import C_CHECKED, C_STATE, STATE_LEFT, W_ABORT
from .segment import Segment
from .wait import Waiter

__all__ = ["State", "Lifecycle", "Channel"]


class State(enum.Enum):
    FORMING = "forming"
    LIVE = "live"
    BROKEN = "broken"
    LEFT = "left"
    CLOSED = "closed"


_LEAVING = "shut down (cpuddp.shutdown() or destroy_process_group())"
_GONE = (State.LEFT, State.CLOSED)


class Lifecycle:
    """One group's lifecycle state and why it is not live (the first error, or the leaving)."""

    def __init__(self) -> None:
        self.state = State.FORMING
        self.why = ""

    def live(self) -> None:
        if self.state is State.FORMING:
            self.state = State.LIVE

    def broke(self, why: str) -> None:
        """An error of a call: the first one is kept; a group that left stays left."""
        if self.state in (State.FORMING, State.LIVE):
            self.state, self.why = State.BROKEN, why

    def leave(self) -> bool:
        """Mark the group left; False when it had already left (or closed)."""
        if self.state in _GONE:
            return False
        self.state, self.why = State.LEFT, _LEAVING
        return True

    def close(self) -> None:
        self.state = State.CLOSED
        self.why = self.why or _LEAVING

    @property
    def gone(self) -> bool:
        return self.state in _GONE

    def check_usable(self) -> None:
        """Raise for a group that left or closed (a broken one raises at its next agreement)."""
        if self.state in _GONE:
            raise GroupShutDownError(f"this shm process group was {self.why}: it cannot run collectives any "
                                     "more", fix="use the group of a new init (cpuddp.init_distributed()), and "
                                                 "wrap the model again (cpuddp.prepare or DDP) after a re-init")

    def check_not_broken(self) -> None:
        if self.state is State.BROKEN:
            raise dist.DistBackendError(f"the shm process group is broken by an earlier error: {self.why}")


class Channel:
    """This rank's side of the node's segment protocol (see the module docstring)."""

    def __init__(self, seg: Segment, local: Sequence[int], rank: int, waiter: Waiter, life: Lifecycle,
                 fence: Optional[Callable[[], None]] = None) -> None:
        self.seg, self.local, self.rank, self.waiter, self.life = seg, tuple(local), rank, waiter, life
        self.me, self.n = seg.local_rank, seg.size
        #: a full memory fence around the counters (None on x86, whose store order is the protocol's)
        self.fence = fence
        self.ring = Ring(seg, fence)
        #: the counters this rank's calls advance, shared with the native data path (one home:
        #: a group runs some calls there and others here)
        self.state = Counters()
        self._unchecked: Optional[Tuple[int, Call]] = None

    @property
    def epoch(self) -> int:
        """The last round this rank arrived at."""
        return self.state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.state.epoch = value

    @property
    def seq(self) -> int:
        """The last call this rank posted."""
        return self.state.seq

    @seq.setter
    def seq(self, value: int) -> None:
        self.state.seq = value

    @property
    def calls(self) -> int:
        """Collectives agreed so far (either path)."""
        return self.state.calls

    def describe(self, call: Call) -> str:
        """``call`` as text (an error's words)."""
        return describe(call.words())

    # ------------------------------------------------------------------ the two calls

    def agree(self, call: Call) -> None:
        """Post the next call's descriptor; it is compared at the call's first round (or by
        :meth:`settle` for a call without one)."""
        self.life.check_not_broken()
        self.seq += 1
        seq = self.seq
        if self.n > 1 and self.ring.slot_free(seq):
            self.waiter.until(lambda: bool(self.ring.slot_free(seq)), lambda: self.ring.slot_free(seq),
                              f"call #{seq - 16} to be checked", self._poll)
        self.ring.post(seq, call)
        self._unchecked = (seq, call)
        self.state.calls += 1

    def round(self, e: int) -> None:
        """Announce arrival at round ``e``; return once every local peer has arrived there (and
        the call's descriptors, posted before any round, are compared)."""
        seg, fence = self.seg, self.fence
        if fence is not None:
            fence()  # this rank's writes and reads of the slots before its arrival
        seg.mine.value = e
        arrived = seg.arrived
        if min(arrived) < e:
            self.waiter.until(lambda: min(arrived) < e, lambda: seg.late(arrived, e),
                              f"a shared-memory round ({e})", self._poll)
        if fence is not None:
            fence()  # the peers' arrivals before this rank reads what they wrote
        if self._unchecked is not None:
            self.settle()
        if seg.words[W_ABORT]:  # a peer gave up: what it left in the slots may be from a call it abandoned
            self.waiter.check_abort()
        self.epoch = e

    def next_round(self) -> int:
        """The round after the last one (a data path's next epoch)."""
        return self.epoch + 1

    def settle(self) -> None:
        """Finish the posted call's agreement: wait until every local peer posted it, compare."""
        if self._unchecked is None:
            return
        seq, call = self._unchecked
        if self.ring.late(seq):
            self.waiter.until(lambda: bool(self.ring.late(seq)), lambda: self.ring.late(seq),
                              f"collective call #{seq} ({describe(call.words())})", self._poll)
        self._unchecked = None
        self.ring.compare(seq, call, self.local)

    def _poll(self) -> None:
        """While waiting: a peer that posted a different call is a mismatch now, not at the timeout."""
        if self._unchecked is not None and not self.ring.late(self._unchecked[0]):
            self.settle()

    # ------------------------------------------------------------------ the lifecycle's ends

    def fail(self, why: str) -> None:
        """This rank gave up: the group is broken, and the abort word stops the peers."""
        self.life.broke(why)
        self.waiter.abort(self.me)

    def leave(self) -> None:
        """Peers waiting for this rank stop at once: its line says it left, and no call of theirs
        waits for it to check one."""
        self.seg.lines[self.me][C_STATE] = STATE_LEFT
        self.seg.lines[self.me][C_CHECKED] = 1 << 62

    def close(self) -> None:
        self.life.close()
        self.seg.close()
