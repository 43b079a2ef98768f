"""``cpuddp doctor``: what cpuddp sees here, what it would do, and what looks wrong.

Usage::

    cpuddp doctor             # a readable report
    cpuddp doctor --json      # the same report as JSON (one object)
    cpuddp doctor --strict    # exit 3 when there is any warning (for CI)
    cpuddp doctor --torch     # also import torch (about 2 s) to probe gloo/mpi/nccl and torch.cpu
    cpuddp doctor --ranks 4   # from a shell: what a job of 4 ranks would get here
    torchrun --nproc-per-node 2 -m cpuddp doctor   # under a launcher: one report, from rank 0
    mpiexec -n 2 cpuddp doctor --all-ranks --json  # every rank's own report

Sections: the launcher and the :class:`~cpuddp.launchers.env.DistEnv` it describes (or the
:class:`~cpuddp.errors.LauncherEnvError` that explains why there is none); the collective
backends, with versions and the reason each can or cannot run; whether torch, IPEX and the
oneCCL bindings' versions match; the CPU model and features (AVX-512, AVX512-BF16, AMX);
sockets, cores, threads, the allowed CPU set and the cgroup quota; the thread variables;
the pinning plan cpuddp would apply for each local rank of this node, as a table; from a
shell (no launcher), what a job here would get instead -- the plan ``cpuddp run`` would use
(:func:`cpuddp.affinity.job.plan_run`: by default one rank per NUMA node, ``--ranks N`` for
N) with each rank's CPUs and threads, and the backend ``"auto"`` would pick for it; the host's name resolution and the
``GLOO_SOCKET_IFNAME`` cpuddp would export; and warnings (oversubscription, a conflicting
``OMP_NUM_THREADS``, a hostname resolving to loopback in a multi-node job, a missing
``MASTER_ADDR``, IPEX or bindings built for another torch, and the pinning planner's own).

Under a launcher with two or more ranks, only global rank 0 prints: one report, its pinning
table covering every local rank of its node (each computed as that rank's
``init_distributed()`` computes it).  ``--all-ranks`` has every rank print its own report.

It is fast (well under two seconds; about 0.1 s of work) because it never imports torch,
IPEX, the oneCCL bindings, mpi4py or py-cpuinfo: versions come from ``importlib.metadata``,
the CPU from ``/proc/cpuinfo`` and sysfs, and name lookups are bounded to 0.5 s.  torch's
built-in backends are therefore listed unprobed unless ``--torch`` is given.  oneCCL bindings
whose version names another torch get the verdict ``init_distributed`` uses: an import probe
in a child process (:mod:`cpuddp.backends.ccl_probe`; a few seconds the first time, cached after).  It forms no process group and changes nothing.  A section
whose module fails is reported as "not available" with the reason; the rest still runs.
Exit codes: 0 (report printed); 2 for a ``--ranks`` that cannot be met -- below 1, or more
than this node runs (the report is printed, with the ``job-plan`` warning and its fix); 3 with
``--strict`` when there are warnings.

The probes are in :mod:`cpuddp.doctor.collect`, the warning rules (pure, each warning a
``{"code", "message", "fix"}`` record) in :mod:`cpuddp.doctor.diagnose`, the text in
:mod:`cpuddp.doctor.text`; this module puts them together and is the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from .collect import (
    _backends,
    _ccl_verdict,
    _cpu,
    _gloo_ifname,
    _job,
    _launcher,
    _launcher_auto,
    _plans,
    _resolve_host,
    _section,
    _torch_probes,
    torch_matches,
)
from .diagnose import diagnose, job_warnings, version_warnings
from .text import format_text

__all__ = ["collect", "diagnose", "format_text", "add_arguments", "run", "main", "DoctorConfig"]

#: A request that cannot be met: ``--ranks`` below 1, or more than this node can run (the report
#: is printed first); ``cpuddp run`` exits 2 for the same plan.
EXIT_REQUEST = 2
#: ``--strict`` and at least one warning.
EXIT_WARNINGS = 3

#: Thread and affinity variables worth showing.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY",
                "KMP_AFFINITY", "KMP_BLOCKTIME", "CCL_WORKER_COUNT", "CCL_WORKER_AFFINITY",
                "GLOO_SOCKET_IFNAME", "LD_PRELOAD")


# --------------------------------------------------------------------------- versions


def _dist_version(name: str) -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _versions() -> dict[str, Any]:
    from cpuddp._compat import versions

    v: dict[str, Any] = versions(lookup=_dist_version)
    v.update(torch_matches(v))  # one rule for both packages (cpuddp._compat.torch_pairing)
    return v


# --------------------------------------------------------------------------- the report


def collect(environ: Optional[Mapping[str, str]] = None, *, root: str = "/", probe_torch: bool = False,
            ranks: Optional[int] = None) -> dict[str, Any]:
    """Everything ``cpuddp doctor`` reports, as plain data (reads only).

    Imports no torch unless ``probe_torch`` (then torch's backends and CPU probes are checked
    too, at about 2 s).  ``view``: the one job the report is about -- ``"job"`` (from a shell,
    or with ``ranks``: the plan ``cpuddp run`` would use) or ``"launcher"`` (the launcher's);
    ``backends.auto`` is ``"auto"``'s answer for that job, its ``for`` saying which.
    """
    t0 = time.perf_counter()
    environ = dict(os.environ if environ is None else environ)
    report: dict[str, Any] = {"format": "cpuddp-doctor/1"}
    launcher = _section(lambda: _launcher(environ))
    launcher, env = launcher if isinstance(launcher, tuple) else (launcher, None)
    report["launcher"] = launcher
    versions = _section(_versions)
    report["versions"] = versions
    backends = _section(lambda: _backends(probe_torch))
    report["backends"] = backends
    if isinstance(versions, dict) and versions.get("oneccl_bind_pt"):
        versions["oneccl_bind_pt_verdict"] = _ccl_verdict(backends)
    if probe_torch:
        report["torch"] = _section(_torch_probes)
    cpu = _section(lambda: _cpu(root))
    cpu, topo = cpu if isinstance(cpu, tuple) else (cpu, None)
    report["cpu"] = cpu
    report["threads"] = {k: environ.get(k) for k in _THREAD_VARS}
    ours = _section(lambda: _launcher_auto(env, probe_torch))
    chosen = ours if isinstance(ours, dict) and "name" in ours else None
    report["pinning"] = _section(lambda: _plans(env, topo, environ, chosen))
    job = None
    if env is None or (env.launcher == "none" and env.world_size == 1) or ranks is not None:
        job = report["job"] = _section(lambda: _job(topo, environ, ranks, probe_torch))
    report["view"] = "job" if job is not None and (ranks is not None or env is not None) else "launcher"
    if isinstance(backends, dict) and backends.get("available", True):
        # one "auto" for the whole report: the job it shows (--ranks N, or cpuddp run's plan), else the launcher's
        mine = job.get("backend") if report["view"] == "job" and isinstance(job, dict) else ours
        if mine is not None:
            backends["auto"] = mine
    report["host"] = _resolve_host()
    report["network"] = _section(lambda: _gloo_ifname(env, environ))
    report["warnings"] = _warnings(report, environ)
    report["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return report


def _warnings(report: Mapping[str, Any], environ: Mapping[str, str]) -> list[dict[str, str]]:
    """:func:`diagnose` over the collected sections, then the version mismatches."""
    launcher, cpu, network = report["launcher"], report["cpu"], report["network"]
    plans = [p["plan"] for p in report["pinning"].get("plans", []) if isinstance(p.get("plan"), Mapping)]
    cpus = cpu.get("effective_cpu_count") if isinstance(cpu, dict) and cpu.get("available") else None
    out = diagnose(
        launcher.get("env") if launcher.get("ok") else None,
        environ,
        cpus=cpus or os.cpu_count() or 1,
        plans=plans,
        host=report["host"],
        mpi4py=importlib.util.find_spec("mpi4py") is not None,
        gloo_ifname=network.get("GLOO_SOCKET_IFNAME") if network.get("available", True) else None,
    )
    if isinstance(report["versions"], dict):
        out += version_warnings(report["versions"])
    return out + job_warnings(report.get("job"))


def _quiet_rank(environ: Mapping[str, str]) -> bool:
    """Under a launcher with 2+ ranks, every rank but global rank 0 stays quiet (one report)."""
    try:
        _, env = _launcher(environ)
    except Exception:  # no verdict: every rank reports, as the launcher section will say why
        return False
    return env is not None and env.world_size > 1 and env.rank != 0


# --------------------------------------------------------------------------- entry points


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``cpuddp doctor``."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 3 when there are warnings")
    p.add_argument("--torch", dest="probe_torch", action="store_true",
                   help="also import torch (about 2 s) to probe its built-in backends, threads and CPU checks")
    p.add_argument("--ranks", type=int, metavar="N", help="what a job of N ranks per node would get here "
                   "(default from a shell: the plan `cpuddp run` would use)")
    p.add_argument("--all-ranks", action="store_true", help="under a launcher: every rank prints its own report "
                   "(default: rank 0 only, with a table of every local rank)")


@dataclasses.dataclass(frozen=True)
class DoctorConfig:
    """The options of ``cpuddp doctor`` (:func:`add_arguments`, which holds their defaults),
    typed and frozen."""

    json: bool
    strict: bool
    probe_torch: bool
    ranks: Optional[int]
    all_ranks: bool

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> DoctorConfig:
        """The config of the parsed options; ``--ranks`` and ``--all-ranks`` may be absent from ``ns``."""
        return cls(json=ns.json, strict=ns.strict, probe_torch=ns.probe_torch, ranks=getattr(ns, "ranks", None),
                   all_ranks=getattr(ns, "all_ranks", False))


def run(args: argparse.Namespace) -> int:
    """Print the report; return the exit code (``args`` becomes a :class:`DoctorConfig` here, once)."""
    cfg = DoctorConfig.from_args(args)
    if cfg.ranks is not None and cfg.ranks < 1:
        sys.stderr.write(f"cpuddp doctor: error: --ranks {cfg.ranks}: must be at least 1\nFix: --ranks 2, say\n")
        return EXIT_REQUEST
    if not cfg.all_ranks and _quiet_rank(os.environ):
        return 0
    report = collect(probe_torch=cfg.probe_torch, ranks=cfg.ranks)
    if cfg.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(format_text(report))
    job = report.get("job")
    if cfg.ranks is not None and isinstance(job, dict) and job.get("available") is False:
        return EXIT_REQUEST  # the job asked for cannot run here; the report and its warning say why
    return EXIT_WARNINGS if cfg.strict and report["warnings"] else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``cpuddp doctor ...`` as a function (``argv`` without the leading ``doctor``)."""
    p = argparse.ArgumentParser(prog="cpuddp doctor", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(list(sys.argv[1:] if argv is None else argv)))
