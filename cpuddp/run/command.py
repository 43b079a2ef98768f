"""``cpuddp run [options] script.py [args]``: size, pin and launch a training job.

Usage::

    cpuddp run examples/finetune.py                        # one node: one rank per NUMA node
    cpuddp run --ranks-per-node 2 examples/finetune.py --bf16
    cpuddp run --cores-per-rank 14 train.py                # as many 14-core ranks as fit
    salloc -N 2 cpuddp run train.py                        # srun across the allocation
    cpuddp run --hosts node1,node2 train.py                # the installed MPI launcher
    cpuddp run --dry-run ...                               # print the plan and the command only

It reads the node's topology (:mod:`cpuddp.topology`), plans the ranks
(:func:`cpuddp.affinity.job.plan_run`: ranks per node, each rank's CPUs and threads), picks the
engine that is there (:mod:`cpuddp.run.launch`: torchrun's elastic agent on one node, srun in
a Slurm allocation, the MPI launcher for a host list), adds the runtime settings
(:mod:`cpuddp.run.settings`), prints the plan as a table and the exact command, then runs that
command as its child and waits (its exit code is the launcher's), exporting the launcher's pid
and host so that every rank ends when that launcher dies (:func:`cpuddp.run.rank.end_with_launcher`),
and ends its output with the first failing rank's message and fix, or, after Ctrl-C, with where
the same command resumes (:mod:`cpuddp.run.supervise`).  Each rank's
``init_distributed()`` then pins as planned.  A request that cannot be met ends here, before
anything starts, with the value and the fix (exit code 2).  ``--dry-run`` never imports torch.

Environment read: ``OMP_NUM_THREADS`` (refused when it contradicts the plan), ``SLURM_JOB_ID``,
``SLURM_STEP_ID``, ``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_CPUS_PER_NODE``,
``SLURM_CPUS_PER_TASK``, ``SLURMD_NODENAME``, ``CPUDDP_MPIEXEC``, ``LD_PRELOAD``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from typing import Any, Mapping, Optional, Sequence

from cpuddp.topology import here
from cpuddp.topology.model import Topology, synthetic_topology
from cpuddp.topology.read import read_topology

from .hosts import HostEntry, parse_hostfile, parse_hosts_option, ranks_from_slots
from .launch import MPI_NAMES, Launch, command_text, mpi_command, mpi_family, srun_command, torchrun_command
from cpuddp.affinity.job import RunPlan, RunPlanError, plan_run, plan_table
from .supervise import launch_and_report
from .settings import DEFAULTS, find_allocator, openmp_runtime, settings_env

__all__ = ["add_arguments", "run", "prepare_job", "check_script", "RunConfig"]

SSH_PORT = 22
HOST_CHECK_TIMEOUT = 3.0  # seconds for each host's ssh port to answer


#: torchrun's names for what ``cpuddp run`` plans itself -> ours.
_TORCHRUN_NAMES = {"--nproc-per-node": "--ranks-per-node N", "--nproc_per_node": "--ranks-per-node N",
                   "--nnodes": "--hosts H1,H2 (or --hostfile FILE; in a Slurm allocation, nothing)"}


class _TorchrunName(argparse.Action):
    """An option of torchrun's given to ``cpuddp run``: an error naming ours (not "unrecognized")."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser.error(f"{option_string} is torchrun's option; cpuddp run starts torchrun itself and takes "
                     f"{_TORCHRUN_NAMES[option_string]}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    size = p.add_argument_group("the plan (default: one rank per NUMA node)")
    size.add_argument("--ranks-per-node", type=int, metavar="N", help="ranks on each node")
    size.add_argument(*_TORCHRUN_NAMES, action=_TorchrunName, nargs="?", help=argparse.SUPPRESS)
    size.add_argument("--cores-per-rank", type=int, metavar="C", help="physical cores per rank (must divide the node's)")
    where = p.add_argument_group("where (default: this node; in a Slurm allocation: srun over it)")
    where.add_argument("--hosts", metavar="H1,H2", help="comma-separated hosts (host or host:N): started with the "
                       "installed MPI launcher")
    where.add_argument("--hostfile", metavar="FILE", help="one host per line: host, host:N, host slots=N, fd00::2, "
                       "[fd00::3]:N, fe80::1%%eth0; N (the same for every host) sets the ranks per node")
    where.add_argument("--launcher", metavar="PATH", help="the mpiexec/mpirun for --hosts (default $CPUDDP_MPIEXEC, else PATH)")
    where.add_argument("--no-host-check", action="store_true", help="skip resolving the hosts and probing their ssh port")
    where.add_argument("--max-restarts", type=int, default=0, metavar="R", help="one node: torchrun's --max-restarts (default 0)")
    tune = p.add_argument_group("runtime settings (defaults measured: docs/performance.md)")
    tune.add_argument("--allocator", choices=["auto", "jemalloc", "tcmalloc", "none"], default=DEFAULTS["allocator"],
                      help=f"LD_PRELOAD a system allocator (default {DEFAULTS['allocator']})")
    tune.add_argument("--omp", choices=["on", "off"], default=DEFAULTS["omp"],
                      help=f"OpenMP binding variables matching the plan (default {DEFAULTS['omp']})")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the command; start nothing")
    p.add_argument("script", help="the training script (run as `python script.py args` in every rank)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The options of ``cpuddp run`` (:func:`add_arguments`, which holds their defaults), typed
    and frozen.  ``script_args`` are the script's own arguments."""

    script: str
    script_args: tuple[str, ...]
    ranks_per_node: Optional[int]
    cores_per_rank: Optional[int]
    hosts: Optional[str]
    hostfile: Optional[str]
    launcher: Optional[str]
    no_host_check: bool
    max_restarts: int
    allocator: str
    omp: str
    dry_run: bool

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> RunConfig:
        """The config of the options :func:`add_arguments` parsed."""
        return cls(script=ns.script, script_args=tuple(ns.args), ranks_per_node=ns.ranks_per_node,
                   cores_per_rank=ns.cores_per_rank, hosts=ns.hosts, hostfile=ns.hostfile, launcher=ns.launcher,
                   no_host_check=ns.no_host_check, max_restarts=ns.max_restarts, allocator=ns.allocator, omp=ns.omp,
                   dry_run=ns.dry_run)


# --------------------------------------------------------------------------- gathering


def _host_entries(cfg: RunConfig) -> tuple[list[HostEntry], str]:
    """The host list of ``--hosts`` or ``--hostfile`` (:mod:`cpuddp.run.hosts`), and its source."""
    if cfg.hosts and cfg.hostfile:
        raise RunPlanError(f"--hosts {cfg.hosts} and --hostfile {cfg.hostfile} both given", fix="give one of them")
    if cfg.hostfile:
        try:
            with open(cfg.hostfile, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise RunPlanError(f"--hostfile {cfg.hostfile}: {exc.strerror}", fix="the path of a readable hostfile") from None
        return parse_hostfile(text, f"--hostfile {cfg.hostfile}"), f"--hostfile {cfg.hostfile}"
    if cfg.hosts:
        return parse_hosts_option(cfg.hosts), f"--hosts {cfg.hosts}"
    return [], ""


def _hosts(cfg: RunConfig) -> tuple[list[str], Optional[int], str]:
    """The host names, the ranks per node (``--ranks-per-node``, or the list's slot counts) and
    what set them."""
    entries, source = _host_entries(cfg)
    ranks = ranks_from_slots(entries, cfg.ranks_per_node, source)
    if ranks is None or cfg.ranks_per_node is not None:
        return [e.host for e in entries], ranks, "--ranks-per-node"
    if cfg.cores_per_rank is not None:
        raise RunPlanError(f"{source} gives {ranks} slot(s) per host and --cores-per-rank {cfg.cores_per_rank} "
                           "is given too", fix="drop the slot counts or --cores-per-rank")
    return [e.host for e in entries], ranks, f"the slot count of {source}:"


def _slurm_node(environ: Mapping[str, str]) -> tuple[Topology, int, Optional[int], bool]:
    """(node topology, nodes, SLURM_CPUS_PER_TASK, CPUs known) of the allocation."""
    from cpuddp.launchers.parsers import expand_tasks_per_node

    if environ.get("SLURM_STEP_ID"):
        raise RunPlanError(f"cpuddp run is already inside an srun step (SLURM_STEP_ID={environ['SLURM_STEP_ID']})",
                           fix="run `cpuddp run` from the batch script or the salloc shell, not under srun")
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1")
    raw = environ.get("SLURM_JOB_CPUS_PER_NODE", "")
    per_node = min(expand_tasks_per_node(raw)) if raw else None
    cpt = int(environ["SLURM_CPUS_PER_TASK"]) if environ.get("SLURM_CPUS_PER_TASK", "").strip() else None
    if environ.get("SLURMD_NODENAME"):  # on a node of the allocation (sbatch): its real layout
        return read_topology(), nodes, cpt, True
    if per_node is None:
        raise RunPlanError(f"SLURM_JOB_ID={environ.get('SLURM_JOB_ID')} but no SLURM_JOB_CPUS_PER_NODE",
                           fix="run cpuddp run inside salloc/sbatch, which set both")
    topo = dataclasses.replace(synthetic_topology(1, per_node), source="synthetic-slurm")
    return topo, nodes, cpt, False


def _find_launcher(cfg: RunConfig, environ: Mapping[str, str]) -> str:
    path = cfg.launcher or environ.get("CPUDDP_MPIEXEC") or shutil.which("mpiexec") or shutil.which("mpirun")
    if not path:
        raise RunPlanError(
            "--hosts/--hostfile need an MPI launcher and none is installed (no mpiexec or mpirun on PATH, "
            "no $CPUDDP_MPIEXEC, no --launcher)",
            fix="install Intel MPI, MPICH or Open MPI (e.g. `pip install mpich` into its own venv) and pass "
                "--launcher /path/to/mpiexec, or run inside a Slurm allocation (salloc/sbatch)")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise RunPlanError(f"launcher {path!r} is not an executable file", fix="--launcher /path/to/mpiexec")
    return path


def _family(launcher: str) -> str:
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=20)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = str(exc)
    family = mpi_family(text)
    if family is None:
        raise RunPlanError(f"launcher {launcher!r} is not Intel MPI, MPICH or Open MPI (`--version` said: {text.strip()[:200]!r})",
                           fix="--launcher the mpiexec/mpirun of one of " + ", ".join(MPI_NAMES.values()))
    return family


def check_hosts(hosts: Sequence[str], resolve=socket.getaddrinfo, connect=socket.create_connection) -> None:
    """Each host resolves; each that is not this machine answers on the ssh port."""
    from cpuddp.launchers.parsers import is_loopback

    name = here.hostname()
    me = {name, name.split(".")[0]}
    for host in hosts:
        try:
            addr = resolve(host, None)[0][4][0]
        except (OSError, IndexError):
            raise RunPlanError(f"host {host!r} (--hosts/--hostfile) is unknown: the name does not resolve",
                               fix="check the spelling, or add it to DNS or /etc/hosts") from None
        if is_loopback(addr) or host in me:
            continue
        try:
            connect((addr, SSH_PORT), timeout=HOST_CHECK_TIMEOUT).close()
        except OSError as exc:
            raise RunPlanError(
                f"host {host!r} ({addr}) is unreachable: no answer on port {SSH_PORT} within "
                f"{HOST_CHECK_TIMEOUT:g} s ({exc})",
                fix="check that the node is up and runs sshd (the MPI launcher starts ranks over ssh), "
                    "or --no-host-check") from None


def check_script(script: str) -> None:
    """The script is a file here (``--dry-run`` too: a plan for a script that is not there is no
    plan).  Every rank runs ``python SCRIPT args``: no module (``-m``), no other program."""
    if os.path.isfile(script):
        return
    what = "is a directory" if os.path.isdir(script) else "does not exist"
    raise RunPlanError(f"script {script!r} {what} (looked for {os.path.abspath(script)})",
                       fix="the path of your training script, a Python file: every rank runs `python SCRIPT args` "
                           "(for a module, pass a script that runs it: runpy.run_module('pkg.mod', run_name='__main__'))")


# --------------------------------------------------------------------------- deciding


def prepare_job(cfg: RunConfig, environ: Mapping[str, str]) -> tuple[RunPlan, Launch, list[str], list[str]]:
    """The plan, the launch, the host names and notes for ``cfg``; raises :class:`RunPlanError`."""
    hosts, ranks_per_node, ranks_source = _hosts(cfg)
    in_slurm = bool(environ.get("SLURM_JOB_ID")) and not hosts
    if in_slurm:
        topo, nodes, cpt, known = _slurm_node(environ)
    else:
        topo, nodes, cpt, known = read_topology(), max(1, len(hosts)), None, True
    plan = plan_run(topo, nodes=nodes, ranks_per_node=ranks_per_node, ranks_source=ranks_source,
                    cores_per_rank=cfg.cores_per_rank,
                    slurm_cpus_per_task=cpt, omp_num_threads=environ.get("OMP_NUM_THREADS"), cpus_known=known,
                    hosts=hosts)
    tpc = max(1, len(topo.usable) // max(1, len(topo.cores())))
    settings, notes = settings_env(cfg.allocator, cfg.omp, environ,
                                   allocator_path=None if cfg.allocator == "none" else find_allocator(cfg.allocator, environ),
                                   runtime=openmp_runtime())
    if cfg.max_restarts and (hosts or in_slurm):
        raise RunPlanError(f"--max-restarts {cfg.max_restarts} applies to one node (torchrun's agent)",
                           fix="drop --max-restarts, or requeue with Slurm (--requeue)")
    if hosts:
        launcher = _find_launcher(cfg, environ)
        if not cfg.no_host_check:
            check_hosts(hosts)
        launch = mpi_command(_family(launcher), launcher, plan, hosts, cfg.script, cfg.script_args,
                             threads_per_core=tpc, settings=settings)
    elif in_slurm:
        if shutil.which("srun") is None:
            raise RunPlanError(f"in a Slurm allocation (SLURM_JOB_ID={environ['SLURM_JOB_ID']}) but srun is not on PATH",
                               fix="add Slurm's bin directory to PATH (module load slurm)")
        launch = srun_command(plan, cfg.script, cfg.script_args, settings=settings, threads_per_core=tpc)
    else:
        launch = torchrun_command(plan, cfg.script, cfg.script_args, max_restarts=cfg.max_restarts, settings=settings)
    names = hosts or ([f"slurm node {i}" for i in range(nodes)] if in_slurm else [here.hostname()])
    return plan, launch, names, notes


def run(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> int:
    """``cpuddp run``: print the plan and the command, then run it (unless ``--dry-run``).

    ``args`` becomes a :class:`RunConfig` here, once; everything below takes that config.
    """
    environ = os.environ if environ is None else environ
    cfg = RunConfig.from_args(args)
    try:
        check_script(cfg.script)
        plan, launch, names, notes = prepare_job(cfg, environ)
    except RunPlanError as exc:
        print(f"cpuddp run: error: {exc}", file=sys.stderr)
        return 2
    print(plan_table(plan, names))
    print(f"# engine: {launch.engine}" + "".join(f"\n# {n}" for n in notes))
    print(command_text(launch))
    sys.stdout.flush()
    if cfg.dry_run:
        return 0
    # Each rank ends when the launcher dies, the launcher when this process dies; the output ends
    # with the first failure and its fix (cpuddp.run.supervise).
    return launch_and_report(launch.argv, {**environ, **launch.env})
