"""Mismatched sparse, all_to_all and send/recv calls on the shm backend (issue 35, item 4).

A call the ranks disagree on -- a sparse all_reduce of float32 values on one rank and float64
on the other, 2 dense columns against 3, all_to_all buffers of different dtypes, a send of
float64 received as int64 -- must be an error on every rank involved, naming the call, the
ranks and both values; never bytes read as another dtype, never a hang.  Every case runs on
real processes (``run_distributed``), each on a shm subgroup of its own.
"""

from __future__ import annotations

import time

import pytest

from cpuddp.testing import run_distributed

pytestmark = pytest.mark.slow

#: name -> words each rank's error must hold (both sides' values)
CASES = {
    "sparse_values_dtype": ("all_reduce_sparse", "float32", "float64"),
    "sparse_dense_columns": ("all_reduce_sparse", "dense sizes (2)", "dense sizes (3)"),
    "sparse_dim": ("all_reduce_sparse", "sparse_dim 1", "sparse_dim 2"),
    "sparse_shape": ("all_reduce_sparse", "shape (5)", "shape (7)"),
    "all_to_all_single_dtype": ("all_to_all_single", "float32", "int32"),
    "all_to_all_dtype": ("all_to_all(", "float32", "int32"),
    "send_recv_dtype": ("tag 3", "4 float64 elements", "4 int64 elements"),
    "send_recv_count": ("tag 0", "8 float32 elements", "4 float64 elements"),
    "send_recv_dtype_late": ("tag 0", "2 float32 elements", "2 int32 elements"),
}


def _sparse(case: str, rank: int):
    import torch

    if case == "sparse_values_dtype":
        return torch.sparse_coo_tensor([[rank, 3]], torch.ones(2, dtype=(torch.float32, torch.float64)[rank]), (5,))
    if case == "sparse_dense_columns":
        cols = 2 + rank
        return torch.sparse_coo_tensor([[rank, 3]], torch.ones(2, cols), (5, cols))
    if case == "sparse_shape":
        return torch.sparse_coo_tensor([[rank, 3]], torch.ones(2), (5 + 2 * rank,))
    return torch.ones(4, 3).to_sparse(1 + rank)  # sparse_dim 1 (2 dense columns... of 3) against 2


def _one(case: str, group, rank: int):
    """Run ``case``'s mismatched call; what it gave (a result, or None when it raised)."""
    import torch
    import torch.distributed as dist

    if case.startswith("sparse"):
        t = _sparse(case, rank)
        dist.all_reduce(t, group=group)
        return t.to_dense().reshape(-1).tolist()
    dtype = (torch.float32, torch.int32)[rank]
    if case == "all_to_all_single_dtype":
        out = torch.zeros(4, dtype=dtype)
        dist.all_to_all_single(out, torch.arange(4).to(dtype) + 10 * rank, group=group)
        return out.tolist()
    if case == "all_to_all_dtype":
        outs = [torch.zeros(2, dtype=dtype) for _ in range(2)]
        dist.all_to_all(outs, [torch.full((2,), 7 + rank).to(dtype) for _ in range(2)], group=group)
        return [o.tolist() for o in outs]
    return _send_recv(case, group, rank)


def _send_recv(case: str, group, rank: int):
    """Rank 0 sends, rank 1 receives a buffer the send does not match.  Rank 1 answers only if its
    recv took the bytes (the old behaviour); rank 0's next recv from rank 1 must learn the error."""
    import torch
    import torch.distributed as dist

    sent, got, tag = {
        "send_recv_dtype": (torch.arange(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int64), 3),
        "send_recv_count": (torch.arange(8, dtype=torch.float32), torch.zeros(4, dtype=torch.float64), 0),
        "send_recv_dtype_late": (torch.ones(2), torch.zeros(2, dtype=torch.int32), 0),
    }[case]
    if rank == 0:
        dist.send(sent, dst=1, group=group, tag=tag)
        answer = torch.zeros(1)
        dist.recv(answer, src=1, group=group)
        return answer.tolist()
    if case.endswith("_late"):
        time.sleep(0.5)  # the message arrives before the recv is posted
    dist.recv(got, src=0, group=group, tag=tag)
    dist.send(torch.ones(1), dst=0, group=group)
    return got.tolist()


def _mismatches(cases):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for case in cases:
        group = dist.new_group(backend="shm")
        x = torch.ones(3)
        dist.all_reduce(x, group=group)  # a matched call first
        start = time.monotonic()
        try:
            out[case] = {"result": _one(case, group, rank)}
        except Exception as exc:  # noqa: BLE001
            out[case] = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return out


@pytest.mark.parametrize("kind", ["sparse", "all_to_all", "send_recv"])
def test_a_mismatched_call_is_an_error_on_both_ranks_naming_both_values(kind):
    cases = [c for c in CASES if c.startswith(kind)]
    res = run_distributed(_mismatches, 2, args=(cases,), backend="shm", timeout=180)
    for case in cases:
        for rank, r in enumerate(res):
            got = r[case]
            assert "error" in got, f"{case}: rank {rank} got no error but {got}"
            for word in (*CASES[case], "rank 0", "rank 1"):
                assert word in got["error"], (case, rank, word, got["error"])
            assert got["seconds"] < 10, (case, rank, got)


