"""cpuddp.testing.run_distributed: results, every failure mode, and no orphan processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types

import psutil
import pytest

from cpuddp.errors import RankFailedError
from cpuddp.testing.plugin import _marker_options
from cpuddp.testing.world import _trim_stack, clean_environ, run_distributed

#: How long a rank that simulates a hang sleeps: far past every timeout here, so the
#: harness (and pytest-timeout) must end it; it never ends a test by itself.
SIMULATED_HANG = 120

# --------------------------------------------------------------------------- helpers


def _multiprocessing_helper(cmdline: list[str]) -> bool:
    """multiprocessing's resource tracker or fork server (run_distributed starts ranks from it)."""
    line = " ".join(cmdline)
    return "resource_tracker" in line or "multiprocessing.forkserver" in line


def _descendants() -> set[int]:
    """Live descendants of this process, minus multiprocessing's resource tracker and fork server
    (one each per process that ever started ranks, by design; they exit with us)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or _multiprocessing_helper(p.cmdline()):
                continue
        except psutil.Error:
            continue
        out.add(p.pid)
    return out


@pytest.fixture
def no_orphans():
    """Fail the test if it leaves a process of its own behind."""
    before = _descendants()
    yield
    left = _descendants() - before
    assert not left, f"processes left behind: {[(p, psutil.Process(p).cmdline()) for p in left]}"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped by init
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- rank functions (module level: pickled by name)


def _probe(scale, *, offset=0):
    import torch
    import torch.distributed as dist

    import cpuddp

    env = cpuddp.get_env()
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    leaked = sorted(k for k in os.environ if k.startswith(("SLURM_", "PMI_", "OMPI_")))
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t * scale + offset,  # a tensor: must come back by value
        "launcher": env.launcher,
        "leaked": leaked,
        "extra": os.environ.get("CPUDDP_EXTRA"),
        "threads": torch.get_num_threads(),
    }


def _raise_on_1(peer: str, pid_file: str):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({SIMULATED_HANG})"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        raise ValueError("rank one exploded")
    if peer == "collective":
        dist.all_reduce(torch.ones(1))  # blocked with the rank that raised
    time.sleep(SIMULATED_HANG)


def _die_on_1(how: str):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(7)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segv":
            import ctypes

            ctypes.string_at(0)
    time.sleep(SIMULATED_HANG)


def _world():
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size())


# --------------------------------------------------------------------------- results


@pytest.mark.timeout(180)
def test_results_in_rank_order_with_a_clean_environment(monkeypatch, no_orphans):
    import torch

    # launcher variables of the test process (as under srun or mpirun) must not reach the ranks
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("RANK", "7")
    for _ in range(2):  # back to back
        out = run_distributed(_probe, 2, args=(2.0,), kwargs={"offset": 1}, env={"CPUDDP_EXTRA": "x"}, timeout=120)
        assert [r["rank"] for r in out] == [0, 1]
        for r in out:
            assert r["world"] == 2 and r["launcher"] == "env" and r["leaked"] == []
            assert r["extra"] == "x" and r["threads"] == 1
            assert torch.equal(r["sum"], torch.full((3,), 7.0))  # (1 + 2) * 2 + 1
    assert os.environ["RANK"] == "7"  # the caller's environment is untouched


@pytest.mark.timeout(60)
@pytest.mark.distributed(world_size=1, timeout=45)
def test_marker_sets_the_fixture_defaults(run_distributed, no_orphans):
    assert run_distributed(_world) == [(0, 1)]


# --------------------------------------------------------------------------- a rank raises


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer", ["collective", "sleeping"])
def test_a_raising_rank_fails_fast_and_the_others_are_stopped(peer, tmp_path, no_orphans):
    pid_file = tmp_path / "grandchild.pid"
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_distributed(_raise_on_1, 2, args=(peer, str(pid_file)), timeout=90)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    assert str(err).startswith("rank 1 of 2 raised: ValueError: rank one exploded")
    assert 'in _raise_on_1\n    raise ValueError("rank one exploded")' in err.traceback
    assert "rank_main" not in err.traceback  # the traceback starts at fn
    if peer == "sleeping":
        assert "stopped: rank 0 (still running)" in str(err)
    assert elapsed < 45, f"took {elapsed:.1f} s: not fail-fast (timeout was 90 s)"
    assert _gone(int(pid_file.read_text()))  # what the failed rank started is stopped with it


# --------------------------------------------------------------------------- a rank dies without a word


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how, expected",
    [("exit", "exited with code 7"), ("sigkill", "was killed by signal 9 (SIGKILL)"), ("segv", "was killed by signal 11 (SIGSEGV)")],
)
def test_a_dead_rank_is_reported_with_its_exit_code_or_signal(how, expected, no_orphans):
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_distributed(_die_on_1, 2, args=(how,), timeout=90)
    err = info.value
    assert err.rank == 1
    assert str(err).startswith(f"rank 1 of 2 {expected} before reporting a result")
    if how == "segv":  # faulthandler's stack of the crash, down to fn
        assert "in _die_on_1" in err.traceback and "Segmentation fault" in err.traceback
    assert time.monotonic() - start < 45


# --------------------------------------------------------------------------- a rank hangs
# (tests/test_plugin.py: a hang ends at the marker's timeout with each rank's stack, no orphans)


# --------------------------------------------------------------------------- fn cannot reach the ranks


@pytest.mark.timeout(30)
def test_an_unpicklable_fn_fails_before_anything_starts(no_orphans):
    with pytest.raises(TypeError, match="cannot pickle fn .*module level"):
        run_distributed(lambda: 1, 2)


@pytest.mark.timeout(60)
def test_a_fn_the_ranks_cannot_import_is_reported_with_a_fix(monkeypatch, no_orphans):
    ghost = types.ModuleType("cpuddp_ghost_module")
    exec("def f():\n    return 1\n", ghost.__dict__)
    monkeypatch.setitem(sys.modules, "cpuddp_ghost_module", ghost)
    with pytest.raises(RankFailedError) as info:
        run_distributed(ghost.f, 2, timeout=45)
    assert "could not load fn: ModuleNotFoundError: No module named 'cpuddp_ghost_module'" in str(info.value)
    assert "define fn" in info.value.fix


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"world_size": 0}, ValueError, "world_size must be an int >= 1"),
        ({"world_size": True}, ValueError, "world_size"),
        ({"timeout": 0}, ValueError, "timeout must be a positive"),
        ({"threads": 0}, ValueError, "threads must be"),
        ({"env": {"MASTER_PORT": "1"}}, ValueError, r"env= may not set \['MASTER_PORT'\]"),
        ({"env": {"X": 1}}, TypeError, "env= must map str to str"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match, no_orphans):
    with pytest.raises(error, match=match):
        run_distributed(_world, **kwargs)


# --------------------------------------------------------------------------- pure helpers


def test_clean_environ_drops_every_launchers_variables():
    environ = {
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1",
        "PMI_RANK": "0", "PMIX_RANK": "0", "OMPI_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_RANK": "0",
        "SLURM_PROCID": "0", "MPI_LOCALRANKID": "0", "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0",
        "MPIRUN_ID": "5", "I_MPI_HYDRA_UUID": "u", "CCL_WORKER_COUNT": "2", "GLOO_SOCKET_IFNAME": "eth0",
        "PATH": "/bin", "OMP_NUM_THREADS": "4", "I_MPI_PIN": "1", "CPUDDP_LOG_LEVEL": "INFO",
    }
    assert clean_environ(environ) == {"PATH": "/bin", "OMP_NUM_THREADS": "4", "I_MPI_PIN": "1", "CPUDDP_LOG_LEVEL": "INFO"}
    # launchers.clean_environ keeps the backend settings unless asked: one function, the difference named
    from cpuddp.launchers import registry as launchers

    kept = launchers.clean_environ(environ)
    assert kept["CCL_WORKER_COUNT"] == "2" and kept["GLOO_SOCKET_IFNAME"] == "eth0" and "RANK" not in kept
    assert launchers.clean_environ(environ, strip_backend_settings=True) == clean_environ(environ)


class _Node:
    def __init__(self, mark):
        self._mark = mark

    def get_closest_marker(self, name):
        return self._mark if name == "distributed" else None


@pytest.mark.parametrize(
    "mark, expected",
    [
        (None, {}),
        (pytest.mark.distributed(3).mark, {"world_size": 3}),
        (pytest.mark.distributed(world_size=3, timeout=30).mark, {"world_size": 3, "timeout": 30}),
        (pytest.mark.distributed(backend="gloo", threads=2).mark, {"backend": "gloo", "threads": 2}),
    ],
)
def test_marker_options(mark, expected):
    assert _marker_options(_Node(mark)) == expected


@pytest.mark.parametrize(
    "mark, match",
    [
        (pytest.mark.distributed(2, 3).mark, "at most one positional"),
        (pytest.mark.distributed(2, world_size=3).mark, "both by position and by name"),
        (pytest.mark.distributed(worldsize=3).mark, r"unknown option\(s\) \['worldsize'\]"),
    ],
)
def test_marker_mistakes_are_named(mark, match):
    with pytest.raises(TypeError, match=match):
        _marker_options(_Node(mark))


def test_stacks_stop_at_fn():
    import cpuddp.testing.rank as t

    dump = (
        "Current thread 0x1 (most recent call first):\n"
        '  File "/x/test_a.py", line 3 in _stuck\n'
        f'  File "{t.__file__}", line 9 in rank_main\n'
        '  File "/py/multiprocessing/process.py", line 108 in run\n'
        '  File "<string>", line 1 in <module>\n'
        "\n"
        "Thread 0x2 (most recent call first):\n"
        '  File "/py/threading.py", line 1 in wait\n'
    )
    assert _trim_stack(dump) == (
        "Current thread 0x1 (most recent call first):\n"
        '  File "/x/test_a.py", line 3 in _stuck\n'
        "\n"
        "Thread 0x2 (most recent call first):\n"
        '  File "/py/threading.py", line 1 in wait'
    )
