"""``cpuddp doctor``: what cpuddp sees here, what it would do, and what looks wrong.

Usage::

    cpuddp doctor             # a readable report
    cpuddp doctor --json      # the same report as JSON (one object)
    cpuddp doctor --strict    # exit 3 when there is any warning (for CI)
    cpuddp doctor --torch     # also import torch (about 2 s) to probe gloo/mpi/nccl and torch.cpu
    mpiexec -n 2 cpuddp doctor --json   # what each rank sees under a launcher

Sections: the launcher and the :class:`~cpuddp.env.DistEnv` it describes (or the
:class:`~cpuddp.errors.LauncherEnvError` that explains why there is none); the collective
backends, with versions and the reason each can or cannot run; whether torch, IPEX and the
oneCCL bindings' versions match; the CPU model and features (AVX-512, AVX512-BF16, AMX);
sockets, cores, threads, the allowed CPU set and the cgroup quota; the thread variables;
the pinning plan cpuddp would apply for each local rank; the host's name resolution and the
``GLOO_SOCKET_IFNAME`` cpuddp would export; and warnings (oversubscription, a conflicting
``OMP_NUM_THREADS``, a hostname resolving to loopback in a multi-node job, a missing
``MASTER_ADDR``, IPEX or bindings built for another torch, and the pinning planner's own).

It is fast (well under two seconds; about 0.1 s of work) because it never imports torch,
IPEX, the oneCCL bindings, mpi4py or py-cpuinfo: versions come from ``importlib.metadata``,
the CPU from ``/proc/cpuinfo`` and sysfs, and name lookups are bounded to 0.5 s.  torch's
built-in backends are therefore listed unprobed unless ``--torch`` is given.  oneCCL bindings
whose version names another torch get the verdict ``init_distributed`` uses: an import probe
in a child process (:mod:`cpuddp.ccl_probe`; a few seconds the first time, cached after).  It forms no process group and changes nothing.  A section
whose module fails is reported as "not available" with the reason; the rest still runs.
Exit codes: 0 (report printed), 3 with ``--strict`` when there are warnings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["collect", "diagnose", "format_text", "version_match", "add_arguments", "run", "main"]

EXIT_WARNINGS = 3

#: Distributions whose versions the report shows (distribution name -> short key).
_DISTS = {
    "cpuddp": "cpuddp",
    "torch": "torch",
    "intel_extension_for_pytorch": "ipex",
    "oneccl_bind_pt": "oneccl_bind_pt",
    "mpi4py": "mpi4py",
    "psutil": "psutil",
    "py-cpuinfo": "py-cpuinfo",
}

#: Thread and affinity variables worth showing.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY",
                "KMP_AFFINITY", "KMP_BLOCKTIME", "CCL_WORKER_COUNT", "CCL_WORKER_AFFINITY",
                "GLOO_SOCKET_IFNAME", "LD_PRELOAD")


# --------------------------------------------------------------------------- pure helpers


def _dist_version(name: str) -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def version_match(torch_version: Optional[str], other: Optional[str]) -> Optional[bool]:
    """True when ``other`` is built for ``torch_version`` (same major.minor), None if either is missing.

    IPEX and the oneCCL bindings are released per torch minor version (IPEX 2.8.x for torch
    2.8); compared as versions, never as strings.
    """
    if not torch_version or not other:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        t, o = Version(torch_version), Version(other)
    except InvalidVersion:
        return False
    return (t.major, t.minor) == (o.major, o.minor)


def _built_for(version: str) -> str:
    """``"2.8.0+cpu"`` -> ``"torch 2.8"`` (IPEX and the bindings follow torch's major.minor)."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return "an unknown torch"
    return f"torch {v.major}.{v.minor}"


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
    out: list[dict[str, str]] = []
    lws = int(env["local_world_size"]) if env else 1
    nodes = int(env["num_nodes"]) if env else 1

    omp_raw = environ.get("OMP_NUM_THREADS")
    omp = _int_or_none(omp_raw)
    replaced = any("OMP_NUM_THREADS" in (p.get("replace_env") or ()) for p in plans)
    user_omp = omp if (omp and omp > 0 and not replaced) else None
    if omp_raw is not None and (omp is None or omp < 1):
        out.append(_warn("omp-invalid", f"OMP_NUM_THREADS={omp_raw!r} is not a positive integer",
                         "export OMP_NUM_THREADS=<threads per rank>, or unset it and let cpuddp choose"))

    # Threads on this node as the job would run: the plans' (which honour the user's
    # OMP_NUM_THREADS), else the user's value, else torch's default of every usable CPU.
    if plans:
        total = sum(int(p.get("num_threads") or 1) for p in plans)
        src = f"OMP_NUM_THREADS={user_omp}" if user_omp else "the pinning plan"
    else:
        total = lws * (user_omp or cpus)
        src = f"OMP_NUM_THREADS={user_omp}" if user_omp else "torch's default: every usable CPU"
    over = False
    if lws > cpus:
        over = True
        out.append(_warn(
            "oversubscribed",
            f"{lws} ranks on this node share {cpus} usable CPU(s): ranks will time-slice",
            f"run at most {cpus} rank(s) per node (the launcher's -ppn / --nproc-per-node), or give the job more CPUs"))
    elif total > cpus:
        over = True
        out.append(_warn(
            "oversubscribed",
            f"{lws} rank(s) on this node run {total} threads in all ({src}) on {cpus} usable CPU(s)",
            f"export OMP_NUM_THREADS={max(1, cpus // lws)} (usable CPUs / ranks per node), or unset it and "
            "let cpuddp pin (init_distributed(pin=True))"))

    conflict = False
    if user_omp and plans:
        shares = sorted({len(p.get("cpus") or ()) for p in plans if p.get("cpus")})
        if shares and user_omp not in shares:
            conflict = True
            share = "/".join(map(str, shares))
            effect = "threads will share CPUs" if user_omp > max(shares) else "cores will sit idle"
            out.append(_warn(
                "omp-conflict",
                f"OMP_NUM_THREADS={user_omp} but each local rank is pinned to {share} CPU(s): {effect} "
                "(the user's value wins)",
                f"unset OMP_NUM_THREADS to use the plan's {share} thread(s) per rank, or set it to {share}"))
    mkl = _int_or_none(environ.get("MKL_NUM_THREADS"))
    if omp and mkl and mkl != omp:
        out.append(_warn("omp-conflict", f"OMP_NUM_THREADS={omp} but MKL_NUM_THREADS={mkl}",
                         "set both to the same value, or unset MKL_NUM_THREADS"))

    # The planner's own warnings, once each, minus those the checks above already made.
    seen = {w["message"] for w in out}
    for p in plans:
        for text in p.get("warnings") or ():
            if (over and text.startswith("oversubscribed")) or (conflict and "threads asked for local rank" in text):
                continue
            if text not in seen:
                seen.add(text)
                message, _, fix = text.partition(" Fix: ")
                out.append(_warn("pinning", message.rstrip(". ") if fix else message,
                                 fix or "see the pinning plan"))

    if nodes > 1:
        addrs = list((host or {}).get("addresses") or [])
        name = (host or {}).get("name") or socket.gethostname()
        from .launchers import is_loopback

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
            how = (env or {}).get("sources", {}).get("master_addr", "") if env else ""
            if how.startswith("pending"):
                detail = ("cpuddp will ask rank 0 over MPI (mpi4py is installed)" if mpi4py else
                          "cpuddp cannot learn rank 0's address: mpi4py is not installed, so init will fail")
            else:
                detail = f"cpuddp derives it ({how or 'default'})"
            out.append(_warn(
                "master-addr-missing", f"this is a {nodes}-node job and MASTER_ADDR is not set; {detail}",
                "export MASTER_ADDR=<rank 0's host or address> to every rank "
                "(mpiexec -genv / mpirun -x), or pip install cpuddp[mpi]"))
        elif is_loopback(master):
            out.append(_warn(
                "master-addr-loopback", f"this is a {nodes}-node job but MASTER_ADDR={master} is a loopback address",
                "export MASTER_ADDR=<rank 0's host or address, reachable from every node>"))
    return out


# --------------------------------------------------------------------------- gathering


def _section(fn: Callable[[], Any]) -> Any:
    """Run one probe; a failure becomes ``{"available": False, "error": ...}``."""
    try:
        return fn()
    except Exception as e:  # a broken or missing module must not take the report down
        return {"available": False, "error": f"{type(e).__name__}: {e}"}


def _launcher(environ: Mapping[str, str]) -> tuple[dict[str, Any], Any]:
    from .errors import LauncherEnvError
    from .launchers import LAUNCHER_NAMES, detect

    try:
        env = detect(environ)
    except LauncherEnvError as e:
        return {"ok": False, "error": str(e), "variable": e.variable, "value": e.value, "launcher": e.launcher,
                "fix": e.fix}, None
    d = env.as_dict()
    return {"ok": True, "name": env.launcher, "description": LAUNCHER_NAMES.get(env.launcher, env.launcher),
            "env": d}, env


def _versions() -> dict[str, Any]:
    v: dict[str, Any] = {k: _dist_version(name) for name, k in _DISTS.items()}
    v["python"] = platform.python_version()
    if v["cpuddp"] is None:
        from . import __version__

        v["cpuddp"] = __version__
    v["ipex_matches_torch"] = version_match(v["torch"], v["ipex"])
    v["oneccl_bind_pt_matches_torch"] = version_match(v["torch"], v["oneccl_bind_pt"])
    if v["torch"] and v["oneccl_bind_pt"]:
        try:  # the bindings' own pairing rules (some releases fit one torch patch release only)
            from .backends import ccl_pairing

            v["oneccl_bind_pt_matches_torch"], v["oneccl_bind_pt_built_for"] = ccl_pairing(
                v["oneccl_bind_pt"], v["torch"])
        except ImportError:
            pass
    return v


#: torch.distributed's built-in backends: probing them means importing torch (about 2 s).
_TORCH_BUILTINS = ("gloo", "mpi", "nccl")


def _backends(env: Any, probe_torch: bool) -> dict[str, Any]:
    """Every registered backend's status, and what ``backend="auto"`` would pick.

    Without ``probe_torch`` torch's built-in backends are listed unprobed, and "auto" is
    decided as :func:`cpuddp.backends.resolve_backend` decides it: ccl when its bindings are
    usable, else gloo (built into every PyPI torch).
    """
    from . import backends

    light = not probe_torch and "torch" not in sys.modules
    items: list[dict[str, Any]] = []
    for name in list(backends.BACKENDS):
        if light and name in _TORCH_BUILTINS:
            items.append({"name": name, "available": None, "version": None,
                          "reason": "built into torch when it was compiled with it (not probed: "
                                    "`cpuddp doctor --torch` imports torch and checks)"})
        else:
            items.append(_plain(backends.backend_status(name)))
    out: dict[str, Any] = {"available": True, "backends": items, "torch_probed": not light}
    if env is not None:
        ccl = next((b for b in items if b.get("name") == "ccl"), None)
        try:
            if not light or (ccl and ccl.get("available")):
                out["auto"] = _plain(backends.resolve_backend("auto", env))
            else:
                why = ccl["reason"] if ccl else "ccl is not registered"
                out["auto"] = {"name": "gloo", "reason": f"auto: gloo, because {why}", "requested": "auto"}
        except Exception as e:
            out["auto"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _ccl_verdict(backends: Any) -> Optional[dict[str, Any]]:
    """What the ccl backend's check decided, and on what evidence (metadata, import probe)."""
    items = backends.get("backends", []) if isinstance(backends, dict) else []
    ccl = next((b for b in items if isinstance(b, dict) and b.get("name") == "ccl"), None)
    if ccl is None:
        return None
    return {"usable": bool(ccl.get("available")), "evidence": ccl.get("evidence"), "reason": ccl.get("reason")}


def _torch_probes() -> dict[str, Any]:
    """What only torch can tell (``--torch``): threads, and its own CPU-feature probes."""
    import torch

    out: dict[str, Any] = {"available": True, "version": torch.__version__, "num_threads": torch.get_num_threads(),
                           "num_interop_threads": torch.get_num_interop_threads(),
                           "mkldnn": bool(torch.backends.mkldnn.is_available())}
    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        out[probe.strip("_")] = bool(fn()) if fn is not None else None
    return out


def _plain(obj: Any) -> Any:
    """A dataclass / object with as_dict / namedtuple / mapping -> plain data for JSON."""
    import dataclasses

    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "as_dict"):
        return _plain(obj.as_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "_asdict"):
        return _plain(obj._asdict())
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in (sorted(obj) if isinstance(obj, (set, frozenset)) else obj)]
    return str(obj)


