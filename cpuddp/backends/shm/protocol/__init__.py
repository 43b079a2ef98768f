"""backends.shm.protocol: the shm group's segment protocol -- how the ranks of a node meet, share
one segment and agree each call, whatever data path moves the bytes.

Owns: whether shm can run here and where the segment's areas lie (:mod:`.check`, by the sizes
of ``native/layout.h``, where every word and number of the segment is defined); which ranks share the
node (:mod:`.node`); the segment, made, checked, mapped and held (:mod:`.segment`; where its pages
are: :mod:`.placement`; what a forked child drops: :mod:`.forks`); its hand-over from local rank
0, every peer checked (:mod:`.handover`, its words :mod:`.offer`); the per-call agreement
(:mod:`.descriptor`); waiting for the node's peers by layout.h's wait policy (:mod:`.wait`); the
channel: the protocol behind one object with one lifecycle state (:mod:`.channel`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._units`, :mod:`cpuddp.launchers`, :mod:`cpuddp.topology`,
:mod:`cpuddp.backends.shm.native`
"""
