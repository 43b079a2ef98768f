"""Set-up for :mod:`cpuddp.shm`: which ranks share a node, and the node's segment file.

* :func:`whoami` / :func:`plan_node`: each rank publishes ``host identity, pid, PID namespace,
  allowed CPUs`` through the store; :func:`plan_node` (pure) turns every rank's line into this
  rank's :class:`NodePlan` (local ranks, node index, peers' pids, whether to spin) or the reason
  the group runs gloo for every collective.
* :func:`map_segment`: local rank 0 creates the segment file (``posix_fallocate``: a full
  ``/dev/shm`` is a clear error now, never a SIGBUS later), the others open and check it
  (magic, token, size); the file is unlinked once every local rank has mapped it or read why
  it could not.  Files left by a creator that died before that are removed
  (:func:`reap_stale`) by the next group formed on the host.
* :class:`Segment`: the mapped header words, arrival counters and typed slot views the data
  path of :mod:`cpuddp.shm` reads and writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import mmap
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import shm_check
from .errors import BackendError
from .hosts import host_identity, pid_alive

log = logging.getLogger("cpuddp.shm")

MAGIC = 0x6370756464707368  # "cpuddpsh"
FILE_PREFIX = "cpuddp-shm-"
# int64 words of the header page
W_MAGIC, W_SIZE, W_SLOT, W_TOKEN, W_ABORT = 0, 1, 2, 3, 4

FIX = ("give the shared-memory directory room (Docker: --shm-size=1g; or point CPUDDP_SHM_DIR at a tmpfs "
       "every local rank sees), or pass backend='gloo'")


def pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "?"


def _allowed_cpus() -> str:
    try:
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return ""


# --------------------------------------------------------------------------- who shares a node


def whoami() -> str:
    """This rank's line for ``shm/who/<rank>``: host identity, pid, PID namespace, allowed CPUs."""
    return f"{host_identity()}\t{os.getpid()}\t{pid_namespace()}\t{_allowed_cpus()}"


@dataclass(frozen=True)
class NodePlan:
    """This rank's place among the ranks of its node, from every rank's :func:`whoami` line."""

    local: Tuple[int, ...]  # the global ranks on this node, in order
    local_rank: int
    node: int
    nodes: int
    peer_pids: dict = field(default_factory=dict)  # local rank's global rank -> pid (same PID namespace)
    spin: bool = True  # the node's ranks have at least a CPU each: yield-spin before sleeping
    gloo_only: Optional[str] = None  # why shared memory is not used, else None

    @property
    def local_size(self) -> int:
        return len(self.local)


def plan_node(who: Sequence[Sequence[str]], rank: int) -> NodePlan:
    """Pure: ``who[r]`` is rank r's :func:`whoami` line split at tabs."""
    size = len(who)
    hosts = list(dict.fromkeys(w[0] for w in who))
    local = tuple(r for r in range(size) if who[r][0] == who[rank][0])
    counts = {h: sum(1 for w in who if w[0] == h) for h in hosts}
    cpus = set().union(*(who[r][3].split(",") for r in local)) - {""}
    gloo_only = None
    if size == 1 or len(local) == 1:
        gloo_only = "gloo for every collective: one rank per node"
    elif len(set(counts.values())) != 1:
        gloo_only = ("gloo for every collective: nodes run different numbers of ranks "
                     f"({', '.join(str(c) for c in counts.values())})")
    return NodePlan(
        local=local,
        local_rank=local.index(rank),
        node=hosts.index(who[rank][0]),
        nodes=len(hosts),
        peer_pids={r: int(who[r][1]) for r in local if r != rank and who[r][2] == who[rank][2]},
        spin=bool(cpus) and len(cpus) >= len(local),
        gloo_only=gloo_only,
    )


# --------------------------------------------------------------------------- the segment


class Segment:
    """One node's mapped segment: header words, arrival counters, typed slot views."""

    def __init__(self, mm: mmap.mmap, local_rank: int, local_size: int, slot: int) -> None:
        counters, slots, total = shm_check.layout(local_size, slot)
        self.mm = mm
        self.slot = slot
        self.size = local_size
        self.words = (ctypes.c_int64 * 8).from_buffer(mm, 0)
        self.counters = [ctypes.c_int64.from_buffer(mm, counters + i * shm_check.COUNTER_STRIDE)
                         for i in range(local_size)]
        self.mine = self.counters[local_rank]
        self.others = [c for i, c in enumerate(self.counters) if i != local_rank]
        self.raw = torch.frombuffer(mm, dtype=torch.uint8, count=total - slots, offset=slots)
        self._views: dict[torch.dtype, List[List[torch.Tensor]]] = {}

    def slots(self, dtype: torch.dtype) -> List[List[torch.Tensor]]:
        """``[parity][local rank]`` 1-D views of ``dtype`` over the slots."""
        views = self._views.get(dtype)
        if views is None:
            flat = self.raw.view(dtype)
            n = self.slot // flat.element_size()
            views = [[flat[(p * self.size + r) * n:(p * self.size + r + 1) * n] for r in range(self.size)]
                     for p in (0, 1)]
            self._views[dtype] = views
        return views


