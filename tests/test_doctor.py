"""``cpuddp doctor``: the pure warning rules, version matching, the text report, and collect().

The command-line runs (text, --json, a fake launcher environment, timing) are in tests/test_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from cpuddp.doctor import command as doctor
from cpuddp.doctor.command import collect
from cpuddp.doctor.diagnose import diagnose
from cpuddp.doctor.text import format_text

REPO = Path(__file__).resolve().parents[1]


def _env(**kw: Any) -> dict[str, Any]:
    base = {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "node_rank": 0, "num_nodes": 1,
            "launcher": "none", "master_addr": "127.0.0.1", "master_port": 29500, "job_id": None,
            "sources": {}}
    base.update(kw)
    return base


def _plan(cpus: list[int], threads: Optional[int] = None, **kw: Any) -> dict[str, Any]:
    d = {"local_rank": 0, "local_world_size": 1, "cpus": cpus, "cpulist": ",".join(map(str, cpus)),
         "num_threads": threads if threads is not None else len(cpus), "ccl_worker_cpus": [], "reason": "test",
         "warnings": [], "env": {}, "replace_env": []}
    d.update(kw)
    return d


def _rec(code: str, message: str, fix: str = "") -> dict[str, str]:
    return {"code": code, "message": message, "fix": fix}


def codes(warnings: list[dict[str, str]]) -> list[str]:
    return [w["code"] for w in warnings]


def test_quiet_single_process() -> None:
    assert diagnose(_env(), {}, cpus=2, plans=[_plan([0, 1])]) == []


def test_more_ranks_than_cpus() -> None:
    w = diagnose(_env(world_size=4, local_world_size=4), {}, cpus=2,
                 plans=[_plan([0], warning_records=[_rec("oversubscribed", "oversubscribed: 4 local ranks on 2 cores",
                                                          "fewer")])] * 4)
    assert codes(w) == ["oversubscribed"]  # the planner's own oversubscription warning is not repeated
    assert "4 ranks" in w[0]["message"] and "2 usable CPU" in w[0]["message"]


def test_threads_oversubscribe_without_plan() -> None:
    # No pinning plan: torch's default is every usable CPU per rank.
    w = diagnose(_env(world_size=2, local_world_size=2), {}, cpus=2, plans=[])
    assert codes(w) == ["oversubscribed"]
    assert "OMP_NUM_THREADS=1" in w[0]["fix"]
    assert diagnose(_env(world_size=2, local_world_size=2), {"OMP_NUM_THREADS": "1"}, cpus=2, plans=[]) == []


def test_omp_conflict_with_plan() -> None:
    plans = [_plan([0, 1, 2, 3], threads=8, warning_records=[
        _rec("threads-exceed-cpus", "8 threads asked for local rank 0, which is pinned to 4 CPUs")])]
    w = diagnose(_env(), {"OMP_NUM_THREADS": "8"}, cpus=4, plans=plans)
    assert codes(w) == ["oversubscribed", "omp-conflict"]
    assert "threads will share CPUs" in w[1]["message"]
    idle = diagnose(_env(), {"OMP_NUM_THREADS": "1"}, cpus=4, plans=[_plan([0, 1, 2, 3], threads=1)])
    assert codes(idle) == ["omp-conflict"] and "idle" in idle[0]["message"]


def test_torchrun_default_omp_is_not_a_conflict() -> None:
    # torchrun sets OMP_NUM_THREADS=1 itself; the planner marks it replaceable.
    plans = [_plan([0, 1], replace_env=["OMP_NUM_THREADS"]), _plan([2, 3], replace_env=["OMP_NUM_THREADS"])]
    env = _env(launcher="torchrun", world_size=2, local_world_size=2)
    assert diagnose(env, {"OMP_NUM_THREADS": "1"}, cpus=4, plans=plans) == []


def test_omp_invalid_and_mkl_mismatch() -> None:
    assert "omp-invalid" in codes(diagnose(_env(), {"OMP_NUM_THREADS": "zero"}, cpus=2))
    w = diagnose(_env(), {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "1"}, cpus=2, plans=[_plan([0, 1])])
    assert codes(w) == ["omp-conflict"] and "MKL_NUM_THREADS=1" in w[0]["message"]


MULTI = _env(world_size=4, local_world_size=2, num_nodes=2, launcher="hydra", master_addr="",
             sources={"master_addr": "pending: broadcast from rank 0 over MPI"})
LOOPBACK_HOST = {"name": "node1", "addresses": ["127.0.1.1"], "error": None}


def test_multinode_loopback_hostname_and_missing_master_addr() -> None:
    w = diagnose(MULTI, {}, cpus=2, plans=[_plan([0]), _plan([1])], host=LOOPBACK_HOST, mpi4py=False)
    assert codes(w) == ["hostname-loopback", "master-addr-missing"]
    assert "GLOO_SOCKET_IFNAME" in w[0]["fix"] and "127.0.1.1" in w[0]["message"]
    assert "mpi4py is not installed" in w[1]["message"]
    ok = diagnose(MULTI, {}, cpus=2, plans=[_plan([0]), _plan([1])], host=LOOPBACK_HOST, mpi4py=True)
    assert "mpi4py is installed" in ok[1]["message"]


def test_multinode_loopback_hostname_is_fine_when_cpuddp_knows_the_interface() -> None:
    env = dict(MULTI, master_addr="10.0.0.1")
    w = diagnose(env, {"MASTER_ADDR": "10.0.0.1"}, cpus=2, plans=[_plan([0]), _plan([1])], host=LOOPBACK_HOST,
                 gloo_ifname="eth0")
    assert w == []


def test_multinode_quiet_when_configured() -> None:
    environ = {"GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": "10.0.0.1"}
    env = dict(MULTI, master_addr="10.0.0.1")
    assert diagnose(env, environ, cpus=2, plans=[_plan([0]), _plan([1])], host=LOOPBACK_HOST) == []
    w = diagnose(env, {"MASTER_ADDR": "127.0.0.1"}, cpus=2, plans=[_plan([0]), _plan([1])],
                 host={"name": "n", "addresses": ["10.0.0.2"], "error": None})
    assert codes(w) == ["master-addr-loopback"]


def test_single_node_ignores_loopback() -> None:
    env = _env(world_size=2, local_world_size=2)
    assert diagnose(env, {}, cpus=2, plans=[_plan([0]), _plan([1])], host=LOOPBACK_HOST) == []


def test_planner_warnings_are_passed_on_once() -> None:
    rec = _rec("unequal-shares", "local ranks get unequal shares (1 to 2 cores)", "use a rank count that divides")
    w = diagnose(_env(world_size=2, local_world_size=2), {}, cpus=3,
                 plans=[_plan([0, 1], warning_records=[rec]), _plan([2], warning_records=[rec])])
    assert codes(w) == ["pinning"]
    assert w[0]["fix"] == "use a rank count that divides" and w[0]["message"] == rec["message"]


def test_planner_warnings_come_from_the_real_planner_as_records() -> None:
    # The planner's records, through PinPlan.as_dict(), reach doctor without any text parsing:
    # its oversubscription is covered by doctor's own; an unequal share is passed on.
    from cpuddp.affinity import plan_pinning
    from cpuddp.topology import synthetic_topology

    over = [plan_pinning(synthetic_topology(1, 2), r, 3).as_dict() for r in range(3)]
    assert over[0]["warning_records"][0]["code"] == "oversubscribed"
    w = diagnose(_env(world_size=3, local_world_size=3), {}, cpus=2, plans=over)
    assert codes(w) == ["oversubscribed"]
    uneven = [plan_pinning(synthetic_topology(1, 3), r, 2).as_dict() for r in range(2)]
    w = diagnose(_env(world_size=2, local_world_size=2), {}, cpus=3, plans=uneven)
    assert codes(w) == ["pinning"] and w[0]["fix"] == "use a rank count that divides each socket's cores"
    assert uneven[0]["warnings"] == [f"{w[0]['message']}. Fix: {w[0]['fix']}"]  # the same text as logged
    # plain text (an older plan's JSON) is passed on whole, never split
    legacy = diagnose(_env(world_size=2, local_world_size=2), {}, cpus=3, plans=[_plan([0, 1], warnings=["a. Fix: b"])])
    assert legacy == [{"code": "pinning", "message": "a. Fix: b", "fix": "see the pinning plan"}]


def test_collect_degrades_and_formats(tmp_path: Path) -> None:
    # An empty filesystem root: the CPU section still answers (fallbacks), nothing raises.
    report = collect({"OMP_NUM_THREADS": "1"}, root=str(tmp_path))
    text = format_text(report)
    for heading in ("Launcher", "Versions", "Backends", "CPU", "Threads", "A job here", "Warnings"):
        assert heading in text
    json.dumps(report, default=str)


def test_collect_reports_launcher_error() -> None:
    report = collect({"RANK": "1"})  # half a launcher environment
    la = report["launcher"]
    assert la["ok"] is False and la["variable"] == "WORLD_SIZE"
    assert "WORLD_SIZE" in format_text(report)
    assert report["pinning"]["available"] is False


def test_collect_fake_launcher() -> None:
    environ = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    report = collect(environ)
    assert report["launcher"]["ok"] and report["launcher"]["name"] == "hydra"
    assert report["launcher"]["env"]["rank"] == 1
    plans = report["pinning"]["plans"]
    assert [p["local_rank"] for p in plans] == [0, 1]
    assert report["network"]["GLOO_SOCKET_IFNAME"] == "lo"  # one node on loopback


def test_text_marks_missing_sections() -> None:
    report = {
        "launcher": {"available": False, "error": "ImportError: x"},
        "versions": {"cpuddp": "0", "python": "3", "torch": None, "ipex": None, "oneccl_bind_pt": None},
        "backends": {"available": False, "error": "ModuleNotFoundError: cpuddp.backends"},
        "cpu": {"available": False, "error": "OSError: y"},
        "threads": {"OMP_NUM_THREADS": "2"},
        "pinning": {"available": False, "error": "z"},
        "host": {"name": "h", "addresses": [], "error": "slow"},
        "warnings": [{"code": "c", "message": "m", "fix": "f"}],
        "elapsed_s": 0.01,
    }
    text = format_text(report)
    assert text.count("not available") == 4
    assert "OMP_NUM_THREADS=2" in text and "! m" in text and "fix: f" in text


@pytest.mark.timeout(60)
def test_doctor_imports_no_heavy_module() -> None:
    code = (
        "import sys, cpuddp.doctor.command as d; d.collect(); "
        "heavy = [m for m in ('torch', 'cpuinfo', 'mpi4py', 'intel_extension_for_pytorch', "
        "'oneccl_bindings_for_pytorch') if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stdout + r.stderr


def test_main_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "cpuddp-doctor/1" and "warnings" in data


def test_backends_light_by_default_and_auto_is_gloo_without_ccl() -> None:
    report = collect({})
    names = {b["name"]: b for b in report["backends"]["backends"]}
    assert {"gloo", "ccl"} <= set(names)
    assert report["backends"]["auto"]["name"] in ("gloo", "ccl")
    if "torch" not in __import__("sys").modules:
        assert names["gloo"]["available"] is None and "--torch" in names["gloo"]["reason"]
    assert "torch" not in report  # only with probe_torch=True


@pytest.mark.timeout(60)
def test_doctor_torch_flag_probes_torch() -> None:
    r = subprocess.run([sys.executable, "-m", "cpuddp", "doctor", "--json", "--torch"], cwd=REPO,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    gloo = next(b for b in data["backends"]["backends"] if b["name"] == "gloo")
    assert gloo["available"] is True
    assert data["torch"]["num_threads"] >= 1


def test_version_mismatch_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"torch": "2.13.0+cpu", "oneccl_bind_pt": "2.8.0+cpu", "intel_extension_for_pytorch": "2.8.0"}
    monkeypatch.setattr(doctor, "_dist_version", installed.get)
    report = collect({})
    assert report["versions"]["ipex_matches_torch"] is False
    assert report["versions"]["oneccl_bind_pt_matches_torch"] is False
    mism = [w for w in report["warnings"] if w["code"] == "version-mismatch"]
    assert len(mism) == 2 and "built for torch 2.8" in mism[0]["message"]
    assert "MISMATCH" in format_text(report)


@pytest.mark.timeout(120)
def test_doctor_auto_is_inits_rule_with_and_without_torch() -> None:
    """Issue 20 item 7: under a launcher with 2 ranks on this node, doctor's auto is the one
    init_distributed picks (the same function), with and without --torch, and the light path
    stays torch-free and under a second."""
    from cpuddp.backends import resolve_backend
    from cpuddp.topology.here import allowed_cpus
    from cpuddp.launchers import detect

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPUDDP_", "CCL_"))}
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29500", TORCHELASTIC_RUN_ID="x", GROUP_RANK="0")
    expected = resolve_backend("auto", detect(env), environ=env, node_cpus=len(allowed_cpus()))
    seen = []
    for extra in ([], ["--torch"]):
        r = subprocess.run([sys.executable, "-m", "cpuddp", "doctor", "--json", *extra], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=100)
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        auto = data["backends"]["auto"]
        seen.append((auto["name"], auto["inter"]))
        if not extra:
            assert data["elapsed_s"] < 1.0, data["elapsed_s"]
        assert data["pinning"]["backend"] == auto["name"]  # the pinning plan is for that backend too
    assert seen == [(expected.name, expected.inter)] * 2
    import platform

    if platform.machine() == "x86_64" and len(allowed_cpus()) >= 2:
        assert expected.name == "shm"


# --------------------------------------------------------------------------- a job of N ranks, one report


def test_from_a_shell_it_shows_what_a_job_of_n_ranks_would_get() -> None:
    """Issue 30: plain `cpuddp doctor` showed this 1-process plan (gloo, all threads), not a job's."""
    from cpuddp.affinity.job import plan_run
    from cpuddp.topology.read import read_topology

    report = collect({}, ranks=2)
    job = report["job"]
    assert job["available"] and job["plan"]["world_size"] == 2
    assert job["plan"] == plan_run(read_topology(), ranks_per_node=2, ranks_source="--ranks").as_dict()
    text = format_text(report)
    assert "A job here: the plan `cpuddp run` would use" in text and "\nPinning plan" not in text
    assert "launch it: cpuddp run --ranks-per-node 2 script.py" in text
    assert job["backend"]["name"] == report_backend_for_two()


