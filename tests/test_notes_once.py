"""Issue 37 #9: a note about the job prints once per job (on rank 0), not once per rank.

Two real ranks each call ``prepare(mixed_precision="bf16")`` and ``autocast_for()`` on a CPU
without bf16 ("... staying in fp32") and ``prepare(shard="full")`` on glibc's malloc; rank 0
gets each note once, rank 1 none.  (Before: each rank printed each note.)
"""

from __future__ import annotations

import logging
import warnings

import pytest

pytestmark = pytest.mark.slow


def _notes() -> dict:
    import torch
    from torch import nn

    import cpuddp
    import cpuddp.train.precision.bf16 as precision
    import cpuddp.train.prepare as prepare_mod
    import cpuddp.train.sharding.shard as shard_mod

    no_bf16 = (lambda: (False, "CPU has neither AMX nor AVX512-BF16 (this test says so)"))
    precision.cpu_bf16_support = no_bf16  # autocast_for's decision
    prepare_mod.cpu_bf16_support = no_bf16  # prepare's
    shard_mod.running_allocator = lambda *a, **k: "glibc"  # whatever LD_PRELOAD the CI has

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("cpuddp.prepare")
    log.addHandler(Keep(level=logging.WARNING))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpuddp.prepare(nn.Linear(4, 4), mixed_precision="bf16", ipex=False)
        with cpuddp.autocast_for():
            pass
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        cpuddp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), shard="full", shard_blocks=[nn.Linear],
                       ipex=False)
    said = [str(w.message) for w in caught] + records
    return {
        "fp32_prepare": sum("cpuddp.prepare: bf16 requested" in s and "staying in fp32" in s for s in said),
        "fp32_autocast": sum("cpuddp.autocast_for:" in s and "staying in fp32" in s for s in said),
        "glibc": sum("on glibc's malloc" in s for s in said),
    }


@pytest.mark.timeout(200)
def test_a_jobs_notes_print_on_rank_0_only(run_distributed):
    r0, r1 = run_distributed(_notes, 2, timeout=150)
    assert r0 == {"fp32_prepare": 1, "fp32_autocast": 1, "glibc": 1}, r0
    assert r1 == {"fp32_prepare": 0, "fp32_autocast": 0, "glibc": 0}, r1
