"""``cpuddp run``'s launch: which engine starts the ranks, and its exact command line (pure).

- One node (no ``--hosts``/``--hostfile``, not in a Slurm allocation): torch's elastic agent,
  ``python -m cpuddp.run.agent --standalone --nproc-per-node N --max-restarts R`` (torchrun,
  leaving the failure summary to ``cpuddp run``: :mod:`cpuddp.run.agent`), each
  rank started through :mod:`cpuddp.run.rank`, which pins it to its planned CPUs before the
  script (and torch, and OpenMP) loads.  The plan travels in ``CPUDDP_RANK_CPUS`` and
  ``CPUDDP_RANK_THREADS`` (``;``-separated, local rank order); :func:`cpuddp.affinity.plan_for`
  reads ``CPUDDP_RANK_CPUS`` too, so ``init_distributed()`` pins to the same CPUs.
- In a Slurm allocation (``SLURM_JOB_ID`` set; ``salloc``/``sbatch``): ``srun --nodes
  --ntasks-per-node --ntasks --cpus-per-task --cpu-bind=cores``; Slurm binds each task and
  ``init_distributed()`` pins inside that set.
- ``--hosts``/``--hostfile``: the MPI launcher installed (``--launcher``, ``$CPUDDP_MPIEXEC``,
  else ``mpiexec``/``mpirun`` on ``PATH``), recognised from its ``--version``: Intel MPI
  (``mpiexec -n -ppn -hosts``, ``I_MPI_PIN_DOMAIN``), MPICH's Hydra (``-bind-to core:C``),
  Open MPI (``mpirun -np --map-by ppr:N:node:PE=C --bind-to core --host h:N``).

Every engine starts each rank as ``python -m cpuddp.run.rank script.py args``: it ends the
rank when the launcher dies (:func:`cpuddp.run.rank.end_with_launcher`), then runs the script
as ``python script.py args`` would.

Everything here is a function of plain data (the plan, the options, an environment mapping,
the launcher's version text); :mod:`cpuddp.run` gathers the data and starts the command.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from cpuddp.affinity.job import RunPlan, RunPlanError

from .hosts import is_ipv6

__all__ = ["Launch", "mpi_family", "command_text", "torchrun_command", "srun_command", "mpi_command",
           "MPI_NAMES"]

#: The MPI families cpuddp run drives, as the table and errors name them.
MPI_NAMES = {"impi": "Intel MPI", "mpich": "MPICH (Hydra)", "openmpi": "Open MPI"}


@dataclass(frozen=True)
class Launch:
    """What ``cpuddp run`` starts: ``argv`` with ``env`` added to its environment."""

    engine: str  # "torchrun", "srun", "impi", "mpich" or "openmpi"
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def mpi_family(version_text: str) -> Optional[str]:
    """``"impi"``, ``"openmpi"`` or ``"mpich"`` from ``mpiexec --version``'s output, or None."""
    text = version_text.lower()
    if "intel(r) mpi" in text or "intel mpi" in text:
        return "impi"
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return None


def command_text(launch: Launch) -> str:
    """The command as a shell line that runs it: ``NAME=value`` assignments first (each value
    quoted, never the whole assignment: a quoted assignment is a command name to a shell,
    ``'CPUDDP_RANK_CPUS=0;1'``), then the argv, each word quoted where a shell needs it."""
    for name in launch.env:
        if not name.isidentifier():
            raise RunPlanError(f"variable name {name!r} cannot be set on a shell line", fix="a name of letters, digits and _")
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in launch.env.items()), shlex.join(launch.argv)])


def _rank_argv(script: str, args: Sequence[str], python: str) -> list[str]:
    """Each rank of every engine: the script through :mod:`cpuddp.run.rank` (it ends the rank with its launcher)."""
    return [python, "-m", "cpuddp.run.rank", script, *args]


