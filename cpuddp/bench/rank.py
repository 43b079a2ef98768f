"""Inside one rank of ``cpuddp bench``: form the group, time the collectives, check their results,
exchange what rank 0 reports, and leave the group within a bound.

Every rank runs :func:`run_rank`; only rank 0 prints (:mod:`cpuddp.bench.report`).  Time: each
rank times ``--iters`` back-to-back calls after ``--warmup`` calls (a barrier before each) and
divides by ``--iters``; the reported time is the maximum over ranks of that mean.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from cpuddp.topology.model import format_cpulist

from . import report
from .report import out
from .sweep import DTYPES, EXIT_OK, EXIT_WRONG, Row, backend_row, make_row, shaped_sizes, summarize

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .config import BenchConfig

__all__ = ["run_rank", "data_path", "exchange_json", "measure_copy_bandwidth", "TEARDOWN_TIMEOUT"]

#: Seconds the teardown waits for torch's destroy_process_group before abandoning it.
TEARDOWN_TIMEOUT = 10.0


def run_rank(cfg: BenchConfig) -> int:
    """The benchmark inside one rank (every rank runs this; rank 0 prints)."""
    env = _init(cfg.backends[0], cfg.timeout, cfg.pin)
    finished = False
    try:
        code = _run_rank(cfg, env)
        finished = True
        return code
    finally:
        _teardown(finished)


def _init(backend: str, timeout: float, pin: bool) -> Any:
    """Form the process group with :func:`cpuddp.init_distributed`; return its DistEnv."""
    import torch.distributed as dist

    from cpuddp.distributed import get_session, init_distributed

    env = init_distributed(backend, timeout=min(timeout, 300.0), pin=pin)
    if not dist.is_initialized():
        # A single process with no launcher: a world of one still runs the collectives.
        session = get_session()
        dist.init_process_group((session.backend if session else None) or "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    return env


def _run_rank(cfg: BenchConfig, env: Any) -> int:
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    meta = _meta(cfg, env, n)
    if rank == 0:
        for line in report.header_lines(meta):
            out(line)
    shaped = shaped_sizes(cfg.min, cfg.max, cfg.factor, cfg.collective, n, DTYPES[cfg.dtype][1])
    if len(cfg.backends) > 1:
        return _compare_backends(cfg, shaped, rank, n, meta)
    return _sweep(cfg, shaped, rank, n, meta)


def _meta(cfg: BenchConfig, env: Any, n: int) -> dict[str, Any]:
    """The run's metadata (every rank takes part: it exchanges the ranks' details, times the ceiling)."""
    import torch.distributed as dist

    from cpuddp._compat import versions

    from cpuddp.distributed import get_session

    infos = exchange_json(_rank_info())
    session = get_session()  # what init chose: the backend, the pin plan
    plan = session.pin_plan if session is not None else None
    ceiling = _ceiling_all_at_once(cfg.ceiling_size, len({i["host_id"] for i in infos})) if cfg.ceiling else None
    backend = str(dist.get_backend())
    chosen = session.backend if session is not None else None
    return {
        "collective": cfg.collective, "nranks": n,
        "nodes": len({i["host_id"] for i in infos}),  # hostname, boot and network namespace
        "launcher": getattr(env, "launcher", None) or ("env" if n > 1 else "none"),
        "backend": backend if not chosen or chosen == backend else f"{chosen} (process group: {backend})",
        "data_path": data_path(dist.group.WORLD),
        "versions": versions(("torch", "cpuddp", "oneccl_bind_pt", "ipex"), imported_torch=True),
        "min": cfg.min, "max": cfg.max, "factor": cfg.factor,
        "warmup": cfg.warmup, "iters": cfg.iters, "dtype": cfg.dtype, "inplace": cfg.inplace,
        "check": cfg.check, "pin": cfg.pin,
        "pin_plan": report.plan_text(plan), "pin_plan_dict": plan.as_dict() if hasattr(plan, "as_dict") else None,
        "ranks": infos, "ceiling": ceiling, "time": "max over ranks of mean per-iteration time",
        "env": env.as_dict() if hasattr(env, "as_dict") else None,
    }


def data_path(group: Any) -> str:
    """The data path ``group``'s collectives take, as the job's header names it: the shm group's
    own words (``native data path, avx2``, ``Python data path: <why>``), else its backend's name
    (gloo, ccl: the backend moves the bytes itself)."""
    import torch.distributed as dist

    return str(getattr(group, "data_path", "") or dist.get_backend(group))


def _ceiling_all_at_once(nbytes: int, nodes: int) -> dict[str, Any]:
    """The copy bandwidth each rank gets while every rank copies (a barrier before each copy):
    what N ranks share, not what one rank alone gets.  ``gbps``: the ranks' median;
    ``node_gbps``: their sum per node."""
    import torch.distributed as dist

    dist.barrier()
    mine = measure_copy_bandwidth(nbytes, sync=dist.barrier)
    rates = [r["gbps"] for r in exchange_json(mine)]
    return dict(mine, gbps=statistics.median(rates), node_gbps=sum(rates) / max(1, nodes), ranks=len(rates),
                rank_gbps=rates)


def _node_gbps(meta: dict[str, Any]) -> Any:
    c = meta.get("ceiling")
    return c.get("node_gbps", c["gbps"]) if c else None


def _sweep(cfg: BenchConfig, shaped: Sequence[tuple[int, int]], rank: int, n: int,
           meta: dict[str, Any]) -> int:
    """The nccl-tests table: one row per size."""
    dtype = _torch_dtype(cfg.dtype)
    rows: list[Row] = []
    if rank == 0:
        for line in report.format_rows([]):
            out(line)
    for nbytes, count in shaped:
        op = _make_op(cfg.collective, count, dtype, cfg.inplace, rank, n)
        seconds = _max_over_ranks(_timed(op.call, cfg.warmup, cfg.iters))
        wrong = _sum_over_ranks(_check(op, dtype)) if cfg.check else -1
        row = make_row(cfg.collective, n, nbytes, count, cfg.dtype, seconds, wrong, cfg.inplace, _node_gbps(meta))
        rows.append(row)
        if rank == 0:
            out(report.format_row(row))
        del op
    ceiling = meta.get("ceiling")
    summary = summarize(rows, cfg.min_busbw, ceiling["gbps"] if ceiling and n > 1 else None)  # 1 rank: no fraction
    if rank == 0:
        for line in report.format_summary(summary):
            out(line)
        result = {"format": "cpuddp-bench/1", "meta": meta, "rows": [asdict(r) for r in rows], "summary": summary}
        report.write_outputs(cfg, result, rows)
    return int(summary["exit_code"])


def _compare_backends(cfg: BenchConfig, shaped: Sequence[tuple[int, int]], rank: int, n: int,
                      meta: dict[str, Any]) -> int:
    """Time each backend of ``--backend a,b,...`` in the same ranks, interleaved, size by size.

    The first backend is the default group's; each other one gets a group of all ranks made with
    ``new_group(backend=...)``.  Per size and backend: ``--rounds`` rounds of the sweep's timed
    loop in ABBA order, the median round reported (max over ranks, as in the sweep).
    """
    import torch.distributed as dist

    from cpuddp.backends.registry import load_backend

    dtype = _torch_dtype(cfg.dtype)
    names = list(cfg.backends)
    groups: dict[str, Any] = {names[0]: None}
    for b in names[1:]:
        load_backend(b)
        groups[b] = dist.new_group(backend=b)
    paths = {b: data_path(groups[b] or dist.group.WORLD) for b in names}
    if rank == 0:
        out(f"# compare backends: {', '.join(names)} in the same {n} ranks; per size {cfg.rounds} round(s) of "
            f"{cfg.iters} timed calls each, interleaved (ABBA), median round; ratio = {names[0]} time / other's")
        out(report.data_paths_line(paths))
        for line in report.format_backend_head(names):
            out(line)
    out_rows: list[dict[str, Any]] = []
    wrong_total = 0
    for nbytes, count in shaped:
        ops = {b: _make_op(cfg.collective, count, dtype, cfg.inplace, rank, n, groups[b]) for b in names}
        times: dict[str, list[float]] = {b: [] for b in names}
        for i in range(cfg.rounds):
            for b in (names if i % 2 == 0 else names[::-1]):
                times[b].append(_max_over_ranks(_timed(ops[b].call, cfg.warmup, cfg.iters)))
        rows = {}
        for b in names:
            wrong = _sum_over_ranks(_check(ops[b], dtype)) if cfg.check else -1
            wrong_total += max(wrong, 0)
            rows[b] = make_row(cfg.collective, n, nbytes, count, cfg.dtype, statistics.median(times[b]), wrong,
                               cfg.inplace, _node_gbps(meta))
        out_rows.append(backend_row(names, rows, times))
        if rank == 0:
            out(report.format_backend_row(out_rows[-1], names))
        del ops
    code = EXIT_WRONG if wrong_total else EXIT_OK
    if rank == 0:
        for line in report.backend_footer(names, out_rows, meta.get("ceiling") if n > 1 else None, cfg.check,
                                          wrong_total, code):
            out(line)
        result = {"format": "cpuddp-bench-backends/1", "meta": dict(meta, backends=names, data_paths=paths),
                  "rows": out_rows}
        report.write_backend_outputs(cfg, result)
    return code


# --------------------------------------------------------------------------- one size's buffers and calls


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


@dataclass
class _Op:
    """The buffers and the call of one size: ``call`` is what :func:`_timed` times; ``fill``,
    ``result`` and ``expected`` serve the correctness check (:func:`_check`)."""

    call: Callable[[], Any]
    fill: Callable[[], None]
    result: Callable[[], "torch.Tensor"]
    expected: Callable[[], "torch.Tensor"]


def _pattern(count: int, rank: int, dtype: "torch.dtype") -> "torch.Tensor":
    """Small whole numbers (0-4): their sums stay exact up to 31 ranks in int8, 64 in bfloat16."""
    import torch

    return ((torch.arange(count, dtype=torch.int64) + rank) % 5).to(dtype)


def _summed(count: int, n: int) -> "torch.Tensor":
    import torch

    total = torch.zeros(count, dtype=torch.float64)
    for r in range(n):
        total += _pattern(count, r, torch.float64)
    return total


def _make_op(collective: str, count: int, dtype: "torch.dtype", inplace: bool, rank: int, n: int,
             group: Any = None) -> _Op:
    """The buffers and call of one size, on ``group`` (None: the default group)."""
    import torch
    import torch.distributed as dist

    # torch 2.13 renamed the tensor forms (the old names warn); use the new ones when present.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    chunk = count // n
    lo, hi = rank * chunk, (rank + 1) * chunk

    if collective in ("allreduce", "broadcast"):
        buf = torch.zeros(count, dtype=dtype)
        if collective == "allreduce":
            return _Op(lambda: dist.all_reduce(buf, group=group), lambda: buf.copy_(_pattern(count, rank, dtype)),
                       lambda: buf, lambda: _summed(count, n))
        return _Op(lambda: dist.broadcast(buf, 0, group=group),
                   lambda: buf.copy_(_pattern(count, 0, dtype) if rank == 0 else torch.full((count,), 7, dtype=dtype)),
                   lambda: buf, lambda: _pattern(count, 0, torch.float64))

    if collective == "all_gather":
        gathered = torch.zeros(count, dtype=dtype)
        mine = gathered[lo:hi] if inplace else torch.zeros(chunk, dtype=dtype)

        def fill_gather() -> None:
            gathered.fill_(7)
            mine.copy_(_pattern(chunk, rank, dtype))

        return _Op(lambda: all_gather(gathered, mine, group=group), fill_gather, lambda: gathered,
                   lambda: torch.cat([_pattern(chunk, r, torch.float64) for r in range(n)]))

    if collective == "reduce_scatter":
        inp = torch.zeros(count, dtype=dtype)
        res = inp[lo:hi] if inplace else torch.zeros(chunk, dtype=dtype)

        def fill_scatter() -> None:
            inp.copy_(_pattern(count, rank, dtype))
            if not inplace:
                res.fill_(7)

        return _Op(lambda: reduce_scatter(res, inp, group=group), fill_scatter, lambda: res,
                   lambda: _summed(count, n)[lo:hi])

    return _rooted_op(collective, count, dtype, rank, n, group)


def _rooted_op(collective: str, count: int, dtype: "torch.dtype", rank: int, n: int, group: Any) -> _Op:
    """reduce, gather, scatter (root 0), all_to_all and barrier."""
    import torch
    import torch.distributed as dist

    chunk = count // n
    if collective == "reduce":
        buf = torch.zeros(count, dtype=dtype)
        # only the root's tensor has a defined value afterwards (gloo uses the others' as scratch)
        return _Op(lambda: dist.reduce(buf, 0, group=group), lambda: buf.copy_(_pattern(count, rank, dtype)),
                   lambda: buf, lambda: _summed(count, n) if rank == 0 else buf.to(torch.float64))
    if collective == "gather":
        mine = torch.zeros(chunk, dtype=dtype)
        parts = [torch.zeros(chunk, dtype=dtype) for _ in range(n)] if rank == 0 else None
        return _Op(lambda: dist.gather(mine, parts, 0, group=group), lambda: mine.copy_(_pattern(chunk, rank, dtype)),
                   lambda: torch.cat(parts) if parts else mine,
                   lambda: torch.cat([_pattern(chunk, r, torch.float64) for r in range(n)]) if rank == 0
                   else _pattern(chunk, rank, torch.float64))
    if collective == "scatter":
        got = torch.zeros(chunk, dtype=dtype)
        parts = [_pattern(chunk, r, dtype) for r in range(n)] if rank == 0 else None
        return _Op(lambda: dist.scatter(got, parts, 0, group=group), lambda: got.fill_(7), lambda: got,
                   lambda: _pattern(chunk, rank, torch.float64))
    if collective == "all_to_all":
        inp, out = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)

        def fill_a2a() -> None:
            inp.copy_(_pattern(count, rank, dtype))
            out.fill_(7)

        return _Op(lambda: dist.all_to_all_single(out, inp, group=group), fill_a2a, lambda: out,
                   lambda: torch.cat([_pattern(count, r, torch.float64)[rank * chunk:(rank + 1) * chunk]
                                      for r in range(n)]))
    if collective == "barrier":
        nothing = torch.zeros(0)
        return _Op(lambda: dist.barrier(group=group), lambda: None, lambda: nothing, lambda: nothing.double())
    raise ValueError(f"unknown collective {collective!r}")


def _timed(call: Callable[[], Any], warmup: int, iters: int) -> float:
    """Mean seconds per call on this rank: ``warmup`` calls, a barrier, ``iters`` timed calls.

    This is the loop every sweep row is measured with.
    """
    import torch.distributed as dist

    dist.barrier()
    for _ in range(warmup):
        call()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sum_over_ranks(value: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _check(op: _Op, dtype: "torch.dtype") -> int:
    """Elements on this rank that differ from the expected result of one call."""
    import torch

    op.fill()
    op.call()
    got = op.result().to(torch.float64)
    want = op.expected()
    rtol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}.get(dtype, 0.0)
    bad = ~torch.isclose(got, want, rtol=rtol, atol=0.0)
    return int(bad.sum().item())


# --------------------------------------------------------------------------- the rank's surroundings


def measure_copy_bandwidth(nbytes: int, reps: int = 5, sync: Optional[Callable[[], Any]] = None) -> dict[str, Any]:
    """Median rate of ``dst.copy_(src)`` over ``reps`` runs of ``nbytes`` (GB/s = 1e9 B/s copied);
    ``sync()`` before each run (a barrier: every rank copies at once)."""
    import torch

    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    dst.copy_(src)  # first touch and warm-up
    rates = []
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        rates.append(n * 4 / 1e9 / dt)
    return {"gbps": statistics.median(rates), "bytes": n * 4, "reps": reps, "threads": torch.get_num_threads(),
            "min_gbps": min(rates), "max_gbps": max(rates),
            "how": "torch.Tensor.copy_ of a float32 buffer, median; GB/s = bytes copied / 1e9 / s "
                   "(memory traffic is twice that: read + write)"}


def _rank_info() -> dict[str, Any]:
    import torch

    from cpuddp.topology import here

    cpus = list(here.allowed_cpus())
    return {"host": here.hostname(), "host_id": here.host_identity(), "pid": os.getpid(), "cpus": format_cpulist(cpus),
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def exchange_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order, through two tensor collectives.

    Not ``all_gather_object``: that needs numpy, which a bare torch install lacks.
    """
    import torch
    import torch.distributed as dist

    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    n = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(x.item()) for x in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    got = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(got, padded, group=group)
    return [json.loads(bytes(g[:int(k.item())].tolist()).decode()) for g, k in zip(got, sizes)]


def _teardown(finished: bool, limit: float = TEARDOWN_TIMEOUT) -> None:
    """Leave the group; a barrier first only when this rank finished (a failed peer would hang it).

    Bounded: a ``destroy_process_group`` that hangs (a peer gone mid-collective) is abandoned
    after ``limit`` seconds on a daemon thread, with a line on stderr.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if finished:
            dist.barrier()
    finally:
        from cpuddp.distributed import shutdown

        shutdown()  # bounded: it abandons a torch teardown that hangs
        if dist.is_initialized():
            _bounded(dist.destroy_process_group, limit, "destroy_process_group")


def _bounded(fn: Callable[[], Any], limit: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread; True when it returned within ``limit`` seconds."""
    import threading

    t = threading.Thread(target=fn, name=f"cpuddp-bench-{what}", daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        sys.stderr.write(f"# cpuddp bench: {what} did not return within {limit:g} s; leaving it\n")
        return False
    return True
