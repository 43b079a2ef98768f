"""MVAPICH2's ``mpirun_rsh``/``mpiexec``: ``MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``."""

from __future__ import annotations

from .readers import WorldReader

__all__ = ["MvapichReader"]


class MvapichReader(WorldReader):
    description = "MVAPICH2"
    mpi_world = True
    rank_variable = "MV2_COMM_WORLD_RANK"
    size_variable = "MV2_COMM_WORLD_SIZE"
    job_variables = ("MPIRUN_ID",)
    local_variables = (("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",))
    fix = "launch with MVAPICH2 `mpirun_rsh`/`mpiexec`, which sets MV2_COMM_WORLD_RANK and _SIZE"
