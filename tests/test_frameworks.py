"""Every recipe of docs/frameworks.md, run as written on 2 ranks: under torchrun, under MPICH's
mpiexec, and (Lightning, Fabric) as plain ``python`` where Lightning starts its own ranks.

Each asserts what the page promises: backend shm, each rank pinned to its own cores, the
model DDP-wrapped, identical weights after training, and a falling loss
(tests/frameworks_probe.py, prepended to the recipe, records them).  Also: the no-DDP
warning (accelerate without ``cpu=True``) and the clear error when ``init_distributed()``
runs before Lightning's self-launch.

The frameworks are an extra (``pip install -e ".[frameworks]"``): without them these tests
skip, saying why -- unless CPUDDP_REQUIRE_FRAMEWORKS=1 (.ci/frameworks.sh), where they fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launchers_util
from frameworks_util import need

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "frameworks.md"
PROBE = Path(__file__).resolve().parent / "frameworks_probe.py"
NEEDS = {"plain": (), "trainer": ("transformers", "accelerate"), "accelerate": ("accelerate",),
         "lightning-trainer": ("lightning",), "fabric": ("lightning",)}
TIMEOUT = 240

pytestmark = [pytest.mark.launcher, pytest.mark.slow]


def recipes() -> dict[str, str]:
    """The ```python block after each ``<!-- recipe: NAME -->`` line of docs/frameworks.md."""
    found = dict(re.findall(r"<!-- recipe: ([\w-]+) -->\s*```python\n(.*?)```", PAGE.read_text(), re.S))
    assert set(found) == set(NEEDS), f"docs/frameworks.md recipes: {sorted(found)}, expected {sorted(NEEDS)}"
    return found


def write_script(tmp_path: Path, name: str, code: str) -> Path:
    script = tmp_path / f"recipe_{name.replace('-', '_')}.py"  # never a framework's own name
    script.write_text(PROBE.read_text() + "\n# ---- the recipe, verbatim from docs/frameworks.md ----\n" + code)
    return script


def self_launch(script: Path, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    env = launchers_util.clean_env(**extra)
    try:
        return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script.name} did not finish in {TIMEOUT} s:\n{exc.stdout}\n{exc.stderr}")


def run_recipe(name: str, how: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = write_script(tmp_path, name, recipes()[name])
    out = tmp_path / "out"
    out.mkdir()
    if how == "python":
        proc = self_launch(script, tmp_path, CPUDDP_FW_OUT=str(out))
    else:
        proc = launchers_util.run(how, 2, [str(script)], timeout=TIMEOUT, cwd=str(tmp_path),
                                  env={"CPUDDP_FW_OUT": str(out)})
    assert proc.returncode == 0, f"{name} under {how} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def results(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / "out" / f"{r}.json").read_text()) for r in range(2)]


CASES = [(name, how) for name in NEEDS for how in ("torchrun", "mpich")] + [
    ("lightning-trainer", "python"), ("fabric", "python")]


@pytest.mark.parametrize("name,how", CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_recipe_trains_on_cpuddp(name, how, tmp_path):
    need(*NEEDS[name])
    if how != "torchrun" and how != "python":
        launchers_util.launcher_path(how)
    proc = run_recipe(name, how, tmp_path)
    ranks = results(tmp_path)
    shown = json.dumps(ranks, indent=1)[:3000] + proc.stderr[-3000:]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks), shown
    assert all(r["backend"] == "shm" for r in ranks), shown
    assert ranks[0]["cpus"] and ranks[1]["cpus"] and not set(ranks[0]["cpus"]) & set(ranks[1]["cpus"]), shown
    assert all(r["wrapped"] for r in ranks), shown
    assert ranks[0]["weights"] == ranks[1]["weights"], shown
    for r in ranks:
        losses = r["losses"]
        assert len(losses) >= 6 and sum(losses[-3:]) < 0.5 * sum(losses[:3]), shown
    assert "DistributedDataParallel wraps" not in proc.stderr + proc.stdout  # no false no-DDP warning


def test_accelerate_without_cpu_true_warns_of_divergent_replicas(tmp_path):
    need("accelerate")
    code = recipes()["accelerate"].replace("Accelerator(cpu=True)", "Accelerator()")
    assert "Accelerator()" in code
    script = write_script(tmp_path, "no_cpu", code)
    (tmp_path / "out").mkdir()
    proc = launchers_util.run("torchrun", 2, [str(script)], timeout=TIMEOUT, cwd=str(tmp_path),
                              env={"CPUDDP_FW_OUT": str(tmp_path / "out")})
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = results(tmp_path)
    if all(r["wrapped"] for r in ranks):
        pytest.skip("this accelerate wraps the model in DDP without cpu=True here; nothing to warn about")
    assert "no DistributedDataParallel wraps" in proc.stderr, proc.stderr[-6000:]
    assert "Accelerator(cpu=True)" in proc.stderr


INIT_FIRST = """
import cpuddp
cpuddp.init_distributed()          # a world of 1: no launcher yet
""" + "\n"


@pytest.mark.parametrize("strategy", ['"ddp"', "cpuddp.lightning.trainer_strategy()"],
                         ids=["lightning-ddp", "cpuddp-strategy"])
def test_lightning_self_launch_after_init_stops_with_the_fix(strategy, tmp_path):
    """init_distributed() before a devices=2 Trainer in plain python: never one rank silently."""
    need("lightning")
    code = recipes()["lightning-trainer"].replace('if __name__ == "__main__":', 'if __name__ == "__main__":' + "".join(
        f"\n    {line}" for line in INIT_FIRST.strip().splitlines()), 1)
    code = code.replace("strategy=cpuddp.lightning.trainer_strategy()", f"strategy={strategy}")
    assert "init_distributed()" in code and f"strategy={strategy}" in code
    script = write_script(tmp_path, "init_first", code)
    (tmp_path / "out").mkdir()
    proc = self_launch(script, tmp_path, CPUDDP_FW_OUT=str(tmp_path / "out"))
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"trained without an error:\n{text[-6000:]}"
    assert "cpuddp.lightning.trainer_strategy()" in text and "init_distributed()" in text, text[-6000:]
    steps = {f.name: len(json.loads(f.read_text())["losses"]) for f in (tmp_path / "out").glob("*.json")}
    assert all(n <= 1 for n in steps.values()), f"a rank trained on alone (losses per rank: {steps})\n{text[-6000:]}"
