"""all_reduce of a sparse COO tensor on a shm group (DDP sends one for ``nn.Embedding(sparse=True)``
gradients): every rank's indices and values are all-gathered -- their counts first -- and the
rank-order concatenation is coalesced, the same on every rank.  SUM and AVG, as gloo's.
"""

from __future__ import annotations

from typing import Any, Callable, List

import torch

from cpuddp.errors import BackendError

from .ops import AVG, SUM, flat_bytes

__all__ = ["check_sparse", "all_reduce_sparse"]


def check_sparse(t: torch.Tensor, code: Any) -> None:
    if t.layout != torch.sparse_coo or t.device.type != "cpu":
        raise BackendError(f"all_reduce got a {t.layout} tensor on {t.device}: the shm backend reduces dense CPU "
                           "tensors and sparse COO ones", fix="convert it with .to_dense() or .to_sparse_coo()")
    if code not in (SUM, AVG):
        raise BackendError(f"all_reduce of a sparse tensor with ReduceOp.{getattr(code, 'name', code)}",
                           fix="use SUM or AVG for sparse tensors (as gloo does)")


def all_reduce_sparse(t: torch.Tensor, code: Any, size: int, all_gather: Callable[..., None]) -> torch.Tensor:
    """The reduced sparse tensor (also copied into ``t``).  ``all_gather(inp, outs)`` moves bytes."""
    c = t.coalesce()
    indices, values = c._indices().contiguous(), c._values().contiguous()
    counts = _gather(torch.tensor([indices.shape[1]], dtype=torch.int64), size, all_gather)
    most = int(max(x.item() for x in counts))
    idx = _gather(_padded(indices, 1, most), size, all_gather)
    val = _gather(_padded(values, 0, most), size, all_gather)
    k = [int(x.item()) for x in counts]
    merged = torch.sparse_coo_tensor(torch.cat([i[:, :n] for i, n in zip(idx, k)], dim=1),
                                     torch.cat([v[:n] for v, n in zip(val, k)]), t.shape).coalesce()
    if code == AVG:
        merged = merged / size
    t.copy_(merged)
    return t


def _padded(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = length
    out = torch.zeros(shape, dtype=x.dtype)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _gather(x: torch.Tensor, size: int, all_gather: Callable[..., None]) -> List[torch.Tensor]:
    outs = [torch.empty_like(x) for _ in range(size)]
    all_gather(flat_bytes(x), [flat_bytes(o) for o in outs])
    return outs
