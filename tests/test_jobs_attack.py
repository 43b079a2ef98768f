"""Same uid is not the same job (issue 43): another local user, who can reach every job's
rendezvous store, against two jobs of one user run at once, and against a subgroup.

The attacker runs as a second user (tests/scripts/jobs_intruder.py, standard library only,
speaking the store's protocol itself); the victim's jobs are ``torchrun --nproc-per-node N`` of
tests/scripts/jobs_victim.py, README's ``init_distributed()`` and ``prepare()`` with the default
backend (shm on this node).

* Two jobs (A and B) whose stores the attacker rewrites to hand each job's rank 1 the other job's
  rank 0 (its record and its shm hand-over offer).  Before issue 43 both jobs exited 0 with every
  sum wrong (11.0 for 2.0 or 20.0) and rank 1 of each held the other job's weights: ``SO_PEERCRED``
  checks the uid, the same for both, and the pid and token it expected came from the store.  Now
  each rank states its own job identity in the hand-over: a job may fail, naming its store,
  never run with the other's ranks.
* A subgroup ``new_group([0, 1])`` of a world of 3 whose records the attacker rewrites so each
  rank seems alone on its node.  Before issue 43 the group left shared memory for gloo (whose
  addresses come from the store: the issue's attacker relayed and changed every sum).  Now the
  group takes its members' nodes from the layout proven at init: it stays on shm, every sum right.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_shm_faults import _intruder_uid, _system_python

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"

pytestmark = pytest.mark.slow

#: what a rank refused by the other job's rank says; what every rank the attack reached names
ANOTHER_JOB = "is not a rank of this job"
STORE = "rendezvous store at 127.0.0.1:"
#: a rank that stops because its job's other rank stopped
WITH_A_PEER = ("every rank stops with it", "local rank 1", "local rank 0", "the fix is in that rank's own error")


def _stage(run: Path) -> None:
    for name in ("jobs_intruder.py", "init_intruder.py", "shm_intruder.py", "jobs_victim.py"):
        shutil.copy(SCRIPTS / name, run / name)
        os.chmod(run / name, 0o644)
    os.chmod(run, 0o777)


def _job(run: Path, port: int, name: str, mode: str, nproc: int) -> subprocess.Popen:
    from cpuddp.testing import clean_environ

    env = clean_environ(os.environ)
    env.update(OMP_NUM_THREADS="1", CPUDDP_TIMEOUT="40",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
                             str(run / "jobs_victim.py"), str(run), name, mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _attack(run: Path, uid: int, mode: str, jobs: dict[str, int]) -> tuple[dict, dict, str]:
    """Run the intruder against ``jobs`` (name -> rank count); every rank's report, the intruder's, the output."""
    from failure_scripts.procs import free_port

    _stage(run)
    ports = {name: free_port() for name in jobs}
    intruder = subprocess.Popen([_system_python(), str(run / "jobs_intruder.py"), mode, *map(str, ports.values()),
                                 "150", str(run)], user=uid, group=uid, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
                                cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = {name: _job(run, ports[name], name, mode, n) for name, n in jobs.items()}
    out = ""
    try:
        for name, p in procs.items():
            out += f"--- job {name}\n" + p.communicate(timeout=240)[0][-2500:]
        (run / "done").touch()  # the intruder stops on it
        out += "--- intruder\n" + intruder.communicate(timeout=60)[0][-1500:]
    finally:
        for p in [*procs.values(), intruder]:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = {}
    for name, n in jobs.items():
        for r in range(n):
            f = run / f"{name}-rank{r}.json"
            reports[(name, r)] = json.loads(f.read_text()) if f.exists() else {"init": "no report"}
    took = json.loads((run / "intruder.json").read_text()) if (run / "intruder.json").exists() else {}
    return reports, took, out


def _attempts(prefix: str):
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_two_jobs_of_one_user_are_never_wired_to_each_other_through_their_stores():
    uid = _intruder_uid()
    reached = 0
    for base in _attempts("cpuddp-jobs-attack-"):
        for attempt in range(3):
            run = base / f"run{attempt}"
            run.mkdir()
            reports, took, out = _attack(run, uid, "cross", {"A": 2, "B": 2})
            shown = f"{json.dumps({f'{j}{r}': v for (j, r), v in reports.items()}, indent=1)}\nintruder: {took}\n{out}"
            assert took.get("uid") == uid and took.get("moved", 0) > 0, shown  # the attack happened
            for job in ("A", "B"):
                ok = [reports[(job, r)] for r in (0, 1) if reports[(job, r)].get("init") == "ok"]
                for rep in ok:  # a rank that ran, ran with its own job's ranks only
                    assert rep["calls"] == 120 and rep["wrong"] == [], shown
                if len(ok) == 2:
                    assert ok[0]["weights"] == ok[1]["weights"], shown  # rank 1 holds its own job's rank 0's weights
                failed = [reports[(job, r)]["init"] for r in (0, 1) if reports[(job, r)].get("init") != "ok"]
                for why in failed:  # it names the store, or says its peer stopped
                    assert STORE in why or any(w in why for w in WITH_A_PEER), shown
                if failed:
                    assert any(STORE in why for why in failed), shown
                    reached += 1
            if reports[("A", 0)].get("init") == "ok" == reports[("B", 0)].get("init"):
                assert reports[("A", 0)]["weights"] != reports[("B", 0)]["weights"], shown
            if reached:
                break
    assert reached, "the attack never reached a rank in 3 attempts: the test proves nothing"


def test_a_subgroup_on_one_node_stays_on_shared_memory_whatever_its_records_say():
    uid = _intruder_uid()
    for base in _attempts("cpuddp-subgroup-attack-"):
        run = base / "run"
        run.mkdir()
        reports, took, out = _attack(run, uid, "subgroup", {"A": 3})
        shown = f"{json.dumps({f'{j}{r}': v for (j, r), v in reports.items()}, indent=1)}\nintruder: {took}\n{out}"
        assert took.get("uid") == uid and took.get("rewrites", 0) > 0, shown  # records were rewritten
        for r in (0, 1):
            rep = reports[("A", r)]
            assert rep.get("init") == "ok", shown
            assert rep["reason"].startswith("shared memory among 2 ranks"), shown  # never gloo
            assert rep["calls"] == 60 and rep["wrong"] == [], shown
