"""shard="optimizer"'s gradient norm (:mod:`cpuddp.train.sharding.zero_norm`): the same bits from
every rank's shares as from the whole gradients, whatever the bucket layout, world size and
norm -- the reason a run that clips resumes bit-identically (issue 46; the resume itself is
tests/test_shard_zero.py's)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cpuddp.train.sharding import zero_norm
from cpuddp.train.sharding.zero_norm import NormPlan, block_norms, unsharded_norm

NORMS = (2.0, 1.0, 3.0, float("inf"))


def test_a_blocks_norm_does_not_depend_on_the_rows_beside_it():
    torch.manual_seed(0)
    flat = torch.randn(5 * zero_norm.BLOCK + 17) * 1e3
    for p in NORMS:
        whole = block_norms(flat, p, torch.float32)
        assert whole.numel() == 6
        for k in range(6):
            piece = flat[k * zero_norm.BLOCK:(k + 1) * zero_norm.BLOCK].clone()  # another address, alone
            assert torch.equal(block_norms(piece, p, torch.float32), whole[k:k + 1]), (p, k)


def _layout(seed: int, world: int):
    """Parameters with gradients (one without: unused) and a random bucket layout, the same on every rank."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(rng.choice([1, 2, 3, 7, 11, 12, 30, 64]))) for _ in range(9)]
    for i, p in enumerate(params):
        p.grad = None if i == 4 else torch.randn(p.numel(), generator=gen) * 10 ** rng.uniform(-3, 3)
    order = list(params)
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), 2))
    return params, [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]


def _shares(bucket_params, rank: int, world: int):
    """A bucket as ShardPlan keeps it: this rank's share of the reduced gradients and the tail."""
    flat = torch.cat([p.grad if p.grad is not None else torch.zeros(p.numel()) for p in bucket_params])
    chunk = flat.numel() // world
    offsets = [sum(q.numel() for q in bucket_params[:i]) for i in range(len(bucket_params))]
    return SimpleNamespace(params=tuple(bucket_params), offsets=offsets, chunk=chunk, flat=flat,
                           grad=flat[rank * chunk:(rank + 1) * chunk].clone(), tail=flat[world * chunk:].clone())


def _compare(seeds):
    import torch.distributed as dist

    zero_norm.BLOCK = 5  # many blocks, many cut by a share's edge
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []
    for seed in seeds:
        params, buckets = _layout(seed, world)
        plan = SimpleNamespace(buckets={i: _shares(b, rank, world) for i, b in enumerate(buckets)})
        norms = NormPlan.build(plan, params, rank, world)
        for p in NORMS:
            want, got = unsharded_norm(params, p), norms.norm(p, None)
            if not torch.equal(want, got):
                bad.append((seed, p, want.item(), got.item()))
            reference = torch.linalg.vector_norm(torch.cat([q.grad for q in params if q.grad is not None]), p)
            assert torch.allclose(got, reference, rtol=1e-5), (seed, p)
    return bad, norms.width


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_the_sharded_norm_equals_the_unsharded_bits(run_distributed, world):
    results = run_distributed(_compare, world, args=(range(30),), timeout=150)
    for rank, (bad, _) in enumerate(results):
        assert not bad, f"rank {rank}: the sharded norm differs (seed, norm, unsharded, sharded): {bad[:5]}"
    assert any(width for _, width in results), "no block was cut by a share's edge: the test proves little"
