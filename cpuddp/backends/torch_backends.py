"""The backends built into torch, as the pipeline sees them (:class:`~cpuddp.backends.types.BackendSpec`):
each one's check (torch's ``is_<name>_available``), and what else is its own.

* :class:`GlooBackend`: the fallback of ``backend="auto"`` (an error when even gloo cannot run),
  and a node-to-node leg of the shm group (``ProcessGroupGloo``).
* :class:`MpiBackend`: needs ranks started by an MPI launcher.
* :class:`NcclBackend`: CUDA only, and needs a CUDA device.

Nothing here imports torch until a check or a group asks for it.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from cpuddp.errors import BackendError
from cpuddp.launchers.registry import starts_mpi_world

from .types import BackendChoice, BackendName, BackendSpec, BackendStatus, Lookups, _torch_version

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

__all__ = ["TorchBackend", "GlooBackend", "MpiBackend", "NcclBackend", "torch_probe"]


def torch_probe(check: str, what: str) -> Callable[[Lookups], Tuple[bool, str]]:
    """A check that asks ``torch.distributed.<check>()`` (``what``: why not, when it says no)."""

    def probe(lk: Lookups) -> Tuple[bool, str]:
        import torch.distributed as dist

        if not dist.is_available():
            return False, "torch was built without torch.distributed"
        ok = bool(getattr(dist, check, lambda: False)())
        return ok, (f"built into torch {_torch_version(lk)}" if ok else what)

    return probe


class TorchBackend(BackendSpec):
    """A backend built into torch: checking it imports torch."""

    built_into_torch = True


class GlooBackend(TorchBackend):
    """torch's CPU backend: auto's fallback, and a leg between nodes."""

    #: torch 2.8's gloo returns the *sum* for ReduceOp.AVG in reduce_scatter (ranks holding 1 and 2
    #: got 3, not 1.5): FSDP2's gradients N times too large, silently.
    averages_in_reduce_scatter = False

    def auto_choice(self, reason: str, inter: Optional[str], lk: Lookups, probe_torch: bool) -> BackendChoice:
        """gloo when nothing faster runs (``reason`` says why); without torch (``cpuddp doctor``
        without ``--torch``) taken as built in, as in every PyPI torch."""
        if probe_torch:
            st = self.status(lk)
            if not st.available:
                raise BackendError(
                    f"backend='auto' found nothing to run: {reason}; gloo: {st.reason}",
                    fix="install a torch built with gloo (every PyPI build is), or name a backend",
                )
        return BackendChoice(self.name, f"auto: gloo, because {reason}", None, BackendName.AUTO)

    def create_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, size, timeout)


class MpiBackend(TorchBackend):
    """torch's MPI backend: every rank must be in one MPI world, so an MPI launcher started them.
    As the shm group's node-to-node leg, MPI runs through mpi4py instead (any PyPI torch), not
    torch's own (which needs a torch built from source against an MPI)."""

    def leg_status(self, env: "DistEnv", lk: Lookups) -> BackendStatus:
        """The MPI leg (mpi4py) can run where an MPI launcher, or srun, started the ranks as one MPI
        world and mpi4py finds an MPI library; every rank then checks, once MPI has started, that
        MPI's world is the launcher's (:mod:`cpuddp.backends.shm.cross.legs`)."""
        if not starts_mpi_world(env.launcher):
            return BackendStatus(self.name, False, f"the job was started by {env.launcher}, not by an MPI launcher")
        from cpuddp.launchers.mpi import find_library

        found = (lk.mpi_library or find_library)(lk.environ)
        if not found.ok:
            return BackendStatus(self.name, False, found.reason)
        return BackendStatus(self.name, True, f"mpi4py with {found.library}", version=found.library)

    def check_request(self, env: "DistEnv", device: Optional[str]) -> None:
        if env.world_size > 1 and not starts_mpi_world(env.launcher):
            raise BackendError(
                f"backend={self.name!r} needs ranks started by an MPI launcher, but this job was started by "
                f"{env.launcher!r} (each rank would be an MPI world of its own)",
                fix="launch with mpiexec/mpirun/srun --mpi, or pass backend='gloo'",
            )
        super().check_request(env, device)


class NcclBackend(TorchBackend):
    """NVIDIA NCCL: torch must have it, and see a CUDA device."""

    def _check(self, lk: Lookups) -> BackendStatus:
        import torch

        ok, reason = torch_probe("is_nccl_available", "torch was built without NCCL")(lk)
        if ok and not torch.cuda.is_available():
            ok, reason = False, "torch has NCCL but sees no CUDA device (torch.cuda.is_available() is False)"
        return BackendStatus(self.name, ok, reason, None, self.module, self.devices, self.distribution)
