"""backends.shm.group: the ``shm`` process group torch sees.

Owns: the group -- forming it, choosing its route, its lifecycle, registering ``"shm"`` with
torch (:mod:`.process_group`); the collectives torch calls, each handed to the route
(:mod:`.calls`); send/recv between a node's ranks over their sockets (:mod:`.p2p`); which CPUs it
runs on, on which data path (:mod:`.arch`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.launchers`, :mod:`cpuddp.affinity.pin`,
:mod:`cpuddp.backends.shm.api`, :mod:`cpuddp.backends.shm.native`, :mod:`cpuddp.backends.shm.protocol`,
:mod:`cpuddp.backends.shm.python`, :mod:`cpuddp.backends.shm.routes`, :mod:`cpuddp.backends.shm.cross`,
:mod:`cpuddp.backends.types` (how long a teardown lets gloo's workers finish)
"""
