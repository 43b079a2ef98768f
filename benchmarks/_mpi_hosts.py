"""Network-namespace "hosts" on one bridge, and an MPI's own mpiexec run across them: what the MPI
leg's tests (tests/mpi_netns.py) and benchmark (benchmarks/mpi_leg.py) share.  Standard library
only; needs root and iproute2, ``unshare`` (util-linux) and ``awk``.

* :func:`hosts`: a "switch" namespace holding a bridge, and ``n`` host namespaces each with ``eth0``
  on it (``10.82.0.<i+1>/24``) and ``/etc/netns/<ns>/hosts`` naming every host; nothing is added
  to the root namespace.  Everything is deleted on exit, with whatever runs inside.
* :func:`mpiexec`: the command line of MPICH's, Open MPI's or Intel MPI's mpiexec that starts a
  program on ``ppn`` ranks per host, reaching the hosts through ``tests/scripts/netns_agent.sh``
  (what ssh is on a cluster: it enters a host's namespace, under the host's own hostname) and
  keeping each MPI's traffic on ``eth0`` (UCX on TCP, libfabric's tcp provider, Open MPI's TCP BTL).
* :func:`run`: that command started in the first host, bounded in time.
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

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "tests" / "scripts" / "netns_agent.sh"
SUBNET = "10.82.0"
#: each MPI's library (MPICH ABI or Open MPI's), beside its mpiexec (``bin/../lib``)
LIBMPI = {"mpich": "libmpi.so.12", "openmpi": "libmpi.so.40", "impi": "libmpi.so.12"}
TOOLS = ("ip", "unshare", "awk", "taskset")


@dataclass(frozen=True)
class Hosts:
    """``namespaces[i]`` plays ``names[i]`` at ``addrs[i]`` on ``cpus[i]`` (a CPU list, "" for
    every CPU); ``table``: the agent's host list."""

    namespaces: tuple[str, ...]
    names: tuple[str, ...]
    addrs: tuple[str, ...]
    table: Path
    cpus: tuple[str, ...] = ()


@dataclass
class Run:
    returncode: Optional[int]  # None: killed at the timeout
    seconds: float
    output: str


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=check)


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def drop(namespaces: Sequence[str]) -> None:
    """Kill what runs in ``namespaces`` (ours), then delete them and their hosts files."""
    for ns in namespaces:
        with contextlib.suppress(subprocess.TimeoutExpired):
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@contextlib.contextmanager
def hosts(n: int, folder: Path, cpus: Sequence[str] = ()) -> Iterator[Hosts]:
    """``n`` hosts on one bridge (see the module docstring); ``folder`` gets the agent's table;
    ``cpus``: each host's CPUs (``taskset`` lists; none: every host runs on every CPU, so two
    hosts' ranks may share one -- what a real cluster never does)."""
    token = secrets.token_hex(3)
    switch, spaces = f"mpisw-{token}", tuple(f"mpi{i}-{token}" for i in range(n))
    names, addrs = tuple(f"h{i}-{token}" for i in range(n)), tuple(f"{SUBNET}.{i + 1}" for i in range(n))
    created: list[str] = []
    try:
        for ns in (switch, *spaces):
            ip("netns", "add", ns)
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, ns in enumerate(spaces):
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", switch)
            ip("-n", ns, "addr", "add", f"{addrs[i]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
            ip("-n", switch, "link", "set", f"p{i}", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(addrs, names)))
        table = folder / "hosts.txt"
        cpu = tuple(cpus) or ("",) * n
        table.write_text("".join(f"{a} {ns} {h} {c}".rstrip() + "\n" for a, ns, h, c in zip(addrs, spaces, names, cpu)))
        yield Hosts(spaces, names, addrs, table, cpu)
    finally:
        drop(created)


def libmpi(kind: str, exe: str) -> Path:
    """The MPI library beside ``kind``'s launcher ``exe`` (what mpi4py must load under it)."""
    return Path(exe).resolve().parent.parent / "lib" / LIBMPI[kind]


def mpiexec(kind: str, exe: str, on: Hosts, ppn: int, prog: Sequence[str], env: dict[str, str],
            launcher_args: Sequence[str] = ()) -> list[str]:
    """``kind``'s mpiexec (at ``exe``) starting ``prog`` on ``ppn`` ranks per host, the ranks'
    environment ``env`` forwarded as that launcher forwards it (Hydra: ``-genv``; Open MPI: ``-x``)."""
    n, agent = ppn * len(on.addrs), str(AGENT)
    prog = [*launcher_args, *prog]
    if kind == "openmpi":
        host = ",".join(f"{a}:{ppn}" for a in on.addrs)
        fwd = [w for k, v in env.items() for w in ("-x", f"{k}={v}")]
        return [exe, "--allow-run-as-root", "--oversubscribe", "--mca", "plm_rsh_agent", agent, "--host", host,
                "-n", str(n), "--map-by", f"ppr:{ppn}:node", "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp",
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0", *fwd, *prog]
    genv = [w for k, v in env.items() for w in ("-genv", k, v)]
    if kind == "impi":
        return [exe, "-bootstrap", "ssh", "-bootstrap-exec", agent, "-iface", "eth0", "-hosts", ",".join(on.addrs),
                "-ppn", str(ppn), "-n", str(n), "-genv", "FI_PROVIDER", "tcp", "-genv", "FI_TCP_IFACE", "eth0", *genv,
                *prog]
    return [exe, "-launcher", "ssh", "-launcher-exec", agent, "-hosts", ",".join(on.addrs), "-ppn", str(ppn),
            "-n", str(n), "-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0", *genv, *prog]


def run(kind: str, cmd: Sequence[str], on: Hosts, env: dict[str, str], log: Path, timeout: float) -> Run:
    """Run an mpiexec command in the first host (its own hostname too), at most ``timeout`` s;
    its process group is killed at the end."""
    full = dict(env)
    full["CPUDDP_TEST_HOSTS"] = str(on.table)
    if kind == "openmpi":
        full.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    pin = ["taskset", "-c", on.cpus[0]] if on.cpus and on.cpus[0] else []  # the first host's ranks fork from it
    wrapped = [*pin, "ip", "netns", "exec", on.namespaces[0], "unshare", "--uts", "/bin/sh", "-c",
               'hostname "$0" && exec "$@"', on.names[0], *cmd]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(wrapped, env=full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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


def python() -> str:
    return sys.executable
