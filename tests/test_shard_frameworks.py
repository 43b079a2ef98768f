"""docs/frameworks.md, "Sharded training (FSDP) under the frameworks", held to what it says:

* the Lightning recipe (``ModelParallelStrategy`` + FSDP2 on cpuddp's shm backend) trains on 2
  ranks as plain ``python`` (Lightning starts the second): backend shm, parameters sharded
  DTensors (each rank a different half), a falling loss;
* accelerate's FSDP2 plugin is ignored on the CPU (``MULTI_CPU``, a DDP model);
* Lightning's ``FSDPStrategy`` refuses ``accelerator="cpu"``.

If a framework changes any of these, the page is wrong and a test here fails.  Needs the
``frameworks`` extra; skips without it unless CPUDDP_REQUIRE_FRAMEWORKS=1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launchers_util
from frameworks_util import need

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "frameworks.md"
TIMEOUT = 240

pytestmark = [pytest.mark.slow]

PROBE = r'''
def _shard_probe():
    import atexit, json, os
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    rec = {"losses": []}

    def on_loss(module, args, out):
        if isinstance(module, torch.nn.MSELoss) and torch.is_grad_enabled():
            rec["losses"].append(float(out.detach()))

    def on_step(optimizer, args, kwargs):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        rec.update(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(),
                   backend=str(torch.distributed.get_backend()),
                   kinds=sorted({type(p).__name__ for p in params}),
                   placements=sorted({str(getattr(p, "placements", None)) for p in params}),
                   local=[p.to_local().flatten().tolist() if hasattr(p, "to_local") else None for p in params])

    def dump():
        if "rank" in rec:
            with open(os.path.join(os.environ["CPUDDP_FW_OUT"], f"{rec['rank']}.json"), "w") as f:
                json.dump(rec, f)

    torch.nn.modules.module.register_module_forward_hook(on_loss)
    register_optimizer_step_post_hook(on_step)
    atexit.register(dump)


_shard_probe()
'''


def recipe(name: str) -> str:
    found = dict(re.findall(r"<!-- shard-recipe: ([\w-]+) -->\s*```python\n(.*?)```", PAGE.read_text(), re.S))
    assert name in found, f"docs/frameworks.md has no shard recipe {name!r}: {sorted(found)}"
    return found[name]


@pytest.mark.timeout(TIMEOUT + 60)
def test_lightning_fsdp2_recipe_trains_sharded_on_shm(tmp_path):
    need("lightning")
    script = tmp_path / "recipe_lightning_fsdp2.py"
    script.write_text(PROBE + "\n# ---- the recipe, verbatim from docs/frameworks.md ----\n" + recipe("lightning-fsdp2"))
    out = tmp_path / "out"
    out.mkdir()
    env = launchers_util.clean_env(CPUDDP_FW_OUT=str(out))
    try:
        proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the recipe did not finish in {TIMEOUT} s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    shown = json.dumps(ranks)[:2000] + proc.stderr[-2000:]
    assert [r["world"] for r in ranks] == [2, 2] and all(r["backend"] == "shm" for r in ranks), shown
    assert all(r["kinds"] == ["DTensor"] and r["placements"] == ["(Shard(dim=0),)"] for r in ranks), shown
    assert ranks[0]["local"] != ranks[1]["local"], "both ranks hold the same values: not sharded"
    for r in ranks:
        losses = r["losses"]
        assert len(losses) >= 6 and sum(losses[-3:]) < 0.5 * sum(losses[:3]), shown
    assert "backend shm" in proc.stdout


ACCELERATE = r'''
import cpuddp
cpuddp.init_distributed()
import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin

accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.print(f"RESULT {accelerator.distributed_type} {type(model).__name__} fsdp2={accelerator.is_fsdp2}")
'''


@pytest.mark.launcher
@pytest.mark.timeout(TIMEOUT + 60)
def test_accelerate_ignores_its_fsdp2_plugin_on_the_cpu(tmp_path):
    need("accelerate")
    script = tmp_path / "accelerate_fsdp2.py"
    script.write_text(ACCELERATE)
    proc = launchers_util.run("torchrun", 2, [str(script)], timeout=TIMEOUT, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "RESULT DistributedType.MULTI_CPU DistributedDataParallel fsdp2=False" in proc.stdout, proc.stdout


def test_lightning_fsdp_strategy_refuses_the_cpu():
    need("lightning")
    from unittest import mock

    with mock.patch.dict(os.environ):  # importing lightning sets PYTORCH_NVML_BASED_CUDA_CHECK
        import lightning as L
        from lightning.pytorch.strategies import FSDPStrategy

        with pytest.raises(ValueError, match="requires a GPU accelerator"):
            L.Trainer(accelerator="cpu", devices=2, strategy=FSDPStrategy(), logger=False)
