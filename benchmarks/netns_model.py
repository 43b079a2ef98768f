"""DDP scaling to N nodes, on paper: an alpha-beta model with constants measured on one machine.

    python benchmarks/netns_model.py            # table on stdout, plot to benchmarks/results/netns_model.png

Per step, each rank computes for ``T_COMPUTE`` (forward + backward + optimizer of the 10.5 M
MLP, batch 32, one core: benchmarks/shm_ddp.py's no-sync step) and all-reduces ``S`` bytes of
gradients (42 MB in fp32, half with the bf16/fp16 hooks, which cost ``T_CAST`` per step to
convert).  N nodes of L ranks, P = N L ranks; a link of ``B`` bytes/s and one-way delay ``D``;
gloo costs ``A_GLOO`` per message (software, measured) and moves at most ``B_GLOO`` bytes/s
per rank (its CPU-bound copy and sum, measured on an unshaped link).

* flat ring (gloo over all P ranks): 2(P-1) steps of ``A_GLOO + D + (S/P) / min(B, B_GLOO)``;
* hierarchical (cpuddp's shm group): within each node shared memory reduce-scatter and
  all-gather (``T_SHM(S)``, measured on one node), and between nodes L rings of N, each on
  S/L bytes, sharing the link: 2(N-1) steps of ``A_GLOO + D + (S/(L N)) / min(B/L, B_GLOO)``;
* overlap: a fraction ``h`` of the communication hides behind backward (``T_BWD``);
  "no overlap" is h = 0 (cpuddp's shm allreduce ran synchronously when measured), "overlap"
  is h = 1 (communication hidden up to the whole backward).

step = T_COMPUTE (+ T_CAST with a hook) + max(0, comm + T_DDP - h T_BWD); samples/s = P x 32 / step.
``T_DDP`` is what DDP's reducer adds beyond the allreduces on this machine (bucket copies, waiting
for the slower rank); the comparison with the measured 2-host runs scales compute by the ranks
per core there (2 hosts x 2 ranks share 2 vCPUs).
The constants were measured on a 2-vCPU AMD EPYC (AVX2, no AVX-512), torch 2.13 (:data:`MEASURED_ON`).
Where it stops being trustworthy is in docs/multinode.md (and printed below).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plot import pyplot  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: Where the constants below were measured (the plot's title says so).
MEASURED_ON = "2-vCPU AMD EPYC (AVX2, no AVX-512), torch 2.13"

# ---- constants (seconds, bytes); each from a measurement named in docs/multinode.md
S = 10_507_786 * 4          # gradient bytes of the MLP (fp32)
T_COMPUTE = 0.086           # s per step, 1 core per rank (shm_ddp.json: no-sync 740 samples/s on 2 ranks)
T_BWD = 2 / 3 * T_COMPUTE   # backward is about two thirds of a step
T_CAST = 0.022              # s per step: fp32 -> fp16/bf16, divide, copy back of 10.5 M floats, 1 thread (20-24 ms min)
A_GLOO = 0.3e-3             # s per gloo ring step (1 node, 2 ranks: 16 KiB allreduce 0.56 ms = 2 steps)
B_GLOO = 0.85e9             # bytes/s one gloo rank moves (1 node, 2 ranks: 16 MiB in 18.8 ms, 64 MiB in 83 ms)
SHM_BPS = 3.7e9             # bytes/s of a node's shm allreduce (1 node, 2 ranks: 16 MiB 4.1 ms, 64 MiB 18.1 ms)
T_DDP = 0.030               # s per step DDP adds beyond the allreduces (bucket copies, waiting for the slower
                            # rank): shm_ddp.json, "added to a step" minus "allreduces alone" (shm 35, gloo 25 ms)
BATCH = 32
LINKS = {  # name: (bytes/s, one-way delay s)
    "10GbE": (10e9 / 8, 25e-6),
    "25GbE": (25e9 / 8, 15e-6),
    "1GbE": (1e9 / 8, 50e-6),
}


def flat(n: int, l: int, s: float, b: float, d: float) -> float:
    p = n * l
    if p == 1:
        return 0.0
    if n == 1:  # every hop is loopback
        return 2 * (p - 1) * (A_GLOO + (s / p) / B_GLOO)
    return 2 * (p - 1) * (A_GLOO + d + (s / p) / min(b, B_GLOO))  # the cross-node hops set the pace


def hier(n: int, l: int, s: float, b: float, d: float) -> float:
    local = (s / SHM_BPS) if l > 1 else 0.0
    if n == 1:
        return local
    return local + 2 * (n - 1) * (A_GLOO + d + (s / (l * n)) / min(b / l, B_GLOO))


def samples_per_s(n: int, l: int, link: str, path: str, compress: bool, overlap: bool, share: float = 1.0) -> float:
    """``share``: ranks per core (1: each rank its own core; 2 for 2 hosts x 2 ranks on 2 vCPUs)."""
    b, d = LINKS[link]
    s = S / 2 if compress else S
    comm = (hier if path == "hier" else flat)(n, l, s, b, d) + (T_DDP if n * l > 1 else 0.0)
    exposed = max(0.0, comm - (T_BWD * share if overlap else 0.0))
    step = (T_COMPUTE + (T_CAST if compress else 0.0)) * share + exposed
    return n * l * BATCH / step


VARIANTS = [("flat", False, False), ("hier", False, False), ("hier", True, False), ("hier", True, True),
            ("flat", True, True)]


def label(path: str, compress: bool, overlap: bool) -> str:
    return (("hierarchical" if path == "hier" else "flat ring (gloo)") + (" + bf16" if compress else "")
            + (" + overlap" if overlap else ""))


def efficiency(n: int, l: int, link: str, v: tuple[str, bool, bool]) -> float:
    """Samples/s over N nodes' perfect scaling of one node's compute-only rate."""
    return samples_per_s(n, l, link, *v) / (n * l * BATCH / T_COMPUTE)


def table(l: int = 2, nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> str:
    out = [f"L = {l} ranks per node; scaling efficiency (samples/s over N x L x compute-only rate)", ""]
    for link in LINKS:
        out.append(f"| {link} | " + " | ".join(f"N={n}" for n in nodes) + " |")
        out.append("| --- |" + " ---: |" * len(nodes))
        for v in VARIANTS:
            out.append(f"| {label(*v)} | " + " | ".join(f"{efficiency(n, l, link, v):.2f}" for n in nodes) + " |")
        out.append("")
    return "\n".join(out)


def check(measured: Optional[Path] = None) -> str:
    """The model against the measured 2-host runs (10g): predicted / measured samples/s."""
    path = measured or RESULTS / "netns_ddp.json"
    if not path.exists():
        return "(no measured netns_ddp.json to compare with)"
    import statistics

    doc = json.loads(path.read_text())
    net = doc["nets"].get("10g")
    if not net:
        return "(no 10g runs in netns_ddp.json)"
    rows = ["| layout | backend | hook | measured | model | model / measured |", "| --- | --- | --- | ---: | ---: | ---: |"]
    for key, runs in sorted(net["runs"].items()):
        layout, backend, hook = key.split("/")
        n, l = (int(x) for x in layout.split("x"))
        model = samples_per_s(n, l, "10GbE", "hier" if backend == "shm" else "flat", hook != "none", False,
                              share=max(1.0, n * l / 2))  # all ranks on this machine's 2 vCPUs
        got = statistics.median(runs)
        rows.append(f"| {layout} | {backend} | {hook} | {got:.0f} | {model:.0f} | {model / got:.2f} |")
    return "\n".join(rows)


def plot(out: Path, l: int = 2) -> None:
    plt = pyplot("the model's figure")
    if plt is None:
        return

    nodes = [1, 2, 4, 8, 16, 32, 64, 128]
    fig, axes = plt.subplots(1, len(LINKS), figsize=(5 * len(LINKS), 4), sharey=True)
    for ax, link in zip(axes, LINKS):
        for v in VARIANTS:
            ax.plot(nodes, [efficiency(n, l, link, v) for n in nodes], marker="o", label=label(*v))
        ax.set_xscale("log", base=2)
        ax.set_title(f"{link} ({l} ranks/node, 10.5 M MLP, 1 core/rank)")
        ax.set_xlabel("nodes")
        ax.set_ylim(0, 1.05)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (model)")
    fig.suptitle(f"DDP scaling efficiency by node count, modelled (not measured); constants from a {MEASURED_ON}",
                 fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    print(table())
    print(check())
    out = RESULTS / "netns_model.png"
    plot(out)
    print(f"\nplot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
