"""``init_distributed()``: detect, meet, plan, pin, form the group -- and tear down.

Usage::

    env = cpuddp.init_distributed()        # under mpirun, torchrun, srun, Kubeflow or plain python
    cpuddp.get_session().backend           # what init chose: the backend, the pinning plan
    ...
    cpuddp.shutdown()                      # or: with cpuddp.session() as env: ...

:class:`~cpuddp.launchers.env.DistEnv` (``env``) says where the launcher put this process;
:class:`Session` adds what init chose for it.

The order, and why:

1. **Detect** (:func:`cpuddp.launchers.detect`): a malformed environment fails before anything
   starts, and before torch is imported.
2. **Meet** (:mod:`cpuddp.launchers.rendezvous`): join the job's store -- torchrun's agent store, or a
   TCP store rank 0 hosts -- and nothing else yet.
3. **Gather** (:mod:`cpuddp.launchers.hosts`): every rank publishes its host, its allowed CPUs and what
   its launcher said through the store, and reads everyone's.  This fixes the local rank,
   local size and node rank from the hosts themselves (two ranks on one host launched
   Kubeflow-style are seen as such), with no collective, no pickle and no numpy.
4. **Decide** (:func:`cpuddp.backends.decide.decide_backend`), once, from that layout: this
   rank's backend, the pinning plan for it (:mod:`cpuddp.affinity`) and the settings to export,
   then the agreement through the store, last (a rank keeps its own choice; ranks that disagree
   stop with an error naming them, before anything is carried out, so they never form
   mismatched groups): a frozen :class:`~cpuddp.backends.decide.BackendPlan`, which the steps
   below carry out.
5. **Export, load and pin**: the rank's and the backend's variables, the backend's module, then
   the compute threads -- this thread and every thread that existed before init, OpenMP's
   pool among them -- go to the rank's own cores.  The ranks then say "ready" through the store.
6. **Form the group**, with the options the agreed plan gives, and with this thread
   temporarily allowed on every CPU the process was given, so the backend's communication
   threads (gloo's, oneCCL's, the store's) start there and are never re-pinned (oneCCL pins its workers itself, from
   ``CCL_WORKER_AFFINITY``), then run one small collective to prove the group works.

Steps 4-6 are the backend's, one call (:func:`cpuddp.backends.start.start_backend`) handed the
job and this init's own steps (exports and pinning into the undo log, "ready", the watchdog).
A rank that fails in steps 3-5 publishes its error in the store, and the others raise at
once naming it.  A failed init undoes what it did (exports, pinning, store, group).

Environment variables read: every launcher's (see :mod:`cpuddp.launchers`), plus
``CPUDDP_TIMEOUT`` (seconds; the default for ``timeout=``) and ``CPUDDP_LOG_LEVEL`` (attach a
stderr handler to the ``cpuddp`` logger at that level).

Environment variables written, and restored by :func:`shutdown`: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` go to
``environ`` (default ``os.environ``) when a launcher started the process (a plain ``python``
run exports none of them, so a framework that launches its own ranks still does); the
backend's settings (``CCL_*``, ``FI_*``, ``GLOO_SOCKET_IFNAME``) and the pinning plan's
(``OMP_NUM_THREADS``, ``KMP_AFFINITY``,
``KMP_BLOCKTIME``) always go to the process environment (``os.environ``), because the
native libraries read them there, and only where the user has not set them there.  A value
the user set that cpuddp must change is logged as a warning.  :func:`shutdown` puts back
every variable it exported unless something changed it since.

Failure modes: a malformed environment raises :class:`~cpuddp.errors.LauncherEnvError`
before anything is started; a busy port, an unresolvable ``MASTER_ADDR`` or a peer that never
comes raise :class:`~cpuddp.errors.RendezvousError` (the last within ``timeout``); a group
whose first collective fails raises :class:`~cpuddp.errors.BackendError`.  The default
timeout is 300 s (torch's gloo default is 30 minutes); it bounds the rendezvous and every
collective.  :func:`shutdown` is bounded too, and runs at interpreter exit.  A process whose
previous group could not be torn down (a peer gone mid-collective) refuses a new one with a
clear error instead of adopting the dying group.  From the first call on, an uncaught
exception is printed in one write and reported where the launcher reads it (torchrun's
``TORCHELASTIC_ERROR_FILE``, ``cpuddp run``'s report directory: :mod:`cpuddp.launchers.report`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, MutableMapping, Optional

from cpuddp.affinity import pin as affinity
from cpuddp.backends.registry import accepts, leave_all
from cpuddp.backends.start import InitJob, start_backend
from cpuddp.backends.types import GLOO_SETTLE, BackendChoice, BackendName
from cpuddp.launchers import hosts, identity, proof, report
from cpuddp.launchers.env import DistEnv, Provenance
from cpuddp.launchers.exports import DEFAULT_TIMEOUT, Exports, Timeout
from cpuddp.launchers.exports import configure_logging as _configure_logging
from cpuddp.launchers.exports import timeout_from as _timeout
from cpuddp.launchers.registry import detect
from cpuddp.launchers.rendezvous import job_key, local_address, mpi_master_addr, open_store
from cpuddp.topology import here

from . import ddp_check
from ._compat import TESTED_TORCH, check_torch_version, older_than_tested
from .errors import BackendError, RendezvousError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

    from cpuddp.affinity.pin import PinState
    from cpuddp.affinity.plan import PinPlan
    from cpuddp.launchers.hosts import Layout

__all__ = ["init_distributed", "shutdown", "get_env", "get_session", "Session", "session", "DEFAULT_TIMEOUT",
           "local_address"]

log = logging.getLogger("cpuddp")

#: How long :func:`shutdown` waits for torch's own teardown before giving up on it.
SHUTDOWN_TIMEOUT = 10.0


@dataclass(frozen=True)
class Session:
    """The process group :func:`init_distributed` formed (or adopted): where the launcher put
    this process (``env``) and what init chose for it -- the backend ``choice`` (its name is
    ``backend``; the object that knows its settings is ``choice.backend``) and the ``pin_plan`` in
    force (None with ``pin=False`` or an adopted group)."""

    env: DistEnv
    choice: BackendChoice
    pin_plan: Optional["PinPlan"] = None

    @property
    def backend(self) -> str:
        """The backend's name (as ``init_process_group`` took it)."""
        return self.choice.name

    def __post_init__(self) -> None:
        self.env._attach_session(self)  # DistEnv.backend / .pin_plan forward here (deprecated)

    def chosen(self) -> dict[str, Any]:
        """``backend`` and ``pin_plan`` as plain data."""
        plan = self.pin_plan
        return {"backend": self.backend, "pin_plan": plan.as_dict() if plan is not None else None}

    def as_dict(self) -> dict[str, Any]:
        """Plain data: the env's fields and sources, the backend and the plan."""
        return {**self.env.as_dict(), **self.chosen()}


