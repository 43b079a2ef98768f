"""Lightning and Fabric on cpuddp: its launcher detection, its group (shm where ranks share a
node) and its pinning, through Lightning's own extension points.

Usage (one line each; ``lightning`` is imported only when these are called)::

    import cpuddp.lightning
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=cpuddp.lightning.trainer_strategy())
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=cpuddp.lightning.fabric_strategy())

The same script runs under ``torchrun --nproc-per-node 2``, ``mpiexec -n 2``, ``srun``, a
Kubeflow PyTorchJob, or as plain ``python train.py`` (Lightning then starts the other
``devices - 1`` processes itself).  Do not call :func:`cpuddp.init_distributed` first in a
plain ``python`` run: the strategy calls it in every process once the ranks exist.

- :func:`cluster_environment`: a Lightning ``ClusterEnvironment`` whose ranks come from
  :func:`cpuddp.launchers.detect` (every launcher cpuddp reads; no mpi4py).  The strategies use
  it whenever a launcher started the process; without one, Lightning's own environment
  launches the ranks.
- :func:`trainer_strategy` / :func:`fabric_strategy`: Lightning's ``DDPStrategy`` whose
  process group is formed by :func:`cpuddp.init_distributed` (backend ``"auto"`` unless
  ``backend=`` says otherwise, pinning on) instead of ``init_process_group``; their
  ``_process_group_backend`` then names the backend really in use (``"shm"``, not ``"gloo"``).

``package``: ``"lightning"`` (``import lightning``), ``"pytorch_lightning"`` (the
``pytorch_lightning`` and ``lightning_fabric`` packages) or ``"auto"`` (the first installed).
"""

from __future__ import annotations

import importlib
import logging
import os
from functools import lru_cache
from typing import Any, Mapping, Optional

from cpuddp.launchers.registry import detect

__all__ = ["cluster_environment", "trainer_strategy", "fabric_strategy", "lightning_ranks"]

log = logging.getLogger("cpuddp")

#: package name -> (Trainer's package, Fabric's package)
_PACKAGES = {"lightning": ("lightning.pytorch", "lightning.fabric"),
             "pytorch_lightning": ("pytorch_lightning", "lightning_fabric")}


def cluster_environment(package: str = "auto") -> Any:
    """A ``ClusterEnvironment`` with the ranks cpuddp reads from the launcher's variables."""
    return _classes(_package(package))["environment"]()


def trainer_strategy(backend: str = "auto", package: str = "auto", **ddp_kwargs: Any) -> Any:
    """``strategy=`` for ``Trainer``: Lightning's ``DDPStrategy`` on cpuddp's group and pinning.
    ``ddp_kwargs`` go to ``DDPStrategy`` (``find_unused_parameters=True``, ...)."""
    return _classes(_package(package))["trainer"](cpuddp_backend=backend, **ddp_kwargs)


def fabric_strategy(backend: str = "auto", package: str = "auto", **ddp_kwargs: Any) -> Any:
    """``strategy=`` for ``Fabric``: Fabric's ``DDPStrategy`` on cpuddp's group and pinning."""
    return _classes(_package(package))["fabric"](cpuddp_backend=backend, **ddp_kwargs)


def lightning_ranks(*, global_rank: int, world_size: int, local_rank: int, local_world_size: int,
                    node_rank: int, main_address: str, main_port: int) -> dict[str, str]:
    """The variables that describe a rank Lightning launched itself, for
    :func:`cpuddp.init_distributed` to read (its ``RANK``/``WORLD_SIZE`` reader)."""
    return {"RANK": str(global_rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size), "NODE_RANK": str(node_rank),
            "MASTER_ADDR": main_address, "MASTER_PORT": str(main_port)}


def _package(package: str) -> str:
    """``package`` checked, ``"auto"`` resolved to the first one installed."""
    if package not in ("auto", *_PACKAGES):
        raise ValueError(f"package={package!r} is not one of 'auto', 'lightning', 'pytorch_lightning'; "
                         "pass package='lightning' for `import lightning`")
    names = list(_PACKAGES) if package == "auto" else [package]
    for name in names:
        try:
            importlib.import_module(_PACKAGES[name][1])
        except ImportError:
            continue
        return name
    raise ImportError("cpuddp.lightning needs Lightning: pip install lightning "
                      "(or pip install 'cpuddp[frameworks]' for the tested versions)")


def _setup_on_cpuddp(strategy: Any, backend: str) -> None:
    """Form the group with :func:`cpuddp.init_distributed` in place of Lightning's
    ``_init_dist_connection``.  A rank Lightning launched itself is described to cpuddp through
    the ``RANK``/``WORLD_SIZE`` variables; a world of 1 formed earlier in this process (init
    called before Lightning launched the other ranks) is shut down and re-formed."""
    from .distributed import get_session, init_distributed, shutdown

    env = strategy.cluster_environment
    if not getattr(env, "_cpuddp", False):
        os.environ.update(lightning_ranks(
            global_rank=strategy.global_rank, world_size=strategy.world_size, local_rank=strategy.local_rank,
            local_world_size=strategy.num_processes, node_rank=strategy.node_rank,
            main_address=env.main_address, main_port=env.main_port))
    current = get_session()
    if current is not None and current.env.world_size != strategy.world_size:
        log.info("cpuddp: re-forming the group: world %d -> %d (Lightning launched the ranks)",
                 current.env.world_size, strategy.world_size)
        shutdown()
    init_distributed(backend)
    session = get_session()
    assert session is not None
    strategy._process_group_backend = session.backend
    if getattr(env, "_cpuddp", False):
        env._env = session.env


