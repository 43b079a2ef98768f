"""Plain ``RANK``/``WORLD_SIZE``, as Kubeflow's PyTorchJob (or a user) exports them.

Tried last of the built-ins: these are also what cpuddp exports for torch and child processes.
"""

from __future__ import annotations

from typing import Mapping

from cpuddp.errors import LauncherEnvError

from .env import Provenance
from .parsers import is_loopback
from .readers import LauncherReader, PartialEnv, Variables

__all__ = ["PlainEnvReader"]


class PlainEnvReader(LauncherReader):
    """``RANK``/``WORLD_SIZE`` as Kubeflow's PyTorchJob (or a user) exports them."""

    description = "RANK/WORLD_SIZE (Kubeflow or exported by hand)"
    rank_variable = "RANK"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has("RANK", "WORLD_SIZE")

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        if not v.has("RANK") and v.has("LOCAL_RANK"):
            raise _framework_child(environ)
        fix = "export both RANK and WORLD_SIZE (as Kubeflow PyTorchJob does), or launch with torchrun or mpiexec"
        out = v.world("RANK", "WORLD_SIZE", fix=fix)
        out.node_rank = v.maybe_int("NODE_RANK", "GROUP_RANK", into="node_rank")
        # A torchrun-like agent (cpuddp.testing) may host the store for every rank.
        out.agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self._local(v, out)
        return out

    @staticmethod
    def _local(v: Variables, out: PartialEnv) -> None:
        if v.has("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            v.local(out, ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",))
        elif is_loopback(v.environ.get("MASTER_ADDR", "")):
            # Rank 0 on loopback is reachable from this host only: every rank is here.
            out.local_rank, out.local_world_size = out.rank, out.world_size
            how = Provenance.derived("MASTER_ADDR is loopback")
            out.sources.update(local_rank=how, local_world_size=how)
        elif v.has("MASTER_ADDR"):
            # Kubeflow PyTorchJob without torchrun: one process per pod.
            out.local_rank, out.local_world_size = 0, 1
            how = Provenance.derived("one process per host")
            out.sources.update(local_rank=how, local_world_size=how)
        elif out.world_size > 1:
            raise LauncherEnvError(
                "RANK and WORLD_SIZE are set, but neither MASTER_ADDR nor LOCAL_WORLD_SIZE says where rank 0 runs",
                variable="MASTER_ADDR",
                value=None,
                launcher=v.launcher,
                fix="export MASTER_ADDR=<rank 0's host> (127.0.0.1 when every rank runs on this machine)",
            )


def _framework_child(environ: Mapping[str, str]) -> LauncherEnvError:
    """``WORLD_SIZE`` and ``LOCAL_RANK`` without ``RANK``: how Lightning's ``devices=N``
    self-launch starts its extra ranks.  A script that calls ``init_distributed()`` before
    ``Trainer``/``Fabric`` would otherwise form a group Lightning does not know about."""
    return LauncherEnvError(
        f"WORLD_SIZE={environ.get('WORLD_SIZE')} and LOCAL_RANK={environ.get('LOCAL_RANK')} are set but RANK is not: "
        "a framework started this process (Lightning's devices=N self-launch does exactly this) after "
        "cpuddp.init_distributed() ran in its parent",
        variable="RANK", value=None, launcher="a framework's own launch (Lightning devices=N?)",
        fix="with Lightning/Fabric do not call cpuddp.init_distributed() before Trainer/Fabric in a plain `python` "
        "run: pass strategy=cpuddp.lightning.trainer_strategy() (Fabric: fabric_strategy()), which forms cpuddp's "
        "group in every rank Lightning starts; or start the ranks with torchrun --nproc-per-node N / mpiexec -n N",
    )
