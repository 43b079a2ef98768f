"""``cpuddp doctor``'s human-readable report: :func:`format_text`, pure over the report's plain data.

One function per section, in the order shown; a section whose probe failed reads "not
available (<why>)".
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from cpuddp._compat import torch_pairing

__all__ = ["format_text"]

#: CPU feature keys (``cpu_features``) as the report names them.
_FEATURE_LABELS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI", "avx512_bf16": "AVX512-BF16",
                   "amx_tile": "AMX-TILE", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}


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
    for section in (_launcher, _versions, _backends, _cpu):
        add("")
        section(report, add)
    if report.get("torch") is not None:
        add("")
        _torch(report, add)
    shell = report.get("view") == "job" if "view" in report else (
        report.get("job") is not None and (report.get("launcher") or {}).get("name") == "none")
    for section in (_threads, _job if shell else _pinning, _host, _warnings):
        add("")
        section(report, add)
    add("")
    add(f"({report.get('elapsed_s', 0):.2f} s)")
    return "\n".join(lines) + "\n"


def _launcher(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """The launcher and the DistEnv it describes (or why there is none)."""
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


def _versions(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """torch, IPEX, the oneCCL bindings, mpi4py; whether each matches torch."""
    v = report.get("versions") or {}
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
                    f"(built for {v.get(key + '_built_for') or torch_pairing(v[key], v.get('torch') or '').built_for}"
                    + (" by its version; import probe " + ("passed: usable" if verdict.get("usable") else "FAILED")
                       if probed else "") + ")")


def _backends(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """Every registered backend (shm's line names its data path), and what "auto" picks for the
    job the report is about (the one its plan below is for)."""
    add("Backends")
    b = report.get("backends") or {}
    if _na(b):
        add(f"  {_na(b)}")
        return
    for item in b.get("backends", []):
        if isinstance(item, dict):
            ok = item.get("available")
            ver = item.get("version")
            mark = "yes" if ok else ("?  " if ok is None else "no ")
            why = "; ".join(filter(None, (item.get("reason"), _data_path(item))))
            add(f"  [{mark}] {item.get('name', '?')}" + (f" {ver}" if ver else "") + (f": {why}" if why else ""))
        else:
            add(f"  {item}")
    auto = b.get("auto")
    if isinstance(auto, dict):
        who = f" for {auto['for']}" if auto.get("for") else ""
        if "error" in auto:
            add(f"  auto{who} -> error: {auto['error']}")
        else:
            leg = f", between nodes {auto['inter']}" if auto.get("inter") else ""
            add(f"  auto{who} -> {auto.get('name')}{leg}" + (f" ({auto['reason']})" if auto.get("reason") else ""))
        from cpuddp.backends.auto import RULE

        add(f"  auto's rule: {RULE}")


def _data_path(item: Mapping[str, Any]) -> str:
    """``data path native (avx2)``, ``data path python (<why>)``: which data path a backend's
    group would take here, in :func:`cpuddp.backends.shm.native.status`'s words; "" for a
    backend that has one (gloo: its own)."""
    return f"data path {item['data_path']}" if item.get("data_path") else ""


def _backend_words(report: Mapping[str, Any], name: Optional[str]) -> str:
    """``shm, data path native (avx2)``: a backend's name with its data path (shm's), as the
    Backends section shows it -- the words a job's header line says too."""
    items = (report.get("backends") or {}).get("backends") or []
    item = next((i for i in items if isinstance(i, Mapping) and i.get("name") == name), None)
    path = _data_path(item) if item is not None else ""
    return f"{name}, {path}" if path else str(name)


