"""The backend registry's data, the one interface every backend has, and the lookups a check may
consult (package metadata, module search, the environment, the oneCCL import probe): injectable,
so every decision in :mod:`cpuddp.backends` and :mod:`cpuddp.backends.ccl` can be tested on plain
data.

* :class:`BackendName`: a backend's name, normalised (stripped, lower case), with the built-in
  names as constants (as torch's ``Backend.GLOO``).
* :class:`BackendSpec`: one backend, as an object.  The pipeline (resolve, decide, agree, form,
  load, explain) asks it what is its own -- its status here, the check of a request, the
  settings to export, the worker cores to keep free, the group's options, loading its module,
  explaining a failed first collective, forming a node-to-node group -- and never compares
  its name.  The generic behaviour is here (a plug-in added with ``register_backend`` gets
  it); a backend with more of its own subclasses it in its own module: torch's
  (:mod:`cpuddp.backends.torch_backends`), oneCCL (:class:`cpuddp.backends.ccl.CclBackend`),
  cpuddp's shared memory (:class:`cpuddp.backends.shm.backend.ShmBackend`).
* :data:`BACKENDS`: name -> object, filled by :mod:`cpuddp.backends.registry`;
  :func:`backend_for` looks a name up.

Nothing here imports torch or a backend's module (:meth:`BackendSpec.load` imports them when
called).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Collection, Mapping, Optional, Tuple, Union

from cpuddp.errors import BackendError

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv
    from cpuddp.launchers.hosts import Share


__all__ = ["BackendName", "BackendStatus", "BackendChoice", "BackendSpec", "BACKENDS", "backend_for", "Lookups",
           "ProbeResult", "ImportProbe", "GLOO_SETTLE"]

log = logging.getLogger("cpuddp.backends")

MetadataLookup = Callable[[str], Optional[str]]
ModuleFinder = Callable[[str], bool]
#: (module, torch version) -> a verdict with ``ok``, ``summary()`` (see cpuddp.backends.ccl_probe).
ImportProbe = Callable[[str, str], Any]

#: Seconds a teardown sleeps (the GIL released) so that gloo's worker threads finish with their
#: last Works while Python still runs.  A worker drops its reference to a finished Work after the
#: caller's ``wait()`` returned; releasing a tensor that has a Python object takes the GIL, and a
#: thread that asks for it while the interpreter exits is ended inside a C++ destructor, which
#: aborts the rank ("terminate called without an active exception", SIGABRT after the job's work
#: is done; the stack: ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
#: ``pthread_exit``).  The cause is in torch's gloo group; this closes the window.
GLOO_SETTLE = 0.05


# --------------------------------------------------------------------------- data


class BackendName(str):
    """A backend's name as ``init_process_group`` takes it: stripped and lower case, whatever the
    user wrote (``BackendName(" Gloo ") == "gloo"``).  The built-in names are constants."""

    AUTO = "auto"  # not a backend: the request to choose one (cpuddp.backends.auto)
    GLOO = "gloo"
    CCL = "ccl"
    SHM = "shm"
    MPI = "mpi"
    NCCL = "nccl"
    ACCL = "accl"

    def __new__(cls, value: str) -> "BackendName":
        return super().__new__(cls, value.strip().lower())


#: What ``backend=`` may ask for that names no backend: the rule's choice.
REQUEST_WORDS = frozenset({BackendName.AUTO})


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
    def named(self) -> bool:
        """Whether the user named the backend (``backend="shm"``), not "auto" (``requested``)."""
        return BackendName(self.requested) not in REQUEST_WORDS

    @property
    def backend(self) -> "BackendSpec":
        """The backend chosen, as its object (:func:`backend_for`)."""
        return backend_for(self.name)

    @property
    def leg(self) -> Optional["BackendSpec"]:
        """shm's node-to-node leg as its backend's object; None without one."""
        return backend_for(self.inter) if self.inter else None


@dataclass(frozen=True)
class Lookups:
    """What an availability check may consult, injectable for tests.

    ``metadata(dist)`` returns an installed distribution's version or None;
    ``find_module(name)`` says whether a top-level module can be found (without importing
    it); ``environ`` is read for ``CPUDDP_CCL_SKIP_VERSION_CHECK``;
    ``import_probe(module, torch_version)`` says whether ``import torch, <module>`` works,
    without importing it here (default: :func:`cpuddp.backends.ccl_probe.check_import`, a cached
    child process); ``mpi_library(environ)`` whether mpi4py finds an MPI library, and which
    (default: :func:`cpuddp.launchers.mpi.find_library`, a child process once per process).
    """

    metadata: MetadataLookup
    find_module: ModuleFinder
    environ: Mapping[str, str] = field(default_factory=dict)
    import_probe: Optional[ImportProbe] = None
    mpi_library: Optional[Callable[[Mapping[str, str]], Any]] = None


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
    #: ``watch(check)``: its long waits ask ``check()`` now and then whether a rank of the job is
    #: known lost (None: none; else the text that names it); ``watch(None)`` stops them.  The
    #: watchdog registers its own check while it runs.
    watch: Optional[Callable[[Optional[Callable[[], Optional[str]]]], None]] = None

    #: Whether its check imports torch (torch's own backends): ``cpuddp doctor`` without
    #: ``--torch`` lists it unprobed.
    built_into_torch: ClassVar[bool] = False
    #: Whether its ``reduce_scatter`` with ``ReduceOp.AVG`` is as right and as fast as with SUM;
    #: False: a caller that can (FSDP2) reduces a sum and divides it itself.
    averages_in_reduce_scatter: ClassVar[bool] = True

    # ------------------------------------------------------------ choosing

    def status(self, lk: Lookups) -> BackendStatus:
        """Whether it can run here, and why: its probe, else whether its module can be found.
        A probe that raises is a verdict too (one broken plug-in must not hide the others)."""
        try:
            return self._check(lk)
        except Exception as exc:
            return BackendStatus(self.name, False, f"its check raised {type(exc).__name__}: {exc}",
                                 module=self.module, devices=self.devices, distribution=self.distribution)

    def _check(self, lk: Lookups) -> BackendStatus:
        version = lk.metadata(self.distribution) if self.distribution else None
        if self.probe is not None:
            result = self.probe(lk)
            if isinstance(result, BackendStatus):
                return result
            if isinstance(result, tuple):
                ok, reason = bool(result[0]), str(result[1])
            else:
                ok, reason = bool(result), ("the plug-in's check passed" if result else "the plug-in's check failed")
            return BackendStatus(self.name, ok, reason, version, self.module, self.devices, self.distribution)
        if self.module is None:
            return BackendStatus(self.name, True, "registered without a module or check", version, None, self.devices,
                                 self.distribution)
        pkg = (f" ({self.distribution} {version})" if version
               else (f" ({self.distribution} is not installed)" if self.distribution else ""))
        found = lk.find_module(self.module)
        return BackendStatus(self.name, found, f"module {self.module} {'found' if found else 'not found'}{pkg}", version,
                             self.module, self.devices, self.distribution)

    def auto_status(self, env: "DistEnv", lk: Lookups, node_cpus: Optional[int],
                    smallest_node: Optional[int]) -> BackendStatus:
        """Whether ``backend="auto"`` may take it in this job (``node_cpus``: the CPUs this node's
        ranks share; ``smallest_node``: the fewest ranks a node runs): its status here."""
        return self.status(lk)

    def refusal(self, st: BackendStatus, lk: Lookups) -> BackendError:
        """The error for ``backend=<this>`` where it cannot run (``st`` says why)."""
        pkg = f" (pip distribution {st.distribution})" if st.distribution else ""
        return BackendError(f"backend={self.name!r} was requested, but it cannot run here: {st.reason}",
                            fix=f"install it{pkg}, or pass backend='auto' or 'gloo'")

    def check_request(self, env: "DistEnv", device: Optional[str]) -> None:
        """Refuse a named request this backend cannot serve in this job (the tensors' device)."""
        if device is not None and device.strip().lower() not in self.devices:
            raise BackendError(
                f"backend={self.name!r} serves {', '.join(self.devices)} tensors, not {device!r}",
                fix=f"pick a backend for {device!r} (auto does), or move the model",
            )

    def named_choice(self, st: BackendStatus, env: "DistEnv", lk: Lookups) -> BackendChoice:
        """The choice for ``backend=<this>``, checked (``st``: its status here)."""
        return BackendChoice(self.name, f"requested; {st.reason}", st.module, self.name, st.version, st.distribution,
                             True)

    def auto_choice(self, reason: str, inter: Optional[str], lk: Lookups, probe_torch: bool) -> BackendChoice:
        """The choice when the rule of ``backend="auto"`` picked this backend, for ``reason``."""
        return BackendChoice(self.name, f"auto: {reason}", self.module, BackendName.AUTO, inter=inter)

    def with_user_settings(self, choice: BackendChoice, environ: Mapping[str, str]) -> BackendChoice:
        """``choice`` with what the user's variables change in it (nothing, unless the backend
        has such variables); read once, before the ranks agree."""
        return choice

    def agree(self, choice: BackendChoice, env: "DistEnv", share: "Share", key: str) -> BackendChoice:
        """What else of ``choice`` the ranks must share, agreed through ``share`` (this rank's
        exchange over the job's store) under exchange ``key/...`` once every rank chose this
        backend (nothing, unless the backend has more)."""
        return choice

    # ------------------------------------------------------------ planning

    def worker_cores(self, choice: BackendChoice, environ: Mapping[str, str]) -> int:
        """The cores of each rank its worker threads need kept free of compute."""
        return 0

    def settings(self, env: "DistEnv", choice: BackendChoice, plan: Any, environ: Mapping[str, str], *,
                 paths: Any = None) -> dict[str, str]:
        """Its variables to export before ``init_process_group`` (none the user set); ``plan``:
        the pinning plan or None; ``paths``: filesystem lookups a backend may take as given."""
        return {}

    def group_options(self, env: "DistEnv", plan: Any) -> Any:
        """The group's ``pg_options`` for the agreed ``plan`` (a :class:`cpuddp.backends.decide.BackendPlan`;
        None: torch's defaults)."""
        return None

    # ------------------------------------------------------------ running

    def load(self, choice: BackendChoice) -> None:
        """Import torch, then ``choice.module`` (if any), and check it registered the name.
        Any import failure is a BackendError naming the module."""
        if choice.module is None:
            return
        import torch  # noqa: F401  -- first: a binding links against the loaded libtorch
        import torch.distributed as dist

        self._before_import(choice)
        pkg = f"{choice.distribution} {choice.version}" if choice.distribution and choice.version else choice.module
        try:
            importlib.import_module(choice.module)
        except Exception as exc:
            raise BackendError(
                f"importing {choice.module} ({pkg}) for backend {choice.name!r} failed: {type(exc).__name__}: {exc}",
                fix=self._import_fix(pkg, torch.__version__) + ", or pass backend='gloo'",
            ) from exc
        registered = [b.lower() for b in getattr(dist.Backend, "backend_list", [])]
        if registered and choice.name not in registered:
            raise BackendError(
                f"importing {choice.module} did not register backend {choice.name!r} with torch.distributed "
                f"(registered: {', '.join(registered)})",
                fix=f"check that {choice.module} is the plug-in for {choice.name!r} and built for torch "
                    f"{torch.__version__}",
            )
        log.debug("loaded %s for backend %s", choice.module, choice.name)

    def _before_import(self, choice: BackendChoice) -> None:
        """A last check before ``choice.module`` is imported (torch is loaded)."""

    def _import_fix(self, pkg: str, torch_version: str) -> str:
        return f"check the {pkg} install"

    def explain_failure(self, environ: Mapping[str, str], exc: BaseException) -> BackendError:
        """The error for a group that formed but whose first collective raised ``exc``."""
        ifname = environ.get("GLOO_SOCKET_IFNAME")
        return BackendError(failed_line(self.name, environ, exc),
                            fix=f"{self.name} over GLOO_SOCKET_IFNAME={ifname or 'unset'}: check that every rank's log "
                                f"shows the same backend, that the hosts reach each other on that interface, "
                                f"or pass backend='gloo' to rule {self.name} out")

    def leg_status(self, env: "DistEnv", lk: Lookups) -> BackendStatus:
        """Whether this backend can carry the shm group's node-to-node leg here, and why: by
        default, whether it can run (its :meth:`status`)."""
        return self.status(lk)

    def create_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        """A process group of this backend over ``store`` (shm's node-to-node leg); only the
        backends that can be a leg have one."""
        raise BackendError(f"backend {self.name!r} cannot carry the shm group's node-to-node leg",
                           fix="use gloo, ccl or mpi between nodes (CPUDDP_SHM_INTER)")


#: name -> :class:`BackendSpec`, filled by :mod:`cpuddp.backends.registry` (which every import of
#: :mod:`cpuddp.backends` runs first).  Extend it with ``register_backend``.
BACKENDS: dict[str, BackendSpec] = {}


def backend_for(name: str) -> BackendSpec:
    """The object of the backend called ``name``: the registered one, else the generic behaviour
    under that name (a group torch formed with a backend cpuddp does not know)."""
    key = BackendName(name)
    return BACKENDS.get(key) or BackendSpec(key)


def failed_line(name: str, environ: Mapping[str, str], exc: BaseException) -> str:
    """The first line of the error for a group whose first all_reduce raised ``exc``."""
    said = " ".join(str(exc).split())
    if len(said) > 600:
        said = said[:600] + " ..."
    return (f"rank {environ.get('RANK', '?')}: the {name} group formed, but its first all_reduce failed: "
            f"{type(exc).__name__}: {said}")


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


