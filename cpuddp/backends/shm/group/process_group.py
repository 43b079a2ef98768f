"""``shm``: cpuddp's process group -- every collective between the ranks of a node through
shared memory, nothing between them through sockets anyone else can reach.

Use::

    import cpuddp
    cpuddp.init_distributed(backend="shm")          # or backend="auto" (see docs/backends.md)

    import cpuddp.shm                                # registers "shm" with torch.distributed
    torch.distributed.init_process_group("shm")      # plain torch, no pinning (frameworks: docs/frameworks.md)

What it does: all_reduce (and its coalesced form), reduce, broadcast, all_gather (list, single
tensor and coalesced forms, the torch 2.13 names ``all_gather_single*`` and the old ones),
reduce_scatter (likewise ``reduce_scatter_single*``), gather, scatter, all_to_all and
all_to_all_single, barrier, and send/recv, for dense CPU tensors of any layout (a strided
tensor goes through a contiguous staging copy and back) -- through the node's shared segment
(:mod:`cpuddp.backends.shm.python.local`) and, between the node's ranks, its sockets for send/recv
(:mod:`cpuddp.backends.shm.group.p2p`).  Across nodes: shared memory inside each node and gloo (or
oneCCL) between them (:mod:`cpuddp.backends.shm.cross.hierarchy`).  Nodes that run different numbers of
ranks, or one rank each, run every collective on gloo (the reason is logged).

Every collective is agreed first (:mod:`cpuddp.backends.shm.protocol.descriptor`): a mismatch between the
node's ranks is an error on every rank naming both calls, never a wrong result.  Errors raise
from the call (or its ``wait()``), and break the group: later calls raise at once.

The group's torch-side name needs a backend object registered for the CPU; it is a
``FakeProcessGroup`` that raises if anything calls it (nothing does: every path torch has --
its Python API, DDP's reducer, functional collectives, FSDP2, DCP -- reaches these methods).

Lifecycle (one state, :class:`~cpuddp.backends.shm.protocol.channel.Lifecycle`):
``shutdown``/``destroy_process_group`` and ``cpuddp.shutdown`` leave the group
(peers waiting for this rank stop at once); any use after that raises
:class:`~cpuddp.errors.GroupShutDownError`; a forked child can neither use its parent's group
nor leave it (:mod:`cpuddp.backends.shm.protocol.segment`).  Each group forms under a key prefix of its
own in the store (``shm/<n>/``, n counting this process's formations of that group: a count no one
else can move), so a group formed again in the same processes never reads a key the last one
left.  Which node each member is on comes from the job's proven layout, and every local peer
proves it is a rank of this job's group in the hand-over (:mod:`cpuddp.backends.shm.protocol.node`,
:mod:`cpuddp.backends.shm.protocol.handover`).

Options: :class:`~cpuddp.backends.shm.api.ShmOptions` as ``pg_options``; without them
``CPUDDP_SHM_INTER``, ``CPUDDP_SHM_ASYNC`` and ``CPUDDP_SHM_SLOT`` are read (and ``CPUDDP_SHM_NUMA``, a
forced NUMA plan: :mod:`cpuddp.backends.shm.python.levels`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from cpuddp.affinity.pin import thread_affinity
from cpuddp.backends.types import GLOO_SETTLE
from cpuddp.errors import BackendError
from cpuddp.launchers import identity

from .. import api
from ..protocol import check as shm_check
from ..routes import call_args
from .. import native
from . import arch
from .calls import Collectives
from ..protocol.channel import Channel, Lifecycle
from ..cross.hierarchy import Hierarchy
from ..cross.legs import Legs, form_legs
from ..cross.direct import CrossDirect
from ..cross.native_hier import NativeHierarchy
from ..routes.direct import Direct
from ..routes.executor import Executor
from ..protocol.handover import map_segment
from ..python.levels import setup_levels
from ..python.local import LocalEngine
from ..protocol.node import (GroupName, NodePlan, check_local_size, gather_who, group_name, pin_hosts, plan_node,
                             whoami)
from ..python.ops import check_tensors
from .p2p import PeerLinks
from ..routes.progress import Progress
from ..routes.route import CALLS, Route, WorldRoute
from ..routes.route_cross import NativeCrossRoute
from ..routes.route_native import NativeRoute
from ..routes.route_node import CrossRoute, NodeRoute
from ..native.layout import C_NATIVE
from ..routes.stream import GatheredWork, Stream, TimedWork, async_setting
from ..protocol.wait import Waiter

__all__ = ["NAME", "ShmProcessGroup", "register", "eligibility"]

log = logging.getLogger("cpuddp.shm")

NAME = shm_check.NAME
eligibility = shm_check.eligibility


def _name_holder(rank: int, size: int) -> Any:
    """A backend object for the group's name (torch keeps it there).  Nothing calls it: every path
    torch has reaches this group's methods (tests/test_shm*.py hold on torch 2.8 and 2.13); where
    torch can say so (2.10 and later), it raises if something does."""
    from torch._C._distributed_c10d import FakeProcessGroup

    create = getattr(FakeProcessGroup, "_create_internal", None)
    if create is None:
        return FakeProcessGroup(rank, size)
    opts = FakeProcessGroup.Options()
    opts.error_on_collective = True
    return create(rank, size, opts)


class ShmProcessGroup(Collectives, dist.ProcessGroup):
    """The ``shm`` process group (see the module docstring; the collectives are in
    :mod:`cpuddp.backends.shm.group.calls`)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                 options: Optional[api.ShmOptions] = None, name: Optional[GroupName] = None) -> None:
        super().__init__(rank, size)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, _name_holder(rank, size))
        # this group replaces the one torch made, and with it the default backend torch set there:
        # torch 2.15 attaches its flight recorder to every group, which needs it
        self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        self._options = options or api.ShmOptions.from_environ(size)
        self._timeout = timeout
        self._life = Lifecycle()
        self._pid = os.getpid()
        self._eng: Optional[LocalEngine] = None
        self._native: Optional[native.Engine] = None
        self._direct: Optional[Direct] = None
        self._progress: Optional[Progress] = None
        #: which data path the node's collectives take, and why (the log and the job's header)
        self.data_path = ""
        self._hier: Optional[Hierarchy] = None
        self._nhier: Optional[NativeHierarchy] = None  # the hierarchy's native node parts
        #: what carries the group between nodes, in words ("" on one node)
        self.leg = ""
        self._leg_name = ""  # "gloo", "ccl" or "mpi" where legs formed
        self._links: Optional[PeerLinks] = None
        self._world: Any = None  # gloo over every rank: across nodes only (all_to_all, send/recv)
        self._plan: Optional[NodePlan] = None
        name = name or group_name(store, "", (), size, None)
        self._whole = name.members == tuple(range(name.world))  # the job's world group
        self.reason = self._setup(store, rank, size, timeout, name)
        self._life.live()
        threaded = self._eng is not None and async_setting(self._options.async_comm)
        if self._native is not None and threaded and self._hier is None:  # the native progress thread
            self._progress = Progress(self._native, self._on_error, rank)
            threaded = False
        self._stream = Stream(rank, threaded, self._on_error, self._thread_setup)
        #: what the routes run a call through (the group's side of a collective; no route reaches in here)
        self._executor = Executor(rank, size, self._plan.local if self._plan is not None else (), self._life,
                                  self._pid, self._stream, self._progress,
                                  self._eng.ch if self._eng is not None else None)
        #: the direct route: torch's call to one native call (native groups that queue nothing)
        self._direct = self._direct_route()
        #: the route every collective takes (cpuddp.backends.shm.routes.route), chosen once: its methods
        #: bound here as ``_<name>``, what torch's methods (cpuddp.backends.shm.group.calls) hand a call to
        self._route = self._route_for()
        for call in CALLS:
            setattr(self, f"_{call}", getattr(self._route, call))
        api.track(self, (self._leg_name or self._options.inter) if self._whole else None)
        if rank == 0:
            log.info("cpuddp.shm: group of %d: %s", size, self.reason)

    # ------------------------------------------------------------------ set-up

    def _setup(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, name: GroupName) -> str:
        """Find the node's ranks through ``store``, map the node's segment; the mode's reason."""
        store = dist.PrefixStore(name.prefix, store)
        mine = whoami(rank)
        store.set(f"who/{rank}", mine.to_json())
        who = pin_hosts(gather_who(store, rank, size, timeout, name), name, mine)
        plan = plan_node(who, rank)
        check_local_size(plan, self._options.local_size, rank)
        self._plan = plan
        if plan.whole_gloo is not None:
            legs = self._legs(store, plan, name, timeout)
            self._world = legs.world
            return plan.whole_gloo.replace("gloo", legs.text, 1)
        seconds = timeout.total_seconds()
        with thread_affinity(self._options.cpus):  # the slots are allocated on the rank's NUMA node
            seg, socks, peers = map_segment(store, rank, plan, seconds, shm_check.slot_bytes(os.environ), name.identity)
        if name.members == tuple(range(name.world)):  # the world's layout, proven: its subgroups keep to it
            # (its local ranks proved themselves in the hand-over, and the launcher's count is its floor)
            identity.remember_hosts(name.identity.store, [w.host for w in who])
        waiter = Waiter(seg, plan.local, peers, rank, seconds, plan.spin)
        self._eng = LocalEngine(Channel(seg, plan.local, rank, waiter, self._life, arch.fence_here()))
        self._links = PeerLinks({plan.local[j]: s for j, s in socks.items()}, rank)
        # off x86 the node runs one level: the two-level NUMA plan runs in Python (arch.py)
        numa = setup_levels(self._eng, self._options.cpus or plan.local_cpus[plan.local_rank]) if arch.is_x86() else ""
        engine, path = native.form(self._eng.ch, peers, seconds, C_NATIVE)
        try:
            arch.check_path(engine, path)
        except BackendError:
            self._links.close()
            self._eng.ch.close()
            raise
        if self._eng.levels is None:  # the two-level NUMA plan runs in Python
            self._native = engine
        elif engine is not None:
            path = "Python data path: the native one runs one-level groups"
        self.data_path = path
        if plan.nodes == 1:
            return f"shared memory among {plan.local_size} ranks ({', '.join(filter(None, (numa, path)))})"
        legs = self._legs(store, plan, name, timeout)
        self._hier = Hierarchy(self._eng, plan, legs.cross)
        if self._native is not None:
            self._nhier = NativeHierarchy(self._native, plan, legs.cross)
        self._world = legs.world
        return (f"shared memory within each of {plan.nodes} nodes ({plan.local_size} ranks each; {path}), "
                f"{legs.text} between them")

    def _legs(self, store: Any, plan: NodePlan, name: GroupName, timeout: datetime.timedelta) -> Legs:
        """The group's legs between nodes (cross group and world group), and what carries them."""
        legs = form_legs(store, plan, name, self.rank(), self.size(), timeout, self._options.inter,
                         required=self._options.require_leg)
        self.leg, self._leg_name = legs.text, legs.leg
        return legs

    def _direct_route(self) -> Optional[Direct]:
        """The direct route (torch's call to the native calls, no Python object per call): native
        groups that queue nothing -- one node's (:class:`Direct`), or several nodes' with the node
        part native (:class:`CrossDirect`) -- else None."""
        if self._native is None or not self._stream.inline or self._progress is not None:
            return None
        args = (self._native, self._life, self._eng.ch.seg, self._stream.exec_lock, self._on_error,  # type: ignore[union-attr]
                self._plan.local, self._stream.crowded)  # type: ignore[union-attr]
        if self._nhier is not None:
            return CrossDirect(*args, leg=self._nhier.cross if self._nhier.me == 0 else None)
        return Direct(*args) if self._hier is None else None

    def _route_for(self) -> Route:
        """The route of the formed group, from what :meth:`_setup` made: no engine of the node's
        (every collective on gloo), the hierarchy across nodes, the native data path, or the
        Python engine."""
        if self._eng is None:
            return WorldRoute(self._world)
        if self._nhier is not None:
            return NativeCrossRoute(self._executor, self._eng, self._hier, self._world, self._native, self._nhier)
        if self._hier is not None:
            return CrossRoute(self._executor, self._eng, self._hier, self._world)
        if self._native is not None:
            return NativeRoute(self._executor, self._eng, self._native)
        return NodeRoute(self._executor, self._eng)

    def _thread_setup(self) -> None:
        """On the communication thread: its ops use one OpenMP thread."""
        import ctypes

        with contextlib.suppress(AttributeError, OSError):
            ctypes.CDLL(None).omp_set_num_threads(1)

    @property
    def paths(self) -> str:
        """The node's data path and the leg between nodes, in words (the job's header line):
        ``native data path, avx2; between nodes MPI (MPICH Version: 5.0.2)``."""
        return "; ".join(filter(None, (self.data_path, f"between nodes {self.leg}" if self.leg else "")))

    @property
    def shm_calls(self) -> int:
        """Collectives agreed through shared memory so far (tests and benchmarks read it)."""
        return self._eng.ch.calls if self._eng is not None else 0

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return NAME

    def _on_error(self, exc: BaseException) -> None:
        if getattr(self, "_stream", None) is not None:
            self._stream.name_crowd(exc)  # two threads that called at once are named first
        if self._eng is not None:
            self._eng.ch.fail(str(exc))

    # ------------------------------------------------------------------ point-to-point

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self._p2p(tensors, dst, tag, "send")

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self._p2p(tensors, src, tag, "recv")

    def _p2p(self, tensors: Any, peer: int, tag: int, kind: str) -> Any:
        """Within the node over its sockets, else on the gloo group of every rank; a tensor that
        is not contiguous goes through a staging copy (and back, for a recv)."""
        self._executor.usable()
        tensors = call_args.one_tensor(tensors, kind)
        check_tensors(tensors, kind)
        t = tensors[0]
        flat = t if t.is_contiguous() else (t.contiguous() if kind == "send" else torch.empty(t.shape, dtype=t.dtype))
        back = (lambda: t.copy_(flat)) if kind == "recv" and flat is not t else None
        if self._links is None or not self._links.has(peer):
            return GatheredWork([getattr(self._world, kind)([flat], peer, tag)], [t], back)
        fut = self._links.send(flat, peer, tag) if kind == "send" else self._links.recv(flat, peer, tag)
        if back is not None:
            fut = fut.then(lambda f: (f.value(), back(), [t])[2])
        return TimedWork(fut, self._timeout)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        if self._world is not None and self._links is None:
            return self._world.recv_anysource(tensors, tag)
        raise BackendError("recv without a source is not supported by the shm backend",
                           fix="pass src= to recv/irecv (the rank that sends)")

    # ------------------------------------------------------------------ leaving

    def leave(self) -> None:
        """Leave the group: peers waiting for this rank stop at once; later calls raise."""
        if not self._life.leave():
            return
        if os.getpid() != self._pid:
            return  # a forked child: the parent's group is not this process's to leave
        self._stream.close()
        if self._progress is not None:
            self._progress.close()
        if self._eng is not None:
            self._eng.ch.leave()
        if self._links is not None:
            self._links.close()

    def abort_peers(self, why: str) -> None:
        """Set the segment's abort word: local peers waiting for this rank raise at once."""
        if self._eng is not None and os.getpid() == self._pid and not self._life.gone:
            self._eng.ch.fail(why)

    def shutdown(self) -> None:  # torch's destroy_process_group calls it
        self.leave()
        if os.getpid() != self._pid:
            return
        for inner in (self._world, getattr(self._hier, "cross", None)):
            if inner is not None:
                with contextlib.suppress(Exception):
                    inner.shutdown()
        if self._world is not None or self._hier is not None:
            time.sleep(GLOO_SETTLE)  # gloo's workers (the leg's) release their last Works while Python still runs
        if self._eng is not None:
            self._eng.ch.close()
        else:
            self._life.close()

    def abort(self) -> None:
        self.abort_peers("the process group was aborted")
        self.shutdown()


# --------------------------------------------------------------------------- registration


def _create(dist_opts: Any, pg_options: Any = None) -> ShmProcessGroup:
    """torch's creator (``extended_api=True``): the store, ranks and timeout, and our options."""
    options = pg_options if isinstance(pg_options, api.ShmOptions) else None
    if pg_options is not None and options is None:
        raise BackendError(f"pg_options for the shm backend must be cpuddp's ShmOptions, not "
                           f"{type(pg_options).__name__}",
                           fix="pass cpuddp.backends.shm.api.ShmOptions(...) or nothing")
    members = list(getattr(dist_opts, "global_ranks_in_group", None) or ())
    world = dist.get_world_size() if members and dist.is_initialized() else None
    name = group_name(dist_opts.store, str(getattr(dist_opts, "group_id", "") or ""), members,
                      dist_opts.group_size, world)
    return ShmProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout, options,
                           name)


def register() -> None:
    """Register ``shm`` with ``torch.distributed`` (idempotent; done on import)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


register()
