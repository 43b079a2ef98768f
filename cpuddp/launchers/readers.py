"""The launcher reader interface, and one reader per built-in launcher family.

A reader says whether its launcher's variables are present (:meth:`LauncherReader.detect`)
and reads them into a :class:`PartialEnv` (:meth:`LauncherReader.read`): what the launcher
said, with each value's :class:`~cpuddp.launchers.env.Provenance`.  Both take a mapping, never
``os.environ``, and import nothing.  :func:`cpuddp.launchers.detect` tries the registered
readers in order and then applies the rules every launcher shares (derivations, range
checks, rendezvous address and port), so a site reader added with
:func:`cpuddp.launchers.register_launcher` gets the same checks as the built-ins.

:class:`Variables` parses integers out of the mapping with errors in one voice: the
variable, its value, the launcher and the fix.  The order of the built-ins, and why, is in
:mod:`cpuddp.launchers`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from cpuddp.errors import LauncherEnvError

from .env import Provenance
from .parsers import expand_nodelist, expand_tasks_per_node, is_loopback

log = logging.getLogger("cpuddp")

__all__ = ["LauncherReader", "PartialEnv", "Variables", "BUILTIN_READERS"]


@dataclass
class PartialEnv:
    """What one launcher said, before the rules every launcher shares.

    ``rank`` and ``world_size`` are required; leave a field None when the launcher does not
    say it (the local size of a single-node job, the node rank and node count are derived).
    ``hosts``: the job's hosts in node order, when the launcher lists them (rank 0's host is
    then the rendezvous address of a multi-node job with no ``MASTER_ADDR``).  ``sources``
    maps a field to the variable it came from (a plain name) or a
    :class:`~cpuddp.launchers.env.Provenance`.
    """

    rank: int
    world_size: int
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    node_rank: Optional[int] = None
    num_nodes: Optional[int] = None
    job_id: Optional[str] = None
    agent_store: bool = False
    hosts: Optional[list[str]] = None
    sources: dict[str, Union[str, Provenance]] = field(default_factory=dict)


class Variables:
    """A launcher's variables in ``environ``, read with errors that name the variable, its
    value, the launcher (``launcher``: its human name) and the fix.  ``sources`` maps a field
    to the variable it was read from, for the reads that name the field (``into=``); pass it
    on as :attr:`PartialEnv.sources`."""

    def __init__(self, environ: Mapping[str, str], launcher: str) -> None:
        self.environ = environ
        self.launcher = launcher
        self.sources: dict[str, Union[str, Provenance]] = {}

    def has(self, *names: str) -> bool:
        """True when any of ``names`` is set and not empty."""
        return any(self.environ.get(n, "") != "" for n in names)

    def first(self, *names: str) -> Optional[str]:
        """The first of ``names`` that is set and not empty, or None."""
        for n in names:
            if self.environ.get(n, "") != "":
                return n
        return None

    def error(self, msg: str, var: str, fix: str) -> LauncherEnvError:
        return LauncherEnvError(msg, variable=var, value=self.environ.get(var), launcher=self.launcher, fix=fix)

    def int(self, *names: str, minimum: int = 0, fix: Optional[str] = None, into: Optional[str] = None) -> int:
        """The first of ``names`` that is set, as an integer >= ``minimum``; an error when
        none is set (other variables of this launcher are: partial information).  ``into``:
        the field it goes to, recorded in :attr:`sources` with the variable read."""
        value = self.maybe_int(*names, minimum=minimum, fix=fix, into=into)
        if value is None:
            raise LauncherEnvError(
                f"{' or '.join(names)} is not set, but other {self.launcher} variables are",
                variable=names[0],
                value=None,
                launcher=self.launcher,
                fix=fix or f"start the job with the launcher itself, or export {names[0]}",
            )
        return value

    def maybe_int(self, *names: str, minimum: int = 0, fix: Optional[str] = None,
                  into: Optional[str] = None) -> Optional[int]:
        """Like :meth:`int`, but None (and nothing recorded) when none of ``names`` is set."""
        var = self.first(*names)
        if var is None:
            return None
        raw = self.environ[var].strip()
        try:
            value = int(raw, 10)
        except ValueError:
            raise self.error(f"{var} must be an integer", var, fix or f"export {var} as a whole number") from None
        if value < minimum:
            raise self.error(f"{var} must be >= {minimum}, got {value}", var, fix or f"export {var} >= {minimum}")
        if into is not None:
            self.sources[into] = var
        return value

    def local(self, out: PartialEnv, rank_vars: tuple[str, ...], size_vars: tuple[str, ...]) -> None:
        """Read the local rank and size into ``out`` from the first of each set that is present."""
        rank_var, size_var = self.first(*rank_vars), self.first(*size_vars)
        if rank_var is not None:
            out.local_rank = self.int(rank_var)
            out.sources["local_rank"] = rank_var
        if size_var is not None:
            out.local_world_size = self.int(size_var, minimum=1)
            out.sources["local_world_size"] = size_var

    def job_id(self, *names: str) -> Optional[str]:
        """``NAME=value`` for the first of ``names`` that is set: a job id every rank shares."""
        var = self.first(*names)
        return None if var is None else f"{var}={self.environ[var]}"


class LauncherReader:
    """One launcher family: the interface of every built-in reader, for a site to subclass.

    ``description``: the launcher's human name in messages.  ``rank_variable``: its
    per-process rank variable, if any; another family's disagreeing rank variable is then an
    error (two launchers describing one process).  Implement :meth:`detect` and :meth:`read`;
    both are pure functions of ``environ``.  :meth:`declined` may log why the launcher's
    variables did not describe this process.  Register an instance with
    :func:`cpuddp.launchers.register_launcher`.
    """

    description: str = ""
    rank_variable: Optional[str] = None
    #: True when other launchers set ``rank_variable`` too (PMIx's ``PMIX_RANK``: Open MPI and
    #: Slurm set it): it is checked last, so a conflict names the launcher that set it.
    shared_rank_variable: bool = False

    def detect(self, environ: Mapping[str, str]) -> bool:
        """True when this launcher's variables describe this process."""
        raise NotImplementedError

    def declined(self, environ: Mapping[str, str]) -> None:
        """Called by :func:`cpuddp.launchers.detect` when it tried this reader and :meth:`detect`
        was false (the readers before it did not match either); the default does nothing."""

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        """What the launcher said (called only when :meth:`detect` is true).  Raise
        :class:`~cpuddp.errors.LauncherEnvError` (:meth:`variables` words it) for a value
        that is missing, malformed or out of range."""
        raise NotImplementedError

    def no_master_addr(self) -> Optional[LauncherEnvError]:
        """The error for a multi-node job with neither ``MASTER_ADDR`` nor ``hosts``; None
        (the default): rank 0's address is learned over MPI at init (needs mpi4py)."""
        return None

    def variables(self, environ: Mapping[str, str]) -> Variables:
        return Variables(environ, self.description or type(self).__name__)


