"""cpuddp.backends and cpuddp.launchers.netif: choosing, loading and configuring the collective backend.

The decision logic runs on injected package metadata and module lookups (no monkeypatching
of globals).  gloo runs for real in subprocesses; so does the oneCCL bindings' test double
(tests/fake_ccl: an installed module that registers "ccl" over gloo, or aborts on import), to
exercise the whole path through ``cpuddp.init_distributed``; tests/test_ccl_probe.py has the
import probe, the transport per launcher and the init order.  The real oneCCL test runs only where the bindings can be used.
"""

from __future__ import annotations

import dataclasses

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest

from ccl_util import MISMATCHED_VERSION, fake_site
from cpuddp.backends import (
    BACKENDS,
    CclPaths,
    BackendChoice,
    BackendStatus,
    available_backends,
    backend_env,
    backend_status,
    ccl_env,
    ccl_module_for,
    ccl_pairing,
    gloo_env,
    load_backend,
    register_backend,
    resolve_backend,
)
from cpuddp.launchers.env import DistEnv
from cpuddp.errors import BackendError, LauncherEnvError
from cpuddp.launchers.netif import Route, interface_for_source, is_loopback_address, route_to, source_address

REPO = Path(__file__).resolve().parents[1]
TORCH = "2.13.0+cpu"
SUBPROCESS_TIMEOUT = 120


@pytest.fixture
def registry():
    """Restore BACKENDS after a test that registers or replaces entries."""
    saved = dict(BACKENDS)
    yield BACKENDS
    BACKENDS.clear()
    BACKENDS.update(saved)


def _env(**kw) -> DistEnv:
    return DistEnv(**kw)


def _never(*_a, **_k):
    raise AssertionError("must not be called")


# --------------------------------------------------------------------------- versions


@pytest.mark.parametrize(
    "binding, torch, ok",
    [
        ("2.8.0+cpu", "2.8.0", True),
        ("2.8.0", "2.8.1+cpu", True),
        ("2.8.0+xpu", "2.13.0+cpu", False),
        ("2.1.0+cpu", "2.1.2", True),
        ("2.1.400+xpu", "2.1.0a0+cxx11.abi", True),
        # the seeds' rule: 1.12.0 is for torch 1.12.0 only, 1.12.100 for torch 1.12.1
        ("1.12.0", "1.12.0", True),
        ("1.12.0", "1.12.1", False),
        ("1.12.100", "1.12.1", True),
        ("1.12.100", "1.12.0", False),
        ("2.0.100", "2.0.1", True),
        ("2.0.100", "2.0.0", False),
        ("2.3.100", "2.3.1", True),
        # numeric, never string, comparison ("1.9" > "1.10" as strings)
        ("1.9.0", "1.10.0", False),
        ("1.10.0", "1.1.0", False),
        ("1.10.0", "1.10.2", True),
        ("garbage!", "2.8.0", False),
        ("2.8.0", "not-a-version", False),
    ],
)
def test_ccl_pairing(binding, torch, ok):
    assert ccl_pairing(binding, torch)[0] is ok


def test_ccl_pairing_says_what_the_binding_is_for():
    assert ccl_pairing("1.12.0", "1.12.1") == (False, "torch 1.12.0 only")
    assert ccl_pairing("2.8.0", "2.13.0") == (False, "torch 2.8")


@pytest.mark.parametrize(
    "version, module",
    [
        ("1.10.0", "torch_ccl"),
        ("1.11.0", "torch_ccl"),
        ("1.9.0", "torch_ccl"),
        ("1.12.0", "oneccl_bindings_for_pytorch"),
        ("1.12.100", "oneccl_bindings_for_pytorch"),
        ("2.8.0+cpu", "oneccl_bindings_for_pytorch"),
    ],
)
def test_ccl_module_for(version, module):
    assert ccl_module_for(version) == module


# --------------------------------------------------------------------------- status with fake metadata


def _ccl(metadata, find_module=(), environ=None) -> BackendStatus:
    return backend_status("ccl", metadata=metadata, find_module=find_module, environ=environ or {})


def test_ccl_missing():
    st = _ccl({"torch": TORCH})
    assert not st.available
    assert "oneccl_bind_pt" in st.reason and TORCH in st.reason


def test_ccl_matching_wheel_is_available():
    st = _ccl({"torch": "2.8.0+cpu", "oneccl_bind_pt": "2.8.0+cpu"}, {"oneccl_bindings_for_pytorch"})
    assert st.available
    assert (st.version, st.module, st.distribution) == ("2.8.0+cpu", "oneccl_bindings_for_pytorch", "oneccl_bind_pt")


