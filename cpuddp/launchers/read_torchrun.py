"""torchrun / TorchElastic's workers: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, ...

Its variables, and why torchrun is tried first, are in the registry's table
(:mod:`cpuddp.launchers.registry`).
"""

from __future__ import annotations

from typing import Mapping

from cpuddp.errors import LauncherEnvError

from .readers import LauncherReader, PartialEnv

__all__ = ["TorchrunReader"]


class TorchrunReader(LauncherReader):
    description = "torchrun / TorchElastic"
    rank_variable = "RANK"

    def read(self, environ: Mapping[str, str]) -> PartialEnv:
        v = self.variables(environ)
        fix = "run the script with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* for each worker)"
        out = v.world("RANK", "WORLD_SIZE", fix=fix)
        out.local_rank = v.int("LOCAL_RANK", fix=fix, into="local_rank")
        out.local_world_size = v.maybe_int("LOCAL_WORLD_SIZE", minimum=1, into="local_world_size")
        out.node_rank = v.maybe_int("GROUP_RANK", into="node_rank")
        out.num_nodes = v.maybe_int("GROUP_WORLD_SIZE", minimum=1)
        out.job_id = environ.get("TORCHELASTIC_RUN_ID") or None
        out.agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        for var in ("MASTER_ADDR", "MASTER_PORT") if out.agent_store else ():
            if not v.has(var):
                raise LauncherEnvError(
                    "torchrun's agent hosts the rendezvous store but did not say where",
                    variable=var,
                    value=None,
                    launcher=v.launcher,
                    fix="launch with torchrun, which sets MASTER_ADDR and MASTER_PORT itself",
                )
        return out

    def detect(self, environ: Mapping[str, str]) -> bool:
        return self.variables(environ).has("TORCHELASTIC_RUN_ID", "GROUP_RANK")
