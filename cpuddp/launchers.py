"""One small reader per launcher family, tried in one documented order.

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

Rules every reader follows: partial information is an error (a rank without a size never
becomes rank 0); a value that is not an integer, negative or out of range is an error naming
the variable and launcher; a rank variable of another launcher family that disagrees with the
chosen one is an error.  ``OMPI_COMM_WORLD_NODE_RANK`` is the rank *among the processes on a
node*, not the node's index, so the node rank under MPI is derived from block placement
(``rank // local_world_size``) and checked against the real hosts once the group exists.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from .env import DEFAULT_PORT, PORT_RANGE, DistEnv
from .errors import LauncherEnvError

log = logging.getLogger("cpuddp")

__all__ = [
    "READERS",
    "LAUNCHER_NAMES",
    "detect",
    "expand_nodelist",
    "expand_tasks_per_node",
    "derive_port",
    "is_loopback",
    "LAUNCHER_ENV_PREFIXES",
    "LAUNCHER_ENV_NAMES",
    "is_launcher_variable",
    "clean_environ",
]

#: Human names of the families, used in messages.
LAUNCHER_NAMES = {
    "torchrun": "torchrun / TorchElastic",
    "hydra": "Intel MPI / MPICH (Hydra)",
    "pmix": "PMIx",
    "openmpi": "Open MPI",
    "mvapich": "MVAPICH2",
    "slurm": "Slurm srun",
    "env": "RANK/WORLD_SIZE (Kubeflow or exported by hand)",
    "none": "no launcher",
}

#: Variables that describe a launched process (every family's, and what cpuddp exports).  A
#: process that starts ranks of its own (``cpuddp bench --nproc``, ``cpuddp.testing``) strips
#: them, so a run inside mpirun or srun still gets a clean world of its own.
LAUNCHER_ENV_PREFIXES = (
    "PMI_", "PMIX_", "OMPI_", "MV2_", "MPIRUN_", "SLURM_", "MPI_LOCAL", "I_MPI_HYDRA", "HYDRA_",
    "TORCHELASTIC_", "GROUP_", "ROLE_",
)
LAUNCHER_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def is_launcher_variable(name: str) -> bool:
    """True for a variable some launcher sets to describe a launched process."""
    return name in LAUNCHER_ENV_NAMES or name.startswith(LAUNCHER_ENV_PREFIXES)


def clean_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any launcher's variables."""
    return {k: v for k, v in environ.items() if not is_launcher_variable(k)}


# Each family's per-process rank variable, for the conflict check.
_RANK_VARS = {
    "torchrun": "RANK",
    "hydra": "PMI_RANK",
    "openmpi": "OMPI_COMM_WORLD_RANK",
    "mvapich": "MV2_COMM_WORLD_RANK",
    "pmix": "PMIX_RANK",
    "env": "RANK",
}


@dataclass
class _Raw:
    """What a reader found, before the common derivations and checks."""

    launcher: str
    rank: int
    world_size: int
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    node_rank: Optional[int] = None
    num_nodes: Optional[int] = None
    job_id: Optional[str] = None
    agent_store: bool = False
    slurm_nodes: Optional[list[str]] = None
    sources: dict[str, str] = field(default_factory=dict)


class _Reader:
    """Parses integers out of ``environ`` with errors in one voice."""

    def __init__(self, environ: Mapping[str, str], launcher: str) -> None:
        self.environ = environ
        self.launcher = launcher
        self.name = LAUNCHER_NAMES[launcher]

    def has(self, *names: str) -> bool:
        return any(self.environ.get(n, "") != "" for n in names)

    def first(self, *names: str) -> Optional[str]:
        for n in names:
            if self.environ.get(n, "") != "":
                return n
        return None

    def error(self, msg: str, var: str, fix: str) -> LauncherEnvError:
        return LauncherEnvError(msg, variable=var, value=self.environ.get(var), launcher=self.name, fix=fix)

    def int(self, *names: str, required: bool = True, minimum: int = 0, fix: Optional[str] = None) -> Optional[int]:
        var = self.first(*names)
        if var is None:
            if not required:
                return None
            shown = " or ".join(names)
            raise LauncherEnvError(
                f"{shown} is not set, but other {self.name} variables are",
                variable=names[0],
                value=None,
                launcher=self.name,
                fix=fix or f"start the job with the launcher itself, or export {names[0]}",
            )
        raw = self.environ[var].strip()
        try:
            value = int(raw, 10)
        except ValueError:
            raise self.error(f"{var} must be an integer", var, fix or f"export {var} as a whole number") from None
        if value < minimum:
            raise self.error(f"{var} must be >= {minimum}, got {value}", var, fix or f"export {var} >= {minimum}")
        return value


