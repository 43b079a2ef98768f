"""Rank 0 does the file work, every rank gets the outcome: the collectives behind checkpoints.

Only rank 0 needs to see a checkpoint file (no shared file system is assumed), so it writes
and reads, and the other ranks get the result -- or the error, at once, instead of waiting in
a later collective until the timeout (:func:`on_rank0`).  Bytes travel as ``uint8`` tensors
(torch's object collectives need numpy, which cpuddp does not require): :func:`broadcast_bytes`
from rank 0, :func:`all_gather_bytes` from every rank.  Each works on any backend that has
``broadcast`` and ``all_gather`` (gloo, shm, oneCCL).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from cpuddp.errors import CpuddpError
from cpuddp.ranks import group_rank_world

__all__ = ["global_rank0", "broadcast_bytes", "broadcast_text", "all_gather_bytes", "on_rank0"]

#: Bytes per broadcast: a large checkpoint goes in pieces (gloo counts elements in 32 bits).
CHUNK = 256 << 20


def global_rank0(group: Any) -> int:
    """The global rank of ``group``'s rank 0 (collectives name their source globally)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def _buffer(n: int) -> tuple[bytearray, torch.Tensor]:
    """A bytearray of ``n`` bytes and a uint8 tensor over the same memory (no numpy needed)."""
    ba = bytearray(n)
    return ba, (torch.frombuffer(ba, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8))


def broadcast_bytes(data: Optional[bytes], group: Any = None) -> bytes:
    """``data`` from ``group``'s rank 0 to every rank (the others pass None): its length, then
    the bytes in pieces of at most :data:`CHUNK`."""
    src = global_rank0(group)
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    ba, buf = _buffer(n)
    if data is not None:
        ba[:] = data
    for start in range(0, n, CHUNK):
        dist.broadcast(buf[start:start + CHUNK], src=src, group=group)
    return data if data is not None else bytes(ba)


def broadcast_text(text: str, src: int, group: Any) -> str:
    """Broadcast ``text`` from global rank ``src`` (UTF-8 over :func:`broadcast_bytes`)."""
    rank = dist.get_rank()
    return broadcast_bytes(text.encode() if rank == src else None, group).decode()


def all_gather_bytes(data: bytes, group: Any = None) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (sizes first, then padded buffers)."""
    _, world = group_rank_world(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    if longest == 0:
        return [b"" for _ in range(world)]
    mine_ba, mine = _buffer(longest)
    mine_ba[:len(data)] = data
    bufs = [_buffer(longest) for _ in range(world)]
    dist.all_gather([t for _, t in bufs], mine, group=group)
    return [bytes(ba[:int(s.item())]) for (ba, _), s in zip(bufs, sizes)]


def _error_status(exc: Exception) -> list:
    """``["error", "Type: message", fix]`` for the other ranks: a cpuddp error's own fix (None
    when it has none) travels apart from its message, so a rank prints it once."""
    if isinstance(exc, CpuddpError):
        return ["error", f"{type(exc).__name__}: {exc.msg}", exc.fix]
    return ["error", f"{type(exc).__name__}: {exc}", None]


def on_rank0(action: Callable[[], Any], what: str, fix: str, group: Any) -> Any:
    """Run ``action()`` on rank 0 and give its (JSON-able) result to every rank.

    Every rank waits for rank 0 in one broadcast.  An error on rank 0 is raised there as it
    is, and on every other rank as a :class:`CpuddpError` naming it -- so no rank is left
    waiting in a later collective until the timeout.  That error carries rank 0's own fix
    when its error has one (every rank of the job gives the same fix), else ``fix``.
    """
    rank, _ = group_rank_world(group)
    status = ""
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            status = json.dumps(["ok", action()])
        except Exception as exc:  # reported to every rank below
            error = exc
            status = json.dumps(_error_status(exc))
    kind, value, *rank0_fix = json.loads(broadcast_text(status, global_rank0(group), group))
    if kind == "error":
        if error is not None:
            raise error
        raise CpuddpError(f"{what} failed on rank 0: {value}", fix=rank0_fix[0] or fix)
    return value
