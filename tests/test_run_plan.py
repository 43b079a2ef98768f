"""``cpuddp run``'s pure parts: the plan on synthetic machines, the launch commands, the settings,
the refusals, and ``--dry-run`` (fast, no torch).  No processes except the dry-run ones."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpuddp.affinity import plan_for
from cpuddp.launchers.env import DistEnv
from cpuddp.run.settings import find_allocator, openmp_runtime, settings_env
from cpuddp.run.hosts import HostEntry, parse_hostfile, parse_hosts_option, ranks_from_slots
from cpuddp.run.launch import command_text, mpi_command, mpi_family, srun_command, torchrun_command
from cpuddp.affinity.job import RunPlanError, plan_run, plan_table
from cpuddp.topology import format_cpulist, synthetic_topology

ROOT = Path(__file__).resolve().parents[1]

SPR_LIKE = synthetic_topology(2, 28, 2)  # 2 sockets x 28 cores, SMT: CPUs 0-55 first threads, 56-111 siblings
FOUR_NUMA = synthetic_topology(2, 28, 2, numa_per_socket=2)
UNEVEN = synthetic_topology(2, [10, 6])
ONE_CORE = synthetic_topology(1, 1)


def cpus(plan) -> list[str]:
    return [format_cpulist(s.cpus) for s in plan.slots]


# --------------------------------------------------------------------------- the plan


def test_two_sockets_smt_one_rank_per_socket() -> None:
    p = plan_run(SPR_LIKE)
    assert (p.ranks_per_node, cpus(p), [s.threads for s in p.slots]) == (2, ["0-27", "28-55"], [28, 28])
    assert "one rank per NUMA node (2)" in p.reason and not p.warnings


def test_two_sockets_four_ranks_stay_inside_sockets() -> None:
    p = plan_run(SPR_LIKE, ranks_per_node=4)
    assert cpus(p) == ["0-13", "14-27", "28-41", "42-55"] and p.threads == 14


def test_cores_per_rank() -> None:
    p = plan_run(SPR_LIKE, cores_per_rank=7)
    assert p.ranks_per_node == 8 and {s.cores for s in p.slots} == {7} and p.threads == 7
    assert cpus(p)[:2] == ["0-6", "7-13"]


def test_four_numa_nodes() -> None:
    p = plan_run(FOUR_NUMA)
    assert (p.ranks_per_node, cpus(p), p.threads) == (4, ["0-13", "14-27", "28-41", "42-55"], 14)


def test_uneven_numa_gives_each_rank_its_node_and_warns() -> None:
    p = plan_run(UNEVEN)
    assert (cpus(p), [s.threads for s in p.slots]) == (["0-9", "10-15"], [10, 6])
    assert any("unequal" in w for w in p.warnings), p.warnings
    # --cores-per-rank 4 does not divide 16 cores by NUMA node: blocks of 4, the straddler named.
    q = plan_run(UNEVEN, cores_per_rank=4)
    assert cpus(q) == ["0-3", "4-7", "8-11", "12-15"] and q.threads == 4
    assert any("local rank(s) 2 span two NUMA nodes" in w for w in q.warnings), q.warnings


def test_six_cpu_cpuset() -> None:
    """A cgroup cpuset of 6 logical CPUs = 3 cores with their siblings: one NUMA node, 3 threads."""
    topo = dataclasses.replace(SPR_LIKE, cgroup_cpus=frozenset({0, 1, 2, 56, 57, 58}))
    p = plan_run(topo)
    assert (p.ranks_per_node, cpus(p), p.threads) == (1, ["0-2"], 3)
    assert "usable CPUs 0-2,56-58" in p.reason
    with pytest.raises(RunPlanError, match=r"--ranks-per-node 4 is more ranks than the node's 3 usable physical cores"):
        plan_run(topo, ranks_per_node=4)


def test_one_core() -> None:
    p = plan_run(ONE_CORE)
    assert (p.ranks_per_node, cpus(p), p.threads) == (1, ["0"], 1)
    with pytest.raises(RunPlanError) as err:
        plan_run(ONE_CORE, ranks_per_node=2)
    assert "Fix: --ranks-per-node 1 or fewer" in str(err.value)


def test_cgroup_quota_caps_threads() -> None:
    p = plan_run(synthetic_topology(1, 8, quota=4.0), ranks_per_node=2)
    assert [s.threads for s in p.slots] == [2, 2] and "cgroup quota 4 CPUs" in p.reason


def test_slurm_cpus_per_task_sets_the_rank_count() -> None:
    topo = dataclasses.replace(synthetic_topology(1, 8), source="synthetic-slurm")
    p = plan_run(topo, nodes=2, slurm_cpus_per_task=4, cpus_known=False)
    assert (p.ranks_per_node, p.world_size, p.cpus_per_rank) == (2, 4, 4)
    assert "SLURM_CPUS_PER_TASK=4" in p.reason
    with pytest.raises(RunPlanError, match="SLURM_CPUS_PER_TASK=16"):
        plan_run(topo, slurm_cpus_per_task=16)


@pytest.mark.parametrize("kwargs, match, fix", [
    ({"cores_per_rank": 5}, r"--cores-per-rank 5 does not divide the node's 56 usable physical cores", "one of 1, 2, 4, 7, 8, 14, 28, 56"),
    ({"cores_per_rank": 64}, r"--cores-per-rank 64 is more than", "--cores-per-rank 56 or fewer"),
    ({"ranks_per_node": 0}, r"--ranks-per-node 0: must be at least 1", "--ranks-per-node 1 or more"),
    ({"ranks_per_node": 2, "cores_per_rank": 2}, r"both given", "give one of them"),
    ({"omp_num_threads": "23"}, r"OMP_NUM_THREADS=23 contradicts the plan: 2 rank\(s\) per node with 28 thread", "unset OMP_NUM_THREADS"),
])
def test_bad_requests_name_the_value_and_the_fix(kwargs, match, fix) -> None:
    with pytest.raises(RunPlanError, match=match) as err:
        plan_run(SPR_LIKE, **kwargs)
    assert fix in err.value.fix


def test_omp_num_threads_that_agrees_is_accepted() -> None:
    assert plan_run(SPR_LIKE, omp_num_threads="28").threads == 28


def test_table() -> None:
    text = plan_table(plan_run(SPR_LIKE), ["a"])
    assert text.splitlines()[1:] == ["node  rank  local  CPUs   threads", "a     0     0      0-27   28",
                                     "a     1     1      28-55  28"]


# --------------------------------------------------------------------------- the hand-over


def test_plan_for_follows_cpuddp_run_plan() -> None:
    """CPUDDP_RANK_CPUS wins over the in-rank split: here the reverse of what the split gives."""
    topo = synthetic_topology(1, 4)
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher="torchrun")
    p = plan_for(env, environ={"CPUDDP_RANK_CPUS": "2-3;0-1"}, topology=topo)
    assert p.cpus == (2, 3) and "cpuddp run's plan" in p.reason
    assert plan_for(env, environ={}, topology=topo).cpus == (0, 1)
    # A list for another world size is ignored (with a warning), not half-applied.
    assert plan_for(env, environ={"CPUDDP_RANK_CPUS": "0-3"}, topology=topo).cpus == (0, 1)


# --------------------------------------------------------------------------- the launch


def test_torchrun_command() -> None:
    plan = plan_run(SPR_LIKE)
    launch = torchrun_command(plan, "train.py", ["--lr", "1"], max_restarts=2, python="py")
    assert launch.argv == ("py", "-m", "cpuddp.run.agent", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "2", "--module", "cpuddp.run.rank", "train.py", "--lr", "1")
    assert launch.env["CPUDDP_RANK_CPUS"] == "0-27;28-55" and launch.env["CPUDDP_RANK_THREADS"] == "28;28"
    assert launch.env["OMP_NUM_THREADS"] == "28"  # torchrun then keeps it instead of forcing 1


def test_srun_command() -> None:
    plan = plan_run(SPR_LIKE, nodes=2)
    launch = srun_command(plan, "train.py", [], threads_per_core=2, python="py")
    assert launch.argv == ("srun", "--nodes=2", "--ntasks-per-node=2", "--ntasks=4", "--cpus-per-task=56",
                           "--cpu-bind=cores", "py", "-m", "cpuddp.run.rank", "train.py")
    assert launch.env == {"OMP_NUM_THREADS": "28"}


def test_mpi_commands() -> None:
    plan = plan_run(SPR_LIKE, nodes=2, hosts=("a", "b"))
    mpich = mpi_command("mpich", "mpiexec", plan, ["a", "b"], "t.py", [], python="py").argv
    assert mpich == ("mpiexec", "-n", "4", "-ppn", "2", "-hosts", "a,b", "-bind-to", "core:28",
                     "-genv", "OMP_NUM_THREADS", "28", "-genv", "MASTER_ADDR", "a", "py", "-m", "cpuddp.run.rank", "t.py")
    impi = mpi_command("impi", "mpiexec", plan, ["a", "b"], "t.py", [], threads_per_core=2, python="py").argv
    assert impi[:7] == ("mpiexec", "-n", "4", "-ppn", "2", "-hosts", "a,b")
    assert ("-genv", "I_MPI_PIN_DOMAIN", "56:compact") == impi[13:16]
    ompi = mpi_command("openmpi", "mpirun", plan, ["a", "b"], "t.py", [], python="py").argv
    assert ompi == ("mpirun", "-np", "4", "--map-by", "ppr:2:node:PE=28", "--bind-to", "core", "--host", "a:2,b:2",
                    "-x", "OMP_NUM_THREADS=28", "-x", "MASTER_ADDR=a", "py", "-m", "cpuddp.run.rank", "t.py")


@pytest.mark.parametrize("text, family", [
    ("HYDRA build details:\n    Version:                                 4.3.0", "mpich"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.14", "impi"),
    ("mpirun (Open MPI) 5.0.6\n\nReport bugs to https://www.open-mpi.org/community/help/", "openmpi"),
    ("something else", None),
])
def test_mpi_family(text, family) -> None:
    assert mpi_family(text) == family


def test_hostfile() -> None:
    assert parse_hostfile("# nodes\nn1 slots=2\nn2:4\n\nn1\n") == [HostEntry("n1", 2), HostEntry("n2", 4)]
    with pytest.raises(RunPlanError, match="lists no hosts"):
        parse_hostfile("# empty\n")


def test_hostfile_ipv6() -> None:
    """Issue 30: these three lines were read as hosts `fd00`, `[fd00` and `fe80`."""
    text = "fd00::2\n[fd00::3]:2\nfe80::1%eth0\n[fe80::2%eth1]:3 # link-local, bracketed\nfd00::4 slots=2 max_slots=4\n"
    assert parse_hostfile(text) == [HostEntry("fd00::2"), HostEntry("fd00::3", 2), HostEntry("fe80::1%eth0"),
                                    HostEntry("fe80::2%eth1", 3), HostEntry("fd00::4", 2)]
    assert parse_hosts_option("n1:2,[fd00::3]:2") == [HostEntry("n1", 2), HostEntry("fd00::3", 2)]


@pytest.mark.parametrize("text, match, fix", [
    ("[fd00::3:2\n", r"line 2: '\[fd00::3:2' is not `\[IPv6 address\]`", "[fd00::3]:2"),
    ("[node1]:2\n", r"'node1' in brackets is not an IPv6 address", "node1:2"),
    ("fd00::3:x\n", r"'fd00::3:x' is neither a host name nor an IPv6 address", "[fd00::3]:2"),
    ("n1:0\n", r"slot count '0' is not a whole number of 1 or more", "node1:2"),
    ("n1:two\n", r"slot count 'two'", "node1:2"),
    ("n1 cpus=2\n", r"'cpus=2' in 'n1 cpus=2' is not understood", "node1 slots=2"),
    (":2\n", r"':2' names no host", "node1:2"),
])
def test_hostfile_refusals_name_the_line_and_the_fix(text, match, fix) -> None:
    with pytest.raises(RunPlanError, match=match) as err:
        parse_hostfile("n0\n" + text)
    assert "line 2" in str(err.value) and fix in err.value.fix


def test_slot_counts_set_the_ranks_per_node_or_are_refused() -> None:
    two = [HostEntry("a", 2), HostEntry("b", 2)]
    assert ranks_from_slots(two, None, "--hostfile h") == 2
    assert ranks_from_slots(two, 2, "--hostfile h") == 2
    assert ranks_from_slots([HostEntry("a"), HostEntry("b")], 3, "--hostfile h") == 3
    with pytest.raises(RunPlanError, match=r"different slot counts \(a:2, b:4\)"):
        ranks_from_slots([HostEntry("a", 2), HostEntry("b", 4)], None, "--hostfile h")
    with pytest.raises(RunPlanError, match=r"slot counts for some hosts \(a:2\) but not for b"):
        ranks_from_slots([HostEntry("a", 2), HostEntry("b")], None, "--hostfile h")
    with pytest.raises(RunPlanError, match=r"--ranks-per-node 1 contradicts --hostfile h's 2 slot"):
        ranks_from_slots(two, 1, "--hostfile h")


def test_mpi_refuses_an_ipv6_host_it_cannot_parse() -> None:
    plan = plan_run(SPR_LIKE, nodes=2, hosts=("fd00::2", "fd00::3"))
    for family in ("mpich", "impi", "openmpi"):
        with pytest.raises(RunPlanError, match=r"host fd00::2 is an IPv6 address: .* reads `host:slots`") as err:
            mpi_command(family, "mpiexec", plan, ["fd00::2", "fd00::3"], "t.py", [], python="py")
        assert "by name" in err.value.fix


def test_unknown_and_unreachable_hosts() -> None:
    from cpuddp.run.command import check_hosts

    def resolve(host, port):
        if host == "nosuch":
            raise OSError("Name or service not known")
        return [(0, 0, 0, "", ("10.1.2.3", 0))]

    def refuse(addr, timeout):
        raise ConnectionRefusedError("Connection refused")

    with pytest.raises(RunPlanError, match=r"host 'nosuch' \(--hosts/--hostfile\) is unknown"):
        check_hosts(["nosuch"], resolve=resolve)
    with pytest.raises(RunPlanError, match=r"host 'n9' \(10.1.2.3\) is unreachable: no answer on port 22") as err:
        check_hosts(["n9"], resolve=resolve, connect=refuse)
    assert "--no-host-check" in err.value.fix
    check_hosts(["localhost"])  # this machine: never probed


# --------------------------------------------------------------------------- settings


def test_settings() -> None:
    env, notes = settings_env("auto", "on", {"OMP_PLACES": "threads"}, allocator_path="/usr/lib/libjemalloc.so.2",
                              runtime="gnu")
    assert env["LD_PRELOAD"] == "/usr/lib/libjemalloc.so.2" and "MALLOC_CONF" in env
    assert env["OMP_PROC_BIND"] == "close" and "OMP_PLACES" not in env  # the user's value is kept
    assert any("keeping the user's OMP_PLACES=threads" in n for n in notes)
    env, _ = settings_env("none", "on", {}, allocator_path=None, runtime="intel")
    assert env == {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}
    with pytest.raises(RunPlanError, match="--allocator tcmalloc: no libtcmalloc_minimal.so.4") as err:
        settings_env("tcmalloc", "off", {}, allocator_path=None, runtime="gnu")
    assert "libtcmalloc-minimal4" in err.value.fix


def test_find_allocator_and_runtime() -> None:
    assert find_allocator("jemalloc", {}, exists=lambda p: p == "/usr/lib64/libjemalloc.so.2") == "/usr/lib64/libjemalloc.so.2"
    assert find_allocator("auto", {}, exists=lambda p: p.endswith("libtcmalloc_minimal.so.4")).endswith("minimal.so.4")
    assert find_allocator("auto", {}, exists=lambda p: "jemalloc" in p) is None  # measured no gain: only by name
    assert find_allocator("auto", {}, exists=lambda p: False) is None
    assert openmp_runtime(["libc10.so", "libgomp.so.1"]) == "gnu"
    assert openmp_runtime(["libiomp5.so", "libtorch.so"]) == "intel"


# --------------------------------------------------------------------------- the command line


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMP_", "CPUDDP_"))}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "cpuddp", "run", *args], capture_output=True, text=True,
                          timeout=60, env=full, cwd=ROOT)


def test_dry_run_is_fast_and_imports_no_torch() -> None:
    t0 = time.perf_counter()
    res = _cli("--dry-run", "examples/finetune.py", "--steps", "5")
    took = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr
    assert "cpuddp.run.agent" in res.stdout and "--steps 5" in res.stdout and "threads" in res.stdout
    assert took < 3.0, f"--dry-run took {took:.2f} s"  # about 0.3 s here; slack for a loaded machine
    imp = subprocess.run([sys.executable, "-X", "importtime", "-m", "cpuddp", "run", "--dry-run", "examples/finetune.py"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    imported = {line.split("|")[-1].strip() for line in imp.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if re.match(r"(torch|numpy)(\.|$)", m)}, "cpuddp run --dry-run imported torch/numpy"


def test_cli_refuses_before_starting() -> None:
    res = _cli("--ranks-per-node", "999", "examples/finetune.py")
    assert res.returncode == 2 and "--ranks-per-node 999 is more ranks" in res.stderr and "Fix:" in res.stderr
    res = _cli("--dry-run", "--hosts", "localhost", "--launcher", "/nonexistent/mpiexec", "examples/finetune.py")
    assert res.returncode == 2 and "'/nonexistent/mpiexec' is not an executable file" in res.stderr
    res = _cli("--dry-run", "--hosts", "localhost", "examples/finetune.py", env={"PATH": "/nonexistent"})
    assert res.returncode == 2 and "none is installed" in res.stderr and "pip install mpich" in res.stderr
    res = _cli("--dry-run", "examples/finetune.py", env={"OMP_NUM_THREADS": "23"})
    assert res.returncode == 2 and "OMP_NUM_THREADS=23 contradicts the plan" in res.stderr


def test_cli_refuses_a_script_that_is_not_there_dry_run_too(tmp_path) -> None:
    """Issue 37 #9: `cpuddp run --dry-run nosuch.py` printed a plan for a script that does not exist."""
    for flags in (["--dry-run"], []):
        res = _cli(*flags, "nosuch.py", "--lr", "1")
        assert res.returncode == 2 and res.stdout == "", res.stdout  # no plan, no command
        assert f"script 'nosuch.py' does not exist (looked for {ROOT / 'nosuch.py'})" in res.stderr, res.stderr
        assert "Fix: the path of your training script" in res.stderr, res.stderr
    res = _cli("--dry-run", str(tmp_path))
    assert res.returncode == 2 and f"script {str(tmp_path)!r} is a directory" in res.stderr, res.stderr


