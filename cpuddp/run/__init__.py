"""run: ``cpuddp run``, size, pin and launch a training job.

Owns: the command (:mod:`.command`), the plan of ranks and CPUs, pure (:mod:`.plan`), the
runtime settings each rank gets (:mod:`.settings`), the launcher command line (:mod:`.launch`)
and the rank side (:mod:`.rank`, run as ``python -m cpuddp.run.rank`` under torchrun).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.topology`, :mod:`cpuddp.launchers`,
:mod:`cpuddp.affinity`.
"""
