"""cpuddp: distributed data-parallel PyTorch training on CPU clusters.

    import cpuddp
    env = cpuddp.init_distributed()           # mpirun, torchrun, srun, Kubeflow or plain python
    model = cpuddp.prepare(model, optimizer)  # bf16/fused/IPEX optimizations + DDP

``import cpuddp`` is light: it imports neither torch nor any optional package (IPEX, the
oneCCL bindings, mpi4py, transformers, py-cpuinfo).  Each public name is loaded from its
module on first use.

The top level holds what a training script uses (README.md, "Public API"); introspection
and extension details stay in their public submodules (``cpuddp.backends``, ``cpuddp.launchers``,
``cpuddp.topology``, ``cpuddp.affinity``, ``cpuddp.shm``, ``cpuddp.testing``, ``cpuddp.lightning``).
How the package is laid out, and which area may import which: docs/code.md.

``_EXPORTS`` below is the one list: ``__all__`` is built from it, and tests/test_api.py pins
it, the TYPE_CHECKING imports and the deprecated aliases together.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._package import __version__, lazy_names

# public name -> module that defines it
_EXPORTS = {
    # env / launchers
    "DistEnv": "launchers.env",
    "detect": "launchers.registry",
    "register_launcher": "launchers.registry",
    # distributed
    "init_distributed": "distributed",
    "shutdown": "distributed",
    "get_env": "distributed",
    "get_session": "distributed",
    "Session": "distributed",
    "session": "distributed",
    # where this process sits, before or after init; rank-0 output
    "get_rank": "ranks",
    "get_world_size": "ranks",
    "get_local_rank": "ranks",
    "get_local_world_size": "ranks",
    "print0": "ranks",
    "log0": "ranks",
    # prepare and the loop helpers
    "prepare": "train.prepare",
    "PrepareInfo": "train.prepare",
    "prepared_info": "train.prepare",
    "unwrap": "train.strategies.base",
    "shard": "train.common.data",
    "ShardedLoader": "train.common.data",
    "autocast_for": "train.loop",
    "reduce_mean": "train.loop",
    "is_main_process": "train.loop",
    "barrier": "train.loop",
    "save_state_dict": "train.loop",
    "load_state_dict": "train.loop",
    "clip_grad_norm_": "train.grads",
    "no_sync": "train.grads",
    "save_checkpoint": "train.checkpoint.save",
    "load_checkpoint": "train.checkpoint.load",
    "Progress": "train.progress",
    "ProgressSummary": "train.progress",
    # backends
    "available_backends": "backends.registry",
    "register_backend": "backends.registry",
    # pinning
    "PinPlan": "affinity.plan",
    "pinned": "affinity.pin",
    # errors
    "CpuddpError": "errors",
    "LauncherEnvError": "errors",
    "BackendError": "errors",
    "RendezvousError": "errors",
    "PrepareError": "errors",
    "CheckpointError": "errors",
    "RankFailedError": "errors",
}

# Deprecated top-level names (one release): old name -> (module, name there).  They still
# resolve, with a DeprecationWarning naming the new path, but are not in __all__ or dir().
_DEPRECATED = {
    "BackendStatus": ("backends", "BackendStatus"),
    "BackendChoice": ("backends", "BackendChoice"),
    "resolve_backend": ("backends", "resolve_backend"),
    "backend_status": ("backends", "backend_status"),
    "unregister_backend": ("backends", "unregister_backend"),
    "Topology": ("topology", "Topology"),
    "read_topology": ("topology", "read_topology"),
    "cpu_features": ("topology", "cpu_features"),
    "plan_for": ("affinity", "plan_for"),
    "current_plan": ("affinity", "current_plan"),
    "autocast": ("train.loop", "autocast_for"),
}

__all__ = sorted(["__version__", *_EXPORTS])


_load, __dir__ = lazy_names(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        module, new = _DEPRECATED[name]
        path = f"cpuddp.{new}" if new in _EXPORTS else f"cpuddp.{module}.{new}"
        from .errors import warn

        warn(f"cpuddp.{name} is deprecated and goes in the next release; use {path}", DeprecationWarning)
        return getattr(importlib.import_module(f"cpuddp.{module}"), new)
    return _load(name)


if TYPE_CHECKING:  # pragma: no cover  # noqa: F401 (names for type checkers)
    from .affinity.pin import pinned
    from .affinity.plan import PinPlan
    from .backends.registry import available_backends, register_backend
    from .distributed import Session, get_env, get_session, init_distributed, session, shutdown
    from .errors import (
        BackendError,
        CheckpointError,
        CpuddpError,
        LauncherEnvError,
        PrepareError,
        RankFailedError,
        RendezvousError,
    )
    from .launchers.env import DistEnv
    from .launchers.registry import detect, register_launcher
    from .ranks import get_local_rank, get_local_world_size, get_rank, get_world_size, log0, print0
    from .train.common.data import ShardedLoader, shard
    from .train.loop import (
        autocast_for,
        barrier,
        is_main_process,
        load_state_dict,
        reduce_mean,
        save_state_dict,
    )
    from .train.grads import clip_grad_norm_, no_sync
    from .train.strategies.base import unwrap
    from .train.prepare import PrepareInfo, prepare, prepared_info
    from .train.checkpoint.load import load_checkpoint
    from .train.checkpoint.save import save_checkpoint
    from .train.progress import Progress, ProgressSummary
