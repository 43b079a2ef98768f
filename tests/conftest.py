"""Test hygiene for cpuddp's own suite: no test may leak environment variables or a process group;
and, under pytest-xdist (README's command runs ``-n 2``, pyproject's ``addopts``), the tests that must
have the machine to themselves get it."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile

import pytest

#: Tests that run alone while the suite runs on several xdist workers: no other test runs beside
#: them.  Each entry is a node id prefix (a file, or a file's test); each bound is a reason:
#:
#: * a time bound on what a loaded machine slows (a dead peer named within seconds, a flood won
#:   in time, a command's start-up under 1-3 s), or a wait that a second worker's load stretches
#:   past the rank's own liveness checks;
#: * state the whole machine shares (new files in /dev/shm, the one Slurm cluster, the second
#:   user's account the attack tests create).
EXCLUSIVE = (
    # dead peers within 0.1-5 s, mismatches named within 5 s, the second user, /dev/shm before/after
    "tests/test_shm_faults.py::test_every_mismatched_call_is_an_error_on_every_rank_naming_both_calls",
    "tests/test_shm_faults.py::test_a_call_one_rank_refuses_never_happened_and_the_next_one_mismatches",
    "tests/test_shm_faults.py::test_a_peer_that_left_the_group_and_lives_on_is_an_error_in_seconds",
    "tests/test_shm_faults.py::test_a_peer_in_another_pid_namespace_that_dies_is_an_error_in_seconds",
    "tests/test_shm_faults.py::test_a_rank_that_dies_while_the_segment_is_handed_over_is_an_error_in_seconds",
    "tests/test_shm_faults.py::test_a_peer_slow_to_map_the_segment_is_waited_for_not_called_dead",
    "tests/test_shm_faults.py::test_another_local_user_can_make_a_job_fail_but_never_read_or_change_its_data",
    "tests/test_shm_faults.py::test_a_peer_dying_while_work_is_queued_errors_without_a_hang",
    "tests/test_shm_faults.py::test_shutdown_with_work_in_flight_finishes_it_first",
    "tests/test_shm_flood.py",  # a flood the group must outlast within its timeout
    "tests/test_shm_lifecycle.py",  # a dead rank seen "at once" (< 1-2 s)
    # the pid check within 5 s, a sleeping wait's CPU share, /dev/shm before/after
    "tests/test_shm.py::test_a_dead_peer_ends_the_waiting_rank_at_once",
    "tests/test_shm.py::test_a_stuck_peer_times_out_at_the_group_timeout_and_learns_of_the_abort",
    "tests/test_shm.py::test_nothing_is_created_in_dev_shm",
    "tests/test_node_proof.py",  # a failed member stops the leader in < 5 s; the second user
    "tests/test_init_attack.py",  # the second user racing the ranks' store writes
    "tests/test_jobs_attack.py",  # the second user racing two jobs' store writes (4 ranks, 2 agents)
    "tests/test_failures.py",  # timeouts measured against their settings
    # every rank and the launcher gone within the group's timeout + 5 s of a rank's death
    "tests/test_failures_launchers.py::test_lost_rank_under_launcher",
    "tests/test_run_launcher_death.py",  # ranks gone within 5 s of their launcher
    "tests/test_slurm.py",  # the one Slurm cluster (2 CPUs) and its queue
    "tests/test_cli.py::test_doctor_json_and_speed",  # < 2 s
    "tests/test_doctor.py::test_doctor_auto_is_inits_rule_with_and_without_torch",  # < 1 s
    "tests/test_run_plan.py::test_dry_run_is_fast_and_imports_no_torch",  # < 3 s
    "tests/test_loop.py::test_a_failed_save_on_rank0_raises_on_every_rank_at_once",  # < 10 s of a 30 s timeout
    "tests/test_benchmark_call_cost.py",  # a benchmark's stages compared (beside a second worker they swung widely)
    # gloo's worker thread at exit ("terminate called without an active exception", SIGABRT on
    # rank 1 once in 2 local runs of .ci/run with a second worker beside it; never before alone)
    "tests/test_init_layout.py",
    # a rank's error named by the others before the launcher ends them, a killed rank's job ended
    # within a minute, a mismatch named on every rank (4 ranks on 2 CPUs)
    "tests/test_mpi_leg.py::test_a_rank_that_raises_ends_every_rank_with_its_error",
    "tests/test_mpi_leg.py::test_a_killed_rank_ends_the_job_without_orphans",
    "tests/test_mpi_leg.py::test_ranks_that_call_different_collectives_get_a_mismatch_naming_both",
)


def _check_exclusive() -> None:
    """Every EXCLUSIVE entry names a file and test that exist: a renamed test must not quietly
    start running beside others."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for entry in EXCLUSIVE:
        path, _, name = entry.partition("::")
        try:
            with open(os.path.join(root, path)) as f:
                text = f.read()
        except OSError:
            raise pytest.UsageError(f"tests/conftest.py EXCLUSIVE names {path}, which does not exist") from None
        if name and f"def {name}(" not in text:
            raise pytest.UsageError(f"tests/conftest.py EXCLUSIVE names {entry}; {path} defines no {name}")


