"""The launcher reader interface, and the reading every built-in reader shares.

A reader says whether its launcher's variables are present (:meth:`LauncherReader.detect`)
and reads them into a :class:`PartialEnv` (:meth:`LauncherReader.read`): what the launcher
said, with each value's :class:`~cpuddp.launchers.env.Provenance`.  Both take a mapping, never
``os.environ``, and import nothing.  :func:`cpuddp.launchers.detect` tries the registered
readers in order and then applies the rules every launcher shares (derivations, range
checks, rendezvous address and port), so a site reader added with
:func:`cpuddp.launchers.register_launcher` gets the same checks as the built-ins.

:class:`Variables` parses integers out of the mapping with errors in one voice: the
variable, its value, the launcher and the fix; :meth:`Variables.world` reads the rank and the
world size every launcher gives, and :class:`WorldReader` is a whole reader for a launcher
that sets a rank and a size variable (the MPI families).  Each built-in launcher's reader is a
module of its own beside this one (``read_<launcher>.py``); the registry
(:mod:`cpuddp.launchers.registry`) lists them, in their order, and says why that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from cpuddp.errors import LauncherEnvError

from .env import Provenance

__all__ = ["LauncherReader", "PartialEnv", "Variables", "WorldReader"]


@dataclass
class PartialEnv:
    """What one launcher said, before the rules every launcher shares.

    ``rank`` and ``world_size`` are required; leave a field None when the launcher does not
    say it (the local size of a single-node job, the node rank and node count are derived).
    ``hosts``: the job's hosts in node order, when the launcher lists them (rank 0's host is
    then the rendezvous address of a multi-node job with no ``MASTER_ADDR``).  ``sources``
    maps a field to the variable it came from (a plain name) or a
    :class:`~cpuddp.launchers.env.Provenance`.
    """

    rank: int
    world_size: int
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    node_rank: Optional[int] = None
    num_nodes: Optional[int] = None
    job_id: Optional[str] = None
    agent_store: bool = False
    hosts: Optional[list[str]] = None
    sources: dict[str, Union[str, Provenance]] = field(default_factory=dict)


class Variables:
    """A launcher's variables in ``environ``, read with errors that name the variable, its
    value, the launcher (``launcher``: its human name) and the fix.  ``sources`` maps a field
    to the variable it was read from, for the reads that name the field (``into=``); pass it
    on as :attr:`PartialEnv.sources`."""

    def __init__(self, environ: Mapping[str, str], launcher: str) -> None:
        self.environ = environ
        self.launcher = launcher
        self.sources: dict[str, Union[str, Provenance]] = {}

    def has(self, *names: str) -> bool:
        """True when any of ``names`` is set and not empty."""
        return any(self.environ.get(n, "") != "" for n in names)

    def first(self, *names: str) -> Optional[str]:
        """The first of ``names`` that is set and not empty, or None."""
        for n in names:
            if self.environ.get(n, "") != "":
                return n
        return None

    def error(self, msg: str, var: str, fix: str) -> LauncherEnvError:
        return LauncherEnvError(msg, variable=var, value=self.environ.get(var), launcher=self.launcher, fix=fix)

    def int(self, *names: str, minimum: int = 0, fix: Optional[str] = None, into: Optional[str] = None) -> int:
        """The first of ``names`` that is set, as an integer >= ``minimum``; an error when
        none is set (other variables of this launcher are: partial information).  ``into``:
        the field it goes to, recorded in :attr:`sources` with the variable read."""
        value = self.maybe_int(*names, minimum=minimum, fix=fix, into=into)
        if value is None:
            raise LauncherEnvError(
                f"{' or '.join(names)} is not set, but other {self.launcher} variables are",
                variable=names[0],
                value=None,
                launcher=self.launcher,
                fix=fix or f"start the job with the launcher itself, or export {names[0]}",
            )
        return value

    def maybe_int(self, *names: str, minimum: int = 0, fix: Optional[str] = None,
                  into: Optional[str] = None) -> Optional[int]:
        """Like :meth:`int`, but None (and nothing recorded) when none of ``names`` is set."""
        var = self.first(*names)
        if var is None:
            return None
        raw = self.environ[var].strip()
        try:
            value = int(raw, 10)
        except ValueError:
            raise self.error(f"{var} must be an integer", var, fix or f"export {var} as a whole number") from None
        if value < minimum:
            raise self.error(f"{var} must be >= {minimum}, got {value}", var, fix or f"export {var} >= {minimum}")
        if into is not None:
            self.sources[into] = var
        return value

    def world(self, rank: str, *sizes: str, fix: Optional[str] = None, size_fix: Optional[str] = None,
              job: tuple[str, ...] = ()) -> PartialEnv:
        """What every launcher says first: the rank (``rank``), the world size (the first of
        ``sizes`` that is set; ``size_fix`` or ``fix`` when it is wrong), each recorded in
        :attr:`sources`, and the job id (the first of ``job``, as :meth:`job_id` words it).
        The reader reads the rest into the :class:`PartialEnv` returned, whose ``sources`` is
        :attr:`sources`."""
        return PartialEnv(
            rank=self.int(rank, fix=fix, into="rank"),
            world_size=self.int(*sizes, minimum=1, fix=size_fix or fix, into="world_size"),
            job_id=self.job_id(*job),
            sources=self.sources,
        )

    def local(self, out: PartialEnv, rank_vars: tuple[str, ...], size_vars: tuple[str, ...]) -> None:
        """Read the local rank and size into ``out`` from the first of each set that is present."""
        rank_var, size_var = self.first(*rank_vars), self.first(*size_vars)
        if rank_var is not None:
            out.local_rank = self.int(rank_var)
            out.sources["local_rank"] = rank_var
        if size_var is not None:
            out.local_world_size = self.int(size_var, minimum=1)
            out.sources["local_world_size"] = size_var

    def job_id(self, *names: str) -> Optional[str]:
        """``NAME=value`` for the first of ``names`` that is set: a job id every rank shares."""
        var = self.first(*names)
        return None if var is None else f"{var}={self.environ[var]}"


class LauncherReader:
    """One launcher family: the interface of every built-in reader, for a site to subclass.

    ``description``: the launcher's human name in messages.  ``rank_variable``: its
    per-process rank variable, if any; another family's disagreeing rank variable is then an
    error (two launchers describing one process).  Implement :meth:`detect` and :meth:`read`;
    both are pure functions of ``environ``.  :meth:`declined` may log why the launcher's
    variables did not describe this process.  Register an instance with
    :func:`cpuddp.launchers.register_launcher`.
    """

    description: str = ""
    rank_variable: Optional[str] = None
    #: True when other launchers set ``rank_variable`` too (PMIx's ``PMIX_RANK``: Open MPI and
    #: Slurm set it): it is checked last, so a conflict names the launcher that set it.
    shared_rank_variable: bool = False
    #: True when the launcher starts its ranks as the processes of one MPI world (what
    #: ``backend='mpi'`` needs).
    mpi_world: bool = False

    def detect(self, environ: Mapping[str, str]) -> bool:
        """True when this launcher's variables describe this process."""
        raise NotImplementedError

    def declined(self, environ: Mapping[str, str]) -> None:
        """Called by :func:`cpuddp.launchers.detect` when it tried this reader and :meth:`detect`
        was false (the readers before it did not match either); the default does nothing."""

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        """What the launcher said (called only when :meth:`detect` is true).  Raise
        :class:`~cpuddp.errors.LauncherEnvError` (:meth:`variables` words it) for a value
        that is missing, malformed or out of range."""
        raise NotImplementedError

    def no_master_addr(self) -> Optional[LauncherEnvError]:
        """The error for a multi-node job with neither ``MASTER_ADDR`` nor ``hosts``; None
        (the default): rank 0's address is learned over MPI at init (needs mpi4py)."""
        return None

    def variables(self, environ: Mapping[str, str]) -> Variables:
        return Variables(environ, self.description or type(self).__name__)


class WorldReader(LauncherReader):
    """A launcher that names the rank and the world size in a variable each, and the local
    rank and size in others (the MPI families): a reader is its variables.

    ``size_variable``: the world size; ``job_variables``: the job id's (the first set);
    ``local_variables``: the local rank's and the local size's, each the first set of its
    tuple; ``fix``: what to do when a value is missing or wrong (``size_fix`` for the size,
    when it differs).  :meth:`detect` is true when the rank or the size is set.
    """

    size_variable: str = ""
    job_variables: tuple[str, ...] = ()
    local_variables: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    fix: Optional[str] = None
    size_fix: Optional[str] = None

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has(str(self.rank_variable), self.size_variable)

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        out = v.world(str(self.rank_variable), self.size_variable, fix=self.fix, size_fix=self.size_fix,
                      job=self.job_variables)
        v.local(out, *self.local_variables)
        return out