def reap_stale(directory: str) -> None:
    """Remove segment files whose creator (in this PID namespace) is dead."""
    ns = pid_namespace()
    for path in glob.glob(os.path.join(directory, f"{FILE_PREFIX}{ns}-*")):
        try:
            pid = int(os.path.basename(path)[len(FILE_PREFIX):].split("-")[1])
        except (IndexError, ValueError):
            continue
        if not pid_alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(path)
                log.info("cpuddp.shm: removed %s, left by dead process %d", path, pid)


def _free_text(directory: str) -> str:
    from ._units import format_size

    try:
        st = os.statvfs(directory)
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    return f"{format_size(st.f_bavail * st.f_frsize)} free of {format_size(st.f_blocks * st.f_frsize)}"


def _reserve(fd: int, total: int, directory: str, local_size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        from ._units import format_size

        raise BackendError(
            f"cannot reserve {format_size(total)} in {directory} for {local_size} local ranks: "
            f"{exc.strerror} ({_free_text(directory)})", fix=FIX) from exc


def create_file(local_size: int) -> Tuple[str, mmap.mmap, int, int]:
    """Local rank 0: create, reserve and map a new segment file; (path, map, slot, token)."""
    environ = os.environ
    directory, slot = shm_check.shm_dir(environ), shm_check.slot_bytes(environ)
    total = shm_check.layout(local_size, slot)[2]
    reap_stale(directory)
    token = secrets.randbits(62) + 1
    path = os.path.join(directory, f"{FILE_PREFIX}{pid_namespace()}-{os.getpid()}-{token:x}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise BackendError(f"cannot create {path}: {exc.strerror}", fix=FIX) from exc
    try:
        _reserve(fd, total, directory, local_size)
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    words = (ctypes.c_int64 * 8).from_buffer(mm, 0)
    words[W_SIZE], words[W_SLOT], words[W_TOKEN] = local_size, slot, token
    words[W_MAGIC] = MAGIC
    del words
    return path, mm, slot, token


def open_file(path: str, token: int, size: int, slot: int) -> mmap.mmap:
    """Another local rank: open and map local rank 0's file, checking it is that segment."""
    total = shm_check.layout(size, slot)[2]
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise BackendError(
            f"cannot open {path}, made by local rank 0: {exc.strerror} (ranks with the same host identity "
            "do not share this shared-memory directory: separate containers?)", fix=FIX) from exc
    try:
        if os.fstat(fd).st_size != total:
            raise BackendError(f"{path} has size {os.fstat(fd).st_size}, expected {total}", fix=FIX)
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    words = (ctypes.c_int64 * 8).from_buffer(mm, 0)
    ok = words[W_MAGIC] == MAGIC and words[W_TOKEN] == token and words[W_SIZE] == size
    del words
    if not ok:
        raise BackendError(f"{path} is not the segment local rank 0 made", fix=FIX)
    return mm


def _create_or_open(store: Any, key: str, lr: int, ls: int, found: list) -> Segment:
    """Create (local rank 0, publishing ``path<TAB>token<TAB>slot`` under ``key``) or open the
    file; ``found`` receives the path as soon as it exists (for the unlink)."""
    if lr == 0:
        path, mm, slot, token = create_file(ls)
        found.append(path)
        store.set(key, f"{path}\t{token}\t{slot}")
    else:
        got = store.get(key).decode()
        if got.startswith("error\t"):
            raise BackendError(got.split("\t", 1)[1], fix=FIX)
        path, token_s, slot_s = got.split("\t")
        token, slot = int(token_s), int(slot_s)
        found.append(path)
        mm = open_file(path, token, ls, slot)
    return Segment(mm, lr, ls, slot)


def map_segment(store: Any, rank: int, local: Sequence[int], local_rank: int) -> Segment:
    """Map the node's segment on every local rank; any local rank's failure is raised on all."""
    lr, ls = local_rank, len(local)
    key = f"shm/seg/{local[0]}"
    found: list = []
    status = "ok"
    try:
        seg = _create_or_open(store, key, lr, ls, found)
    except BaseException as exc:
        status = f"rank {rank}: {getattr(exc, 'msg', exc)}"
        if lr == 0 and not found:
            store.set(key, f"error\t{status}")
        store.set(f"shm/mapped/{rank}", f"error\t{status}")
        raise
    finally:
        if status == "ok":
            store.set(f"shm/mapped/{rank}", "ok")
        if lr == 0:
            # every local rank has mapped it or read the error: the name can go now (and a
            # failed rank 0, which may host the store, has not left before its peers read why)
            try:
                for r in local:
                    store.get(f"shm/mapped/{r}")
            finally:
                if found:
                    with contextlib.suppress(OSError):
                        os.unlink(found[0])
    problems = [s for s in (store.get(f"shm/mapped/{r}").decode() for r in local) if s != "ok"]
    if problems:
        raise BackendError("the shared-memory segment could not be mapped: "
                           + "; ".join(p.split("\t", 1)[1] for p in problems), fix=FIX)
    return seg
