"""A small all-reduce loop in which one rank dies at a given step.

Environment: ``VICTIM`` (rank that dies, default 1), ``MODE`` (``kill``: SIGKILL itself;
``stop``: SIGSTOP itself, a hung rank; ``raise``: ValueError; ``exit``: ``os._exit(3)``),
``DIE_AT`` (step, default 10), ``STEPS`` (default 400).  Each rank prints ``PID <rank> <pid>``
first (to map a launcher's PID-only message to a rank); the victim prints
``DYING <rank> <unix time>`` just before.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import cpuddp
from cpuddp.watchdog import monitor as watchdog

env = cpuddp.init_distributed(pin=False)
if not watchdog.running():  # until init_distributed starts it itself
    from cpuddp import distributed as _d

    watchdog.start(env, _d._store)
print(f"PID {env.rank} {os.getpid()}", flush=True)

victim = int(os.environ.get("VICTIM", "1"))
mode = os.environ.get("MODE", "kill")
die_at = int(os.environ.get("DIE_AT", "10"))
x = torch.ones(1024)
for step in range(int(os.environ.get("STEPS", "400"))):
    dist.all_reduce(x)
    x.fill_(1.0)
    if step == die_at and env.rank == victim:
        print(f"DYING {env.rank} {time.time():.3f}", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "stop":  # hung: alive, but neither computing nor answering
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "exit":
            os._exit(3)
        raise ValueError(f"bad batch at step {step}")
    time.sleep(0.01)
print(f"FINISHED {env.rank}", flush=True)
cpuddp.shutdown()
