"""``cpuddp.shm``: the shared-memory backend's public door.

Use::

    import cpuddp
    cpuddp.init_distributed(backend="shm")          # or backend="auto" (see docs/backends.md)

    import cpuddp.shm                                # registers "shm" with torch.distributed
    torch.distributed.init_process_group("shm")      # plain torch, no pinning (frameworks: docs/frameworks.md)
    torch.distributed.init_process_group("shm", pg_options=cpuddp.shm.ShmOptions(inter="ccl"))

Importing this module imports torch and registers the backend with
``torch.distributed.Backend`` (idempotent); ``import cpuddp`` alone does not.  The group itself
and how it works are in :mod:`cpuddp.backends.shm` (docstring of
:mod:`cpuddp.backends.shm.group.process_group`).
"""

from .backends.shm.api import INTER_VAR, ShmOptions
from .backends.shm.group.process_group import NAME, ShmProcessGroup, eligibility, register

__all__ = ["NAME", "ShmProcessGroup", "ShmOptions", "register", "eligibility", "INTER_VAR"]
