"""Training throughput: cpuddp's custom loop vs Hugging Face Trainer, fp32 vs bf16, 1 vs 2 ranks.

    python benchmarks/train_throughput.py                  # the full measurement (see --help)
    python benchmarks/train_throughput.py --quick          # 3 steps, 1 repeat: does the script work?
    python benchmarks/train_throughput.py --replot benchmarks/results/train_throughput.json
                                                           # redraw a result's PNG; runs nothing

Every case trains the same model -- the BERT-style cross-encoder of ``examples/finetune.py
--size bench --model hf`` (transformers' BertForSequenceClassification from a tiny config:
hidden 256, 4 layers, 11.2 M parameters, random weights, seq 128), not README's small demo
model -- on the same synthetic paraphrase data, with the same global batch, steps,
learning-rate schedule, optimizer family (AdamW, fused) and gradient clipping:

* ``cpuddp``  -- ``examples/finetune.py --size bench --model hf`` (init_distributed, prepare,
  shard, a plain loop);
* ``trainer`` -- ``transformers.Trainer`` with ``use_cpu=True``, ``ddp_backend="gloo"`` (on 2 ranks),
  ``bf16=`` the precision, its other settings left at their defaults (so its DDP runs with
  ``find_unused_parameters=True``, as Trainer users get it).

One rank runs as ``python``; two ranks under ``torchrun --standalone --nproc-per-node 2``.
The global batch (``--global-batch``, default 32) is split over the ranks; a single rank
uses every allowed core as threads, two ranks one thread each (torchrun's default).

samples/s counts every rank's samples over the steps after ``--warmup`` (barrier to
barrier).  Cases run interleaved (case 1..8, then again) ``--repeats`` times; the summary
is the median with min and max.  Output: ``benchmarks/results/train_throughput.json``
(meta with date, host and CPU, every run, summary, ratios, targets), ``.png`` (titled with the
model, the CPU, torch and the backend of the 2-rank runs) and ``.md`` beside it, and the
Markdown table on stdout (for docs/performance.md).  ``#`` lines are progress.  Exit code 0 when every run
succeeded (targets missed are reported, not failed); 1 when a run failed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import os
import shlex
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune.py"
RESULTS = Path(__file__).resolve().parent / "results"

RUNNERS = ("cpuddp", "trainer")
PRECISIONS = ("fp32", "bf16")
RANKS = (1, 2)
TARGET_BF16 = 1.5  # bf16 samples/s >= 1.5 x fp32
TARGET_VS_TRAINER = 1.1  # cpuddp samples/s >= 1.1 x Trainer

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "NODE_RANK")
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MV2_", "SLURM_", "MPI_LOCAL", "HYDRA_", "I_MPI_", "TORCHELASTIC_")


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the Trainer worker


def trainer_worker(args: argparse.Namespace) -> int:
    """One rank of the Trainer case (run by this script under python or torchrun)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    spec = importlib.util.spec_from_file_location("finetune_example", EXAMPLE)
    finetune = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(finetune)  # type: ignore[union-attr]

    if args.threads:
        torch.set_num_threads(args.threads)
    model, model_name = finetune.build_model("hf", "bench", seed=args.seed)
    train = finetune.build_dataset(args.num_samples, args.seq_len, seed=args.seed)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t0: Optional[float] = None
            self.t1: Optional[float] = None
            self.loss = float("nan")

        def on_step_end(self, targs, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == args.warmup:
                self._sync()
                self.t0 = time.perf_counter()
            if state.global_step == args.steps:
                self._sync()
                self.t1 = time.perf_counter()

        def on_log(self, targs, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])

        @staticmethod
        def _sync() -> None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.barrier()

    clock = Clock()
    out_dir = tempfile.mkdtemp(prefix="cpuddp-trainer-")
    targs = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        # accelerate 1.15 crashes on ddp_backend="gloo" in a single process ("Default process
        # group has not been initialized"), so it is set only when there are ranks to join.
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        bf16=args.precision == "bf16",
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        weight_decay=0.01,
        warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=max(1, min(10, args.steps)),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_drop_last=True,
        seed=args.seed,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=train, callbacks=[clock])
    trainer.train()
    world = targs.world_size
    timed = args.steps - args.warmup
    rate = world * args.batch_size * timed / (clock.t1 - clock.t0) if clock.t0 and clock.t1 and timed > 0 else float("nan")
    if trainer.is_world_process_zero():
        import transformers

        result = {
            "samples_per_s": rate,
            "loss": clock.loss,
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "timed_seconds": (clock.t1 or 0) - (clock.t0 or 0),
            "batch_size_per_rank": args.batch_size,
            "world_size": world,
            "threads_per_rank": torch.get_num_threads(),
            "precision": args.precision,
            "requested_precision": args.precision,
            "model": model_name,
            "optim": str(targs.optim),
            "ddp_find_unused_parameters": targs.ddp_find_unused_parameters,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        }
        with open(args.result_json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"samples/s {rate:.1f} | loss {clock.loss:.4f}", flush=True)
    return 0


