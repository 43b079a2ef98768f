"""The settings of one ``cpuddp bench`` run, typed and frozen: :class:`BenchConfig`.

The command line (:mod:`.cli`) parses the options and builds a :class:`BenchConfig` once
(:meth:`BenchConfig.from_args`); the ranks (:mod:`.rank`) and the writers (:mod:`.report`)
take the config, never the parsed options.  Pure: it imports nothing of cpuddp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["BenchConfig", "parse_backends"]

#: Collectives torch has only in-place forms of: their runs are always in place.
_IN_PLACE_ONLY = ("allreduce", "broadcast", "reduce")


def parse_backends(text: str) -> list[str]:
    """``"gloo, shm"`` -> ``["gloo", "shm"]`` (lowercase, in order; no repeats)."""
    names = [b.strip().lower() for b in str(text).split(",")]
    if not names or any(not b for b in names):
        raise ValueError(f"--backend {text!r} must name one backend or several separated by commas, e.g. gloo,shm")
    repeated = sorted({b for b in names if names.count(b) > 1})
    if repeated:
        raise ValueError(f"--backend {text!r} names {', '.join(repeated)} more than once")
    return names


@dataclass(frozen=True)
class BenchConfig:
    """One run's settings; the fields are the options of ``cpuddp bench`` (:mod:`.cli`).

    ``backends`` is ``--backend`` as a tuple (the first forms the default group); ``inplace``
    is true for every collective torch has only in place (allreduce, broadcast, reduce).
    """

    collective: str
    min: int
    max: int
    factor: float
    warmup: int
    iters: int
    dtype: str
    inplace: bool
    check: bool
    backends: tuple[str, ...]
    pin: bool
    nproc: Optional[int]
    timeout: float
    min_busbw: Optional[float]
    ceiling_size: int
    ceiling: bool
    json: Optional[str]
    csv: Optional[str]
    plot: Optional[str]
    rounds: int

    @classmethod
    def from_args(cls, ns: Any) -> BenchConfig:
        """The config of the options :func:`.cli.add_arguments` parsed into ``ns``.

        A ``backend`` given as text is parsed by :func:`parse_backends` (which raises ValueError).
        """
        backends = parse_backends(ns.backend) if isinstance(ns.backend, str) else ns.backend
        return cls(
            collective=ns.collective, min=ns.min, max=ns.max, factor=ns.factor, warmup=ns.warmup, iters=ns.iters,
            dtype=ns.dtype, inplace=bool(ns.inplace or ns.collective in _IN_PLACE_ONLY), check=ns.check,
            backends=tuple(backends), pin=ns.pin, nproc=ns.nproc, timeout=ns.timeout, min_busbw=ns.min_busbw,
            ceiling_size=ns.ceiling_size, ceiling=ns.ceiling, json=ns.json, csv=ns.csv, plot=ns.plot,
            rounds=ns.rounds,
        )