def report_backend_for_two() -> str:
    from cpuddp.backends import registry
    from cpuddp.launchers.env import DistEnv
    from cpuddp.topology.here import allowed_cpus

    env = DistEnv(world_size=2, local_world_size=2, launcher="torchrun", agent_store=True)
    return registry.resolve_backend("auto", env, node_cpus=len(allowed_cpus()), probe_torch=False).name


def test_too_many_ranks_name_the_option_and_the_fix() -> None:
    report = collect({}, ranks=999)
    assert report["job"]["available"] is False and "--ranks 999 is more ranks" in report["job"]["error"]
    assert "--ranks" in report["job"]["fix"] and "fix: --ranks" in format_text(report)


def test_too_many_ranks_is_a_warning_and_exits_2(capsys) -> None:
    """Issue 37 #9: `doctor --ranks 4` on 2 CPUs said "not available ... fix: --ranks 2", then
    "Warnings: none", and exited 0."""
    report = collect({}, ranks=999)
    (w,) = [w for w in report["warnings"] if w["code"] == "job-plan"]
    assert "--ranks 999 is more ranks" in w["message"] and w["fix"].startswith("--ranks ")
    assert "Warnings: none" not in format_text(report)
    assert doctor.main(["--ranks", "999"]) == doctor.EXIT_REQUEST == 2  # a request that cannot be met
    listed = capsys.readouterr().out.split("\nWarnings:")[1]
    assert not listed.startswith(" none") and "--ranks 999 is more ranks" in listed, listed
    assert doctor.main(["--ranks", "1", "--json"]) == 0  # one rank always fits
    assert "job-plan" not in capsys.readouterr().out


