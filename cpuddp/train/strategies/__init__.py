"""train.strategies: one object per ``shard=`` mode, chosen once by :func:`cpuddp.prepare`.

Owns: prepare's arguments, typed and checked once (:mod:`.options`: ``PrepareOptions``), the
``shard=`` string turned into a strategy -- the one lookup -- and a prepared model's strategy
asked back, with the one fallback for a model cpuddp did not prepare (:mod:`.modes`), the
interface and the undoing of the wraps (:mod:`.base`: ``Strategy``, ``unwrap``), and the
strategies: DDP with its gradient hook (:mod:`.ddp`), what the sharded ones share
(:mod:`.sharded`), ``shard="optimizer"`` over :mod:`cpuddp.train.sharding.zero` (:mod:`.zero`) and
``shard="full"`` over FSDP2 (:mod:`.fsdp`).  Each owns its option checks, its wrap, ``no_sync``,
gradient clipping, what :func:`cpuddp.prepared_info` says of it and how its model's state is
saved and loaded.
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.ranks`, :mod:`cpuddp.train.common`,
:mod:`cpuddp.train.precision`, :mod:`cpuddp.train.sharding`.
"""