def _cpu(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """The CPU model, features, topology and limits."""
    add("CPU")
    c = report.get("cpu") or {}
    if _na(c):
        add(f"  {_na(c)}")
    else:
        feats = c.get("features") or {}
        add(f"  model: {c.get('model') or 'unknown'}")
        add("  features: " + ", ".join(f"{_FEATURE_LABELS.get(k, k)} {'yes' if on else 'no'}" for k, on in feats.items()))
        add(f"  {len(c.get('sockets') or [])} socket(s), {len(c.get('numa_nodes') or [])} NUMA node(s), "
            f"{c.get('physical_cores')} usable physical core(s), {c.get('logical_cpus')} logical CPU(s) online, "
            f"{c.get('threads_per_core')} thread(s) per core")
        quota = c.get("quota")
        add(f"  allowed {c.get('allowed') or '?'}; usable {c.get('usable') or '?'}; cgroup cpuset "
            f"{c.get('cgroup_cpus') or 'none'}; quota {('%g CPUs' % quota) if quota else 'none'}; "
            f"effective {c.get('effective_cpu_count')} CPU(s)")
        for note in c.get("notes") or []:
            add(f"  note: {note}")


def _torch(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """What only torch can tell (``--torch``)."""
    tp = report.get("torch")
    add("torch (--torch)")
    if _na(tp):
        add(f"  {_na(tp)}")
    else:
        add(f"  torch {tp['version']}: {tp['num_threads']} intra-op / {tp['num_interop_threads']} inter-op "
            f"threads; oneDNN {'yes' if tp['mkldnn'] else 'no'}; torch.cpu says AVX-512 "
            f"{tp.get('is_avx512_supported')}, AVX512-BF16 {tp.get('is_avx512_bf16_supported')}, "
            f"AMX {tp.get('is_amx_tile_supported')}")


def _threads(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """The thread and affinity variables that are set."""
    add("Threads")
    t = report.get("threads") or {}
    set_vars = {k: val for k, val in t.items() if val is not None}
    add("  " + (", ".join(f"{k}={val}" for k, val in set_vars.items()) if set_vars else "no thread variables set"))


def _pinning(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """The plan cpuddp would apply for each local rank of this node: a table, then rank 0's
    exports and reason (the other ranks' differ only in their CPUs and thread counts)."""
    p = report.get("pinning") or {}
    items = [i for i in p.get("plans", []) if isinstance(i.get("plan"), Mapping)] if not _na(p) else []
    add(f"Pinning plan: {len(items)} local rank(s) of this node"
        + (f", backend {_backend_words(report, p['backend'])}" if p.get("backend") else ""))
    if _na(p):
        add(f"  {_na(p)}")
        return
    rows = [("rank", "local", "CPUs", "threads")]
    rows += [(str(i["rank"]), str(i["local_rank"]), i["plan"].get("cpulist") or "-", str(i["plan"].get("num_threads")))
             for i in items]
    _table(rows, add)
    if items:
        add(f"  local rank {items[0]['local_rank']}: {_plan_line(items[0]['plan'])}")


def _table(rows: list[tuple[str, ...]], add: Callable[[str], None]) -> None:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        add("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def _job(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """From a shell: what a job here would get (the plan ``cpuddp run`` would use)."""
    j = report.get("job") or {}
    add("A job here: the plan `cpuddp run` would use" + ("" if j.get("ranks") else
                                                         " (--ranks N for another rank count)"))
    if _na(j):
        add(f"  {_na(j)}" + (f"\n  fix: {j['fix']}" if j.get("fix") else ""))
        return
    for line in str(j.get("table", "")).splitlines():
        add(f"  {line}")
    b = j.get("backend") or {}
    add(f"  backend: {_backend_words(report, b['name'])}; auto's choice, why: see Backends above" if b.get("name")
        else f"  backend: {b.get('error')}")
    add(f"  launch it: {j.get('command')}  (--dry-run prints the exact command)")


def _host(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """This host's name resolution and the GLOO_SOCKET_IFNAME cpuddp would export."""
    h = report.get("host") or {}
    add(f"Host: {h.get('name')} -> {', '.join(h.get('addresses') or []) or h.get('error') or '?'}")
    net = report.get("network") or {}
    if _na(net):
        add(f"  GLOO_SOCKET_IFNAME: {_na(net)}")
    elif net.get("GLOO_SOCKET_IFNAME") or net.get("source"):
        add(f"  GLOO_SOCKET_IFNAME: {net.get('GLOO_SOCKET_IFNAME') or '(not set)'}"
            + (f" ({net['source']})" if net.get("source") else ""))


def _warnings(report: Mapping[str, Any], add: Callable[[str], None]) -> None:
    """The warnings, each with its fix."""
    warnings = report.get("warnings") or []
    add(f"Warnings: {len(warnings)}" if warnings else "Warnings: none")
    for w in warnings:
        add(f"  ! {w['message']}")
        add(f"    fix: {w['fix']}")


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
