"""Train a small BERT-style paraphrase classifier on CPUs with cpuddp: a plain custom loop.

    python -m torch.distributed.run --nproc-per-node 2 examples/finetune.py   # README's command
    python examples/finetune.py                                                # one process
    mpiexec -n 2 python examples/finetune.py
    ... examples/finetune.py --checkpoint-dir ckpt --save-every 100           # stop any time; run again to resume

**What it learns.**  Sentence pairs from ``paraphrase_data.py`` (generated, nothing is
downloaded): label 1 when sentence 2 says what sentence 1 says in other words (synonyms,
the time phrase moved to the front, the passive voice), 0 when it does not -- an unrelated
sentence, or a *hard negative* that keeps the sentence and swaps who, did what or to what
for a non-synonym.  No single token gives the label away: both sentences come from the same
vocabulary, and a hard negative differs from a paraphrase only in whether the one changed
word is a synonym.  The model has to compare the two sentences, whatever their word order,
and learn from the labels alone which words are synonyms.  Without that it tops out at
85 % accuracy (the hard negatives are 30 % of the negatives, 15 % of all pairs).

**The model.**  ``PairEncoder``, Sentence-BERT's pair classifier in plain torch: a
BERT-style encoder reads each sentence on its own, mean-pools it into a vector, and a head
classifies ``(u, v, |u - v|, u * v)``.  Comparing the two sentence vectors directly is what
lets it learn the synonyms in a minute; BERT's own ``[CLS]`` cross-encoder of the same size
(``TinyBert``, kept for ``--size bench``) learned word overlap quickly but no synonyms in
1200 steps here (85 %).

**Why it is sized so.**  The weights start random (there is no pre-trained checkpoint to
download), so everything is learned in the run, on 2 CPU cores, in well under a minute.
The vocabulary is this generator's 137 words, not BERT's 30522; pairs are at most 35
tokens, so ``--seq-len`` is 40, not 128; the encoder is one layer x 128 hidden (4 heads, FFN
512; 0.29 M parameters): 2 layers learned the task as well but took twice as long.  600
steps of 2 x 32 pairs at lr 2e-3 reach held-out accuracy 1.000 (the loss is below 0.1 by
step 180); README gives the time of the whole command and the CPU it was measured on.
Each step draws fresh pairs (one pass over ``--num-samples``, so the training loss is
measured on unseen pairs too), and the held-out pairs come from another seed.  ``--size
bench`` builds instead the 11.2 M-parameter BERT-style cross-encoder (hidden 256, 4 layers,
vocabulary 30522) that ``benchmarks/train_throughput.py`` times against Hugging Face
Trainer at ``--seq-len 128``: a throughput workload, too slow to learn this task in a
demo's time.

**Precision.**  ``--precision auto`` (the default) lets ``prepare`` time the first 14 steps
in fp32 and bf16 by turns and keep the faster: on a model this small, bf16's casts cost more
than its matrix products save (docs/performance.md has the figures and their CPUs), so it
keeps fp32 there; on a CPU without AMX or AVX512-BF16 it is fp32 without measuring.
``--precision bf16`` (or ``--bf16``) asks for bf16 and says so when it measured slower.

What it shows: ``init_distributed`` (launcher, backend, pinning), ``prepare`` (the precision,
fused AdamW, DDP), ``shard``, ``reduce_mean``, ``Progress`` (each rank's CPUs and threads,
then rank 0's progress bar, or a line per ``--log-every`` steps when stderr is not a
terminal), ``save_checkpoint``/``load_checkpoint`` with ``--checkpoint-dir`` (a run stopped
at any point and started again with the same command goes on from its last checkpoint:
the weights, optimizer, LR schedule, data position and random state) and a final summary
(``print0``: rank 0 prints it).  ``--batch-size`` is per rank; samples/s counts every rank's
samples and leaves out the ``--warmup-steps``.  With ``--size bench``, ``--model hf`` builds
``transformers.BertForSequenceClassification`` instead of the plain-torch ``TinyBert``.
``--result-json`` writes the numbers as JSON.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # the summary's wall time includes importing torch

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from typing import Any, Optional, Sequence  # noqa: E402

# Where numpy is not installed torch warns "Failed to initialize NumPy" at import, in every
# process: torchrun's own says it once; this example needs no numpy, so its ranks do not repeat it.
warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cpuddp  # noqa: E402
from cpuddp.train.progress import format_duration  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paraphrase_data  # noqa: E402  (next to this file)

#: Model sizes.  "small": the demo, sized for the task (the module doc says why; keep it in
#: step).  "bench": the BERT-style configuration of docs/performance.md (BERT's vocabulary).
SIZES: dict[str, dict[str, Any]] = {
    "small": dict(vocab_size=len(paraphrase_data.VOCAB), hidden=128, layers=1, heads=4, ffn=512,
                  max_positions=64, num_labels=2, dropout=0.0),
    "bench": dict(vocab_size=30522, hidden=256, layers=4, heads=4, ffn=1024, max_positions=512,
                  num_labels=2, dropout=0.1),
}
#: The demo's defaults (the module doc says why; keep it in step).
STEPS, BATCH, LR = 600, 32, 2e-3


# --------------------------------------------------------------------------- model


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


class TinyBert(nn.Module):
    """A plain-torch BertForSequenceClassification (post-LN encoder, GELU, word + position +
    token-type embeddings, tanh pooler on [CLS]); returns a dict with ``loss`` (when
    ``labels`` are given) and ``logits``, as transformers does."""

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


class PairEncoder(nn.Module):
    """Sentence-BERT's pair classifier in plain torch: one BERT-style encoder reads each
    sentence on its own (attention stays inside a sentence, positions restart), each sentence
    is mean-pooled into a vector, and the head classifies ``(u, v, |u - v|, u * v)``.

    Both sentences go through the encoder in one call, as ``[CLS] s1 [SEP] s2 [SEP]`` with
    an attention mask that blocks attention across the ``token_type_ids`` boundary, so the
    data and the loop are the same as for :class:`TinyBert`.  Comparing the two sentence
    vectors directly is what lets it learn the synonym groups fast: a paraphrase's
    ``|u - v|`` pulls synonyms together, a hard negative's pushes the swapped words apart.
    """

    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int, ffn: int,
                 max_positions: int, num_labels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(vocab_size, hidden, padding_idx=paraphrase_data.PAD)
        self.position = nn.Embedding(max_positions, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout, activation=_gelu,
                                           batch_first=True, layer_norm_eps=1e-12)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(4 * hidden, hidden), nn.Tanh(), nn.Dropout(dropout),
                                  nn.Linear(hidden, num_labels))
        self.apply(TinyBert._init)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> dict:
        second = token_type_ids == 1
        pad = attention_mask == 0
        steps = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        positions = torch.where(second, steps - second.long().argmax(1, keepdim=True), steps)
        x = self.dropout(self.norm(self.word(input_ids) + self.position(positions)))
        # Query i may attend key j only within its own sentence, never to padding.
        blocked = (token_type_ids[:, :, None] != token_type_ids[:, None, :]) | pad[:, None, :]
        h = self.encoder(x, mask=blocked.repeat_interleave(self.heads, 0)).float()  # pool in fp32 under bf16
        first = (~second & ~pad).unsqueeze(-1).float()
        other = (second & ~pad).unsqueeze(-1).float()
        u = (h * first).sum(1) / first.sum(1)
        v = (h * other).sum(1) / other.sum(1).clamp(min=1)
        logits = self.head(torch.cat([u, v, (u - v).abs(), u * v], dim=-1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


def build_model(kind: str = "torch", size: str = "small", seed: int = 0) -> tuple[nn.Module, str]:
    """The classifier with random weights.

    ``size`` "small": the demo's :class:`PairEncoder`.  ``size`` "bench": the cross-encoder of
    docs/performance.md, :class:`TinyBert` (``kind`` "torch") or transformers'
    BertForSequenceClassification (``kind`` "hf").
    """
    if size not in SIZES:
        raise SystemExit(f"--size must be one of {sorted(SIZES)}. Got {size!r} instead.")
    cfg = SIZES[size]
    torch.manual_seed(seed)
    if size == "small":
        if kind != "torch":
            raise SystemExit("--model hf builds the cross-encoder of --size bench; the small demo model is plain torch")
        return PairEncoder(**cfg), "PairEncoder (Sentence-BERT style, plain torch)"
    if kind == "hf":
        try:
            from transformers import BertConfig, BertForSequenceClassification
        except ImportError:
            raise SystemExit("--model hf needs transformers: pip install transformers") from None
        config = BertConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
            num_attention_heads=cfg["heads"], intermediate_size=cfg["ffn"],
            max_position_embeddings=cfg["max_positions"], num_labels=cfg["num_labels"],
            hidden_dropout_prob=cfg["dropout"], attention_probs_dropout_prob=cfg["dropout"],
        )
        return BertForSequenceClassification(config), "transformers BertForSequenceClassification (bench)"
    return TinyBert(**cfg), "plain-torch TinyBert (bench)"


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


# --------------------------------------------------------------------------- training


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    ap.add_argument("--batch-size", type=int, default=BATCH, help=f"pairs per rank per step (default {BATCH})")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                    help="auto (default): the first steps measure fp32 and bf16 and keep the faster; "
                         "bf16: bf16 autocast (fp32 on a CPU without bf16); fp32")
    ap.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="the same as --precision bf16")
    ap.add_argument("--strict-bf16", action="store_true", help="with --precision bf16: fail instead of falling back")
    ap.add_argument("--lr", type=float, default=LR, help=f"peak learning rate (default {LR:g})")
    ap.add_argument("--seq-len", type=int, default=40, help="tokens per pair, padded (default 40; the longest pair is 35)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default small; see the doc)")
    ap.add_argument("--num-samples", type=int, default=None,
                    help="generated training pairs (default: steps x batch x ranks, one pass)")
    ap.add_argument("--data", help="a TSV in MRPC's format instead of generated pairs")
    ap.add_argument("--eval-samples", type=int, default=2000, help="held-out pairs scored at the end (0: none)")
    ap.add_argument("--model", choices=["torch", "hf"], default="torch")
    ap.add_argument("--warmup-steps", type=int, default=None, help="steps left out of samples/s (default min(5, steps/5))")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cpuddp's pinning / torch's)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--no-pin", action="store_true", help="init_distributed(pin=False): no core pinning")
    ap.add_argument("--no-ipex", action="store_true", help="stock PyTorch even when IPEX is installed")
    ap.add_argument("--comm-hook", choices=["fp16", "bf16"], default=None, help="gradient compression")
    ap.add_argument("--log-every", type=int, default=None, help="steps per progress line off a terminal (default steps/10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="write the trained state dict here (rank 0)")
    ap.add_argument("--checkpoint-dir", help="resume from the newest checkpoint here, if any, and save checkpoints here")
    ap.add_argument("--save-every", type=int, default=0, help="with --checkpoint-dir: a checkpoint every N steps "
                    "(default: only at the end)")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this step, as a preempted job would "
                    "(with --checkpoint-dir: saved there; run again without it, or with a later one, to go on)")
    ap.add_argument("--result-json", help="write the result as JSON here (rank 0)")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    env = cpuddp.init_distributed(pin=not args.no_pin)
    backend = cpuddp.get_session().backend
    # the shm engine's data path, native or Python (and why), and its leg between nodes: the header's
    data_path = getattr(torch.distributed.group.WORLD, "paths", "") if backend == "shm" else ""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.seq_len > SIZES[args.size]["max_positions"]:
        raise SystemExit(f"--seq-len {args.seq_len} is longer than --size {args.size} allows "
                         f"({SIZES[args.size]['max_positions']} positions); use a shorter one or --size bench")
    model, optimizer, model_name = prepared_model(args)
    info = cpuddp.prepared_info(model)
    scheduler = linear_schedule(optimizer, warmup=max(1, args.steps // 10), total=args.steps)
    per_step = env.world_size * args.batch_size
    train, loader = training_data(args, per_step)
    warmup = min(5, args.steps // 5) if args.warmup_steps is None else args.warmup_steps
    precision = "auto (measuring)" if "measuring" in info.precision_reason else info.mixed_precision or "fp32"
    nparams = sum(p.numel() for p in cpuddp.unwrap(model).parameters())
    cpuddp.print0(f"{model_name}: {nparams / 1e6:.2f} M parameters | {len(train)} training pairs, "
                  f"{args.steps} steps x {per_step} | {env.world_size} rank(s) x {torch.get_num_threads()} thread(s), "
                  f"launcher {env.launcher}, backend {backend}" + (f" ({data_path})" if data_path else "")
                  + f" | precision {precision}"
                  + (", fused AdamW" if info.fused_optimizer else ""))

    start, first_loss = resume(args, model, optimizer, scheduler, loader)
    if start >= last_step(args):
        cpuddp.print0(nothing_to_do(args, start))
    model.train()
    warmup = min(warmup, max(0, last_step(args) - start - 1))
    with cpuddp.Progress(args.steps, start=min(start, args.steps), samples_per_step=per_step, every=args.log_every,
                         warmup=warmup) as progress:
        first_loss = train_steps(args, model, optimizer, scheduler, loader, progress, start, warmup, first_loss)
    timed = progress.close()
    result = {
        "samples_per_s": timed.samples_per_s, "loss": cpuddp.reduce_mean(timed.loss), "first_loss": first_loss,
        "accuracy": evaluate(model, args) if args.eval_samples > 0 else None,
        "replicas_identical": replicas_identical(model), "eval_samples": args.eval_samples, "steps": args.steps,
        "steps_done": max(start, timed.steps), "steps_run": max(0, timed.steps - start),
        "warmup_steps": warmup, "train_seconds": timed.seconds, "wall_seconds": time.perf_counter() - _STARTED,
        "batch_size_per_rank": args.batch_size, "world_size": env.world_size,
        "threads_per_rank": torch.get_num_threads(), "backend": backend, "ranks": timed.ranks,
        "model": model_name, "launcher": env.launcher, "torch": torch.__version__,
        **precision_result(cpuddp.prepared_info(model), args),  # after "auto"'s trial: what it kept
    }
    if args.save:
        cpuddp.save_state_dict(model, args.save)
    cpuddp.print0(summary(result))
    if start < timed.steps < args.steps:
        cpuddp.print0(stopped_early(args, timed.steps))
    if args.result_json and cpuddp.is_main_process():
        with open(args.result_json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    cpuddp.shutdown()
    return 0


def prepared_model(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, str]:
    """The model with random weights, its AdamW, and prepare's result (precision, fusing, DDP)."""
    model, model_name = build_model(args.model, args.size, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model = cpuddp.prepare(
        model,
        optimizer,
        mixed_precision=None if args.precision == "fp32" else args.precision,
        strict=args.strict_bf16,
        ipex=False if args.no_ipex else None,
        compile=args.compile,
        comm_hook=args.comm_hook,
    )
    return model, optimizer, model_name


def training_data(args: argparse.Namespace, per_step: int) -> tuple[Any, Any]:
    """The training pairs and this rank's shard of them."""
    num_samples = args.num_samples or args.steps * per_step
    train = build_dataset(num_samples, args.seq_len, seed=args.seed, path=args.data)
    loader = cpuddp.shard(train, batch_size=args.batch_size, shuffle=True, seed=args.seed, drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"--num-samples {num_samples} gives no full batch of {args.batch_size} per rank")
    return train, loader


def precision_result(info: Any, args: argparse.Namespace) -> dict:
    return {"precision": info.mixed_precision or "fp32", "requested_precision": args.precision,
            "precision_reason": info.precision_reason, "path": info.path, "fused_optimizer": info.fused_optimizer}


def resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
           loader: Any) -> tuple[int, Optional[float]]:
    """With ``--checkpoint-dir``: go on from its newest checkpoint (step 0 when there is none)."""
    if not args.checkpoint_dir:
        return 0, None
    state = cpuddp.load_checkpoint(args.checkpoint_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                                   loader=loader)
    if state is None:
        return 0, None
    cpuddp.print0(f"resumed from {state.path}: step {state.step} of {args.steps}"
                  + ("" if state.same_world else f" (saved by {state.saved_world_size} rank(s))"))
    return state.step, state.extra.get("first_loss")


