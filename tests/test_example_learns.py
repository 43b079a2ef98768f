"""README's example learns on 2 real ranks: a regression in prepare/DDP that stops learning fails here.

A shortened configuration of ``examples/finetune.py`` runs under torchrun (2 ranks, gloo).
It must end well above chance on held-out pairs, with the loss falling, and with the same
weights on both ranks -- DDP's contract, which a broken gradient average breaks even when
each rank still learns from its own half of the data.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from example_util import EXAMPLES, example_env, paraphrase_data

#: The shortened run: the same model, data and learning rate as README's command, fewer steps.
SHORT = ["--steps", "160", "--eval-samples", "1000", "--log-every", "20"]


def test_generated_pairs_fit_the_default_sequence_length():
    pd = paraphrase_data()
    pairs = pd.generate(5000, seed=3)
    longest = max(len(a.split()) + len(b.split()) + 3 for a, b, _ in pairs)
    assert longest <= 40, f"a pair of {longest} tokens would be truncated at --seq-len 40"


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(240)
def test_example_learns_on_two_ranks(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "finetune.py"), *SHORT, "--result-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=example_env(), cwd=tmp_path)
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, log
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["launcher"] == "torchrun", log
    assert r["replicas_identical"], "the two ranks ended with different weights: gradients were not averaged\n" + log
    assert r["first_loss"] - r["loss"] > 0.15, f"the loss did not fall: {r['first_loss']:.3f} -> {r['loss']:.3f}\n{log}"
    assert r["accuracy"] >= 0.8, f"held-out accuracy {r['accuracy']:.3f}: barely above chance (0.5)\n{log}"
    # What the user sees: progress lines with the loss, and the summary.
    assert proc.stderr.count("loss ") >= 8 and "samples/s" in proc.stderr, log
    assert "accuracy" in proc.stdout and ("precision fp32" in proc.stdout or "precision bf16" in proc.stdout), log