def _cpu_model(root: str) -> Optional[str]:
    try:
        with open(os.path.join(root, "proc/cpuinfo")) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpu(root: str) -> tuple[dict[str, Any], Any]:
    from .topology import cpu_features, effective_cpu_count, read_topology

    topo = read_topology(root)
    d = topo.as_dict()
    d.pop("cpus", None)
    threads_per_core = (len(topo.cpus) / max(1, len({c.core for c in topo.cpus}))) if topo.cpus else 1
    d.update({
        "available": True,
        "model": _cpu_model(root),
        "features": cpu_features(topo),
        "threads_per_core": round(threads_per_core, 2),
        "effective_cpu_count": effective_cpu_count(topo),
    })
    return d, topo


def _plans(env: Any, topo: Any, environ: Mapping[str, str], backend: Optional[str]) -> dict[str, Any]:
    from . import affinity

    if env is None:
        return {"available": False, "error": "no DistEnv (see the launcher section)"}
    plans = []
    for lr in range(env.local_world_size):
        rank = env.rank - env.local_rank + lr
        e = env.replace(local_rank=lr, rank=rank)
        plan = affinity.plan_for(e, backend=backend or "gloo", environ=environ, topology=topo)
        plans.append({"local_rank": lr, "rank": rank, "plan": _plain(plan)})
    return {"available": True, "backend": backend, "plans": plans}


