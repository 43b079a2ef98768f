"""The cpuddp pytest plugin, exercised the way users meet it: in pytest runs of their own (pytester)."""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["pytester"]

DOCS = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
GUARD = "--timeout=120"  # pytest-timeout inside each inner run: nothing may hang


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- registration (no torch needed)


@pytest.mark.timeout(60)
def test_the_plugin_loads_by_entry_point_and_stays_light(pytester):
    pytester.makepyfile(
        test_light="""
        import sys

        def test_registered(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("cpuddp")  # the entry point's name
            assert "torch" not in sys.modules  # loading the plugin must not import torch
        """
    )
    result = pytester.runpytest_subprocess(GUARD, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    markers = pytester.runpytest_subprocess("--markers")
    markers.stdout.fnmatch_lines(["@pytest.mark.distributed(world_size=2, *timeout=60*"])
    fixtures = pytester.runpytest_subprocess("--fixtures")
    fixtures.stdout.fnmatch_lines(["*fixtures defined from cpuddp.testing*", "clean_launcher_env -- *", "run_distributed -- *"])


# --------------------------------------------------------------------------- multi-rank tests


REPORT_TESTS = """
import pytest
import torch
import torch.distributed as dist


def _sum():
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.tolist()


def _explode():
    x = dist.get_rank() + 1
    assert x == 1, "rank one exploded"  # fails on rank 1 only
    dist.barrier()


@pytest.mark.timeout(100)
def test_passes(run_distributed):
    assert run_distributed(_sum) == [[3.0, 3.0], [3.0, 3.0]]


@pytest.mark.timeout(100)
def test_fails(run_distributed):
    run_distributed(_explode)

"""


@pytest.mark.timeout(180)
def test_a_passing_and_a_failing_multi_rank_test_under_import_mode_importlib(pytester):
    # The test module sits in tests/ (no __init__.py) under a rootdir that is not on
    # sys.path, so with --import-mode=importlib a plain `import tests.test_report` fails in
    # the ranks: they must load it from the file pytest loaded.  (The default import mode
    # is exercised by the tests below.)
    pytester.mkdir("proj")
    pytester.mkdir("proj/tests")
    (pytester.path / "proj" / "tests" / "test_report.py").write_text(REPORT_TESTS)
    result = pytester.runpytest_subprocess(
        GUARD, "-p", "no:cacheprovider", "-rf", "--import-mode=importlib", "--rootdir=proj", "proj/tests", timeout=170
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "E *RankFailedError: rank 1 of 2 raised: AssertionError: rank one exploded",
            "E *in _explode",
            'E *assert x == 1, "rank one exploded"*',
            # rewritten in the rank, as pytest rewrites asserts in the test itself
            "E *AssertionError: rank one exploded",
            "E *assert 2 == 1",
            "FAILED proj/tests/test_report.py::test_fails - cpuddp.errors.RankFailedError*",
        ]
    )
    # the harness's own frames are hidden from the report
    assert "def _collect" not in result.stdout.str()


HANG_TESTS = """
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

HERE = Path(__file__).parent


def _stuck():
    if dist.get_rank() == 0:
        hang = 300  # seconds: far past the marker's timeout, which must end it
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({hang})"])
        (HERE / "grandchild.pid").write_text(str(child.pid))
        time.sleep(hang)  # never reaches the barrier
    dist.barrier()


@pytest.mark.timeout(100)
@pytest.mark.distributed(timeout=12)
def test_hangs(run_distributed):
    seen, done = set(), threading.Event()

    def watch():  # every process the call starts: ranks, their children
        while not done.is_set():
            seen.update(p.pid for p in psutil.Process().children(recursive=True))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run_distributed(_stuck)
    finally:
        done.set()
        watcher.join()
        (HERE / "seen.json").write_text(json.dumps(sorted(seen)))
"""


@pytest.mark.timeout(180)
def test_a_hang_ends_at_the_markers_timeout_with_stacks_and_no_orphans(pytester):
    pytester.makepyfile(test_hang=HANG_TESTS)
    start = time.monotonic()
    result = pytester.runpytest_subprocess(GUARD, "-p", "no:cacheprovider", timeout=170)
    elapsed = time.monotonic() - start
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "E *RankFailedError: ranks 0, 1 of 2 did not finish within 12 s",
            "E *--- rank 0, where it was at the timeout:",
            "E *test_hang.py*in _stuck",  # asleep in fn
            "E *--- rank 1, where it was at the timeout:",
            "E *in barrier",  # waiting for rank 0
            "E *test_hang.py*in _stuck",
            "E *Fix: a rank is stuck*",
        ]
    )
    assert "in rank_main" not in result.stdout.str()  # stacks stop at fn
    assert elapsed < 80, f"the inner run took {elapsed:.0f} s for a 12 s timeout"
    # No orphans: the ranks, the process rank 0 started, and (once pytest has exited) the
    # multiprocessing resource tracker are all gone.
    seen = json.loads((pytester.path / "seen.json").read_text())
    grandchild = int((pytester.path / "grandchild.pid").read_text())
    assert grandchild in seen and len(seen) >= 3
    end = time.monotonic() + 10
    while any(not _gone(p) for p in seen) and time.monotonic() < end:
        time.sleep(0.1)
    assert all(_gone(p) for p in seen), [psutil.Process(p).cmdline() for p in seen if not _gone(p)]


