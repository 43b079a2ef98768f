"""MPI_Init through the MPI library named in argv[1] (ctypes: no compiler, no mpi4py), an
MPI_Allreduce of rank+1, and one JSON line on stdout.  Run by tests/test_slurm.py under
``srun --mpi=pmi2`` to show that MPICH's and Intel MPI's PyPI wheels find Slurm's PMI-2.

MPICH and Intel MPI share the MPICH ABI: the handles below are its constants.
"""

import ctypes
import json
import sys

MPI_COMM_WORLD = 0x44000000
MPI_INT = 0x4C000405
MPI_SUM = 0x58000003

mpi = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
assert mpi.MPI_Init(None, None) == 0, "MPI_Init failed"
rank, size = ctypes.c_int(), ctypes.c_int()
mpi.MPI_Comm_rank(MPI_COMM_WORLD, ctypes.byref(rank))
mpi.MPI_Comm_size(MPI_COMM_WORLD, ctypes.byref(size))
send, recv = ctypes.c_int(rank.value + 1), ctypes.c_int(0)
assert mpi.MPI_Allreduce(ctypes.byref(send), ctypes.byref(recv), 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD) == 0
version = ctypes.create_string_buffer(8192)
length = ctypes.c_int()
mpi.MPI_Get_library_version(version, ctypes.byref(length))
print(json.dumps({"rank": rank.value, "size": size.value, "sum": recv.value,
                  "library": version.value.decode(errors="replace").splitlines()[0].strip()}), flush=True)
mpi.MPI_Finalize()
