"""Slurm's ``srun`` tasks: ``SLURM_PROCID``, ``SLURM_NTASKS``, the node list, the tasks per node, ...

A batch script or ``salloc`` shell (no ``SLURM_STEP_ID``) is a single process, and says why.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

from cpuddp.errors import LauncherEnvError

from .env import Provenance
from .parsers import expand_nodelist, expand_tasks_per_node
from .readers import LauncherReader, PartialEnv, Variables

log = logging.getLogger("cpuddp")

__all__ = ["SlurmReader"]


class SlurmReader(LauncherReader):
    """Slurm's ``srun`` tasks; a batch script (no ``SLURM_STEP_ID``) is a single process."""

    description = "Slurm srun"
    mpi_world = True

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
        out = v.world("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", fix=fix)
        out.local_rank = v.int("SLURM_LOCALID", fix=fix, into="local_rank")
        out.node_rank = v.int("SLURM_NODEID", fix=fix, into="node_rank")
        out.num_nodes = v.maybe_int("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", minimum=1)
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