@dataclass
class _Undo:
    """What one :func:`init_distributed` put in place, for :func:`shutdown` (or a failed
    init) to undo."""

    generation: int
    exports: Exports = field(default_factory=Exports)
    keep: Optional["Store"] = None  # keeps the store (and its listening socket) alive with the group
    pin_state: Optional["PinState"] = None
    pid: int = field(default_factory=os.getpid)  # a forked child is not this rank: it undoes nothing


@dataclass
class _Process:
    """This process's session: the one instance is :data:`_state`, read and changed under ``lock``."""

    lock: "threading.RLock" = field(default_factory=threading.RLock)
    current: Optional[Session] = None
    undo: Optional[_Undo] = None  # what the init of ``current`` put in place
    generation: int = 0  # how many inits this process began (the store keys of each are its own)
    #: Set when torch's teardown of our group did not return: that group cannot be reused.
    abandoned: Optional[str] = None
    atexit_registered: bool = False

    def next_undo(self) -> _Undo:
        """The undo log of a new init, under the next generation."""
        self.generation += 1
        return _Undo(self.generation)

    def forget(self) -> None:
        """No current session (its undo is done, or is another process's)."""
        self.current, self.undo = None, None


_state = _Process()


def get_env() -> Optional[DistEnv]:
    """The :class:`DistEnv` of the current process group, or None before :func:`init_distributed`."""
    return None if _state.current is None else _state.current.env


def get_session() -> Optional[Session]:
    """The current :class:`Session` (env, backend, pinning plan), or None before
    :func:`init_distributed`."""
    return _state.current


