"""No silent divergent replicas, no silent single rank: checks at each optimizer's first
``step()``.

- In a job of more than one rank, a warning when the optimizer's parameters are not wrapped
  by ``DistributedDataParallel`` (or FSDP).
- In a world of 1 (a plain ``python`` run), an error when ``WORLD_SIZE`` > 1 was set after
  init: a framework (Lightning's ``devices=N`` self-launch) started more ranks, and this
  process would otherwise train alone beside them.

:func:`cpuddp.init_distributed` installs the checks (a torch optimizer step pre-hook, run once
per optimizer) and :func:`cpuddp.shutdown` removes them.  Without DDP each rank trains its
own copy of the model and ends with different weights -- what accelerate does on a CPU-only host without
``use_cpu=True`` (``DistributedType.NO``), and what a hand-written loop does without
``cpuddp.prepare``/``DDP``.  A loop that averages the gradients itself can turn the check off
with ``CPUDDP_DDP_CHECK=0``.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
import weakref
from typing import Any, Iterable, Mapping, Optional

from .errors import LauncherEnvError

__all__ = ["install", "uninstall", "unwrapped", "warning_text", "grown_world"]

log = logging.getLogger("cpuddp")

_handle: Any = None
_checked: "weakref.WeakSet[Any]" = weakref.WeakSet()
_world = 1


def unwrapped(stepped: Iterable[int], wrapped: Iterable[int]) -> int:
    """How many of the stepped parameters (ids) no data-parallel wrapper holds (pure)."""
    held = set(wrapped)
    return sum(1 for p in stepped if p not in held)


def warning_text(optimizer: str, count: int, world_size: int) -> str:
    """The warning, in one voice with cpuddp's errors: what, why, the fix."""
    return (
        f"cpuddp: {optimizer}.step() updates {count} parameter tensor(s) that no DistributedDataParallel wraps, "
        f"in a job of {world_size} ranks: every rank trains its own copy and the replicas diverge. "
        "Fix: wrap the model (cpuddp.prepare(model, optimizer) or DDP(model)); accelerate/Trainer on a CPU-only "
        "host: Accelerator(cpu=True) / TrainingArguments(use_cpu=True); Lightning: strategy="
        "cpuddp.lightning.trainer_strategy(). If you average the gradients yourself, set CPUDDP_DDP_CHECK=0"
    )


def grown_world(world_size: int, environ: Mapping[str, str]) -> Optional[LauncherEnvError]:
    """The error when a world of 1 that init formed meets ``WORLD_SIZE`` > 1 set since (pure):
    a framework (Lightning's ``devices=N``) started more ranks, which this process cannot join."""
    size = environ.get("WORLD_SIZE", "").strip()
    if world_size != 1 or not size.isdigit() or int(size) <= 1:
        return None
    return LauncherEnvError(
        f"this process's group has 1 rank (cpuddp.init_distributed() ran before any launcher), but WORLD_SIZE={size} "
        "was set since: a framework started more ranks (Lightning/Fabric devices=N), and they cannot join it; "
        "training on would run this rank alone",
        variable="WORLD_SIZE", value=size, launcher="a framework's own launch (Lightning devices=N?)",
        fix="do not call cpuddp.init_distributed() before Trainer/Fabric in a plain `python` run: pass "
        "strategy=cpuddp.lightning.trainer_strategy() (Fabric: fabric_strategy()), or start the ranks with "
        "torchrun --nproc-per-node N / mpiexec -n N",
    )


def install(world_size: int, environ: Optional[Mapping[str, str]] = None) -> None:
    """Check each optimizer's first step (once per optimizer) in a world of ``world_size``."""
    global _handle, _world
    environ = os.environ if environ is None else environ
    if _handle is not None or environ.get("CPUDDP_DDP_CHECK", "1").strip() == "0":
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _world = world_size
    _handle = register_optimizer_step_pre_hook(_first_step)


def uninstall() -> None:
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None


def _first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if optimizer in _checked:
        return
    _checked.add(optimizer)
    if _world == 1:
        error = grown_world(_world, os.environ)
        if error is not None:
            raise error
        return
    stepped = [id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    count = unwrapped(stepped, _wrapped_parameter_ids())
    if count:
        log.warning(warning_text(type(optimizer).__name__, count, _world))


def _wrapped_parameter_ids() -> set[int]:
    """The parameters every live DDP/FSDP module holds (a scan of the live objects, once per
    optimizer: the wrappers mark nothing on the parameters themselves)."""
    kinds = _wrapper_types()
    ids: set[int] = set()
    with warnings.catch_warnings():  # isinstance() on some lazy module proxies warns
        warnings.simplefilter("ignore")
        wrappers = [obj for obj in gc.get_objects() if isinstance(obj, kinds)]
    for obj in wrappers:
        ids.update(id(p) for p in obj.parameters())
    return ids


def _wrapper_types() -> tuple[type, ...]:
    from torch.nn.parallel import DistributedDataParallel

    kinds: list[type] = [DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds += [FullyShardedDataParallel, FSDPModule]
    except ImportError:  # pragma: no cover - older torch
        pass
    return tuple(kinds)
