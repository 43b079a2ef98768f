"""``cpuddp.shm``: the shared-memory backend's public door.

Use::

    import cpuddp
    cpuddp.init_distributed(backend="shm")          # or backend="auto" (see docs/backends.md)

    import cpuddp.shm                                # registers "shm" with torch.distributed
    torch.distributed.init_process_group("shm")      # plain torch, no pinning (frameworks: docs/frameworks.md)

Importing this module imports torch and registers the backend with
``torch.distributed.Backend`` (idempotent); ``import cpuddp`` alone does not.  The group itself
and how it works are in :mod:`cpuddp.backends.shm` (docstring of
:mod:`cpuddp.backends.shm.group`).
"""

from .backends.shm.group import INTER_VAR, NAME, ShmProcessGroup, eligibility, register
from .backends.shm.path import SUPPORTED_DTYPES

__all__ = ["NAME", "ShmProcessGroup", "register", "eligibility", "SUPPORTED_DTYPES", "INTER_VAR"]
