"""backends.shm: cpuddp's shared-memory process group for the ranks of one node.

Owns: whether it can run here and the segment's layout, pure and light (:mod:`.check`); the
group's options and lifecycle hooks, without torch (:mod:`.api`); which ranks share the node
(:mod:`.node`) and the plan over its NUMA nodes (:mod:`.numa_plan`); the node's segment, each
rank's slots on its own NUMA node (:mod:`.segment`; where the pages are: :mod:`.placement`), and
its hand-over from local rank 0 (:mod:`.handover`); the per-call agreement (:mod:`.descriptor`);
waiting for the node's peers (:mod:`.wait`); the node-local data path in Python (:mod:`.local`; its
all_reduce in two levels over NUMA nodes: :mod:`.levels`) and in C (:mod:`.native`: the library,
its binding and build, the path a node agrees on; its routes: :mod:`.direct`, one call from
torch's, and :mod:`.progress`, the progress thread) and the leg across nodes
(:mod:`.cross`); where collectives run (:mod:`.stream`); argument forms and size checks
(:mod:`.call_args`), reduce ops and staging (:mod:`.ops`), sparse all_reduce (:mod:`.sparse`) and
send/recv (:mod:`.p2p`); the collectives torch calls (:mod:`.calls`), the route they take, chosen
once per group (:mod:`.route`: :mod:`.route_node`, :mod:`.route_native`), and the process group
(:mod:`.group`, which imports torch and registers ``"shm"``).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._units`, :mod:`cpuddp.launchers`, :mod:`cpuddp.topology`,
:mod:`cpuddp.affinity.pin` (the forming thread on the rank's CPUs), :mod:`cpuddp.backends.types` (the
backend interface, and the leg's object) and :mod:`cpuddp.backends.auto` (the leg's rule).

Importing this package imports nothing: :mod:`cpuddp.backends` asks :mod:`.check` without
torch.  Users import the door, :mod:`cpuddp.shm`.
"""
