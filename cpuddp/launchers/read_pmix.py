"""A PMIx launcher that is neither Open MPI nor Slurm: ``PMIX_RANK``, with the sizes exported.

PMIx keeps the job's size behind its API, so ``WORLD_SIZE`` (and the local rank and size)
must be exported.  Open MPI and Slurm set ``PMIX_RANK`` too, and their readers describe their
tasks: this one steps aside when their variables are present.
"""

from __future__ import annotations

from typing import Mapping

from .readers import WorldReader

__all__ = ["PmixReader"]


class PmixReader(WorldReader):
    description = "PMIx"
    mpi_world = True
    rank_variable = "PMIX_RANK"
    shared_rank_variable = True
    size_variable = "WORLD_SIZE"
    job_variables = ("PMIX_NAMESPACE",)
    local_variables = (("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",))
    size_fix = ("PMIx keeps the job size behind its API: export WORLD_SIZE (and LOCAL_RANK, LOCAL_WORLD_SIZE), "
                "or launch with Open MPI mpirun / srun, which set the sizes")

    def detect(self, environ: Mapping[str, str]) -> bool:
        v = self.variables(environ)
        return v.has("PMIX_RANK") and not v.has("OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
