"""oneCCL bindings judged by evidence: the import probe and its cache (cpuddp.backends.ccl_probe), the
verdict in backend_status, init_distributed and doctor, the transport settings per launcher,
and the explanation of a failing first collective.

The bindings are not on any package registry, so the test double tests/fake_ccl stands for
them: module ``oneccl_bindings_for_pytorch`` with the version a source build carries
(``2.8.0+xpu``), registering ``ccl`` on top of gloo, told by environment variables to import
cleanly, abort, hang or register nothing.  The probe's children are real processes that
import torch and the double.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ccl_util import MODULE, SOURCE_BUILD_VERSION, fake_site, torch_minor_version
from cpuddp.backends import ccl_probe
from cpuddp.backends import (
    CclPaths,
    backend_status,
    ccl_env,
    ccl_settings,
    explain_collective_failure,
    find_ccl_paths,
)
from cpuddp.errors import BackendError, LauncherEnvError
from cpuddp.launchers import detect

REPO = Path(__file__).resolve().parents[1]
TORCH = "2.13.0+cpu"
TIMEOUT = 120


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment with the probe's cache under ``tmp_path`` and the double's knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPUDDP_FAKE_CCL", "CPUDDP_CCL"))}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["CPUDDP_FAKE_CCL_MARKER"] = str(tmp_path / "imported")
    env.update(extra)
    return env


def _imports(tmp_path: Path) -> list[int]:
    marker = tmp_path / "imported"
    return [int(line) for line in marker.read_text().split()] if marker.exists() else []


def _check(site: Path, environ: dict[str, str], torch_version: str = TORCH) -> ccl_probe.ImportVerdict:
    return ccl_probe.check_import(MODULE, torch_version, environ=environ, path=[str(site), *sys.path])


# --------------------------------------------------------------------------- the probe and its cache


@pytest.mark.timeout(TIMEOUT)
def test_probe_passes_then_cache_is_reused_and_invalidated(tmp_path):
    site = fake_site(tmp_path / "site")
    environ = _env(tmp_path)
    first = _check(site, environ)
    assert first.ok and not first.cached, first
    assert first.detail == "import probe passed" and "ok" in first.output
    assert len(_imports(tmp_path)) == 1 and os.getpid() not in _imports(tmp_path)
    assert MODULE not in sys.modules  # judged in a child, never imported here
    entry = Path(first.cache_file)
    assert entry.parent == tmp_path / "cache" / "cpuddp" and entry.exists()

    again = _check(site, environ)
    assert again.ok and again.cached and again.cache_file == first.cache_file
    assert len(_imports(tmp_path)) == 1  # no second child

    # Another torch: asked again.
    other_torch = _check(site, environ, torch_version="2.14.0+cpu")
    assert other_torch.ok and not other_torch.cached
    assert len(_imports(tmp_path)) == 2

    # A rebuild (the files change size and mtime): asked again.
    init = site / MODULE / "__init__.py"
    init.write_text(init.read_text() + "\n# rebuilt\n")
    rebuilt = _check(site, environ)
    assert rebuilt.ok and not rebuilt.cached and rebuilt.cache_file != first.cache_file
    assert len(_imports(tmp_path)) == 3


@pytest.mark.timeout(TIMEOUT)
def test_probe_fails_for_a_binding_that_aborts(tmp_path):
    site = fake_site(tmp_path / "site")
    environ = _env(tmp_path, CPUDDP_FAKE_CCL="abort")
    v = _check(site, environ)
    assert not v.ok and v.detail == "the import probe was killed by signal 6 (SIGABRT)"
    assert "Mismatch in kernel C++ signatures" in v.output and "Mismatch in kernel" in v.summary()
    assert _imports(tmp_path) and os.getpid() not in _imports(tmp_path)
    # the failure is cached too: the next start does not pay again
    assert _check(site, environ).cached


@pytest.mark.timeout(TIMEOUT)
def test_probe_that_hangs_is_killed_in_time(tmp_path):
    site = fake_site(tmp_path / "site")
    # long enough for the child to import torch on a busy machine and reach the hang
    environ = _env(tmp_path, CPUDDP_FAKE_CCL="hang", CPUDDP_CCL_PROBE_TIMEOUT="15")
    t0 = time.monotonic()
    v = _check(site, environ)
    assert time.monotonic() - t0 < 45
    assert not v.ok and v.detail == "the import probe did not finish in 15 s (killed)"
    assert "hanging in import" in v.output


@pytest.mark.timeout(TIMEOUT)
def test_probe_fails_for_a_module_that_registers_nothing(tmp_path):
    site = fake_site(tmp_path / "site")
    v = _check(site, _env(tmp_path, CPUDDP_FAKE_CCL="silent"))
    assert not v.ok and v.detail == "the import probe exited with code 3"
    assert "registered no backend 'ccl'" in v.output


def test_probe_of_a_missing_module_spawns_nothing(tmp_path):
    v = ccl_probe.check_import(MODULE, TORCH, environ=_env(tmp_path), path=[str(tmp_path)])
    assert not v.ok and "cannot be found" in v.detail
    assert not (tmp_path / "cache").exists()


CONCURRENT = """
    import json, sys
    sys.path.insert(0, {repo!r})
    from cpuddp.backends import ccl_probe
    v = ccl_probe.check_import("oneccl_bindings_for_pytorch", "2.13.0+cpu", path=[{site!r}, *sys.path])
    print("VERDICT " + json.dumps([v.ok, v.cached]))