# --------------------------------------------------------------------------- the driver


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["CPUDDP_PRECISION_TRIAL"] = "0"  # time each precision as asked, from the first step
    return env


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def command(runner: str, precision: str, ranks: int, opts: argparse.Namespace, result_json: str) -> list[str]:
    per_rank = opts.global_batch // ranks
    threads = max(1, usable_cores() // ranks)
    launch = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
    ]
    common = ["--steps", str(opts.steps), "--batch-size", str(per_rank), "--seq-len", str(opts.seq_len), "--lr", str(opts.lr),
              "--num-samples", str(opts.num_samples), "--threads", str(threads), "--result-json", result_json]
    if runner == "cpuddp":
        cmd = launch + [str(EXAMPLE), *common, "--warmup-steps", str(opts.warmup), "--eval-samples", "0",
                        "--model", "hf", "--size", "bench", "--log-every", str(max(1, min(10, opts.steps)))]
        cmd += ["--precision", precision]  # each as asked: CPUDDP_PRECISION_TRIAL=0 (clean_env) skips the trial
        return cmd + shlex.split(opts.cpuddp_args)
    return launch + [str(Path(__file__).resolve()), "--worker", "trainer", *common,
                     "--warmup", str(opts.warmup), "--precision", precision]


def run_case(runner: str, precision: str, ranks: int, opts: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpuddp-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = command(runner, precision, ranks, opts, out)
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, env=clean_env(), cwd=tmp)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = -1, f"timed out after {opts.timeout} s: {str(exc.stderr or '')[-1500:]}"
        wall = time.perf_counter() - t
        record: dict[str, Any] = {"runner": runner, "precision": precision, "ranks": ranks,
                                  "command": " ".join(cmd), "wall_seconds": round(wall, 2), "returncode": rc}
        if rc == 0 and os.path.exists(out):
            with open(out, encoding="utf-8") as fh:
                record["result"] = json.load(fh)
        else:
            record["error"] = tail
        return record


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for runner, precision, ranks in itertools.product(RUNNERS, PRECISIONS, RANKS):
        rates = [r["result"]["samples_per_s"] for r in runs
                 if r["runner"] == runner and r["precision"] == precision and r["ranks"] == ranks and "result" in r]
        if rates:
            summary[f"{runner}/{precision}/{ranks}"] = {
                "runner": runner, "precision": precision, "ranks": ranks, "n": len(rates),
                "median": statistics.median(rates), "min": min(rates), "max": max(rates),
            }
    return summary


def ratios(summary: dict[str, Any]) -> dict[str, Any]:
    def med(key: str) -> Optional[float]:
        return summary[key]["median"] if key in summary else None

    out: dict[str, Any] = {"bf16_over_fp32": {}, "cpuddp_over_trainer": {}}
    for runner, ranks in itertools.product(RUNNERS, RANKS):
        a, b = med(f"{runner}/bf16/{ranks}"), med(f"{runner}/fp32/{ranks}")
        if a and b:
            out["bf16_over_fp32"][f"{runner}/{ranks}"] = {"ratio": a / b, "target": TARGET_BF16, "met": a / b >= TARGET_BF16}
    for precision, ranks in itertools.product(PRECISIONS, RANKS):
        a, b = med(f"cpuddp/{precision}/{ranks}"), med(f"trainer/{precision}/{ranks}")
        if a and b:
            out["cpuddp_over_trainer"][f"{precision}/{ranks}"] = {"ratio": a / b, "target": TARGET_VS_TRAINER,
                                                                  "met": a / b >= TARGET_VS_TRAINER}
    return out


