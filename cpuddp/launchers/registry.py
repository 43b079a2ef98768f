"""Which launcher started this process, and where it put it: :func:`detect`.

The launchers' readers are tried in one documented order; the first whose variables are
present describes the process.  Each reader is a small :class:`LauncherReader` (the
interface and the reading they share are in :mod:`cpuddp.launchers.readers`, each built-in
in a module of its own, ``read_<launcher>.py``, listed here in :data:`BUILTIN_READERS`); a
site adds its own scheduler with :func:`register_launcher` (see docs/launchers.md).

=====  =========================  ==============================================================
order  family (``DistEnv.launcher``)  variables read
=====  =========================  ==============================================================
1      torchrun / TorchElastic     ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
       (``torchrun``)              ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
                                   ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``,
                                   ``TORCHELASTIC_USE_AGENT_STORE``
2      Intel MPI / MPICH Hydra     ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
       (``hydra``)                 ``MPI_LOCALNRANKS``, ``I_MPI_HYDRA_UUID`` (job id)
3      PMIx (``pmix``)             ``PMIX_RANK``, ``PMIX_NAMESPACE``; only when neither Open MPI
                                   nor Slurm variables are present (both set ``PMIX_RANK`` too,
                                   and give the sizes, which PMIx keeps behind its API)
4      Open MPI (``openmpi``)      ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE,NODE_RANK}``,
                                   ``PMIX_NAMESPACE`` / ``OMPI_MCA_orte_ess_jobid`` (job id)
5      MVAPICH2 (``mvapich``)      ``MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
6      Slurm srun (``slurm``)      ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
                                   ``SLURM_NODEID``, ``SLURM_STEP_NODELIST`` /
                                   ``SLURM_JOB_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE`` /
                                   ``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID``
       (site launchers)            :func:`register_launcher` puts them here unless told otherwise
7      plain env (``env``)         ``RANK``, ``WORLD_SIZE`` (+ optional ``LOCAL_RANK``,
                                   ``LOCAL_WORLD_SIZE``, ``NODE_RANK``), as Kubeflow sets them
8      nothing (``none``)          a single process
=====  =========================  ==============================================================

Why this order: torchrun first because it sets the torch variables itself and may run inside
an MPI or Slurm allocation (whose variables then describe the allocation, not this process).
The MPI families come before Slurm for the same reason: ``mpirun`` inside an ``sbatch``
script inherits the batch step's ``SLURM_PROCID=0``.  Slurm is trusted only inside an
``srun`` step (``SLURM_STEP_ID`` set); a batch script run directly is a single process (and
logs why).  ``srun --mpi=pmi2`` sets ``PMI_RANK``/``PMI_SIZE`` too: when ``PMI_JOBID`` is
Slurm's ``<job>.<step>``, the task is Slurm's and the Slurm reader describes it.
Plain ``RANK``/``WORLD_SIZE`` come last because they are also what cpuddp exports.

Rules every reader's result goes through (:func:`detect`, so a site reader gets them too):
partial information is an error (a rank without a size never becomes rank 0); a value that
is not an integer, negative or out of range is an error naming the variable and launcher; a
rank variable of another launcher family that disagrees with the chosen one is an error.
``OMPI_COMM_WORLD_NODE_RANK`` is the rank *among the processes on a node*, not the node's
index, so the node rank under MPI is derived from block placement
(``rank // local_world_size``) and checked against the real hosts once the group exists.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Mapping, Optional, Union

from cpuddp.errors import LauncherEnvError

from .env import DEFAULT_PORT, DistEnv, Provenance
from .parsers import derive_port
from .read_env import PlainEnvReader
from .read_hydra import HydraReader
from .read_mvapich import MvapichReader
from .read_openmpi import OpenMPIReader
from .read_pmix import PmixReader
from .read_slurm import SlurmReader
from .read_torchrun import TorchrunReader
from .readers import LauncherReader, PartialEnv

log = logging.getLogger("cpuddp")

__all__ = [
    "READERS",
    "LAUNCHER_NAMES",
    "register_launcher",
    "unregister_launcher",
    "registered_launchers",
    "starts_mpi_world",
    "detect",
    "LAUNCHER_ENV_PREFIXES",
    "LAUNCHER_ENV_NAMES",
    "is_launcher_variable",
    "clean_environ",
    "BACKEND_ENV_PREFIXES",
    "BACKEND_ENV_NAMES",
]

# --------------------------------------------------------------------------- the registry

#: Human names of the families, used in messages (kept in step with the registry).
LAUNCHER_NAMES: dict[str, str] = {"none": "no launcher"}
_READERS: dict[str, LauncherReader] = {}
#: The registered readers, ``(name, reader)`` in the order :func:`detect` tries them (rebound
#: on every change: read it as ``cpuddp.launchers.READERS``, or call :func:`registered_launchers`).
READERS: tuple[tuple[str, LauncherReader], ...] = ()
_registry_lock = threading.Lock()
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
#: Where :func:`register_launcher` puts a reader by default: after every built-in launcher,
#: before the plain variables (which are also what cpuddp exports).
_DEFAULT_BEFORE = "env"


class _Unset:
    def __repr__(self) -> str:
        return "'env' (or the same place when replacing)"


_UNSET: Any = _Unset()


def register_launcher(name: str, reader: Union[LauncherReader, type[LauncherReader]], *,
                      before: Optional[str] = _UNSET, replace: bool = False) -> LauncherReader:
    """Add a launcher that :func:`detect` (and so :func:`cpuddp.init_distributed`) knows.

    ``reader``: a :class:`LauncherReader` (an instance, or a subclass to instantiate).
    ``before``: the registered launcher it is tried before (default ``"env"``: after every
    built-in launcher, which then win when they nest inside the site's); None: last.
    ``replace=True`` replaces an existing entry (in its place unless ``before`` moves it).
    Example (docs/launchers.md has it in full)::

        cpuddp.register_launcher("foosched", FooSchedReader())
    """
    key = name.strip().lower() if isinstance(name, str) else ""
    if not _NAME.match(key) or key == "none":
        raise ValueError(f"launcher name {name!r} is not valid: use lowercase letters, digits and '_', "
                         f"starting with a letter, and not 'none'")
    if isinstance(reader, type):
        reader = reader()
    if not isinstance(reader, LauncherReader):
        raise TypeError(f"launcher {key!r}: the reader must be a cpuddp.launchers.LauncherReader "
                        f"(subclass it, with detect(environ) and read(environ)), got {reader!r}")
    with _registry_lock:
        if key in _READERS and not replace:
            raise ValueError(f"launcher {key!r} is already registered; pass replace=True to override it")
        keep_place = before is _UNSET and key in _READERS
        if before is _UNSET:
            before = _DEFAULT_BEFORE if _DEFAULT_BEFORE in _READERS else None
        if before is not None and (before not in _READERS or before == key):
            raise ValueError(f"launcher {key!r}: before={before!r} is not another registered launcher "
                             f"(registered: {', '.join(_READERS)})")
        _insert(key, reader, before, keep_place=keep_place)
    return reader


def _insert(key: str, reader: LauncherReader, before: Optional[str], *, keep_place: bool) -> None:
    items = list(_READERS.items())
    if keep_place:  # replace=True without a new position: same place
        items = [(k, reader if k == key else r) for k, r in items]
    else:
        items = [(k, r) for k, r in items if k != key]
        at = next((i for i, (k, _) in enumerate(items) if k == before), len(items))
        items.insert(at, (key, reader))
    _READERS.clear()
    _READERS.update(items)
    LAUNCHER_NAMES[key] = reader.description or key
    _publish()


def _publish() -> None:
    global READERS
    READERS = tuple(_READERS.items())


def unregister_launcher(name: str) -> None:
    """Remove a registry entry (no error when absent)."""
    key = name.strip().lower()
    with _registry_lock:
        if _READERS.pop(key, None) is not None:
            LAUNCHER_NAMES.pop(key, None)
            _publish()


def registered_launchers() -> tuple[tuple[str, LauncherReader], ...]:
    """The registered readers, ``(name, reader)`` in the order :func:`detect` tries them."""
    with _registry_lock:
        return tuple(_READERS.items())


def starts_mpi_world(name: str) -> bool:
    """Whether launcher family ``name`` starts its ranks as one MPI world (its reader's
    ``mpi_world``); False for a name not registered."""
    with _registry_lock:
        reader = _READERS.get(name)
    return bool(reader is not None and reader.mpi_world)


#: The built-in readers, in the order of the table above: the one place that lists them.
BUILTIN_READERS: tuple[tuple[str, LauncherReader], ...] = (
    ("torchrun", TorchrunReader()),
    ("hydra", HydraReader()),
    ("pmix", PmixReader()),
    ("openmpi", OpenMPIReader()),
    ("mvapich", MvapichReader()),
    ("slurm", SlurmReader()),
    ("env", PlainEnvReader()),
)
for _name, _reader in BUILTIN_READERS:
    register_launcher(_name, _reader, before=None)
del _name, _reader


#: Variables that describe a launched process (every family's, and what cpuddp exports).  A
#: process that starts ranks of its own (``cpuddp bench --nproc``, ``cpuddp.testing``) strips
#: them, so a run inside mpirun or srun still gets a clean world of its own.
LAUNCHER_ENV_PREFIXES = (
    "PMI_", "PMIX_", "OMPI_", "MV2_", "MPIRUN_", "SLURM_", "MPI_LOCAL", "I_MPI_HYDRA", "HYDRA_",
    "TORCHELASTIC_", "GROUP_", "ROLE_",
)
LAUNCHER_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "CPUDDP_RANK_CPUS", "CPUDDP_RANK_THREADS")  # the last two: cpuddp run's plan for its ranks
#: Backend settings a job exports (oneCCL's ``CCL_*``, gloo's interface).  ``cpuddp.testing``
#: strips them too, so one test's world never leaks into the next; ``cpuddp bench --nproc``
#: keeps them (they are the user's settings for the run it measures).
BACKEND_ENV_PREFIXES = ("CCL_",)
BACKEND_ENV_NAMES = ("GLOO_SOCKET_IFNAME",)


def is_launcher_variable(name: str, *, backend_settings: bool = False) -> bool:
    """True for a variable some launcher sets to describe a launched process (and, with
    ``backend_settings``, for a backend setting: :data:`BACKEND_ENV_PREFIXES`, :data:`BACKEND_ENV_NAMES`)."""
    if name in LAUNCHER_ENV_NAMES or name.startswith(LAUNCHER_ENV_PREFIXES):
        return True
    return backend_settings and (name in BACKEND_ENV_NAMES or name.startswith(BACKEND_ENV_PREFIXES))


def clean_environ(environ: Mapping[str, str], *, strip_backend_settings: bool = False) -> dict[str, str]:
    """``environ`` without any launcher's variables (and without the backend settings when
    ``strip_backend_settings``)."""
    return {k: v for k, v in environ.items() if not is_launcher_variable(k, backend_settings=strip_backend_settings)}


# --------------------------------------------------------------------------- detect


def detect(environ: Mapping[str, str]) -> DistEnv:
    """Build the :class:`~cpuddp.launchers.env.DistEnv` that ``environ`` describes (a function
    of ``environ`` alone; a reader that does not match may log why, in its ``declined``).

    Raises :class:`cpuddp.errors.LauncherEnvError` when the variables are half-set,
    inconsistent or malformed: partial information is an error, complete absence is a
    single process.
    """
    for name, reader in registered_launchers():
        if reader.detect(environ):
            part = reader.read(environ)
            _check_conflicts(environ, name, part)
            return _finish(environ, name, reader, part)
        reader.declined(environ)  # a reader may say why its variables do not describe this process
    return _single_process(environ)


def _single_process(environ: Mapping[str, str]) -> DistEnv:
    sources = {"rank": Provenance.default(), "world_size": Provenance.default()}
    addr = environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _port(environ, None, "none") or DEFAULT_PORT
    return DistEnv(master_addr=addr, master_port=port, launcher="none", sources=sources)


def _check_conflicts(environ: Mapping[str, str], chosen_name: str, part: PartialEnv) -> None:
    """Another family's rank variable that disagrees with the chosen launcher's rank."""
    readers = registered_launchers()
    chosen = dict(readers)[chosen_name].rank_variable
    for family, reader in sorted(readers, key=lambda fr: fr[1].shared_rank_variable):
        var = reader.rank_variable
        if var is None or var == chosen or family == chosen_name:
            continue
        value = environ.get(var, "")
        if value == "" or value.strip() == str(part.rank):
            continue
        fam = "RANK (exported by hand or by an earlier run)" if var == "RANK" else LAUNCHER_NAMES[family]
        name = LAUNCHER_NAMES[chosen_name]
        raise LauncherEnvError(
            f"two launchers disagree about this process's rank: {part.sources['rank']}={part.rank} "
            f"({name}) but {var}={value} ({fam})",
            variable=var,
            value=value,
            launcher=fam,
            fix=f"unset {var} in the job script, so only {name} describes the job",
        )


class _Checks:
    """Errors in one voice for the shared rules: the variable a field came from, its value,
    the launcher and the fix."""

    def __init__(self, environ: Mapping[str, str], launcher: str, sources: Mapping[str, Any]) -> None:
        self.environ, self.launcher, self.sources = environ, launcher, sources

    def bad(self, msg: str, key: str, fix: str) -> LauncherEnvError:
        var = str(self.sources.get(key, key))
        return LauncherEnvError(msg, variable=var, value=self.environ.get(var), launcher=self.launcher, fix=fix)

    def unset(self, msg: str, var: str, fix: str) -> LauncherEnvError:
        return LauncherEnvError(msg, variable=var, value=None, launcher=self.launcher, fix=fix)


def _finish(environ: Mapping[str, str], name: str, reader: LauncherReader, part: PartialEnv) -> DistEnv:
    """Apply the rules every launcher shares to what ``reader`` said."""
    src: dict[str, Any] = {k: Provenance.of(v) for k, v in part.sources.items()}
    check = _Checks(environ, LAUNCHER_NAMES[name], src)
    if part.rank >= part.world_size:
        raise check.bad(
            f"rank {part.rank} is out of range for a world of {part.world_size} (valid: 0..{part.world_size - 1})",
            "rank",
            f"every rank must be below {src['world_size']}={part.world_size}; "
            "launch with the launcher rather than by hand",
        )
    local_rank, local_size = _local(part, src, check)
    node_rank, num_nodes = _nodes(part, local_rank, local_size, src, check)
    single = local_size == part.world_size
    addr = _master_addr(environ, reader, part, single, src)
    port = _port(environ, part.job_id, check.launcher)
    src["master_port"] = Provenance.variable("MASTER_PORT") if environ.get("MASTER_PORT") else (
        Provenance.derived(f"job id {part.job_id}") if part.job_id else Provenance.default()
    )
    return DistEnv(
        rank=part.rank, world_size=part.world_size, local_rank=local_rank, local_world_size=local_size,
        node_rank=node_rank, master_addr=addr, master_port=port, launcher=name, num_nodes=num_nodes,
        job_id=part.job_id, agent_store=part.agent_store, sources=src,
    )


def _local(part: PartialEnv, src: dict[str, Any], check: _Checks) -> tuple[int, int]:
    """The local rank and size: the launcher's, or derived for a job on one node."""
    local_rank, local_size = part.local_rank, part.local_world_size
    if local_size is None and part.world_size == 1:
        local_size = 1
        src["local_world_size"] = Provenance.derived("world of 1")
    if local_rank is None and local_size == part.world_size:
        local_rank = part.rank
        src["local_rank"] = Provenance.derived("one node")
    if local_rank is None:
        raise check.unset(f"{check.launcher} did not say this process's rank on its node", "LOCAL_RANK",
                          "export LOCAL_RANK and LOCAL_WORLD_SIZE, or launch with a launcher that sets them")
    if local_size is None:
        raise check.unset(f"{check.launcher} did not say how many ranks run on this node", "LOCAL_WORLD_SIZE",
                          "export LOCAL_WORLD_SIZE (ranks per node), or launch with a launcher that sets it")
    if local_size > part.world_size:
        raise check.bad(f"{local_size} ranks per node is more than the {part.world_size} ranks in the job",
                        "local_world_size",
                        "the local world size must not exceed the world size; check the launcher's -n/-ppn flags")
    if local_rank >= local_size:
        raise check.bad(f"local rank {local_rank} is at or above the local world size {local_size}", "local_rank",
                        f"local ranks run 0..{local_size - 1}; launch with the launcher rather than by hand")
    if local_rank > part.rank:
        raise check.bad(f"local rank {local_rank} is above the global rank {part.rank}", "local_rank",
                        "the local rank is the rank among the processes on this node; check what exported it")
    return local_rank, local_size