"""


@pytest.mark.timeout(TIMEOUT)
def test_concurrent_first_starts_probe_once(tmp_path):
    site = fake_site(tmp_path / "site")
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(CONCURRENT.format(repo=str(REPO), site=str(site))))
    # Each import takes 2 s, so the four starts overlap whatever the scheduling.
    environ = _env(tmp_path, CPUDDP_FAKE_CCL_DELAY="2")
    procs = [subprocess.Popen([sys.executable, str(script)], env=environ, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=TIMEOUT - 20)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, out
        outs.append(json.loads(out.split("VERDICT ", 1)[1]))
    assert all(ok for ok, _ in outs), outs
    assert sorted(cached for _, cached in outs) == [False, True, True, True], outs
    assert len(_imports(tmp_path)) == 1  # one child imported the double, for all four


def test_cache_dir_follows_xdg_then_home(tmp_path):
    assert ccl_probe.cache_dir({"XDG_CACHE_HOME": "/x/cache", "HOME": "/h"}) == Path("/x/cache/cpuddp")
    assert ccl_probe.cache_dir({"HOME": "/h"}) == Path("/h/.cache/cpuddp")
    assert ccl_probe.cache_dir({"XDG_CACHE_HOME": "relative", "HOME": "/h"}) == Path("/h/.cache/cpuddp")


@pytest.mark.timeout(TIMEOUT)
def test_unwritable_cache_still_gives_a_verdict(tmp_path):
    site = fake_site(tmp_path / "site")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    v = _check(site, _env(tmp_path, XDG_CACHE_HOME=str(blocker)))
    assert v.ok and not v.cached and v.cache_file is None


@pytest.mark.parametrize("bad", ["0", "-5", "soon", "nan", "inf"])
def test_bad_probe_timeout_names_the_variable(bad):
    with pytest.raises(LauncherEnvError) as info:
        ccl_probe.probe_timeout({"CPUDDP_CCL_PROBE_TIMEOUT": bad})
    assert info.value.variable == "CPUDDP_CCL_PROBE_TIMEOUT" and info.value.value == bad
    assert ccl_probe.probe_timeout({}) == 60.0 and ccl_probe.probe_timeout({"CPUDDP_CCL_PROBE_TIMEOUT": "7.5"}) == 7.5


# --------------------------------------------------------------------------- the verdict in backend_status


class _Probe:
    def __init__(self, ok: bool, detail: str = "import probe passed", output: str = ""):
        self.verdict = ccl_probe.ImportVerdict(ok, detail, output)
        self.calls: list[tuple[str, str]] = []

    def __call__(self, module: str, torch_version: str) -> ccl_probe.ImportVerdict:
        self.calls.append((module, torch_version))
        return self.verdict


def _status(version: str, probe: _Probe, environ=None):
    return backend_status("ccl", metadata={"torch": TORCH, "oneccl_bind_pt": version}, find_module={MODULE},
                          environ=environ or {}, import_probe=probe)


def test_matching_metadata_needs_no_probe():
    probe = _Probe(False)
    st = _status("2.13.0", probe)
    assert st.available and st.evidence == "metadata" and probe.calls == []


def test_mismatch_but_probe_passes_is_used():
    probe = _Probe(True)
    st = _status(SOURCE_BUILD_VERSION, probe)
    assert st.available and st.evidence == "import probe"
    assert "built for this torch (import probe passed" in st.reason
    assert "torch 2.8" in st.reason and TORCH in st.reason
    assert probe.calls == [(MODULE, TORCH)]


def test_mismatch_and_probe_fails_says_what_it_printed():
    probe = _Probe(False, "the import probe was killed by SIGABRT", "undefined symbol: _ZN3c104impl")
    st = _status(SOURCE_BUILD_VERSION, probe)
    assert not st.available
    assert "built for torch 2.8, not torch 2.13.0+cpu" in st.reason
    assert "killed by SIGABRT: undefined symbol: _ZN3c104impl" in st.reason and "not imported here" in st.reason


def test_skip_variable_still_overrides_without_a_probe():
    probe = _Probe(False)
    st = _status(SOURCE_BUILD_VERSION, probe, {"CPUDDP_CCL_SKIP_VERSION_CHECK": "1"})
    assert st.available and st.evidence == "CPUDDP_CCL_SKIP_VERSION_CHECK" and probe.calls == []


def test_mismatched_binding_without_its_module_is_not_probed():
    probe = _Probe(True)
    st = backend_status("ccl", metadata={"torch": TORCH, "oneccl_bind_pt": SOURCE_BUILD_VERSION}, find_module=set(),
                        environ={}, import_probe=probe)
    assert not st.available and "without its module" in st.reason and probe.calls == []


# --------------------------------------------------------------------------- init_distributed, end to end

RANK_SCRIPT = """
    import json, os, sys, threading, time
    sys.path.insert(0, os.environ["FAKE_SITE"])
    import torch, torch.distributed as dist
    import cpuddp
    wide = sorted(os.sched_getaffinity(0))  # what the rank may use, before cpuddp pins it
    stop = threading.Event()
    compute = threading.Thread(target=stop.wait, name="user-compute", daemon=True)
    compute.start()  # a thread that exists before init: cpuddp pins it with the others
    pinned_at = []
    from cpuddp.affinity import pin as affinity
    _apply = affinity.apply_plan
    def apply_plan(*a, **k):
        out = _apply(*a, **k)
        pinned_at.append(time.time())
        return out
    affinity.apply_plan = apply_plan
    env = cpuddp.init_distributed(backend=os.environ.get("BACKEND", "auto"), timeout=60,
                                  pin=os.environ.get("PIN", "1") == "1")
    t = torch.full((4,), float(env.rank + 1))
    dist.all_reduce(t)
    def cpus(tid):
        with open(f"/proc/self/task/{tid}/status") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("Cpus_allowed_list:"))
    mod = sys.modules.get("oneccl_bindings_for_pytorch")
    workers = [w.native_id for w in getattr(mod, "_workers", [])]
    out = {"sum": t.tolist(), "backend": dist.get_backend(), "pid": os.getpid(),
           "compute_tid": compute.native_id, "compute_cpus": cpus(compute.native_id),
           "worker_cpus_now": [cpus(w) for w in workers], "pinned_at": pinned_at,
           "plan_cpus": list(cpuddp.get_session().pin_plan.cpus) if cpuddp.get_session().pin_plan is not None else None,
           "wide": wide}
    with open(os.environ["RESULT"], "w") as f:
        json.dump(out, f)
    cpuddp.shutdown()
