"""train.sharding: the machinery that spreads a model over the ranks -- ``shard="optimizer"`` and ``shard="full"``.

Owns: ``shard="full"`` on FSDP2 -- blocks, mesh, the checks of the model and optimizer, the
optimizer rebound (:mod:`.shard`) -- and ``shard="optimizer"``: the hooks and the step
(:mod:`.zero`), the shard plan (:mod:`.zero_plan`), the gradient norm (:mod:`.zero_norm`), the
whole state dicts (:mod:`.zero_dicts`), what the ranks agree on (:mod:`.zero_sync`).  Which mode a
model runs, the DDP wrap and prepare's options are :mod:`cpuddp.train.strategies`' (above).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.ranks`, :mod:`cpuddp.backends.types` (what a backend can do).
"""
