"""The node-to-node leg over MPI: a group of ranks over one MPI communicator, with the methods of
a torch process group that the shm group's hierarchy, world route, all_to_all and send/recv call
(the same calls they make of a gloo group; each collective's Work has finished when it returns,
send/recv's when it is waited for).

Every result is the same bits on every rank, and the same as the shm engine's for the same
inputs: MPI only moves bytes (:mod:`cpuddp.backends.shm.cross.mpi_comm`), and each element is
reduced once, by one rank, with the shm engine's reduce in rank order
(:func:`~cpuddp.backends.shm.python.ops.rows_reducer`: float16 and bfloat16 rounded at each step,
as the shm engine sums them; integers exact).  How:

* all_reduce of up to :data:`GATHER_ALL` bytes in all (the tensor times the ranks): one
  all-gather, which carries the call's descriptor too, then every rank reduces all rows in rank
  order -- one MPI call, and every rank computes the same sum from the same rows;
* larger: an all-to-all hands rank ``i`` every rank's part ``i`` (the tensor cut in equal parts;
  the fewer-than-ranks elements left over go to every rank beside it), it reduces them, and an
  all-gather hands every rank every part (MPI's reduce-scatter plus all-gather, with the
  reduction ours).  MPI's collectives of equal counts, not their ``v`` forms: those move a large
  message in many more steps, each needing a look at the request (16 MiB: 168 ms against 18 ms
  with MPICH, polled every 50 us);
* reduce_scatter: the all-to-all and the reduction; reduce: all_reduce's gather or all-to-all,
  the rows gathered at the root; broadcast, all_gather, gather, scatter, all_to_all, barrier,
  send/recv: MPI's own, on bytes.

A tensor that is not contiguous goes through a contiguous copy (and back, for an output).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from cpuddp.errors import BackendError

from ..protocol.descriptor import encode
from ..python.ops import AVG, flat_bytes, reducer, rows_reducer, staged
from ..routes.stream import ShmWork
from .mpi_comm import MpiComm, _nbytes

__all__ = ["MpiGroup", "GATHER_ALL", "MpiWork"]

#: all_reduce gathers every rank's whole tensor (one MPI call) up to this many bytes in all;
#: above it, an all-to-all and an all-gather move each byte twice, not ``ranks`` times.
GATHER_ALL = 256 << 10
#: all_reduce's scratch (every rank's part of the tensor, as large as the tensor) is kept for the
#: next call up to this many bytes: a fresh buffer of tens of MiB is new pages for the kernel to
#: fault in and zero at every call (glibc maps allocations over 32 MiB afresh each time).
KEEP_SCRATCH = 256 << 20
#: A barrier's descriptor (the same for every barrier).
_BARRIER = encode("barrier", [])


def _op(opts: Any) -> Any:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    return getattr(op, "op", op)


def _parts(n: int, size: int) -> List[int]:
    """``n`` elements cut into ``size`` parts, the first ``n % size`` one longer."""
    return [n // size + (i < n % size) for i in range(size)]


def _offsets(counts: Sequence[int]) -> List[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


class MpiWork(dist.Work):
    """A send's or recv's Work: ``wait()`` polls its request (the leg's wait policy)."""

    def __init__(self, comm: MpiComm, req: Any, what: str, nbytes: int, after: Optional[Callable[[], None]] = None,
                 status: Any = None) -> None:
        super().__init__()
        self._comm, self._req, self._what, self._after, self._status = comm, req, what, after, status
        self._nbytes = nbytes
        self._done = False

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if not self._done:
            self._comm.wait([self._req], self._what, None if self._status is None else [self._status],
                            nbytes=self._nbytes)
            self._done = True
            after, self._after = self._after, None
            if after is not None:
                after()
        return True

    def is_completed(self) -> bool:
        return self._done

    def _source_rank(self) -> int:  # torch's recv from any source asks it
        self.wait()
        return int(self._status.Get_source())


class MpiGroup:
    """A group of ranks over an MPI communicator (:class:`~.mpi_comm.MpiComm`)."""

    def __init__(self, comm: MpiComm) -> None:
        self.c = comm
        self._rank, self._size = comm.rank, comm.size
        self._scratch: Optional[torch.Tensor] = None  # all_reduce's, kept (KEEP_SCRATCH)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ reductions

    def _all_reduce(self, flat: torch.Tensor, code: Any) -> None:
        """``flat`` (contiguous, 1-D) reduced in place over the group (see the module docstring)."""
        fn = rows_reducer(reducer(code, flat.dtype), flat.dtype)
        c, n, p = self.c, flat.numel(), self._size
        call = encode("all_reduce", [flat], op=int(code))
        if p == 1:
            return c.run(call, "all_reduce", [])
        if n * flat.element_size() * p <= GATHER_ALL or n < p:
            fn(c.gather_rows(call, "all_reduce", flat.data_ptr(), n * flat.element_size(), flat.dtype), flat)
            return None
        k, es = n // p, flat.element_size()
        body, rest = flat[:k * p], flat[k * p:]
        scratch = self._take_scratch(n * es + p * rest.numel() * es)
        mine = scratch[:p * k * es].view(flat.dtype).view(p, k)
        extra = scratch[p * k * es:(p * k + p * rest.numel()) * es].view(flat.dtype).view(p, rest.numel())
        per, me = k * es, self._rank

        def scatter_parts() -> list:
            reqs = [c.comm.Ialltoall(c.buf(body, per), c.buf(mine, per))]
            if rest.numel():  # fewer elements than ranks left over: each rank has them all
                reqs.append(c.comm.Iallgather(c.buf(rest), c.buf(extra, rest.numel() * rest.element_size())))
            return reqs

        def gather_back() -> Any:
            fn(mine, body[me * k:(me + 1) * k])
            if rest.numel():
                fn(extra, rest)
            return c.comm.Iallgather(c.MPI.IN_PLACE, c.buf(body, per))

        c.run(call, "all_reduce", [scatter_parts, gather_back], _nbytes(flat))
        self._keep_scratch(scratch)
        return None

    def _take_scratch(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of scratch: the kept buffer where it is large enough (taken while in use, so
        a call made meanwhile, from another thread, gets its own), else a new one."""
        kept, self._scratch = self._scratch, None
        if kept is not None and kept.numel() >= nbytes:
            return kept
        return torch.empty(nbytes, dtype=torch.uint8)

    def _keep_scratch(self, scratch: torch.Tensor) -> None:
        if scratch.numel() <= KEEP_SCRATCH and (self._scratch is None or self._scratch.numel() < scratch.numel()):
            self._scratch = scratch

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> ShmWork:
        code = _op(opts)
        for t in tensors:
            with staged(t, out=True) as flat:
                self._all_reduce(flat, code)
                if code == AVG:
                    flat.div_(self._size)
        return ShmWork.done(list(tensors))

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> ShmWork:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any) -> ShmWork:
        """The root's tensor gets the reduction (every rank's rows gathered there, reduced in rank order)."""
        t, root, code = tensors[0], int(opts.rootRank), _op(opts)
        fn = rows_reducer(reducer(code, t.dtype), t.dtype)
        c, p = self.c, self._size
        with staged(t, out=self._rank == root) as flat:
            rows = torch.empty((p, flat.numel()), dtype=flat.dtype) if self._rank == root else None
            call = encode("reduce", [flat], op=int(code), root=root)

            def at_root() -> None:
                if rows is not None:
                    fn(rows, flat)
                    if code == AVG:
                        flat.div_(p)

            per = flat.numel() * flat.element_size()
            c.run(call, "reduce", [lambda: c.comm.Igather(c.buf(flat), c.buf(rows, per) if rows is not None else None,
                                                          root), at_root], per * p)
        return ShmWork.done(list(tensors))

    def reduce_scatter(self, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]],
                       opts: Any = None) -> ShmWork:
        out = outputs[0]
        whole = torch.cat([i.reshape(-1) for i in inputs[0]])
        return self._reduce_scatter_base(out, whole, opts, kind="reduce_scatter", result=list(outputs))

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None, *,
                             kind: str = "reduce_scatter_single", result: Any = None) -> ShmWork:
        code, c, p = _op(opts), self.c, self._size
        if inp.numel() != output.numel() * p:
            raise BackendError(f"{kind}: rank {self._rank} passed {inp.numel()} elements for a part of "
                               f"{output.numel()}", fix=f"pass {p} x the part's elements")
        fn = rows_reducer(reducer(code, output.dtype), output.dtype)
        with staged(inp, out=False) as fin, staged(output, out=True) as fout:
            rows = torch.empty((p, fout.numel()), dtype=fout.dtype)

            def reduce() -> None:
                fn(rows, fout)
                if code == AVG:
                    fout.div_(p)

            per = fout.numel() * fout.element_size()
            c.run(encode(kind, [fout], op=int(code)), kind, [lambda: c.comm.Ialltoall(c.buf(fin, per), c.buf(rows, per)),
                                                             reduce], _nbytes(fin))
        return ShmWork.done(result if result is not None else output)

    # ------------------------------------------------------------------ moving bytes

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any) -> ShmWork:
        root, c = int(opts.rootRank), self.c
        for t in tensors:
            with staged(t, out=self._rank != root) as flat:
                c.run(encode("broadcast", [flat], root=root), "broadcast",
                      [lambda: c.comm.Ibcast(c.buf(flat_bytes(flat)), root)], _nbytes(flat))
        return ShmWork.done(list(tensors))

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> ShmWork:
        c = self.c
        with staged(output, out=True) as fout, staged(inp, out=False) as fin:
            if fout.numel() != fin.numel() * self._size:
                raise BackendError(f"all_gather: rank {self._rank} passed an output of {fout.numel()} elements for "
                                   f"an input of {fin.numel()}", fix=f"pass {self._size} x the input's elements")
            per = fin.numel() * fin.element_size()
            c.run(encode("all_gather_single", [fin]), "all_gather", [lambda: c.comm.Iallgather(c.buf(fin), c.buf(fout, per))],
                  _nbytes(fout))
        return ShmWork.done(output)

    def allgather(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                  opts: Any = None) -> ShmWork:
        for outs, inp in zip(outputs, inputs):
            whole = torch.empty((self._size, inp.numel()), dtype=inp.dtype)
            self._allgather_base(whole, inp)
            for o, row in zip(outs, whole):
                o.copy_(row.view(o.shape))
        return ShmWork.done(list(outputs))

    def allgather_coalesced(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                            opts: Any = None) -> ShmWork:
        return self.allgather(outputs, inputs)

    def gather(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any) -> ShmWork:
        root, c, inp = int(opts.rootRank), self.c, inputs[0]
        mine = self._rank == root
        with staged(inp, out=False) as fin:
            whole = torch.empty((self._size, fin.numel()), dtype=fin.dtype) if mine else None
            per = fin.numel() * fin.element_size()
            c.run(encode("gather", [fin], root=root), "gather",
                  [lambda: c.comm.Igather(c.buf(fin), c.buf(whole, per) if whole is not None else None, root)],
                  per * self._size)
        if whole is not None:
            for o, row in zip(outputs[0], whole):
                o.copy_(row.view(o.shape))
        return ShmWork.done(list(outputs))

    def scatter(self, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], opts: Any) -> ShmWork:
        root, c, out = int(opts.rootRank), self.c, outputs[0]
        whole = torch.cat([i.reshape(-1) for i in inputs[0]]) if self._rank == root else None
        with staged(out, out=True) as fout:
            per = fout.numel() * fout.element_size()
            c.run(encode("scatter", [fout], root=root), "scatter",
                  [lambda: c.comm.Iscatter(c.buf(whole, per) if whole is not None else None, c.buf(fout), root)],
                  per * self._size)
        return ShmWork.done(list(outputs))

    def alltoall_base(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None) -> ShmWork:
        c = self.c
        with staged(output, out=True) as fout, staged(inp, out=False) as fin:
            send = self._row_bytes(inp, input_split_sizes)
            recv = self._row_bytes(output, output_split_sizes)
            c.run(encode("all_to_all_single", []), "all_to_all",
                  [lambda: c.comm.Ialltoallv(c.counts(fin, send), c.counts(fout, recv))], max(sum(send), sum(recv)))
        return ShmWork.done(output)

    def _row_bytes(self, t: torch.Tensor, splits: Sequence[int]) -> List[int]:
        rows = t.shape[0] if t.dim() else 1
        splits = list(splits or []) or [rows // self._size] * self._size
        per_row = (t.numel() // rows if rows else 0) * t.element_size()
        return [s * per_row for s in splits]

    def barrier(self, opts: Any = None) -> ShmWork:
        """Every rank's descriptor gathered: the barrier and its agreement in one MPI call."""
        self.c.gather_rows(_BARRIER, "barrier", 0, 0)
        return ShmWork.done(None)

    # ------------------------------------------------------------------ point-to-point

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> MpiWork:
        c, t = self.c, tensors[0].contiguous()
        req = c.post(lambda: c.comm.Isend(c.buf(t), int(dst), int(tag)), "send")
        return MpiWork(c, req, f"send to rank {dst}", _nbytes(t), after=lambda: t)

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int = 0) -> MpiWork:
        return self._recv(tensors[0], int(src), int(tag), f"recv from rank {src}")

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int = 0) -> MpiWork:
        return self._recv(tensors[0], self.c.MPI.ANY_SOURCE, int(tag), "recv from any rank")

    def _recv(self, t: torch.Tensor, src: int, tag: int, what: str) -> MpiWork:
        c = self.c
        flat = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
        status = c.MPI.Status()
        req = c.post(lambda: c.comm.Irecv(c.buf(flat), src, tag), what)
        back = (lambda: t.copy_(flat)) if flat is not t else None
        return MpiWork(c, req, what, _nbytes(flat), after=back, status=status)

    def shutdown(self) -> None:
        self.c.close()
