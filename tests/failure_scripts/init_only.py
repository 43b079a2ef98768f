"""Call ``cpuddp.init_distributed()`` with the environment as given; print OK on success.

Usage: python init_only.py [BACKEND].  Prints ``READY <unix time>`` (stdout) just before the
call, so the caller can time it.  It does not import torch first -- a malformed environment
should be reported before anything heavy is loaded -- unless ``IMPORT_TORCH_FIRST=1`` (the
cases that must wait for a timeout are timed from after the import, as in a training script).
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("IMPORT_TORCH_FIRST") == "1":
    import torch.distributed  # noqa: F401

import cpuddp

backend = sys.argv[1] if len(sys.argv) > 1 else "auto"
print(f"READY {time.time():.3f}", flush=True)
env = cpuddp.init_distributed(backend, pin=False)
print(f"OK rank {env.rank} of {env.world_size} port {env.master_port}", flush=True)
cpuddp.shutdown()
