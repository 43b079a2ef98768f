"""What bare torch does with the same environment: ``init_process_group(BACKEND)`` via env://.

Usage: python bare_torch_init.py [BACKEND]   (default gloo)

Prints ``READY <unix time>`` after importing torch, then OK on success; otherwise torch's own
error -- or nothing, when it hangs (the caller bounds it; torch's default timeout is 30 min).
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"
print(f"READY {time.time():.3f}", flush=True)
dist.init_process_group(backend)
print(f"OK rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
