"""Hosts for the MPI leg's tests: network namespaces on one bridge, each a "host" with an address
and a hostname of its own, and each MPI's own ``mpiexec`` started in the first host, reaching the
others through a launcher agent that enters a host's namespace where ssh would log in
(tests/scripts/netns_agent.sh).

How a cluster runs, and what it takes here (the facts the tests rest on were measured this way):

- A "switch" namespace holds a bridge; each host namespace has ``eth0`` on it, with
  ``10.82.0.<i+1>/24``, and ``/etc/netns/<ns>/hosts`` naming every host.  Nothing is added to the
  root namespace, so no traffic leaves the namespaces and two tests never collide.
- Each host runs under a hostname of its own (a UTS namespace: ``unshare --uts``): Open MPI's
  daemons hang in ``MPI_Init`` when every host reports the same name, and Intel MPI connects
  back to the hostname it reads.
- UCX (MPICH's default device) takes processes on one kernel for one machine and would move the
  bytes through shared memory: ``UCX_TLS=tcp,self`` keeps it on the veth, as between real
  nodes.  Intel MPI: libfabric's ``tcp`` provider on ``eth0``.  Open MPI: ``ob1`` over the TCP
  BTL on ``eth0``.
- The launcher forwards the environment to the ranks (Hydra all of it; Open MPI what ``-x``
  names): the commands below pass what the ranks need, ``MPI4PY_LIBMPI`` first -- mpi4py in
  the test venv loads the launcher's own library, from the launcher's prefix.

Everything is created under unique names and always deleted, with whatever the test left running
inside; without root, iproute2 or ``unshare`` the tests skip and say why.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest

from launchers_util import launcher_path
from netns_util import delete_namespaces, ip

AGENT = Path(__file__).resolve().parent / "scripts" / "netns_agent.sh"
SUBNET = "10.82.0"  # used by no other test (test_netns 10.77, test_shm/rendezvous 10.78, Slurm 10.79)
#: each MPI's library (MPICH ABI or Open MPI's), beside its mpiexec
LIBMPI = {"mpich": "libmpi.so.12", "openmpi": "libmpi.so.40", "impi": "libmpi.so.12"}


@dataclass(frozen=True)
class Hosts:
    """``namespaces[i]`` plays ``names[i]`` at ``addrs[i]``; ``table``: the agent's host list."""

    namespaces: tuple[str, ...]
    names: tuple[str, ...]
    addrs: tuple[str, ...]
    table: Path


def _require() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux-only")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    missing = [t for t in ("ip", "unshare", "awk") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (iproute2, util-linux)")


@contextlib.contextmanager
def netns_hosts(n: int, folder: Path) -> Iterator[Hosts]:
    """``n`` hosts on one bridge (see the module docstring); ``folder`` gets the agent's table."""
    _require()
    token = secrets.token_hex(3)
    switch = f"mpisw-{token}"
    hosts = tuple(f"mpi{i}-{token}" for i in range(n))
    names = tuple(f"h{i}-{token}" for i in range(n))
    addrs = tuple(f"{SUBNET}.{i + 1}" for i in range(n))
    created: list[str] = []
    try:
        for ns in (switch, *hosts):
            ip("netns", "add", ns)
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, ns in enumerate(hosts):
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", switch)
            ip("-n", ns, "addr", "add", f"{addrs[i]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
            ip("-n", switch, "link", "set", f"p{i}", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(addrs, names)))
        table = folder / "hosts.txt"
        table.write_text("".join(f"{a} {ns} {h}\n" for a, ns, h in zip(addrs, hosts, names)))
        yield Hosts(hosts, names, addrs, table)
    finally:
        delete_namespaces(created)
        for ns in hosts:
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def libmpi(kind: str) -> str:
    """The MPI library beside ``kind``'s launcher (what mpi4py must load under it)."""
    exe = Path(launcher_path(kind)).resolve()
    lib = exe.parent.parent / "lib" / LIBMPI[kind]
    if not lib.exists():
        pytest.fail(f"{kind}: no {lib}")
    return str(lib)


def mpi_command(kind: str, hosts: Hosts, ppn: int, argv: Sequence[str], env: dict[str, str],
                launcher_args: Sequence[str] = ()) -> list[str]:
    """``kind``'s mpiexec command starting ``argv`` (a Python script's) on ``ppn`` ranks per host,
    the ranks' environment ``env`` forwarded as that launcher forwards it."""
    exe = launcher_path(kind)
    n, agent = ppn * len(hosts.addrs), str(AGENT)
    prog = [*launcher_args, sys.executable, *argv]
    if kind == "openmpi":
        host = ",".join(f"{a}:{ppn}" for a in hosts.addrs)
        fwd = [w for k, v in env.items() for w in ("-x", f"{k}={v}")]
        return [exe, "--allow-run-as-root", "--oversubscribe", "--mca", "plm_rsh_agent", agent, "--host", host,
                "-n", str(n), "--map-by", f"ppr:{ppn}:node", "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp",
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0", *fwd, *prog]
    genv = [w for k, v in env.items() for w in ("-genv", k, v)]
    if kind == "impi":
        return [exe, "-bootstrap", "ssh", "-bootstrap-exec", agent, "-iface", "eth0", "-hosts", ",".join(hosts.addrs),
                "-ppn", str(ppn), "-n", str(n), "-genv", "FI_PROVIDER", "tcp", "-genv", "FI_TCP_IFACE", "eth0", *genv,
                *prog]
    return [exe, "-launcher", "ssh", "-launcher-exec", agent, "-hosts", ",".join(hosts.addrs), "-ppn", str(ppn),
            "-n", str(n), "-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0", *genv, *prog]


@dataclass
class Run:
    returncode: Optional[int]  # None: killed at the timeout
    seconds: float
    output: str


def run_mpi(kind: str, hosts: Hosts, ppn: int, argv: Sequence[str], env: dict[str, str], log: Path,
            timeout: float, launcher_args: Sequence[str] = ()) -> Run:
    """Run ``kind``'s mpiexec in the first host (its own hostname too), at most ``timeout`` s; its
    process group is killed at the end, and the hosts' namespaces are emptied by their owner."""
    from cpuddp.testing import clean_environ

    full = clean_environ(os.environ)
    full.update(env)
    full["CPUDDP_TEST_HOSTS"] = str(hosts.table)
    if kind == "openmpi":
        full.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    inner = mpi_command(kind, hosts, ppn, argv, env, launcher_args)
    cmd = ["ip", "netns", "exec", hosts.namespaces[0], "unshare", "--uts", "/bin/sh", "-c",
           'hostname "$0" && exec "$@"', hosts.names[0], *inner]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Run(code, time.monotonic() - start, log.read_text(errors="replace"))
