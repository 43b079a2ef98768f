"""run: ``cpuddp run``, size, pin and launch a training job.

Owns: the command (:mod:`.command`), the host lists (:mod:`.hosts`), the runtime settings
each rank gets (:mod:`.settings`), the launcher command line and the shell line that runs it
(:mod:`.launch`), torchrun as it starts it (:mod:`.agent`), starting the launcher and ending
the output with the root cause (:mod:`.supervise`) and the rank side (:mod:`.rank`, run as
``python -m cpuddp.run.rank`` by every engine: it ends the rank with its launcher, and pins it
under torchrun).  The plan of
ranks and CPUs is :mod:`cpuddp.affinity.job` (``cpuddp doctor`` shows it too).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.topology`, :mod:`cpuddp.launchers`,
:mod:`cpuddp.affinity`, :mod:`cpuddp._procs`.
"""
