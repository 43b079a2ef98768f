"""Gradient communication for :func:`cpuddp.prepare`: the ``comm_hook`` argument, the
collective probe that bf16 all-reduces correctly, and cpuddp's own bf16 DDP hook.

``comm_hook="bf16"``: gloo's bf16 all_reduce failed in some torch versions (pytorch issue
111131), so every rank first runs :func:`bf16_allreduce_supported`; torch refuses its own
``bf16_compress_hook`` on CPU by the hook's name, so :func:`bf16_allreduce_hook` does the same
under another name.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from cpuddp.errors import PrepareError, warn

__all__ = ["COMM_HOOKS", "bf16_allreduce_supported", "bf16_allreduce_hook", "check_comm_hook", "register_hook"]

#: The named hooks ``comm_hook`` accepts (besides a hook or a ``(state, hook)`` pair).
COMM_HOOKS = (None, "fp16", "bf16")


def bf16_allreduce_supported(group: Optional[Any] = None) -> tuple[bool, str]:
    """Collective probe: does the backend all-reduce bf16 correctly?  Every rank must call it."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    ok, why = True, "bf16 all_reduce returned the right sum"
    t = torch.full((8,), float(rank + 1), dtype=torch.bfloat16)
    try:
        dist.all_reduce(t, group=group)
        expected = world * (world + 1) / 2
        if not torch.all(t.float() == expected):
            ok, why = False, f"bf16 all_reduce returned {t.float().tolist()[:2]}, expected {expected}"
    except RuntimeError as exc:  # gloo: "Invalid scalar type" (pytorch issue 111131)
        ok, why = False, f"bf16 all_reduce failed: {str(exc).splitlines()[0]}"
    # Agree across ranks, so that no rank registers a hook the others do not.
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if ok and not flag.item():
        ok, why = False, "bf16 all_reduce failed on another rank"
    return ok, f"{why} (backend {dist.get_backend(group)})"


def bf16_allreduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: all-reduce gradients in bf16, then copy back into the fp32 bucket.

    The same algorithm as torch's ``bf16_compress_hook``, under a name torch does not refuse
    on CPU (torch checks the hook's ``__name__`` against CUDA/NCCL).  No annotations: DDP
    compares them with ``dist.GradBucket`` and would reject this module's string
    annotations (``from __future__ import annotations``).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: "torch.futures.Future") -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(f.value()[0])
        return out

    return fut.then(decompress)


def _is_pair(comm_hook: Any) -> bool:
    return isinstance(comm_hook, tuple) and len(comm_hook) == 2 and callable(comm_hook[1])


def check_comm_hook(comm_hook: Any) -> None:
    """Raise :class:`PrepareError` unless ``comm_hook`` is one :func:`register_hook` takes."""
    if comm_hook in COMM_HOOKS or callable(comm_hook) or _is_pair(comm_hook):
        return
    raise PrepareError(
        f"comm_hook must be None, 'fp16', 'bf16', a hook or a (state, hook) pair. Got {comm_hook!r} instead.",
        fix="pass comm_hook='fp16' for fp16 gradient compression",
    )


def register_hook(ddp: nn.Module, comm_hook: Any, group: Any, strict: bool, notes: list[str],
) -> Optional[str]:
    """Register ``comm_hook`` on the DDP module; the name it is known by (None: no hook).

    ``"bf16"`` is probed first: when the backend cannot all-reduce bf16, warn and keep fp32, or raise :class:`PrepareError` when ``strict``.
    """
    if comm_hook is None:
        return None
    if comm_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return "fp16"
    if comm_hook == "bf16":
        ok, why = bf16_allreduce_supported(group)
        if not ok:
            if strict:
                raise PrepareError(f'comm_hook="bf16" requested, but {why}.', fix='use comm_hook="fp16" or None')
            msg = f'comm_hook="bf16" requested, but {why}: gradients are all-reduced in fp32'
            warn(msg)
            notes.append(msg)
            return None
        ddp.register_comm_hook(group, bf16_allreduce_hook)
        return "bf16"
    if _is_pair(comm_hook):
        state, hook = comm_hook
        ddp.register_comm_hook(state, hook)
        return getattr(hook, "__name__", "custom")
    check_comm_hook(comm_hook)
    ddp.register_comm_hook(group, comm_hook)
    return getattr(comm_hook, "__name__", "custom")
