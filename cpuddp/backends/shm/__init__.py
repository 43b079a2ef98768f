"""backends.shm: cpuddp's shared-memory process group for the ranks of one node.

Owns: the ``shm`` backend, in rooms that are its layers, bottom first (each imports only the
rooms below it, and the two doors here):

* :mod:`.native` -- the node-local data path in C: the library, its build, its binding, the
  path a node agrees on;
* :mod:`.protocol` -- the segment protocol: whether shm can run here and the segment's layout
  (:mod:`.protocol.check`), which ranks share the node, the segment and its hand-over, the
  per-call agreement, waiting for the node's peers, the channel that holds it all;
* :mod:`.python` -- the node-local data path in Python (the fallback and the reference), its
  reduce ops and staging, its NUMA levels, sparse all_reduce;
* :mod:`.routes` -- the route a group's collectives take (Python, native, across nodes, the
  world), where they run (the caller's thread, the communication thread, the native progress
  thread), argument forms and size checks;
* :mod:`.cross` -- across nodes: the hierarchy (shared memory inside each node, the leg between
  them) and the legs' groups;
* :mod:`.group` -- the process group torch sees, its collectives and send/recv.

The doors: :mod:`.api`, what the session asks without torch (the group's options, the
lifecycle hooks), and :mod:`.backend`, the backend as the pipeline sees it.
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._units`, :mod:`cpuddp.launchers`, :mod:`cpuddp.topology`,
:mod:`cpuddp.affinity.pin` (the forming thread on the rank's CPUs), :mod:`cpuddp.backends.types` (the
backend interface, and the leg's object) and :mod:`cpuddp.backends.auto` (the leg's rule).

Importing this package imports nothing: :mod:`cpuddp.backends` asks :mod:`.protocol.check`
without torch.  Users import the door, :mod:`cpuddp.shm`.
"""
