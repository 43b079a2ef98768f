"""The ``shm`` backend as the pipeline sees it (:class:`~cpuddp.backends.types.BackendSpec`): what
is its own of every step, without importing torch.

* **Its check**: :func:`cpuddp.backends.shm.protocol.check.probe` (a named ``backend="shm"``), and
  :meth:`ShmBackend.auto_status` for ``backend="auto"`` (the node eligible, and every node of the
  job running 2 or more ranks).
* **Its node-to-node leg**, another backend's object (:attr:`BackendChoice.leg
  <cpuddp.backends.types.BackendChoice.leg>`): the rule's (oneCCL when its bindings work here,
  else gloo: :func:`cpuddp.backends.auto.inter_leg`), or the user's ``CPUDDP_SHM_INTER``, read
  once, before the ranks agree (:meth:`ShmBackend.with_user_settings`).  The leg's settings and
  worker cores are the group's; the leg's object forms the cross groups
  (:func:`cpuddp.backends.shm.cross.hierarchy.cross_group`).
* **The group's options** (:class:`~cpuddp.backends.shm.api.ShmOptions`, as ``pg_options``): the
  agreed leg, the communication thread on a spare CPU of the plan, the launcher's local size,
  the rank's CPUs.
* **Leave and abort**: every live group of the process (:mod:`cpuddp.backends.shm.api`).

Environment variables read: ``CPUDDP_SHM_INTER`` (:meth:`ShmBackend.with_user_settings`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

from cpuddp.errors import BackendError
from cpuddp.launchers import store_values

from ..auto import inter_leg
from ..types import BACKENDS, BackendChoice, BackendName, BackendSpec, BackendStatus, Lookups
from .protocol import check
from .api import INTER_VAR, LEGS, ShmOptions, user_leg

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv
    from cpuddp.launchers.hosts import Share


__all__ = ["ShmBackend", "shm_options"]

log = logging.getLogger("cpuddp.backends")

#: Marks a leg the user set (CPUDDP_SHM_INTER) in the legs exchange.
_SET = "_set"


class ShmBackend(BackendSpec):
    """cpuddp's shared-memory backend within a node; between nodes its leg's backend."""

    #: Its native one-call route takes SUM, not AVG (the division would be a second pass over the
    #: output): a sum divided by the caller stays on it.
    averages_in_reduce_scatter = False

    def refusal(self, st: BackendStatus, lk: Lookups) -> BackendError:
        """A CPU that is not x86 without the native data path (:data:`~.protocol.check.NATIVE_ONLY`)
        gets that fix; any other reason the base class's."""
        if check.NATIVE_ONLY not in st.reason:
            return super().refusal(st, lk)
        import platform

        return BackendError(f"backend={self.name!r} was requested, but it cannot run here: {st.reason}",
                            fix=f"{check.native_fix(lk.environ, platform.machine())}; or pass backend='auto' "
                                "(it takes gloo here) or 'gloo'")

    def named_choice(self, st: BackendStatus, env: "DistEnv", lk: Lookups) -> BackendChoice:
        return replace(super().named_choice(st, env, lk), inter=self.rule_leg(env, lk))

    def rule_leg(self, env: "DistEnv", lk: Lookups) -> Optional[str]:
        """The node-to-node leg by the rule (None on one node): the same rule as auto's."""
        if env.num_nodes <= 1:
            return None
        ccl, mpi = BACKENDS.get(BackendName.CCL), BACKENDS.get(BackendName.MPI)
        st = ccl.status(lk) if ccl is not None else None
        mst = mpi.leg_status(env, lk) if mpi is not None else None
        return inter_leg(env.num_nodes, bool(st and st.available), st.reason if st else "",
                         bool(mst and mst.available), mst.reason if mst else "")[0]

    def auto_status(self, env: "DistEnv", lk: Lookups, node_cpus: Optional[int],
                    smallest_node: Optional[int]) -> BackendStatus:
        """Whether ``backend="auto"`` may take shared memory on this node, and why."""
        ok, reason = check.eligibility(env.local_world_size, lk.environ, node_cpus=node_cpus)
        if ok and smallest_node is not None and smallest_node < 2:
            ok, reason = False, (f"a node of this job runs {smallest_node} rank: auto takes shared memory only where "
                                 "every node runs 2 or more (backend='shm' runs such a layout over its leg: MPI where "
                                 "it can run, else gloo)")
        return BackendStatus(self.name, ok, reason, module=self.module)

    def with_user_settings(self, choice: BackendChoice, environ: Mapping[str, str]) -> BackendChoice:
        """``choice`` with its node-to-node leg the user's ``CPUDDP_SHM_INTER`` where it is set
        (logged when it overrides the rule), checked; the one place the variable is read for a
        group that init forms."""
        leg = user_leg(environ)
        if leg is None:
            return choice
        if choice.inter is not None and leg != choice.inter:
            log.info("cpuddp: %s=%s is your setting and is kept (the rule would take %s between nodes)",
                     INTER_VAR, environ.get(INTER_VAR), choice.inter)
        return replace(choice, inter=leg, inter_set=True)

    def agree(self, choice: BackendChoice, env: "DistEnv", share: "Share", key: str) -> BackendChoice:
        """The node-to-node leg every rank forms (exchange ``key/inter``): oneCCL only when every
        rank has working bindings, else gloo (a warning names each rank's leg); where some rank
        set the leg itself (``CPUDDP_SHM_INTER``) and the legs differ, an error naming each rank's.
        Between nodes both legs are plain TCP that a network peer can reach (docs/security.md), so
        the store choosing gloo there exposes nothing new; within a node the store chooses nothing."""
        if choice.inter is None:  # one node: no leg
            return choice
        mine = choice.inter + (_SET if choice.inter_set else "")
        said = share(f"{key}/inter", mine, "backend")
        said = [store_values.backend_name(f"{key}/inter/{r}", n) for r, n in enumerate(said)]
        legs = [n[:-len(_SET)] if n.endswith(_SET) else n for n in said]
        if len(set(legs)) == 1:
            return choice
        if any(n.endswith(_SET) for n in said):
            _legs_differ(env.rank, legs, said)
        if env.is_main:
            log.warning("cpuddp: between nodes gloo, not %s: not every rank can take it (%s)",
                        choice.inter, ", ".join(f"rank {r}: {n}" for r, n in enumerate(legs) if n != choice.inter)[:400])
        return replace(choice, inter=LEGS[0], reason=f"{choice.reason}; between nodes gloo after all: not "
                       f"every rank can take the same leg ({', '.join(sorted(set(legs)))})")

    def worker_cores(self, choice: BackendChoice, environ: Mapping[str, str]) -> int:
        leg = choice.leg
        return leg.worker_cores(choice, environ) if leg is not None else 0

    def settings(self, env: "DistEnv", choice: BackendChoice, plan: Any, environ: Mapping[str, str], *,
                 paths: Any = None) -> dict[str, str]:
        leg = choice.leg
        return leg.settings(env, choice, plan, environ, paths=paths) if leg is not None else {}

    def group_options(self, env: "DistEnv", plan: Any) -> ShmOptions:
        return shm_options(plan.choice, async_comm=plan.comm_thread, local_size=env.local_world_size,
                           cpus=plan.compute_cpus)


