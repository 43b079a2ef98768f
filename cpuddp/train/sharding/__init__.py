"""train.sharding: how the model is spread over the ranks -- DDP, ``shard="optimizer"``, ``shard="full"``.

Owns: prepare's arguments, typed and checked once (:mod:`.options`: ``PrepareOptions``), the wrap
prepare ends with and its undoing (:mod:`.distribute`: DDP and its gradient hook, FSDP2,
``torch.compile``, ``unwrap``), ``shard="full"`` on FSDP2 and the one check of what is sharded
(:mod:`.shard`), ``shard="optimizer"``: the hooks and the step (:mod:`.zero`), the shard plan
(:mod:`.zero_plan`), the whole state dicts (:mod:`.zero_dicts`), what the ranks agree on
(:mod:`.zero_sync`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.ranks`, :mod:`cpuddp.train.common`,
:mod:`cpuddp.train.precision`.
"""
