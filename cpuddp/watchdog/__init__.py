"""watchdog: naming the rank that was lost when a job fails.

Owns: the per-rank monitor thread and its hooks (:mod:`.monitor`), the store protocol it
speaks with its peers (:mod:`.store`), and its decisions, pure (:mod:`.verdict`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.topology.here`, :mod:`cpuddp.launchers`, :mod:`cpuddp.backends` (its
lifecycle hooks).
"""