def test_ccl_old_torch_ccl_module():
    st = _ccl({"torch": "1.10.2", "torch-ccl": "1.10.0"}, {"torch_ccl"})
    assert st.available and st.module == "torch_ccl"


def test_ccl_mismatch_is_judged_by_a_probe_never_by_importing():
    looked, probed = [], []

    def probe(module, torch_version):
        probed.append((module, torch_version))
        return SimpleNamespace(ok=False, cache_file=None, summary=lambda: "the import probe was killed by SIGABRT")

    st = backend_status("ccl", metadata={"torch": TORCH, "oneccl_bind_pt": "2.8.0+cpu"},
                        find_module=lambda m: looked.append(m) or True, environ={}, import_probe=probe)
    assert not st.available
    assert looked == ["oneccl_bindings_for_pytorch"]  # located, not imported ...
    assert probed == [("oneccl_bindings_for_pytorch", TORCH)]  # ... and imported in a child only
    assert "2.8.0+cpu" in st.reason and TORCH in st.reason and "not imported here" in st.reason
    assert "killed by SIGABRT" in st.reason
    assert "oneccl_bindings_for_pytorch" not in sys.modules


def test_ccl_seed_rule_1_12():
    st = _ccl({"torch": "1.12.1", "oneccl_bind_pt": "1.12.0"}, {"oneccl_bindings_for_pytorch"})
    assert not st.available and "torch 1.12.0 only" in st.reason
    st = _ccl({"torch": "1.12.1", "oneccl_bind_pt": "1.12.100"}, {"oneccl_bindings_for_pytorch"})
    assert st.available


def test_ccl_installed_without_its_module():
    st = _ccl({"torch": "2.8.0", "oneccl_bind_pt": "2.8.0"}, set())
    assert not st.available and "broken install" in st.reason


def test_ccl_picks_the_matching_one_of_two():
    md = {"torch": "1.10.1", "oneccl_bind_pt": "2.8.0", "torch_ccl": "1.10.0"}
    st = _ccl(md, {"torch_ccl", "oneccl_bindings_for_pytorch"})
    assert st.available and st.distribution == "torch-ccl" and st.module == "torch_ccl"


def test_metadata_function_may_raise_package_not_found():
    from importlib.metadata import PackageNotFoundError

    table = {"torch": "2.8.0", "oneccl_bind_pt": "2.8.0"}

    def lookup(name):
        if name not in table:
            raise PackageNotFoundError(name)
        return table[name]

    assert _ccl(lookup, {"oneccl_bindings_for_pytorch"}).available


def test_skip_version_check():
    md = {"torch": TORCH, "oneccl_bind_pt": "2.8.0+xpu"}
    assert not _ccl(md, {"oneccl_bindings_for_pytorch"}).available
    st = _ccl(md, {"oneccl_bindings_for_pytorch"}, {"CPUDDP_CCL_SKIP_VERSION_CHECK": "1"})
    assert st.available and "skipped" in st.reason


def test_available_backends_lists_every_candidate():
    names = [s.name for s in available_backends(metadata={"torch": TORCH}, find_module=set())]
    assert set(names) >= {"ccl", "gloo", "mpi", "nccl", "accl"}
    by = {s.name: s for s in available_backends()}
    assert by["gloo"].available  # real torch here
    for s in by.values():
        assert isinstance(s.reason, str) and s.reason


def test_available_backends_real_ccl_reason_is_honest():
    st = {s.name: s for s in available_backends()}["ccl"]
    if st.available:
        assert st.module in ("oneccl_bindings_for_pytorch", "torch_ccl")
    else:
        assert st.reason


def test_a_broken_plugin_check_does_not_hide_the_others(registry):
    def boom(lookups):
        raise RuntimeError("plug-in exploded")

    register_backend("broken", probe=boom)
    by = {s.name: s for s in available_backends()}
    assert not by["broken"].available and "plug-in exploded" in by["broken"].reason
    assert by["gloo"].available


# --------------------------------------------------------------------------- resolve


def test_auto_picks_ccl_when_it_matches():
    """Between nodes with one rank each (no shared memory): oneCCL.  On one node: gloo (oneCCL
    measured slower there; tests/test_backend_auto.py has the whole rule)."""
    md, mods = {"torch": "2.8.0", "oneccl_bind_pt": "2.8.0"}, {"oneccl_bindings_for_pytorch"}
    choice = resolve_backend("auto", _env(world_size=2, num_nodes=2), metadata=md, find_module=mods)
    assert (choice.name, choice.module, choice.requested) == ("ccl", "oneccl_bindings_for_pytorch", "auto")
    assert "2.8.0" in choice.reason and choice.verified
    one_node = resolve_backend("auto", _env(), metadata=md, find_module=mods)
    assert one_node.name == "gloo" and "rather than the working oneCCL" in one_node.reason


