"""``cpuddp doctor``'s probes: each gathers one section of the report as plain data.

Each is run through :func:`_section`, so a probe that fails becomes ``{"available": False,
"error": ...}`` and the rest of the report still runs.  None imports torch unless asked
(``probe_torch``); name lookups are bounded in time.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import threading
from typing import Any, Callable, Mapping, Optional

from cpuddp._compat import torch_pairing
from cpuddp.topology import here


def torch_matches(versions: Mapping[str, Any]) -> dict[str, Any]:
    """``<key>_matches_torch`` (None when either is missing) and ``<key>_built_for`` for IPEX
    and the oneCCL bindings, by :func:`cpuddp._compat.torch_pairing` -- the rule
    ``init_distributed`` and ``prepare`` apply (the bindings' with their exact pairs)."""
    from cpuddp.backends.ccl import CCL_EXACT_TORCH

    out: dict[str, Any] = {}
    torch = versions.get("torch")
    for key, exact in (("ipex", None), ("oneccl_bind_pt", CCL_EXACT_TORCH)):
        version = versions.get(key)
        if not torch or not version:
            out[f"{key}_matches_torch"] = None
            continue
        pairing = torch_pairing(version, torch, exact=exact)
        out[f"{key}_matches_torch"] = pairing.ok
        out[f"{key}_built_for"] = pairing.built_for
    return out


def _section(fn: Callable[[], Any]) -> Any:
    """Run one probe; a failure becomes ``{"available": False, "error": ...}``."""
    try:
        return fn()
    except Exception as e:  # a broken or missing module must not take the report down
        return {"available": False, "error": f"{type(e).__name__}: {e}"}


def _launcher(environ: Mapping[str, str]) -> tuple[dict[str, Any], Any]:
    from cpuddp.errors import LauncherEnvError
    from cpuddp.launchers.registry import LAUNCHER_NAMES, detect

    try:
        env = detect(environ)
    except LauncherEnvError as e:
        return {"ok": False, "error": str(e), "variable": e.variable, "value": e.value, "launcher": e.launcher,
                "fix": e.fix}, None
    d = env.as_dict()
    return {"ok": True, "name": env.launcher, "description": LAUNCHER_NAMES.get(env.launcher, env.launcher),
            "env": d}, env


def _backends(probe_torch: bool) -> dict[str, Any]:
    """Every registered backend's status; shm's with the data path a group formed here would
    take (``data_path``: :func:`cpuddp.backends.shm.native.status`'s words -- native and its
    vector width, or Python and why; ``native``: which).

    Without ``probe_torch`` torch's built-in backends are listed unprobed and gloo is taken as
    built in (every PyPI torch has it); nothing imports torch.  What ``backend="auto"`` picks
    is :func:`auto_for`'s, for the job the report is about (the report adds it as ``auto``).
    """
    from cpuddp.backends import registry as backends

    light = _light(probe_torch)
    items: list[dict[str, Any]] = []
    for name, spec in list(backends.BACKENDS.items()):
        if light and spec.built_into_torch:  # probing it means importing torch (about 2 s)
            items.append({"name": name, "available": None, "version": None,
                          "reason": "built into torch when it was compiled with it (not probed: "
                                    "`cpuddp doctor --torch` imports torch and checks)"})
        else:
            items.append(_plain(backends.backend_status(name)))
    from cpuddp.backends.shm import native  # ctypes only: no torch

    native_ok, path = native.status()
    for item in items:
        if item.get("name") == "shm":
            item.update(native=native_ok, data_path=path)
    return {"available": True, "backends": items, "torch_probed": not light}


def _light(probe_torch: bool) -> bool:
    """Whether torch stays unimported (no ``--torch``, and nothing imported it already)."""
    return not probe_torch and "torch" not in sys.modules


def auto_for(env: Any, node_cpus: Optional[int], probe_torch: bool, job: str) -> dict[str, Any]:
    """What ``backend="auto"`` picks for ``env`` on ``node_cpus`` CPUs: the rule init applies
    (:func:`cpuddp.backends.registry.resolve_backend`), as plain data with ``for``: the job it
    is for, in words (``job``); ``{"error": ..., "for": ...}`` when the question fails."""
    from cpuddp.backends import registry as backends

    try:
        choice = _plain(backends.resolve_backend("auto", env, node_cpus=node_cpus or None,
                                                 probe_torch=not _light(probe_torch)))
    except Exception as e:  # a backend question must not hide the rest of the report
        choice = {"error": f"{type(e).__name__}: {e}"}
    return dict(choice, **{"for": job})


def _launcher_auto(env: Any, probe_torch: bool) -> Optional[dict[str, Any]]:
    """:func:`auto_for` the job the launcher describes (its ranks on this node, this process's CPUs)."""
    if env is None:
        return None
    from cpuddp.topology.here import allowed_cpus

    return auto_for(env, len(allowed_cpus()), probe_torch,
                    f"this job ({env.local_world_size} rank(s) on this node, {env.num_nodes} node(s))")


def _ccl_verdict(backends: Any) -> Optional[dict[str, Any]]:
    """What the ccl backend's check decided, and on what evidence (metadata, import probe): the one
    check that names its evidence."""
    items = backends.get("backends", []) if isinstance(backends, dict) else []
    ccl = next((b for b in items if isinstance(b, dict) and b.get("evidence")), None)
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
    from cpuddp.topology.model import cpu_features, effective_cpu_count
    from cpuddp.topology.read import read_topology

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


def _plans(env: Any, topo: Any, environ: Mapping[str, str], auto: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """Each local rank's pinning plan for the backend "auto" picked (``auto``: its plain choice),
    with the worker cores that backend keeps free."""
    from cpuddp.affinity import pin as affinity
    from cpuddp.backends.types import BackendChoice

    if env is None:
        return {"available": False, "error": "no DistEnv (see the launcher section)"}
    backend = auto.get("name") if auto else None
    choice = BackendChoice(backend or "gloo", "auto", inter=auto.get("inter") if auto else None)
    workers = choice.backend.worker_cores(choice, environ)
    plans = []
    for lr in range(env.local_world_size):
        rank = env.rank - env.local_rank + lr
        e = env.replace(local_rank=lr, rank=rank)
        plan = affinity.plan_for(e, workers=workers, environ=environ, topology=topo)
        plans.append({"local_rank": lr, "rank": rank, "plan": _plain(plan)})
    return {"available": True, "backend": backend, "plans": plans}


def _gloo_ifname(env: Any, environ: Mapping[str, str], timeout: float = 0.5) -> dict[str, Any]:
    """The ``GLOO_SOCKET_IFNAME`` cpuddp would export in a multi-node job (bounded in time)."""
    from cpuddp.backends.settings import gloo_env

    out: dict[str, Any] = {"GLOO_SOCKET_IFNAME": environ.get("GLOO_SOCKET_IFNAME"), "source": "user"}
    if out["GLOO_SOCKET_IFNAME"]:
        return out
    if env is None or env.single_node or not env.master_addr:
        out["source"] = None if env is None or not env.single_node else "single node"
        if env is not None and env.single_node:
            out["GLOO_SOCKET_IFNAME"] = gloo_env(env, environ).get("GLOO_SOCKET_IFNAME")
        return out
    from cpuddp.launchers.netif import route_to

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
        from cpuddp.launchers.netif import is_loopback_address

        if is_loopback_address(route[1]):
            out["source"] = f"none: MASTER_ADDR={env.master_addr} is reached over loopback from here"
        else:
            out.update({"GLOO_SOCKET_IFNAME": route[0], "source": f"route to MASTER_ADDR={env.master_addr}"})
    return out


def _resolve_host(timeout: float = 0.5) -> dict[str, Any]:
    """This host's name and the addresses it resolves to (bounded: a slow DNS is reported, not waited on)."""
    name = here.hostname()
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



def _job(topo: Any, environ: Mapping[str, str], ranks: Optional[int], probe_torch: bool) -> dict[str, Any]:
    """What a job of ``ranks`` ranks (default: ``cpuddp run``'s choice) would get on this node:
    ``cpuddp run``'s plan (:func:`cpuddp.affinity.job.plan_run`) and the backend ``"auto"``
    would pick for it (``backend``; also for ``--ranks N`` that cannot run here: auto's answer
    for N ranks on this node).  For ``cpuddp doctor`` run from a shell, where this process is
    no job."""
    from cpuddp.affinity.job import RunPlanError, plan_run, plan_table

    if topo is None:
        return {"available": False, "error": "no CPU topology (see the CPU section)"}
    try:
        plan = plan_run(topo, ranks_per_node=ranks, ranks_source="--ranks",
                        omp_num_threads=environ.get("OMP_NUM_THREADS"))
    except RunPlanError as exc:
        out = {"available": False, "error": exc.msg, "fix": (exc.fix or "").replace("--ranks-per-node", "--ranks"),
               "ranks": ranks}
        if ranks:
            out["backend"] = _job_backend(ranks, topo, probe_torch)
        return out
    return {"available": True, "ranks": ranks, "plan": plan.as_dict(),
            "table": plan_table(plan, [here.hostname()]),
            "command": "cpuddp run " + (f"--ranks-per-node {ranks} " if ranks else "") + "script.py",
            "backend": _job_backend(plan.ranks_per_node, topo, probe_torch)}


def _job_backend(ranks: int, topo: Any, probe_torch: bool) -> dict[str, Any]:
    """:func:`auto_for` a one-node job of ``ranks`` ranks on this node's usable CPUs."""
    from cpuddp.launchers.env import DistEnv

    env = DistEnv(world_size=ranks, local_world_size=ranks, launcher="torchrun", agent_store=True)
    return auto_for(env, len(topo.usable), probe_torch, f"a job of {ranks} rank(s) on this node")