# --------------------------------------------------------------------------- the built-ins


class TorchrunReader(LauncherReader):
    description = "torchrun / TorchElastic"
    rank_variable = "RANK"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has("TORCHELASTIC_RUN_ID", "GROUP_RANK")

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        fix = "run the script with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* for each worker)"
        out = PartialEnv(
            rank=v.int("RANK", fix=fix, into="rank"),
            world_size=v.int("WORLD_SIZE", minimum=1, fix=fix, into="world_size"),
            local_rank=v.int("LOCAL_RANK", fix=fix, into="local_rank"),
            local_world_size=v.maybe_int("LOCAL_WORLD_SIZE", minimum=1, into="local_world_size"),
            node_rank=v.maybe_int("GROUP_RANK", into="node_rank"),
            num_nodes=v.maybe_int("GROUP_WORLD_SIZE", minimum=1),
            job_id=environ.get("TORCHELASTIC_RUN_ID") or None,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            sources=v.sources,
        )
        for var in ("MASTER_ADDR", "MASTER_PORT") if out.agent_store else ():
            if not v.has(var):
                raise LauncherEnvError(
                    "torchrun's agent hosts the rendezvous store but did not say where",
                    variable=var,
                    value=None,
                    launcher=v.launcher,
                    fix="launch with torchrun, which sets MASTER_ADDR and MASTER_PORT itself",
                )
        return out