XDIST_TESTS = """
import json
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist


def _port():
    time.sleep(1.0)  # overlap with the other worker's call
    dist.barrier()
    return os.environ["MASTER_PORT"]


@pytest.mark.timeout(100)
@pytest.mark.parametrize("i", range(2))
def test_call(run_distributed, i):
    start = time.time()
    ports = run_distributed(_port, timeout=90)
    record = {"worker": os.environ["PYTEST_XDIST_WORKER"], "port": ports[0], "start": start, "end": time.time()}
    assert ports[1] == ports[0]
    (Path(__file__).parent / f"call{i}.json").write_text(json.dumps(record))
"""


@pytest.mark.timeout(240)
def test_xdist_workers_never_share_a_port(pytester):
    pytester.makepyfile(test_xdist=XDIST_TESTS)
    result = pytester.runpytest_subprocess(GUARD, "-p", "no:cacheprovider", "-n", "2", timeout=230)
    result.assert_outcomes(passed=2)
    calls = [json.loads(p.read_text()) for p in sorted(pytester.path.glob("call*.json"))]
    assert {c["worker"] for c in calls} == {"gw0", "gw1"}
    overlapping = [(a, b) for a, b in itertools.combinations(calls, 2) if a["start"] < b["end"] and b["start"] < a["end"]]
    assert overlapping, "no two calls ran at the same time: the test proved nothing"
    for a, b in overlapping:
        assert a["port"] != b["port"], (a, b)


@pytest.mark.timeout(180)
def test_the_docs_example_passes(pytester):
    if not DOCS.exists():
        pytest.skip("docs/testing.md is not next to the tests")
    section = DOCS.read_text().split("## A complete example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    pytester.makepyfile(test_train_step=code)
    result = pytester.runpytest_subprocess(GUARD, "-p", "no:cacheprovider", timeout=170)
    result.assert_outcomes(passed=1)


# --------------------------------------------------------------------------- environment isolation (no torch needed)


ISOLATION_CONFTEST = """
import os

os.environ.update(RANK="5", SLURM_JOB_ID="77", PMI_RANK="1", KEEP_ME="yes")
"""

ISOLATION_TESTS = """
import os


def test_1_hidden_during_the_test(clean_launcher_env):
    assert not {"RANK", "SLURM_JOB_ID", "PMI_RANK"} & set(os.environ)
    assert os.environ["KEEP_ME"] == "yes"
    os.environ.update(RANK="9", MASTER_PORT="1234", ALSO_NEW="x")  # as init_distributed would
    del os.environ["KEEP_ME"]


def test_1b_with_monkeypatch_requested_first(monkeypatch, clean_launcher_env):
    assert "RANK" not in os.environ
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("KEEP_ME", "changed")
    os.environ["MASTER_ADDR"] = "direct"


def test_2_restored_after_it():
    assert (os.environ["RANK"], os.environ["SLURM_JOB_ID"], os.environ["PMI_RANK"]) == ("5", "77", "1")
    assert os.environ["KEEP_ME"] == "yes"
    assert not {"MASTER_PORT", "MASTER_ADDR", "ALSO_NEW"} & set(os.environ)
"""

AUTOUSE_TESTS = """
import os


def test_hidden_without_asking():
    assert not {"RANK", "SLURM_JOB_ID", "PMI_RANK"} & set(os.environ)
    os.environ["MASTER_ADDR"] = "leak"


def test_and_restored():
    assert "MASTER_ADDR" not in os.environ
"""


@pytest.mark.timeout(60)
def test_clean_launcher_env_hides_and_restores(pytester):
    pytester.makeconftest(ISOLATION_CONFTEST)
    pytester.makepyfile(test_isolation=ISOLATION_TESTS)
    result = pytester.runpytest_subprocess(GUARD, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ini, outcome", [("true", {"passed": 2}), ("false", {"failed": 1, "passed": 1})])
def test_the_ini_option_isolates_every_test(pytester, ini, outcome):
    pytester.makeconftest(ISOLATION_CONFTEST)
    pytester.makepyfile(test_autouse=AUTOUSE_TESTS)
    result = pytester.runpytest_subprocess(GUARD, "-p", "no:cacheprovider", "-o", f"cpuddp_isolate_env={ini}")
    result.assert_outcomes(**outcome)
