"""The collective cases of tests/test_shm_collectives.py, shared with the namespace-hosts run
(tests/scripts/shm_ranks.py ``compare``): every collective on the shm default group and on a gloo
group of the same ranks, compared element for element, each rank in a layout of its own.

:func:`every_collective` runs them all and returns ``{"bad": [...], "shm_calls": n, "gloo_inside": bool}``.
"""

from __future__ import annotations

LAYOUTS = ("contiguous", "strided", "transposed")
SENTINEL = -7


# --------------------------------------------------------------------------- rank-side helpers


def _values(seed: int, numel: int, dtype, low: int = -4, high: int = 5):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (numel,), generator=g).to(dtype)


def _in_layout(flat, layout: str):
    """``(view, base)``: a tensor with ``flat``'s values (as 2-D, 4 columns where it divides) in
    ``layout``; ``base`` is the memory it lives in (sentinel elsewhere)."""
    import torch

    n = flat.numel()
    rows, cols = (n // 4, 4) if n % 4 == 0 and n >= 4 else (n, 1) if n else (0, 1)
    values = flat.reshape(rows, cols)
    if layout == "contiguous":
        view = values.clone()
        return view, view
    if layout == "strided":
        base = torch.full((rows, cols * 2 + 1), SENTINEL, dtype=flat.dtype)
        view = base[:, 1::2][:, :cols]
        view.copy_(values)
        return view, base
    base = torch.full((cols, rows), SENTINEL, dtype=flat.dtype)  # transposed: the view is base.t()
    view = base.t()
    view.copy_(values)
    return view, base


def _sentinels_kept(view, base) -> bool:
    import torch

    if view.data_ptr() == base.data_ptr() and view.shape == base.shape:
        return True
    mask = torch.ones(base.shape, dtype=torch.bool)
    probe = torch.zeros(base.shape, dtype=torch.bool)
    probe.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).fill_(True)
    mask &= ~probe
    return bool((base[mask] == SENTINEL).all())