@pytest.mark.parametrize(
    "metadata, why",
    [
        ({"torch": TORCH}, "no oneCCL bindings"),
        ({"torch": TORCH, "oneccl_bind_pt": "2.8.0"}, "built for torch 2.8"),
    ],
)
def test_auto_falls_back_to_gloo_and_says_why(metadata, why):
    choice = resolve_backend("auto", _env(), metadata=metadata, find_module=set())
    assert choice.name == "gloo" and choice.module is None
    assert choice.reason.startswith("auto: gloo") and why in choice.reason


def test_ccl_requested_but_missing_names_package_and_versions():
    with pytest.raises(BackendError) as info:
        resolve_backend("ccl", _env(), metadata={"torch": TORCH}, find_module=set())
    text = str(info.value)
    assert "oneccl_bind_pt" in text and TORCH in text
    assert "gloo" in info.value.fix  # suggests it, never switches to it


def test_ccl_requested_but_mismatched_names_both_versions():
    with pytest.raises(BackendError) as info:
        resolve_backend("ccl", _env(), metadata={"torch": TORCH, "oneccl_bind_pt": "2.8.0+cpu"}, find_module=set())
    text = str(info.value)
    assert "oneccl_bind_pt 2.8.0+cpu" in text and TORCH in text
    assert "2.8" in info.value.fix and "CPUDDP_CCL_SKIP_VERSION_CHECK" in info.value.fix


def test_ccl_fix_names_the_right_wheel():
    with pytest.raises(BackendError) as info:
        resolve_backend("ccl", _env(), metadata={"torch": "1.12.1", "oneccl_bind_pt": "1.12.0"}, find_module=set())
    assert "oneccl_bind_pt==1.12.100" in info.value.fix
    assert "pytorch-extension.intel.com" in info.value.fix


def test_unknown_backend_lists_the_choices():
    with pytest.raises(BackendError) as info:
        resolve_backend("nope", _env())
    for name in ("auto", "ccl", "gloo", "mpi", "nccl", "accl"):
        assert name in str(info.value)


def test_backend_error_pickles():
    with pytest.raises(BackendError) as info:
        resolve_backend("nope", _env())
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value) and again.fix == info.value.fix


def test_names_are_case_insensitive():
    assert resolve_backend(" GLOO ", _env()).name == "gloo"


def test_gloo_by_name():
    choice = resolve_backend("gloo", _env())
    assert choice.name == "gloo" and choice.module is None and choice.requested == "gloo"


def test_mpi_when_torch_lacks_it():
    import torch.distributed as dist

    if dist.is_mpi_available():
        pytest.skip("this torch has MPI")
    with pytest.raises(BackendError, match="without MPI"):
        resolve_backend("mpi", _env(world_size=2, local_world_size=2, launcher="hydra", rank=0))


def test_mpi_needs_an_mpi_launcher(registry):
    registry["mpi"] = dataclasses.replace(registry["mpi"], probe=lambda lk: (True, "pretend"))  # MPI's own check stays
    env = _env(world_size=2, local_world_size=2, launcher="torchrun")
    with pytest.raises(BackendError, match="MPI launcher"):
        resolve_backend("mpi", env)
    assert resolve_backend("mpi", env.replace(launcher="openmpi")).name == "mpi"


def test_mpi_asks_the_launchers_reader_whether_it_starts_an_mpi_world(registry):
    """A site's launcher says so itself (LauncherReader.mpi_world), not a list in backends/."""
    from cpuddp.launchers import LauncherReader, register_launcher, unregister_launcher

    class World(LauncherReader):
        description = "a site's MPI launcher"
        mpi_world = True

        def detect(self, environ):
            return False

    class Plain(World):
        mpi_world = False

    registry["mpi"] = dataclasses.replace(registry["mpi"], probe=lambda lk: (True, "pretend"))  # MPI's own check stays
    register_launcher("sitempi", World())
    register_launcher("siteplain", Plain())
    try:
        assert resolve_backend("mpi", _env(world_size=2, local_world_size=2, launcher="sitempi")).name == "mpi"
        with pytest.raises(BackendError, match="started by 'siteplain'"):
            resolve_backend("mpi", _env(world_size=2, local_world_size=2, launcher="siteplain"))
    finally:
        unregister_launcher("sitempi")
        unregister_launcher("siteplain")


