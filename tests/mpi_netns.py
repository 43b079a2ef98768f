"""Hosts for the MPI leg's tests: network namespaces on one bridge, each a "host" with an address
and a hostname of its own, and each MPI's own ``mpiexec`` started in the first host, reaching the
others through a launcher agent that enters a host's namespace where ssh would log in
(tests/scripts/netns_agent.sh).  The machinery is benchmarks/_mpi_hosts.py's (the benchmark
uses it too); this module adds the tests' rules: skip without root or the tools, the launchers
found as tests/launchers_util.py finds them.

How a cluster runs, and what it takes here (the facts the tests rest on were measured this way):

- Each host runs under a hostname of its own (a UTS namespace: ``unshare --uts``): Open MPI's
  daemons hang in ``MPI_Init`` when every host reports the same name, and Intel MPI connects
  back to the hostname it reads.
- UCX (MPICH's default device) takes processes on one kernel for one machine and would move the
  bytes through shared memory: ``UCX_TLS=tcp,self`` keeps it on the veth, as between real
  nodes.  Intel MPI: libfabric's ``tcp`` provider on ``eth0``.  Open MPI: ``ob1`` over the TCP
  BTL on ``eth0``.
- The launcher forwards the environment to the ranks (Hydra all of it; Open MPI what ``-x``
  names): the commands pass what the ranks need, ``MPI4PY_LIBMPI`` first -- mpi4py in the test
  venv loads the launcher's own library, from the launcher's prefix.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from launchers_util import launcher_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _mpi_hosts  # noqa: E402
from _mpi_hosts import Hosts, Run  # noqa: E402

__all__ = ["Hosts", "Run", "netns_hosts", "libmpi", "run_mpi"]


@contextlib.contextmanager
def netns_hosts(n: int, folder: Path) -> Iterator[Hosts]:
    """``n`` hosts on one bridge (benchmarks/_mpi_hosts.py), or a skip saying what is missing."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux-only")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    missing = _mpi_hosts.missing_tools()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (iproute2, util-linux)")
    with _mpi_hosts.hosts(n, folder) as made:
        yield made


def libmpi(kind: str) -> str:
    """The MPI library beside ``kind``'s launcher (what mpi4py must load under it)."""
    lib = _mpi_hosts.libmpi(kind, launcher_path(kind))
    if not lib.exists():
        pytest.fail(f"{kind}: no {lib}")
    return str(lib)


def run_mpi(kind: str, hosts: Hosts, ppn: int, argv: Sequence[str], env: dict[str, str], log: Path,
            timeout: float, launcher_args: Sequence[str] = ()) -> Run:
    """``argv`` (a Python script's) on ``ppn`` ranks per host under ``kind``'s own mpiexec, at most
    ``timeout`` s, the ranks' environment this process's (less any launcher's variables) and ``env``."""
    from cpuddp.testing import clean_environ

    cmd = _mpi_hosts.mpiexec(kind, launcher_path(kind), hosts, ppn, [sys.executable, *argv], env, launcher_args)
    full = clean_environ(os.environ)
    full.update(env)
    return _mpi_hosts.run(kind, cmd, hosts, full, log, timeout)