def _nodes(part: PartialEnv, local_rank: int, local_size: int, src: dict[str, Any],
           check: _Checks) -> tuple[int, int]:
    """The node rank and count: the launcher's, or derived from block placement."""
    node_rank, num_nodes = part.node_rank, part.num_nodes
    if node_rank is None:
        node_rank = (part.rank - local_rank) // local_size
        src["node_rank"] = Provenance.derived(
            "(rank - local_rank) // local_world_size (block placement; checked after init)")
    if num_nodes is None:
        num_nodes = -(-part.world_size // local_size)
        src["num_nodes"] = Provenance.derived("ceil(world_size / local_world_size)")
    if local_size == part.world_size:
        num_nodes = 1
    if node_rank >= num_nodes:
        raise check.bad(f"node rank {node_rank} is out of range for {num_nodes} nodes", "node_rank",
                        "check the node rank the job script exports (a stray NODE_RANK is a common cause)")
    return node_rank, num_nodes


def _master_addr(environ: Mapping[str, str], reader: LauncherReader, part: PartialEnv, single: bool,
                 src: dict[str, Any]) -> str:
    user = environ.get("MASTER_ADDR", "").strip()
    if user:
        src["master_addr"] = Provenance.variable("MASTER_ADDR")
        return user
    if single:
        src["master_addr"] = Provenance.derived("single node")
        return "127.0.0.1"
    if part.hosts:
        src["master_addr"] = Provenance.derived(f"first host of {src.get('hosts', 'the launcher host list')}")
        return part.hosts[0]
    error = reader.no_master_addr()
    if error is not None:
        raise error
    # Multi-node MPI: the address is learned from rank 0 over MPI at init time (needs mpi4py).
    src["master_addr"] = Provenance.pending("broadcast from rank 0 over MPI")
    return ""


def _port(environ: Mapping[str, str], job_id: Optional[str], launcher: str) -> int:
    raw = environ.get("MASTER_PORT", "").strip()
    if raw:
        try:
            port = int(raw, 10)
        except ValueError:
            port = -1
        if not 1 <= port <= 65535:
            raise LauncherEnvError(
                "MASTER_PORT must be an integer from 1 to 65535",
                variable="MASTER_PORT",
                value=environ.get("MASTER_PORT"),
                launcher=launcher,
                fix="export MASTER_PORT=<a free port from 1024 to 65535>, or unset it to derive one from the job id",
            )
        return port
    if job_id:
        return derive_port(job_id)
    return DEFAULT_PORT
