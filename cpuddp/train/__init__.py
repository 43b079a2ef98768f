"""train: what a training script calls once the group is formed.

Owns: :func:`cpuddp.prepare` and its steps (:mod:`.prepare`; precision :mod:`.precision`,
optimizer :mod:`.optim`, gradient communication :mod:`.comm`, IPEX :mod:`.ipex`), the loop
helpers (:mod:`.loop`: sharding, autocast, metrics, rank-0 I/O; checkpoints :mod:`.checkpoint`)
and :class:`cpuddp.Progress` (:mod:`.progress`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._compat`, :mod:`cpuddp.topology`,
:mod:`cpuddp.affinity`, :mod:`cpuddp.ranks`.
"""
