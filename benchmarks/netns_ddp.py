"""DDP samples/s across two "hosts" (network namespaces on a veth pair) on a shaped link.

    python benchmarks/netns_ddp.py --nets 10g,1g --skip '*/1x2/*/fp16,*/2x1/*/fp16,1g/2x1/*'   # root; takes the lock
    python benchmarks/netns_ddp.py --quick                                           # plumbing check
    python benchmarks/netns_ddp.py --ceiling                                         # unshaped TCP ceiling

Layouts: ``1x2`` (one host, 2 ranks: no network), ``2x1`` (2 hosts x 1 rank) and ``2x2``
(2 hosts x 2 ranks: 4 processes on this machine's CPUs).  Backends: ``gloo`` (flat) and
``shm`` (cpuddp's hierarchical group: shared memory within a host, gloo between hosts).
Hooks: none, ``fp16`` (torch's fp16_compress_hook) and ``bf16`` (cpuddp's bf16 hook), the
ones ``cpuddp.prepare(comm_hook=...)`` registers.  Each rank trains the 10.5 M-parameter MLP
of benchmarks/shm_ddp.py (1024-2048-2048-2048-10, fp32, SGD momentum, batch 32 per rank).

``--skip`` leaves cases out (``net/layout/backend/hook`` patterns).  Links (:data:`NETS`): ``tc`` on both veth ends -- ``tbf`` for the rate and ``netem`` for the
one-way delay when the kernel has netem (this script says when it does not: the delay is then
only in the scaling model, benchmarks/netns_model.py).  Cases run interleaved (the case order
reversed on every other repeat); the heavy lock (benchmarks/_heavy_lock.py: a file in a
directory of the invoking user's, ``SUDO_UID``'s under sudo) is held for one round of cases at a
time.  The summary is the median.  Output: ``benchmarks/results/netns_ddp.json`` and a Markdown table.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _heavy_lock import HeavyLock, lock_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
NS = ("cpuddpdd-a", "cpuddpdd-b")
IFS = ("cpuddpdda", "cpuddpddb")
ADDRS = ("10.79.0.1", "10.79.0.2")
#: name -> (rate, one-way delay in microseconds); None: the bare veth.
NETS: dict[str, Optional[tuple[str, int]]] = {
    "none": None, "10g": ("10gbit", 25), "25g": ("25gbit", 15), "1g": ("1gbit", 50)}


# --------------------------------------------------------------------------- rank side


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cpuddp

    cpuddp.init_distributed(backend=args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    ddp = DDP(model)
    if args.hook != "none":
        from cpuddp.train.common.comm import register_hook

        assert register_hook(ddp, args.hook, None, True, []) == args.hook
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(args.batch, 1024, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
            for _ in range(4)]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(i)
    dist.barrier()
    sps = n * args.batch * args.steps / (time.perf_counter() - t0)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"backend": str(dist.get_backend()), "samples_per_s": sps}))
    cpuddp.shutdown()


# --------------------------------------------------------------------------- the two hosts


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=check)


def make_hosts() -> None:
    drop_hosts()
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", IFS[0], "netns", NS[0], "type", "veth", "peer", "name", IFS[1], "netns", NS[1])
    for ns, ifname, addr in zip(NS, IFS, ADDRS):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
        sh("ip", "-n", ns, "link", "set", ifname, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def drop_hosts() -> None:
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def shape(net: str) -> str:
    """Shape both veth ends for ``net``; what was applied (the delay may be unavailable)."""
    spec = NETS[net]
    applied = []
    for ns, ifname in zip(NS, IFS):
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ifname, "root", check=False)
        if spec is None:
            continue
        rate, delay = spec
        netem = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ifname, "root", "handle", "1:",
                   "netem", "delay", f"{delay}us", "limit", "100000", check=False)
        parent = ["parent", "1:1", "handle", "10:"] if netem.returncode == 0 else ["root", "handle", "10:"]
        # burst: at least rate x 1 ms (a tbf bucket smaller than that caps the rate below it)
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ifname, *parent,
           "tbf", "rate", rate, "burst", "4mb", "latency", "10ms")
        applied = [f"tbf rate {rate}",
                   f"netem delay {delay}us" if netem.returncode == 0 else
                   f"no delay (netem unavailable: {netem.stderr.strip()})"]
    return ", ".join(applied) or "unshaped veth"


def run_case(case: tuple[str, str, str], opts: argparse.Namespace, port: int) -> float:
    layout, backend, hook = case
    hosts, per = (int(x) for x in layout.split("x"))
    world = hosts * per
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        procs = []
        for r in range(world):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r % per),
                   "LOCAL_WORLD_SIZE": str(per), "MASTER_ADDR": ADDRS[0], "MASTER_PORT": str(port)}
            cmd = ["ip", "netns", "exec", NS[r // per], "timeout", str(int(opts.timeout)), sys.executable,
                   __file__, "--rank-main", "--backend", backend, "--hook", hook, "--result", result,
                   "--batch", str(opts.batch), "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
            log = open(os.path.join(tmp, f"rank{r}.log"), "w")
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        codes = []
        for p, log in procs:
            codes.append(p.wait())
            log.close()
        if any(codes) or not os.path.exists(result):
            logs = "\n".join(Path(tmp, f"rank{r}.log").read_text()[-2000:] for r in range(world))
            raise SystemExit(f"case {case} failed: exit codes {codes}\n{logs}")
        return float(json.loads(Path(result).read_text())["samples_per_s"])


def allreduce_case(opts: argparse.Namespace, port: int) -> dict[str, float]:
    """16 MiB allreduce, 2 hosts x 2 ranks, gloo and shm in one run: ms per call (rank 0)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ar.json")
        procs = []
        for r in range(4):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r % 2),
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": ADDRS[0], "MASTER_PORT": str(port)}
            cmd = ["ip", "netns", "exec", NS[r // 2], "timeout", str(int(opts.timeout)), sys.executable, "-m",
                   "cpuddp", "bench", "allreduce", "--backend", "gloo,shm", "-b", opts.ar_size, "-e", opts.ar_size,
                   "--iters", str(opts.ar_iters), "--warmup", "3", "--no-ceiling", "--rounds", "3", *(["--json", out] if r == 0 else [])]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit("allreduce run failed:\n" + "\n".join(o[-2000:] for o in outs))
        rows = json.loads(Path(out).read_text())
    return _ar_times(rows)


def _ar_times(doc: Any) -> dict[str, float]:
    """ms per call of each backend at the one size (``cpuddp bench --backend a,b --json``)."""
    row = doc["rows"][-1]
    return {name: float(r["time_us"]) / 1e3 for name, r in row["backends"].items()}


def ceiling(seconds: float = 3.0) -> float:
    """TCP goodput (Gbit/s) from host a to host b over the current link, one stream."""
    script = ("import socket,sys,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
              f"s.bind(('{ADDRS[1]}',29777));s.listen(1);c,_=s.accept();n=0\n"
              "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nprint(n)")
    sink = subprocess.Popen(["ip", "netns", "exec", NS[1], sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    src = ("import socket,time\nc=socket.create_connection(('%s',29777));b=bytes(1<<20);t=time.time()\n"
           "while time.time()-t<%f: c.sendall(b)\nc.close();print(time.time()-t)") % (ADDRS[1], seconds)
    took = float(subprocess.run(["ip", "netns", "exec", NS[0], sys.executable, "-c", src],
                                capture_output=True, text=True, check=True, timeout=60).stdout)
    got = int(sink.communicate(timeout=60)[0])
    return got * 8 / took / 1e9


# --------------------------------------------------------------------------- driver


def cases(opts: argparse.Namespace) -> list[tuple[str, str, str]]:
    return list(itertools.product(opts.layouts.split(","), opts.backends.split(","), opts.hooks.split(",")))


def _wanted(net: str, case: tuple[str, str, str], opts: argparse.Namespace) -> bool:
    key = "/".join((net, *case))
    if case[0] == "1x2" and net != opts.nets.split(",")[0]:
        return False  # one host: the link plays no part, measured once
    return not any(fnmatch.fnmatch(key, pat) for pat in opts.skip.split(",") if pat)


def measure(opts: argparse.Namespace) -> dict[str, Any]:
    """Per link: the TCP ceiling, then ``--repeats`` rounds of every case (order reversed every
    other round) and one allreduce run; the heavy lock is held for one round at a time."""
    lock = HeavyLock(None if opts.no_lock else lock_path())
    out: dict[str, Any] = {"nets": {}}
    port = 29600
    for net in opts.nets.split(","):
        shaped = shape(net)
        runs: dict[str, list[float]] = {}
        ar: list[dict[str, float]] = []
        todo = [c for c in cases(opts) if _wanted(net, c, opts)]
        with lock:
            gbps = ceiling(2.0)
        print(f"# {net}: {shaped}; one TCP stream {gbps:.2f} Gbit/s; {len(todo)} cases", flush=True)
        for i in range(opts.repeats):
            with lock:
                for case in (todo if i % 2 == 0 else todo[::-1]):
                    port += 1
                    sps = run_case(case, opts, port)
                    runs.setdefault("/".join(case), []).append(sps)
                    print(f"# {net} repeat {i + 1} {'/'.join(case)}: {sps:.1f} samples/s", flush=True)
                if opts.ar_size:
                    port += 1
                    ar.append(allreduce_case(opts, port))
                    print(f"# {net} repeat {i + 1} allreduce {opts.ar_size}: {ar[-1]}", flush=True)
        out["nets"][net] = {"shaping": shaped, "tcp_gbit_s": gbps, "runs": runs, "allreduce": ar}
    return out


def summarize(doc: dict[str, Any]) -> str:
    lines = ["| link | layout | backend | hook | samples/s median (min-max) | vs gloo, same layout and hook |",
             "| --- | --- | --- | --- | --- | --- |"]
    for net, d in doc["nets"].items():
        med = {k: statistics.median(v) for k, v in d["runs"].items()}
        for k, v in d["runs"].items():
            layout, backend, hook = k.split("/")
            base = med.get(f"{layout}/gloo/{hook}")
            lines.append(f"| {net} | {layout} | {backend} | {hook} | {med[k]:.1f} ({min(v):.1f}-{max(v):.1f}) | "
                         f"{med[k] / base:.2f}x |" if base else "")
        if d["allreduce"]:
            ratios = [r["gloo"] / r["shm"] for r in d["allreduce"] if r.get("shm")]
            g = statistics.median(r["gloo"] for r in d["allreduce"])
            s = statistics.median(r["shm"] for r in d["allreduce"])
            lines.append(f"\n{net}: allreduce 2x2 gloo {g:.2f} ms, shm (hierarchical) {s:.2f} ms, "
                         f"ratio median {statistics.median(ratios):.2f}x (per run {', '.join(f'{x:.2f}' for x in ratios)})")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:
        name = platform.processor() or "unknown CPU"
    flags = open("/proc/cpuinfo").read()
    simd = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{name}, {simd}, {os.cpu_count()} CPUs"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="10g,1g", help=f"links, of {', '.join(NETS)}")
    ap.add_argument("--layouts", default="1x2,2x1,2x2")
    ap.add_argument("--backends", default="gloo,shm")
    ap.add_argument("--hooks", default="none,fp16,bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", default="", help="cases to leave out: net/layout/backend/hook patterns, e.g. '*/2x1/*/fp16'")
    ap.add_argument("--ar-size", default="16M", help="allreduce size per repeat ('' to skip)")
    ap.add_argument("--ar-iters", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--no-lock", action="store_true", help="do not take the heavy lock (benchmarks/_heavy_lock.py) per round")
    ap.add_argument("--ceiling", action="store_true", help="only the TCP ceiling of each link")
    ap.add_argument("--out", default=str(RESULTS / "netns_ddp.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--hook", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.rank_main:
        rank_main(opts)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("netns_ddp.py needs root (ip netns, tc)")
    if opts.quick:
        opts.steps, opts.warmup, opts.repeats, opts.nets, opts.hooks, opts.ar_iters = 2, 1, 1, "10g", "none,bf16", 2
        opts.out = os.path.join(tempfile.mkdtemp(), "netns_ddp.json")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still delete the namespaces
    make_hosts()
    try:
        if opts.ceiling:
            for net in opts.nets.split(","):
                print(f"{net}: {shape(net)}: one TCP stream {ceiling():.2f} Gbit/s", flush=True)
            return 0
        doc = measure(opts)
    finally:
        drop_hosts()
    doc["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": _cpu_model(),
                   "batch": opts.batch, "steps": opts.steps, "warmup": opts.warmup, "repeats": opts.repeats,
                   "python": platform.python_version(), "argv": sys.argv[1:]}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{doc['meta']['cpu']}; batch {opts.batch}/rank, {opts.steps} steps, median of {opts.repeats}\n")
    print(summarize(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