def _gloo_ifname(env: Any, environ: Mapping[str, str], timeout: float = 0.5) -> dict[str, Any]:
    """The ``GLOO_SOCKET_IFNAME`` cpuddp would export in a multi-node job (bounded in time)."""
    from .backends import gloo_env

    out: dict[str, Any] = {"GLOO_SOCKET_IFNAME": environ.get("GLOO_SOCKET_IFNAME"), "source": "user"}
    if out["GLOO_SOCKET_IFNAME"]:
        return out
    if env is None or env.single_node or not env.master_addr:
        out["source"] = None if env is None or not env.single_node else "single node"
        if env is not None and env.single_node:
            out["GLOO_SOCKET_IFNAME"] = gloo_env(env, environ).get("GLOO_SOCKET_IFNAME")
        return out
    from .netif import route_to

    found: dict[str, Any] = {}

    def work() -> None:
        found["route"] = route_to(env.master_addr)  # resolves MASTER_ADDR: may wait on DNS

    t = threading.Thread(target=work, name="cpuddp-doctor-route", daemon=True)
    t.start()
    t.join(timeout)
    route = found.get("route")
    if t.is_alive():
        out["source"] = f"unknown: resolving MASTER_ADDR={env.master_addr} took longer than {timeout:g} s"
    elif route is None:
        out["source"] = f"unknown: no route to MASTER_ADDR={env.master_addr}"
    else:
        from .netif import is_loopback_address

        if is_loopback_address(route[1]):
            out["source"] = f"none: MASTER_ADDR={env.master_addr} is reached over loopback from here"
        else:
            out.update({"GLOO_SOCKET_IFNAME": route[0], "source": f"route to MASTER_ADDR={env.master_addr}"})
    return out