def _legs_differ(rank: int, legs: list[str], said: list[str]) -> None:
    """Some rank set the leg itself and the ranks' legs differ: they would form mismatched
    node-to-node groups (and hang there), so stop now naming each rank's."""
    shown = ", ".join(f"rank {r}: {leg}" + (f" ({INTER_VAR})" if s.endswith(_SET) else " (the rule)")
                      for r, (leg, s) in enumerate(zip(legs, said)) if r == rank or leg != legs[rank])
    shown = shown if len(shown) <= 400 else shown[:397] + "..."
    raise BackendError(f"rank {rank}: the ranks' shm node-to-node legs differ: {shown}",
                       fix=f"set the same {INTER_VAR} ({', '.join(LEGS)}) on every node, or unset it everywhere")


def shm_options(choice: BackendChoice, *, async_comm: Optional[bool] = None, local_size: Optional[int] = None,
                cpus: Optional[Tuple[int, ...]] = None) -> ShmOptions:
    """The shm group's options (``pg_options``): the agreed node-to-node leg (gloo without one);
    ``async_comm``, ``local_size`` and ``cpus`` as :class:`~cpuddp.backends.shm.api.ShmOptions`."""
    return ShmOptions(inter=choice.inter or LEGS[0], require_leg=choice.inter_set, async_comm=async_comm,
                      local_size=local_size, cpus=cpus)