def test_nccl_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(BackendError, match="nccl"):
        resolve_backend("nccl", _env())
    choice = resolve_backend("auto", _env(), device="cuda")
    assert choice.name == "gloo" and "nccl" in choice.reason


def test_device_must_be_served(registry):
    register_backend("gpuonly", probe=lambda lk: True, devices=("cuda",))
    with pytest.raises(BackendError, match="cuda"):
        resolve_backend("gpuonly", _env(), device="cpu")
    assert resolve_backend("gpuonly", _env(), device="cuda").name == "gpuonly"


def test_accl_is_registered_as_a_plugin():
    spec = BACKENDS["accl"]
    assert spec.module == "torch_accl" and spec.devices == ("cuda",)
    st = backend_status("accl", find_module={"torch_accl"}, metadata={"torch_accl": "0.3.0"})
    assert st.available and st.version == "0.3.0"
    with pytest.raises(BackendError, match="torch_accl"):
        resolve_backend("accl", _env(), find_module=set(), metadata={})


# --------------------------------------------------------------------------- registry


@pytest.mark.parametrize("bad", ["", "auto", "9lives", "has space", "dash-name", None])
def test_register_rejects_bad_names(registry, bad):
    with pytest.raises(ValueError):
        register_backend(bad)  # type: ignore[arg-type]


def test_register_refuses_duplicates_unless_replace(registry):
    with pytest.raises(ValueError, match="already registered"):
        register_backend("gloo")
    spec = register_backend("gloo", probe=lambda lk: (False, "replaced"), replace=True)
    assert BACKENDS["gloo"] is spec
    assert not backend_status("gloo").available


def test_register_plugin_by_module(registry):
    register_backend("myccl", module="my_ccl_plugin", devices=["cpu"], distribution="my-ccl-plugin")
    with pytest.raises(BackendError, match="my_ccl_plugin"):
        resolve_backend("myccl", _env(), find_module=set(), metadata={})
    choice = resolve_backend("myccl", _env(), find_module={"my_ccl_plugin"}, metadata={"my-ccl-plugin": "1.0"})
    assert (choice.name, choice.module, choice.version) == ("myccl", "my_ccl_plugin", "1.0")


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch, registry):
    """A directory on sys.path for fake plug-in modules; removes them from sys.modules after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("cpuddp_fake_"):
            del sys.modules[name]


def test_load_backend_imports_and_checks_registration(plugin_dir):
    (plugin_dir / "cpuddp_fake_good.py").write_text(textwrap.dedent("""
        import torch.distributed as dist
        def _create(store, rank, size, timeout):
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        if "cpuddpfake" not in dist.Backend.backend_list:
            dist.Backend.register_backend("cpuddpfake", _create, devices=["cpu"])
    """))
    register_backend("cpuddpfake", module="cpuddp_fake_good")
    choice = resolve_backend("cpuddpfake", _env())
    load_backend(choice)
    assert "cpuddp_fake_good" in sys.modules


def test_load_backend_module_that_registers_nothing(plugin_dir):
    (plugin_dir / "cpuddp_fake_silent.py").write_text("x = 1\n")
    register_backend("cpuddpsilent", module="cpuddp_fake_silent")
    with pytest.raises(BackendError, match="did not register"):
        load_backend(resolve_backend("cpuddpsilent", _env()))


def test_load_backend_import_error(plugin_dir):
    (plugin_dir / "cpuddp_fake_broken.py").write_text("raise ImportError('libccl.so.2: cannot open shared object file')\n")
    register_backend("cpuddpbroken", module="cpuddp_fake_broken")
    with pytest.raises(BackendError, match="libccl.so.2"):
        load_backend(resolve_backend("cpuddpbroken", _env()))


def test_load_backend_nothing_to_import():
    load_backend(BackendChoice("gloo", "test"))
    load_backend("gloo")


# --------------------------------------------------------------------------- subprocess helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CPUDDP_LOG_LEVEL="INFO")
    env.update(extra)
    return env


def _run_ranks(script: str, world: int, tmp_path: Path, **extra: str) -> list[tuple[int, dict, str]]:
    """Run ``script`` as ``world`` ranks on this host (Kubeflow-style variables, loopback).

    Returns (exit code, the JSON the rank wrote or {}, its log) per rank; every process is
    killed after SUBPROCESS_TIMEOUT seconds.
    """
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(script))
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = _clean_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                         RESULT=str(tmp_path / f"rank{rank}.json"), **extra)
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(path)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    out = []
    for rank, (p, log) in enumerate(procs):
        try:
            code = p.wait(timeout=SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            code = p.wait(timeout=10)
        log.close()
        result = tmp_path / f"rank{rank}.json"
        data = json.loads(result.read_text()) if result.exists() else {}
        out.append((code, data, (tmp_path / f"rank{rank}.log").read_text(errors="replace")))
    return out


# --------------------------------------------------------------------------- gloo for real

GLOO_SCRIPT = """
    import json, os
    import psutil, torch, torch.distributed as dist
    import cpuddp
    env = cpuddp.init_distributed(backend=os.environ.get("BACKEND", "auto"), timeout=60, pin=False)
    t = torch.full((4,), float(env.rank + 1))
    dist.all_reduce(t)
    peers = sorted({c.raddr.ip for c in psutil.Process().net_connections(kind="inet") if c.raddr})
    locals_ = sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.laddr})
    with open(os.environ["RESULT"], "w") as f:
        json.dump({"sum": t.tolist(), "backend": dist.get_backend(), "peers": peers, "locals": locals_,
                   "env": {k: v for k, v in os.environ.items() if k.startswith(("CCL_", "GLOO_"))}}, f)
    cpuddp.shutdown()