_check_exclusive()


def _exclusive(nodeid: str) -> bool:
    return any(nodeid == e or nodeid.startswith(e + "::") or nodeid.startswith(e + "[") for e in EXCLUSIVE)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's controller: one private folder for the workers' turn-taking lock files."""
    config = node.config
    if not hasattr(config, "_cpuddp_lockdir"):
        config._cpuddp_lockdir = tempfile.mkdtemp(prefix="cpuddp-pytest-")  # 0700, ours alone
    node.workerinput["cpuddp_lockdir"] = config._cpuddp_lockdir


def pytest_unconfigure(config) -> None:
    if hasattr(config, "_cpuddp_lockdir"):
        shutil.rmtree(config._cpuddp_lockdir, ignore_errors=True)


class _Turn:
    """A fair readers-writer lock between the workers (flock on two files): ordinary tests share
    ``run``; an exclusive test holds it alone.  Every test first passes ``gate``, which a waiting
    exclusive test holds, so a stream of ordinary tests cannot starve it.  A worker keeps ``run``
    from one exclusive test to the next when they follow each other in its queue (the suite's
    order puts them together: ``pytest_collection_modifyitems``), so the other worker drains its
    current test once per run of them, not once per test."""

    def __init__(self) -> None:
        self.run = None  # the open ``run`` file while this worker holds it
        self.alone = False

    def take(self, lockdir: str, alone: bool) -> None:
        if self.run is not None and self.alone and alone:
            return  # still held from the exclusive test before
        self.give()
        with open(os.path.join(lockdir, "gate"), "a") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            run = open(os.path.join(lockdir, "run"), "a")
            try:
                fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            except BaseException:
                run.close()
                raise
            # closing ``gate`` releases it
        self.run, self.alone = run, alone

    def give(self) -> None:
        if self.run is not None:
            self.run.close()  # releases the flock
            self.run = None


_TURN = _Turn()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's timer: a wait is not the test's time
def pytest_runtest_protocol(item, nextitem):
    lockdir = getattr(item.config, "workerinput", {}).get("cpuddp_lockdir")
    if lockdir is None:  # one process runs the suite: nothing to share
        yield
        return
    alone = _exclusive(item.nodeid)
    _TURN.take(lockdir, alone)
    try:
        yield
    finally:
        if not (alone and nextitem is not None and _exclusive(nextitem.nodeid)):
            _TURN.give()


def pytest_collection_modifyitems(config, items) -> None:
    """Under xdist: the exclusive tests first, together (one drain of the other worker for all of
    them), then the tests marked ``slow``, then the rest -- so the run ends on short tests and
    neither worker idles long at the end.  One process keeps the files' order."""
    if not hasattr(config, "workerinput"):
        return
    rank = {id(item): (0 if _exclusive(item.nodeid) else 1 if item.get_closest_marker("slow") else 2)
            for item in items}
    items.sort(key=lambda item: rank[id(item)])  # stable: each group keeps the files' order


# Set by pytest itself for each test.
_SET_BY_TOOLS = {"PYTEST_CURRENT_TEST"}


@pytest.fixture(scope="session", autouse=True)
def _torch_process_defaults():
    """Let torch write its once-per-process default of ``TORCHINDUCTOR_CACHE_DIR`` before any test.

    torch's ``cache_dir()`` puts its default into ``os.environ`` the first time anything imports
    the inductor: torch 2.13's ``torch._dynamo.package`` at the first optimizer, torch 2.8 on
    ``import intel_extension_for_pytorch`` (a module-level ``@torch.compile``).  Whichever test
    came first was then blamed for a leak it did not make.  Calling it here, once, makes that
    write happen before the leak check's first snapshot; a test that changes the variable is
    still caught.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()


@pytest.fixture(autouse=True)
def _no_leaks():
    before = dict(os.environ)
    yield
    leaked_group = False
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            leaked_group = True
            import cpuddp

            cpuddp.shutdown()
    after = dict(os.environ)
    changed = sorted(
        k for k in set(before) | set(after) if before.get(k) != after.get(k) and k not in _SET_BY_TOOLS
    )
    os.environ.clear()
    os.environ.update(before)
    if leaked_group:
        pytest.fail("the test left a process group initialized")
    if changed:
        pytest.fail(f"the test leaked environment variables: {changed}")
