"""Another local user against README's own path (issue 35): ``init_distributed()`` with the
default backend, under ``torchrun``, whose agent store any local user can reach.

The attacker runs as a second user (tests/scripts/init_intruder.py, standard library only) and
rewrites the store while the job forms: every rank's backend choice to ``gloo`` plus gloo's
address keys pointing at its relay, or every rank's host record so the ranks seem to share one
CPU (``auto`` would then pick gloo).  Before issue 35 either one moved the job onto gloo (the
first: 10 of 10 runs), through which the attacker read and changed the sums.  Now no value from
the store can choose the backend: the job stops with an error naming what the store said, or
(when the rewrite came too late to be read) runs on shm with every result right; never gloo,
never a byte at the relay.
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

#: what a rank stopped by the attack says, by mode
STOPPED = {
    "downgrade": "the ranks' backend choices differ",
    "cpus": "something other than this job's ranks writes to its rendezvous store",
}
#: what a rank says when it stops because another rank of the job stopped (rank 0 left the private
#: check of the host records, or a rank published its error): the other rank names the cause
WITH_A_PEER = "every rank stops with it"


def _attack(run: Path, uid: int, mode: str) -> tuple[list, dict, str]:
    from failure_scripts.procs import free_port
    from cpuddp.testing import clean_environ

    port = free_port()
    for name in ("init_intruder.py", "shm_intruder.py", "init_victim.py"):
        shutil.copy(SCRIPTS / name, run / name)
        os.chmod(run / name, 0o644)
    intruder = subprocess.Popen([_system_python(), str(run / "init_intruder.py"), mode, str(port), "60", str(run)],
                                user=uid, group=uid, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, cwd="/tmp",
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    env = clean_environ(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
                            str(run / "init_victim.py"), str(run)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = job.communicate(timeout=240)[0]
        intruder.wait(timeout=90)
    finally:
        for p in (job, intruder):
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = [json.loads((run / f"rank{r}.json").read_text()) if (run / f"rank{r}.json").exists()
               else {"rank": r, "init": "no report"} for r in range(2)]
    took = json.loads((run / "intruder.json").read_text()) if (run / "intruder.json").exists() else {}
    return reports, took, out[-3000:]


@pytest.mark.parametrize("mode", ["downgrade", "cpus"])
def test_a_neighbour_rewriting_the_store_cannot_move_a_default_job_onto_gloo(mode):
    uid = _intruder_uid()
    base = Path(tempfile.mkdtemp(prefix="cpuddp-init-attack-", dir="/tmp"))
    stopped = 0
    try:
        for attempt in range(3):
            run = base / f"run{attempt}"
            run.mkdir()
            os.chmod(base, 0o755)
            os.chmod(run, 0o777)
            reports, took, out = _attack(run, uid, mode)
            shown = f"{reports}\nintruder: {took}\njob output:\n{out}"
            assert took.get("uid") == uid and took.get("rewrites", 0) > 0, shown  # the attack happened
            assert took["relay_connections"] == 0 and took["relay_bytes"] == 0, shown
            for r in reports:
                assert r.get("backend") in (None, "shm"), shown  # never a gloo group within the node
                if r.get("init") == "ok":
                    assert r.get("calls") == 50 and r.get("wrong") == [], shown
                else:  # it names the attack, or says it stops because a peer stopped
                    assert STOPPED[mode] in r["init"] or WITH_A_PEER in r["init"], shown
            failed = [r["init"] for r in reports if r.get("init") != "ok"]
            if failed:  # whichever rank saw it first, the job's errors name what the store did
                assert any(STOPPED[mode] in why for why in failed), shown
            stopped += bool(failed)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert stopped >= 1, "the attack never reached a rank: the test proves nothing"
