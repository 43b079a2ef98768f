"""train: what a training script calls once the group is formed.

Owns: :func:`cpuddp.prepare` and its steps (:mod:`.prepare`; its arguments :mod:`.options`; precision :mod:`.precision`,
optimizer :mod:`.optim`, gradient communication :mod:`.comm`, IPEX :mod:`.ipex`, the DDP wrap
or FSDP2 and ``torch.compile`` :mod:`.distribute`; sharding :mod:`.shard` (FSDP2) and
:mod:`.zero` (``shard="optimizer"``; its plan :mod:`.zero_plan`, state dicts :mod:`.zero_dicts`,
agreements :mod:`.zero_sync`)), the gradient helpers for every
mode (:mod:`.grads`: ``clip_grad_norm_``, ``no_sync``), the loop
helpers (:mod:`.loop`: autocast, metrics, the model's state dict; sharding data and its
position :mod:`.data`), checkpoints (a file written atomically :mod:`.checkpoint`, a
directory :mod:`.ckpt_dirs`, whose checkpoints :mod:`.ckpt_index`, one writer
:mod:`.ckpt_lock`, safe places and full disks :mod:`.paths`, rank 0's I/O
:mod:`.rank0`), the training checkpoint (:mod:`.resume`, :mod:`.resume_io`, random state
:mod:`.rng`) and :class:`cpuddp.Progress` (:mod:`.progress`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._compat`, :mod:`cpuddp._units`,
:mod:`cpuddp._package`, :mod:`cpuddp.topology`, :mod:`cpuddp.affinity`, :mod:`cpuddp.ranks`.
"""
