"""Each framework as its users run it by default (gloo) versus on cpuddp (shm + pinning).

    python benchmarks/frameworks.py                 # 5 interleaved repeats (see --help)
    python benchmarks/frameworks.py --quick         # 1 repeat, 6 steps: does it work?

Frameworks: Hugging Face Trainer, accelerate, Lightning Trainer, Fabric -- 2 ranks under
``torchrun --standalone --nproc-per-node 2`` (one thread per rank, torchrun's default), the
same 10.5 M-parameter MLP (1024-2048-2048-2048-10), the same data (random, seed 0), batch 32
per rank, AdamW lr 1e-3, ``--warmup`` untimed steps then ``--steps`` timed ones.

* ``default``: the framework alone -- Trainer ``use_cpu=True`` (accelerate forms a gloo group),
  ``Accelerator(cpu=True)``, ``Trainer/Fabric(strategy="ddp")`` (gloo);
* ``cpuddp``: ``cpuddp.init_distributed()`` first (Trainer, accelerate), or
  ``strategy=cpuddp.lightning.trainer_strategy()`` / ``fabric_strategy()`` -- docs/frameworks.md.

samples/s: a global optimizer step hook on rank 0 times the steps after warm-up (every rank's
samples).  Cases run interleaved (every case once, then again) ``--repeats`` times; the
summary is the median with min and max, and the ratio cpuddp / default per framework.  Output:
``benchmarks/results/frameworks.json`` (every run), ``frameworks.png`` and the Markdown table
on stdout.  Needs ``pip install -e ".[frameworks,bench]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plot import pyplot  # noqa: E402
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
FRAMEWORKS = ("trainer", "accelerate", "lightning", "fabric")
MODES = ("default", "cpuddp")

COMMON = r'''
import json, os, sys, time
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
WARMUP, STEPS, BATCH = int(os.environ["B_WARMUP"]), int(os.environ["B_STEPS"]), 32
MODE = os.environ["B_MODE"]
TOTAL = WARMUP + STEPS
stamps = []
register_optimizer_step_pre_hook(lambda opt, a, k: stamps.append(time.perf_counter()))

def mlp():
    torch.manual_seed(0)
    L = torch.nn.Linear
    return torch.nn.Sequential(L(1024, 2048), torch.nn.ReLU(), L(2048, 2048), torch.nn.ReLU(),
                               L(2048, 2048), torch.nn.ReLU(), L(2048, 10))

def data():
    g = torch.Generator().manual_seed(0)
    n = TOTAL * BATCH * 2
    return torch.randn(n, 1024, generator=g), torch.randint(0, 10, (n,), generator=g)

def report(backend):
    if int(os.environ.get("RANK", "0")) == 0:
        t = stamps[WARMUP:]
        sps = (len(t) - 1) * BATCH * 2 / (t[-1] - t[0])
        with open(os.environ["B_OUT"], "w") as f:
            json.dump({"samples_per_s": sps, "backend": backend, "steps": len(stamps)}, f)
'''

WORKERS = {
    "trainer": r'''
if MODE == "cpuddp":
    import cpuddp; cpuddp.init_distributed()
from transformers import Trainer, TrainingArguments
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.net = mlp()
    def forward(self, x, labels=None):
        out = self.net(x); return {"loss": torch.nn.functional.cross_entropy(out, labels), "logits": out}
class D(torch.utils.data.Dataset):
    def __init__(self): self.x, self.y = data()
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return {"x": self.x[i], "labels": self.y[i]}
args = TrainingArguments(output_dir="out", use_cpu=True, per_device_train_batch_size=BATCH, max_steps=TOTAL,
                         learning_rate=1e-3, report_to="none", save_strategy="no", logging_strategy="no",
                         disable_tqdm=True, dataloader_num_workers=0)
Trainer(model=M(), args=args, train_dataset=D()).train()
report(str(torch.distributed.get_backend()))
''',
    "accelerate": r'''
if MODE == "cpuddp":
    import cpuddp; cpuddp.init_distributed()
from accelerate import Accelerator
acc = Accelerator(cpu=True)
x, y = data()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)
model = mlp(); opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt, loader = acc.prepare(model, opt, loader)
for i, (xb, yb) in zip(range(TOTAL), loader):
    loss = torch.nn.functional.cross_entropy(model(xb), yb); opt.zero_grad(); acc.backward(loss); opt.step()
report(str(torch.distributed.get_backend()))
''',
    "lightning": r'''
import lightning as L
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.net = mlp()
    def training_step(self, b, i):
        return torch.nn.functional.cross_entropy(self.net(b[0]), b[1])
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
if MODE == "cpuddp":
    import cpuddp.lightning; strategy = cpuddp.lightning.trainer_strategy()
else:
    strategy = "ddp"
x, y = data()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)
tr = L.Trainer(accelerator="cpu", devices=2, max_steps=TOTAL, strategy=strategy, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
tr.fit(M(), loader)
report(str(torch.distributed.get_backend()))
''',
    "fabric": r'''
import lightning as L
if MODE == "cpuddp":
    import cpuddp.lightning; strategy = cpuddp.lightning.fabric_strategy()
else:
    strategy = "ddp"
fab = L.Fabric(accelerator="cpu", devices=2, strategy=strategy); fab.launch()
x, y = data()
loader = fab.setup_dataloaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH,
                                                           shuffle=True))
model = mlp(); opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = fab.setup(model, opt)
for i, (xb, yb) in zip(range(TOTAL), loader):
    loss = torch.nn.functional.cross_entropy(model(xb), yb); opt.zero_grad(); fab.backward(loss); opt.step()
report(str(torch.distributed.get_backend()))
''',
}


def run_case(fw: str, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    script = work / f"bench_{fw}.py"
    script.write_text(COMMON + WORKERS[fw])
    out = work / f"{fw}-{mode}.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(B_MODE=mode, B_OUT=str(out), B_WARMUP=str(args.warmup), B_STEPS=str(args.steps))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        print(f"# {fw} {mode} FAILED\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"framework": fw, "mode": mode, "ok": False}
    return {"framework": fw, "mode": mode, "ok": True, **json.loads(out.read_text())}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Median, min, max samples/s per case, and cpuddp / default per framework (pure)."""
    table: dict[str, dict[str, Any]] = {}
    for fw in FRAMEWORKS:
        row: dict[str, Any] = {}
        for mode in MODES:
            vals = [r["samples_per_s"] for r in runs if r["framework"] == fw and r["mode"] == mode and r["ok"]]
            if vals:
                row[mode] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals),
                             "backend": next(r["backend"] for r in runs if r["framework"] == fw and r["mode"] == mode
                                             and r["ok"])}
        if len(row) == 2:
            row["ratio"] = row["cpuddp"]["median"] / row["default"]["median"]
        if row:
            table[fw] = row
    return table