def _matched_still_work():
    """The agreement does not refuse what is legal: uneven all_to_all splits, hybrid sparse
    tensors alike on both ranks, a send received in order by tag, a message that arrived early."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    sp = torch.sparse_coo_tensor([[rank, 4]], torch.ones(2, 3) * (rank + 1), (6, 3))
    dist.all_reduce(sp)
    want = torch.zeros(6, 3)
    want[0], want[1], want[4] = 1.0, 2.0, 3.0
    assert torch.equal(sp.to_dense(), want), sp.to_dense()
    send = [1 + rank, 2]  # uneven: rank r sends 1 + r rows to rank 0, 2 rows to rank 1
    recv = [1 + r if rank == 0 else 2 for r in range(2)]
    out = torch.zeros(sum(recv), dtype=torch.int16)
    dist.all_to_all_single(out, torch.arange(sum(send), dtype=torch.int16) + 100 * rank, recv, send)
    peer = 1 - rank
    early = torch.full((3,), float(rank), dtype=torch.float64)
    work = dist.isend(early, dst=peer, tag=9)
    time.sleep(0.2)
    got = torch.zeros(3, dtype=torch.float64)
    dist.recv(got, src=peer, tag=9)
    work.wait()
    assert got.tolist() == [float(peer)] * 3
    return out.tolist()


def test_matched_sparse_all_to_all_and_send_recv_calls_still_work():
    r0, r1 = run_distributed(_matched_still_work, 2, backend="shm", timeout=120)
    assert r0 == [0, 100, 101], r0
    assert r1 == [1, 2, 102, 103], r1


def test_sparse_layouts_are_compared_across_nodes_too():
    """Ranks on different nodes: no node's descriptors compare them, so their layouts go first,
    with the counts.  Two threads stand for them here, over an all_gather of their own; a
    difference is a CallMismatch on both before any index or value moves."""
    import threading

    import torch

    from cpuddp.backends.shm.protocol.descriptor import CallMismatch
    from cpuddp.backends.shm.python.ops import SUM
    from cpuddp.backends.shm.python.sparse import all_reduce_sparse

    box, gathered, barrier = {}, [], threading.Barrier(2, timeout=30)

    def run(rank: int, t, out: dict) -> None:
        def all_gather(inp, outs) -> None:
            box[rank] = inp.clone()
            barrier.wait()
            gathered.append(inp.numel())
            for r, o in enumerate(outs):
                o.copy_(box[r])
            barrier.wait()

        try:
            out[rank] = all_reduce_sparse(t, SUM, 2, all_gather).to_dense().tolist()
        except CallMismatch as exc:
            out[rank] = str(exc)

    for cols in ((2, 2), (2, 3)):
        out: dict = {}
        gathered.clear()
        threads = [threading.Thread(target=run, args=(r, torch.sparse_coo_tensor([[r, 3]], torch.ones(2, c), (5, c)),
                                                      out)) for r, c in enumerate(cols)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        if cols[0] == cols[1]:
            assert out[0] == out[1] and out[0][3] == [2.0, 2.0], out
            continue
        for rank in range(2):
            assert "sparse all_reduce differs between ranks" in out[rank], out
            assert "dense sizes (2)" in out[rank] and "dense sizes (3)" in out[rank], out
        assert len(gathered) == 2, gathered  # the heads only: no index or value moved


def _refusal_while_sending_big():
    """Rank 1 is in the middle of sending rank 0 a 32 MiB tensor when it refuses rank 0's
    mismatched message: the big one goes out whole (or fails with the mismatch), never cut."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group(backend="shm")
    big = 8 << 20
    if rank == 1:
        work = dist.isend(torch.arange(big, dtype=torch.float32), dst=0, group=group, tag=1)
        time.sleep(0.2)  # rank 0 is not receiving yet: the big message is stuck half-written
        out = {}
        try:
            dist.recv(torch.zeros(4, dtype=torch.int64), src=0, group=group, tag=2)
            out["recv"] = "ok"
        except Exception as exc:  # noqa: BLE001
            out["recv"] = str(exc)
        try:
            work.wait()
            out["big_send"] = "ok"
        except Exception as exc:  # noqa: BLE001
            out["big_send"] = str(exc)
        dist.barrier()  # on the world group: stay until rank 0's next send was refused (not "closed")
        return out
    dist.send(torch.zeros(4, dtype=torch.float64), dst=1, group=group, tag=2)
    time.sleep(0.5)  # rank 1 refused it meanwhile
    got = torch.zeros(big)
    out = {}
    try:
        dist.recv(got, src=1, group=group, tag=1)
        out["big_recv"] = "ok" if torch.equal(got, torch.arange(big, dtype=torch.float32)) else "WRONG BYTES"
    except Exception as exc:  # noqa: BLE001
        out["big_recv"] = str(exc)
    try:
        dist.send(torch.zeros(1), dst=1, group=group)
        out["next"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["next"] = str(exc)
    dist.barrier()  # rank 1 may leave now
    return out


def test_a_refusal_never_cuts_a_message_half_sent_the_other_way():
    r0, r1 = run_distributed(_refusal_while_sending_big, 2, backend="shm", timeout=120)
    mismatch = "rank 0 sent 4 float64 elements, rank 1 receives 4 int64 elements"
    assert mismatch in r1["recv"], r1
    assert r0["big_recv"] == "ok" or mismatch in r0["big_recv"], r0
    assert (r1["big_send"] == "ok") == (r0["big_recv"] == "ok"), (r0, r1)
    assert mismatch in r0["next"], r0