def last_step(args: argparse.Namespace) -> int:
    """The step this run stops after: ``--steps``, or an earlier ``--stop-after``."""
    return min(args.steps, args.stop_after or args.steps)


def nothing_to_do(args: argparse.Namespace, start: int) -> str:
    """What a run resumed at or past its last step says instead of training."""
    if start >= args.steps:
        return (f"already at step {start} of {args.steps} (the checkpoint in {args.checkpoint_dir}): nothing to do; "
                "the run is finished (train anew with another --checkpoint-dir)")
    return (f"already at step {start} of {args.steps} (the checkpoint in {args.checkpoint_dir}), and --stop-after "
            f"{args.stop_after}: nothing to do; run the command again without --stop-after, or with one after "
            f"{start}, to go on")


def stopped_early(args: argparse.Namespace, step: int) -> str:
    """The last line of a run that ``--stop-after`` ended before ``--steps``: it is unfinished."""
    head = f"stopped early at step {step} of {args.steps} (--stop-after {args.stop_after}), as a preempted job would"
    if not args.checkpoint_dir:
        return head + "; nothing was saved (no --checkpoint-dir): add --checkpoint-dir DIR to be able to go on"
    return (f"{head}; the run is unfinished: run the command again without --stop-after (or with one after {step}) "
            f"to go on from the checkpoint in {args.checkpoint_dir}")