def meta(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "usable_cores": usable_cores(),
        "cpu": cpu_model(),
        "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        "avx512_bf16": bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()),
        "args": {k: v for k, v in vars(opts).items() if k not in ("worker",)},
    }
    for name in ("transformers", "accelerate", "intel_extension_for_pytorch"):
        try:
            info[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    return info


def plot_title(doc: dict[str, Any], cpu: Optional[str] = None, backend: Optional[str] = None) -> str:
    """What the PNG shows: the model and batch, the CPU, torch and the 2-rank runs' DDP backend.

    ``cpu`` and ``backend`` stand in for what an older result does not record (its meta's CPU
    without generation or ISA; the example's backend)."""
    m = doc["meta"]
    backends = sorted({r["result"]["backend"] for r in doc["runs"]
                       if r["runner"] == "cpuddp" and r["ranks"] > 1 and r.get("result", {}).get("backend")})
    ddp = backend or (", ".join(backends) if backends else "not recorded")
    cores = m["usable_cores"]
    return (f"BERT-style cross-encoder (11.2 M parameters, seq {m['args']['seq_len']}, global batch "
            f"{m['args']['global_batch']}): cpuddp's loop vs Hugging Face Trainer\n"
            f"{cpu or m['cpu']}, torch {m['torch'].split('+')[0]}\n"
            f"1 rank x {cores} thread(s), 2 ranks x {max(1, cores // 2)}; "
            f"2-rank DDP: cpuddp's on {ddp}, Trainer's on gloo; {m['date'][:10]}")


def markdown(summary: dict[str, Any], rat: dict[str, Any], m: dict[str, Any], runs: Sequence[dict[str, Any]] = ()) -> str:
    lines = [
        f"Measured {m['date'][:10]} on {m['cpu']} ({m['usable_cores']} cores; AMX {'yes' if m['amx'] else 'no'}, "
        f"AVX512-BF16 {'yes' if m['avx512_bf16'] else 'no'}), torch {m['torch']}, transformers {m['transformers']}; "
        f"global batch {m['args']['global_batch']}, {m['args']['steps']} steps ({m['args']['warmup']} warm-up), "
        f"median of {m['args']['repeats']} runs (min-max).",
        "",
        "| ranks x threads | precision | cpuddp samples/s | Trainer samples/s | cpuddp / Trainer |",
        "| --- | --- | --- | --- | --- |",
    ]
    for ranks, precision in itertools.product(RANKS, PRECISIONS):
        threads = max(1, m["usable_cores"] // ranks)
        cells = []
        for runner in RUNNERS:
            s = summary.get(f"{runner}/{precision}/{ranks}")
            tried = any(r["runner"] == runner and r["precision"] == precision and r["ranks"] == ranks for r in runs)
            cells.append(f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})" if s else ("failed" if tried else "not run"))
        r = rat["cpuddp_over_trainer"].get(f"{precision}/{ranks}")
        cells.append(f"{r['ratio']:.2f}x" if r else "-")
        lines.append(f"| {ranks} x {threads} | {precision} | " + " | ".join(cells) + " |")
    lines.append("")
    for key, r in rat["bf16_over_fp32"].items():
        lines.append(f"- bf16 / fp32, {key.replace('/', ', ')} rank(s): {r['ratio']:.2f}x "
                     f"(target {r['target']}x: {'met' if r['met'] else 'missed'})")
    for key, r in rat["cpuddp_over_trainer"].items():
        lines.append(f"- cpuddp / Trainer, {key.replace('/', ', ')} rank(s): {r['ratio']:.2f}x "
                     f"(target {r['target']}x: {'met' if r['met'] else 'missed'})")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path, title: str) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return None
    groups = [f"{ranks} rank{'s' if ranks > 1 else ''}\n{precision}" for ranks, precision in itertools.product(RANKS, PRECISIONS)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    for i, runner in enumerate(RUNNERS):
        xs, ys, lo, hi = [], [], [], []
        for j, (ranks, precision) in enumerate(itertools.product(RANKS, PRECISIONS)):
            s = summary.get(f"{runner}/{precision}/{ranks}")
            if s:
                xs.append(j + (i - 0.5) * width)
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label="cpuddp custom loop" if runner == "cpuddp" else "HF Trainer")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("samples/s (median, min-max)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    ap.add_argument("--warmup", type=int, default=8, help="steps left out of samples/s (default 8)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per case (default 5)")
    ap.add_argument("--global-batch", type=int, default=32, help="samples per step over all ranks (default 32)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate, both runners (default 5e-4, as the example)")
    ap.add_argument("--num-samples", type=int, default=4096)
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--cpuddp-args", default="", help="extra arguments for the example, e.g. '--no-pin'")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--out", help="directory for JSON and PNG (default benchmarks/results; a temp dir with --quick)")
    ap.add_argument("--quick", action="store_true", help="3 steps, 1 warm-up, 1 repeat: a smoke test of this script")
    ap.add_argument("--replot", type=Path, metavar="JSON", help="redraw this result's PNG beside it (runs nothing)")
    ap.add_argument("--cpu", help="with --replot: the CPU for the title, where the result names it without generation")
    ap.add_argument("--backend", help="with --replot: cpuddp's DDP backend, where the result does not record it")
    # internal: one rank of the Trainer case
    ap.add_argument("--worker", choices=["trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)
    ap.add_argument("--result-json", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.steps, opts.warmup, opts.repeats, opts.num_samples = 3, 1, 1, 256
    return opts


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parse_args(argv)
    if opts.worker == "trainer":
        return trainer_worker(opts)
    if opts.replot:
        doc = json.loads(opts.replot.read_text(encoding="utf-8"))
        out = plot(doc["summary"], opts.replot.with_suffix(".png"), plot_title(doc, opts.cpu, opts.backend))
        log(f"wrote {out}" if out else "no plot")
        return 0 if out else 1

    runners = [r for r in opts.runners.split(",") if r]
    precisions = [p for p in opts.precisions.split(",") if p]
    ranks_list = [int(r) for r in opts.ranks.split(",") if r]
    if "trainer" in runners and (importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None):
        log("transformers/accelerate not installed: Trainer cases skipped (pip install transformers accelerate)")
        runners = [r for r in runners if r != "trainer"]
    if importlib.util.find_spec("transformers") is None:
        log("transformers not installed: cannot build the same model for every case")
        return 1
    cases = list(itertools.product(runners, precisions, ranks_list))
    out_dir = Path(opts.out) if opts.out else (Path(tempfile.mkdtemp(prefix="cpuddp-bench-")) if opts.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    m = meta(opts)
    log(f"{len(cases)} cases x {opts.repeats} repeats, {opts.steps} steps each; results in {out_dir}")

    runs: list[dict[str, Any]] = []
    for rep in range(opts.repeats):
        for runner, precision, ranks in cases:
            rec = run_case(runner, precision, ranks, opts)
            rec["repeat"] = rep
            runs.append(rec)
            rate = rec.get("result", {}).get("samples_per_s")
            status = f"{rate:.1f} samples/s" if rate is not None else f"FAILED (rc {rec['returncode']})"
            log(f"repeat {rep + 1}/{opts.repeats} {runner:7s} {precision} {ranks} rank(s): {status} [{rec['wall_seconds']} s]")
            if "error" in rec:
                log("  " + rec["error"].strip().replace("\n", "\n#   ")[-1500:])

    summary = summarize(runs)
    rat = ratios(summary)
    base = out_dir / ("train_throughput-quick" if opts.quick else "train_throughput")
    doc = {"meta": m, "summary": summary, "ratios": rat, "runs": runs}
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    plot(summary, base.with_suffix(".png"), plot_title(doc))
    table = markdown(summary, rat, m, runs)
    base.with_suffix(".md").write_text(table + "\n", encoding="utf-8")
    print(table)
    log(f"wrote {base}.json, .png, .md")
    return 0 if all("result" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
