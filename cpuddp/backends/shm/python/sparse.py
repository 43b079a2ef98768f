"""all_reduce of a sparse COO tensor on a shm group (DDP sends one for ``nn.Embedding(sparse=True)``
gradients): every rank's indices and values are all-gathered -- their counts first -- and the
rank-order concatenation is coalesced, the same on every rank.  SUM and AVG, as gloo's.

The ranks must hold alike tensors: the values' dtype, the indices' dtype, ``sparse_dim``, the
dense sizes and the shape (the number of non-zeros may differ).  :func:`sparse_call` packs them
into the call's descriptor, so the node's ranks compare them before anything moves (a
difference is a :class:`~cpuddp.backends.shm.protocol.descriptor.CallMismatch` on every rank, naming both);
across nodes the same words go first with the counts, and are compared again.

Descriptor fields of ``all_reduce_sparse``: ``dtype`` the values' dtype; ``root`` the indices'
dtype code, ``sparse_dim << 16`` and ``dense_dim << 32``; ``numel``, ``tensors`` and ``sizes``
the shape's first three sizes (``ANY`` where the tensor has fewer), ``sizes`` a digest of the
sizes from the third on where it has more.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, List, Sequence

import torch

from cpuddp.errors import BackendError

from ..protocol.descriptor import ANY, KINDS, READERS, CallMismatch, Pinned, describe, dtype_code, dtype_name, encode
from .ops import AVG, SUM, flat_bytes

__all__ = ["check_sparse", "all_reduce_sparse", "sparse_call", "read_sparse_call"]

_DIGEST = 1 << 40  # marks ``sizes`` as a digest of the shape's sizes from the third on


def sparse_call(t: torch.Tensor) -> Pinned:
    """The descriptor fields of an all_reduce of sparse ``t`` (see the module doc)."""
    shape = [int(s) for s in t.shape]
    dims = shape[:2] + [ANY] * (2 - len(shape[:2]))
    if len(shape) <= 3:
        third = shape[2] if len(shape) == 3 else ANY
    else:
        third = _DIGEST | zlib.crc32(",".join(map(str, shape[2:])).encode())
    layout = dtype_code(t._indices().dtype) | t.sparse_dim() << 16 | t.dense_dim() << 32
    return Pinned([], dtype=dtype_code(t.dtype), root=layout, numel=dims[0], tensors=dims[1], sizes=third)


def read_sparse_call(words: Sequence[int]) -> List[str]:
    """``float32 values, int64 indices, sparse_dim 1, dense sizes (3), shape (5, 3)``."""
    _kind, _op, dtype, d0, layout, d1, third = words
    if layout == ANY:
        return []
    sparse_dim, dense_dim = layout >> 16 & 0xFFFF, layout >> 32 & 0xFFFF
    ndim = sparse_dim + dense_dim
    sizes = [str(d) for d in (d0, d1, third)[:min(ndim, 3)]]
    if ndim > 3:
        sizes[2:] = [f"...#{third & 0xFFFFFFFF:08x}"]
    dense = f"dense sizes ({', '.join(sizes[sparse_dim:])})" if ndim <= 3 else f"dense_dim {dense_dim}"
    return [f"{dtype_name(dtype)} values", f"{dtype_name(layout & 0xFFFF)} indices", f"sparse_dim {sparse_dim}",
            dense, f"shape ({', '.join(sizes)})"]


READERS[KINDS["all_reduce_sparse"]] = read_sparse_call


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
    mine = encode("all_reduce_sparse", sparse_call(t), op=int(code)).words()
    heads = _gather(torch.tensor([indices.shape[1], *mine], dtype=torch.int64), size, all_gather)
    _compare([tuple(h[1:].tolist()) for h in heads])
    counts = [h[:1] for h in heads]
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


def _compare(words: List[Sequence[int]]) -> None:
    """Every rank's descriptor words alike (ranks on other nodes too), or a mismatch on every rank."""
    for r, theirs in enumerate(words):
        if theirs != words[0]:
            raise CallMismatch(
                f"sparse all_reduce differs between ranks: rank 0 called {describe(words[0])}, rank {r} called "
                f"{describe(theirs)}. Every rank must all-reduce sparse tensors of the same values and indices "
                "dtypes, sparse_dim, dense sizes and shape; nothing was reduced, and the group is now broken")


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