def train_steps(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                loader: Any, progress: Any, start: int, warmup: int, first_loss: Optional[float]) -> Optional[float]:
    """Steps ``start + 1`` to :func:`last_step`; a checkpoint every ``--save-every`` steps and at the last."""
    batches = iter(loader)
    last = last_step(args)
    for step in range(start + 1, last + 1):
        try:
            batch = next(batches)
        except StopIteration:  # another pass: the loader reshuffles by itself
            batches = iter(loader)
            batch = next(batches)
        loss = model(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step in (start + warmup, last):
            cpuddp.barrier()  # samples/s from barrier to barrier: every rank's steps are done
        progress.update(loss=loss.item())
        if progress.step - start == progress.every and first_loss is None:
            first_loss = cpuddp.reduce_mean(progress.loss)
        if args.checkpoint_dir and ((args.save_every and step % args.save_every == 0) or step == last):
            cpuddp.save_checkpoint(args.checkpoint_dir, step=step, model=model, optimizer=optimizer,
                                   scheduler=scheduler, loader=loader, extra={"first_loss": first_loss})
    return first_loss


def summary(r: dict) -> str:
    """The lines printed at the end (rank 0)."""
    acc = "not measured" if r["accuracy"] is None else f"{r['accuracy']:.3f} on {r['eval_samples']} held-out pairs (chance 0.5)"
    return "\n".join([
        f"done in {format_duration(r['wall_seconds'])} wall ({r['wall_seconds']:.0f} s, torch import "
        f"included; training {r['train_seconds']:.0f} s)",
        f"  accuracy {acc} | weights identical on every rank: {'yes' if r['replicas_identical'] else 'NO'}",
        f"  {loss_text(r)}",
        f"  {r['ranks']}",
        f"  backend {r['backend'] or 'none (1 process)'} | launcher {r['launcher']} | precision {r['precision']}: "
        f"{r['precision_reason']}",
    ])


def loss_text(r: dict) -> str:
    """The summary's loss and samples/s line, or why there are none (never "nan")."""
    if r["steps_run"] == 0:
        return f"no training step in this run: already at step {r['steps_done']} of {r['steps']}"
    first = "" if r["first_loss"] is None else f"{r['first_loss']:.3f} -> "
    rate = (f"{r['samples_per_s']:.0f} samples/s" if math.isfinite(r["samples_per_s"]) else
            f"samples/s not measured ({r['steps_run']} step(s), {r['warmup_steps']} of them warm-up)")
    return (f"loss {first}{r['loss']:.3f} | {rate} ({r['world_size']} rank(s) x {r['threads_per_rank']} "
            f"thread(s), batch {r['batch_size_per_rank']}/rank)")


def replicas_identical(model: nn.Module) -> bool:
    """DDP's contract: every rank ends with the same weights (checked on a checksum per tensor)."""
    sums = torch.stack([p.detach().double().sum() for p in cpuddp.unwrap(model).parameters()])
    low, high = sums.clone(), sums.clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
        torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def evaluate(model: nn.Module, args: argparse.Namespace) -> float:
    """Accuracy on held-out pairs (another seed), each rank scoring its shard."""
    data = build_dataset(args.eval_samples, args.seq_len, seed=args.seed + 1_000_003)
    loader = cpuddp.shard(data, batch_size=250, shuffle=False)
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
