"""What a careless call does on the shm backend: the public API used as a red team would, at 2
ranks, on the native data path and the Python one (``CPUDDP_SHM_NATIVE=1``/``0``; CI runs this
file again under AddressSanitizer, .ci/native.sh).  Each ends in the right result or a clear
error, never a wrong sum with exit 0, a crash, a wait until the timeout or a message that blames
the wrong thing:

* input and output of all_gather / reduce_scatter that share memory through two storages (two
  ``torch.from_numpy`` views of one array, ``torch.frombuffer`` views of one buffer): the right
  result (both paths summed wrong, the native one ran an overlapping ``memcpy``);
* a tensor queued on the group's thread (``CPUDDP_SHM_ASYNC=1``) resized, or given other memory,
  before ``wait()``: ``resize_`` refused, ``wait()`` naming the change (the native thread read
  and wrote freed memory: SIGSEGV);
* two threads calling one group's collectives at once: the error names them (it read "call
  #N differs", or "refused a call (7) ...; this is a bug");
* ranks creating their subgroups in different orders: cpuddp's stall error naming the group,
  the ranks not there and the likely causes (torch's bare ``DistStoreError: wait timeout``);
* a process of the job's own user that truncates the segment through ``/proc/<pid>/fd``, or
  writes over its header: refused, or an error saying the header was overwritten (SIGBUS on every
  rank; "local rank -1923101111149478831 gave up").

Every test starts real ranks with a timeout (run_distributed).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from cpuddp.testing import run_distributed

pytestmark = pytest.mark.slow

PATHS = {"native": {"CPUDDP_SHM_NATIVE": "1"}, "python": {"CPUDDP_SHM_NATIVE": "0"}}


def _env(path: str, **more: str) -> dict:
    if path == "native":
        from cpuddp.backends.shm import native

        try:
            native.load()
        except native.Unavailable as exc:
            pytest.skip(f"no native library here: {exc}")
    return {**PATHS[path], **more}


def _group():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()


# --------------------------------------------------------------------------- one memory, two storages


def _views(kind: str, n: int):
    """``view(start, count)``: float32 tensors over one memory of ``n`` floats, each view a storage
    of its own (``numpy``: ``torch.from_numpy`` of a slice; ``buffer``: ``torch.frombuffer``)."""
    import numpy as np
    import torch

    if kind == "numpy":
        arr = np.zeros(n, dtype=np.float32)
        return lambda start, count: torch.from_numpy(arr[start:start + count])
    buf = bytearray(4 * n)
    return lambda start, count: torch.frombuffer(buf, dtype=torch.float32, offset=4 * start, count=count)


def _overlapping(kind: str) -> dict:
    """all_gather and reduce_scatter whose input shares memory with the output other than as this
    rank's own row, through different storages; 3,000 floats a row (with a 4 KiB slot: many rounds)
    and 70,000 (big enough to be queued with the progress thread on)."""
    import torch
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out = {}
    for k in (3000, 70000):
        rows = torch.cat([torch.arange(k, dtype=torch.float32) + 1e5 * i for i in range(n)])
        view = _views(kind, n * k + k)
        got, inp = view(0, n * k), view(k // 2, k)  # the input straddles rows 0 and 1
        inp.copy_(rows[r * k:(r + 1) * k])
        gather(got, inp)
        out[f"all_gather_single {k}"] = bool(torch.equal(got, rows))
        outs, inp = [view(i * k, k) for i in range(n)], view(k // 2, k)
        inp.copy_(rows[r * k:(r + 1) * k])
        dist.all_gather(outs, inp)
        out[f"all_gather {k}"] = bool(torch.equal(torch.cat(outs), rows))
        whole, part = view(0, n * k), view(k // 2, k)  # the output lies inside the input, off its own part
        whole.copy_(rows * (r + 1))
        scatter(part, whole)
        out[f"reduce_scatter_single {k}"] = bool(torch.equal(part, rows[r * k:(r + 1) * k] * sum(range(1, n + 1))))
    return out


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("thread", ["0", "1"])
@pytest.mark.parametrize("kind", ["numpy", "buffer"])
def test_inputs_and_outputs_sharing_memory_through_two_storages_give_the_right_result(path, thread, kind):
    """Fails before the fix on both paths (a row's or a part's values from the other rank's, or
    this rank's own written back early), and under ASan with memcpy-param-overlap in engine.c."""
    env = _env(path, CPUDDP_SHM_ASYNC=thread, CPUDDP_SHM_SLOT="4K")
    for res in run_distributed(_overlapping, 2, args=(kind,), backend="shm", timeout=120, env=env):
        assert all(res.values()), res


def _refused_by_the_library() -> dict:
    """The library itself refuses an all_gather whose input overlaps its output other than as
    this rank's row (the binding never passes one): an error, and nothing copied or posted."""
    import torch
    import torch.distributed as dist

    from cpuddp.backends.shm.protocol.descriptor import encode
    from cpuddp.backends.shm.python.ops import flat_bytes

    g, k = _group(), 64
    nat = g._native
    out = torch.zeros(2 * k)
    before = out.clone()
    inp = out[k // 2:k // 2 + k]
    call = encode("all_gather_single", [inp])
    try:
        nat.run(call, nat.all_gather(call, flat_bytes(out), flat_bytes(inp)))
        said = "ran"
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        said = str(exc)
    t = torch.ones(4)
    dist.all_reduce(t)  # nothing was posted: the group goes on
    return {"said": said, "untouched": bool(torch.equal(out, before)), "after": t.tolist()}


def test_the_library_refuses_overlapping_arguments_itself():
    """Fails before the fix: the library copied the input into this rank's row over itself (ASan:
    memcpy-param-overlap) and ran the call."""
    for res in run_distributed(_refused_by_the_library, 2, backend="shm", timeout=60, env=_env("native")):
        assert "refused a call (7)" in res["said"], res
        assert res["untouched"] and res["after"] == [2.0] * 4, res


# --------------------------------------------------------------------------- a queued tensor changed


def _changed_while_queued(how: str, behind: bool) -> dict:
    """Rank 0 queues an all_reduce of 1 MiB (rank 1 calls 0.5 s late, so it waits queued), then
    resizes the tensor or gives it other memory before ``wait()``: 0.1 s after the call (its
    thread has started it), or at once with another call queued ahead of it (``behind``: the
    Python path's thread has not started it)."""
    import torch
    import torch.distributed as dist

    from cpuddp.backends.shm.routes import hold

    rank, n = dist.get_rank(), 1 << 18
    t = torch.ones(n)
    if rank == 1:
        time.sleep(0.5)
    ahead = dist.all_reduce(torch.ones(n), async_op=True) if behind else None
    work = dist.all_reduce(t, async_op=True)
    out = {"resize": "not tried"}
    if rank == 0:
        if not behind:
            time.sleep(0.1)
        try:
            if how == "resize":
                t.resize_(4 * n)
            else:
                t.data = torch.zeros(n)
            out["resize"] = "allowed"
        except RuntimeError as exc:
            out["resize"] = str(exc)
    out["wait"] = _outcome(work)
    if ahead is not None:
        _outcome(ahead)
    out["values"] = sorted(set(t[:n].tolist()))
    t.resize_(4 * n)  # its storage resizable again once the call completed
    again = torch.ones(8)
    said = _outcome(lambda: dist.all_reduce(again))
    out["after"], out["lent"] = again.tolist() if said == "ok" else said, hold.lent()
    return out


def _outcome(work) -> str:
    try:
        work() if callable(work) else work.wait()
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return str(exc)


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_queued_tensor_that_is_resized_before_wait_is_refused_and_the_sum_is_right(path):
    """Fails before the fix: on the native path the progress thread read and wrote the freed
    memory (SIGSEGV, glibc's "corrupted double-linked list"; ASan: heap-use-after-free in
    kernels.h); on the Python path the call went on over the tensor's new memory."""
    from cpuddp.backends.shm.routes.hold import CAN_LEND

    if not CAN_LEND:
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_ (2.13 has it): a queued tensor's storage is "
                    "kept, but its resize_ is not refused")
    env = _env(path, CPUDDP_SHM_ASYNC="1")
    r0, r1 = run_distributed(_changed_while_queued, 2, args=("resize", False), backend="shm", timeout=120, env=env)
    assert "not resizable" in r0["resize"], r0
    for r in (r0, r1):
        assert r["wait"] == "ok" and r["values"] == [2.0] and r["after"] == [2.0] * 8 and r["lent"] == 0, r


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_queued_tensor_given_other_memory_before_wait_makes_wait_say_so(path):
    """Fails before the fix: on the native path the tensor's storage was freed under the queued
    call (SIGSEGV); on the Python path wait() said nothing and the tensor held no sum."""
    env = _env(path, CPUDDP_SHM_ASYNC="1")
    r0, r1 = run_distributed(_changed_while_queued, 2, args=("data", False), backend="shm", timeout=120, env=env)
    assert r0["resize"] == "allowed" and "was given other memory" in r0["wait"] and "wait()" in r0["wait"], r0
    assert r0["values"] == [0.0], r0  # what it was given; the sum went to the memory it had
    assert r1["wait"] == "ok" and r1["values"] == [2.0], r1
    for r in (r0, r1):
        assert r["after"] == [2.0] * 8 and r["lent"] == 0, r  # the group goes on


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_tensor_changed_before_its_queued_call_ran_is_refused_or_named(path):
    """Behind another queued call: the native thread took the tensor's memory when the call was
    made (the sum goes there; wait() names the change); the Python thread has not started it and
    refuses it (the peers, waiting for it, stop too).  Fails before the fix: a SIGSEGV (native),
    or rank 0 moved other memory than the ranks agreed on (Python)."""
    env = _env(path, CPUDDP_SHM_ASYNC="1")
    r0, r1 = run_distributed(_changed_while_queued, 2, args=("data", True), backend="shm", timeout=120, env=env)
    assert r0["resize"] == "allowed" and r0["lent"] == r1["lent"] == 0, (r0, r1)
    if path == "native":
        assert "was given other memory" in r0["wait"] and "before its Work's wait()" in r0["wait"], r0
        assert r1["wait"] == "ok" and r1["values"] == [2.0] and r0["after"] == [2.0] * 8, (r0, r1)
    else:
        assert "before it ran: refused" in r0["wait"], r0
        assert "gave up" in r1["wait"], r1


# --------------------------------------------------------------------------- two threads on one group


def _two_threads() -> dict:
    """Two threads call one group's collectives at once, in different orders on the two ranks:
    on rank 0 a big all_reduce is queued (rank 1 has called nothing yet) when a small one comes
    from the other thread; rank 1's small one comes first.  The calls differ between the ranks."""
    import torch
    import torch.distributed as dist

    rank, errors = dist.get_rank(), {}
    dist.barrier()
    start = time.monotonic()

    def at(seconds: float) -> None:
        time.sleep(max(0.0, start + seconds - time.monotonic()))

    def big() -> None:
        at(0.0 if rank == 0 else 0.8)
        try:
            dist.all_reduce(torch.ones(1 << 18), async_op=True).wait()
        except Exception as exc:  # noqa: BLE001
            errors["big"] = str(exc)

    def small() -> None:
        at(0.3 if rank == 0 else 0.6)
        try:
            dist.all_reduce(torch.ones(10))
        except Exception as exc:  # noqa: BLE001
            errors["small"] = str(exc)

    threads = [threading.Thread(target=f, name=f.__name__) for f in (big, small)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("thread", ["1", "0"])
def test_two_threads_calling_one_group_at_once_are_named(path, thread):
    """Fails before the fix: rank 0 read only that call #N differs between the ranks (with the
    progress thread, before the engine's review: "refused a call (7) ...; this is a bug")."""
    env = _env(path, CPUDDP_SHM_ASYNC=thread)
    r0, r1 = run_distributed(_two_threads, 2, backend="shm", timeout=120, env=env)
    assert set(r0) == {"big", "small"} and r1, (r0, r1)  # an error on every rank
    for said in r0.values():  # rank 0 saw both threads at once; its errors say so
        assert "two threads called collectives on this shm group at once" in said, r0
        assert "'big'" in said or "'small'" in said, r0
        assert "this is a bug" not in said, r0


# --------------------------------------------------------------------------- subgroups out of order


def _subgroups_out_of_order() -> str:
    """Rank 0 makes new_group([0]) then new_group([0, 1]); rank 1 the reverse (group timeout 3 s)."""
    import datetime

    import torch.distributed as dist

    rank, td = dist.get_rank(), datetime.timedelta(seconds=3)
    order = ([0], [0, 1]) if rank == 0 else ([0, 1], [0])
    try:
        for ranks in order:
            dist.new_group(ranks, backend="shm", timeout=td)
        return "formed"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def test_subgroups_made_in_different_orders_stop_with_cpuddps_stall_error():
    """Fails before the fix: rank 0 waited out the store's own timeout (the job's, not the
    group's 3 s) and got torch's bare ``DistStoreError: wait timeout ... keys: .../shm/1/who/1``."""
    started = time.monotonic()
    r0, r1 = run_distributed(_subgroups_out_of_order, 2, backend="shm", timeout=50)
    assert time.monotonic() - started < 40, (r0, r1)
    assert r0.startswith("BackendError: rank 0: the shm group of ranks [0, 1] did not form: group rank(s) [1]"), r0
    assert "within the group timeout (3 s)" in r0 and "in different orders" in r0, r0
    assert "rendezvous store at 127.0.0.1:" in r0 and "died or hangs" in r0, r0
    assert "DistStoreError" not in r0, r0
    assert "in different orders" in r1, r1  # it read the other group's offer: the hand-over's error says so


# --------------------------------------------------------------------------- the user's own processes


_TRUNCATE = "import os, sys; os.ftruncate(os.open(sys.argv[1], os.O_RDWR), 0)"
_SCRIBBLE = """import mmap, os, secrets, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
with mmap.mmap(fd, 4096) as head:
    words = list(struct.unpack("8q", secrets.token_bytes(64)))
    words[4] = -1923101111149478830  # the abort word (layout.h's W_ABORT): no rank's
    head[:64] = struct.pack("8q", *words)
"""


def _neighbour(script: str) -> dict:
    """Rank 0: a process of this user opens the segment through /proc/<rank 0>/fd/<n> and runs
    ``script`` on it; then every rank calls 20 all_reduces."""
    import subprocess

    import torch
    import torch.distributed as dist

    out = {}
    store = dist.distributed_c10d._get_default_store()  # the ranks meet there: no segment round
    if dist.get_rank() == 0:
        path = f"/proc/{os.getpid()}/fd/{_group()._eng.ch.seg.fd}"
        done = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=60)
        out["neighbour"] = done.stderr.strip().splitlines()[-1] if done.returncode else "done"
        store.set("careless/neighbour", "done")
    store.wait(["careless/neighbour"])
    try:
        for _ in range(20):
            t = torch.ones(1 << 16)
            dist.all_reduce(t)
            assert t.min().item() == t.max().item() == 2.0
        out["calls"] = "right"
    except Exception as exc:  # noqa: BLE001
        out["calls"] = str(exc)
    return out


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_process_of_the_user_cannot_truncate_the_segment(path):
    """Fails before the fix: the truncation succeeded and both ranks died of SIGBUS at their next
    touch of the segment, with no Python error."""
    r0, r1 = run_distributed(_neighbour, 2, args=(_TRUNCATE,), backend="shm", timeout=60, env=_env(path))
    assert "Operation not permitted" in r0["neighbour"], r0
    assert r0["calls"] == r1["calls"] == "right", (r0, r1)


@pytest.mark.parametrize("path", ["native", "python"])
def test_random_words_over_the_segments_header_are_named_as_such(path):
    """Fails before the fix: every rank said 'local rank -1923101111149478831 gave up'."""
    for r in run_distributed(_neighbour, 2, args=(_SCRIBBLE,), backend="shm", timeout=60, env=_env(path)):
        assert "segment's header was overwritten" in r["calls"], r
        assert "-1923101111149478830" in r["calls"] and "gave up" not in r["calls"], r


def test_the_segment_is_sealed_and_a_peer_refuses_one_that_is_not():
    """The segment local rank 0 makes is sealed, passes its peers' checks, and cannot be
    truncated through another descriptor; a peer refuses a look-alike that is not sealed."""
    import fcntl

    from cpuddp.backends.shm.protocol import check
    from cpuddp.backends.shm.protocol.segment import SEALS, check_received, create_segment
    from cpuddp.errors import BackendError

    fd, token = create_segment(2, 4096)
    other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        check_received(fd, token, 2, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(other, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(other, 1 << 30)
    finally:
        os.close(other)
    plain = os.memfd_create("look-alike", os.MFD_CLOEXEC)
    try:
        os.ftruncate(plain, check.layout(2, 4096)[2])
        os.fchmod(plain, 0o600)
        os.pwrite(plain, os.pread(fd, 4096, 0), 0)  # its header too: only the seals differ
        with pytest.raises(BackendError, match="is not sealed against shrinking and growing"):
            check_received(plain, token, 2, 4096)
    finally:
        os.close(plain)
        os.close(fd)