"""


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_gloo_two_ranks_stay_on_loopback(tmp_path):
    runs = _run_ranks(GLOO_SCRIPT, 2, tmp_path, BACKEND="gloo")  # auto would take shm on one node
    for code, data, log in runs:
        assert code == 0, log
        assert data["sum"] == [3.0] * 4 and data["backend"] == "gloo"
        assert data["env"].get("GLOO_SOCKET_IFNAME") == "lo"
        assert not any(k.startswith("CCL_") for k in data["env"])
        # single node: every connection gloo and the store made is on loopback
        assert all(is_loopback_address(a) for a in data["peers"] + data["locals"]), data
    # rank 0 says once which backend it picked and why; rank 1 stays quiet
    assert sum("cpuddp: backend gloo" in line for line in runs[0][2].splitlines()) == 1, runs[0][2]
    assert "backend gloo" not in runs[1][2]


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_user_gloo_socket_ifname_wins(tmp_path):
    runs = _run_ranks(GLOO_SCRIPT, 2, tmp_path, GLOO_SOCKET_IFNAME="lo", BACKEND="gloo")
    for code, data, log in runs:
        assert code == 0, log
        assert data["env"]["GLOO_SOCKET_IFNAME"] == "lo"


# --------------------------------------------------------------------------- oneCCL stand-ins

# The oneCCL bindings' test double (tests/fake_ccl, see tests/ccl_util.py): registers "ccl"
# over gloo, or aborts on import as a binding built for another torch does.


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_mismatched_wheel_is_never_imported(tmp_path):
    site = fake_site(tmp_path / "site", MISMATCHED_VERSION.split("+")[0])
    marker = tmp_path / "imported"
    script = f"""
        import json, os, sys
        sys.path.insert(0, {str(site)!r})
        import torch
        import cpuddp
        from cpuddp import backends
        from cpuddp.errors import BackendError
        from cpuddp.launchers.env import DistEnv
        out = {{}}
        st = {{s.name: s for s in cpuddp.backends.available_backends()}}["ccl"]
        out["status"] = [st.available, st.reason, st.version]
        out["auto"] = backends.resolve_backend("auto", DistEnv()).reason
        for what, call in [
            ("resolve", lambda: backends.resolve_backend("ccl", DistEnv())),
            ("load", lambda: backends.load_backend(backends.BackendChoice("ccl", "by hand", "oneccl_bindings_for_pytorch"))),
        ]:
            try:
                call()
                out[what] = None
            except BackendError as exc:
                out[what] = str(exc)
        env = cpuddp.init_distributed(pin=False)
        out["init"] = cpuddp.get_session().backend
        out["pid"] = os.getpid()
        cpuddp.shutdown()
        print("RESULT " + json.dumps(out))
    """
    path = tmp_path / "check.py"
    path.write_text(textwrap.dedent(script))
    env = _clean_env(CPUDDP_FAKE_CCL="abort", CPUDDP_FAKE_CCL_MARKER=str(marker), XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    # imported once, by the probe's child (which aborted), never by this process
    pids = [int(p) for p in marker.read_text().split()]
    assert len(pids) == 1 and out["pid"] not in pids
    import torch

    assert out["status"][0] is False and out["status"][2] == MISMATCHED_VERSION.split("+")[0]
    assert f"oneccl_bind_pt {MISMATCHED_VERSION.split('+')[0]}" in out["status"][1] and torch.__version__.split("+")[0] in out["status"][1]
    assert "(SIGABRT)" in out["status"][1]
    assert out["auto"].startswith("auto: gloo")
    assert f"oneccl_bind_pt {MISMATCHED_VERSION.split('+')[0]}" in out["resolve"] and torch.__version__.split("+")[0] in out["resolve"]
    assert "refusing to import" in out["load"]
    assert out["init"] == "gloo"


CCL_SCRIPT = """
    import json, os, sys
    sys.path.insert(0, os.environ["FAKE_SITE"])
    import torch, torch.distributed as dist
    import cpuddp
    env = cpuddp.init_distributed(backend=os.environ.get("BACKEND", "auto"), timeout=60, pin=False)
    t = torch.full((4,), float(env.rank + 1))
    dist.all_reduce(t)
    with open(os.environ["RESULT"], "w") as f:
        json.dump({"sum": t.tolist(), "backend": dist.get_backend(),
                   "env": {k: v for k, v in os.environ.items() if k.startswith(("CCL_", "GLOO_"))}}, f)
    cpuddp.shutdown()