def _resolve_host(timeout: float = 0.5) -> dict[str, Any]:
    """This host's name and the addresses it resolves to (bounded: a slow DNS is reported, not waited on)."""
    name = socket.gethostname()
    result: dict[str, Any] = {"name": name, "addresses": [], "error": None}

    def work() -> None:
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
            result["addresses"] = sorted({i[4][0] for i in infos})
        except OSError as e:
            result["error"] = str(e)

    t = threading.Thread(target=work, name="cpuddp-doctor-dns", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        result["error"] = f"resolving {name!r} took longer than {timeout:g} s (slow DNS?)"
    return result


def collect(environ: Optional[Mapping[str, str]] = None, *, root: str = "/", probe_torch: bool = False) -> dict[str, Any]:
    """Everything ``cpuddp doctor`` reports, as plain data (reads only).

    Imports no torch unless ``probe_torch`` (then torch's backends and CPU probes are checked
    too, at about 2 s).
    """
    t0 = time.perf_counter()
    environ = dict(os.environ if environ is None else environ)
    import importlib.util

    report: dict[str, Any] = {"format": "cpuddp-doctor/1"}
    launcher = _section(lambda: _launcher(environ))
    launcher, env = launcher if isinstance(launcher, tuple) else (launcher, None)
    report["launcher"] = launcher
    versions = _section(_versions)
    report["versions"] = versions
    backends = _section(lambda: _backends(env, probe_torch))
    report["backends"] = backends
    if isinstance(versions, dict) and versions.get("oneccl_bind_pt"):
        versions["oneccl_bind_pt_verdict"] = _ccl_verdict(backends)
    if probe_torch:
        report["torch"] = _section(_torch_probes)
    cpu = _section(lambda: _cpu(root))
    cpu, topo = cpu if isinstance(cpu, tuple) else (cpu, None)
    report["cpu"] = cpu
    report["threads"] = {k: environ.get(k) for k in _THREAD_VARS}
    auto = backends.get("auto") if isinstance(backends, dict) else None
    chosen = auto.get("name") if isinstance(auto, dict) else None
    report["pinning"] = _section(lambda: _plans(env, topo, environ, chosen))
    host = _resolve_host()
    report["host"] = host
    network = _section(lambda: _gloo_ifname(env, environ))
    report["network"] = network
    plans = [p["plan"] for p in report["pinning"].get("plans", []) if isinstance(p.get("plan"), Mapping)]
    cpus = cpu.get("effective_cpu_count") if isinstance(cpu, dict) and cpu.get("available") else None
    report["warnings"] = diagnose(
        launcher.get("env") if launcher.get("ok") else None,
        environ,
        cpus=cpus or os.cpu_count() or 1,
        plans=plans,
        host=host,
        mpi4py=importlib.util.find_spec("mpi4py") is not None,
        gloo_ifname=network.get("GLOO_SOCKET_IFNAME") if network.get("available", True) else None,
    )
    if isinstance(versions, dict):
        for key, name in (("ipex", "IPEX"), ("oneccl_bind_pt", "oneccl_bind_pt")):
            if versions.get(f"{key}_matches_torch") is False:
                verdict = versions.get(f"{key}_verdict") or {}
                if verdict.get("usable"):
                    continue  # a source build for this torch: its import probe passed
                built_for = versions.get(f"{key}_built_for") or _built_for(versions[key])
                why = (f" ({verdict['reason']})" if verdict.get("reason") and verdict.get("evidence") == "import probe"
                       else "")
                report["warnings"].append(_warn(
                    "version-mismatch",
                    f"{name} {versions[key]} is built for {built_for}, but torch is {versions['torch']}: "
                    f"importing it would fail or abort{why}",
                    f"install the {name} release for torch {versions['torch']} or the torch it was built for, "
                    f"or uninstall {name}"))
    report["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return report


# --------------------------------------------------------------------------- text


def _na(section: Any) -> Optional[str]:
    if isinstance(section, dict) and section.get("available") is False:
        return f"not available ({section.get('error')})"
    return None


def format_text(report: Mapping[str, Any]) -> str:
    """The human-readable report (pure)."""
    lines: list[str] = []
    add = lines.append
    v = report.get("versions") or {}
    add(f"cpuddp doctor  (cpuddp {v.get('cpuddp')}, python {v.get('python')})")

    add("")
    add("Launcher")
    la = report["launcher"]
    if _na(la):
        add(f"  {_na(la)}")
    elif not la.get("ok"):
        add("  no usable launcher environment:")
        for line in str(la.get("error")).splitlines():
            add(f"    {line}")
    else:
        e = la["env"]
        add(f"  {la['name']} ({la['description']})")
        add(f"  rank {e['rank']} of {e['world_size']}, local rank {e['local_rank']} of {e['local_world_size']}, "
            f"node {e['node_rank']} of {e['num_nodes']}")
        addr = e["master_addr"] or "(pending: from rank 0 over MPI)"
        add(f"  rendezvous {addr}:{e['master_port']}" + (f", job id {e['job_id']}" if e.get("job_id") else ""))
        srcs = e.get("sources") or {}
        if srcs:
            add("  from: " + ", ".join(f"{k}<-{s}" for k, s in srcs.items()))

    add("")
    add("Versions")
    if _na(v):
        add(f"  {_na(v)}")
    else:
        def show(key: str) -> str:
            return v.get(key) or "not installed"

        add(f"  torch {show('torch')}; IPEX {show('ipex')}; oneccl_bind_pt {show('oneccl_bind_pt')}; "
            f"mpi4py {show('mpi4py')}")
        for key, name in (("ipex", "IPEX"), ("oneccl_bind_pt", "oneccl_bind_pt")):
            m = v.get(f"{key}_matches_torch")
            if m is not None:
                verdict = v.get(f"{key}_verdict") or {}
                probed = not m and verdict.get("evidence") == "import probe"
                add(f"  {name} {v[key]} with torch {v.get('torch')}: {'match' if m else 'MISMATCH'} "
                    f"(built for {v.get(key + '_built_for') or _built_for(v[key])}"
                    + (" by its version; import probe " + ("passed: usable" if verdict.get("usable") else "FAILED")
                       if probed else "") + ")")

    add("")
    add("Backends")
    b = report.get("backends") or {}
    if _na(b):
        add(f"  {_na(b)}")
    else:
        for item in b.get("backends", []):
            if isinstance(item, dict):
                ok = item.get("available")
                ver = item.get("version")
                mark = "yes" if ok else ("?  " if ok is None else "no ")
                add(f"  [{mark}] {item.get('name', '?')}" + (f" {ver}" if ver else "")
                    + (f": {item['reason']}" if item.get("reason") else ""))
            else:
                add(f"  {item}")
        auto = b.get("auto")
        if isinstance(auto, dict):
            if "error" in auto:
                add(f"  auto -> error: {auto['error']}")
            else:
                add(f"  auto -> {auto.get('name')}" + (f" ({auto['reason']})" if auto.get("reason") else ""))

    add("")
    add("CPU")
    c = report.get("cpu") or {}
    if _na(c):
        add(f"  {_na(c)}")
    else:
        feats = c.get("features") or {}
        labels = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI", "avx512_bf16": "AVX512-BF16",
                  "amx_tile": "AMX-TILE", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}
        add(f"  model: {c.get('model') or 'unknown'}")
        add("  features: " + ", ".join(f"{labels.get(k, k)} {'yes' if on else 'no'}" for k, on in feats.items()))
        add(f"  {len(c.get('sockets') or [])} socket(s), {len(c.get('numa_nodes') or [])} NUMA node(s), "
            f"{c.get('physical_cores')} usable physical core(s), {c.get('logical_cpus')} logical CPU(s) online, "
            f"{c.get('threads_per_core')} thread(s) per core")
        quota = c.get("quota")
        add(f"  allowed {c.get('allowed') or '?'}; usable {c.get('usable') or '?'}; cgroup cpuset "
            f"{c.get('cgroup_cpus') or 'none'}; quota {('%g CPUs' % quota) if quota else 'none'}; "
            f"effective {c.get('effective_cpu_count')} CPU(s)")
        for note in c.get("notes") or []:
            add(f"  note: {note}")

    tp = report.get("torch")
    if tp is not None:
        add("")
        add("torch (--torch)")
        if _na(tp):
            add(f"  {_na(tp)}")
        else:
            add(f"  torch {tp['version']}: {tp['num_threads']} intra-op / {tp['num_interop_threads']} inter-op "
                f"threads; oneDNN {'yes' if tp['mkldnn'] else 'no'}; torch.cpu says AVX-512 "
                f"{tp.get('is_avx512_supported')}, AVX512-BF16 {tp.get('is_avx512_bf16_supported')}, "
                f"AMX {tp.get('is_amx_tile_supported')}")

    add("")
    add("Threads")
    t = report.get("threads") or {}
    set_vars = {k: val for k, val in t.items() if val is not None}
    add("  " + (", ".join(f"{k}={val}" for k, val in set_vars.items()) if set_vars else "no thread variables set"))

    add("")
    p = report.get("pinning") or {}
    add("Pinning plan" + (f" (backend {p['backend']})" if p.get("backend") else ""))
    if _na(p):
        add(f"  {_na(p)}")
    else:
        for item in p.get("plans", []):
            add(f"  local rank {item['local_rank']} (rank {item['rank']}): {_plan_line(item['plan'])}")

    add("")
    h = report.get("host") or {}
    add(f"Host: {h.get('name')} -> {', '.join(h.get('addresses') or []) or h.get('error') or '?'}")
    net = report.get("network") or {}
    if _na(net):
        add(f"  GLOO_SOCKET_IFNAME: {_na(net)}")
    elif net.get("GLOO_SOCKET_IFNAME") or net.get("source"):
        add(f"  GLOO_SOCKET_IFNAME: {net.get('GLOO_SOCKET_IFNAME') or '(not set)'}"
            + (f" ({net['source']})" if net.get("source") else ""))

    add("")
    warnings = report.get("warnings") or []
    add(f"Warnings: {len(warnings)}" if warnings else "Warnings: none")
    for w in warnings:
        add(f"  ! {w['message']}")
        add(f"    fix: {w['fix']}")
    add("")
    add(f"({report.get('elapsed_s', 0):.2f} s)")
    return "\n".join(lines) + "\n"


def _plan_line(plan: Any) -> str:
    """``PinPlan.as_dict()`` in one line (any other mapping: key=value pairs)."""
    if not isinstance(plan, Mapping):
        return str(plan)
    if "cpulist" in plan and "num_threads" in plan:
        text = f"CPUs {plan['cpulist'] or '-'}, {plan['num_threads']} thread(s)"
        if plan.get("ccl_worker_cpus"):
            text += f", oneCCL workers on {','.join(map(str, plan['ccl_worker_cpus']))}"
        env = plan.get("env") or {}
        if env:
            text += "; exports " + " ".join(f"{k}={v}" for k, v in env.items())
        if plan.get("replace_env"):
            text += f" (replacing a launcher default: {', '.join(plan['replace_env'])})"
        if plan.get("reason"):
            text += f"\n      why: {plan['reason']}"
        return text
    return "; ".join(f"{k}={v}" for k, v in plan.items())


# --------------------------------------------------------------------------- entry points


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``cpuddp doctor``."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 3 when there are warnings")
    p.add_argument("--torch", dest="probe_torch", action="store_true",
                   help="also import torch (about 2 s) to probe its built-in backends, threads and CPU checks")


def run(args: argparse.Namespace) -> int:
    """Print the report; return the exit code."""
    report = collect(probe_torch=args.probe_torch)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(format_text(report))
    return EXIT_WARNINGS if args.strict and report["warnings"] else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``cpuddp doctor ...`` as a function (``argv`` without the leading ``doctor``)."""
    p = argparse.ArgumentParser(prog="cpuddp doctor", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(list(sys.argv[1:] if argv is None else argv)))
