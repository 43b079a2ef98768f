"""README's two lines under attack (tests/test_init_attack.py): ``init_distributed()`` with the
default backend and ``prepare()``, then 50 all_reduces, each checked.  Each rank writes
``DIR/rank<r>.json``: the backend it formed, or the error init raised, and any wrong result."""

import json
import os
import sys

rank = int(os.environ["RANK"])
report = {"rank": rank}
outdir = sys.argv[1]


def done() -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # a peer may have failed: no teardown that could wait for it


try:
    import torch
    import torch.distributed as dist

    import cpuddp

    env = cpuddp.init_distributed()
    report["backend"] = str(dist.get_backend())
    model = cpuddp.prepare(torch.nn.Linear(16, 16), torch.optim.SGD(torch.nn.Linear(16, 16).parameters(), lr=0.1))
except Exception as exc:  # noqa: BLE001 -- the test reads the message
    report["init"] = f"{type(exc).__name__}: {exc} | fix: {getattr(exc, 'fix', '')}"
    done()
report["init"] = "ok"
wrong = []
for i in range(50):
    t = torch.ones(1000)
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((1000,), 2.0)):
        wrong.append([i, t[:4].tolist()])
report["wrong"] = wrong
report["calls"] = 50
done()