def init_distributed(
    backend: str = "auto",
    *,
    timeout: Optional[Timeout] = None,
    pin: bool = True,
    environ: Optional[MutableMapping[str, str]] = None,
) -> DistEnv:
    """Join (or form) the job's process group and return where this process sits in it.

    ``backend``: ``"auto"`` (:func:`cpuddp.backends.auto.auto_rule`: shared memory within a
    node, oneCCL between nodes when it works, else gloo), ``"gloo"``, ``"ccl"``, or any
    registered name.  ``timeout``:
    seconds or a timedelta (default ``CPUDDP_TIMEOUT`` or 300 s).  ``pin``: pin this rank's
    compute threads to its own physical cores.  ``environ``: the mapping to read the
    launcher's variables from and to export the rank variables to (default ``os.environ``;
    see the module docstring for the backend's variables).

    Safe to call twice: a second call returns the current :class:`DistEnv`.  What init chose
    (backend, pinning plan) is in :func:`get_session`.
    """
    with _state.lock:
        environ = os.environ if environ is None else environ
        _configure_logging(environ)
        report.install()  # an uncaught error: printed whole, and reported to torchrun / cpuddp run
        td = _timeout(timeout, environ)
        # Before importing torch (2 s or more): a malformed environment fails at once.
        env = detect(environ)
        import torch.distributed as dist

        _check_torch()
        if dist.is_initialized():
            return _adopt(env, backend).env
        _clear_stale()
        if env.master_addr == "":
            env = env.replace(master_addr=mpi_master_addr(env))
        undo = _state.next_undo()
        try:
            job = _join(env, td, pin, environ, undo)  # steps 2-3: meet, gather and prove
            plan = start_backend(backend, job)  # steps 4-6, the backend's: decide, export, load, pin, form, prove
            current = Session(job.env, plan.choice, pin_plan=plan.pin_plan)
        except BaseException:
            _undo(undo)
            raise
        _state.current, _state.undo = current, undo
        _register_atexit()
        ddp_check.install(current.env.world_size)  # warns when an optimizer steps an unwrapped model
        _log_ready(current)
        return current.env


def _clear_stale() -> None:
    """No group exists: forget one that is gone -- torch's teardown that finished late, or
    our group that the user destroyed themselves (finish the job: undo our changes)."""
    _destroy_group(SHUTDOWN_TIMEOUT)  # clears a stale "abandoned" mark once the group is gone
    if _state.undo is not None:
        _undo(_state.undo)
        _state.forget()


def _log_ready(current: Session) -> None:
    env = current.env
    if env.is_main:
        log.info(
            "cpuddp: rank %d of %d ready (launcher %s, backend %s%s, %d node(s), rendezvous %s:%d)",
            env.rank, env.world_size, env.launcher, current.backend, _data_path(), env.num_nodes, env.master_addr,
            env.master_port,
        )


def _data_path() -> str:
    """``" (native data path, avx512; between nodes MPI (...))"``: the shm group's paths, or ""."""
    import torch.distributed as dist

    try:
        path = getattr(dist.distributed_c10d._get_default_group(), "paths", "")
    except (RuntimeError, ValueError, AttributeError):
        return ""
    return f" ({path})" if path else ""


def _check_torch() -> None:
    """Refuse a torch older than the tested range (the store cannot take rank 0's socket);
    log once for a newer one."""
    import torch

    if older_than_tested(torch.__version__):
        lo = ".".join(map(str, TESTED_TORCH[0]))
        raise BackendError(
            f"torch {torch.__version__} is older than cpuddp supports (torch {lo} or newer)",
            fix=f"pip install 'torch>={lo}' (CPU build: pip install torch==2.13.0)",
        )
    check_torch_version(log)


def _adopt(env: DistEnv, backend: str) -> Session:
    """The group already exists: ours (return it), a dead one of ours (refuse), or one the
    user made with torch's own ``init_process_group`` (adopt it).  A named backend other than
    the live group's is an error, never the old group."""
    import torch.distributed as dist

    if _state.abandoned is not None:
        raise RendezvousError(
            f"the previous process group of this process could not be torn down ({_state.abandoned}); "
            "a new one cannot be formed beside it",
            fix="restart the process (a peer probably died mid-collective); in a notebook, restart the kernel",
        )
    current = _state.current
    live = current.backend if current is not None else str(dist.get_backend())
    if not accepts(backend, live):
        raise BackendError(
            f"init_distributed(backend={backend!r}) was called while a {live!r} process group exists in this process",
            fix=f"call cpuddp.shutdown() first to form a {backend!r} group, or pass backend={live!r} (or 'auto') "
                "to get the live one")
    if current is not None:
        log.debug("init_distributed: already initialized; returning the current DistEnv")
        return current
    env = env.replace(rank=dist.get_rank(), world_size=dist.get_world_size())
    _state.current = Session(env, BackendChoice(BackendName(str(dist.get_backend())), "adopted: formed before init"))
    log.debug("init_distributed: adopting an existing process group: %s (backend %s)", env, _state.current.backend)
    return _state.current


