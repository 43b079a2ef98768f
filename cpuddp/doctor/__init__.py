"""doctor: ``cpuddp doctor``, what cpuddp sees here, what it would do, and what looks wrong.

Owns: the command (:mod:`.command`), the probes that gather the facts (:mod:`.collect`), the
pure rules over them (:mod:`.diagnose`) and the readable report (:mod:`.text`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._compat`, :mod:`cpuddp.topology`,
:mod:`cpuddp.launchers`, :mod:`cpuddp.affinity`, :mod:`cpuddp.backends`.
"""