class _Cases:
    """Runs one case on shm (in this rank's layout) and on gloo (contiguous), compares."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.gloo = dist.new_group(backend="gloo")
        self.k = 0
        self.bad: list[str] = []

    def layout(self) -> str:
        self.k += 1
        return LAYOUTS[(self.rank + self.k) % len(LAYOUTS)]

    def check(self, name: str, got, want, view=None, base=None) -> None:
        import torch

        if got.shape != want.shape or not torch.equal(got.reshape(-1), want.reshape(-1)):
            self.bad.append(f"{name}: shm {got.reshape(-1)[:6].tolist()} vs gloo {want.reshape(-1)[:6].tolist()}")
        if view is not None and not _sentinels_kept(view, base):
            self.bad.append(f"{name}: memory outside the view changed")


def _reductions(c: _Cases, numels, dtypes) -> None:
    import torch

    dist = c.dist
    for dtype in dtypes:
        for op in ("SUM", "MAX", "MIN", "PRODUCT"):
            for numel in numels:
                low, high = (1, 3) if op == "PRODUCT" else (-4, 5)
                vals = _values(100 * c.rank + numel, numel, dtype, low, high)
                name = f"all_reduce {op} {dtype} {numel}"
                view, base = _in_layout(vals, c.layout())
                ref = vals.clone()
                dist.all_reduce(view, op=getattr(dist.ReduceOp, op))
                dist.all_reduce(ref, op=getattr(dist.ReduceOp, op), group=c.gloo)
                c.check(name, view.reshape(-1), ref, view, base)
                for root in range(c.n):
                    view, base = _in_layout(vals, c.layout())
                    ref = vals.clone()
                    dist.reduce(view, dst=root, op=getattr(dist.ReduceOp, op))
                    dist.reduce(ref, dst=root, op=getattr(dist.ReduceOp, op), group=c.gloo)
                    want = ref if c.rank == root else vals
                    c.check(f"reduce {op} {dtype} {numel} root {root}", view.reshape(-1), want, view, base)
    avg = _values(c.rank, 1000, torch.float32)
    view, base = _in_layout(avg, c.layout())
    dist.all_reduce(view, op=dist.ReduceOp.AVG)
    want = sum(_values(r, 1000, torch.float32) for r in range(c.n)) / c.n
    c.check("all_reduce AVG", view.reshape(-1), want, view, base)


def _moves(c: _Cases, numels, dtypes) -> None:
    import torch

    dist, n, rank = c.dist, c.n, c.rank
    for dtype in dtypes:
        for numel in numels:
            vals = _values(7 * rank + numel, numel, dtype)
            for root in range(n):
                view, base = _in_layout(vals, c.layout())
                ref = vals.clone()
                dist.broadcast(view, src=root)
                dist.broadcast(ref, src=root, group=c.gloo)
                c.check(f"broadcast {dtype} {numel} root {root}", view.reshape(-1), ref, view, base)
            outs = [_in_layout(torch.zeros(numel, dtype=dtype), c.layout()) for _ in range(n)]
            refs = [torch.zeros(numel, dtype=dtype) for _ in range(n)]
            inp, _ = _in_layout(vals, c.layout())
            dist.all_gather([o for o, _ in outs], inp)
            dist.all_gather(refs, vals.clone(), group=c.gloo)
            for r, ((o, b), ref) in enumerate(zip(outs, refs)):
                c.check(f"all_gather {dtype} {numel} from {r}", o.reshape(-1), ref, o, b)
            single, sbase = _in_layout(torch.zeros(n * numel, dtype=dtype), c.layout())
            sref = torch.zeros(n * numel, dtype=dtype)
            _all_gather_single(dist)(single, inp)
            _all_gather_single(dist)(sref, vals.clone(), group=c.gloo)
            c.check(f"all_gather_single {dtype} {numel}", single.reshape(-1), sref, single, sbase)
            _gather_scatter(c, vals, numel, dtype)


def _all_gather_single(dist):
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single(dist):
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_scatter(c: _Cases, vals, numel: int, dtype) -> None:
    import torch

    dist, n, rank = c.dist, c.n, c.rank
    for root in range(n):
        outs = [_in_layout(torch.zeros(numel, dtype=dtype), c.layout()) for _ in range(n)] if rank == root else None
        refs = [torch.zeros(numel, dtype=dtype) for _ in range(n)] if rank == root else None
        dist.gather(_in_layout(vals, c.layout())[0], [o for o, _ in outs] if outs else None, dst=root)
        dist.gather(vals.clone(), refs, dst=root, group=c.gloo)
        if rank == root:
            for (o, b), ref in zip(outs, refs):
                c.check(f"gather {dtype} {numel} root {root}", o.reshape(-1), ref, o, b)
        parts = [_values(1000 * root + r, numel, dtype) for r in range(n)] if rank == root else None
        out, obase = _in_layout(torch.zeros(numel, dtype=dtype), c.layout())
        ref = torch.zeros(numel, dtype=dtype)
        dist.scatter(out, [_in_layout(p, c.layout())[0] for p in parts] if parts else None, src=root)
        dist.scatter(ref, [p.clone() for p in parts] if parts else None, src=root, group=c.gloo)
        c.check(f"scatter {dtype} {numel} root {root}", out.reshape(-1), ref, out, obase)


def _scatters(c: _Cases, numels, dtypes) -> None:
    """reduce_scatter against the rank-order reduction of the known values, and against gloo's
    result for SUM (torch 2.8's gloo gets a MAX reduce_scatter wrong: it is checked by value only)."""
    import torch

    dist, n, rank = c.dist, c.n, c.rank
    for dtype in dtypes:
        for op in ("SUM", "MAX"):
            fn = torch.add if op == "SUM" else torch.maximum
            for numel in numels:
                parts = [_values(31 * rank + 7 * r + numel, numel, dtype) for r in range(n)]
                want = _values(7 * rank + numel, numel, dtype)
                for r in range(1, n):
                    want = fn(want, _values(31 * r + 7 * rank + numel, numel, dtype))
                out, obase = _in_layout(torch.zeros(numel, dtype=dtype), c.layout())
                dist.reduce_scatter(out, [_in_layout(p, c.layout())[0] for p in parts], op=getattr(dist.ReduceOp, op))
                c.check(f"reduce_scatter {op} {dtype} {numel}", out.reshape(-1), want, out, obase)
                whole = torch.cat(parts)
                inp, _ = _in_layout(whole, c.layout())
                out, obase = _in_layout(torch.zeros(numel, dtype=dtype), c.layout())
                _reduce_scatter_single(dist)(out, inp, op=getattr(dist.ReduceOp, op))
                c.check(f"reduce_scatter_single {op} {dtype} {numel}", out.reshape(-1), want, out, obase)
                if op == "SUM":
                    ref = torch.zeros(numel, dtype=dtype)
                    _reduce_scatter_single(dist)(ref, whole.clone(), group=c.gloo)
                    c.check(f"reduce_scatter_single against gloo {dtype} {numel}", out.reshape(-1), ref)


def _all_to_all(c: _Cases) -> None:
    import torch

    dist, n, rank = c.dist, c.n, c.rank
    for rows in (1, 3, 70000):
        inp = torch.arange(n * rows * 2, dtype=torch.float32).view(n * rows, 2) + 1000 * rank
        out, ref = torch.zeros(n * rows, 2), torch.zeros(n * rows, 2)
        dist.all_to_all_single(out, inp)
        dist.all_to_all_single(ref, inp.clone(), group=c.gloo)
        c.check(f"all_to_all_single {rows} rows", out, ref)
    send = [(rank + d) % 3 for d in range(n)]  # uneven: rank r sends (r + d) % 3 rows to d
    recv = [(s + rank) % 3 for s in range(n)]
    inp = torch.arange(sum(send) * 2, dtype=torch.int64).view(-1, 2) + 100 * rank
    out, ref = torch.zeros(sum(recv), 2, dtype=torch.int64), torch.zeros(sum(recv), 2, dtype=torch.int64)
    dist.all_to_all_single(out, inp, recv, send)
    dist.all_to_all_single(ref, inp.clone(), recv, send, group=c.gloo)
    c.check("all_to_all_single uneven", out, ref)
    ins = [torch.full((2, 3), float(rank * 10 + d)) for d in range(n)]  # gloo's list form: torch 2.9 and later
    outs = [torch.zeros(2, 3) for _ in range(n)]
    dist.all_to_all(outs, [i.t().contiguous().t() for i in ins])
    for s, o in enumerate(outs):
        c.check(f"all_to_all from {s}", o, torch.full((2, 3), float(s * 10 + rank)))
    ins = [torch.full((d + 1, 3), float(rank * 10 + d)) for d in range(n)]  # uneven: gloo takes equal sizes only
    outs = [torch.zeros(rank + 1, 3) for _ in range(n)]
    dist.all_to_all(outs, ins)
    for s, o in enumerate(outs):
        c.check(f"all_to_all uneven from {s}", o, torch.full((rank + 1, 3), float(s * 10 + rank)))


def _coalesced_p2p_objects(c: _Cases) -> None:
    import torch

    dist, n, rank = c.dist, c.n, c.rank
    a, b = torch.full((5,), float(rank + 1)), torch.arange(7.0) * (rank + 1)  # gloo: one dtype per call
    ra, rb = a.clone(), b.clone()
    with dist._coalescing_manager(async_ops=False):
        dist.all_reduce(a)
        dist.all_reduce(b)
    with dist._coalescing_manager(group=c.gloo, async_ops=False):
        dist.all_reduce(ra, group=c.gloo)
        dist.all_reduce(rb, group=c.gloo)
    c.check("all_reduce coalesced a", a, ra)
    c.check("all_reduce coalesced b", b, rb)
    mixed = [torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.bfloat16)]
    with dist._coalescing_manager(async_ops=False):
        for t in mixed:
            dist.all_reduce(t)
    c.check("all_reduce coalesced, mixed dtypes", torch.cat([t.float() for t in mixed]), torch.full((5,), float(n)))
    outs = [torch.zeros(n * 3), torch.zeros(n * 4)]
    with dist._coalescing_manager(async_ops=False):
        _all_gather_single(dist)(outs[0], torch.full((3,), float(rank)))
        _all_gather_single(dist)(outs[1], torch.full((4,), float(-rank)))
    c.check("all_gather_single coalesced", torch.cat(outs),
            torch.cat([torch.arange(n).repeat_interleave(3).float(), -torch.arange(n).repeat_interleave(4).float()]))
    rs = [torch.zeros(2), torch.zeros(3)]
    with dist._coalescing_manager(async_ops=False):
        _reduce_scatter_single(dist)(rs[0], torch.ones(2 * n))
        _reduce_scatter_single(dist)(rs[1], torch.full((3 * n,), 2.0))
    c.check("reduce_scatter_single coalesced", torch.cat(rs), torch.tensor([n, n, 2 * n, 2 * n, 2 * n], dtype=torch.float32))
    send, got = torch.arange(5.0) + rank, torch.zeros(5)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, got, (rank - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    c.check("send/recv ring", got, torch.arange(5.0) + (rank - 1) % n)
    big = torch.arange(3 << 20, dtype=torch.float32) if rank == 0 else torch.zeros(3 << 20)
    strided = torch.zeros(3 << 20, 2)[:, 0]
    if rank == 0:
        dist.send(big, dst=n - 1, tag=5)
    elif rank == n - 1:
        dist.recv(strided, src=0, tag=5)
        c.check("send/recv 12 MiB into a strided tensor", strided, torch.arange(3 << 20, dtype=torch.float32))
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "text": "x" * rank})
    c.check("all_gather_object", torch.tensor([o["rank"] for o in objs]), torch.arange(n))
    box = [{"from": rank}]
    dist.broadcast_object_list(box, src=n - 1)
    c.check("broadcast_object_list", torch.tensor(box[0]["from"]), torch.tensor(n - 1))
    dist.barrier()


def every_collective(numels, dtypes):
    import torch
    import torch.distributed as dist

    c = _Cases()
    dtypes = [getattr(torch, d) for d in dtypes]
    world = dist.group.WORLD
    before = world.shm_calls
    _reductions(c, numels, dtypes)
    _moves(c, numels, dtypes)
    _scatters(c, numels, dtypes)
    _all_to_all(c)
    _coalesced_p2p_objects(c)
    return {"bad": c.bad, "shm_calls": world.shm_calls - before, "gloo_inside": world._world is not None}