def test_job_plan_rule() -> None:
    from cpuddp.doctor.diagnose import job_warnings

    assert job_warnings(None) == [] and job_warnings({"available": True, "ranks": 2}) == []
    (w,) = job_warnings({"available": False, "ranks": None, "error": "OMP_NUM_THREADS=23 contradicts the plan",
                         "fix": "unset it"})
    assert w == {"code": "job-plan", "message": "`cpuddp run`'s default plan cannot run here: OMP_NUM_THREADS=23 "
                 "contradicts the plan", "fix": "unset it"}


def test_the_default_job_is_cpuddp_runs_default() -> None:
    from cpuddp.affinity.job import plan_run
    from cpuddp.topology.read import read_topology

    assert collect({})["job"]["plan"]["ranks_per_node"] == plan_run(read_topology()).ranks_per_node


def test_under_a_launcher_rank_0_shows_every_local_rank_in_a_table() -> None:
    environ = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    report = collect(environ)
    assert "job" not in report
    text = format_text(report)
    assert "Pinning plan: 2 local rank(s) of this node" in text
    table = text.split("Pinning plan: 2 local rank(s) of this node")[1].splitlines()[1:4]
    assert table[0].split() == ["rank", "local", "CPUs", "threads"]
    assert [r.split()[:2] for r in table[1:]] == [["0", "0"], ["1", "1"]]


