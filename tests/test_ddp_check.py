"""The no-DDP warning and the grown-world error (cpuddp/ddp_check.py) as pure functions, and
cpuddp.lightning's cluster environment over plain mappings (no processes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from cpuddp import ddp_check
from cpuddp.errors import LauncherEnvError


def test_unwrapped_counts_parameters_no_wrapper_holds():
    assert ddp_check.unwrapped([1, 2, 3], [2, 3, 9]) == 1
    assert ddp_check.unwrapped([1, 2], []) == 2
    assert ddp_check.unwrapped([], [4]) == 0


def test_warning_names_what_why_and_the_fixes():
    text = ddp_check.warning_text("AdamW", 4, 2)
    assert "AdamW.step() updates 4 parameter tensor(s)" in text and "2 ranks" in text and "diverge" in text
    for fix in ("cpuddp.prepare(model, optimizer)", "Accelerator(cpu=True)", "use_cpu=True",
                "cpuddp.lightning.trainer_strategy()", "CPUDDP_DDP_CHECK=0"):
        assert fix in text


@pytest.mark.parametrize("world,environ,raises", [
    (1, {}, False),
    (1, {"WORLD_SIZE": "1"}, False),
    (1, {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, True),  # Lightning's devices=2 self-launch, after init
    (2, {"WORLD_SIZE": "2"}, False),
    (1, {"WORLD_SIZE": "x"}, False),
])
def test_grown_world(world, environ, raises):
    error = ddp_check.grown_world(world, environ)
    assert (error is not None) == raises
    if error is not None:
        assert isinstance(error, LauncherEnvError) and error.variable == "WORLD_SIZE" and error.value == "2"
        assert "cpuddp.lightning.trainer_strategy()" in str(error) and "torchrun" in str(error)


def test_lightning_child_without_rank_is_an_error_naming_the_fix():
    from cpuddp.launchers import detect

    with pytest.raises(LauncherEnvError) as info:
        detect({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29511"})
    assert info.value.variable == "RANK" and "cpuddp.lightning.trainer_strategy()" in str(info.value)


def test_import_cpuddp_lightning_imports_no_lightning():
    code = ("import sys, cpuddp.lightning; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _need_lightning() -> None:
    if importlib.util.find_spec("lightning") is None:
        msg = "needs lightning: pip install -e '.[frameworks]'"
        if os.environ.get("CPUDDP_REQUIRE_FRAMEWORKS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.mark.parametrize("environ,ranks", [
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 2, 1, 0)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n0"}, (3, 4, 1, 1)),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0"}, (1, 2, 0, 1)),  # Kubeflow
])
def test_cluster_environment_reads_cpuddp_launchers(environ, ranks, monkeypatch):
    _need_lightning()
    # Importing Lightning sets this in os.environ (conftest fails a test that leaks variables).
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"))
    import cpuddp.lightning

    cls = type(cpuddp.lightning.cluster_environment())
    env = cls(environ)
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == ranks
    assert env.creates_processes_externally
    with pytest.raises(ValueError, match="devices="):
        env.validate_settings(num_devices=ranks[1] * 2, num_nodes=1)