def _lightning_child(environ: Mapping[str, str]) -> bool:
    """A rank Lightning's self-launch started: ``LOCAL_RANK`` and ``WORLD_SIZE``, no ``RANK``."""
    return "RANK" not in environ and "LOCAL_RANK" in environ and "WORLD_SIZE" in environ


def _check_world(env: Any, num_devices: int, num_nodes: int) -> None:
    if num_devices * num_nodes != env.world_size():
        raise ValueError(
            f"Lightning was given devices={num_devices} and num_nodes={num_nodes} ({num_devices * num_nodes} ranks), "
            f"but the launcher ({env._env.launcher}) started {env.world_size()} "
            f"({env._env.local_world_size} on this node): pass devices={env._env.local_world_size}, "
            f"num_nodes={env._env.num_nodes}")


@lru_cache(maxsize=None)
def _classes(package: str) -> dict[str, type]:
    """The Lightning subclasses, made on first use so ``import cpuddp.lightning`` imports no Lightning."""
    trainer_pkg, fabric_pkg = _PACKAGES[package]
    environment = _environment_class(fabric_pkg)
    return {"environment": environment,
            "trainer": _trainer_class(trainer_pkg, fabric_pkg, environment),
            "fabric": _fabric_class(fabric_pkg, environment)}


def _environment_class(fabric_pkg: str) -> type:
    """``CpuddpEnvironment``, a subclass of the package's ``ClusterEnvironment``."""
    envs = importlib.import_module(f"{fabric_pkg}.plugins.environments")

    class CpuddpEnvironment(envs.ClusterEnvironment):  # type: ignore[misc, name-defined]
        """Ranks from :func:`cpuddp.launchers.detect`: Intel MPI, MPICH, Open MPI, MVAPICH, PMIx,
        Slurm, torchrun, Kubeflow -- no mpi4py.  The launcher starts the processes."""

        _cpuddp = True

        def __init__(self, environ: Optional[Mapping[str, str]] = None) -> None:
            super().__init__()
            self._env = detect(os.environ if environ is None else environ)

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return self._env.master_addr or "127.0.0.1"

        @property
        def main_port(self) -> int:
            return self._env.master_port

        @staticmethod
        def detect() -> bool:
            if _lightning_child(os.environ):
                return False  # a rank Lightning started itself: Lightning's own environment describes it
            return detect(os.environ).launcher != "none"

        def world_size(self) -> int:
            return self._env.world_size

        def set_world_size(self, size: int) -> None:
            pass  # the launcher's

        def global_rank(self) -> int:
            return self._env.rank

        def set_global_rank(self, rank: int) -> None:
            pass  # the launcher's

        def local_rank(self) -> int:
            return self._env.local_rank

        def node_rank(self) -> int:
            return self._env.node_rank

        def validate_settings(self, num_devices: int, num_nodes: int) -> None:
            _check_world(self, num_devices, num_nodes)

    return CpuddpEnvironment


def _with_environment(kwargs: dict[str, Any], environment: Any) -> dict[str, Any]:
    """``kwargs`` with ``cluster_environment=environment()`` when a launcher started the process
    and the user gave none."""
    if kwargs.get("cluster_environment") is None and environment.detect():
        kwargs["cluster_environment"] = environment()
    return kwargs


def _trainer_class(trainer_pkg: str, fabric_pkg: str, environment: type) -> type:
    """``CpuddpTrainerStrategy``, a subclass of the ``Trainer``'s ``DDPStrategy``."""
    trainer_ddp = importlib.import_module(f"{trainer_pkg}.strategies").DDPStrategy

    class CpuddpTrainerStrategy(trainer_ddp):  # type: ignore[misc, valid-type]
        """``DDPStrategy`` for ``Trainer`` whose group is cpuddp's (backend and pinning)."""

        def __init__(self, cpuddp_backend: str = "auto", **kwargs: Any) -> None:
            super().__init__(**_with_environment(kwargs, environment))
            self._cpuddp_backend = cpuddp_backend

        def setup_distributed(self) -> None:
            importlib.import_module(f"{fabric_pkg}.utilities.seed").reset_seed()  # as Lightning's does first
            self.set_world_ranks()
            _setup_on_cpuddp(self, self._cpuddp_backend)

    return CpuddpTrainerStrategy


def _fabric_class(fabric_pkg: str, environment: type) -> type:
    """``CpuddpFabricStrategy``, a subclass of Fabric's ``DDPStrategy``."""
    fabric_ddp = importlib.import_module(f"{fabric_pkg}.strategies").DDPStrategy

    class CpuddpFabricStrategy(fabric_ddp):  # type: ignore[misc, valid-type]
        """``DDPStrategy`` for ``Fabric`` whose group is cpuddp's (backend and pinning)."""

        def __init__(self, cpuddp_backend: str = "auto", **kwargs: Any) -> None:
            super().__init__(**_with_environment(kwargs, environment))
            self._cpuddp_backend = cpuddp_backend

        def _setup_distributed(self) -> None:
            self._set_world_ranks()
            _setup_on_cpuddp(self, self._cpuddp_backend)

    return CpuddpFabricStrategy
