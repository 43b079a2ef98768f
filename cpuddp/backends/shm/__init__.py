"""backends.shm: cpuddp's shared-memory process group for the ranks of one node.

Owns: whether it can run here and the segment's layout, pure and light (:mod:`.check`), the
node's ranks and the segment they share (:mod:`.segment`), the per-call agreement
(:mod:`.agree`), the data path and its waiting (:mod:`.path`), and the process group that
torch calls (:mod:`.group`, which imports torch and registers ``"shm"``).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._units`, :mod:`cpuddp.launchers`, :mod:`cpuddp.topology.here`.

Importing this package imports nothing: :mod:`cpuddp.backends` asks :mod:`.check` without
torch.  Users import the door, :mod:`cpuddp.shm`.
"""