def slurm_pmi(environ: Mapping[str, str]) -> bool:
    """True when the PMI_* variables are Slurm's own (``srun --mpi=pmi2`` sets PMI_RANK, PMI_SIZE,
    PMI_FD and PMI_JOBID=<job>.<step>): Slurm launched this task and its reader describes it
    fully (node list, tasks per node), where Hydra's would lack the local size."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    return bool(job and step) and environ.get("PMI_JOBID", "").strip() == f"{job}.{step}"


class HydraReader(LauncherReader):
    description = "Intel MPI / MPICH (Hydra)"
    rank_variable = "PMI_RANK"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has("PMI_RANK", "PMI_SIZE") and not slurm_pmi(environ)

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        fix = "launch with Intel MPI or MPICH `mpiexec -n N python ...`, which sets PMI_RANK and PMI_SIZE"
        out = PartialEnv(
            rank=v.int("PMI_RANK", fix=fix, into="rank"),
            world_size=v.int("PMI_SIZE", minimum=1, fix=fix, into="world_size"),
            job_id=v.job_id("I_MPI_HYDRA_UUID", "PMIX_NAMESPACE"),
            sources=v.sources,
        )
        # Older Hydra and PMI-2 launchers (srun --mpi=pmi2) give no local rank of their own.
        v.local(out, ("MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"), ("MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"))
        return out


class PmixReader(LauncherReader):
    description = "PMIx"
    rank_variable = "PMIX_RANK"
    shared_rank_variable = True

    def detect(self, environ: Mapping[str, str]) -> bool:
        v = self.variables(environ)
        return v.has("PMIX_RANK") and not v.has("OMPI_COMM_WORLD_RANK", "SLURM_PROCID")

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        rank = v.int("PMIX_RANK", into="rank")
        world = v.int(
            "WORLD_SIZE",
            minimum=1,
            fix="PMIx keeps the job size behind its API: export WORLD_SIZE (and LOCAL_RANK, LOCAL_WORLD_SIZE), "
            "or launch with Open MPI mpirun / srun, which set the sizes",
            into="world_size",
        )
        out = PartialEnv(rank=rank, world_size=world, job_id=v.job_id("PMIX_NAMESPACE"), sources=v.sources)
        v.local(out, ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",))
        return out


class OpenMPIReader(LauncherReader):
    description = "Open MPI"
    rank_variable = "OMPI_COMM_WORLD_RANK"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        fix = "launch with Open MPI `mpirun -n N python ...`, which sets OMPI_COMM_WORLD_RANK and _SIZE"
        out = PartialEnv(
            rank=v.int("OMPI_COMM_WORLD_RANK", fix=fix, into="rank"),
            world_size=v.int("OMPI_COMM_WORLD_SIZE", minimum=1, fix=fix, into="world_size"),
            job_id=v.job_id("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid"),
            sources=v.sources,
        )
        v.local(out, ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",))
        # OMPI_COMM_WORLD_NODE_RANK is this process's rank among all processes on the node (across
        # jobs), not the node index: validate it, never use it as node_rank.
        v.maybe_int("OMPI_COMM_WORLD_NODE_RANK")
        return out


class MvapichReader(LauncherReader):
    description = "MVAPICH2"
    rank_variable = "MV2_COMM_WORLD_RANK"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        fix = "launch with MVAPICH2 `mpirun_rsh`/`mpiexec`, which sets MV2_COMM_WORLD_RANK and _SIZE"
        out = PartialEnv(
            rank=v.int("MV2_COMM_WORLD_RANK", fix=fix, into="rank"),
            world_size=v.int("MV2_COMM_WORLD_SIZE", minimum=1, fix=fix, into="world_size"),
            job_id=v.job_id("MPIRUN_ID"),
            sources=v.sources,
        )
        v.local(out, ("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",))
        return out


class SlurmReader(LauncherReader):
    """Slurm's ``srun`` tasks; a batch script (no ``SLURM_STEP_ID``) is a single process."""

    description = "Slurm srun"

    def detect(self, environ: Mapping[str, str]) -> bool:
        v = self.variables(environ)
        # Without a step id this is a batch script or salloc shell: the SLURM_* variables describe
        # the allocation, and this process was not started as one of N tasks (a single process).
        return v.has("SLURM_PROCID") and v.has("SLURM_STEP_ID", "SLURM_STEPID")

    def declined(self, environ: Mapping[str, str]) -> None:
        v = self.variables(environ)
        if v.has("SLURM_PROCID") and not v.has("SLURM_STEP_ID", "SLURM_STEPID"):
            _log_batch_shell(environ)

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        fix = "launch the tasks with `srun` (it sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID)"
        out = PartialEnv(
            rank=v.int("SLURM_PROCID", fix=fix, into="rank"),
            world_size=v.int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1, fix=fix,
                             into="world_size"),
            local_rank=v.int("SLURM_LOCALID", fix=fix, into="local_rank"),
            node_rank=v.int("SLURM_NODEID", fix=fix, into="node_rank"),
            num_nodes=v.maybe_int("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", minimum=1),
            sources=v.sources,
        )
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
        out.job_id = f"slurm:{job}.{step}" if job else None
        _slurm_local_size(v, out)
        _slurm_hosts(v, out)
        return out

    def no_master_addr(self) -> Optional[LauncherEnvError]:
        return LauncherEnvError(
            "this multi-node Slurm step has no node list to take rank 0's host from",
            variable="SLURM_STEP_NODELIST",
            value=None,
            launcher=self.description,
            fix="launch with srun (it sets SLURM_STEP_NODELIST), or export MASTER_ADDR=<rank 0's host>",
        )


