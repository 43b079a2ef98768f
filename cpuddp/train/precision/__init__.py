"""train.precision: the model's arithmetic and its optimizer on this CPU.

Owns: does this CPU compute bf16 natively, the precision decision and the autocast hooks
(:mod:`.bf16`), ``mixed_precision="auto"``'s timed trial (:mod:`.precision_trial`), IPEX behind
``_compat``'s rule (:mod:`.ipex`), the fused-optimizer decision and IPEX's optimize (:mod:`.optim`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp._compat`, :mod:`cpuddp.ranks`, :mod:`cpuddp.topology`.
"""
