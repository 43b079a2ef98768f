"""cpuddp: distributed data-parallel PyTorch training on CPU clusters.

    import cpuddp
    env = cpuddp.init_distributed()           # mpirun, torchrun, srun, Kubeflow or plain python
    model = cpuddp.prepare(model, optimizer)  # bf16/fused/IPEX optimizations + DDP

``import cpuddp`` is light: it imports neither torch nor any optional package (IPEX, the
oneCCL bindings, mpi4py, transformers, py-cpuinfo).  Each public name is loaded from its
module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # env / launchers
    "DistEnv": "env",
    "detect": "env",
    # distributed
    "init_distributed": "distributed",
    "shutdown": "distributed",
    "get_env": "distributed",
    "session": "distributed",
    # prepare and the loop helpers
    "prepare": "preparation",
    "PrepareInfo": "preparation",
    "prepared_info": "preparation",
    "unwrap": "preparation",
    "shard": "loop",
    "ShardedLoader": "loop",
    "autocast": "loop",
    "reduce_mean": "loop",
    "is_main_process": "loop",
    "barrier": "loop",
    "save_state_dict": "loop",
    "load_state_dict": "loop",
    "Progress": "progress",
    "ProgressSummary": "progress",
    # backends
    "available_backends": "backends",
    "backend_status": "backends",
    "resolve_backend": "backends",
    "register_backend": "backends",
    "unregister_backend": "backends",
    "BackendStatus": "backends",
    "BackendChoice": "backends",
    # pinning and topology
    "PinPlan": "affinity",
    "plan_for": "affinity",
    "current_plan": "affinity",
    "pinned": "affinity",
    "Topology": "topology",
    "read_topology": "topology",
    "cpu_features": "topology",
    # errors
    "CpuddpError": "errors",
    "LauncherEnvError": "errors",
    "BackendError": "errors",
    "RendezvousError": "errors",
    "PrepareError": "errors",
    "RankFailedError": "errors",
}

__all__ = sorted(["__version__", *_EXPORTS])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpuddp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"cpuddp.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover  # noqa: F401 (names for type checkers)
    from .distributed import get_env, init_distributed, session, shutdown
    from .backends import (
        BackendChoice,
        BackendStatus,
        available_backends,
        backend_status,
        register_backend,
        resolve_backend,
        unregister_backend,
    )
    from .affinity import PinPlan, current_plan, pinned, plan_for
    from .env import DistEnv, detect
    from .loop import (
        ShardedLoader,
        autocast,
        barrier,
        is_main_process,
        load_state_dict,
        reduce_mean,
        save_state_dict,
        shard,
    )
    from .preparation import PrepareInfo, prepare, prepared_info, unwrap
    from .topology import Topology, cpu_features, read_topology
    from .errors import (
        BackendError,
        CpuddpError,
        LauncherEnvError,
        PrepareError,
        RankFailedError,
        RendezvousError,
    )
