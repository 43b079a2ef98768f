"""The backend registry's data and the lookups a check may consult (package metadata, module
search, the environment, the oneCCL import probe): injectable, so every decision in
:mod:`cpuddp.backends` and :mod:`cpuddp.backends.ccl` can be tested on plain data.

Nothing here imports torch or a backend's module.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Tuple, Union

__all__ = ["BackendStatus", "BackendChoice", "BackendSpec", "Lookups", "ProbeResult", "ImportProbe"]

log = logging.getLogger("cpuddp.backends")

MetadataLookup = Callable[[str], Optional[str]]
ModuleFinder = Callable[[str], bool]
#: (module, torch version) -> a verdict with ``ok``, ``summary()`` (see cpuddp.backends.ccl_probe).
ImportProbe = Callable[[str, str], Any]


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class BackendStatus:
    """Whether one backend can run here, and why (or why not)."""

    name: str
    available: bool
    reason: str
    version: Optional[str] = None
    module: Optional[str] = None
    devices: Tuple[str, ...] = ("cpu",)
    #: The pip distribution whose version is ``version`` (None for torch's own backends).
    distribution: Optional[str] = None
    #: For ccl: what the verdict rests on -- "metadata", "import probe", or the skip variable.
    evidence: Optional[str] = None


@dataclass(frozen=True)
class BackendChoice:
    """What :func:`resolve_backend` picked: the name for ``init_process_group``, why, and
    the module :func:`load_backend` must import first (None for torch's own backends)."""

    name: str
    reason: str
    module: Optional[str] = None
    requested: str = "auto"
    version: Optional[str] = None
    distribution: Optional[str] = None
    #: True when :func:`resolve_backend` checked the module against torch (so
    #: :func:`load_backend` need not check again).
    verified: bool = False
    #: For shm across nodes: the backend of the group's node-to-node leg ("ccl" or "gloo",
    #: the group gets it as ``ShmOptions.inter``); None otherwise.
    inter: Optional[str] = None
    #: True when ``inter`` is the user's ``CPUDDP_SHM_INTER`` (the ranks must agree on it: an
    #: error names theirs where they differ), not the rule's.
    inter_set: bool = False

    @property
    def uses_ccl(self) -> bool:
        """Whether oneCCL carries any of the group's traffic (the backend, or shm's node-to-node
        leg): its settings are exported and its worker cores kept free."""
        return self.name == "ccl" or self.inter == "ccl"


@dataclass(frozen=True)
class Lookups:
    """What an availability check may consult, injectable for tests.

    ``metadata(dist)`` returns an installed distribution's version or None;
    ``find_module(name)`` says whether a top-level module can be found (without importing
    it); ``environ`` is read for ``CPUDDP_CCL_SKIP_VERSION_CHECK``;
    ``import_probe(module, torch_version)`` says whether ``import torch, <module>`` works,
    without importing it here (default: :func:`cpuddp.backends.ccl_probe.check_import`, a cached
    child process).
    """

    metadata: MetadataLookup
    find_module: ModuleFinder
    environ: Mapping[str, str] = field(default_factory=dict)
    import_probe: Optional[ImportProbe] = None


ProbeResult = Union[bool, Tuple[bool, str], BackendStatus]


@dataclass(frozen=True)
class BackendSpec:
    """A registry entry.

    ``module`` is imported (after torch) before ``init_process_group`` and must register
    ``name`` with torch; ``devices`` are the tensor devices it serves; ``distribution`` is
    the pip distribution whose version is reported.  ``probe(lookups)`` replaces the
    default check (is ``module`` present?) and returns a bool, ``(bool, reason)`` or a
    :class:`BackendStatus`.  ``leave()`` and ``abort(why)``, when given, act on the backend's
    live groups of this process: ``cpuddp.shutdown`` calls every ``leave`` before torch's
    teardown (peers waiting for this rank can stop at once), the watchdog every ``abort`` when
    the rank raises (peers stop while this rank reports its error).
    """

    name: str
    module: Optional[str] = None
    devices: Tuple[str, ...] = ("cpu",)
    distribution: Optional[str] = None
    probe: Optional[Callable[[Lookups], ProbeResult]] = None
    description: str = ""
    leave: Optional[Callable[[], None]] = None
    abort: Optional[Callable[[str], None]] = None


# --------------------------------------------------------------------------- lookups


def _default_metadata(dist: str) -> Optional[str]:
    from importlib import metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
    except Exception as exc:  # a broken dist-info must not break backend selection
        log.debug("metadata for %s unreadable: %s", dist, exc)
        return None


def _default_find_module(name: str) -> bool:
    top = name.split(".", 1)[0]
    if top in sys.modules:
        return True
    try:
        return importlib.util.find_spec(top) is not None  # finds, never executes
    except (ImportError, ValueError):
        return False


def _as_metadata(metadata: Union[None, Mapping[str, str], MetadataLookup]) -> MetadataLookup:
    if metadata is None:
        return _default_metadata
    if isinstance(metadata, Mapping):
        table = {_canon(k): v for k, v in metadata.items()}
        return lambda dist: table.get(_canon(dist))
    fn = metadata

    def lookup(dist: str) -> Optional[str]:
        try:
            return fn(dist)
        except Exception:  # PackageNotFoundError from a wrapped importlib.metadata.version
            return None

    return lookup


def _as_finder(find_module: Union[None, Collection[str], ModuleFinder]) -> ModuleFinder:
    if find_module is None:
        return _default_find_module
    if callable(find_module):
        return find_module  # type: ignore[return-value]
    names = {find_module} if isinstance(find_module, str) else set(find_module)
    return lambda name: name.split(".", 1)[0] in names


def _canon(dist: str) -> str:
    """PEP 503 normalized distribution name (``torch_ccl`` == ``torch-ccl``)."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def _lookups(metadata: Any = None, find_module: Any = None, environ: Optional[Mapping[str, str]] = None,
             import_probe: Optional[ImportProbe] = None) -> Lookups:
    return Lookups(
        metadata=_as_metadata(metadata),
        find_module=_as_finder(find_module),
        environ=os.environ if environ is None else environ,
        import_probe=import_probe,
    )


def _torch_version(lk: Lookups) -> Optional[str]:
    version = lk.metadata("torch")
    if version is None and "torch" in sys.modules:
        version = getattr(sys.modules["torch"], "__version__", None)
    return version


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