def test_cli_in_a_slurm_allocation_from_a_login_node() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "4(x2)", "PATH": os.environ["PATH"]}
    res = _cli("--dry-run", "examples/finetune.py", env=env)
    if res.returncode == 2 and "srun is not on PATH" in res.stderr:
        pytest.skip("no srun here: " + res.stderr)
    assert res.returncode == 0, res.stderr
    assert "--nodes=2 --ntasks-per-node=1 --ntasks=2 --cpus-per-task=4 --cpu-bind=cores" in res.stdout


# --------------------------------------------------------------------------- docs/run.md's examples


def doc_launches():
    """The launches behind docs/run.md's worked examples: ``(flags, host name, plan, launch)``,
    the four one-node plans, then the two-node plan under srun and each MPI."""
    spr = synthetic_topology(2, 56, 2)  # 2 x 56-core Sapphire Rapids, SMT on, SNC off
    epyc = synthetic_topology(2, 64, 2, numa_per_socket=4)  # 2 x 64-core EPYC, NPS4: 8 NUMA nodes
    out = []
    for name, topo, kwargs, flags in [
        ("spr", spr, {}, ""),
        ("spr", spr, {"ranks_per_node": 4}, "--ranks-per-node 4 "),
        ("epyc", epyc, {}, ""),
        ("epyc", epyc, {"ranks_per_node": 2}, "--ranks-per-node 2 "),
    ]:
        plan = plan_run(topo, **kwargs)
        out.append((flags, name, plan, torchrun_command(plan, "train.py", [], python="python")))
    two = plan_run(epyc, nodes=2, hosts=("epyc1", "epyc2"))
    out.append(("", None, two, srun_command(two, "train.py", [], threads_per_core=2, python="python")))
    for family, exe in (("impi", "mpiexec"), ("mpich", "mpiexec"), ("openmpi", "mpirun")):
        out.append(("", None, two, mpi_command(family, exe, two, ["epyc1", "epyc2"], "train.py", [],
                                               threads_per_core=2, python="python")))
    return out


