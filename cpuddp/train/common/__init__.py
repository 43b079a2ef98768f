"""train.common: what the other parts of train stand on.

Owns: rank 0 does the file work and every rank gets the outcome (bytes broadcast and gathered as
tensors, :mod:`.rank0`), torch's object collectives without numpy (:mod:`.objects`), each rank's
host, CPUs and threads (:mod:`.layout`), the per-rank data sharding and its position
(:mod:`.data`: ``cpuddp.shard``, ``ShardedLoader``), and the ``comm_hook`` argument with its DDP
hooks (:mod:`.comm`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.ranks`, :mod:`cpuddp.topology`, :mod:`cpuddp.affinity`.
"""
