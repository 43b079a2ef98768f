"""``shard="optimizer"``: the optimizer's whole state dict from every rank's pieces, and a whole
state dict cut back to them (:mod:`cpuddp.train.sharding.zero_plan` holds the pieces).

Per-element values (``exp_avg``, ...) are all-gathered bucket by bucket; per-parameter numbers
(``step``, ...) come from the rank holding the parameter's first element.  What each parameter
has is agreed first (one all-reduce per bucket), so every rank makes the same calls whatever it
holds.  Each function here is a collective: every rank calls it (:class:`~cpuddp.train.sharding.zero_sync.StateDictGate`
sees to that first).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from .zero_plan import Bucket, ShardPlan, all_gather, index_of, owner

__all__ = ["PER_PARAMETER", "whole_state"]

#: The optimizers' per-parameter numbers (one value per parameter, whatever its shape).
PER_PARAMETER = ("step", "mu_product", "eta", "mu")


def whole_state(optimizer: torch.optim.Optimizer, plan: ShardPlan, rank: int, world: int,
                group: Any) -> defaultdict:
    """The optimizer's state as DDP's optimizer would hold it: each bucket parameter's whole
    state gathered from the pieces, the other parameters' state as it is."""
    pieces = {id(pc.tensor) for b in plan.buckets.values() for pc in b.pieces}
    whole: defaultdict = defaultdict(dict, ((p, s) for p, s in optimizer.state.items() if id(p) not in pieces))
    for b in plan.buckets.values():
        whole.update(_gather_bucket(optimizer, b, plan.per_element, rank, world, group))
    return whole


def _gather_bucket(optimizer: torch.optim.Optimizer, b: Bucket, per_element: tuple, rank: int, world: int,
                   group: Any) -> dict[torch.Tensor, dict[str, Any]]:
    """Each bucket parameter's whole state: per-element values all-gathered from every rank's
    pieces, per-parameter numbers from the rank holding the parameter's first element."""
    have, numbers = _agree_state(optimizer, b, per_element, rank, world, group)
    flats = {}
    for ki, key in enumerate(per_element):
        if not have[ki].any():
            continue
        flat = torch.zeros_like(b.flat)
        for piece in b.pieces:
            value = optimizer.state.get(piece.tensor, {}).get(key)
            if value is not None:
                start = b.offsets[index_of(b.params, piece.param)] + piece.lo
                flat[start:start + piece.hi - piece.lo].copy_(value)
        if b.chunk:
            all_gather(flat[:b.shared], flat[rank * b.chunk:(rank + 1) * b.chunk].clone(), group=group)
        flats[ki] = flat
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch's for "step"
    out = {}
    for j, (p, a) in enumerate(zip(b.params, b.offsets)):
        entry = {key: flats[ki][a:a + p.numel()].view_as(p) for ki, key in enumerate(per_element) if have[ki, j]}
        entry.update((key, torch.tensor(numbers[1, ni, j].item(), dtype=scalar))
                     for ni, key in enumerate(PER_PARAMETER) if numbers[0, ni, j])
        if entry:
            out[p] = entry
    return out


def _agree_state(optimizer: torch.optim.Optimizer, b: Bucket, keys: tuple, rank: int, world: int,
                 group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(have, numbers)``: which per-element keys each of the bucket's parameters has
    (``[key, param]``), and its per-parameter numbers (``[0]``: present, ``[1]``: value), as
    the rank holding the parameter's first element says (one all-reduce)."""
    state = optimizer.state
    k, n, params = len(keys), len(PER_PARAMETER), len(b.params)
    table = torch.zeros(k * params + 2 * n * params + 1, dtype=torch.float64)  # the last: a key nobody knows
    have, numbers = table[:k * params].view(k, params), table[k * params:-1].view(2, n, params)
    for piece in b.pieces:
        j = index_of(b.params, piece.param)
        if piece.lo or owner(b.offsets[j], b.chunk, world) != rank:
            continue
        held = state.get(piece.tensor, {})
        if any(key not in keys and key not in PER_PARAMETER for key in held):
            table[-1] = 1.0  # said after the all-reduce, on every rank
        for ki, key in enumerate(keys):
            have[ki, j] = float(held.get(key) is not None)
        for ni, key in enumerate(PER_PARAMETER):
            if key in held:
                numbers[0, ni, j], numbers[1, ni, j] = 1.0, float(held[key])
    dist.all_reduce(table, group=group)
    if table[-1]:
        raise RuntimeError(f"cpuddp shard='optimizer': {type(optimizer).__name__} holds optimizer state "
                           f"other than {keys + PER_PARAMETER}, which cpuddp does not know how to "
                           "gather (a torch version cpuddp has not seen?); report it, and use shard='full' meanwhile")
    return have > 0, numbers
