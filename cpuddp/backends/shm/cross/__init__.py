"""backends.shm.cross: a shm group across nodes -- shared memory inside each node, a leg between
them.

Owns: the hierarchy, each collective's node part and leg, on the Python engine
(:mod:`.hierarchy`) and on the native data path (:mod:`.native_hier`), whose small all_reduce and
barrier also go straight from torch's call (:mod:`.direct`); the legs' groups, formed
over gloo, oneCCL or MPI (:mod:`.legs`); the MPI leg itself, through mpi4py: a communicator's byte
collectives, waited for and agreed (:mod:`.mpi_comm`), and the process-group methods over them
with every reduction ours, in rank order (:mod:`.mpi_group`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.backends.shm.api` (the lost-rank check), :mod:`cpuddp.launchers.hosts` (the legs' agreement),
:mod:`cpuddp.launchers.mpi` (MPI's start and world), :mod:`cpuddp.backends.types` (the leg's object),
:mod:`cpuddp.backends.shm.protocol`,
:mod:`cpuddp.backends.shm.python`, :mod:`cpuddp.backends.shm.routes`
"""
