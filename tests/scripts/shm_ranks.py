"""One rank of a tests/test_shm.py failure scenario, as a plain torch.distributed program.

``python shm_ranks.py MODE OUTDIR`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
writes ``OUTDIR/rank<r>.json``.  Modes:

* ``init_only``: form the shm group; report its reason or the error.
* ``peer_dies``: rank 1 kills itself with SIGKILL; rank 0's allreduce must fail at once.
* ``compare``: every collective on the shm group and on a gloo group (tests/shm_cases.py),
  element for element (run on 2 namespace hosts x 2); plus an all_reduce digest per dtype.
* ``peer_stuck``: group timeout 3 s; rank 1 calls allreduce 4.5 s late: rank 0 times out,
  rank 1 learns of the abort at once, and rank 0's next call fails because the group is broken.
"""

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import cpuddp.shm  # noqa: F401  -- registers "shm" with torch.distributed

mode, outdir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
report: dict = {"rank": rank}


def done() -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # a peer is dead or stuck: no teardown that could wait for it


def timed_allreduce(key: str) -> None:
    start, cpu = time.monotonic(), time.process_time()
    try:
        dist.all_reduce(torch.ones(1000))
        report.setdefault("completed", []).append(key)
    except Exception as exc:  # noqa: BLE001 -- the test reads the message
        report[key] = f"{type(exc).__name__}: {exc}"
    report.setdefault("seconds", time.monotonic() - start)
    report.setdefault("cpu_seconds", time.process_time() - cpu)


if os.environ.get("SHM_RANKS_FSIZE"):  # a real kernel refusal of the reservation (EFBIG)
    import resource

    limit = int(os.environ["SHM_RANKS_FSIZE"])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
if os.environ.get("SHM_RANKS_NOMEM_RANK") == os.environ["RANK"]:  # this rank's reservations fail (ENOMEM)
    import errno

    def _no_memory(fd, offset, length):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    os.posix_fallocate = _no_memory
timeout = datetime.timedelta(seconds=3 if mode == "peer_stuck" else 60)
try:
    dist.init_process_group("shm", timeout=timeout)
except Exception as exc:  # noqa: BLE001
    report["error"] = f"{type(exc).__name__}: {exc}"
    done()
report["ok"] = True
report["reason"] = dist.group.WORLD.reason
if mode == "init_only":
    dist.barrier()  # rank 0 hosts the store: it must not leave before rank 1 has formed the group
    done()

if mode == "compare":
    import ctypes
    import hashlib

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from shm_cases import every_collective

    report.update(every_collective((1, 13, 300001), ("float32", "int64", "bfloat16")))
    report["digests"] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        g = torch.Generator().manual_seed(rank * 31)
        a = (torch.randn(600001, generator=g, dtype=torch.float64) * 8).to(dtype)
        dist.all_reduce(a)
        report["digests"][str(dtype)] = hashlib.sha256(ctypes.string_at(a.data_ptr(), a.numel() * a.element_size())).hexdigest()
    dist.barrier()
    done()

dist.all_reduce(torch.ones(10))  # one good call first
if mode == "peer_dies":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    timed_allreduce("error")
    done()

if mode == "peer_stuck":
    if rank == 1:
        time.sleep(4.5)
        timed_allreduce("error")
        done()
    timed_allreduce("error")
    report["second_error"] = ""
    try:
        dist.all_reduce(torch.ones(10))
    except Exception as exc:  # noqa: BLE001
        report["second_error"] = str(exc)
    time.sleep(3)  # stay alive while rank 1 tries
    done()
