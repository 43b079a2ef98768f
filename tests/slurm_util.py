"""A real Slurm for the tests: munged, slurmctld and slurmd started by hand in a temporary directory.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` packages (22.05), no systemd
(``.ci/slurm.sh install`` installs them).  Without root or the packages the tests skip and say
why -- unless ``CPUDDP_REQUIRE_SLURM=1`` (set by ``.ci/run``), where they fail.

How a cluster runs (the facts the tests rest on were measured this way):

- ``munged`` runs as the ``munge`` user with its socket in the cluster's directory
  (``AuthInfo=socket=...``), so a system munged, if any, is never touched.
- Each ``slurmd -D -N <node>`` runs under ``unshare --uts --pid --fork --mount-proc
  --kill-child=SIGKILL``: its own hostname (without a UTS namespace every node reports the
  same one), ``/etc/hosts`` bind-mounted from the cluster's directory so node names resolve
  to node addresses, and a PID namespace, so killing that one process ends the slurmd, every
  slurmstepd and every task it started -- nothing survives a failed test.
- One node: the slurmd in the root network namespace, slurmctld on 127.0.0.1, free ports.
- Two nodes: three network namespaces of our own -- a "login" namespace holding slurmctld, the
  clients (srun, sbatch, salloc run through ``nsenter --net``) and a bridge with 10.79.0.1/24,
  and one per node (10.79.0.2, 10.79.0.3) on a veth port of that bridge.  The slurmds enter
  theirs with ``nsenter --net`` (not ``ip netns exec``, which remounts /sys; slurmd then finds
  no cgroup filesystem).  Nothing is added to the root namespace, so no traffic leaves these
  namespaces and two test sessions never collide.  10.79.0.0/24 is used by no other test
  (tests/test_netns.py uses 10.77, tests/test_rendezvous_local.py 10.78).

:meth:`Cluster.stop` always runs (a finalizer registered before the first daemon starts):
cancel the jobs, kill each slurmd's namespace, stop slurmctld, delete the namespaces.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Optional, Sequence

import pytest

from netns_util import delete_namespaces, ip

REQUIRE_VAR = "CPUDDP_REQUIRE_SLURM"
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "salloc", "scontrol", "sinfo", "scancel", "munged")
NETNS_TOOLS = ("ip", "nsenter", "unshare")
INSTALL_HINT = "apt-get install slurmctld slurmd slurm-client munge (or run `bash .ci/slurm.sh install`)"
SUBNET = "10.79.0"  # the two-node cluster's bridge: .1 login/controller, .2, .3 ... the nodes
CMD_TIMEOUT = 20.0  # seconds for each scontrol/sinfo/scancel/ip call
START_TIMEOUT = 30.0  # seconds for a cluster's nodes to come up idle
STOP_GRACE = 5.0  # seconds slurmctld and munged get after SIGTERM


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason`` -- or fail, where CI installed Slurm and says so."""
    if os.environ.get(REQUIRE_VAR) == "1":
        pytest.fail(f"{reason} ({REQUIRE_VAR}=1: a real Slurm is required here)")
    pytest.skip(reason)


