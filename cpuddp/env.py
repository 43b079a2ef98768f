"""``DistEnv``: where this process sits in the job, derived purely from environment variables.

:func:`detect` is a pure function of a mapping (``os.environ`` or a test's dict): it never
reads or writes the process environment itself, never imports torch or mpi4py, and never
talks to the network.  The launcher readers it uses, and their order, live in
:mod:`cpuddp.launchers`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # pragma: no cover
    from .affinity import PinPlan

__all__ = ["DistEnv", "detect", "DEFAULT_PORT", "PORT_RANGE"]

#: The port used when neither the user nor a job id gives one (torch's own default).
DEFAULT_PORT = 29500
#: Ports derived from a job id fall in this half-open range: above the usual services, below
#: Linux's default ephemeral range (32768-60999), so an outgoing connection rarely holds one.
PORT_RANGE = (20000, 32000)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    ``launcher`` names the launcher family whose variables were read (``"torchrun"``,
    ``"hydra"`` for Intel MPI/MPICH, ``"pmix"``, ``"openmpi"``, ``"mvapich"``, ``"slurm"``,
    ``"env"`` for plain ``RANK``/``WORLD_SIZE`` as Kubeflow sets them, ``"none"`` for a
    single process).  ``sources`` maps each field to the variable it came from, or to
    ``"derived: ..."`` / ``"default"``.  ``backend`` and ``pin_plan`` are filled in by
    :func:`cpuddp.init_distributed` once the process group exists.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "none"
    num_nodes: int = 1
    job_id: Optional[str] = None
    #: True under torchrun: its agent already hosts the rendezvous store at
    #: MASTER_ADDR:MASTER_PORT, so every rank is a client.
    agent_store: bool = False
    backend: Optional[str] = None
    pin_plan: Optional["PinPlan"] = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on the first rank of each node."""
        return self.local_rank == 0

    @property
    def single_node(self) -> bool:
        """True when every rank runs on this node."""
        return self.local_world_size == self.world_size

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    def replace(self, **changes: Any) -> "DistEnv":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view (for ``cpuddp doctor --json`` and logs)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "pin_plan"}
        out["sources"] = dict(self.sources)
        plan = self.pin_plan
        out["pin_plan"] = plan.as_dict() if plan is not None and hasattr(plan, "as_dict") else None
        return out

    def exported(self) -> dict[str, str]:
        """The torch-convention variables this environment stands for."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def detect(environ: Mapping[str, str]) -> DistEnv:
    """Build the :class:`DistEnv` that ``environ`` describes.

    Raises :class:`cpuddp.errors.LauncherEnvError` when the variables are half-set,
    inconsistent or malformed: partial information is an error, complete absence is a
    single process.
    """
    from .launchers import detect as _detect

    return _detect(environ)