"""


def _ranks(tmp_path: Path, site: Path, world: int = 2, **extra: str) -> list[tuple[int, dict, str, dict]]:
    from test_backends import _run_ranks

    environ = {"FAKE_SITE": str(site), "XDG_CACHE_HOME": str(tmp_path / "cache"),
               "CPUDDP_FAKE_CCL_MARKER": str(tmp_path / "imported")}
    environ.update(extra)
    out = []
    # each rank's creator records what it saw: one file per rank, named by RANK
    records = {r: tmp_path / f"created{r}.json" for r in range(world)}
    script = RANK_SCRIPT.replace(
        'sys.path.insert(0, os.environ["FAKE_SITE"])',
        'sys.path.insert(0, os.environ["FAKE_SITE"]); '
        'os.environ["CPUDDP_FAKE_CCL_RECORD"] = os.environ["RECORD_STEM"] + os.environ["RANK"] + ".json"')
    environ["RECORD_STEM"] = str(tmp_path / "created")
    for rank, (code, data, log) in enumerate(_run_ranks(script, world, tmp_path, **environ)):
        rec = json.loads(records[rank].read_text()) if records[rank].exists() else {}
        out.append((code, data, log, rec))
    return out


@pytest.mark.timeout(TIMEOUT + 60)
def test_source_build_is_probed_once_and_used(tmp_path):
    """A binding whose version names torch 2.8: backend="ccl" probes it (once for both ranks)
    and forms a ccl group; the ranks log why.  (On one node "auto" takes shm even with working
    bindings: tests/test_backend_auto.py.)"""
    site = fake_site(tmp_path / "site")
    runs = _ranks(tmp_path, site, PIN="0", BACKEND="ccl")
    for code, data, log, _ in runs:
        assert code == 0, log
        assert data["backend"] == "ccl" and data["sum"] == [3.0] * 4
    assert "built for this torch (import probe passed" in runs[0][2]
    pids = _imports(tmp_path)
    ranks = {data["pid"] for _, data, _, _ in runs}
    assert ranks <= set(pids) and len(pids) == 3, pids  # two ranks + exactly one probe child


@pytest.mark.timeout(TIMEOUT + 60)
def test_source_build_that_aborts_is_never_imported_by_a_rank(tmp_path):
    site = fake_site(tmp_path / "site")
    # CPUDDP_SHM=0: auto's reason then names why oneCCL was not taken (with shm it need not)
    runs = _ranks(tmp_path, site, PIN="0", CPUDDP_FAKE_CCL="abort", CPUDDP_SHM="0")
    for code, data, log, _ in runs:
        assert code == 0, log
        assert data["backend"] == "gloo"  # auto's choice without ccl
    assert "(SIGABRT)" in runs[0][2] and "Mismatch in kernel C++ signatures" in runs[0][2]
    ranks = {data["pid"] for _, data, _, _ in runs}
    assert len(_imports(tmp_path)) == 1 and not ranks & set(_imports(tmp_path))


@pytest.mark.timeout(TIMEOUT + 60)
def test_no_communicator_before_pinning(tmp_path):
    """The double's creator runs when the group is formed: by then every compute thread is
    pinned to the rank's plan; the "worker" it starts gets the rank's whole allowed set and
    keeps it (cpuddp does not re-pin threads the backend made)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 allowed CPUs to tell pinned from unpinned")
    site = fake_site(tmp_path / "site", torch_minor_version())
    runs = _ranks(tmp_path, site, BACKEND="ccl")
    for code, data, log, rec in runs:
        assert code == 0, log
        assert data["backend"] == "ccl" and rec, log
        plan = _cpulist(data["plan_cpus"])
        # pinning ran before the communicator was created ...
        assert data["pinned_at"] and data["pinned_at"][0] <= rec["created_at"], (data, rec)
        # ... so the compute thread that existed before init was already on the plan's CPUs
        assert rec["threads"][str(data["compute_tid"])] == plan, (rec, plan)
        assert plan != _cpulist(data["wide"])  # (which is narrower than what the rank may use)
        # the backend's own thread started wide, and nobody re-pinned it afterwards
        assert rec["worker_cpus_at_start"] == _cpulist(data["wide"])
        assert data["worker_cpus_now"] == [rec["worker_cpus_at_start"]]
        assert "CCL_LOCAL_RANK" in rec["env"] and "CCL_ATL_TRANSPORT" in rec["env"]