"""


def _matching_site(tmp_path: Path) -> Path:
    import torch
    from packaging.version import Version

    rel = Version(torch.__version__).release
    return fake_site(tmp_path / "site", f"{rel[0]}.{rel[1]}.0")


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_auto_prefers_shm_to_working_bindings_on_one_node(tmp_path):
    """Issue 23: with working oneCCL bindings, one node's auto is shm (ccl measured 19x slower
    at 1 MiB), and init logs the rule's reason."""
    runs = _run_ranks(CCL_SCRIPT, 2, tmp_path, FAKE_SITE=str(_matching_site(tmp_path)))
    for code, data, log in runs:
        assert code == 0, log
        assert data["backend"] == "shm" and data["sum"] == [3.0] * 4
        assert not any(k.startswith("CCL_") for k in data["env"])
    assert "backend shm (auto: within a node shared memory" in runs[0][2]
    assert "preferred to the working oneCCL" in runs[0][2]


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_matching_bindings_end_to_end(tmp_path):
    runs = _run_ranks(CCL_SCRIPT, 2, tmp_path, FAKE_SITE=str(_matching_site(tmp_path)), BACKEND="ccl")
    for rank, (code, data, log) in enumerate(runs):
        assert code == 0, log
        assert data["backend"] == "ccl" and data["sum"] == [3.0] * 4
        assert data["env"] == {
            "CCL_LOCAL_RANK": str(rank),
            "CCL_LOCAL_SIZE": "2",
            "CCL_PROCESS_LAUNCHER": "none",
            "CCL_ATL_TRANSPORT": "ofi",
            "CCL_ATL_SHM": "1",
            "CCL_WORKER_COUNT": "1",
            "GLOO_SOCKET_IFNAME": "lo",
        }
    assert "backend ccl" in runs[0][2]


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_real_ccl_bindings(tmp_path):
    """With real oneCCL bindings: two ranks all-reduce over ccl.  Skips where they are unusable."""
    st = backend_status("ccl")
    if not st.available:
        pytest.skip(f"oneCCL bindings unusable here: {st.reason}")
    runs = _run_ranks(CCL_SCRIPT, 2, tmp_path, FAKE_SITE=str(tmp_path), BACKEND="ccl")
    for code, data, log in runs:
        assert code == 0, log
        assert data["backend"] == "ccl" and data["sum"] == [3.0] * 4


# --------------------------------------------------------------------------- backend_env / ccl_env


def _plan(*cpus: int):
    return SimpleNamespace(ccl_worker_cpus=tuple(cpus))


def test_ccl_env_torchrun_single_node():
    env = _env(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="torchrun")
    assert ccl_env(env, None, {}, paths=CclPaths()) == {
        "CCL_LOCAL_RANK": "1",
        "CCL_LOCAL_SIZE": "2",
        "CCL_PROCESS_LAUNCHER": "none",
        "CCL_ATL_TRANSPORT": "ofi",
        "CCL_ATL_SHM": "1",
        "CCL_WORKER_COUNT": "1",
    }


def test_ccl_env_hydra_multi_node():
    env = _env(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, num_nodes=2, launcher="hydra",
               master_addr="10.0.0.1")
    out = ccl_env(env, None, {}, paths=CclPaths())
    assert out == {"CCL_LOCAL_RANK": "1", "CCL_LOCAL_SIZE": "2", "CCL_ATL_TRANSPORT": "ofi", "CCL_WORKER_COUNT": "1"}
    intel = {"I_MPI_HYDRA_UUID": "b73", "I_MPI_ROOT": "/opt/intel/oneapi/mpi/latest"}
    assert ccl_env(env, None, intel, paths=CclPaths())["CCL_ATL_TRANSPORT"] == "mpi"