def doc_examples() -> list[str]:
    """The worked examples of docs/run.md, generated from the planner (the test below checks
    that the document holds each one verbatim; print them with
    ``python -c "import sys; sys.path.insert(0, 'tests'); import test_run_plan as t; print(*t.doc_examples(), sep='\\n\\n')"``)."""
    launches = doc_launches()
    blocks = [f"$ cpuddp run --dry-run {flags}train.py\n{plan_table(plan, [name])}\n# engine: torchrun\n"
              f"{command_text(launch)}" for flags, name, plan, launch in launches[:4]]
    blocks.append("\n".join(command_text(launch) for *_, launch in launches[4:]))
    return blocks


def test_docs_worked_examples_come_from_the_planner() -> None:
    text = (ROOT / "docs" / "run.md").read_text()
    for block in doc_examples():
        assert block in text, f"docs/run.md lacks this block (regenerate it):\n{block}"


_STUB = """#!/bin/sh
{ printf '%s\\0' "$(basename "$0")" "$@"; } > "$STUB_OUT"
env -0 > "$STUB_OUT.env"
"""


def _shell_runs(line: str, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """What the program gets when bash runs ``line``: its argv and environment (the programs
    on PATH are stubs that record them)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "srun", "mpiexec", "mpirun"):
        (bin_dir / name).write_text(_STUB)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "argv"
    res = subprocess.run(["bash", "-c", line], env={"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_OUT": str(out)},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"bash could not run {line!r}: rc {res.returncode}, {res.stderr}"
    argv = out.read_bytes().decode().split("\0")[:-1]
    env = dict(item.split("=", 1) for item in (tmp_path / "argv.env").read_bytes().decode().split("\0") if item)
    return argv, env


def test_every_command_in_docs_run_md_runs_in_a_shell_as_printed(tmp_path) -> None:
    """Issue 30: `'CPUDDP_RANK_CPUS=0;1' torchrun ...` pasted into bash was `command not found`.
    Each command docs/run.md shows, run by bash, starts its program with exactly the argv and
    the variables the launch holds."""
    text = (ROOT / "docs" / "run.md").read_text()
    for *_, launch in doc_launches():
        line = command_text(launch)
        assert line in text
        argv, env = _shell_runs(line, tmp_path)
        assert argv == list(launch.argv), line
        assert {k: env.get(k) for k in launch.env} == dict(launch.env), line


@pytest.mark.parametrize("value", ["0;1", "a b", "it's", "$HOME", "0-3,8-11;4-7", ""])
def test_command_text_quotes_values_not_assignments(value, tmp_path) -> None:
    from cpuddp.run.launch import Launch

    launch = Launch("torchrun", ("python", "-m", "x", "arg with space"), {"CPUDDP_RANK_CPUS": value})
    line = command_text(launch)
    assert line.startswith("CPUDDP_RANK_CPUS=")
    argv, env = _shell_runs(line, tmp_path)
    assert argv == list(launch.argv) and env["CPUDDP_RANK_CPUS"] == value


def test_cli_hostfile_slots_set_the_ranks_per_node(tmp_path) -> None:
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.3.0'\n")
    fake.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:1\n")
    res = _cli("--dry-run", "--no-host-check", "--hostfile", str(hostfile), "--launcher", str(fake), "examples/finetune.py")
    assert res.returncode == 0, res.stderr
    assert "--ranks-per-node" not in res.stdout and "1 rank(s): 1 node(s) x 1" in res.stdout
    assert " -n 1 -ppn 1 -hosts localhost " in res.stdout
    hostfile.write_text("fd00::2\n[fd00::3]:2\n")
    res = _cli("--dry-run", "--no-host-check", "--hostfile", str(hostfile), "--launcher", str(fake), "examples/finetune.py")
    assert res.returncode == 2 and "gives slot counts for some hosts (fd00::3:2) but not for fd00::2" in res.stderr


@pytest.mark.parametrize("name, ours", [("--nproc-per-node", "--ranks-per-node N"), ("--nproc_per_node", "--ranks-per-node N"),
                                        ("--nnodes", "--hosts H1,H2")])
def test_torchruns_option_names_point_to_ours_not_unrecognized(name, ours) -> None:
    """``cpuddp run --nproc-per-node 2`` used to get only "unrecognized arguments" (issue 46)."""
    res = _cli(name, "2", "--dry-run", "examples/finetune.py")
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{name} is torchrun's option" in res.stderr and ours in res.stderr, res.stderr
    assert "unrecognized" not in res.stderr
    after = _cli("--dry-run", "examples/finetune.py", name, "2")  # the script's own arguments are its own
    assert after.returncode == 0 and f"finetune.py {name} 2" in after.stdout, after.stderr
