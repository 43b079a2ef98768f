"""Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE,NODE_RANK}``."""

from __future__ import annotations

from typing import Mapping

from .readers import PartialEnv, WorldReader

__all__ = ["OpenMPIReader"]


class OpenMPIReader(WorldReader):
    description = "Open MPI"
    mpi_world = True
    rank_variable = "OMPI_COMM_WORLD_RANK"
    size_variable = "OMPI_COMM_WORLD_SIZE"
    job_variables = ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid")
    local_variables = (("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",))
    fix = "launch with Open MPI `mpirun -n N python ...`, which sets OMPI_COMM_WORLD_RANK and _SIZE"

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        out = super().read(environ)
        # OMPI_COMM_WORLD_NODE_RANK is this process's rank among all processes on the node (across
        # jobs), not the node index: validate it, never use it as node_rank.
        self.variables(environ).maybe_int("OMPI_COMM_WORLD_NODE_RANK")
        return out