def torchrun_command(plan: RunPlan, script: str, args: Sequence[str], *, max_restarts: int = 0,
                     settings: Mapping[str, str] = {}, python: str = sys.executable) -> Launch:
    """One node: torch's elastic agent, each rank through :mod:`cpuddp.run.rank`."""
    argv = [python, "-m", "cpuddp.run.agent", "--standalone", "--nproc-per-node", str(plan.ranks_per_node),
            "--max-restarts", str(max_restarts), "--module", "cpuddp.run.rank", script, *args]
    env = dict(settings)
    env["CPUDDP_RANK_CPUS"] = plan.rank_cpus_env()
    env["CPUDDP_RANK_THREADS"] = ";".join(str(s.threads) for s in plan.slots)
    # Set, so torchrun does not put its own 1 there (and warn); each rank's entry replaces it.
    env["OMP_NUM_THREADS"] = str(plan.threads)
    return Launch("torchrun", tuple(argv), env)


def srun_command(plan: RunPlan, script: str, args: Sequence[str], *, settings: Mapping[str, str] = {},
                 threads_per_core: int = 1, python: str = sys.executable) -> Launch:
    """A Slurm allocation: one srun step with the plan's counts; Slurm binds each task to its
    cores (``--cpus-per-task`` counts logical CPUs: a core's hyperthreads included)."""
    argv = ["srun", f"--nodes={plan.nodes}", f"--ntasks-per-node={plan.ranks_per_node}",
            f"--ntasks={plan.world_size}", f"--cpus-per-task={plan.cores_per_rank * threads_per_core}",
            "--cpu-bind=cores", *_rank_argv(script, args, python)]
    env = dict(settings)
    if plan.cpus_known:  # else (a login node) init_distributed() sizes the threads inside the bound set
        env["OMP_NUM_THREADS"] = str(plan.threads)
    return Launch("srun", tuple(argv), env)


def mpi_command(family: str, launcher: str, plan: RunPlan, hosts: Sequence[str], script: str,
                args: Sequence[str], *, threads_per_core: int = 1, settings: Mapping[str, str] = {},
                python: str = sys.executable) -> Launch:
    """A host list: the MPI launcher's own per-node count and binding flags; ``MASTER_ADDR`` is
    the first host when there are several (the rank-0 store's address, whatever the MPI)."""
    P, W, C = plan.ranks_per_node, plan.world_size, plan.cores_per_rank
    literal = [h for h in hosts if is_ipv6(h)]
    if literal:
        raise RunPlanError(f"host {literal[0]} is an IPv6 address: {MPI_NAMES.get(family, family)} reads `host:slots` in "
                           "its host list and cannot take one", fix="give that host by name (DNS or /etc/hosts); "
                           "cpuddp's own rendezvous takes IPv6 (MASTER_ADDR=fd00::2)")
    env = {**settings, "OMP_NUM_THREADS": str(plan.threads)}
    if len(hosts) > 1:  # the store's host: the first host holds rank 0 (docs/launchers.md)
        env["MASTER_ADDR"] = hosts[0]
    rank = _rank_argv(script, args, python)
    if family == "openmpi":
        argv = [launcher, "-np", str(W), "--map-by", f"ppr:{P}:node:PE={C}", "--bind-to", "core",
                "--host", ",".join(f"{h}:{P}" for h in hosts)]
        for k, v in env.items():
            argv += ["-x", f"{k}={v}"]
        return Launch(family, tuple(argv + rank), {})
    argv = [launcher, "-n", str(W), "-ppn", str(P), "-hosts", ",".join(hosts)]
    if family == "impi":
        env["I_MPI_PIN_DOMAIN"] = f"{C * threads_per_core}:compact"
    elif family == "mpich":
        argv += ["-bind-to", f"core:{C}"]
    else:
        raise RunPlanError(f"unknown MPI family {family!r}", fix=f"one of {', '.join(MPI_NAMES)}")
    for k, v in env.items():
        argv += ["-genv", k, v]
    return Launch(family, tuple(argv + rank), {})