# --------------------------------------------------------------------------- readers


def _read_torchrun(environ: Mapping[str, str]) -> Optional[_Raw]:
    r = _Reader(environ, "torchrun")
    if not r.has("TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        return None
    fix = "run the script with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* for each worker)"
    raw = _Raw(
        "torchrun",
        rank=r.int("RANK", fix=fix),  # type: ignore[arg-type]
        world_size=r.int("WORLD_SIZE", minimum=1, fix=fix),  # type: ignore[arg-type]
        local_rank=r.int("LOCAL_RANK", fix=fix),
        local_world_size=r.int("LOCAL_WORLD_SIZE", required=False, minimum=1),
        node_rank=r.int("GROUP_RANK", required=False),
        num_nodes=r.int("GROUP_WORLD_SIZE", required=False, minimum=1),
        job_id=environ.get("TORCHELASTIC_RUN_ID") or None,
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )
    raw.sources.update(rank="RANK", world_size="WORLD_SIZE", local_rank="LOCAL_RANK")
    if raw.local_world_size is not None:
        raw.sources["local_world_size"] = "LOCAL_WORLD_SIZE"
    if raw.node_rank is not None:
        raw.sources["node_rank"] = "GROUP_RANK"
    if raw.agent_store:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not r.has(var):
                raise LauncherEnvError(
                    "torchrun's agent hosts the rendezvous store but did not say where",
                    variable=var,
                    value=None,
                    launcher=r.name,
                    fix="launch with torchrun, which sets MASTER_ADDR and MASTER_PORT itself",
                )
    return raw


def _read_hydra(environ: Mapping[str, str]) -> Optional[_Raw]:
    r = _Reader(environ, "hydra")
    if not r.has("PMI_RANK", "PMI_SIZE") or _slurm_pmi(environ):
        return None
    fix = "launch with Intel MPI or MPICH `mpiexec -n N python ...`, which sets PMI_RANK and PMI_SIZE"
    raw = _Raw(
        "hydra",
        rank=r.int("PMI_RANK", fix=fix),  # type: ignore[arg-type]
        world_size=r.int("PMI_SIZE", minimum=1, fix=fix),  # type: ignore[arg-type]
        job_id=_job_id(environ, "I_MPI_HYDRA_UUID", "PMIX_NAMESPACE"),
    )
    raw.sources.update(rank="PMI_RANK", world_size="PMI_SIZE")
    # Older Hydra and PMI-2 launchers (srun --mpi=pmi2) give no local rank of their own.
    _read_local(r, raw, ("MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"), ("MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"))
    return raw


def _read_pmix(environ: Mapping[str, str]) -> Optional[_Raw]:
    r = _Reader(environ, "pmix")
    if not r.has("PMIX_RANK") or r.has("OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        return None
    rank = r.int("PMIX_RANK")
    world = r.int(
        "WORLD_SIZE",
        minimum=1,
        fix="PMIx keeps the job size behind its API: export WORLD_SIZE (and LOCAL_RANK, LOCAL_WORLD_SIZE), "
        "or launch with Open MPI mpirun / srun, which set the sizes",
    )
    raw = _Raw("pmix", rank=rank, world_size=world, job_id=_job_id(environ, "PMIX_NAMESPACE"))  # type: ignore[arg-type]
    raw.sources.update(rank="PMIX_RANK", world_size="WORLD_SIZE")
    _read_local(r, raw, ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",))
    return raw


def _read_openmpi(environ: Mapping[str, str]) -> Optional[_Raw]:
    r = _Reader(environ, "openmpi")
    if not r.has("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        return None
    fix = "launch with Open MPI `mpirun -n N python ...`, which sets OMPI_COMM_WORLD_RANK and _SIZE"
    raw = _Raw(
        "openmpi",
        rank=r.int("OMPI_COMM_WORLD_RANK", fix=fix),  # type: ignore[arg-type]
        world_size=r.int("OMPI_COMM_WORLD_SIZE", minimum=1, fix=fix),  # type: ignore[arg-type]
        job_id=_job_id(environ, "PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid"),
    )
    raw.sources.update(rank="OMPI_COMM_WORLD_RANK", world_size="OMPI_COMM_WORLD_SIZE")
    _read_local(r, raw, ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",))
    # OMPI_COMM_WORLD_NODE_RANK is this process's rank among all processes on the node (across
    # jobs), not the node index: validate it, never use it as node_rank.
    r.int("OMPI_COMM_WORLD_NODE_RANK", required=False)
    return raw


def _read_mvapich(environ: Mapping[str, str]) -> Optional[_Raw]:
    r = _Reader(environ, "mvapich")
    if not r.has("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"):
        return None
    fix = "launch with MVAPICH2 `mpirun_rsh`/`mpiexec`, which sets MV2_COMM_WORLD_RANK and _SIZE"
    raw = _Raw(
        "mvapich",
        rank=r.int("MV2_COMM_WORLD_RANK", fix=fix),  # type: ignore[arg-type]
        world_size=r.int("MV2_COMM_WORLD_SIZE", minimum=1, fix=fix),  # type: ignore[arg-type]
        job_id=_job_id(environ, "MPIRUN_ID"),
    )
    raw.sources.update(rank="MV2_COMM_WORLD_RANK", world_size="MV2_COMM_WORLD_SIZE")
    _read_local(r, raw, ("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",))
    return raw


def _read_slurm(environ: Mapping[str, str]) -> Optional[_Raw]:
    r = _Reader(environ, "slurm")
    if not r.has("SLURM_PROCID"):
        return None
    if not r.has("SLURM_STEP_ID", "SLURM_STEPID"):
        # A batch script or salloc shell: the SLURM_* variables describe the allocation, and
        # this process was not started as one of N tasks.  That is a single process.
        _log_batch_shell(environ)
        return None
    fix = "launch the tasks with `srun` (it sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID)"
    raw = _Raw(
        "slurm",
        rank=r.int("SLURM_PROCID", fix=fix),  # type: ignore[arg-type]
        world_size=r.int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1, fix=fix),  # type: ignore[arg-type]
        local_rank=r.int("SLURM_LOCALID", fix=fix),
        node_rank=r.int("SLURM_NODEID", fix=fix),
        num_nodes=r.int("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", required=False, minimum=1),
    )
    raw.sources.update(
        rank="SLURM_PROCID",
        world_size=r.first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or "",
        local_rank="SLURM_LOCALID",
        node_rank="SLURM_NODEID",
    )
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    raw.job_id = f"slurm:{job}.{step}" if job else None

    tpn_var = r.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tpn_var is not None:
        try:
            per_node = expand_tasks_per_node(environ[tpn_var])
        except ValueError as exc:
            raise r.error(str(exc), tpn_var, "it should look like `2(x3),1`; launch with srun") from None
        if raw.num_nodes is None:
            raw.num_nodes = len(per_node)
        if raw.node_rank is not None and raw.node_rank >= len(per_node):
            raise r.error(
                f"SLURM_NODEID={raw.node_rank} but {tpn_var} lists only {len(per_node)} nodes",
                "SLURM_NODEID",
                "launch with srun, which keeps these consistent",
            )
        raw.local_world_size = per_node[raw.node_rank or 0]
        raw.sources["local_world_size"] = f"derived: {tpn_var}[SLURM_NODEID]"
    elif r.has("SLURM_NTASKS_PER_NODE"):
        raw.local_world_size = r.int("SLURM_NTASKS_PER_NODE", minimum=1)
        raw.sources["local_world_size"] = "SLURM_NTASKS_PER_NODE"
    elif raw.num_nodes == 1:
        raw.local_world_size = raw.world_size
        raw.sources["local_world_size"] = "derived: one node"

    list_var = r.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if list_var is not None:
        try:
            raw.slurm_nodes = expand_nodelist(environ[list_var])
        except ValueError as exc:
            raise r.error(
                f"cannot parse the Slurm node list: {exc}",
                list_var,
                "it should look like `node[01-04,07],gpu-a[1-2]`; launch with srun, or export MASTER_ADDR",
            ) from None
        raw.sources["slurm_nodelist"] = list_var
        if raw.num_nodes is None:
            raw.num_nodes = len(raw.slurm_nodes)
    return raw


def _slurm_pmi(environ: Mapping[str, str]) -> bool:
    """True when the PMI_* variables are Slurm's own (``srun --mpi=pmi2`` sets PMI_RANK, PMI_SIZE,
    PMI_FD and PMI_JOBID=<job>.<step>): Slurm launched this task and its reader describes it
    fully (node list, tasks per node), where Hydra's would lack the local size."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    return bool(job and step) and environ.get("PMI_JOBID", "").strip() == f"{job}.{step}"


def _log_batch_shell(environ: Mapping[str, str]) -> None:
    """Say why an sbatch script's ``python train.py`` (SLURM_PROCID=0, SLURM_NTASKS=N, no step)
    is a world of one: a warning when the job has more tasks, which the user probably meant."""
    ntasks = environ.get("SLURM_NTASKS", "").strip()
    level = logging.WARNING if ntasks.isdigit() and int(ntasks) > 1 else logging.DEBUG
    log.log(
        level,
        "cpuddp: SLURM_PROCID is set but SLURM_STEP_ID is not: this is an sbatch script or salloc shell, "
        "not an srun task, so it runs as a single process (world 1, not SLURM_NTASKS=%s); "
        "start the ranks with `srun python ...`",
        ntasks or "unset",
    )


def _read_env(environ: Mapping[str, str]) -> Optional[_Raw]:
    r = _Reader(environ, "env")
    if not r.has("RANK", "WORLD_SIZE"):
        return None
    fix = "export both RANK and WORLD_SIZE (as Kubeflow PyTorchJob does), or launch with torchrun or mpiexec"
    raw = _Raw(
        "env",
        rank=r.int("RANK", fix=fix),  # type: ignore[arg-type]
        world_size=r.int("WORLD_SIZE", minimum=1, fix=fix),  # type: ignore[arg-type]
        node_rank=r.int("NODE_RANK", "GROUP_RANK", required=False),
        # A torchrun-like agent (cpuddp.testing) may host the store for every rank.
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )
    raw.sources.update(rank="RANK", world_size="WORLD_SIZE")
    if raw.node_rank is not None:
        raw.sources["node_rank"] = r.first("NODE_RANK", "GROUP_RANK") or ""
    if r.has("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        _read_local(r, raw, ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",))
    elif is_loopback(environ.get("MASTER_ADDR", "")):
        # Rank 0 on loopback is reachable from this host only: every rank is here.
        raw.local_rank, raw.local_world_size = raw.rank, raw.world_size
        raw.sources.update(local_rank="derived: MASTER_ADDR is loopback", local_world_size="derived: MASTER_ADDR is loopback")
    elif r.has("MASTER_ADDR"):
        # Kubeflow PyTorchJob without torchrun: one process per pod.
        raw.local_rank, raw.local_world_size = 0, 1
        raw.sources.update(local_rank="derived: one process per host", local_world_size="derived: one process per host")
    elif raw.world_size > 1:
        raise LauncherEnvError(
            "RANK and WORLD_SIZE are set, but neither MASTER_ADDR nor LOCAL_WORLD_SIZE says where rank 0 runs",
            variable="MASTER_ADDR",
            value=None,
            launcher=r.name,
            fix="export MASTER_ADDR=<rank 0's host> (127.0.0.1 when every rank runs on this machine)",
        )
    return raw


#: The readers, in the order they are tried.  See the module docstring for why.
READERS: tuple[tuple[str, Callable[[Mapping[str, str]], Optional[_Raw]]], ...] = (
    ("torchrun", _read_torchrun),
    ("hydra", _read_hydra),
    ("pmix", _read_pmix),
    ("openmpi", _read_openmpi),
    ("mvapich", _read_mvapich),
    ("slurm", _read_slurm),
    ("env", _read_env),
)


def _read_local(r: _Reader, raw: _Raw, rank_vars: tuple[str, ...], size_vars: tuple[str, ...]) -> None:
    rank_var, size_var = r.first(*rank_vars), r.first(*size_vars)
    if rank_var is not None:
        raw.local_rank = r.int(rank_var)
        raw.sources["local_rank"] = rank_var
    if size_var is not None:
        raw.local_world_size = r.int(size_var, minimum=1)
        raw.sources["local_world_size"] = size_var


def _job_id(environ: Mapping[str, str], *names: str) -> Optional[str]:
    for n in names:
        v = environ.get(n, "")
        if v:
            return f"{n}={v}"
    return None


# --------------------------------------------------------------------------- pure parsers

_NODELIST_TOKEN = re.compile(r"([^,\[\]]+)(?:\[([^\[\]]*)\])?([^,\[\]]*)")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: ``node[01-04,07],gpu-a[1-2]`` -> node01..node04, node07, gpu-a1, gpu-a2.

    Zero padding is kept (``[08-10]`` -> 08, 09, 10).  Raises ValueError on malformed input.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("the node list is empty")
    hosts: list[str] = []
    pos = 0
    while pos < len(text):
        m = _NODELIST_TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"unexpected {text[pos:]!r} in {nodelist!r}")
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            if "[" in text[m.end():m.end() + 1] or "]" in prefix:
                raise ValueError(f"unbalanced brackets in {nodelist!r}")
            hosts.append(prefix + suffix)
        else:
            for item in ranges.split(","):
                hosts.extend(prefix + n + suffix for n in _expand_range(item, nodelist))
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise ValueError(f"unexpected {text[pos:]!r} in {nodelist!r}")
            pos += 1
            if pos == len(text):
                raise ValueError(f"trailing comma in {nodelist!r}")
    return hosts


def _expand_range(item: str, whole: str) -> list[str]:
    item = item.strip()
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
    if not m:
        raise ValueError(f"bad range {item!r} in {whole!r}")
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if int(hi) < int(lo):
        raise ValueError(f"descending range {item!r} in {whole!r}")
    width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
    return [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]


def expand_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's compressed tasks-per-node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in value.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"cannot parse tasks per node {value!r} (at {part!r})")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def derive_port(job_id: str, port_range: tuple[int, int] = PORT_RANGE) -> int:
    """Map a job id to a port every rank computes alike (CRC32, stable across processes)."""
    lo, hi = port_range
    return lo + zlib.crc32(job_id.encode()) % (hi - lo)


def is_loopback(addr: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 (by text; no name resolution)."""
    a = addr.strip().strip("[]").lower()
    if a in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(a).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- detect


def detect(environ: Mapping[str, str]) -> DistEnv:
    """Build the :class:`~cpuddp.env.DistEnv` described by ``environ`` (pure)."""
    raw: Optional[_Raw] = None
    for _, reader in READERS:
        raw = reader(environ)
        if raw is not None:
            break
    if raw is None:
        return _single_process(environ)
    _check_conflicts(environ, raw)
    return _finish(environ, raw)


def _single_process(environ: Mapping[str, str]) -> DistEnv:
    sources = {"rank": "default", "world_size": "default"}
    addr = environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _port(environ, None, "none") or DEFAULT_PORT
    return DistEnv(master_addr=addr, master_port=port, launcher="none", sources=sources)


def _check_conflicts(environ: Mapping[str, str], raw: _Raw) -> None:
    chosen = _RANK_VARS.get(raw.launcher)
    for family, var in _RANK_VARS.items():
        if var == chosen or family == raw.launcher:
            continue
        value = environ.get(var, "")
        if value == "" or value.strip() == str(raw.rank):
            continue
        fam = "RANK (exported by hand or by an earlier run)" if var == "RANK" else LAUNCHER_NAMES[family]
        raise LauncherEnvError(
            f"two launchers disagree about this process's rank: {raw.sources['rank']}={raw.rank} "
            f"({LAUNCHER_NAMES[raw.launcher]}) but {var}={value} ({fam})",
            variable=var,
            value=value,
            launcher=fam,
            fix=f"unset {var} in the job script, so only {LAUNCHER_NAMES[raw.launcher]} describes the job",
        )


def _finish(environ: Mapping[str, str], raw: _Raw) -> DistEnv:
    name = LAUNCHER_NAMES[raw.launcher]
    src = raw.sources

    def bad(msg: str, key: str, fix: str) -> LauncherEnvError:
        var = src.get(key, key)
        return LauncherEnvError(msg, variable=var, value=environ.get(var), launcher=name, fix=fix)

    if raw.rank >= raw.world_size:
        raise bad(
            f"rank {raw.rank} is out of range for a world of {raw.world_size} (valid: 0..{raw.world_size - 1})",
            "rank",
            f"every rank must be below {src['world_size']}={raw.world_size}; launch with the launcher rather than by hand",
        )

    # Local rank and size.
    if raw.local_world_size is None and raw.world_size == 1:
        raw.local_world_size = 1
        src["local_world_size"] = "derived: world of 1"
    if raw.local_rank is None and raw.local_world_size == raw.world_size:
        raw.local_rank = raw.rank
        src["local_rank"] = "derived: one node"
    if raw.local_rank is None:
        raise LauncherEnvError(
            f"{name} did not say this process's rank on its node",
            variable="LOCAL_RANK",
            value=None,
            launcher=name,
            fix="export LOCAL_RANK and LOCAL_WORLD_SIZE, or launch with a launcher that sets them",
        )
    if raw.local_world_size is None:
        raise LauncherEnvError(
            f"{name} did not say how many ranks run on this node",
            variable="LOCAL_WORLD_SIZE",
            value=None,
            launcher=name,
            fix="export LOCAL_WORLD_SIZE (ranks per node), or launch with a launcher that sets it",
        )
    if raw.local_world_size > raw.world_size:
        raise bad(
            f"{raw.local_world_size} ranks per node is more than the {raw.world_size} ranks in the job",
            "local_world_size",
            "the local world size must not exceed the world size; check the launcher's -n/-ppn flags",
        )
    if raw.local_rank >= raw.local_world_size:
        raise bad(
            f"local rank {raw.local_rank} is at or above the local world size {raw.local_world_size}",
            "local_rank",
            f"local ranks run 0..{raw.local_world_size - 1}; launch with the launcher rather than by hand",
        )
    if raw.local_rank > raw.rank:
        raise bad(
            f"local rank {raw.local_rank} is above the global rank {raw.rank}",
            "local_rank",
            "the local rank is the rank among the processes on this node; check what exported it",
        )

    # Node rank and count.
    if raw.node_rank is None:
        raw.node_rank = (raw.rank - raw.local_rank) // raw.local_world_size
        src["node_rank"] = "derived: (rank - local_rank) // local_world_size (block placement; checked after init)"
    if raw.num_nodes is None:
        raw.num_nodes = -(-raw.world_size // raw.local_world_size)
        src["num_nodes"] = "derived: ceil(world_size / local_world_size)"
    single = raw.local_world_size == raw.world_size
    if single:
        raw.num_nodes = 1
    if raw.node_rank >= raw.num_nodes:
        raise bad(
            f"node rank {raw.node_rank} is out of range for {raw.num_nodes} nodes",
            "node_rank",
            "check the node rank the job script exports (a stray NODE_RANK is a common cause)",
        )

    addr = _master_addr(environ, raw, single, src)
    port = _port(environ, raw.job_id, name)
    src["master_port"] = "MASTER_PORT" if environ.get("MASTER_PORT") else (
        f"derived: job id {raw.job_id}" if raw.job_id else "default"
    )
    return DistEnv(
        rank=raw.rank,
        world_size=raw.world_size,
        local_rank=raw.local_rank,
        local_world_size=raw.local_world_size,
        node_rank=raw.node_rank,
        master_addr=addr,
        master_port=port,
        launcher=raw.launcher,
        num_nodes=raw.num_nodes,
        job_id=raw.job_id,
        agent_store=raw.agent_store,
        sources=dict(src),
    )


def _master_addr(environ: Mapping[str, str], raw: _Raw, single: bool, src: dict[str, str]) -> str:
    user = environ.get("MASTER_ADDR", "").strip()
    if user:
        src["master_addr"] = "MASTER_ADDR"
        return user
    if single:
        src["master_addr"] = "derived: single node"
        return "127.0.0.1"
    if raw.slurm_nodes:
        src["master_addr"] = f"derived: first host of {src.get('slurm_nodelist')}"
        return raw.slurm_nodes[0]
    if raw.launcher == "slurm":
        raise LauncherEnvError(
            "this multi-node Slurm step has no node list to take rank 0's host from",
            variable="SLURM_STEP_NODELIST",
            value=None,
            launcher=LAUNCHER_NAMES["slurm"],
            fix="launch with srun (it sets SLURM_STEP_NODELIST), or export MASTER_ADDR=<rank 0's host>",
        )
    # Multi-node MPI: the address is learned from rank 0 over MPI at init time (needs mpi4py).
    src["master_addr"] = "pending: broadcast from rank 0 over MPI"
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
