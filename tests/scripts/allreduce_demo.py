"""Run by the launcher tests: init, check an all_reduce, report as one JSON line per rank."""

import json
import os
import sys

import torch
import torch.distributed as dist

import cpuddp

env = cpuddp.init_distributed(timeout=60)
t = torch.full((8,), float(env.rank + 1))
dist.all_reduce(t)
expected = env.world_size * (env.world_size + 1) / 2
out = os.environ.get("CPUDDP_RESULT_DIR")
row = (
    json.dumps(
        {
            "rank": env.rank,
            "world_size": env.world_size,
            "local_rank": env.local_rank,
            "local_world_size": env.local_world_size,
            "node_rank": env.node_rank,
            "launcher": env.launcher,
            "backend": env.backend,
            "allreduce_ok": bool(torch.all(t == expected)),
            "exported": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
            "affinity": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "same_env_twice": cpuddp.init_distributed() is env,
        }
    )
)
if out:  # one file per rank: launchers interleave the ranks' stdout
    with open(os.path.join(out, f"rank{env.rank}.json"), "w") as f:
        f.write(row)
else:
    print(row, flush=True)
cpuddp.shutdown()
sys.exit(0)
