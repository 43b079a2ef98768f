"""backends.shm.cross: a shm group across nodes -- shared memory inside each node, a leg between
them.

Owns: the hierarchy, each collective's node part and leg, and the cross group formed by the
leg's backend object (:mod:`.hierarchy`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.backends.types` (the leg's object),
:mod:`cpuddp.backends.shm.protocol`, :mod:`cpuddp.backends.shm.python`, :mod:`cpuddp.backends.shm.routes`
"""
