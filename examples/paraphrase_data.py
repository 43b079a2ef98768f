"""A synthetic sentence-pair paraphrase set (MRPC-shaped), generated offline, and its tokenizer.

Each pair is (sentence 1, sentence 2, label): label 1 when sentence 2 says the same thing
as sentence 1 in other words (synonyms, a moved time phrase, the passive voice), 0 when it
does not -- either an unrelated sentence or a *hard negative* that changes who did what
(one slot swapped for a non-synonym).  Deterministic for a given seed; no downloads.

    python examples/paraphrase_data.py --num-samples 20000 --out paraphrase.tsv
    python examples/paraphrase_data.py --show 5

The TSV has MRPC's columns: ``Quality``, ``#1 String``, ``#2 String``.  The tokenizer is a
word-level one over this generator's vocabulary, with BERT's layout:
``[CLS] sentence 1 [SEP] sentence 2 [SEP]``, ``token_type_ids`` 0 then 1, padded to a fixed
length.
"""

from __future__ import annotations

import argparse
import array
import csv
import random
import sys
from typing import Any, Iterable, Optional, Sequence

# Each inner list is a synonym group: a paraphrase may swap any word for another of its group.
SUBJECTS = [
    ["engineer", "developer", "programmer"],
    ["doctor", "physician"],
    ["teacher", "instructor", "tutor"],
    ["farmer", "grower"],
    ["lawyer", "attorney"],
    ["chef", "cook"],
    ["pilot", "aviator"],
    ["student", "pupil", "learner"],
    ["manager", "supervisor", "boss"],
    ["child", "kid", "youngster"],
    ["writer", "author"],
    ["sailor", "seaman", "mariner"],
]
ADJECTIVES = [
    ["tired", "weary", "exhausted"],
    ["happy", "glad", "cheerful"],
    ["young", "youthful"],
    ["old", "elderly", "aged"],
    ["quiet", "silent"],
    ["clever", "smart", "bright"],
    ["angry", "furious"],
    ["busy", "occupied"],
]
# (present form, past participle) groups
VERBS = [
    [("bought", "bought"), ("purchased", "purchased")],
    [("repaired", "repaired"), ("fixed", "fixed"), ("mended", "mended")],
    [("painted", "painted")],
    [("sold", "sold")],
    [("found", "found"), ("discovered", "discovered")],
    [("built", "built"), ("constructed", "constructed")],
    [("cleaned", "cleaned"), ("washed", "washed")],
    [("moved", "moved"), ("relocated", "relocated")],
    [("lost", "lost"), ("misplaced", "misplaced")],
    [("carried", "carried"), ("hauled", "hauled")],
]
OBJECTS = [
    ["car", "automobile", "vehicle"],
    ["house", "home", "residence"],
    ["boat", "vessel"],
    ["bicycle", "bike"],
    ["computer", "laptop"],
    ["table", "desk"],
    ["painting", "picture"],
    ["fence", "railing"],
    ["box", "crate", "carton"],
    ["book", "volume"],
    ["lamp", "light"],
    ["chair", "seat"],
]
PLACES = [
    ["in the city", "downtown"],
    ["near the river", "by the river"],
    ["at the market", "at the bazaar"],
    ["in the village", "in the hamlet"],
    ["at the harbor", "at the port"],
    ["in the garage", "in the workshop"],
]
TIMES = [
    ["yesterday", "the day before"],
    ["last week", "seven days ago"],
    ["this morning", "earlier today"],
    ["on monday", "at the start of the week"],
    ["last night", "yesterday evening"],
]

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
PAD, UNK, CLS, SEP = range(4)


def _vocabulary() -> list[str]:
    words: set[str] = {"the", "a", "was", "by", ","}
    for groups in (SUBJECTS, ADJECTIVES, OBJECTS, PLACES, TIMES):
        for group in groups:
            for phrase in group:
                words.update(phrase.split())
    for group in VERBS:
        for present, participle in group:
            words.update((present, participle))
    return SPECIAL + sorted(words)


VOCAB = _vocabulary()


def _pick(rng: random.Random, groups: Sequence[Sequence], avoid: Optional[int] = None) -> int:
    while True:
        i = rng.randrange(len(groups))
        if i != avoid:
            return i


def _render(rng: random.Random, slots: dict[str, int], style: str, like: Optional[dict[str, str]] = None,
            swap: float = 1.0) -> tuple[str, dict[str, str]]:
    """A sentence for ``slots``; with ``like``, each word is kept from ``like`` unless it is
    swapped for a synonym (probability ``swap``)."""
    words: dict[str, Any] = {}
    for key, groups in (("subj", SUBJECTS), ("adj", ADJECTIVES), ("verb", VERBS), ("obj", OBJECTS),
                        ("place", PLACES), ("time", TIMES)):
        group = groups[slots[key]]
        if like is not None and key in like and like[key] in group and rng.random() >= swap:
            words[key] = like[key]
        else:
            words[key] = rng.choice(group)
    verb, participle = words["verb"]
    w = dict(words)
    if style == "active":
        text = f"the {w['adj']} {w['subj']} {verb} the {w['obj']} {w['place']} {w['time']}"
    elif style == "fronted":
        text = f"{w['time']} , the {w['adj']} {w['subj']} {verb} the {w['obj']} {w['place']}"
    else:  # passive
        text = f"the {w['obj']} was {participle} by the {w['adj']} {w['subj']} {w['place']} {w['time']}"
    return text, words


