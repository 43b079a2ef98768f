"""backends.shm.python: the node-local data path in Python, over the segment protocol -- the
fallback where the native library does not load, and the reference its bits are checked against.

Owns: the node's collectives in rounds (:mod:`.local`); its all_reduce in two levels over NUMA
nodes (:mod:`.levels`, the plan :mod:`.numa_plan`); reduce ops in rank order and the staging of
tensors of any layout (:mod:`.ops`); sparse COO all_reduce (:mod:`.sparse`).  The segment's
numbers it reads from layout.h's reader, not from the native binding.
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.topology`, :mod:`cpuddp.backends.shm.protocol`,
:mod:`cpuddp.backends.shm.native.layout`
"""
