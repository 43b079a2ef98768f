"""A user's job under the issue-43 attack (tests/test_jobs_attack.py): README's two lines, then
checked collectives.  ``jobs_victim.py DIR JOB MODE`` writes ``DIR/<JOB>-rank<r>.json``.

* ``cross`` (two of these jobs run at once, JOB ``A`` and ``B``): ``init_distributed()`` and
  ``prepare()`` of a model seeded by the job, then 120 all_reduces of the job's own value (A: 1.0
  from each rank, B: 10.0); the report has each rank's parameter sum after ``prepare()`` (rank 0's
  weights, broadcast) and every wrong sum.
* ``subgroup`` (3 ranks): ``init_distributed(backend="shm")``, ``dist.new_group([0, 1])`` with
  the job's backend, then 60 all_reduces in it on ranks 0 and 1; the report has the group's reason."""

import json
import os
import sys

rank = int(os.environ["RANK"])
outdir, job, mode = sys.argv[1], sys.argv[2], sys.argv[3]
report = {"job": job, "rank": rank}


def done() -> None:
    with open(os.path.join(outdir, f"{job}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # a peer may have failed: no teardown that could wait for it


def cross() -> None:
    torch.manual_seed(1 if job == "A" else 2)
    model = torch.nn.Linear(16, 16)
    if rank != 0:
        torch.manual_seed(100 + rank)  # the other ranks start from weights of their own
        model = torch.nn.Linear(16, 16)
    model = cpuddp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    report["weights"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    value = 1.0 if job == "A" else 10.0
    calls, report["wrong"] = 120, []
    for i in range(calls):
        t = torch.full((1000,), value)
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((1000,), 2 * value)):
            report["wrong"].append([i, t[:2].tolist()])
    report["calls"] = calls


def subgroup() -> None:
    pg = dist.new_group([0, 1])
    if rank > 1:
        return
    report["reason"] = str(getattr(pg, "reason", dist.get_backend(pg)))
    report["wrong"] = []
    for i in range(60):
        t = torch.full((100,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        if not torch.equal(t, torch.full((100,), 3.0)):
            report["wrong"].append([i, t[:2].tolist()])
    report["calls"] = 60


try:
    import torch
    import torch.distributed as dist

    import cpuddp

    cpuddp.init_distributed(backend="shm" if mode == "subgroup" else "auto")  # 3 ranks on 2 CPUs: auto takes gloo
    report["backend"] = str(dist.get_backend())
    cross() if mode == "cross" else subgroup()
    report["init"] = "ok"
except Exception as exc:  # noqa: BLE001 -- the test reads the message
    report["init"] = f"{type(exc).__name__}: {exc} | fix: {getattr(exc, 'fix', '')}"
done()
