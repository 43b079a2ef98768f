"""The hand-over's words: local rank 0's offer in the store, a peer's hello, the count of other
users' connections refused, and the errors they lead to (:mod:`cpuddp.backends.shm.protocol.handover`).
Every value read from the store or a socket is checked here before use."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
from typing import Dict, List, Optional, Tuple

from cpuddp.errors import BackendError
from cpuddp.launchers.identity import JobIdentity
from cpuddp.launchers.store_values import STORE_FIX

from ..native.layout import PAGE
from .segment import FIX

__all__ = ["parse_offer", "parse_busy", "busy_value", "busy_text", "hello_line", "parse_hello", "another_job", "uid_problem",
           "PEER_FIX", "MAX_HELLO"]

_SOCK_RE = re.compile(r"^[0-9a-f]{32}$")
_MAX_SLOT = 1 << 30
#: The fix of an error a peer published (it raised the same error, with its own fix).
PEER_FIX = "the fix is in that rank's own error (and docs/security.md if another user is named)"
#: The longest hello (and the longest identity with the descriptors) read.
MAX_HELLO = 4096


def uid_problem(pid: int, uid: int) -> Optional[str]:
    """Why the process ``pid`` of ``uid`` is not one of ours (None when it runs as this user)."""
    if uid != os.geteuid():
        return f"runs as uid {uid} (pid {pid}), not this job's uid {os.geteuid()}: another user"
    return None


def another_job(who: str, why: str, store: str) -> BackendError:
    """A process of this user that is not a rank of this job's group: someone rewrote the store."""
    return BackendError(f"{who} is not a rank of this job's group ({why}); something other than this "
                        f"job's ranks writes to its rendezvous store at {store}, and pointed this rank at another "
                        "job of yours; refusing", fix=STORE_FIX)


def _user(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f" ({pwd.getpwuid(uid).pw_name})"
    return ""


def _most(refused: Dict[int, int]) -> List[Tuple[int, int]]:
    """The three uids with the most refused connections, and their counts."""
    return sorted(refused.items(), key=lambda kv: -kv[1])[:3]


def busy_text(refused: Dict[int, int]) -> str:
    """``150 connections from uid 999 (name)``, for the uids with the most."""
    return ", ".join(f"{n} connection{'s' if n != 1 else ''} from uid {uid}{_user(uid)}" for uid, n in _most(refused))


def busy_value(refused: Dict[int, int]) -> str:
    """What local rank 0 publishes of ``refused`` (``uid<TAB>count`` lines, the uids with the most)."""
    return "\n".join(f"{uid}\t{n}" for uid, n in _most(refused))


def parse_busy(raw: bytes) -> Dict[int, int]:
    """Local rank 0's published count (``uid<TAB>count`` lines), checked; empty if it is not one."""
    out: Dict[int, int] = {}
    for line in raw.decode(errors="replace").splitlines()[:3]:
        parts = line.split("\t")
        if len(parts) == 2 and all(p.isdigit() and len(p) <= 12 for p in parts):
            out[int(parts[0])] = int(parts[1])
    return out


def parse_offer(raw: bytes, key: str, where: str) -> Tuple[str, int, int]:
    """Local rank 0's offer under ``key`` in the store at ``where``: ``sock<TAB>name<TAB>token<TAB>slot``,
    checked (local rank 0's published error is raised as its own)."""
    text = raw.decode(errors="replace")
    if text.startswith("error\t"):
        raise BackendError(f"local rank 0 failed: {text.split(chr(9), 1)[1]}", fix=FIX)
    parts = text.split("\t")
    try:
        name, token, slot = parts[1], int(parts[2]), int(parts[3])
        ok = (len(parts) == 4 and parts[0] == "sock" and _SOCK_RE.match(name) is not None
              and 0 < token < (1 << 62) + 1 and PAGE <= slot <= _MAX_SLOT and slot % PAGE == 0)
    except (IndexError, ValueError):
        ok = False
    if not ok:
        raise BackendError(f"store key {key} holds {raw[:100]!r}, not local rank 0's shared-memory offer: something "
                           f"other than this job's ranks writes to its rendezvous store at {where}", fix=STORE_FIX)
    return name, token, slot


def hello_line(local_rank: int, rank: int, identity: JobIdentity) -> bytes:
    """What a peer says first: its local rank, its group rank and its job identity."""
    return f"{local_rank}\t{rank}\t{identity.wire()}\n".encode()


def parse_hello(raw: bytes) -> Tuple[int, int, Optional[JobIdentity]]:
    """A :func:`hello_line` (-1 for a number that is not one; None for a missing identity)."""
    parts = raw.decode(errors="replace").split("\t", 2)
    nums = [int(p) if p.isdigit() and len(p) < 10 else -1 for p in parts[:2]] + [-1, -1]
    return nums[0], nums[1], JobIdentity.from_wire(parts[2]) if len(parts) == 3 else None
