"""The shm engine's shared facts -- the segment's layout, the native library's interface, the
wait policy -- as Python reads them from ``layout.h``, their one definition.

``layout.h`` (beside this module; it ships with the package) holds each fact once as an
X-macro line; engine.c compiles the same file, so the Python engine, the binding and the C code
cannot disagree on a word.  This module reads it as text at import -- no compiler, no library:
the Python data path needs neither -- and makes every value a name of this module (``PAGE``,
``W_ABORT``, ``C_ARRIVED``, ``RC_BUSY``, ``WAIT_CHECK_NS`` ...), plus:

* :data:`VALUES` -- every value by name, in the file's order;
* :data:`STATE_FIELDS`, :data:`ENTRY_FIELDS` -- the int64 fields of the counters a native
  context keeps (engine.c's ``state_t``) and of a prepared call after its descriptor's words
  (``entry_t``).

A file that breaks the form (``layout.h``'s header says it) is an error naming the line, never a
silently missing name.  Stdlib only; imports no other module of the package.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Tuple

__all__ = ["HEADER", "VALUES", "STATE_FIELDS", "ENTRY_FIELDS", "parse"]  # and every name of VALUES

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layout.h")

_TABLE = re.compile(r"^#define (CPUDDP_SHM_\w+)\(([XF])\)[ \t]*((?:[^\n]*\\\n)*[^\n]*)", re.M)
_ROW = re.compile(r'X\(\s*([A-Z][A-Z0-9_]*)\s*,\s*(0x[0-9A-Fa-f]+|[0-9]+)\s*,\s*"[^"\n]*"\s*\)')
_FIELD = re.compile(r'F\(\s*([a-z][a-z0-9_]*)\s*,\s*"[^"\n]*"\s*\)')
_TABLES_OF_TABLES = "CPUDDP_SHM_TABLES"


def parse(text: str, where: str = HEADER) -> Tuple[Dict[str, int], Dict[str, Tuple[str, ...]]]:
    """``(values by name, field names by list)`` of a ``layout.h`` text; ``ValueError`` naming
    the line of anything that is not a row of its table, or a name given twice."""
    values: Dict[str, int] = {}
    fields: Dict[str, Tuple[str, ...]] = {}
    for table in _TABLE.finditer(text):
        name, kind, body = table.group(1), table.group(2), table.group(3)
        if name == _TABLES_OF_TABLES:
            continue
        row = _ROW if kind == "X" else _FIELD
        found: List[Tuple[str, str]] = []
        rest = row.sub(lambda m: found.append(m.groups() if kind == "X" else (m.group(1), "")) or "", body)
        stray = rest.replace("\\\n", "").strip()
        if stray or not found:
            line = text.count("\n", 0, table.start()) + 1
            raise ValueError(f"{where}:{line}: {name} is not a table of {kind}(...) rows "
                             f"(left over: {stray[:60]!r})")
        if kind == "F":
            fields[name] = tuple(n for n, _ in found)
            continue
        for key, literal in found:
            if key in values:
                raise ValueError(f"{where}: {key} is defined twice")
            values[key] = int(literal, 0)
    return values, fields


def _read() -> Tuple[Dict[str, int], Dict[str, Tuple[str, ...]]]:
    try:
        with open(HEADER) as f:
            return parse(f.read())
    except OSError as exc:
        raise ImportError(f"the shm engine's layout ({HEADER}) cannot be read: {exc.strerror}; "
                          "reinstall cpuddp (the file ships with it)") from exc


VALUES, _FIELDS = _read()
STATE_FIELDS: Tuple[str, ...] = _FIELDS["CPUDDP_SHM_STATE_FIELDS"]
ENTRY_FIELDS: Tuple[str, ...] = _FIELDS["CPUDDP_SHM_ENTRY_FIELDS"]
globals().update(VALUES)
__all__ += list(VALUES)


def __getattr__(name: str) -> int:  # what a type checker sees of the names above
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (layout.h defines none)")
