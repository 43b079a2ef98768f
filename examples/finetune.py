"""Fine-tune a small BERT-style paraphrase classifier on CPUs with cpuddp: a plain custom loop.

    python examples/finetune.py --steps 100 --batch-size 16 [--bf16]
    torchrun --nproc-per-node 2 examples/finetune.py --steps 100 --batch-size 16
    mpiexec -n 2 python examples/finetune.py --steps 100 --batch-size 16

The model is ``transformers.BertForSequenceClassification`` built from a tiny config with
random weights (hidden 256, 4 layers, 4 heads, FFN 1024, vocabulary 30522: 11.2 M
parameters) when transformers is installed, else an equivalent plain-torch encoder
(``--model torch`` forces it).  Nothing is downloaded: the data is the synthetic
sentence-pair paraphrase set of ``paraphrase_data.py`` (or ``--data file.tsv`` in MRPC's
format), padded to ``--seq-len`` 128.

``--batch-size`` is per rank; samples/s counts every rank's samples and excludes the
warm-up steps.  Rank 0 shows a progress bar (a line per ``--log-every`` steps when stderr
is not a terminal) and prints the final ``samples/s`` and ``loss``; ``--result-json``
writes them as JSON (for ``benchmarks/train_throughput.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import cpuddp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paraphrase_data  # noqa: E402  (next to this file)

# The BERT-style configuration the cpuddp measurements use (docs/performance.md).
CONFIG = dict(vocab_size=30522, hidden=256, layers=4, heads=4, ffn=1024, max_positions=512, num_labels=2)


# --------------------------------------------------------------------------- model


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


class TinyBert(nn.Module):
    """A plain-torch stand-in for BertForSequenceClassification (post-LN encoder, GELU,
    word + position + token-type embeddings, tanh pooler on [CLS]); returns a dict with
    ``loss`` (when ``labels`` are given) and ``logits``, like transformers does."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int, ffn: int,
                 max_positions: int, num_labels: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab_size, hidden, padding_idx=paraphrase_data.PAD)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)
        # activation=_gelu (not "gelu") keeps nn.TransformerEncoderLayer off its fused
        # inference fast path, which fails on IPEX's prepacked weights ("2d weights expected").
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout, activation=_gelu,
                                           batch_first=True, layer_norm_eps=1e-12)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:  # BERT's initializer
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None) -> dict:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions)[None]
        if token_type_ids is not None:
            x = x + self.token_type(token_type_ids)
        x = self.dropout(self.norm(x))
        pad = None if attention_mask is None else attention_mask == 0
        h = self.encoder(x, src_key_padding_mask=pad)
        logits = self.classifier(self.dropout(torch.tanh(self.pooler(h[:, 0]))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


def build_model(kind: str = "auto", seed: int = 0) -> tuple[nn.Module, str]:
    """The classifier with random weights; ``kind`` is "hf", "torch" or "auto"."""
    torch.manual_seed(seed)
    if kind in ("auto", "hf"):
        try:
            from transformers import BertConfig, BertForSequenceClassification
        except ImportError:
            if kind == "hf":
                raise
        else:
            config = BertConfig(
                vocab_size=CONFIG["vocab_size"], hidden_size=CONFIG["hidden"],
                num_hidden_layers=CONFIG["layers"], num_attention_heads=CONFIG["heads"],
                intermediate_size=CONFIG["ffn"], max_position_embeddings=CONFIG["max_positions"],
                num_labels=CONFIG["num_labels"],
            )
            return BertForSequenceClassification(config), "transformers BertForSequenceClassification"
    return TinyBert(**CONFIG), "plain-torch TinyBert"


def build_dataset(num_samples: int, seq_len: int, seed: int = 0, path: Optional[str] = None) -> Any:
    pairs = paraphrase_data.read_tsv(path) if path else paraphrase_data.generate(num_samples, seed)
    return paraphrase_data.PairDataset(pairs, max_len=seq_len)


def linear_schedule(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then linear decay to 0 (transformers' default schedule)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- progress bar


class Progress:
    """A tiny progress bar: redrawn in place on a terminal, a plain line every ``every``
    steps otherwise (log files, torchrun, mpiexec).  Silent when ``enabled`` is false."""

    def __init__(self, total: int, enabled: bool = True, every: int = 10, stream: Any = None) -> None:
        self.total, self.enabled, self.every = total, enabled, max(1, every)
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def update(self, step: int, text: str = "") -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        if self.tty:
            width = 30
            done = int(width * step / max(1, self.total))
            bar = "#" * done + "-" * (width - done)
            self.stream.write(f"\r[{bar}] {step}/{self.total} {text} {elapsed:6.1f}s")
            if step >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif step % self.every == 0 or step >= self.total:
            self.stream.write(f"step {step}/{self.total} {text} {elapsed:.1f}s\n")
            self.stream.flush()


# --------------------------------------------------------------------------- training


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (default 16)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (falls back to fp32 on a CPU without bf16)")
    ap.add_argument("--strict-bf16", action="store_true", help="with --bf16: fail instead of falling back")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4; the weights are random)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--num-samples", type=int, default=8192, help="generated training pairs")
    ap.add_argument("--data", help="a TSV in MRPC's format instead of generated pairs")
    ap.add_argument("--eval-samples", type=int, default=512, help="held-out pairs to score at the end (0: none)")
    ap.add_argument("--model", choices=["auto", "hf", "torch"], default="auto")
    ap.add_argument("--warmup-steps", type=int, default=None, help="steps left out of samples/s (default min(5, steps/5))")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cpuddp's pinning / torch's)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--no-pin", action="store_true", help="init_distributed(pin=False): no core pinning")
    ap.add_argument("--no-ipex", action="store_true", help="stock PyTorch even when IPEX is installed")
    ap.add_argument("--comm-hook", choices=["fp16", "bf16"], default=None, help="gradient compression")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="write the trained state dict here (rank 0)")
    ap.add_argument("--result-json", help="write the result as JSON here (rank 0)")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    env = cpuddp.init_distributed(pin=not args.no_pin)
    if args.threads:
        torch.set_num_threads(args.threads)
    main_rank = cpuddp.is_main_process()

    model, model_name = build_model(args.model, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model = cpuddp.prepare(
        model,
        optimizer,
        mixed_precision="bf16" if args.bf16 else None,
        strict=args.strict_bf16,
        ipex=False if args.no_ipex else None,
        compile=args.compile,
        comm_hook=args.comm_hook,
    )
    info = cpuddp.prepared_info(model)
    scheduler = linear_schedule(optimizer, warmup=max(1, args.steps // 10), total=args.steps)

    train = build_dataset(args.num_samples, args.seq_len, seed=args.seed, path=args.data)
    loader = cpuddp.shard(train, batch_size=args.batch_size, shuffle=True, seed=args.seed, drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"--num-samples {args.num_samples} gives no full batch of {args.batch_size} per rank")
    warmup = min(5, args.steps // 5) if args.warmup_steps is None else args.warmup_steps
    if main_rank:
        nparams = sum(p.numel() for p in cpuddp.unwrap(model).parameters())
        print(
            f"{model_name}: {nparams / 1e6:.1f} M parameters | ranks {env.world_size} (launcher {env.launcher}) | "
            f"threads/rank {torch.get_num_threads()} | batch {args.batch_size}/rank | "
            f"precision {info.mixed_precision or 'fp32'} ({info.precision_reason}) | path {info.path}"
            + (" | fused AdamW" if info.fused_optimizer else ""),
            flush=True,
        )

    progress = Progress(args.steps, enabled=main_rank, every=args.log_every)
    model.train()
    batches = iter(loader)
    window_loss, window_n, last_loss = 0.0, 0, float("nan")
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step == warmup + 1:
            cpuddp.barrier()
            t_start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:  # a new epoch: the loader reshuffles (set_epoch) by itself
            batches = iter(loader)
            batch = next(batches)
        out = model(**batch)
        loss = out["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window_loss += loss.item()
        window_n += 1
        if step % args.log_every == 0 or step == args.steps:
            last_loss = cpuddp.reduce_mean(window_loss / window_n)
            window_loss, window_n = 0.0, 0
            timed = step - warmup
            rate = env.world_size * args.batch_size * timed / (time.perf_counter() - t_start) if timed > 0 else float("nan")
            progress.update(step, f"loss {last_loss:.4f} {rate:7.1f} samples/s")
        else:
            progress.update(step, "")
    cpuddp.barrier()
    elapsed = time.perf_counter() - t_start
    timed_steps = args.steps - warmup
    samples_per_s = env.world_size * args.batch_size * timed_steps / elapsed if timed_steps > 0 else float("nan")

    accuracy = None
    if args.eval_samples > 0:
        accuracy = evaluate(model, args)

    result = {
        "samples_per_s": samples_per_s,
        "loss": last_loss,
        "accuracy": accuracy,
        "steps": args.steps,
        "warmup_steps": warmup,
        "timed_seconds": elapsed,
        "batch_size_per_rank": args.batch_size,
        "world_size": env.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "precision": info.mixed_precision or "fp32",
        "requested_precision": "bf16" if args.bf16 else "fp32",
        "path": info.path,
        "fused_optimizer": info.fused_optimizer,
        "model": model_name,
        "launcher": env.launcher,
        "torch": torch.__version__,
    }
    if args.save:
        cpuddp.save_state_dict(model, args.save)
    if main_rank:
        acc = "" if accuracy is None else f" | eval accuracy {accuracy:.3f}"
        print(f"samples/s {samples_per_s:.1f} | loss {last_loss:.4f}{acc}", flush=True)
        if args.result_json:
            with open(args.result_json, "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=1)
    cpuddp.shutdown()
    return 0


def evaluate(model: nn.Module, args: argparse.Namespace) -> float:
    """Accuracy on held-out pairs (another seed), each rank scoring its shard."""
    data = build_dataset(args.eval_samples, args.seq_len, seed=args.seed + 1_000_003)
    loader = cpuddp.shard(data, batch_size=max(args.batch_size, 32), shuffle=False)
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            labels = batch.pop("labels")
            logits = model(**batch)["logits"]
            correct += int((logits.argmax(-1) == labels).sum())
            total += len(labels)
    model.train()
    acc = correct / total if total else 0.0
    return cpuddp.reduce_mean(acc, weight=total)


if __name__ == "__main__":
    sys.exit(main())
