"""Form the group, report where it met, keep it busy until released, then leave.

Prints ``JOINED {json}`` per rank (rank, world size, launcher, job id, rendezvous address and
port, GLOO_SOCKET_IFNAME, pid), then all-reduces every 0.1 s -- checking the sum is the world
size, which a stranger in the group would break -- until the file ``RELEASE_FILE`` exists or
``HOLD`` seconds (default 60) pass (decided together, so all ranks stop at the same step), and
prints ``DONE <rank>``.  ``HOLD_BACKEND`` names the backend (default auto).  With ``LISTEN_DIR`` set, each
rank writes ``listen<rank>.json``: its listening TCP sockets once the group is up.  With
``FAIL_DIR`` set, a rank whose ``init_distributed()`` fails prints its error, then waits (up to
30 s) until ``FAIL_PEERS`` ranks of its job have failed before it exits: a launcher that ends the
job when its first rank exits (Open MPI) would otherwise cut a slower rank's message short.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import cpuddp


def _fail_together() -> None:
    """Print this rank's error; wait for FAIL_PEERS ranks' failures in FAIL_DIR (30 s at most)."""
    import traceback

    traceback.print_exc()  # called in the except block
    sys.stderr.flush()
    fail_dir = os.environ["FAIL_DIR"]
    with open(os.path.join(fail_dir, f"failed-{os.getpid()}"), "w"):
        pass
    end = time.monotonic() + 30.0
    while len(os.listdir(fail_dir)) < int(os.environ["FAIL_PEERS"]) and time.monotonic() < end:
        time.sleep(0.05)
    sys.exit(1)


try:
    env = cpuddp.init_distributed(os.environ.get("HOLD_BACKEND", "auto"), pin=False)
except Exception:
    if not os.environ.get("FAIL_DIR"):
        raise
    _fail_together()
x = torch.ones(1)
dist.all_reduce(x)  # gloo's connections are all up after the first collective
listen_dir = os.environ.get("LISTEN_DIR")
if listen_dir:
    import psutil

    socks = [[c.laddr.ip, c.laddr.port] for c in psutil.Process().net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN]
    path = os.path.join(listen_dir, f"listen{env.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": env.rank, "pid": os.getpid(), "listening": socks}, f)
    os.replace(path + ".tmp", path)
info = dict(rank=env.rank, world_size=env.world_size, launcher=env.launcher, job_id=env.job_id,
            master_addr=env.master_addr, master_port=env.master_port,
            gloo_socket_ifname=os.environ.get("GLOO_SOCKET_IFNAME"), pid=os.getpid())
print("JOINED " + json.dumps(info), flush=True)
release = os.environ.get("RELEASE_FILE", "")
end = time.monotonic() + float(os.environ.get("HOLD", "60"))
while True:
    # [1, stop?]: every rank learns in the same step whether any rank was told to stop
    stop = time.monotonic() >= end or bool(release and os.path.exists(release))
    x = torch.tensor([1.0, float(stop)])
    dist.all_reduce(x)
    assert int(x[0].item()) == env.world_size, f"all_reduce gave {x[0].item()}, expected {env.world_size}"
    if x[1].item() > 0:
        break
    time.sleep(0.1)
print(f"DONE {env.rank}", flush=True)
cpuddp.shutdown()