def _join(env: DistEnv, td: datetime.timedelta, pin: bool, environ: MutableMapping[str, str],
          undo: _Undo) -> InitJob:
    """Steps 2-3 of the module docstring: meet, gather and prove.  Returns the job as the backend's
    start takes it, with this init's own steps (:class:`_Steps`) as its hands."""
    before = affinity.thread_ids()  # the compute threads (this one, OpenMP's) and the user's
    wide = here.allowed_cpus() or None  # where communication threads may run
    store = _meet(env, td, environ, undo)
    steps = _Steps(env, store, f"cpuddp/init{undo.generation}", td, environ, undo, before, wide)
    with steps.published():
        steps.env, lay = _gather_layout(env, store, steps.step, td)
    return InitJob(steps.env, lay, store, hosts.sharing(store, env.rank, env.world_size, td), f"{steps.step}/backend",
                   td, environ, pin, export=steps.export, pin_compute=steps.pin_compute,
                   until_ready=steps.until_ready, forming=steps.forming)


@dataclass
class _Steps:
    """This init's own steps inside the backend's start (its :class:`InitJob`'s hands), logged in ``undo``."""

    env: DistEnv
    store: Optional["Store"]
    step: str  # this init's exchanges: <step>/host, /proof, /backend, /ready
    td: datetime.timedelta
    environ: MutableMapping[str, str]
    undo: _Undo
    before: Any  # the compute threads: those that existed before init
    wide: Any  # every CPU the process was given: where communication threads may run

    @contextlib.contextmanager
    def published(self) -> Iterator[None]:
        """A failure inside is published under every exchange of this init: the others raise at once naming it."""
        try:
            yield
        except BaseException as exc:
            if self.store is not None:
                for name in ("host", "proof", "backend", "ready"):
                    hosts.publish_error(self.store, f"{self.step}/{name}", self.env.rank, exc)
            raise

    def export(self, settings: Mapping[str, str]) -> None:
        # A plain `python` run (no launcher, world of 1) exports no rank variables: a framework reads
        # LOCAL_RANK as "an outside launcher started me" (Lightning) and would not start its own ranks.
        if self.env.launcher != "none":
            self.undo.exports.export(self.environ, self.env.exported(), strict=True,
                                     reason="describes this process to torch and child processes")
        self.undo.exports.export(os.environ, settings, reason="backend setting")

    def pin_compute(self, plan: "PinPlan") -> None:
        self.undo.pin_state = affinity.apply_plan(plan, os.environ, threads=self.before)

    @contextlib.contextmanager
    def until_ready(self) -> Iterator[None]:
        with self.published():
            yield
            if self.store is not None:
                hosts.exchange(self.store, f"{self.step}/ready", self.env.rank, self.env.world_size, "ok", self.td,
                               what="ready")

    @contextlib.contextmanager
    def forming(self) -> Iterator[None]:
        """Step 6: this thread on every CPU the process was given while the group forms; then the watchdog."""
        with affinity.thread_affinity(self.wide):
            yield
            if self.store is not None:
                from cpuddp.watchdog import monitor as watchdog

                watchdog.start(self.env, self.undo.keep)


def _meet(env: DistEnv, td: datetime.timedelta, environ: Mapping[str, str], undo: _Undo) -> Optional["Store"]:
    """Step 2: the job's store (None for a world of one); ``undo`` keeps it alive."""
    if env.world_size == 1:
        return None
    rdv = open_store(env, td, environ, undo.generation)
    undo.keep = rdv.keep
    return rdv.store


_LAYOUT_SOURCE = Provenance.derived("hosts gathered at init")