@pytest.mark.parametrize("launcher", ["openmpi", "pmix", "slurm", "mvapich", "env", "none"])
def test_ccl_env_outside_hydra(launcher):
    env = _env(rank=0, world_size=4, local_rank=0, local_world_size=2, num_nodes=2, launcher=launcher)
    out = ccl_env(env, None, {})
    assert out["CCL_PROCESS_LAUNCHER"] == "none" and out["CCL_ATL_TRANSPORT"] == "ofi"
    assert "CCL_ATL_SHM" not in out  # two nodes


def test_ccl_env_user_settings_win():
    env = _env(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher="torchrun")
    user = {"CCL_ATL_TRANSPORT": "mpi", "CCL_WORKER_COUNT": "2", "CCL_LOCAL_RANK": "0", "CCL_PROCESS_LAUNCHER": "pmix"}
    out = ccl_env(env, _plan(4, 5), user)
    assert not set(out) & set(user)
    assert "CCL_ATL_SHM" not in out  # the user's transport is mpi
    assert out["CCL_WORKER_AFFINITY"] == "4,5,4,5"  # two workers per rank, two local ranks


def test_ccl_env_worker_affinity_from_plan():
    env = _env(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="torchrun")
    assert ccl_env(env, _plan(7), {})["CCL_WORKER_AFFINITY"] == "7,7"
    assert "CCL_WORKER_AFFINITY" not in ccl_env(env, None, {})
    assert "CCL_WORKER_AFFINITY" not in ccl_env(env, _plan(), {})
    assert "CCL_WORKER_AFFINITY" not in ccl_env(env, _plan(7), {"CCL_WORKER_AFFINITY": "auto"})
    assert "CCL_WORKER_AFFINITY" not in ccl_env(env, _plan(6, 7), {})  # two CPUs, one worker


def test_ccl_env_workers_share_the_ranks_own_cpus_when_none_are_reserved():
    from cpuddp.affinity import PinPlan

    # 2 ranks on 2 CPUs: nothing to reserve.  Unset, oneCCL's "auto" would put local rank 0's
    # worker on CPU 1 (rank 1's compute core) and rank 1's on CPU 0.
    env = _env(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher="torchrun")
    plan = PinPlan(local_rank=0, cpus=(0,), num_threads=1, ccl_worker_cpus=(), local_world_size=2)
    assert ccl_env(env, plan, {}, paths=CclPaths())["CCL_WORKER_AFFINITY"] == "0,0"
    env1 = env.replace(rank=1, local_rank=1)
    plan1 = PinPlan(local_rank=1, cpus=(2, 3), num_threads=2, ccl_worker_cpus=(), local_world_size=2)
    assert ccl_env(env1, plan1, {"CCL_WORKER_COUNT": "2"}, paths=CclPaths())["CCL_WORKER_AFFINITY"] == "3,2,3,2"


def test_ccl_env_accepts_the_affinity_helpers_plan():
    from cpuddp.affinity import PinPlan

    plan = PinPlan(local_rank=0, cpus=(1,), num_threads=1, ccl_worker_cpus=(0,), local_world_size=1)
    env = _env(launcher="none")
    assert ccl_env(env, plan, {})["CCL_WORKER_AFFINITY"] == "0"


@pytest.mark.parametrize("bad", ["0", "-1", "two", ""])
def test_ccl_env_rejects_bad_worker_count(bad):
    with pytest.raises(LauncherEnvError) as info:
        ccl_env(_env(), None, {"CCL_WORKER_COUNT": bad})
    assert info.value.variable == "CCL_WORKER_COUNT" and info.value.value == bad


def test_backend_env_is_pure_and_only_ccl_gets_ccl_vars():
    env = _env(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher="torchrun")
    environ = MappingProxyType({"PATH": "/bin"})  # read-only: any write would raise
    gloo = backend_env(env, "gloo", None, environ, route_lookup=_never)
    assert gloo == {"GLOO_SOCKET_IFNAME": "lo"}
    ccl = backend_env(env, BackendChoice("ccl", "test", "oneccl_bindings_for_pytorch"), _plan(1), environ,
                      route_lookup=_never)
    assert ccl["CCL_WORKER_AFFINITY"] == "1,1" and ccl["GLOO_SOCKET_IFNAME"] == "lo"


# --------------------------------------------------------------------------- gloo_env


