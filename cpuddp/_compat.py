"""The torch releases cpuddp is tested with, and a once-per-process note when torch is outside them.

CI runs the whole suite on both ends of the range: torch 2.8 (with IPEX 2.8, IPEX's last
release, ``.ci/ipex.sh``) and torch 2.13.  ``pyproject.toml``'s ``torch>=2.8`` (no upper cap: pip must
never replace a newer torch) and
README's "Supported torch" line state the same range; ``tests/test_compat.py`` keeps the
three in step.  A torch outside it is not refused -- it may well work -- but
:func:`check_torch_version` says once in the log that it is untested.

Nothing here imports torch: the version is passed in, or read from the imported module.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

__all__ = ["TESTED_TORCH", "torch_range_note", "check_torch_version", "older_than_tested"]

#: Lowest and highest torch major.minor that CI tests, both inclusive.
TESTED_TORCH = ((2, 8), (2, 13))

_log = logging.getLogger("cpuddp")
_said: set[str] = set()


def _span() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TORCH
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def torch_range_note(torch_version: str) -> Optional[str]:
    """Pure: None when ``torch_version`` is inside :data:`TESTED_TORCH`, else a sentence saying so.

    Compared as versions (``packaging``), by major.minor: ``2.13.1+cpu`` is inside,
    ``2.14.0.dev20260101`` and ``2.7.1`` are not.
    """
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(torch_version).release
    except InvalidVersion:
        return f"torch {torch_version!r} has an unparsable version; cpuddp is tested with torch {_span()}"
    minor = tuple(release[:2]) + (0,) * (2 - len(release[:2]))
    lo, hi = TESTED_TORCH
    if lo <= minor <= hi:
        return None
    side = "older" if minor < lo else "newer"
    return (
        f"torch {torch_version} is {side} than the releases cpuddp is tested with (torch {_span()}); "
        "it may work, but nothing here has checked it"
    )


def check_torch_version(log: Optional[logging.Logger] = None, torch_version: Optional[str] = None) -> Optional[str]:
    """Log a warning once per process (and per version) when torch is outside the tested range.

    ``torch_version`` defaults to the imported torch's ``__version__`` (torch is imported if it
    is not yet).  Returns the note, or None when torch is inside the range.
    """
    if torch_version is None:
        torch = sys.modules.get("torch")
        if torch is None:
            import torch
        torch_version = str(torch.__version__)
    note = torch_range_note(torch_version)
    if note is not None and torch_version not in _said:
        _said.add(torch_version)
        (log or _log).warning("%s", note)
    return note


def older_than_tested(torch_version: str) -> bool:
    """Pure: True when ``torch_version``'s major.minor is below :data:`TESTED_TORCH`'s floor
    (cpuddp's rendezvous hands its listening socket to torch's store, which older torch
    cannot take).  An unparsable version is not called older."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(torch_version).release
    except InvalidVersion:
        return False
    return tuple(release[:2]) < TESTED_TORCH[0]
