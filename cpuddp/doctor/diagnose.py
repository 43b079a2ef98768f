"""``cpuddp doctor``'s warnings: pure rules over the plain data :mod:`cpuddp.doctor` collected.

Each warning is a record ``{"code", "message", "fix"}`` with a stable code:

=======================  =================================================================
``omp-invalid``          ``OMP_NUM_THREADS`` is not a positive integer
``oversubscribed``       more ranks, or more threads, than the node's usable CPUs
``omp-conflict``         the user's ``OMP_NUM_THREADS`` against the plan's CPUs, or against
                         ``MKL_NUM_THREADS``
``pinning``              one of the pinning planner's own :class:`~cpuddp.affinity.PinWarning`
                         records, passed on once (minus those the rules above already made)
``hostname-loopback``    a multi-node job whose hostname resolves to loopback, with no
                         interface towards ``MASTER_ADDR`` known
``master-addr-missing``  a multi-node job without ``MASTER_ADDR``
``master-addr-loopback`` a multi-node job whose ``MASTER_ADDR`` is loopback
``version-mismatch``     IPEX or the oneCCL bindings built for another torch
``job-plan``             from a shell: the job asked for (``--ranks N``, or ``cpuddp run``'s
                         default plan) cannot run on this node
=======================  =================================================================

Nothing here parses prose: the planner's warnings arrive as records (``PinPlan.as_dict()``'s
``warning_records``) and the rendezvous address's provenance as a
:class:`~cpuddp.launchers.env.Provenance`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from cpuddp.topology import here

__all__ = ["diagnose", "version_warnings", "job_warnings"]

def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(str(text).strip()) if text is not None else None
    except ValueError:
        return None


def _warn(code: str, message: str, fix: str) -> dict[str, str]:
    return {"code": code, "message": message, "fix": fix}


def diagnose(
    env: Optional[Mapping[str, Any]],
    environ: Mapping[str, str],
    *,
    cpus: int,
    plans: Sequence[Mapping[str, Any]] = (),
    host: Optional[Mapping[str, Any]] = None,
    mpi4py: bool = False,
    gloo_ifname: Optional[str] = None,
) -> list[dict[str, str]]:
    """The warnings for a job, from plain data (pure).

    ``env``: ``DistEnv.as_dict()`` or None when detection failed; ``cpus``: the CPUs this node
    can really use (allowed set capped by the cgroup quota); ``plans``: ``PinPlan.as_dict()``
    per local rank (its ``num_threads`` already honours the user's ``OMP_NUM_THREADS``);
    ``host``: ``{"name", "addresses", "error"}`` of this host's name resolution; ``mpi4py``:
    whether mpi4py is installed; ``gloo_ifname``: the ``GLOO_SOCKET_IFNAME`` cpuddp would
    export (the interface that routes to ``MASTER_ADDR``), when known.
    """
    out, covered = _thread_warnings(env, environ, cpus, plans)
    out += _planner_warnings(plans, out, covered)
    if env and int(env["num_nodes"]) > 1:
        out += _network_warnings(env, environ, host, mpi4py, gloo_ifname)
    return out


def _thread_warnings(env: Optional[Mapping[str, Any]], environ: Mapping[str, str], cpus: int,
                     plans: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, str]], set[str]]:
    """The thread rules, and the planner's warning codes they cover (not to be repeated)."""
    out: list[dict[str, str]] = []
    covered: set[str] = set()
    lws = int(env["local_world_size"]) if env else 1
    omp_raw = environ.get("OMP_NUM_THREADS")
    omp = _int_or_none(omp_raw)
    replaced = any("OMP_NUM_THREADS" in (p.get("replace_env") or ()) for p in plans)
    user_omp = omp if (omp and omp > 0 and not replaced) else None
    if omp_raw is not None and (omp is None or omp < 1):
        out.append(_warn("omp-invalid", f"OMP_NUM_THREADS={omp_raw!r} is not a positive integer",
                         "export OMP_NUM_THREADS=<threads per rank>, or unset it and let cpuddp choose"))
    over = _oversubscription(lws, cpus, user_omp, plans)
    if over is not None:
        out.append(over)
        covered.add("oversubscribed")
    conflict = _omp_conflict(user_omp, plans)
    if conflict is not None:
        out.append(conflict)
        covered.add("threads-exceed-cpus")
    mkl = _int_or_none(environ.get("MKL_NUM_THREADS"))
    if omp and mkl and mkl != omp:
        out.append(_warn("omp-conflict", f"OMP_NUM_THREADS={omp} but MKL_NUM_THREADS={mkl}",
                         "set both to the same value, or unset MKL_NUM_THREADS"))
    return out, covered


def _oversubscription(lws: int, cpus: int, user_omp: Optional[int],
                      plans: Sequence[Mapping[str, Any]]) -> Optional[dict[str, str]]:
    # Threads on this node as the job would run: the plans' (which honour the user's
    # OMP_NUM_THREADS), else the user's value, else torch's default of every usable CPU.
    if plans:
        total = sum(int(p.get("num_threads") or 1) for p in plans)
        src = f"OMP_NUM_THREADS={user_omp}" if user_omp else "the pinning plan"
    else:
        total = lws * (user_omp or cpus)
        src = f"OMP_NUM_THREADS={user_omp}" if user_omp else "torch's default: every usable CPU"
    if lws > cpus:
        return _warn(
            "oversubscribed",
            f"{lws} ranks on this node share {cpus} usable CPU(s): ranks will time-slice",
            f"run at most {cpus} rank(s) per node (the launcher's -ppn / --nproc-per-node), or give the job more CPUs")
    if total > cpus:
        return _warn(
            "oversubscribed",
            f"{lws} rank(s) on this node run {total} threads in all ({src}) on {cpus} usable CPU(s)",
            f"export OMP_NUM_THREADS={max(1, cpus // lws)} (usable CPUs / ranks per node), or unset it and "
            "let cpuddp pin (init_distributed(pin=True))")
    return None


def _omp_conflict(user_omp: Optional[int], plans: Sequence[Mapping[str, Any]]) -> Optional[dict[str, str]]:
    if not (user_omp and plans):
        return None
    shares = sorted({len(p.get("cpus") or ()) for p in plans if p.get("cpus")})
    if not shares or user_omp in shares:
        return None
    share = "/".join(map(str, shares))
    effect = "threads will share CPUs" if user_omp > max(shares) else "cores will sit idle"
    return _warn(
        "omp-conflict",
        f"OMP_NUM_THREADS={user_omp} but each local rank is pinned to {share} CPU(s): {effect} "
        "(the user's value wins)",
        f"unset OMP_NUM_THREADS to use the plan's {share} thread(s) per rank, or set it to {share}")


def _planner_warnings(plans: Sequence[Mapping[str, Any]], made: list[dict[str, str]],
                      covered: set[str]) -> list[dict[str, str]]:
    """The planner's own warning records, once each, minus those the rules already made."""
    from cpuddp.affinity.plan import PinWarning

    seen = {w["message"] for w in made}
    out: list[dict[str, str]] = []
    for p in plans:
        records = p.get("warning_records")
        for raw in (records if records is not None else p.get("warnings") or ()):
            record = PinWarning.coerce(raw)
            if record.code in covered or record.text in seen:
                continue
            seen.add(record.text)
            out.append(_warn("pinning", record.message, record.fix or "see the pinning plan"))
    return out


def _network_warnings(env: Mapping[str, Any], environ: Mapping[str, str], host: Optional[Mapping[str, Any]],
                      mpi4py: bool, gloo_ifname: Optional[str]) -> list[dict[str, str]]:
    from cpuddp.launchers.parsers import is_loopback

    out: list[dict[str, str]] = []
    nodes = int(env["num_nodes"])
    addrs = list((host or {}).get("addresses") or [])
    name = (host or {}).get("name") or here.hostname()
    if addrs and all(is_loopback(a) for a in addrs) and not environ.get("GLOO_SOCKET_IFNAME") and not gloo_ifname:
        out.append(_warn(
            "hostname-loopback",
            f"this is a {nodes}-node job, hostname {name!r} resolves to {', '.join(addrs)} and no interface "
            "towards MASTER_ADDR is known yet: gloo would advertise a loopback address to the other nodes "
            "(pytorch issue 15592)",
            "export GLOO_SOCKET_IFNAME=<the interface between nodes> (see `ip -br addr`) or a reachable "
            "MASTER_ADDR (cpuddp then picks the interface that routes to it), or fix /etc/hosts"))
    master = environ.get("MASTER_ADDR", "").strip()
    if not master:
        out.append(_warn(
            "master-addr-missing", f"this is a {nodes}-node job and MASTER_ADDR is not set; "
            f"{_master_addr_detail(env, mpi4py)}",
            "export MASTER_ADDR=<rank 0's host or address> to every rank "
            "(mpiexec -genv / mpirun -x), or pip install cpuddp[mpi]"))
    elif is_loopback(master):
        out.append(_warn(
            "master-addr-loopback", f"this is a {nodes}-node job but MASTER_ADDR={master} is a loopback address",
            "export MASTER_ADDR=<rank 0's host or address, reachable from every node>"))
    return out


def _master_addr_detail(env: Mapping[str, Any], mpi4py: bool) -> str:
    """How cpuddp will learn rank 0's address, from the provenance of ``master_addr``."""
    from cpuddp.launchers.env import Provenance, Source

    how = (env.get("sources") or {}).get("master_addr", "")
    if how and Provenance.of(how).kind is Source.PENDING:
        return ("cpuddp will ask rank 0 over MPI (mpi4py is installed)" if mpi4py else
                "cpuddp cannot learn rank 0's address: mpi4py is not installed, so init will fail")
    return f"cpuddp derives it ({how or 'default'})"


def version_warnings(versions: Mapping[str, Any]) -> list[dict[str, str]]:
    """``version-mismatch`` for IPEX and the oneCCL bindings built for another torch, from the
    report's ``versions`` section (``<key>_matches_torch``, ``<key>_built_for``, and
    ``<key>_verdict``: what the backend check decided, e.g. an import probe that passed)."""
    out: list[dict[str, str]] = []
    for key, name in (("ipex", "IPEX"), ("oneccl_bind_pt", "oneccl_bind_pt")):
        if versions.get(f"{key}_matches_torch") is not False:
            continue
        verdict = versions.get(f"{key}_verdict") or {}
        if verdict.get("usable"):
            continue  # a source build for this torch: its import probe passed
        why = (f" ({verdict['reason']})" if verdict.get("reason") and verdict.get("evidence") == "import probe"
               else "")
        out.append(_warn(
            "version-mismatch",
            f"{name} {versions[key]} is built for {versions.get(f'{key}_built_for') or 'another torch'}, "
            f"but torch is {versions['torch']}: importing it would fail or abort{why}",
            f"install the {name} release for torch {versions['torch']} or the torch it was built for, "
            f"or uninstall {name}"))
    return out


def job_warnings(job: Optional[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``job-plan`` when the report's ``job`` section (a job here, from a shell) is not available:
    the plan's own refusal and fix, or why the section could not be made."""
    if not isinstance(job, Mapping) or job.get("available", True):
        return []
    why = job.get("error") or "no plan"
    message = why if job.get("ranks") else f"`cpuddp run`'s default plan cannot run here: {why}"
    return [_warn("job-plan", message, job.get("fix") or "see the section 'A job here' above")]