def markdown(table: dict[str, dict[str, Any]]) -> str:
    lines = ["| framework | default (backend) samples/s, median [min-max] | on cpuddp (backend) samples/s "
             "| cpuddp / default |", "| --- | --- | --- | --- |"]
    for fw, row in table.items():
        cells = [f"{row[m]['median']:.0f} [{row[m]['min']:.0f}-{row[m]['max']:.0f}] ({row[m]['backend']})"
                 if m in row else "failed" for m in MODES]
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        lines.append(f"| {fw} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


def plot(table: dict[str, dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """samples/s of each framework as shipped and on cpuddp; the title names the model, the layout, CPU and torch."""
    plt = pyplot("frameworks.png")
    if plt is None:
        return

    fws = [fw for fw in table if "ratio" in table[fw]]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, mode in enumerate(MODES):
        med = [table[fw][mode]["median"] for fw in fws]
        err = [[m - table[fw][mode]["min"] for fw, m in zip(fws, med)],
               [table[fw][mode]["max"] - m for fw, m in zip(fws, med)]]
        ax.bar([i + 0.38 * k for i in range(len(fws))], med, 0.38, yerr=err, capsize=3,
               label="framework default (gloo)" if mode == "default" else "on cpuddp (shm + pinning)")
    ax.set_xticks([i + 0.19 for i in range(len(fws))], [f"{fw}\n{table[fw]['ratio']:.2f}x" for fw in fws])
    ax.set_ylabel("samples/s (2 ranks, median)")
    ax.set_title("Each framework as shipped vs on cpuddp: 10.5 M-param MLP, batch 32/rank, 2 ranks x 1 thread\n"
                 f"{meta['cpu']}, torch {meta['versions']['torch'].split('+')[0]}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--quick", action="store_true", help="1 repeat, 2 warm-up + 4 timed steps")
    ap.add_argument("--replot", action="store_true", help="redraw frameworks.png from frameworks.json; runs nothing")
    args = ap.parse_args()
    if args.replot:
        doc = json.loads((RESULTS / "frameworks.json").read_text())
        plot(doc["summary"], RESULTS / "frameworks.png", doc["meta"])
        return 0
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 2, 4
    fws = [f for f in args.frameworks.split(",") if f]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for fw in fws:
                for mode in MODES:
                    r = run_case(fw, mode, args, Path(tmp))
                    print(f"# repeat {rep + 1}/{args.repeats} {fw:10s} {mode:7s} "
                          + (f"{r['samples_per_s']:.0f} samples/s ({r['backend']})" if r["ok"] else "FAILED"),
                          flush=True)
                    runs.append({"repeat": rep, **r})
    table = summarize(runs)
    RESULTS.mkdir(exist_ok=True)
    meta = {"cpu": _cpu(), "python": platform.python_version(), "versions": _versions(), "args": vars(args)}
    (RESULTS / "frameworks.json").write_text(json.dumps({"meta": meta, "runs": runs, "summary": table}, indent=1))
    if table:
        plot(table, RESULTS / "frameworks.png", meta)
    print(markdown(table))
    return 0 if all(r["ok"] for r in runs) else 1


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    return f"{name}; AVX2 {'avx2' in flags}; AVX-512 {'avx512f' in flags}; {os.cpu_count()} vCPUs"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for pkg in ("torch", "transformers", "accelerate", "lightning"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return found


if __name__ == "__main__":
    sys.exit(main())