def check_prerequisites(*, namespaces: bool) -> None:
    if not os.uname().sysname == "Linux":
        unavailable("a real Slurm cluster needs Linux")
    if os.geteuid() != 0:
        unavailable("starting slurmctld/slurmd/munged needs root")
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        unavailable(f"Slurm is not installed (missing {', '.join(missing)}): {INSTALL_HINT}")
    if namespaces:
        missing = [t for t in NETNS_TOOLS if shutil.which(t) is None]
        if missing:
            unavailable(f"the two-node cluster needs {', '.join(missing)} (apt-get install iproute2 util-linux)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: Optional[subprocess.Popen], sig: int = signal.SIGTERM, grace: float = STOP_GRACE) -> None:
    """Stop a daemon we started (by its own pid), SIGKILL after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(grace)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Munge:
    """munged, as the munge user, with its socket in ``root`` (the package made the key)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "munge"
        self.socket = self.dir / "munge.socket"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        self.dir.mkdir()
        shutil.chown(self.dir, "munge", "munge")
        log = self.dir / "munged.log"
        with open(self.dir / "munged.err", "w") as err:
            self.proc = subprocess.Popen(
                ["munged", "--foreground", f"--socket={self.socket}", f"--pid-file={self.dir / 'munged.pid'}",
                 f"--log-file={log}", f"--seed-file={self.dir / 'munged.seed'}"],
                user="munge", group="munge", extra_groups=[], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{tail(self.dir / 'munged.err')}\n{tail(log)}")
            time.sleep(0.05)

    def stop(self) -> None:
        _kill(self.proc)


@dataclass(frozen=True)
class Node:
    name: str
    addr: str
    netns: Optional[str] = None  # None: the root network namespace


def _printed(exc: subprocess.TimeoutExpired) -> str:
    """What a client printed before its timeout (stdout and stderr; bytes there even in text mode)."""
    parts = (exc.stdout, exc.stderr)
    return "".join(p.decode(errors="replace") if isinstance(p, bytes) else (p or "") for p in parts)


class Cluster:
    """One Slurm cluster: a slurm.conf, slurmctld, one slurmd per node, all under ``root``.

    ``task_plugin``: ``task/affinity`` (Slurm binds each task to its CPUs) or ``task/none``.
    ``nodes`` > 1 needs network namespaces (see the module docstring).
    """

    def __init__(self, root: Path, munge: Munge, *, nodes: int = 1, task_plugin: str = "task/affinity",
                 cpus_per_node: int = 2) -> None:
        self.root = root
        self.munge = munge
        self.task_plugin = task_plugin
        self.cpus_per_node = cpus_per_node
        self.token = secrets.token_hex(3)
        if nodes == 1:
            self.login_netns: Optional[str] = None
            self.ctl_addr = "127.0.0.1"
            self.nodes = [Node("n1", "127.0.0.1")]
            self.ports = (free_port(), free_port())
        else:
            self.login_netns = f"cpsl-{self.token}-login"
            self.ctl_addr = f"{SUBNET}.1"
            self.nodes = [Node(f"n{i}", f"{SUBNET}.{i + 1}", f"cpsl-{self.token}-n{i}") for i in range(1, nodes + 1)]
            self.ports = (6817, 6818)  # our own namespaces: nothing else listens there
        self.conf = root / "slurm.conf"
        self.ctld: Optional[subprocess.Popen] = None
        self.slurmds: list[subprocess.Popen] = []
        self.namespaces: list[str] = []
        self.start_seconds: Optional[float] = None

    # ----------------------------------------------------------------- configuration

    def write_config(self) -> None:
        for d in ("state", "log", "spool"):
            (self.root / d).mkdir(exist_ok=True)
        r = self.root
        # Job ids differ between clusters: MPICH names its /dev/shm segments after the PMI job
        # id, and a segment a killed run left under a reused id makes MPI_Init fail ("Out of
        # memory" in MPIDI_POSIX_comm_bootstrap).
        self.first_job_id = 1000 + secrets.randbelow(60_000_000)
        nodes = "\n".join(f"NodeName={n.name} NodeAddr={n.addr} CPUs={self.cpus_per_node} State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=cpuddp{self.token}
SlurmctldHost={socket.gethostname().split('.')[0]}({self.ctl_addr})
SlurmctldPort={self.ports[0]}
SlurmdPort={self.ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge.socket}
StateSaveLocation={r}/state
FirstJobId={self.first_job_id}
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/spool/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin={self.task_plugin}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SchedulerType=sched/builtin
ReturnToService=2
KillWait=2
InactiveLimit=0
MessageTimeout=10
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in self.nodes if n.netns)
        (r / "hosts").write_text(hosts)

    def create_namespaces(self) -> None:
        """The login namespace with the bridge, one namespace per node on a veth port of it."""
        assert self.login_netns is not None
        for ns in [self.login_netns, *(n.netns for n in self.nodes)]:
            assert ns is not None
            try:
                ip("netns", "add", ns)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                unavailable(f"`ip netns add` is unavailable here: {(getattr(exc, 'stderr', '') or str(exc)).strip()}")
            self.namespaces.append(ns)
        login = self.login_netns
        ip("-n", login, "link", "set", "lo", "up")
        ip("-n", login, "link", "add", "br0", "type", "bridge")
        ip("-n", login, "addr", "add", f"{self.ctl_addr}/24", "dev", "br0")
        ip("-n", login, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes, 1):
            assert node.netns is not None
            port = f"cps{self.token}p{i}"  # the bridge's end; the node's end is its eth0
            ip("link", "add", port, "netns", login, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            ip("-n", login, "link", "set", port, "master", "br0", "up")
            ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            ip("-n", node.netns, "link", "set", "eth0", "up")
            ip("-n", node.netns, "link", "set", "lo", "up")

    # ----------------------------------------------------------------- running

    def in_login(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run where the clients and slurmctld live."""
        return ["nsenter", f"--net=/run/netns/{self.login_netns}", *argv] if self.login_netns else list(argv)

    def env(self, **extra: str) -> dict[str, str]:
        """A client environment: this one without any launcher's variables, plus SLURM_CONF."""
        from cpuddp.launchers import clean_environ

        env = clean_environ(os.environ)
        env.pop("SLURM_CONF", None)
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def command(self, argv: Sequence[str], *, timeout: float = CMD_TIMEOUT, check: bool = True,
                cwd: Optional[Path] = None, env: Optional[dict[str, str]] = None,
                stop_on: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run a Slurm client (srun, sbatch, salloc, scontrol, ...); on timeout cancel every
        job of this cluster, kill the client's process group and fail the test with its output.
        ``stop_on``: text that, once the client prints it, ends it the same way at once, and the
        result (``returncode`` None) comes back with what it printed, for the caller to judge."""
        proc = subprocess.Popen(self.in_login(argv), cwd=cwd or self.root, env=env or self.env(), text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                out, err = proc.communicate(timeout=min(left, 2.0) if stop_on else left)
                break
            except subprocess.TimeoutExpired as exc:
                stopped = stop_on is not None and stop_on in _printed(exc)
                if not stopped and time.monotonic() < deadline:
                    continue
            self.cancel_all()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            if stopped:
                return subprocess.CompletedProcess(list(argv), None, out, err)
            pytest.fail(f"`{' '.join(argv)}` did not finish in {timeout:.0f} s\n--- stdout\n{out}\n--- stderr\n{err}"
                        f"\n{self.logs()}")
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and result.returncode != 0:
            pytest.fail(f"`{' '.join(argv)}` exited {result.returncode}\n--- stdout\n{out}\n--- stderr\n{err}\n"
                        f"{self.logs()}")
        return result

    def wait_job(self, job_id: str, timeout: float) -> tuple[str, str]:
        """Wait for a batch job to end; return its final state and ``ExitCode`` (``3:0``).
        Polled here: ``sbatch --wait`` sleeps with back-off and added up to 30 s per job."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            res = self.command(["scontrol", "show", "job", "--oneliner", job_id], check=False)
            fields = dict(f.split("=", 1) for f in res.stdout.split() if "=" in f)
            if fields.get("JobState", "PENDING") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields["JobState"], fields.get("ExitCode", "?")
            time.sleep(0.2)
        self.cancel_all()
        pytest.fail(f"batch job {job_id} did not end in {timeout:.0f} s (state {fields.get('JobState')})\n{self.logs()}")

    def logs(self) -> str:
        parts = [f"--- slurmctld.log (tail)\n{tail(self.root / 'log/slurmctld.log')}"]
        parts += [f"--- slurmd-{n.name}.log (tail)\n{tail(self.root / f'log/slurmd-{n.name}.log')}" for n in self.nodes]
        return "\n".join(parts)

    def start(self) -> None:
        t0 = time.monotonic()
        self.write_config()
        if self.login_netns:
            self.create_namespaces()
        self.ctld = self._daemon(self.in_login(["slurmctld", "-D", "-i", "-f", str(self.conf)]), "slurmctld")
        for node in self.nodes:
            # The node's own hostname, /etc/hosts and PID namespace; SIGKILL to the unshare
            # process ends the namespace's init (--kill-child) and with it everything inside.
            # The shell stays as that init (no exec): it reaps the slurmstepds, which daemonize.
            script = 'hostname "$1" && mount --bind "$2" /etc/hosts && slurmd -D -N "$1" -f "$3"'
            argv = ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL",
                    "sh", "-c", script, "slurmd-wrapper", node.name, str(self.root / "hosts"), str(self.conf)]
            if node.netns:
                argv = ["nsenter", f"--net=/run/netns/{node.netns}", *argv]
            self.slurmds.append(self._daemon(argv, f"slurmd-{node.name}"))
        self.wait_idle(t0 + START_TIMEOUT)
        self.start_seconds = time.monotonic() - t0

    def _daemon(self, argv: list[str], name: str) -> subprocess.Popen:
        with open(self.root / f"log/{name}.err", "w") as err:
            return subprocess.Popen(argv, env=self.env(), cwd=self.root, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def wait_idle(self, deadline: float) -> None:
        states = ""
        while time.monotonic() < deadline:
            dead = [p for p in [self.ctld, *self.slurmds] if p is not None and p.poll() is not None]
            if dead:
                break
            res = subprocess.run(self.in_login(["sinfo", "-h", "-N", "-o", "%N %T"]), env=self.env(),
                                 capture_output=True, text=True, timeout=CMD_TIMEOUT)
            states = res.stdout.strip()
            lines = states.splitlines()
            if res.returncode == 0 and len(lines) == len(self.nodes) and all(l.split()[1] == "idle" for l in lines):
                return
            time.sleep(0.2)
        errs = "\n".join(f"--- {p.name}\n{tail(p)}" for p in sorted((self.root / "log").glob("*.err")))
        raise RuntimeError(f"the Slurm cluster did not come up (nodes: {states or 'no answer'})\n{errs}\n{self.logs()}")

    def cancel_all(self) -> None:
        if self.ctld is not None and self.ctld.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(self.in_login(["scancel", "--user=root"]), env=self.env(), capture_output=True,
                               timeout=CMD_TIMEOUT)

    def stop(self) -> None:
        """Everything this cluster started, gone; safe to call on a half-started cluster."""
        try:
            self.cancel_all()
            for proc in self.slurmds:
                _kill(proc, signal.SIGKILL)  # the PID namespace goes with it
            _kill(self.ctld)
        finally:
            delete_namespaces(self.namespaces)


def make_root(prefix: str) -> Path:
    """A temporary directory munge can reach (pytest's own are mode 0700 under a 0700 parent)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o755)
    return root
