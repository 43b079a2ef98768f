"""``DistEnv``: where the launcher put this process -- plain data, nothing else.

:class:`DistEnv` holds the launcher's facts (rank, sizes, rendezvous address, job id) and,
for each, where it came from (:class:`Provenance`: a :class:`Source` and a detail).  The
readers that build it from a launcher's variables, and their order, live in
:mod:`cpuddp.launchers` (:func:`cpuddp.launchers.detect`); this module imports none of
them.  What :func:`cpuddp.init_distributed` chose afterwards (the backend, the pinning plan)
belongs to the session (:func:`cpuddp.distributed.get_session`), not here.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from cpuddp.errors import warn

__all__ = ["DistEnv", "Source", "Provenance", "DEFAULT_PORT", "PORT_RANGE"]

#: The port used when neither the user nor a job id gives one (torch's own default).
DEFAULT_PORT = 29500
#: Ports derived from a job id fall in this half-open range: above the usual services, below
#: Linux's default ephemeral range (32768-60999), so an outgoing connection rarely holds one.
PORT_RANGE = (20000, 32000)


class Source(enum.Enum):
    """What kind of source a :class:`DistEnv` field has."""

    #: An environment variable (the launcher's, or one the user exported); detail: its name.
    VARIABLE = "variable"
    #: Computed from other facts; detail: how.
    DERIVED = "derived"
    #: Nothing said anything; the default applies.
    DEFAULT = "default"
    #: Learned at init (rank 0's address over MPI); detail: how.
    PENDING = "pending"


class Provenance(str):
    """Where one field came from: ``kind`` (a :class:`Source`) and ``detail``.

    It *is* the text cpuddp shows (``"PMI_RANK"``, ``"derived: one node"``, ``"default"``,
    ``"pending: broadcast from rank 0 over MPI"``), so ``DistEnv.sources`` prints, compares
    and serialises as plain strings; code decides on ``kind``, never on the text.
    """

    kind: Source
    detail: str

    def __new__(cls, kind: Source, detail: str = "") -> "Provenance":
        if kind is Source.VARIABLE and not detail:
            raise ValueError("a Source.VARIABLE provenance needs the variable's name as its detail")
        if kind is Source.VARIABLE:
            text = detail
        elif kind is Source.DEFAULT:
            text, detail = "default", ""
        else:
            text = f"{kind.value}: {detail}"
        self = super().__new__(cls, text)
        self.kind, self.detail = kind, detail
        return self

    def __reduce__(self) -> Any:
        return (Provenance, (self.kind, self.detail))

    def __repr__(self) -> str:
        return f"Provenance({self.kind}, {self.detail!r})"

    @classmethod
    def variable(cls, name: str) -> "Provenance":
        return cls(Source.VARIABLE, name)

    @classmethod
    def derived(cls, how: str) -> "Provenance":
        return cls(Source.DERIVED, how)

    @classmethod
    def default(cls) -> "Provenance":
        return cls(Source.DEFAULT)

    @classmethod
    def pending(cls, how: str) -> "Provenance":
        return cls(Source.PENDING, how)

    @classmethod
    def of(cls, value: Union[str, "Provenance"]) -> "Provenance":
        """``value`` as a Provenance: itself, or its text read back (the inverse of ``str()``,
        for plain data such as ``DistEnv.as_dict()``'s or a plain string a reader gave)."""
        if isinstance(value, Provenance):
            return value
        text = str(value).strip()
        if text == "default":
            return cls.default()
        for kind in (Source.DERIVED, Source.PENDING):
            if text.startswith(f"{kind.value}:"):
                return cls(kind, text[len(kind.value) + 1:].strip())
        return cls.variable(text)

    @property
    def from_variable(self) -> bool:
        """True when a variable said it (the launcher or the user), not cpuddp."""
        return self.kind is Source.VARIABLE


def _deprecated(name: str, instead: str) -> None:
    warn(f"DistEnv.{name} is deprecated and will be removed in the next release: DistEnv holds the "
         f"launcher's facts only; use {instead}", DeprecationWarning)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as its launcher said (plain, picklable data).

    ``launcher`` names the launcher family whose variables were read (``"torchrun"``,
    ``"hydra"`` for Intel MPI/MPICH, ``"pmix"``, ``"openmpi"``, ``"mvapich"``, ``"slurm"``,
    ``"env"`` for plain ``RANK``/``WORLD_SIZE`` as Kubeflow sets them, a registered site
    launcher's name, ``"none"`` for a single process).  ``sources`` maps each field to its
    :class:`Provenance` (which reads as the variable's name, ``"derived: ..."``,
    ``"default"`` or ``"pending: ..."``).

    ``backend`` and ``pin_plan`` are deprecated read-only properties, forwarded to the
    session :func:`cpuddp.init_distributed` formed (``cpuddp.get_session()``).
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
    sources: Mapping[str, Provenance] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", {k: Provenance.of(v) for k, v in self.sources.items()})

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

    # -- deprecated: fields of Session, forwarded for one release ----------------------------

    @property
    def backend(self) -> Optional[str]:
        """Deprecated: the backend init chose; use ``cpuddp.get_session().backend``."""
        _deprecated("backend", "cpuddp.get_session().backend")
        return self._chosen()["backend"]

    @property
    def pin_plan(self) -> Any:
        """Deprecated: the pinning plan init applied; use ``cpuddp.get_session().pin_plan``
        (or ``cpuddp.affinity.current_plan()``)."""
        _deprecated("pin_plan", "cpuddp.get_session().pin_plan")
        session = self.__dict__.get("_session")
        return None if session is None else session.pin_plan

    def _chosen(self) -> dict[str, Any]:
        session = self.__dict__.get("_session")
        return {"backend": None, "pin_plan": None} if session is None else session.chosen()

    def _attach_session(self, session: Any) -> None:
        """Let the deprecated ``backend``/``pin_plan`` forward to ``session`` (which has
        ``backend``, ``pin_plan`` and ``chosen()``); :mod:`cpuddp.distributed` calls this."""
        object.__setattr__(self, "_session", session)

    # ---------------------------------------------------------------------------------------

    def replace(self, **changes: Any) -> "DistEnv":
        new = dataclasses.replace(self, **changes)
        if "_session" in self.__dict__:
            new._attach_session(self.__dict__["_session"])
        return new

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view (for ``cpuddp doctor --json`` and logs).  The ``backend`` and
        ``pin_plan`` keys are deprecated with the properties (None unless init linked a
        session); ``cpuddp.get_session().as_dict()`` has them."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}
        chosen = self._chosen()
        out["backend"] = chosen["backend"]  # (the keys in the order they have always had)
        out["sources"] = {k: str(v) for k, v in self.sources.items()}
        out["pin_plan"] = chosen["pin_plan"]
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
