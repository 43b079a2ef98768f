"""Checking what is read from the rendezvous store, before anything uses it.

The store is shared by every rank of the job, and -- torchrun's agent store, or rank 0's own
``TCPStore`` -- it has no authentication: anything that can reach its port can write any key
(docs/security.md).  So every value cpuddp reads from it is parsed here, or by a parser built
from these pieces, into plain data with every field checked: type, size, range, field count.
A value that fails is a :class:`~cpuddp.errors.RendezvousError` naming the key, what was wrong
and the value (shortened, as ``repr``), never a crash deep inside, never a silent default.

Everything here is pure: text in, data or an error out.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from cpuddp.errors import RendezvousError

__all__ = [
    "MAX_VALUE", "MAX_HOST", "MAX_CPU", "MAX_PID", "STORE_FIX", "stall_cause", "text_value", "shown",
    "bad_value", "int_field", "backend_name", "job_key_value", "json_object",
]

#: The longest value cpuddp itself ever writes under one key (a host record of 65,536 CPUs).
MAX_VALUE = 1 << 20
#: The longest host identity (hostname, boot id, namespace inodes) or hostname accepted.
MAX_HOST = 4096
#: CPU numbers are below this (Linux's NR_CPUS is at most 8192 today).
MAX_CPU = 1 << 16
#: PIDs are below this (Linux's pid_max is at most 2**22).
MAX_PID = 1 << 22
#: The fix for a store that something else writes to (docs/security.md).
STORE_FIX = "give the job a store only it uses (its own MASTER_PORT), and see docs/security.md"
#: register_backend's rule for a backend name, and the longest accepted.
_BACKEND = re.compile(r"\A[a-z][a-z0-9_]{0,63}\Z")

FIX = ("give the job a store only it uses (its own MASTER_PORT, reachable only from the job's hosts), and "
       "run the same cpuddp version on every rank; see docs/security.md")

def stall_cause(where: str) -> str:
    """What may keep ranks that reached the store at ``where`` waiting for the others: one text for
    every stalled join (init's exchanges, a group forming)."""
    return ("a rank died or hangs before it got there (see its log; raise CPUDDP_TIMEOUT if it is merely slow), or "
            f"something other than this job's ranks writes to the rendezvous store at {where} (any local user can "
            "reach it: docs/security.md): give the job a store only it uses (its own MASTER_PORT), or run it in a "
            "network namespace of its own")


def shown(value: Any, limit: int = 80) -> str:
    """``value`` for a message: its ``repr``, cut to about ``limit`` characters (a hostile value
    may be huge or hold terminal escapes; repr escapes those)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(value) if hasattr(value, '__len__') else '?'} long)"


def bad_value(key: str, what: str, value: Any, *, expected: str = "") -> RendezvousError:
    """The error for a malformed value of ``key``: what was wrong, the value, the fix."""
    want = f", not {expected}" if expected else ""
    return RendezvousError(
        f"store key {key} holds {shown(value)}{want}: {what}. Something other than this job's ranks "
        f"writes to its rendezvous store, or the ranks run different cpuddp versions",
        fix=FIX,
    )


def text_value(key: str, raw: Any, *, limit: int = MAX_VALUE, expected: str = "") -> str:
    """A store value (bytes or str) as text: UTF-8, at most ``limit`` bytes, no NUL."""
    if isinstance(raw, str):
        data = raw.encode("utf-8", "surrogatepass")
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        data = bytes(raw)
    else:
        raise bad_value(key, f"a {type(raw).__name__}, not bytes", raw, expected=expected)
    if len(data) > limit:
        raise bad_value(key, f"{len(data)} bytes, more than the {limit} allowed", data, expected=expected)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_value(key, f"not UTF-8 text ({exc.reason} at byte {exc.start})", data, expected=expected) from None
    if "\x00" in text:
        raise bad_value(key, "a NUL character", data, expected=expected)
    return text


def int_field(key: str, name: str, value: Any, lo: int, hi: int, *, expected: str = "", text: bool = True,
              whole: Any = None) -> int:
    """``value`` (an int, or -- with ``text`` -- a decimal string) as an int in ``lo <= v < hi``,
    else the error naming ``key`` and the field ``name`` (showing ``whole``, the line or record
    the field is from, when given)."""
    shown_value = value if whole is None else whole
    if isinstance(value, str) and text:
        ok = value.isascii() and value.isdigit() and len(value) <= 20
        number: Optional[int] = int(value) if ok else None
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        number = None
    if number is None:
        raise bad_value(key, f"its {name} {shown(value, 40)} is not a whole number", shown_value, expected=expected)
    if not lo <= number < hi:
        raise bad_value(key, f"its {name} {number} is outside {lo}..{hi - 1}", shown_value, expected=expected)
    return number


def json_object(key: str, raw: Any, fields: tuple[str, ...], *, expected: str) -> dict[str, Any]:
    """A JSON object with exactly ``fields`` (no more, no fewer)."""
    text = text_value(key, raw, expected=expected)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad_value(key, f"not JSON ({_first(exc)})", text, expected=expected) from None
    if not isinstance(data, dict):
        raise bad_value(key, f"a JSON {type(data).__name__}, not an object", text, expected=expected)
    if set(data) != set(fields):
        missing, extra = sorted(set(fields) - set(data)), sorted(set(data) - set(fields))
        what = "; ".join(p for p in (f"missing {missing}" if missing else "",
                                    f"unexpected {[shown(k, 30) for k in extra]}" if extra else "") if p)
        raise bad_value(key, f"the wrong fields ({what})", text, expected=expected)
    return data


def _first(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:120]


def backend_name(key: str, raw: Any) -> str:
    """A rank's backend choice: a registered backend's name (``[a-z][a-z0-9_]*``, <= 64)."""
    text = text_value(key, raw, limit=256, expected="a backend name")
    if not _BACKEND.match(text):
        raise bad_value(key, "not a backend name ([a-z][a-z0-9_]*, at most 64 characters)", text,
                        expected="a backend name")
    return text


def job_key_value(key: str, raw: Any) -> str:
    """The job key rank 0 wrote: printable text of at most 1024 characters."""
    text = text_value(key, raw, limit=1024, expected="a cpuddp job key")
    if not text or not text.isprintable():
        raise bad_value(key, "empty or holding non-printable characters", text, expected="a cpuddp job key")
    return text
