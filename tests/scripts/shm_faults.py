"""One rank of a tests/test_shm_faults.py scenario, as a plain torch.distributed program.

``python shm_faults.py MODE OUTDIR`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (rank 0
hosts the TCPStore); writes ``OUTDIR/rank<r>.json``.  Modes:

* ``peer_dies``: rank 1 (started by the test in its own PID namespace) dies (``os._exit``) after one
  allreduce; rank 0's next allreduce must fail within seconds, naming the death.
* ``dies_mapping``: rank 1 dies (os._exit) right when it would fetch the segment from local
  rank 0: rank 0's init must fail within seconds, naming the death.
* ``slow_mapping``: rank 1 takes a second to map the segment it received; rank 0's first
  allreduce must wait for it, never call it dead (it holds no liveness lock yet while mapping).
* ``attacked``: form the group, then DDP's initial broadcast, a broadcast, an all_gather, a
  barrier and 200 allreduces, each checked, while another local user
  (tests/scripts/shm_intruder.py) writes false offers, gloo addresses and host records into the
  store and knocks on the hand-over socket; each rank reports what it got or the error it raised.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import cpuddp.backends.shm.protocol.handover as handover
import cpuddp.shm  # noqa: F401  -- registers "shm" with torch.distributed
from cpuddp.topology.here import pid_namespace

mode, outdir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
report: dict = {"rank": rank, "pid_ns": pid_namespace()}


def done() -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # a peer may be dead: no teardown that could wait for it


def attempt(key: str, fn) -> None:
    start = time.monotonic()
    try:
        fn()
        report[key] = "ok"
    except Exception as exc:  # noqa: BLE001 -- the test reads the message
        report[key] = f"{type(exc).__name__}: {exc}"
    report[f"{key}_seconds"] = time.monotonic() - start


if mode == "dies_mapping" and rank == 1:
    def _die(*_a, **_k):
        os._exit(17)  # a crash at the moment the segment would be fetched
    handover._fetch = _die

if mode == "slow_mapping" and rank == 1:
    class _SlowSegment(handover.Segment):
        def __init__(self, *a, **k):
            time.sleep(1.0)  # a loaded node: mapping takes ten of the peers' liveness checks
            super().__init__(*a, **k)
    handover.Segment = _SlowSegment

timeout = datetime.timedelta(seconds=60)
attempt("init", lambda: dist.init_process_group("shm", timeout=timeout))
if report["init"] != "ok":
    done()

if mode == "peer_dies":
    attempt("first", lambda: dist.all_reduce(torch.ones(1000)))
    if rank == 1:
        time.sleep(0.5)
        os._exit(9)  # under unshare --pid it is PID 1 of its namespace, which ignores its own SIGKILL
    time.sleep(1.0)
    attempt("second", lambda: dist.all_reduce(torch.ones(1000)))
    done()

if mode == "slow_mapping":
    t = torch.full((1000,), float(rank + 1))
    attempt("first", lambda: dist.all_reduce(t))
    report["sum"] = t[0].item()
    done()

if mode == "attacked":
    got = []

    def check(what: str, ok: bool, value) -> None:
        if not ok:
            raise AssertionError(f"WRONG RESULT in {what}: {value}")

    def loop() -> None:
        n = dist.get_world_size()
        torch.manual_seed(rank)  # different initial weights on each rank: DDP must broadcast rank 0's
        model = torch.nn.Linear(64, 64)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.manual_seed(0)
        want = torch.cat([p.detach().reshape(-1) for p in torch.nn.Linear(64, 64).parameters()])
        check("DDP's initial broadcast", torch.equal(flat, want), flat.sum().item())
        b = torch.arange(1000) if rank == 0 else torch.zeros(1000, dtype=torch.int64)
        dist.broadcast(b, src=0)
        check("broadcast", b.sum().item() == 499500, b.sum().item())
        parts = [torch.zeros(100) for _ in range(n)]
        dist.all_gather(parts, torch.full((100,), float(rank)))
        check("all_gather", all(torch.equal(p, torch.full((100,), float(r))) for r, p in enumerate(parts)), parts)
        dist.barrier()
        ddp(torch.randn(8, 64)).sum().backward()
        for i in range(200):
            t = torch.full((257,), float(rank + 1 + i))
            dist.all_reduce(t)
            got.append(t[0].item())
            check(f"all_reduce {i}", t[0].item() == 3.0 + 2 * i and torch.equal(t, torch.full((257,), t[0].item())),
                  t[:4].tolist())

    attempt("loop", loop)
    report["calls"] = len(got)
    report["shm_calls"] = dist.group.WORLD.shm_calls  # 0: every call went over gloo's sockets
    done()
done()
done()
