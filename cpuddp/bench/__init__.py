"""bench: ``cpuddp bench``, collective bandwidth sweeps reported the way nccl-tests reports them.

Owns: the command line and where a run goes (:mod:`.cli`), a run's settings as one frozen
config (:mod:`.config`), the nccl-tests arithmetic, pure (:mod:`.sweep`: sizes, bus factors,
rows, summary, exit code), the text table, CSV, JSON and plots (:mod:`.report`), the work
inside one rank (:mod:`.rank`: timing, collectives, checks) and ``--nproc`` (:mod:`.launch`).
Usage and columns: :mod:`.cli`'s docstring.
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._units`, :mod:`cpuddp._compat`,
:mod:`cpuddp.topology`, :mod:`cpuddp.launchers`, :mod:`cpuddp.backends`,
:mod:`cpuddp.distributed`, :mod:`cpuddp._procs`.
"""
