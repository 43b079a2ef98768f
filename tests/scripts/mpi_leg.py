"""A rank of the MPI leg's tests (tests/test_mpi_leg.py), started by an MPI's mpiexec on network-
namespace hosts.  ``python mpi_leg.py MODE OUTDIR``; each rank writes ``OUTDIR/rank<N>.json``.

* ``collectives``: every collective torch has, on the group ``init_distributed()`` formed, checked
  against exact values on every rank (integer-valued floats, so every order of summing gives the
  same exact sum), plus a digest of a random-valued float sum (every rank must hold the same bits);
  the group's leg, reason and data path.
* ``train``: DDP (``MPI_LEG_SHARD=optimizer``: ``cpuddp.prepare(shard="optimizer")``;
  ``MPI_LEG_HOOK=bf16``: its comm hook) of a small MLP for a few steps: the loss of each step and
  a digest of the weights.
* ``raises``: the last rank raises an exception while the others wait in an all_reduce.
* ``mismatch``: rank 0 all-reduces 3 elements, the others 4.
* ``leg``: init only: the group's leg and reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cpuddp  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]


def digest(t: torch.Tensor) -> str:
    """The tensor's bits, hashed (no numpy: the test venv may lack it)."""
    return hashlib.sha256(bytes(t.contiguous().view(torch.uint8).tolist())).hexdigest()[:16]


def collectives(r: int, p: int) -> list:
    bad = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            bad.append(f"{name}: got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")

    tri = p * (p + 1) // 2
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32):
        for n in (1, 1000, 70001, 300007):
            base = torch.arange(n) % 7
            t = (base + r + 1).to(dtype)
            dist.all_reduce(t)
            check(f"all_reduce {dtype} x{n}", t, base * p + tri)
        t = torch.full((9,), r, dtype=dtype)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        check(f"all_reduce MAX {dtype}", t, torch.full((9,), p - 1))
    t = torch.full((4,), 2.0 * r)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check("all_reduce AVG", t, torch.full((4,), float(p - 1)))
    strided = torch.ones(6, 4)[:, 1]
    dist.all_reduce(strided)
    check("all_reduce strided", strided, torch.full((6,), float(p)))
    mixed = torch.ones(6, 4)[:, 1] if r % 2 else torch.ones(6)  # the general route on odd ranks, the direct on even
    dist.all_reduce(mixed)
    check("all_reduce, strided on odd ranks", mixed, torch.full((6,), float(p)))
    for root in range(p):
        t = torch.full((5000,), float(r))
        dist.broadcast(t, src=root)
        check(f"broadcast from {root}", t, torch.full((5000,), float(root)))
        t = torch.full((7,), float(r + 1))
        dist.reduce(t, dst=root)
        if r == root:
            check(f"reduce to {root}", t, torch.full((7,), float(tri)))
    out = torch.empty(p * 1001)
    dist.all_gather_into_tensor(out, torch.full((1001,), float(r)))
    check("all_gather_into_tensor", out, torch.arange(p).repeat_interleave(1001).float())
    outs = [torch.empty(3) for _ in range(p)]
    dist.all_gather(outs, torch.full((3,), float(r)))
    check("all_gather", torch.stack(outs), torch.arange(p).float().repeat_interleave(3).view(p, 3))
    for k in (4, 50001):
        inp = torch.arange(p * k, dtype=torch.float32) % 11 + r
        o = torch.empty(k)
        dist.reduce_scatter_tensor(o, inp)
        check(f"reduce_scatter_tensor x{k}", o, (torch.arange(p * k, dtype=torch.float32) % 11)[r * k:(r + 1) * k] * p
              + sum(range(p)))
    inp = torch.arange(p * 2, dtype=torch.float32) + 100 * r
    o = torch.empty(p * 2)
    dist.all_to_all_single(o, inp)
    check("all_to_all_single", o, torch.tensor([100 * q + 2 * r + i for q in range(p) for i in range(2)]))
    g = [torch.empty(2) for _ in range(p)] if r == 0 else None
    dist.gather(torch.full((2,), float(r)), g, dst=0)
    if r == 0:
        check("gather", torch.stack(g), torch.arange(p).float().repeat_interleave(2).view(p, 2))
    s = torch.empty(2)
    dist.scatter(s, [torch.full((2,), 10.0 * q) for q in range(p)] if r == 0 else None, src=0)
    check("scatter", s, torch.full((2,), 10.0 * r))
    nxt, prv = (r + 1) % p, (r - 1) % p
    got = torch.empty(3)
    sends = [dist.isend(torch.full((3,), float(r)), nxt), dist.irecv(got, prv)]
    for w in sends:
        w.wait()
    check("send/recv ring", got, torch.full((3,), float(prv)))
    dist.barrier()
    return bad


def float_digest(r: int) -> str:
    gen = torch.Generator().manual_seed(1234 + r)
    t = torch.randn(300007, generator=gen)
    dist.all_reduce(t)
    small = torch.randn(1000, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    dist.all_reduce(small)
    return digest(t) + digest(small)


def train(r: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard = os.environ.get("MPI_LEG_SHARD") or None
    hook = os.environ.get("MPI_LEG_HOOK") or None
    ddp = cpuddp.prepare(model, opt, shard=shard, mixed_precision="fp32", comm_hook=hook)
    gen = torch.Generator().manual_seed(100 + r)
    losses = []
    for _ in range(12):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 8, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        losses.append(t.item())
    weights = torch.cat([p.detach().reshape(-1) for p in cpuddp.unwrap(ddp).parameters()])
    return {"losses": losses, "weights": digest(weights)}


def main() -> None:
    t0 = time.monotonic()
    report: dict = {"rank": int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))}
    try:
        cpuddp.init_distributed(os.environ.get("MPI_LEG_BACKEND", "auto"))
        r, p = dist.get_rank(), dist.get_world_size()
        pg = dist.distributed_c10d._get_default_group()
        report.update(rank=r, size=p, backend=cpuddp.get_session().backend, leg=getattr(pg, "leg", ""),
                      reason=getattr(pg, "reason", ""), data_path=getattr(pg, "data_path", ""),
                      direct=type(getattr(pg, "_direct", None)).__name__)
        if MODE == "collectives":
            report["bad"] = collectives(r, p)
            report["digest"] = float_digest(r)
        elif MODE == "train":
            report.update(train(r))
        elif MODE == "raises":  # MPI_LEG_KILL=1: the last rank is killed instead
            if r == p - 1:
                time.sleep(1.0)
                if os.environ.get("MPI_LEG_KILL"):
                    os.kill(os.getpid(), 9)
                raise ValueError("rank's own error, on purpose")
            dist.all_reduce(torch.ones(1000))
        elif MODE == "mismatch":
            dist.all_reduce(torch.zeros(3 if r == 0 else 4))
        report["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        report.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        raise
    finally:
        report["seconds"] = round(time.monotonic() - t0, 2)
        with open(os.path.join(OUT, f"rank{report['rank']}.json"), "w") as f:
            json.dump(report, f)
    cpuddp.shutdown()


if __name__ == "__main__":
    main()
