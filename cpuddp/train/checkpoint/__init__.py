"""train.checkpoint: the training checkpoint and the files behind it.

Owns: ``save_checkpoint`` (:mod:`.save`), ``load_checkpoint`` and ``list_checkpoints``
(:mod:`.load`), the arguments both take and the format tag (:mod:`.arguments`), the state in and
out of the objects and DCP for sharded models (:mod:`.state_io`), this rank's random state
(:mod:`.rng`), a checkpoint file written atomically (:mod:`.atomic`), a checkpoint directory
(:mod:`.ckpt_dirs`), which checkpoints are ours (:mod:`.ckpt_index`), one writer per directory
(:mod:`.ckpt_lock`), safe places and full disks (:mod:`.paths`).  Whether a model's checkpoint is
one file or a directory every rank writes, its strategy says (:mod:`cpuddp.train.strategies`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.launchers.report`, :mod:`cpuddp._units`, :mod:`cpuddp._package`, :mod:`cpuddp.ranks`,
:mod:`cpuddp.topology`, :mod:`cpuddp.train.common`, :mod:`cpuddp.train.strategies`.
"""
