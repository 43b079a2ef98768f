"""Run by tests/test_slurm.py under a real srun/sbatch/salloc: cpuddp.init_distributed(), a short
DDP loop, and one JSON file per rank (``rank<N>.json`` in the directory given as argv[1]).

Options (argv[2:]): ``--die RANK:STEP`` makes that rank SIGKILL itself before that step (a task
killed mid-run); ``--steps N`` (default 5).  The ranks check that they agree: the final
parameters' checksum is all-gathered, and every rank records what it saw.
"""

import argparse
import json
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist

import cpuddp

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("--die", default="")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()
die_rank, die_step = (int(x) for x in args.die.split(":")) if args.die else (-1, -1)

affinity_before = sorted(os.sched_getaffinity(0))
env = cpuddp.init_distributed(timeout=float(os.environ.get("TEST_TIMEOUT", "60")))
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1000 + env.rank)  # each rank its own data
for step in range(args.steps):
    if env.rank == die_rank and step == die_step:
        sys.stderr.write(f"rank {env.rank}: killing myself (SIGKILL) before step {step}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
checksum = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))], dtype=torch.float64)
gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(env.world_size)]
dist.all_gather(gathered, checksum)
plan = cpuddp.get_session().pin_plan
row = {
    "rank": env.rank,
    "world_size": env.world_size,
    "local_rank": env.local_rank,
    "local_world_size": env.local_world_size,
    "node_rank": env.node_rank,
    "num_nodes": env.num_nodes,
    "launcher": env.launcher,
    "backend": cpuddp.get_session().backend,
    "master_addr": env.master_addr,
    "master_port": env.master_port,
    "hostname": socket.gethostname(),
    "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
    "slurm_cpu_bind": os.environ.get("SLURM_CPU_BIND"),
    "pmi_rank": os.environ.get("PMI_RANK"),
    "affinity_before": affinity_before,
    "affinity": sorted(os.sched_getaffinity(0)),
    "plan_cpus": list(plan.cpus) if plan else None,
    "plan_reason": plan.reason if plan else None,
    "threads": torch.get_num_threads(),
    "checksums": [float(t.item()) for t in gathered],
}
with open(os.path.join(args.outdir, f"rank{env.rank}.json"), "w") as f:
    json.dump(row, f)
print(f"rank {env.rank}/{env.world_size} on {socket.gethostname()}: ok", flush=True)
cpuddp.shutdown()
