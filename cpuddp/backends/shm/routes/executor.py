"""What a shm group's routes run a call through: the group's side of every collective, made by
the group when it forms and handed to its route (:class:`Executor`), so no route reaches into
the group.

A route checks a call, then hands it here with a body (the Python engine's rounds) or a native
job: :meth:`Executor.run` posts the call's descriptor, runs the body and finishes the
agreement; :meth:`Executor.run_native` runs one native call, which agrees itself;
:meth:`Executor.submit_native` queues one on the native progress thread
(:meth:`Executor.queues` says whether a call goes there).  All in issue order: in the caller's
thread or the group's communication thread (:class:`~cpuddp.backends.shm.routes.stream.Stream`),
a call run here after every call queued before it (:mod:`cpuddp.backends.shm.routes.progress`).
An error from there on breaks the group and stops the node's peers.  Besides: the group's rank
and size, a group rank's local rank (:meth:`Executor.local_rank_of`), the check of a root
(:meth:`Executor.check_root`), and whether this process may use the group
(:meth:`Executor.usable`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

from cpuddp.errors import BackendError, GroupShutDownError

from ..protocol.descriptor import encode
from ..python.ops import dense
from .hold import Held
from .stream import ASYNC_FROM

__all__ = ["Executor"]


def _nbytes(tensors: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Executor:
    """One group's calls (see the module docstring).  ``local``: the group's ranks in local-rank
    order (single-node groups); ``life``: the group's
    :class:`~cpuddp.backends.shm.protocol.channel.Lifecycle`; ``pid``: the process that formed
    it; ``progress``: the native progress thread, or None; ``ch``: the node's channel, or None
    (a group with no engine of the node's runs nothing here)."""

    def __init__(self, rank: int, size: int, local: Sequence[int], life: Any, pid: int, stream: Any,
                 progress: Optional[Any], ch: Optional[Any]) -> None:
        self.rank, self.size = rank, size
        self._local = tuple(local)
        self._life, self._pid, self._stream, self._progress, self._ch = life, pid, stream, progress, ch

    def usable(self) -> None:
        """Raise unless this process may use the group now (live, and not a forked child)."""
        self._life.check_usable()
        if os.getpid() != self._pid:
            raise GroupShutDownError(f"this process (pid {os.getpid()}) is a fork of rank {self.rank} (pid "
                                     f"{self._pid}): a forked child cannot use its parent's process group",
                                     fix="run collectives in the parent only (DataLoader workers need none)")

    def run(self, kind: str, agreed: Sequence[Any], body: Callable[[], None], result: Any, *,
            op: Any = None, root: Optional[int] = None) -> Any:
        """Post the (checked) call's descriptor, run ``body``, finish the agreement -- in this
        thread or the group's, in issue order: torch's Work."""
        self.usable()
        ch = self._ch
        call = encode(kind, agreed, op=None if op is None else int(op), root=root)
        progress = self._progress
        if progress is not None:
            self._crowded()
            progress.drain()  # issue order: the queued calls first

        def run() -> None:
            if progress is not None:
                progress.wait_idle()  # under the exec lock: a call a Work's callback queued since, too
            ch.agree(call)
            body()
            ch.settle()  # a call with no round (nothing to move) is compared here

        return self._stream.run(run, result, lambda: _nbytes(agreed), lambda: Held(kind, (agreed, result)))

    def run_native(self, kind: str, agreed: Sequence[Any], run: Callable[[Any], None], result: Any, *,
                   op: Any = None, root: Optional[int] = None) -> Any:
        """``run(call)``: one call of the native data path, which posts, moves and compares itself
        -- in this thread or the group's, in issue order, like :meth:`run`."""
        self.usable()
        self._life.check_not_broken()
        call = encode(kind, agreed, op=None if op is None else int(op), root=root)
        progress = self._progress
        if progress is None:
            return self._stream.run(lambda: run(call), result, lambda: _nbytes(agreed),
                                    lambda: Held(kind, (agreed, result)))
        self._crowded()
        progress.drain()  # issue order: the queued calls first

        def after_the_queue() -> None:
            progress.wait_idle()  # under the exec lock: a call a Work's callback queued since, too
            run(call)

        return self._stream.run(after_the_queue, result, lambda: _nbytes(agreed))

    def queues(self, tensors: Sequence[Any]) -> bool:
        """Does this call go to the progress thread: one is running, the tensors are dense (no
        staging copy to undo afterwards), and the call is big or others are queued (order)?"""
        progress = self._progress
        if progress is None or progress.closed or not all(dense(t) for t in tensors):
            return False
        return bool(progress.pending()) or _nbytes(tensors) >= ASYNC_FROM

    def submit_native(self, kind: str, agreed: Sequence[Any], job: Callable[[Any], Any], result: Any, *,
                      keep: Sequence[Any] = (), op: Any = None, root: Optional[int] = None) -> Any:
        """Queue one native call on the progress thread: an unfinished Work at once.  Held until
        it completes (:class:`~cpuddp.backends.shm.routes.hold.Held`, before ``job`` takes their
        addresses): ``agreed``, ``result`` and ``keep`` -- every tensor ``job`` hands the
        library an address of (an input that is neither, such as reduce_scatter's, goes in
        ``keep``: freed while queued, the thread would read unmapped memory)."""
        self.usable()
        self._life.check_not_broken()
        call = encode(kind, agreed, op=None if op is None else int(op), root=root)
        self._crowded()
        stream = self._stream
        stream.take_exec()
        try:
            held = Held(kind, (agreed, result, keep))
            try:
                return self._progress.submit(call, job(call), result, held)  # type: ignore[union-attr]
            except BaseException:
                held.release()
                raise
        finally:
            stream.exec_lock.release()

    def _crowded(self) -> None:
        """Another thread's calls are queued on the progress thread: two threads call at once."""
        progress = self._progress
        if progress is not None and progress.pending():
            others = progress.others()
            if others:
                self._stream.crowded(*others)

    def local_rank_of(self, rank: int) -> int:
        """This node's local rank of group rank ``rank`` (single-node groups)."""
        if not 0 <= rank < self.size:
            raise BackendError(f"root/peer rank {rank} is not a rank of this group of {self.size}",
                               fix=f"pass a rank from 0 to {self.size - 1}")
        return self._local.index(rank)

    def check_root(self, root: Any) -> None:
        """Raise unless ``root`` is a rank of the group."""
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise BackendError(f"root rank {root!r} is not a rank of this group of {self.size}",
                               fix=f"pass a root from 0 to {self.size - 1}")
