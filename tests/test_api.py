"""The public API is pinned: ``__all__``, ``_EXPORTS`` and the TYPE_CHECKING imports agree,
the public submodules docs name keep their names, the deprecated top-level names warn with
their new path, and ``import cpuddp`` stays light."""

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
    "reduce_mean", "is_main_process", "barrier", "save_state_dict", "load_state_dict", "save_checkpoint",
    "load_checkpoint", "clip_grad_norm_", "no_sync",
    "Progress", "ProgressSummary",
    # backends and pinning
    "available_backends", "register_backend", "PinPlan", "pinned",
    # errors
    "CpuddpError", "LauncherEnvError", "BackendError", "RendezvousError", "PrepareError", "CheckpointError",
    "RankFailedError",
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


#: The submodules the docs tell users about, and the names each must keep (their ``__all__``
#: before the areas became subpackages; adding or removing one must change this test).
SUBMODULES = {
    "cpuddp.backends": {
        "BackendStatus", "BackendChoice", "BackendName", "BackendSpec", "backend_for", "Lookups", "BACKENDS",
        "available_backends",
        "backend_status", "resolve_backend", "load_backend", "backend_env", "ccl_env", "ccl_settings", "CclPaths",
        "find_ccl_paths", "explain_collective_failure", "gloo_env", "register_backend", "unregister_backend",
        "ccl_pairing", "ccl_module_for", "CCL_DISTRIBUTIONS", "SKIP_VERSION_CHECK_VAR"},
    "cpuddp.launchers": {
        "READERS", "LAUNCHER_NAMES", "LauncherReader", "PartialEnv", "Variables", "register_launcher",
        "unregister_launcher", "registered_launchers", "detect", "expand_nodelist", "expand_tasks_per_node",
        "derive_port", "is_loopback", "LAUNCHER_ENV_PREFIXES", "LAUNCHER_ENV_NAMES", "is_launcher_variable",
        "clean_environ", "BACKEND_ENV_PREFIXES", "BACKEND_ENV_NAMES",
        "Provenance", "Source"},  # added with the move: site launchers build Provenance values
    "cpuddp.affinity": {
        "PinPlan", "PinWarning", "WARNING_CODES", "PinState", "plan_pinning", "plan_for", "apply_plan", "restore",
        "pinned", "current_plan", "thread_affinity", "thread_ids", "launcher_binding", "KMP_AFFINITY",
        "KMP_BLOCKTIME"},
    "cpuddp.topology": {
        "LogicalCpu", "Topology", "read_topology", "synthetic_topology", "cpu_features", "effective_cpu_count",
        "parse_cpulist", "format_cpulist"},
    "cpuddp.shm": {"NAME", "ShmProcessGroup", "ShmOptions", "register", "eligibility", "INTER_VAR"},
    "cpuddp.testing": {"run_distributed", "clean_environ", "is_launcher_variable", "LAUNCHER_ENV_PREFIXES",
                       "LAUNCHER_ENV_NAMES"},
    "cpuddp.lightning": {"trainer_strategy", "fabric_strategy", "cluster_environment", "lightning_ranks"},
    "cpuddp.errors": {"CpuddpError", "LauncherEnvError", "BackendError", "GroupShutDownError", "RendezvousError",
                      "PrepareError", "CheckpointError", "RankFailedError", "how_it_ended", "first_line"},
}


@pytest.mark.parametrize("module", sorted(SUBMODULES))
def test_the_public_submodules_keep_their_names(module):
    mod = importlib.import_module(module)
    assert set(mod.__all__) == SUBMODULES[module]
    for name in mod.__all__:
        value = getattr(mod, name)
        home = getattr(value, "__module__", None)
        if home and home.startswith("cpuddp.") and home != module:  # handed on from where it is defined
            assert getattr(importlib.import_module(home), name) is value, f"{module}.{name}"


def test_the_pytest_plugin_is_the_testing_module():
    """pytest loads ``cpuddp.testing`` (entry point, or ``pytest_plugins``): its hooks and fixtures are there."""
    import cpuddp.testing as plugin

    for name in ("pytest_addoption", "pytest_configure", "clean_launcher_env", "run_distributed_fixture"):
        assert callable(getattr(plugin, name)), name


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


def test_a_name_its_module_rebinds_is_never_stale_at_the_door():
    """``cpuddp.launchers.READERS`` is rebound by every (un)registration: the door asks each time."""
    import cpuddp.launchers as launchers

    class Site(launchers.LauncherReader):
        description = "a test site"

    before = launchers.READERS
    launchers.register_launcher("test_site", Site)
    try:
        assert launchers.READERS is not before and "test_site" in dict(launchers.READERS)
    finally:
        launchers.unregister_launcher("test_site")
    assert "test_site" not in dict(launchers.READERS)


def test_every_cpuddp_train_path_the_docs_name_imports():
    """docs/ and README name some of train's modules by path (``cpuddp.train.loop``,
    ``cpuddp.train.checkpoint.ckpt_lock.release_directory``): each still imports, its name included."""
    import re

    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text() for p in [*sorted((root / "docs").glob("*.md")), root / "README.md"]]
    named = sorted({m for text in texts for m in re.findall(r"cpuddp\.train(?:\.\w+)+", text)})
    assert "cpuddp.train.loop" in named, "the scan found none of the paths docs/prepare.md names: it is broken"
    for path in named:
        parts = path.split(".")
        for cut in range(len(parts), 1, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"the docs name {path}, but {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