def test_gloo_single_node_loopback_uses_lo_without_lookup():
    # every loopback spelling cpuddp.launchers.is_loopback knows (the one check), e.g. Debian's ip6-loopback
    for addr in ("127.0.0.1", "localhost", "::1", "127.0.1.1", "ip6-loopback", "ip6-localhost", "[::1]", "LOCALHOST"):
        env = _env(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr=addr)
        assert gloo_env(env, {}, route_lookup=_never) == {"GLOO_SOCKET_IFNAME": "lo"}, addr
    assert gloo_env(_env(), {}, route_lookup=_never) == {"GLOO_SOCKET_IFNAME": "lo"}  # one process


def test_gloo_user_setting_wins():
    env = _env(rank=0, world_size=2, local_rank=0, local_world_size=1, num_nodes=2, master_addr="10.0.0.1")
    assert gloo_env(env, {"GLOO_SOCKET_IFNAME": "eth9"}, route_lookup=_never) == {}


def test_gloo_multi_node_uses_the_route():
    env = _env(rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1, num_nodes=2,
               master_addr="10.77.0.1")
    seen = []

    def lookup(addr):
        seen.append(addr)
        return Route("veth1", "10.77.0.2")

    assert gloo_env(env, {}, route_lookup=lookup) == {"GLOO_SOCKET_IFNAME": "veth1"}
    assert seen == ["10.77.0.1"]
    assert gloo_env(env, {}, route_lookup=lambda a: ("ib0", "192.168.1.5")) == {"GLOO_SOCKET_IFNAME": "ib0"}


def test_gloo_single_node_with_a_real_address_uses_the_route():
    env = _env(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr="node0")
    assert gloo_env(env, {}, route_lookup=lambda a: Route("eth0", "192.0.2.2")) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_gloo_multi_node_no_route_or_loopback_route_sets_nothing(caplog):
    env = _env(rank=0, world_size=2, local_rank=0, local_world_size=1, num_nodes=2, master_addr="node0")
    assert gloo_env(env, {}, route_lookup=lambda a: None) == {}
    # MASTER_ADDR resolves to loopback on this host (the hostname trap): do not pick lo
    assert gloo_env(env, {}, route_lookup=lambda a: Route("lo", "127.0.1.1")) == {}
    assert "GLOO_SOCKET_IFNAME" in caplog.text
    for addr in ("127.0.0.1", "ip6-loopback"):
        loop = env.replace(master_addr=addr)
        assert gloo_env(loop, {}, route_lookup=_never) == {}, addr  # loopback across nodes: never looked up


# --------------------------------------------------------------------------- netif

TABLE = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": [SimpleNamespace(address="192.0.2.2"), SimpleNamespace(address="fe80::fc:ff:fe00:1%eth0")],
    "veth1": ["10.77.0.2"],
    "docker0": ["172.17.0.1"],
}


@pytest.mark.parametrize(
    "source, expected",
    [
        ("10.77.0.2", "veth1"),
        ("192.0.2.2", "eth0"),
        ("fe80::fc:ff:fe00:1", "eth0"),
        ("fe80::fc:ff:fe00:1%eth0", "eth0"),
        ("127.0.0.1", "lo"),
        ("::1", "lo"),
        ("::ffff:10.77.0.2", "veth1"),
        ("10.9.9.9", None),
        ("not an address", None),
    ],
)
def test_interface_for_source(source, expected):
    assert interface_for_source(TABLE, source) == expected


def test_interface_for_source_prefers_an_interface_that_is_up():
    table = {"a0": ["10.0.0.5"], "b0": ["10.0.0.5"]}
    assert interface_for_source(table, "10.0.0.5") == "a0"
    assert interface_for_source(table, "10.0.0.5", up={"a0": False, "b0": True}) == "b0"


def test_source_address_unresolvable():
    def resolver(*_a):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    assert source_address("no-such-host.invalid", resolver=resolver) is None


def test_source_address_and_route_to_loopback():
    assert source_address("127.0.0.1") == "127.0.0.1"
    route = route_to("127.0.0.1")
    assert route is not None and route.source == "127.0.0.1" and route.interface == "lo"


def test_import_is_light():
    code = (
        "import sys, cpuddp.backends, cpuddp.launchers.netif; "
        "bad = [m for m in ('torch', 'psutil', 'oneccl_bindings_for_pytorch', 'torch_ccl', 'mpi4py') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_auto_with_gloo_unregistered_is_a_clear_error(registry):
    """The rule falls back to gloo; where even gloo is gone from the registry, auto says so (it
    raised KeyError once the rule's answer was looked up as an object)."""
    from cpuddp.backends import unregister_backend

    unregister_backend("gloo")
    with pytest.raises(BackendError, match="backend='auto' found nothing to run: .*gloo: not registered"):
        resolve_backend("auto", _env(world_size=1, local_world_size=1))
