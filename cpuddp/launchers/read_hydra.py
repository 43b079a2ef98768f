"""Intel MPI's and MPICH's Hydra (``mpiexec``): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ...

``srun --mpi=pmi2`` sets the PMI variables too: :func:`slurm_pmi` tells those apart, and the
Slurm reader describes such a task.
"""

from __future__ import annotations

from typing import Mapping

from .readers import WorldReader

__all__ = ["HydraReader", "slurm_pmi"]


def slurm_pmi(environ: Mapping[str, str]) -> bool:
    """True when the PMI_* variables are Slurm's own (``srun --mpi=pmi2`` sets PMI_RANK, PMI_SIZE,
    PMI_FD and PMI_JOBID=<job>.<step>): Slurm launched this task and its reader describes it
    fully (node list, tasks per node), where Hydra's would lack the local size."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    return bool(job and step) and environ.get("PMI_JOBID", "").strip() == f"{job}.{step}"


class HydraReader(WorldReader):
    description = "Intel MPI / MPICH (Hydra)"
    mpi_world = True
    rank_variable = "PMI_RANK"
    size_variable = "PMI_SIZE"
    job_variables = ("I_MPI_HYDRA_UUID", "PMIX_NAMESPACE")
    # Older Hydra and PMI-2 launchers (srun --mpi=pmi2) give no local rank of their own.
    local_variables = (("MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"), ("MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"))
    fix = "launch with Intel MPI or MPICH `mpiexec -n N python ...`, which sets PMI_RANK and PMI_SIZE"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return super().detect(environ) and not slurm_pmi(environ)
