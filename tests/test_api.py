"""The public API is pinned: ``__all__``, ``_EXPORTS`` and the TYPE_CHECKING imports agree,
the deprecated top-level names warn with their new path, and ``import cpuddp`` stays light."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import cpuddp

INIT = Path(cpuddp.__file__)

HEAVY = ["torch", "numpy", "intel_extension_for_pytorch", "oneccl_bindings_for_pytorch", "torch_ccl", "mpi4py",
         "transformers", "cpuinfo"]

#: The public API, by hand: adding or removing a name must change this test (and CHANGELOG.md).
PUBLIC = {
    "__version__",
    # launcher facts and the process group
    "DistEnv", "detect", "register_launcher", "init_distributed", "shutdown", "get_env", "get_session", "Session",
    "session",
    # where this process sits, and rank-0 output
    "get_rank", "get_world_size", "get_local_rank", "get_local_world_size", "print0", "log0",
    # prepare and the loop helpers
    "prepare", "PrepareInfo", "prepared_info", "unwrap", "shard", "ShardedLoader", "autocast_for",
    "reduce_mean", "is_main_process", "barrier", "save_state_dict", "load_state_dict",
    "Progress", "ProgressSummary",
    # backends and pinning
    "available_backends", "register_backend", "PinPlan", "pinned",
    # errors
    "CpuddpError", "LauncherEnvError", "BackendError", "RendezvousError", "PrepareError", "RankFailedError",
}

#: Deprecated top-level aliases (kept one release) and where each now lives.
DEPRECATED = {
    "BackendStatus": "cpuddp.backends.BackendStatus",
    "BackendChoice": "cpuddp.backends.BackendChoice",
    "resolve_backend": "cpuddp.backends.resolve_backend",
    "backend_status": "cpuddp.backends.backend_status",
    "unregister_backend": "cpuddp.backends.unregister_backend",
    "Topology": "cpuddp.topology.Topology",
    "read_topology": "cpuddp.topology.read_topology",
    "cpu_features": "cpuddp.topology.cpu_features",
    "plan_for": "cpuddp.affinity.plan_for",
    "current_plan": "cpuddp.affinity.current_plan",
    "autocast": "cpuddp.autocast_for",
}


def _type_checking_imports() -> dict[str, str]:
    """``{name: module}`` of the ``from .module import name`` lines under ``if TYPE_CHECKING:``."""
    tree = ast.parse(INIT.read_text())
    blocks = [n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
              and n.test.id == "TYPE_CHECKING"]
    assert len(blocks) == 1, "cpuddp/__init__.py should have one `if TYPE_CHECKING:` block"
    names: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        for alias in node.names:
            assert alias.asname is None, f"{alias.name} is imported under another name"
            assert alias.name not in names, f"{alias.name} is imported twice"
            names[alias.name] = node.module
    return names


# --------------------------------------------------------------------------- the three lists agree


def test_the_public_api_is_pinned():
    assert set(cpuddp.__all__) == PUBLIC
    assert cpuddp.__all__ == sorted(["__version__", *cpuddp._EXPORTS])


def test_type_checking_imports_match_exports():
    assert _type_checking_imports() == cpuddp._EXPORTS


def test_every_public_name_resolves_to_its_module_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, module in cpuddp._EXPORTS.items():
            home = importlib.import_module(f"cpuddp.{module}")
            assert getattr(cpuddp, name) is getattr(home, name), name
            assert name in home.__all__, f"cpuddp.{module}.__all__ does not list {name}"
    assert isinstance(cpuddp.__version__, str)


def test_dir_lists_the_public_names_and_hides_the_deprecated():
    listed = set(dir(cpuddp))
    assert PUBLIC <= listed
    assert not listed & set(DEPRECATED)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cpuddp.nope  # noqa: B018


# --------------------------------------------------------------------------- deprecated aliases


def test_the_deprecated_names_are_pinned():
    assert set(cpuddp._DEPRECATED) == set(DEPRECATED)
    assert not set(DEPRECATED) & set(cpuddp.__all__)


@pytest.mark.parametrize("old, new", sorted(DEPRECATED.items()))
def test_a_deprecated_name_warns_and_still_works(old, new):
    module, _, attr = new.rpartition(".")
    target = getattr(importlib.import_module(module), attr)
    with pytest.warns(DeprecationWarning, match=f"cpuddp.{old} is deprecated.*use {new.replace('.', '[.]')}$") as rec:
        assert getattr(cpuddp, old) is target
    assert rec[0].filename == __file__  # points at the user's line
    with pytest.warns(DeprecationWarning, match=new):
        exec(f"from cpuddp import {old}", {})  # noqa: S102 -- the other way users spell it
    with pytest.warns(DeprecationWarning):  # every access warns: it is never cached
        getattr(cpuddp, old)


# --------------------------------------------------------------------------- import cost


def _imported_heavy(code: str) -> list[str]:
    from cpuddp.testing import clean_environ

    code += f"\nimport sys; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env=clean_environ(os.environ))
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 -- our own printed list


def test_import_is_light():
    assert _imported_heavy("import cpuddp") == []


def test_rank_queries_and_rank0_output_stay_light():
    code = ("import cpuddp\n"
            "assert (cpuddp.get_rank(), cpuddp.get_world_size()) == (0, 1)\n"
            "assert (cpuddp.get_local_rank(), cpuddp.get_local_world_size()) == (0, 1)\n"
            "cpuddp.print0('x'); cpuddp.log0('y')")
    assert _imported_heavy(code) == []