#: The defaults of :func:`generate`: the share of non-paraphrases that are hard negatives, and
#: how often a paraphrase swaps a word for a synonym / changes the sentence's shape.
HARD_NEGATIVES = 0.3
SYNONYM_RATE = 0.3
RESTYLE_RATE = 0.3


def generate(num_samples: int, seed: int = 0, *, hard_negatives: float = HARD_NEGATIVES,
             synonym_rate: float = SYNONYM_RATE, restyle_rate: float = RESTYLE_RATE) -> list[tuple[str, str, int]]:
    """``num_samples`` (sentence 1, sentence 2, label) triples, half of them paraphrases.

    A paraphrase swaps each word for a synonym with probability ``synonym_rate`` and
    changes the sentence's shape (time phrase first, passive voice) with probability
    ``restyle_rate``.  A fraction ``hard_negatives`` of the non-paraphrases keep the frame
    and change one key slot (who, did what, to what) to a non-synonym; the rest are
    unrelated sentences.
    """
    rng = random.Random(seed)
    out: list[tuple[str, str, int]] = []
    for i in range(num_samples):
        slots = {
            "subj": _pick(rng, SUBJECTS), "adj": _pick(rng, ADJECTIVES), "verb": _pick(rng, VERBS),
            "obj": _pick(rng, OBJECTS), "place": _pick(rng, PLACES), "time": _pick(rng, TIMES),
        }
        first, words = _render(rng, slots, "active")
        label = i % 2  # balanced
        style = rng.choice(["fronted", "passive"]) if rng.random() < restyle_rate else "active"
        if label == 1:
            second, _ = _render(rng, slots, style, like=words, swap=synonym_rate)
        elif rng.random() < hard_negatives:  # same frame, one key slot changed
            other = dict(slots)
            key = rng.choice(["subj", "verb", "obj"])
            groups = {"subj": SUBJECTS, "verb": VERBS, "obj": OBJECTS}[key]
            other[key] = _pick(rng, groups, avoid=slots[key])
            second, _ = _render(rng, other, style, like=words, swap=synonym_rate)
        else:  # an unrelated sentence
            all_groups = {"subj": SUBJECTS, "adj": ADJECTIVES, "verb": VERBS, "obj": OBJECTS,
                          "place": PLACES, "time": TIMES}
            other = {k: _pick(rng, all_groups[k], avoid=v) for k, v in slots.items()}
            second, _ = _render(rng, other, style)
        out.append((first, second, label))
    rng.shuffle(out)
    return out


def write_tsv(pairs: Iterable[tuple[str, str, int]], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, delimiter="\t", lineterminator="\n")
        w.writerow(["Quality", "#1 String", "#2 String"])
        for a, b, label in pairs:
            w.writerow([label, a, b])


def read_tsv(path: str) -> list[tuple[str, str, int]]:
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh, delimiter="\t"))
    return [(a, b, int(label)) for label, a, b in rows[1:]]


class Tokenizer:
    """Word-level tokenizer over :data:`VOCAB`, BERT's pair layout, fixed length."""

    def __init__(self, vocab: Sequence[str] = VOCAB) -> None:
        self.vocab = list(vocab)
        self.ids = {w: i for i, w in enumerate(self.vocab)}

    def encode_pair(self, first: str, second: str, max_len: int) -> tuple[list[int], list[int], list[int]]:
        a = [self.ids.get(w, UNK) for w in first.split()]
        b = [self.ids.get(w, UNK) for w in second.split()]
        while len(a) + len(b) + 3 > max_len:  # truncate the longer one first
            (a if len(a) >= len(b) else b).pop()
        ids = [CLS] + a + [SEP] + b + [SEP]
        types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        mask = [1] * len(ids)
        pad = max_len - len(ids)
        return ids + [PAD] * pad, types + [0] * pad, mask + [0] * pad


class PairDataset:
    """A map-style torch Dataset of tokenized pairs: dicts of ``input_ids``,
    ``token_type_ids``, ``attention_mask`` and ``labels`` (the names transformers uses)."""

    def __init__(self, pairs: Sequence[tuple[str, str, int]], max_len: int = 40,
                 tokenizer: Optional[Tokenizer] = None) -> None:
        import torch

        tok = tokenizer or Tokenizer()
        flat = array.array("i")
        for a, b, _ in pairs:
            flat.extend(tok.encode_pair(a, b, max_len)[0])
        ids = torch.frombuffer(flat, dtype=torch.int32).view(len(pairs), max_len).long()
        # The other two follow from the ids (one tensor built from Python lists, not three):
        # the mask covers every non-pad token, and token type 1 starts after the first [SEP].
        self.attention_mask = (ids != PAD).long()
        sep = (ids == SEP).long()
        self.token_type_ids = ((sep.cumsum(1) - sep) > 0).long() * self.attention_mask
        self.input_ids = ids
        self.labels = torch.tensor([p[2] for p in pairs], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {
            "input_ids": self.input_ids[i],
            "token_type_ids": self.token_type_ids[i],
            "attention_mask": self.attention_mask[i],
            "labels": self.labels[i],
        }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write a TSV here")
    ap.add_argument("--show", type=int, default=0, help="print this many pairs")
    args = ap.parse_args(argv)
    pairs = generate(args.num_samples, args.seed)
    for a, b, label in pairs[: args.show]:
        print(f"{label}\t{a}\t|\t{b}")
    if args.out:
        write_tsv(pairs, args.out)
        print(f"wrote {len(pairs)} pairs ({sum(p[2] for p in pairs)} paraphrases) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
