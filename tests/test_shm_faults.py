"""Faults and neighbours on the shm backend (issue 22), and its asynchronous collectives (issue 23).

* a mismatched call is an error on every rank naming both calls, never a wrong or shifted result;
* collectives handed to gloo never deadlock (20,000 broadcasts; a mix; DDP with BatchNorm);
* a peer that left, died (also in another PID namespace) or died mid-mapping ends the wait in seconds;
* another local user cannot change a result or obtain the segment;
* async: many collectives in flight, from two threads, a peer dying with work queued, shutdown
  with work in flight -- no hang, no lost error;
* a short soak: results right, memory, descriptors and threads flat.

Every multi-rank test starts real processes with a timeout (run_distributed, or
tests/scripts/shm_faults.py as plain torch.distributed ranks).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpuddp.testing import run_distributed
from shm_util import unshare_pid_or_skip

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"

pytestmark = pytest.mark.slow

# --------------------------------------------------------------------------- mismatched calls

#: name -> (rank 0's call, rank 1's call, words each side's description must contain)
MISMATCHES = {
    "count": ("ar:f32:10", "ar:f32:20", ("10 elements", "20 elements")),
    "dtype": ("ar:f32:10", "ar:f64:10", ("float32", "float64")),
    "op": ("ar:f32:10:SUM", "ar:f32:10:MAX", ("SUM", "MAX")),
    "large_vs_small": ("ar:f32:300000", "ar:f32:10", ("300000 elements", "10 elements")),
    "empty_vs_ten": ("ar:f32:0", "ar:f32:10", ("0 elements", "10 elements")),
    "all_gather_vs_broadcast": ("ag:4", "bc:0", ("all_gather(", "broadcast(")),
    "reduce_scatter_vs_all_reduce": ("rs:4", "ar:f32:8", ("reduce_scatter_single(", "all_reduce(")),
    "barrier_vs_all_reduce": ("barrier", "ar:f32:1", ("barrier(", "all_reduce(")),
    "gather_roots": ("ga:0", "ga:1", ("root 0", "root 1")),
    "broadcast_vs_allreduce": ("bc:0", "ar:f32:1", ("broadcast(", "all_reduce(")),
    "broadcast_roots": ("bc:0", "bc:1", ("root 0", "root 1")),
}


def _tensor(spec: str):
    import torch

    _, dtype, n, *rest = spec.split(":")
    t = torch.ones(int(n), dtype={"f32": torch.float32, "f64": torch.float64, "i64": torch.int64}[dtype])
    if rest[1:] == ["strided"]:
        t = torch.ones(int(n) * 2)[::2]
    return t, (rest[0] if rest else "SUM")


def _call(spec: str, group) -> None:
    import torch
    import torch.distributed as dist

    if spec.startswith("bc:"):
        dist.broadcast(torch.ones(4), src=int(spec.split(":")[1]), group=group)
        return
    if spec.startswith("ag:"):
        dist.all_gather([torch.ones(4), torch.ones(4)], torch.ones(4), group=group)
        return
    if spec.startswith("rs:"):
        dist.reduce_scatter_tensor(torch.ones(4), torch.ones(8), group=group)
        return
    if spec == "barrier":
        dist.barrier(group=group)
        return
    if spec.startswith("ga:"):
        root = int(spec.split(":")[1])
        dist.gather(torch.ones(2), [torch.ones(2), torch.ones(2)] if dist.get_rank() == root else None, dst=root,
                    group=group)
        return
    t, op = _tensor(spec)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)


def _mismatches():
    """Each case on a fresh shm subgroup: both ranks must raise, fast, naming both calls; the next
    matched call on that subgroup raises too (the group is broken, never shifted)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for name, calls in MISMATCHES.items():
        group = dist.new_group(backend="shm")
        for _ in range(3):  # matched calls first: the mismatch is not the first call
            x = torch.full((20,), 100.0)
            dist.all_reduce(x, group=group)
            assert x[0].item() == 200.0
        start = time.monotonic()
        try:
            _call(calls[rank], group)
            out[name] = {"error": None}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": str(exc), "seconds": time.monotonic() - start}
        try:
            y = torch.ones(5)
            dist.all_reduce(y, group=group)
            out[name]["next"] = y.tolist()
        except Exception as exc:  # noqa: BLE001
            out[name]["next"] = str(exc)
    return out


