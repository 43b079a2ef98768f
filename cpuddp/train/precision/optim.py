"""The optimization step of :func:`cpuddp.prepare`: the fused-Adam switch (stock PyTorch) and
``ipex.optimize`` (IPEX), both keeping the user's optimizer object the one that trains.

The fusion decision (:func:`fusion_decision`) is a pure function of the optimizer's settings
and of whether this torch has a fused CPU Adam; :func:`fuse_optimizer` applies it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

__all__ = ["fusion_decision", "fuse_optimizer", "torch_has_fused_cpu_adam", "ipex_optimize"]


def torch_has_fused_cpu_adam() -> bool:
    """Does this torch build list the CPU among the devices with fused optimizer kernels?"""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return False
    return "cpu" in _get_fused_kernels_supported_devices()


def fusion_decision(optimizer: torch.optim.Optimizer, *, cpu_kernel: bool) -> tuple[bool, str]:
    """Pure: may ``optimizer`` be switched to the fused CPU kernel in place, and why (not)?

    Only an exact Adam/AdamW that has not stepped, left at ``fused=None`` with ``foreach``,
    ``capturable`` and ``differentiable`` unset, over real floating CPU tensors.
    ``cpu_kernel``: :func:`torch_has_fused_cpu_adam`.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False, f"{type(optimizer).__name__} has no fused CPU kernel we switch to"
    if not cpu_kernel:
        return False, f"torch {torch.__version__} has no fused CPU Adam"
    if optimizer.state:
        return False, "the optimizer has already stepped; left as it is"
    for group in optimizer.param_groups:
        if "fused" not in group:
            return False, "this torch's Adam has no 'fused' option"
        if group["fused"] is not None:
            return False, f"fused={group['fused']} set by the user; respected"
        if group.get("foreach") is not None or group.get("capturable") or group.get("differentiable"):
            return False, "foreach/capturable/differentiable set by the user; left unfused"
        for p in group["params"]:
            if p.device.type != "cpu" or not torch.is_floating_point(p) or p.is_sparse:
                return False, f"a parameter is {p.dtype} on {p.device}; the fused kernel needs real floating CPU tensors"
    return True, "switched to the fused CPU kernel"


def fuse_optimizer(optimizer: torch.optim.Optimizer) -> tuple[bool, str]:
    """Switch a stock Adam/AdamW to the fused CPU kernel in place, when safe."""
    ok, why = fusion_decision(optimizer, cpu_kernel=torch_has_fused_cpu_adam())
    if ok:
        for group in optimizer.param_groups:
            group["fused"] = True
        optimizer.defaults["fused"] = True
        optimizer._step_supports_amp_scaling = True  # as Adam.__init__ does for fused=True
    return ok, why


# --------------------------------------------------------------------------- IPEX


def adopt_optimizer(user: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Make the user's optimizer object behave as ``new`` (IPEX built a copy).

    Both then share the same param_groups, state and (patched) step.
    """
    if type(new) is not type(user):
        user.__class__ = type(new)
    user.__dict__ = new.__dict__


def ipex_optimize(
    ipex: Any,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    dtype: Optional[torch.dtype],
    notes: list[str],
) -> nn.Module:
    """``ipex.optimize(model, optimizer=..., dtype=..., inplace=True)``; notes what it changed."""
    if optimizer is None and model.training:
        model.eval()
        notes.append("IPEX without an optimizer optimizes for inference: model.eval() was called")
    kwargs: dict[str, Any] = {"dtype": dtype if dtype is not None else torch.float32, "inplace": True}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    result = ipex.optimize(model, **kwargs)
    if optimizer is None:
        return result
    new_model, new_opt = result
    if new_opt is not optimizer:
        adopt_optimizer(optimizer, new_opt)
        notes.append("IPEX returned a new optimizer; the user's object now shares its state and step")
    return new_model