def _cpulist(cpus) -> str:
    from cpuddp.topology import format_cpulist

    return format_cpulist(cpus)


# --------------------------------------------------------------------------- doctor

DOCTOR = """
    import json, sys
    sys.path.insert(0, {site!r})
    from cpuddp.doctor import command as doctor
    report = doctor.collect({{}})
    print("REPORT " + json.dumps({{"versions": report["versions"], "warnings": report["warnings"],
                                  "text": doctor.format_text(report)}}))
"""


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("mode", ["ok", "abort"])
def test_doctor_shows_the_probe_verdict(tmp_path, mode):
    site = fake_site(tmp_path / "site")
    script = tmp_path / "doctor.py"
    script.write_text(textwrap.dedent(DOCTOR.format(site=str(site))))
    env = _env(tmp_path, CPUDDP_FAKE_CCL=mode, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=TIMEOUT - 10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.split("REPORT ", 1)[1])
    verdict = out["versions"]["oneccl_bind_pt_verdict"]
    mism = [w for w in out["warnings"] if w["code"] == "version-mismatch" and "oneccl" in w["message"]]
    assert verdict["evidence"] == "import probe"
    if mode == "ok":
        assert verdict["usable"] is True and not mism
        assert "import probe passed: usable" in out["text"]
        assert "built for this torch (import probe passed" in out["text"]
    else:
        assert verdict["usable"] is False and len(mism) == 1
        assert "(SIGABRT)" in mism[0]["message"]
        assert "import probe FAILED" in out["text"]