def test_every_mismatched_call_is_an_error_on_every_rank_naming_both_calls():
    res = run_distributed(_mismatches, 2, backend="shm", timeout=240)
    for name, (c0, c1, words) in MISMATCHES.items():
        for rank, r in enumerate(res):
            case = r[name]
            assert case["error"], f"{name}: rank {rank} got no error"
            assert "differs between the ranks of this node" in case["error"], (name, case)
            for w in words:
                assert w in case["error"], (name, rank, case["error"])
            assert "rank 0 called" in case["error"] and "rank 1 called" in case["error"]
            assert case["seconds"] < 5, (name, case)
            assert isinstance(case["next"], str) and "broken" in case["next"], (name, case)


def _refused_then_next():
    """Rank 1 refuses its call before posting it (an integer AVG): for the group it never happened.
    Its next call is then the one that meets rank 0's: a mismatch on both, naming both calls."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group(backend="shm")
    out = {}
    for step, call in enumerate(("first", "next")):
        t = torch.ones(8) if rank == 0 or step else torch.ones(8, dtype=torch.int64)
        op = dist.ReduceOp.AVG if step == 0 else dist.ReduceOp.SUM
        if rank == 0 and step:
            break
        try:
            dist.all_reduce(t if step == 0 else torch.ones(5), op=op, group=group)
            out[call] = "ok"
        except Exception as exc:  # noqa: BLE001
            out[call] = str(exc)
    return out


def test_a_call_one_rank_refuses_never_happened_and_the_next_one_mismatches():
    r0, r1 = run_distributed(_refused_then_next, 2, backend="shm", timeout=120)
    assert "ReduceOp.AVG of torch.int64 tensors" in r1["first"], r1
    for text in (r0["first"], r1["next"]):
        assert "differs between the ranks of this node" in text, (r0, r1)
        assert "all_reduce(AVG, float32, 8 elements)" in text and "all_reduce(SUM, float32, 5 elements)" in text


# --------------------------------------------------------------------------- no deadlock


def _broadcasts_and_mix(n: int):
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    for i in range(n):
        b = torch.tensor([i if rank == 0 else -1])
        dist.broadcast(b, src=0)
        assert b.item() == i
    broadcasts = time.monotonic() - start
    start = time.monotonic()
    for i in range(300):
        dist.barrier()
        b = torch.full((3,), float(rank))
        dist.broadcast(b, src=i % world)
        assert b[0].item() == float(i % world)
        got = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(got, torch.full((2,), float(rank)))
        assert [g[0].item() for g in got] == [float(r) for r in range(world)]
        numel = (1, 17, 1000, 65536, 262144, 1 << 20, 3 << 20)[i % 7]
        x = torch.full((numel,), float(rank + 1))
        dist.all_reduce(x)
        assert x[0].item() == x[-1].item() == sum(range(1, world + 1))
    return {"broadcasts_s": broadcasts, "mix_s": time.monotonic() - start,
            "shm_calls": dist.group.WORLD.shm_calls}


def test_20000_small_broadcasts_and_a_mix_of_collectives_finish_on_shm():
    res = run_distributed(_broadcasts_and_mix, 2, args=(20000,), backend="shm", timeout=240)
    assert all(r["shm_calls"] >= 300 for r in res), res
    print("shm:", res)  # seconds, for the record (speed is measured in benchmarks/, not asserted)


def _ddp_batchnorm(steps: int):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.01)  # small buckets: several per step, broadcast of BN buffers
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    import ctypes
    import hashlib

    flat = torch.cat([t.detach().reshape(-1).double() for t in model.parameters()])  # buffers stay per rank
    digest = hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel() * 8)).hexdigest()
    return {"sum": flat.sum().item(), "bytes": digest,
            "first": losses[0], "last": sum(losses[-20:]) / 20, "shm_calls": dist.group.WORLD.shm_calls}


def test_ddp_with_batchnorm_trains_hundreds_of_steps_on_shm_with_identical_replicas():
    res = run_distributed(_ddp_batchnorm, 2, args=(300,), backend="shm", timeout=240)
    assert res[0]["bytes"] == res[1]["bytes"] and res[0]["sum"] == res[1]["sum"]
    assert res[0]["shm_calls"] > 300


# --------------------------------------------------------------------------- hangs become errors


def _peer_left():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.ones(10)
    dist.all_reduce(x)
    if rank == 1:
        pg = dist.group.WORLD
        pg.leave()  # what cpuddp.shutdown() / destroy_process_group() do to the shm group first
        time.sleep(6)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
        return {"error": None}
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc), "seconds": time.monotonic() - start}


def test_a_peer_that_left_the_group_and_lives_on_is_an_error_in_seconds():
    r0, _ = run_distributed(_peer_left, 2, backend="shm", timeout=120)
    assert r0["error"] and "left the group" in r0["error"] and "lives on" in r0["error"], r0
    assert r0["seconds"] < 5, r0


def _launch(mode: str, tmp_path: Path, *, prefix1: tuple = (), timeout: float = 90) -> list[dict]:
    """tests/scripts/shm_faults.py as 2 plain torch.distributed ranks; their JSON reports."""
    from shm_util import launch_ranks

    return launch_ranks(SCRIPTS / "shm_faults.py", 2, mode, tmp_path, timeout=timeout, prefix=((), prefix1))


def test_a_peer_in_another_pid_namespace_that_dies_is_an_error_in_seconds(tmp_path):
    r0, r1 = _launch("peer_dies", tmp_path, prefix1=unshare_pid_or_skip())
    assert r0.get("init") == "ok" and r0.get("first") == "ok", (r0, r1)
    assert r0["pid_ns"] != r1.get("pid_ns"), "rank 1 did not run in a PID namespace of its own"
    # named by the pid the kernel gave the hand-over (the namespace's own pid would mean nothing here)
    assert "died" in r0["second"] and "local rank 1" in r0["second"], r0
    assert r0["second_seconds"] < 5, r0


def test_a_rank_that_dies_while_the_segment_is_handed_over_is_an_error_in_seconds(tmp_path):
    before = set(os.listdir("/dev/shm"))
    r0, _ = _launch("dies_mapping", tmp_path)
    assert "died before it mapped the segment" in r0.get("init", ""), r0
    assert r0["init_seconds"] < 5, r0
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("cpuddp")]


def test_a_peer_slow_to_map_the_segment_is_waited_for_not_called_dead(tmp_path):
    r0, r1 = _launch("slow_mapping", tmp_path)
    for r in (r0, r1):
        assert r.get("init") == "ok" and r.get("first") == "ok", (r0, r1)
        assert r["sum"] == 3.0, r


# --------------------------------------------------------------------------- another local user

INTRUDER = "cpuddp-intruder"


def _intruder_uid() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second local user for the attack")
    try:
        return pwd.getpwnam(INTRUDER).pw_uid
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", INTRUDER],
                              capture_output=True, text=True, timeout=60)
        with contextlib.suppress(KeyError):  # another test process made it first
            return pwd.getpwnam(INTRUDER).pw_uid
        pytest.skip(f"cannot create a second user: {made.stderr.strip()}")


def _system_python() -> str:
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and os.access(cand, os.X_OK):
            return cand
    pytest.skip("no system python3 the second user can run")


def _wait_file(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _attack_once(run: Path, uid: int, forge_who: bool) -> tuple:
    """One job of 2 ranks under attack; (rank reports, the other user's result, the store writer's)."""
    from failure_scripts.procs import free_port
    from cpuddp.testing import clean_environ

    port = free_port()
    script = run / "shm_intruder.py"  # where the other user can read it
    shutil.copy(SCRIPTS / "shm_intruder.py", script)
    os.chmod(script, 0o644)
    user = subprocess.Popen([_system_python(), str(script), "user", "25", str(run)],
                            user=uid, group=uid, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, cwd="/tmp",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_file(run / "fake.json", 20)

    def rank(r: int) -> subprocess.Popen:
        e = clean_environ(os.environ)
        e.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        return subprocess.Popen([sys.executable, str(SCRIPTS / "shm_faults.py"), "attacked", str(run)],
                                env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    ranks = [rank(0)]  # rank 0 hosts the store and waits for rank 1
    writer = subprocess.Popen([sys.executable, str(script), "store", "127.0.0.1", str(port), "20", str(run),
                               "forge-who" if forge_who else "keep-who"],
                              env=clean_environ(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    _wait_file(run / "connected", 60)  # the intruder is at the store before the group forms
    ranks.append(rank(1))
    try:
        outs = [p.communicate(timeout=120)[0] for p in ranks]
        (run / "done").touch()  # the job has ended: the other user's role stops now, not at its deadline
        logs = [p.communicate(timeout=60)[0] for p in (user, writer)]
    finally:
        for p in (*ranks, user, writer):
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = [json.loads((run / f"rank{r}.json").read_text()) if (run / f"rank{r}.json").exists()
               else {"output": outs[r][-2000:]} for r in range(2)]
    took = json.loads((run / "user.json").read_text()) if (run / "user.json").exists() else {"log": logs[0][-2000:]}
    wrote = json.loads((run / "store.json").read_text()) if (run / "store.json").exists() else {"log": logs[1][-2000:]}
    return reports, took, wrote


@pytest.mark.parametrize("forge_who", [False, True], ids=["offers-and-gloo-keys", "and-host-lines"])
def test_another_local_user_can_make_a_job_fail_but_never_read_or_change_its_data(forge_who):
    """The issue-28 attack and more: the other user rewrites the store's offers, gloo-like address
    keys (pointing at a relay it runs), and -- ``forge_who`` -- rank 1's host record, so the ranks
    would think they share no node and talk over gloo.  No tensor may reach the relay, no result
    may be wrong, a rank that formed its group must have run its calls through shared memory (the
    relay's keys are not gloo's own, so it alone would not see a move onto gloo), the segment may
    not leak; a job may fail, naming why."""
    import tempfile

    uid = _intruder_uid()
    outcomes, refused_count = [], 0
    base = Path(tempfile.mkdtemp(prefix="cpuddp-attack-", dir="/tmp"))
    try:
        # Two attempts; with ``forge_who`` up to two more until a rank has refused the store's count.
        # The forgery races rank 1's one true write of its record: rank 0 may read the true one in
        # the moment before the next forgery lands, and then the job fails (or runs) for another
        # reason -- as safe, but it does not show the count check, so another attempt is made.
        for attempt in range(4):
            if attempt >= 2 and (not forge_who or refused_count):
                break
            run = base / f"run{attempt}"
            run.mkdir()
            os.chmod(base, 0o755)
            os.chmod(run, 0o777)
            reports, took, wrote = _attack_once(run, uid, forge_who)
            assert took.get("uid") == uid, took
            assert wrote.get("writes", 0) > 0, wrote
            assert took["stolen_fds"] == 0, f"the other user obtained the job's segment: {took}"
            assert took["relay_connections"] == 0 and took["relay_bytes"] == 0, f"data reached the relay: {took}"
            for r in reports:
                assert "WRONG RESULT" not in json.dumps(r), reports
                if r.get("init") == "ok":
                    assert r.get("loop") == "ok" and r.get("calls") == 200, reports  # every result checked
                    assert r.get("shm_calls", 0) >= 200, f"a forged store moved the node's calls onto gloo: {reports}"
                else:
                    assert r.get("init"), reports
            refused_count += any("the launcher says 2 ranks run on this node" in r.get("init", "") for r in reports)
            outcomes.append([r.get("init") for r in reports])
            print("attack", attempt, outcomes[-1], took, wrote)
        if forge_who:  # the launcher's LOCAL_WORLD_SIZE=2 outweighs a store that hides the peer
            assert refused_count, outcomes
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- asynchronous collectives


def _in_flight():
    import threading

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    # one thread, 40 queued 1 MiB allreduces, waited at the end
    ts = [torch.full((1 << 18,), float(rank + i)) for i in range(40)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    assert all(t[0].item() == t[-1].item() == 2 * i + 1 for i, t in enumerate(ts))
    # two threads, each on its own shm group, collectives in flight at the same time
    groups = [dist.new_group(backend="shm"), dist.new_group(backend="shm")]
    errors = []

    def worker(k: int) -> None:
        try:
            for i in range(60):
                x = torch.full((1000 * (i % 5 + 1),), float(rank + 1))
                w = dist.all_reduce(x, group=groups[k], async_op=True)
                b = torch.tensor([i if rank == 0 else -1])
                dist.broadcast(b, src=0, group=groups[k])
                w.wait()
                assert x[0].item() == 3.0 and b.item() == i
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors, [g.shm_calls for g in groups]


@pytest.mark.parametrize("thread", ["0", "1"])
def test_many_collectives_in_flight_from_one_and_from_two_threads(thread):
    res = run_distributed(_in_flight, 2, backend="shm", timeout=180, env={"CPUDDP_SHM_ASYNC": thread})
    for errors, calls in res:
        assert errors == [] and calls == [120, 120], res  # 60 all_reduces and 60 broadcasts each


def _peer_dies_with_work_queued(out: str):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    works = [dist.all_reduce(torch.ones(1 << 20), async_op=True) for _ in range(3)]
    if rank == 1:
        os._exit(0)  # dies with work queued (on its communication thread, when it has one)
    start = time.monotonic()
    errors = []
    for _ in range(20):  # an error is raised by the call (run in this thread) or by its wait()
        try:
            works.append(dist.all_reduce(torch.ones(1 << 20), async_op=True))
        except Exception as exc:  # noqa: BLE001
            errors.append(str(exc))
    for w in works:
        try:
            w.wait()
        except Exception as exc:  # noqa: BLE001
            errors.append(str(exc))
    Path(out).write_text(json.dumps({"errors": errors, "seconds": time.monotonic() - start}))


@pytest.mark.parametrize("thread", ["0", "1"])
def test_a_peer_dying_while_work_is_queued_errors_without_a_hang(tmp_path, thread):
    from cpuddp.errors import RankFailedError

    out = tmp_path / "rank0.json"
    with pytest.raises(RankFailedError):  # rank 1 exits without a result: the harness says so
        run_distributed(_peer_dies_with_work_queued, 2, args=(str(out),), backend="shm", timeout=120,
                        env={"CPUDDP_SHM_ASYNC": thread})
    r0 = json.loads(out.read_text())
    assert r0["errors"] and all("died" in e or "gave up" in e or "broken" in e for e in r0["errors"]), r0
    assert any("died" in e for e in r0["errors"]), r0
    assert r0["seconds"] < 10, r0


def _shutdown_in_flight():
    import torch
    import torch.distributed as dist

    import cpuddp

    tensors = [torch.ones(1 << 20) for _ in range(10)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    start = time.monotonic()
    cpuddp.shutdown()
    outcomes = []
    for w in works:
        try:
            w.wait()
            outcomes.append("done")
        except Exception as exc:  # noqa: BLE001
            outcomes.append(f"error: {exc}")
    sums = [t.min().item() if bool((t == t[0]).all()) else -1.0 for t in tensors]  # -1: not one value throughout
    return {"shutdown_s": time.monotonic() - start, "outcomes": outcomes, "sums": sums}


@pytest.mark.parametrize("thread", ["0", "1"])
def test_shutdown_with_work_in_flight_finishes_it_first(thread):
    """``shutdown()`` with ten all-reduces in flight on every rank: the stream runs its queue to
    the end before the rank leaves (``Stream.close`` joins the thread, then the state word says
    "left"), so each Work completes -- and with its result.  Issue 37 #8: the test accepted
    "done" or any error, which every run produces."""
    res = run_distributed(_shutdown_in_flight, 2, backend="shm", timeout=120, env={"CPUDDP_SHM_ASYNC": thread})
    for r in res:
        assert r["shutdown_s"] < 15, r
        assert r["outcomes"] == ["done"] * 10, r
        assert r["sums"] == [2.0] * 10, r  # each all-reduce of ones over 2 ranks, whole


# --------------------------------------------------------------------------- soak


def _soak(rounds: int):
    import resource

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()

    def usage():
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(os.listdir("/proc/self/fd")),
                len(os.listdir("/proc/self/task")))

    sizes = (1, 255, 4096, 65536, 300001, 1 << 20, 5 << 20)
    ramps = {n: torch.arange(n, dtype=torch.float32) % 1021 for n in sizes}  # a prime: no chunk looks like the next
    mark = None
    for i in range(rounds):
        numel = sizes[i % len(sizes)]
        scale = 1 + i % 3
        # every element differs from its neighbours and between rounds; sums stay exact in float32
        x = ramps[numel] + (rank + 1) * scale
        w = dist.all_reduce(x, async_op=bool(i % 2))
        if w is not None:
            w.wait()
        want = 2 * ramps[numel] + 3 * scale
        if not torch.equal(x, want):
            bad = (x != want).nonzero().flatten()
            raise AssertionError(f"round {i}, {numel} elements: {bad.numel()} wrong, the first at {bad[0].item()}: "
                                 f"{x[bad[0]].item()} != {want[bad[0]].item()}")
        if i % 97 == 0:
            b = torch.tensor([i * 10 + rank])
            dist.broadcast(b, src=0)
            assert b.item() == i * 10, (i, b.item())
        if i == rounds // 4:
            mark = usage()
    return {"mark": mark, "end": usage()}


def test_soak_results_right_and_memory_descriptors_threads_flat():
    """1,400 all-reduces of 1 to 5 M elements, every element checked against its exact sum
    (issue 37 #8: the soak checked the first and last element of constant tensors)."""
    res = run_distributed(_soak, 2, args=(1400,), backend="shm", timeout=240)
    for r in res:
        (rss0, fds0, th0), (rss1, fds1, th1) = r["mark"], r["end"]
        assert fds1 == fds0 and th1 == th0, r
        assert rss1 - rss0 < 64 * 1024, r  # KiB: no growth beyond noise after the first quarter