def _slurm_local_size(v: Variables, out: PartialEnv) -> None:
    """Tasks on this node: ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) at ``SLURM_NODEID``."""
    tpn_var = v.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tpn_var is not None:
        try:
            per_node = expand_tasks_per_node(v.environ[tpn_var])
        except ValueError as exc:
            raise v.error(str(exc), tpn_var, "it should look like `2(x3),1`; launch with srun") from None
        if out.num_nodes is None:
            out.num_nodes = len(per_node)
        if out.node_rank is not None and out.node_rank >= len(per_node):
            raise v.error(
                f"SLURM_NODEID={out.node_rank} but {tpn_var} lists only {len(per_node)} nodes",
                "SLURM_NODEID",
                "launch with srun, which keeps these consistent",
            )
        out.local_world_size = per_node[out.node_rank or 0]
        out.sources["local_world_size"] = Provenance.derived(f"{tpn_var}[SLURM_NODEID]")
    elif v.has("SLURM_NTASKS_PER_NODE"):
        out.local_world_size = v.int("SLURM_NTASKS_PER_NODE", minimum=1, into="local_world_size")
    elif out.num_nodes == 1:
        out.local_world_size = out.world_size
        out.sources["local_world_size"] = Provenance.derived("one node")


def _slurm_hosts(v: Variables, out: PartialEnv) -> None:
    """The step's hosts, from the expanded node list (``node[01-04,07]``)."""
    list_var = v.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if list_var is None:
        return
    try:
        out.hosts = expand_nodelist(v.environ[list_var])
    except ValueError as exc:
        raise v.error(
            f"cannot parse the Slurm node list: {exc}",
            list_var,
            "it should look like `node[01-04,07],gpu-a[1-2]`; launch with srun, or export MASTER_ADDR",
        ) from None
    out.sources["hosts"] = list_var
    if out.num_nodes is None:
        out.num_nodes = len(out.hosts)


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