# --------------------------------------------------------------------------- transport per launcher

PROV = "/venv/lib"
IMPI_HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
              "I_MPI_HYDRA_UUID": "b7300000-8304-b248-e760-06001f6f6264", "I_MPI_INFO_NP": "1",
              "MASTER_ADDR": "127.0.0.1"}
MPICH_HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
               "PMI_HOSTNAME": "vm", "MASTER_ADDR": "127.0.0.1"}
LAUNCHER_ENVS = {
    "torchrun": {"TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                 "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    "intel-mpi": IMPI_HYDRA,
    "mpich": MPICH_HYDRA,
    "openmpi": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_RANK": "1", "MASTER_ADDR": "127.0.0.1"},
    "slurm": {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42", "SLURM_NTASKS": "2",
              "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1",
              "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "node1"},
}


def _settings(environ, paths=CclPaths(provider_dir=PROV)):
    return ccl_env(detect(environ), None, environ, paths=paths)


@pytest.mark.parametrize("launcher, transport, process_launcher",
                         [("torchrun", "ofi", "none"), ("intel-mpi", "ofi", None), ("mpich", "ofi", None),
                          ("openmpi", "ofi", "none"), ("slurm", "ofi", "none")])
def test_transport_per_launcher_without_intel_mpi_environment(launcher, transport, process_launcher):
    environ = LAUNCHER_ENVS[launcher]
    out = _settings(environ)
    assert out["CCL_ATL_TRANSPORT"] == transport
    assert out.get("CCL_PROCESS_LAUNCHER") == process_launcher
    assert (out["CCL_LOCAL_RANK"], out["CCL_LOCAL_SIZE"]) == ("1", "2")
    assert out["CCL_ATL_SHM"] == "1"  # one node
    assert out["FI_PROVIDER_PATH"] == PROV
    assert "I_MPI_ROOT" not in out


def test_intel_mpi_with_its_environment_uses_mpi():
    environ = {**IMPI_HYDRA, "I_MPI_ROOT": "/opt/intel/oneapi/mpi/latest"}
    out = _settings(environ)
    assert out["CCL_ATL_TRANSPORT"] == "mpi" and "CCL_ATL_SHM" not in out and "I_MPI_ROOT" not in out
    assert _settings({**IMPI_HYDRA, "ONEAPI_ROOT": "/opt/intel/oneapi"})["CCL_ATL_TRANSPORT"] == "mpi"


def test_intel_mpi_root_derived_from_the_launching_intel_mpi():
    out = _settings(IMPI_HYDRA, CclPaths(impi_root="/venv", provider_dir=PROV))
    assert out["CCL_ATL_TRANSPORT"] == "mpi" and out["I_MPI_ROOT"] == "/venv"
    why = ccl_settings(detect(IMPI_HYDRA), None, IMPI_HYDRA, paths=CclPaths(impi_root="/venv"))
    assert "Intel MPI" in why["I_MPI_ROOT"][1]


def test_mpich_never_gets_mpi_even_with_an_intel_mpi_root():
    # MPICH's Hydra: oneCCL's mpi transport would load Intel MPI under another PMI
    environ = {**MPICH_HYDRA, "I_MPI_ROOT": "/opt/intel/oneapi/mpi/latest"}
    assert _settings(environ, CclPaths(impi_root="/venv"))["CCL_ATL_TRANSPORT"] == "ofi"


def test_no_providers_found_sets_no_provider_path():
    assert "FI_PROVIDER_PATH" not in _settings(LAUNCHER_ENVS["torchrun"], CclPaths())


def test_user_values_win_and_are_not_returned():
    user = {"CCL_ATL_TRANSPORT": "mpi", "FI_PROVIDER_PATH": "/mine", "I_MPI_ROOT": "/mine/impi"}
    environ = {**IMPI_HYDRA, **user}
    out = _settings(environ, CclPaths(impi_root="/venv", provider_dir=PROV))
    assert not set(out) & set(user)
    assert "CCL_ATL_SHM" not in out  # the user's transport is mpi


def test_every_value_set_is_logged_by_local_rank_0(caplog):
    environ = dict(LAUNCHER_ENVS["torchrun"], LOCAL_RANK="0", RANK="0")
    with caplog.at_level("INFO", logger="cpuddp.backends"):
        out = _settings(environ)
    for key, value in out.items():
        assert f"{key}={value} (" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="cpuddp.backends"):
        _settings(LAUNCHER_ENVS["torchrun"])  # local rank 1
    assert "oneCCL settings" not in caplog.text


def test_find_ccl_paths_providers_beside_oneccl(tmp_path):
    root = tmp_path / "oneapi"
    prov = root / "opt" / "mpi" / "libfabric" / "lib" / "prov"
    prov.mkdir(parents=True)
    (prov / "libtcp-fi.so").write_text("")
    found = find_ccl_paths({"I_MPI_ROOT": str(root)})
    assert found.provider_dir == str(prov) and found.impi_root is None  # not launched by Intel MPI's Hydra
    ccl_root = tmp_path / "ccl"
    (ccl_root / "lib").mkdir(parents=True)
    (ccl_root / "lib" / "libshm-fi.so").write_text("")
    assert find_ccl_paths({"CCL_ROOT": str(ccl_root), "I_MPI_ROOT": str(root)}).provider_dir == str(ccl_root / "lib")


def test_backend_env_keeps_its_signature_and_purity():
    from types import MappingProxyType

    from cpuddp.backends import backend_env

    environ = MappingProxyType(dict(LAUNCHER_ENVS["torchrun"]))
    out = backend_env(detect(environ), "ccl", None, environ, route_lookup=lambda a: None,
                      ccl_paths=CclPaths(provider_dir=PROV))
    assert out["FI_PROVIDER_PATH"] == PROV and out["GLOO_SOCKET_IFNAME"] == "lo"


# --------------------------------------------------------------------------- a failing first collective


ATL = "oneCCL: atl_ofi_comm.cpp:229 init_transport: EXCEPTION: failed to initialize ATL"


@pytest.mark.parametrize(
    "environ, said, fix",
    [
        # (what real runs printed: MPICH's mpiexec with CCL_ATL_TRANSPORT=mpi; torchrun with
        # FI_PROVIDER_PATH pointing at an empty directory)
        ({"CCL_ATL_TRANSPORT": "mpi", "RANK": "1"},
         "oneCCL: atl_mpi_comm.cpp:87 init_transport: EXCEPTION: failed to initialize ATL",
         "source Intel MPI's env/vars.sh"),
        ({"CCL_ATL_TRANSPORT": "ofi", "RANK": "0"}, ATL, "FI_PROVIDER_PATH is unset, so libfabric found no provider"),
        ({"CCL_ATL_TRANSPORT": "ofi", "FI_PROVIDER_PATH": "{empty}", "RANK": "0"}, ATL, "holds no lib*-fi.so"),
        ({"CCL_ATL_TRANSPORT": "ofi", "RANK": "0"},
         "oneCCL: atl_ofi.cpp: fi_getinfo error: ret -61, providers 0", "export FI_PROVIDER_PATH="),
        ({"CCL_ATL_TRANSPORT": "ofi", "FI_PROVIDER_PATH": "{prov}", "RANK": "0"}, ATL,
         "CCL_LOG_LEVEL=info"),
        ({"CCL_ATL_TRANSPORT": "mpi", "I_MPI_ROOT": "/opt/impi", "RANK": "0"}, "oneCCL: something new",
         "try CCL_ATL_TRANSPORT=ofi"),
    ],
)
def test_explain_collective_failure(tmp_path, environ, said, fix):
    (tmp_path / "prov").mkdir()
    (tmp_path / "prov" / "libtcp-fi.so").write_text("")
    (tmp_path / "empty").mkdir()
    environ = {k: v.format(prov=tmp_path / "prov", empty=tmp_path / "empty") for k, v in environ.items()}
    err = explain_collective_failure("ccl", environ, RuntimeError(said))
    assert isinstance(err, BackendError)
    last = str(err).splitlines()[-1]
    assert last.startswith(f"Fix: oneCCL transport CCL_ATL_TRANSPORT={environ['CCL_ATL_TRANSPORT']}")
    assert "FI_PROVIDER_PATH" in last and "I_MPI_ROOT" in last and fix in last
    assert f"rank {environ['RANK']}" in str(err) and said in str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_explain_collective_failure_other_backends():
    err = explain_collective_failure("gloo", {"GLOO_SOCKET_IFNAME": "eth0"}, RuntimeError("Connection reset by peer"))
    last = str(err).splitlines()[-1]
    assert "GLOO_SOCKET_IFNAME=eth0" in last and "backend='gloo'" not in last.split("GLOO_SOCKET_IFNAME")[0]
    assert "Connection reset by peer" in str(err)


def test_probe_module_is_light():
    code = ("import sys, cpuddp.backends.ccl_probe; bad = [m for m in ('torch', 'numpy', 'oneccl_bindings_for_pytorch') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_verdict_summary():
    v = ccl_probe.ImportVerdict(False, "the import probe exited with code 1", "Traceback\n\nImportError: libccl.so.1")
    assert v.summary() == "the import probe exited with code 1: Traceback | ImportError: libccl.so.1"
    assert ccl_probe.ImportVerdict(True, "import probe passed").summary() == "import probe passed"
