"""What a queued collective holds until it completes: the memory of its tensors.

A call queued on a group's thread -- the native progress thread (:mod:`.progress`) or the
Python engine's communication thread (:mod:`.stream`) -- reads and writes its tensors after the
caller's line returned, until its Work completes.  Keeping the tensors is not enough:
``t.data = other`` and ``t.set_()`` let go of the storage a tensor had, and ``t.resize_()`` to
more elements replaces a storage's memory in place (the storage object stays, its old memory is
freed) -- the native thread then read and wrote freed memory (a SIGSEGV, or glibc's "corrupted
double-linked list").

:class:`Held`, made when a call is queued and before anything takes its tensors' addresses:
each tensor's storage is kept, and where torch could resize one, its memory is moved to a
storage kept here (torch's ``UntypedStorage._swap_data_ptr_``) and lent back: the tensor's
storage holds the same memory, borrowed and not resizable, so nothing can free it and
``t.resize_()`` raises torch's "Trying to resize storage that is not resizable".  When the call
completes (:meth:`Held.release`) each storage owns its memory again, resizable as before (a
storage in several queued calls is lent once, given back after the last).  :meth:`Held.changed`
says whether a tensor was given other memory, or another shape or dtype, since the call was
made (the Python thread refuses such a call before it runs), and :meth:`Held.release` whether
one was given other memory: the call moved the memory the tensor had, which it no longer shows.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import torch

from cpuddp.errors import BackendError

__all__ = ["Held", "lent", "CAN_LEND"]

#: torch's private calls that lend a storage's memory (``_swap_data_ptr_`` came in 2026: 2.13 and
#: 2.15 have both, 2.8 does not); without them a storage is kept, not lent: ``t.resize_()`` of a
#: queued tensor is not refused, and frees the memory the call uses (docs/backends.md says so)
CAN_LEND = (hasattr(torch.UntypedStorage, "_swap_data_ptr_")
            and hasattr(torch._C, "_construct_storage_from_data_pointer"))
#: the storages lent now: its address -> [queued calls holding it, the storage, the keeper of its memory]
_lent: Dict[int, List[Any]] = {}
_SEQUENCES, _STRIDED = (list, tuple), torch.strided
_lock = threading.Lock()

FIX = ("leave a tensor passed to a collective with async_op=True as it is (its data, storage, size and dtype) "
       "until its Work's wait() returns, as torch asks of every backend; change it after wait(), or pass a copy")


def lent() -> int:
    """How many storages are lent now (tests)."""
    return len(_lent)


def _tensors(things: Any) -> List[torch.Tensor]:
    """The dense tensors in ``things`` (tensors, lists and tuples of them, nested; anything else
    is skipped), each once."""
    found: Dict[int, torch.Tensor] = {}
    todo = [things]
    while todo:
        thing = todo.pop()
        if type(thing) in _SEQUENCES or isinstance(thing, (list, tuple)):
            todo.extend(thing)
        elif isinstance(thing, torch.Tensor) and thing.layout is _STRIDED:
            found[id(thing)] = thing
    return list(found.values())


def _lend(key: int, storage: Any) -> None:
    entry = _lent.get(key)
    if entry is not None:
        entry[0] += 1
        return
    keeper = None
    if CAN_LEND and storage.resizable() and storage.nbytes() and storage.data_ptr():
        keeper = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), storage.device, storage.nbytes())
        storage._swap_data_ptr_(keeper)  # the keeper owns the memory; the storage borrows it, not resizable
    _lent[key] = [1, storage, keeper]


def _give_back(key: int) -> None:
    entry = _lent[key]
    entry[0] -= 1
    if entry[0]:
        return
    del _lent[key]
    _, storage, keeper = entry
    if keeper is not None and storage.data_ptr() == keeper.data_ptr() and storage.nbytes() == keeper.nbytes():
        storage._swap_data_ptr_(keeper)  # its own again; else it was given other memory, and the keeper frees this


class Held:
    """One queued call's tensors, their storages and memory, held from the call to its completion
    (see the module docstring).  ``what``: the collective's name, for the error."""

    __slots__ = ("what", "_seen", "_keys")

    def __init__(self, what: str, things: Any) -> None:
        self.what = what
        tensors = _tensors(things)
        storages = {}
        for t in tensors:
            s = t.untyped_storage()
            storages[s._cdata] = s
        with _lock:
            for key, s in storages.items():
                _lend(key, s)
        self._keys = list(storages)
        # after the lending (which can move a copy-on-write tensor's memory): what the call moves
        self._seen = [(t, t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]

    def moved(self) -> bool:
        """Was a tensor given other memory since the call was made (``t.data = ...``, ``t.set_()``)?"""
        for t, ptr, _, _, _ in self._seen:
            if t.data_ptr() != ptr:
                return True
        return False

    def changed(self) -> bool:
        """Was a tensor given other memory, shape or dtype since the call was made (a refused
        ``t.resize_()`` leaves the new shape over the old memory: torch sets the sizes first)?"""
        for t, ptr, shape, stride, dtype in self._seen:
            if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride or t.dtype != dtype:
                return True
        return False

    def refused(self) -> BackendError:
        """The error of a call whose tensor :meth:`changed` before it ran (its peers wait for it
        as it was made: the group stops)."""
        return BackendError(f"shm: a tensor handed to {self.what} with async_op=True was given other memory, shape "
                            "or dtype (t.data = ..., t.set_(), t.resize_()) after the call and before it ran: refused "
                            "(every rank agreed the call as it was made)", fix=FIX)

    def release(self) -> Optional[BackendError]:
        """The call completed: give each storage its memory back; an error if a tensor :meth:`moved`
        (the call moved the memory it had: the tensor does not show the result)."""
        keys, self._keys = self._keys, []
        with _lock:
            for key in keys:
                _give_back(key)
        if not keys or not self.moved():
            return None
        return BackendError(f"shm: a tensor handed to {self.what} with async_op=True was given other memory "
                            "(t.data = ..., t.set_()) after the call and before its Work's wait(): the call moved "
                            "the memory it had when the call was made, which the tensor no longer shows", fix=FIX)