class PlainEnvReader(LauncherReader):
    """``RANK``/``WORLD_SIZE`` as Kubeflow's PyTorchJob (or a user) exports them."""

    description = "RANK/WORLD_SIZE (Kubeflow or exported by hand)"
    rank_variable = "RANK"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has("RANK", "WORLD_SIZE")

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        if not v.has("RANK") and v.has("LOCAL_RANK"):
            raise _framework_child(environ)
        fix = "export both RANK and WORLD_SIZE (as Kubeflow PyTorchJob does), or launch with torchrun or mpiexec"
        out = PartialEnv(
            rank=v.int("RANK", fix=fix, into="rank"),
            world_size=v.int("WORLD_SIZE", minimum=1, fix=fix, into="world_size"),
            node_rank=v.maybe_int("NODE_RANK", "GROUP_RANK", into="node_rank"),
            # A torchrun-like agent (cpuddp.testing) may host the store for every rank.
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            sources=v.sources,
        )
        self._local(v, out)
        return out

    @staticmethod
    def _local(v: Variables, out: PartialEnv) -> None:
        if v.has("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            v.local(out, ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",))
        elif is_loopback(v.environ.get("MASTER_ADDR", "")):
            # Rank 0 on loopback is reachable from this host only: every rank is here.
            out.local_rank, out.local_world_size = out.rank, out.world_size
            how = Provenance.derived("MASTER_ADDR is loopback")
            out.sources.update(local_rank=how, local_world_size=how)
        elif v.has("MASTER_ADDR"):
            # Kubeflow PyTorchJob without torchrun: one process per pod.
            out.local_rank, out.local_world_size = 0, 1
            how = Provenance.derived("one process per host")
            out.sources.update(local_rank=how, local_world_size=how)
        elif out.world_size > 1:
            raise LauncherEnvError(
                "RANK and WORLD_SIZE are set, but neither MASTER_ADDR nor LOCAL_WORLD_SIZE says where rank 0 runs",
                variable="MASTER_ADDR",
                value=None,
                launcher=v.launcher,
                fix="export MASTER_ADDR=<rank 0's host> (127.0.0.1 when every rank runs on this machine)",
            )


def _framework_child(environ: Mapping[str, str]) -> LauncherEnvError:
    """``WORLD_SIZE`` and ``LOCAL_RANK`` without ``RANK``: how Lightning's ``devices=N``
    self-launch starts its extra ranks.  A script that calls ``init_distributed()`` before
    ``Trainer``/``Fabric`` would otherwise form a group Lightning does not know about."""
    return LauncherEnvError(
        f"WORLD_SIZE={environ.get('WORLD_SIZE')} and LOCAL_RANK={environ.get('LOCAL_RANK')} are set but RANK is not: "
        "a framework started this process (Lightning's devices=N self-launch does exactly this) after "
        "cpuddp.init_distributed() ran in its parent",
        variable="RANK", value=None, launcher="a framework's own launch (Lightning devices=N?)",
        fix="with Lightning/Fabric do not call cpuddp.init_distributed() before Trainer/Fabric in a plain `python` "
        "run: pass strategy=cpuddp.lightning.trainer_strategy() (Fabric: fabric_strategy()), which forms cpuddp's "
        "group in every rank Lightning starts; or start the ranks with torchrun --nproc-per-node N / mpiexec -n N",
    )


#: The built-in readers, in the order :mod:`cpuddp.launchers` registers them.
BUILTIN_READERS: tuple[tuple[str, LauncherReader], ...] = (
    ("torchrun", TorchrunReader()),
    ("hydra", HydraReader()),
    ("pmix", PmixReader()),
    ("openmpi", OpenMPIReader()),
    ("mvapich", MvapichReader()),
    ("slurm", SlurmReader()),
    ("env", PlainEnvReader()),
)