def _gather_layout(env: DistEnv, store: Optional["Store"], step: str,
                   td: datetime.timedelta) -> tuple[DistEnv, Optional["Layout"]]:
    """Step 3: gather every rank's host and CPUs, and prove this host's records came from its
    ranks (:func:`cpuddp.launchers.proof.prove_node`); return ``env`` with the layout they show,
    and that layout (None for a world of 1): nothing is decided before the proof."""
    if store is None:
        return env, None
    mine = hosts.HostRecord.here(env.rank, env.local_rank, env.local_world_size)
    where = f"{env.master_addr}:{env.master_port}"
    records = hosts.gather_hosts(
        store, f"{step}/host", mine, env.world_size, td,
        missing_fix=lambda shown: f"{_size_var(env)}={env.world_size} but rank(s) {shown} never reached the "
        f"rendezvous at {where}: start them (check the launcher's rank count and their logs), or fix the world size")
    job = proof.init_identity(store, env.world_size, job_key(env))
    proof.prove_node(store, f"{step}/proof", mine, records, env.world_size, td, errors=f"{step}/backend", identity=job)
    identity.remember_hosts(job.store, [r.host for r in records])  # every group of the job keeps to it
    lay = hosts.layout(records, env.rank)
    return hosts.apply_layout(env, lay, _LAYOUT_SOURCE), lay


def _size_var(env: DistEnv) -> str:
    """The variable the world size came from, for messages (``WORLD_SIZE`` when none did)."""
    said = env.sources.get("world_size")
    return said.detail if said is not None and said.from_variable else "WORLD_SIZE"


def shutdown(timeout: float = SHUTDOWN_TIMEOUT) -> None:
    """Destroy the process group (bounded by ``timeout`` seconds), restore pinning and the
    environment variables :func:`init_distributed` exported.

    Never hangs: if torch's teardown does not return in time it is abandoned with a warning,
    and a later :func:`init_distributed` in this process says so instead of adopting it.
    Safe to call when nothing was initialized.  In a forked child of a rank (a DataLoader
    worker, a helper that exits through ``sys.exit``) it only forgets the parent's session:
    the group, the store and the pinning are the parent's.
    """
    with _state.lock:
        if _state.undo is not None and _state.undo.pid != os.getpid():
            _state.forget()
            return
        from cpuddp.watchdog import monitor as watchdog

        watchdog.stop()  # first: it says "done" through the store the group is about to drop
        ddp_check.uninstall()
        _destroy_group(timeout)
        if _state.undo is not None:  # this process's session, whoever destroyed its group
            _undo(_state.undo)
            if _state.abandoned is None:  # gloo's workers (a group DDP still holds keeps them) finish
                time.sleep(GLOO_SETTLE)  # while Python runs
        _state.forget()


def _destroy_group(timeout: float) -> None:
    """``destroy_process_group`` in a thread, waited for at most ``timeout`` seconds."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _state.abandoned = None  # whatever hung has ended since
        return
    if _state.abandoned is not None:
        return
    leave_all()  # peers waiting for this rank (shm) learn at once that it left
    done = threading.Event()

    def _destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # teardown must not raise over a finished job
            log.debug("destroy_process_group raised: %s", exc)
        finally:
            done.set()

    threading.Thread(target=_destroy, name="cpuddp-shutdown", daemon=True).start()
    if not done.wait(timeout):
        _state.abandoned = f"destroy_process_group did not return within {timeout:.0f} s"
        log.warning("cpuddp: %s; abandoning it", _state.abandoned)


def _undo(undo: _Undo) -> None:
    """Undo what one init did: the group (bounded), pinning, exports, the store."""
    _destroy_group(SHUTDOWN_TIMEOUT)
    if undo.pin_state is not None:
        with contextlib.suppress(Exception):
            affinity.restore(undo.pin_state)
        undo.pin_state = None
    undo.exports.unexport()
    undo.keep = None


@contextlib.contextmanager
def session(backend: str = "auto", **kwargs: Any) -> Iterator[DistEnv]:
    """``with cpuddp.session() as env: ...`` -- :func:`init_distributed`, then :func:`shutdown`."""
    env = init_distributed(backend, **kwargs)
    try:
        yield env
    finally:
        shutdown()


# --------------------------------------------------------------------------- internals


def _register_atexit() -> None:
    if not _state.atexit_registered:
        atexit.register(shutdown)
        _state.atexit_registered = True
