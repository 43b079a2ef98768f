"""train: what a training script calls once the group is formed.

Owns: :func:`cpuddp.prepare` as a list of named steps (:mod:`.prepare`), the loop helpers
(:mod:`.loop`: autocast, metrics, the model's state dict), the gradient helpers for every
``shard=`` mode (:mod:`.grads`: ``clip_grad_norm_``, ``no_sync``), :class:`cpuddp.Progress`
(:mod:`.progress`, with :mod:`.tty_lines`: other output ends its bar's line first); and, in
subpackages, bottom first: what the rest stands on
(:mod:`.common`: rank 0's I/O, object collectives, each rank's places, the data sharding, the
gradient hooks), the arithmetic (:mod:`.precision`: bf16, the trial, IPEX, the fused optimizer),
the sharding machinery (:mod:`.sharding`: FSDP2, ``shard="optimizer"``'s ZeRO), one strategy per
``shard=`` mode with prepare's options (:mod:`.strategies`: DDP, ZeRO, FSDP2 -- the wrap,
``no_sync``, clipping, the state a checkpoint takes) and the training checkpoint
(:mod:`.checkpoint`: ``save``, ``load``).  A subpackage imports only those below it;
the modules at the top import any.
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.launchers.report`, :mod:`cpuddp._compat`, :mod:`cpuddp._units`,
:mod:`cpuddp._package`, :mod:`cpuddp.topology`, :mod:`cpuddp.affinity`, :mod:`cpuddp.ranks`,
:mod:`cpuddp.backends.types`.
"""
