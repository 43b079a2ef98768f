"""train: what a training script calls once the group is formed.

Owns: :func:`cpuddp.prepare` and its steps (:mod:`.prepare`; precision :mod:`.precision`,
optimizer :mod:`.optim`, gradient communication :mod:`.comm`, IPEX :mod:`.ipex`; sharding
:mod:`.shard` (FSDP2) and :mod:`.zero` (``shard="optimizer"``)), the gradient helpers for every
mode (:mod:`.grads`: ``clip_grad_norm_``, ``no_sync``), the loop
helpers (:mod:`.loop`: sharding, autocast, metrics, rank-0 I/O; checkpoints :mod:`.checkpoint`)
and :class:`cpuddp.Progress` (:mod:`.progress`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._compat`, :mod:`cpuddp.topology`,
:mod:`cpuddp.affinity`, :mod:`cpuddp.ranks`.
"""
