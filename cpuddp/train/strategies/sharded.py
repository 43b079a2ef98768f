"""What the sharded strategies (``shard="optimizer"``, ``shard="full"``) share: the checks of
the options that go with any sharding, DDP's strategy at world size 1, and the note that
torch's object collectives run without numpy.
"""

from __future__ import annotations

import logging
from typing import Optional

from cpuddp.errors import PrepareError

from ..common.objects import without_numpy
from .base import Options, Strategy
from .ddp import DdpStrategy

__all__ = ["ShardedStrategy", "scope_error"]

_log = logging.getLogger("cpuddp.prepare")


def scope_error(scope: Optional[str], shard: Optional[str]) -> PrepareError:
    """``shard_scope`` that is not one of its values, or given with another mode than ``"full"``."""
    return PrepareError(f"shard_scope must be None, 'node' or 'world' with shard='full'. Got {scope!r} "
                        f"with shard={shard!r}.", fix="drop shard_scope (default: within each node, HSDP across nodes)")


class ShardedStrategy(Strategy):
    """A mode that spreads state over the ranks; subclasses check their own options
    (:meth:`check_mode_options`) and wrap."""

    shards = True

    def check_request(self, options: Options) -> None:
        shard = self.name
        if options.ipex is True:
            raise PrepareError(f"ipex=True with shard={shard!r}: IPEX's fused optimizer steps whole parameters "
                               "of its own copy and cannot be sharded.", fix="pass ipex=None (or False) with shard=")
        if options.ddp is False:
            raise PrepareError(f"ddp=False with shard={shard!r}: sharding is data parallel.", fix="drop ddp=False")
        if options.compile:
            raise PrepareError(f"compile={options.compile!r} with shard={shard!r}: torch.compile over the sharded "
                               "model is not tested by cpuddp yet.", fix="pass compile=False with shard=")
        self.check_mode_options(options)

    def check_mode_options(self, options: Options) -> None:
        """This mode's own checks, after those of any sharding."""

    def in_world(self, world: int, notes: list[str]) -> Strategy:
        if world > 1:
            return self
        _log.info("shard=%r at world size 1: nothing to shard; the model is prepared unsharded", self.name)
        notes.append(f"shard={self.name!r} not applied: world size 1")
        return DdpStrategy()

    def note_numpy(self, notes: list[str]) -> None:
        """A note when numpy is missing: DCP's object collectives (a sharded model's checkpoint) go without it."""
        if without_numpy():
            notes.append("numpy not installed: torch's object collectives (DCP's) copy their bytes without it")
