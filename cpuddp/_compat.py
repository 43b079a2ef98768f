"""The torch releases cpuddp is tested with, and a once-per-process note when torch is outside them.

CI runs the whole suite on torch 2.8 (with IPEX 2.8, IPEX's last release, ``.ci/ipex.sh``) and
torch 2.13, and the tests of what changes between torch releases -- the shm engine, sharding,
checkpoints -- on torch 2.15 (``.ci/torch215.sh``).  ``pyproject.toml``'s ``torch>=2.8`` (no upper
cap: pip must never replace a newer torch) and
README's "Supported torch" line state the same range; ``tests/test_compat.py`` keeps the
three in step.  A torch outside it is not refused -- it may well work -- but
:func:`check_torch_version` says once in the log that it is untested.

Nothing here imports torch: the version is passed in, or read from the imported module.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Mapping, NamedTuple, Optional, Tuple

__all__ = ["TESTED_TORCH", "torch_range_note", "check_torch_version", "older_than_tested", "TorchPairing", "versions", "VERSIONED",
           "torch_pairing"]

#: Lowest and highest torch major.minor that CI tests, both inclusive.
TESTED_TORCH = ((2, 8), (2, 15))

_log = logging.getLogger("cpuddp")
_said: set[str] = set()


def _span() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TORCH
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def torch_range_note(torch_version: str) -> Optional[str]:
    """Pure: None when ``torch_version`` is inside :data:`TESTED_TORCH`, else a sentence saying so.

    Compared as versions (``packaging``), by major.minor: ``2.15.0+cpu`` is inside,
    ``2.16.0.dev20270101`` and ``2.7.1`` are not.
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


class TorchPairing(NamedTuple):
    """Whether a package built per torch release fits the installed torch (:func:`torch_pairing`).

    ``ok``: it does.  ``built_for``: what its version says it was made for (``"torch 2.8"``,
    ``"torch 1.12.1 only"``, ``"an unknown torch"``).  ``error``: why a version could not be
    parsed, or None.
    """

    ok: bool
    built_for: str
    error: Optional[str] = None


def _release3(version: str) -> Tuple[int, ...]:
    from packaging.version import Version

    rel = Version(version).release
    return tuple(rel) + (0,) * (3 - len(rel))


def torch_pairing(version: str, torch_version: str, *,
                  exact: Optional[Mapping[Tuple[int, ...], Tuple[int, ...]]] = None) -> TorchPairing:
    """Pure: is a package at ``version`` (IPEX, the oneCCL bindings) built for torch ``torch_version``?

    The one rule cpuddp applies to every package released per torch minor: the same
    major.minor, compared as versions (``packaging``; ``2.13`` is newer than ``2.8``), local
    labels (``+cpu``, ``+xpu``) ignored.  ``exact`` lists releases built for one torch patch
    release only (the oneCCL bindings' 1.12.0 -> torch 1.12.0, see :mod:`cpuddp.backends.ccl`):
    those must match torch's major.minor.micro.  An unparsable version never matches.
    """
    from packaging.version import InvalidVersion

    try:
        pkg = _release3(version)
    except InvalidVersion as exc:
        return TorchPairing(False, f"an unknown torch (its version {version!r} is not a valid version)", str(exc))
    pinned = (exact or {}).get(pkg[:3])
    built_for = (f"torch {'.'.join(map(str, pinned))} only" if pinned is not None
                 else f"torch {pkg[0]}.{pkg[1]}")
    try:
        torch = _release3(torch_version)
    except InvalidVersion as exc:
        return TorchPairing(False, built_for, str(exc))
    if pinned is not None:
        return TorchPairing(torch[:3] == tuple(pinned), built_for)
    return TorchPairing(pkg[:2] == torch[:2], built_for)


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


#: Distributions whose versions cpuddp reports (distribution name -> short key), in report order.
VERSIONED = {
    "cpuddp": "cpuddp",
    "torch": "torch",
    "intel_extension_for_pytorch": "ipex",
    "oneccl_bind_pt": "oneccl_bind_pt",
    "mpi4py": "mpi4py",
    "psutil": "psutil",
    "py-cpuinfo": "py-cpuinfo",
}


def _installed(dist: str) -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def versions(keys: Optional[Tuple[str, ...]] = None, *, lookup: Optional[Callable[[str], Optional[str]]] = None,
             imported_torch: bool = False) -> dict[str, Optional[str]]:
    """The installed versions by short key (:data:`VERSIONED`; ``keys`` picks some), plus ``python``.

    Read with ``lookup(distribution)`` (default: ``importlib.metadata``), so nothing is
    imported; with ``imported_torch`` an already imported torch answers with its own
    ``__version__``.  None for a package that is not installed; cpuddp itself falls back to
    ``cpuddp.__version__`` (a source checkout; :mod:`cpuddp._package`).  ``cpuddp doctor`` and
    ``cpuddp bench`` both report these.
    """
    import platform

    lookup = lookup or _installed
    out: dict[str, Optional[str]] = {key: lookup(dist) for dist, key in VERSIONED.items() if keys is None or key in keys}
    if imported_torch and "torch" in out and "torch" in sys.modules:
        out["torch"] = str(getattr(sys.modules["torch"], "__version__", out["torch"]))
    if "cpuddp" in out and out["cpuddp"] is None:
        from ._package import __version__

        out["cpuddp"] = __version__
    out["python"] = platform.python_version()
    return out