# --------------------------------------------------------------------------- one story


def _backend_lines(text: str) -> list[str]:
    return text.split("\nBackends\n")[1].split("\n\n")[0].splitlines()


@pytest.mark.parametrize("native", [None, "0"])
def test_shm_is_one_line_that_names_its_data_path(native: Optional[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`[yes] shm: ... (pure Python over torch ops; cpuddp.shm)` stood directly above `shm data
    path: native (avx2)`: one line now, naming the data path status() gives (native and its
    width, or Python and why), and the job's backend line names the same one."""
    from cpuddp.backends.shm import native as shm_native

    if native is None:
        monkeypatch.delenv("CPUDDP_SHM_NATIVE", raising=False)
    else:
        monkeypatch.setenv("CPUDDP_SHM_NATIVE", native)
    is_native, path = shm_native.status()
    report = collect({}, ranks=2)
    shm = next(b for b in report["backends"]["backends"] if b["name"] == "shm")
    assert (shm["native"], shm["data_path"]) == (is_native, path)
    text = format_text(report)
    (line,) = [x for x in _backend_lines(text) if "shm" in x and not x.lstrip().startswith("auto")]
    assert line.lstrip().startswith(("[yes] shm: ", "[no ] shm: ")) and line.endswith(f"data path {path}"), line
    assert "Python over torch ops" not in text and "shm data path" not in text
    assert ("python (CPUDDP_SHM_NATIVE=0)" == path) == (native == "0")
    if report["job"]["backend"].get("name") == "shm":
        assert f"  backend: shm, data path {path}; " in text, text


def test_ranks_n_is_one_job_throughout_the_report() -> None:
    """`doctor --ranks 2` said `auto -> gloo (... this node runs 1 rank(s) ...)` in Backends and
    `auto -> shm (... 2 local ranks ...)` in the plan below: one job of N ranks, one answer."""
    report = collect({}, ranks=2)
    auto, job = report["backends"]["auto"], report["job"]["backend"]
    assert report["view"] == "job" and auto == job and auto["name"] == report_backend_for_two()
    assert auto["for"] == "a job of 2 rank(s) on this node"
    text = format_text(report)
    assert "this node runs 1 rank(s)" not in text, text
    assert f"  auto for a job of 2 rank(s) on this node -> {auto['name']} (" in text, text
    assert f"  backend: {auto['name']}" in text.split("A job here")[1]
    assert text.count(auto["reason"]) == 1  # said once, in Backends


def test_ranks_that_cannot_run_here_still_get_autos_answer_for_that_many() -> None:
    report = collect({}, ranks=999)
    assert report["job"]["available"] is False
    auto = report["backends"]["auto"]
    assert auto["for"] == "a job of 999 rank(s) on this node" and auto["name"] != "shm", auto


def test_under_a_launcher_auto_is_for_the_launchers_job_and_the_plan_names_its_data_path() -> None:
    environ = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    report = collect(environ)
    auto = report["backends"]["auto"]
    assert report["view"] == "launcher" and auto["for"] == "this job (2 rank(s) on this node, 1 node(s))"
    assert report["pinning"]["backend"] == auto["name"]
    head = next(x for x in format_text(report).splitlines() if x.startswith("Pinning plan"))
    shm = next(b for b in report["backends"]["backends"] if b["name"] == "shm")
    want = f"shm, data path {shm['data_path']}" if auto["name"] == "shm" else auto["name"]
    assert head.endswith(f", backend {want}"), head
