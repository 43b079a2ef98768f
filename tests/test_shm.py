"""The shared-memory backend (cpuddp.shm): results, delegation, DDP, failure behaviour, eligibility.

Multi-rank tests run real processes (``run_distributed`` or tests/scripts/shm_ranks.py started
as plain ``torch.distributed`` ranks), each with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpuddp.backends.shm.protocol import check as shm_check
from cpuddp.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "shm_ranks.py"

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64")
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
BITWISE = ("BAND", "BOR", "BXOR")
#: elements: one, odd, exactly a 1 MiB fp32 slot, several slots plus a ragged tail
SIZES = (1, 1023, 262144, 600001)


# --------------------------------------------------------------------------- rank bodies


def _data(rank: int, numel: int, dtype_name: str, op: str):
    import torch

    g = torch.Generator().manual_seed(rank * 7919 + numel)
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g, dtype=torch.float64)
        if op == "PRODUCT":
            x = 1.0 + x / 16
        return x.to(dtype)
    if op == "PRODUCT":
        return torch.randint(1, 3, (numel,), generator=g).to(dtype)
    return torch.randint(0, 50, (numel,), generator=g).to(dtype)


def _expected(n: int, numel: int, dtype_name: str, op: str):
    """Rank-order reduction, as the backend defines it (bit-exact)."""
    import torch

    parts = [_data(r, numel, dtype_name, op) for r in range(n)]
    fn = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
          "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    out = fn(parts[0], parts[1])
    for p in parts[2:]:
        out = fn(out, p)
    return out / n if op == "AVG" else out


def _digest(t) -> str:
    import ctypes

    t = t.contiguous()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).hexdigest()


def _matrix(sizes):
    """Every dtype x op x size through shm: exact against the rank-order reference, digests per case."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    out = {}
    for dtype_name in DTYPES:
        for op in OPS:
            floating = getattr(torch, dtype_name).is_floating_point
            if (op == "AVG" and not floating) or (op in BITWISE and floating):
                continue
            for numel in sizes:
                t = _data(rank, numel, dtype_name, op)
                before = pg.shm_calls
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                assert pg.shm_calls == before + 1, f"{dtype_name} {op} {numel} went to gloo"
                want = _expected(n, numel, dtype_name, op)
                assert torch.equal(t, want), f"{dtype_name} {op} {numel}: differs from the rank-order reduction"
                out[f"{dtype_name}/{op}/{numel}"] = _digest(t)
    return out


def _interface():
    """torch's interface to the group: the Work/future, the pybind overloads, keyword forms,
    subgroups, and the errors a wrong call gets (before anything moves)."""
    import torch
    import torch.distributed as dist

    from cpuddp.errors import BackendError

    rank, n = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    calls = pg.shm_calls
    x = torch.ones(1000)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    assert work.get_future().value()[0] is x and x[0].item() == n
    y = torch.ones(4)
    pg.allreduce(y).wait()  # pybind overloads: allreduce(tensor), allreduce([tensor], ReduceOp)
    pg.allreduce([y], dist.ReduceOp.MAX).wait()
    assert y.tolist() == [float(n)] * 4
    pg.barrier(opts=dist.BarrierOptions()).wait()  # keywords
    b = torch.full((3,), float(rank))
    pg.broadcast(b, n - 1).wait()  # broadcast(tensor, root)
    assert b.tolist() == [float(n - 1)] * 3
    booleans = torch.tensor([rank == 0, True])
    dist.all_reduce(booleans, op=dist.ReduceOp.MAX)
    assert booleans.tolist() == [True, True]
    assert pg.shm_calls == calls + 6
    errors = []
    for bad in (lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG),
                lambda: dist.all_reduce(torch.ones(2).to_sparse(), op=dist.ReduceOp.MAX),
                lambda: pg.allreduce([torch.ones(2), torch.ones(2)]).wait(),
                lambda: dist.all_gather([torch.ones(3)], torch.ones(3))):
        try:  # refused before it is posted: it never happened, for this rank and its peers
            bad()
        except BackendError as exc:
            errors.append(str(exc))
    assert pg.shm_calls == calls + 6
    sp = torch.sparse_coo_tensor([[rank, 3]], [1.0, 2.0], (5,))  # what DDP sends for sparse gradients
    dist.all_reduce(sp)
    want = torch.zeros(5)
    for r in range(n):
        want[r] += 1.0
    want[3] += 2.0 * n
    assert torch.equal(sp.to_dense(), want), sp
    z = torch.ones(3)  # the group still works
    dist.all_reduce(z)
    sub = dist.new_group(list(range(n)))  # a subgroup is a shm group of its own
    dist.all_reduce(z, group=sub)
    assert z.tolist() == [float(n * n)] * 3 and sub.shm_calls == 1 and pg.shm_calls == calls + 8
    assert dist.get_backend() == "shm"
    return pg.reason, errors


def _ddp_vs_gloo(steps: int = 6):
    """The same DDP training on the shm group and on a gloo group: final parameters' digests."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cpuddp

    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    digests = {}
    cases = [(f"{how}/{name}", how, group) for how in ("ddp", "prepare", "prepare-fp16-hook", "ddp-sparse")
             for name, group in (("shm", None), ("gloo", gloo))]
    for name, how, group in cases:
        torch.manual_seed(0)
        first = (torch.nn.EmbeddingBag(64, 512, mode="sum", sparse=True) if how == "ddp-sparse"
                 else torch.nn.Linear(64, 512))  # sparse gradients: DDP all-reduces a sparse tensor
        model = torch.nn.Sequential(first, torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if how == "ddp-sparse" else 0.9)
        if how.startswith("ddp"):
            ddp = DDP(model, process_group=group, bucket_cap_mb=1)
        else:
            ddp = cpuddp.prepare(model, opt, process_group=group, bucket_cap_mb=1,
                                 comm_hook="fp16" if how.endswith("hook") else None)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            if how == "ddp-sparse":
                x = torch.randint(0, 64, (32, 4), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
        digests[name] = _digest(flat)
    return digests, dist.group.WORLD.shm_calls


def _sharded_vs_gloo(steps: int = 8):
    """FSDP2 (fully_shard) and ZeroRedundancyOptimizer + DDP on the shm group and on a gloo group
    of the same ranks, from the same start: the losses of every step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 4))

    def train(net, opt):
        gen = torch.Generator().manual_seed(7 + rank)
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)  # learnt by heart
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    out = {}
    for name, group in (("shm", dist.group.WORLD), ("gloo", gloo)):
        net = model()
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        out[f"fsdp2/{name}"] = train(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        net = DDP(model(), process_group=group)
        zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                       process_group=group)
        out[f"zero/{name}"] = train(net, zero)
    return out


# --------------------------------------------------------------------------- tests: 2 ranks


@pytest.mark.slow
def test_two_ranks_every_dtype_and_op_exact_and_identical_across_ranks():
    res = run_distributed(_matrix, 2, args=(SIZES,), backend="shm", timeout=240)
    assert res[0] == res[1]
    floats, ints = 4, 5
    assert len(res[0]) == len(SIZES) * (floats * (len(OPS) - len(BITWISE)) + ints * (len(OPS) - 1))


@pytest.mark.slow
def test_two_ranks_torch_interface_and_clear_errors_for_wrong_calls():
    for reason, errors in run_distributed(_interface, 2, backend="shm", timeout=120):
        assert reason.startswith("shared memory among 2 ranks ("), reason
        assert "data path" in reason, reason  # which one, and why (cpuddp.backends.shm.native)
        assert len(errors) == 4, errors
        assert "ReduceOp.AVG of torch.int32 tensors" in errors[0]
        assert "sparse tensor with ReduceOp.MAX" in errors[1]
        assert "got 2 tensors for one rank" in errors[2]
        assert "all_gather: rank" in errors[3] and "pass 2 tensors of that size and dtype" in errors[3]


@pytest.mark.slow
def test_ddp_on_two_ranks_trains_to_the_same_parameters_as_gloo_bit_for_bit():
    res = run_distributed(_ddp_vs_gloo, 2, backend="shm", timeout=180)
    (d0, calls0), (d1, calls1) = res
    assert d0 == d1, "ranks differ"
    for how in ("ddp", "prepare", "prepare-fp16-hook", "ddp-sparse"):
        assert d0[f"{how}/shm"] == d0[f"{how}/gloo"], f"{how}: shm and gloo trained to different parameters"
    assert calls0 == calls1 and calls0 >= 18, "DDP's buckets did not go through shared memory"


@pytest.mark.slow
def test_fsdp2_and_zero_train_on_shm_with_the_losses_of_gloo():
    import torch
    from packaging.version import Version

    # the same sums in the same order: the same losses.  torch 2.8's FSDP2 reduces in another
    # order on gloo than on other backends, so there the losses agree to rounding (Adam grows it)
    exact = Version(torch.__version__).release >= (2, 9)
    for r in run_distributed(_sharded_vs_gloo, 2, backend="shm", timeout=240):
        for engine in ("fsdp2", "zero"):
            shm, gloo = r[f"{engine}/shm"], r[f"{engine}/gloo"]
            assert len(shm) == 8 and shm[-1] < shm[0], (engine, shm)
            if exact or engine == "zero":
                assert shm == gloo, (engine, shm, gloo)
            else:
                assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(shm, gloo)), (engine, shm, gloo)


@pytest.mark.slow
def test_four_ranks_reduce_scatter_all_gather_exact_and_identical():
    res = run_distributed(_matrix, 4, args=((1, 5, 600001),), backend="shm", timeout=300)
    assert all(r == res[0] for r in res)


# --------------------------------------------------------------------------- failure behaviour


def _launch(n: int, mode: str, tmp_path: Path, *, timeout: float = 90, env: dict | None = None) -> list[dict]:
    """Start tests/scripts/shm_ranks.py as ``n`` plain torch.distributed ranks; their JSON reports."""
    from shm_util import launch_ranks

    return launch_ranks(SCRIPT, n, mode, tmp_path, timeout=timeout, env=env)


@pytest.mark.slow
def test_a_dead_peer_ends_the_waiting_rank_at_once(tmp_path):
    r0, _ = _launch(2, "peer_dies", tmp_path)
    assert "error" in r0, r0
    assert "died" in r0["error"] and "rank(s) [1]" in r0["error"], r0
    assert r0["seconds"] < 5, r0  # the group timeout is 60 s: the pid check found it


@pytest.mark.slow
def test_a_stuck_peer_times_out_at_the_group_timeout_and_learns_of_the_abort(tmp_path):
    r0, r1 = _launch(2, "peer_stuck", tmp_path)
    assert "timed out after 3 s" in r0.get("error", ""), r0
    assert 2.5 < r0["seconds"] < 10, r0
    assert r0["cpu_seconds"] < 0.5 * r0["seconds"], r0  # it slept while waiting: no core burnt at 100%
    assert "gave up" in r1.get("error", ""), r1  # the late rank errors at once instead of waiting
    assert r1["seconds"] < 2, r1
    assert "broken" in r0.get("second_error", ""), r0


@pytest.mark.slow
def test_a_reservation_the_kernel_refuses_is_a_clear_error_on_every_rank_not_sigbus(tmp_path):
    # RLIMIT_FSIZE 64 MiB: the kernel refuses to reserve the 128 MiB segment (EFBIG), a real refusal
    env = {"CPUDDP_SHM_SLOT": "32M", "SHM_RANKS_FSIZE": str(64 << 20)}
    reports = _launch(2, "init_only", tmp_path, env=env)
    for r in reports:
        assert "cannot reserve 128.0 MiB of shared memory for 2 local ranks" in r.get("error", ""), r
        assert "CPUDDP_SHM_SLOT" in r["error"] and "backend='gloo'" in r["error"]


@pytest.mark.slow
def test_a_peer_that_cannot_reserve_its_own_slots_is_a_clear_error_on_every_rank(tmp_path):
    # each rank reserves its own slots (on its NUMA node): rank 1's posix_fallocate says ENOMEM
    # (RLIMIT_FSIZE cannot refuse it: local rank 0 has already sized the segment)
    r0, r1 = _launch(2, "init_only", tmp_path, env={"SHM_RANKS_NOMEM_RANK": "1"})
    want = "cannot reserve 1 MiB of shared memory for local rank 1's slots: Cannot allocate memory"
    assert want in r1.get("error", ""), r1
    assert "CPUDDP_SHM_SLOT" in r1["error"] and "backend='gloo'" in r1["error"]
    assert want in r0.get("error", ""), r0


@pytest.mark.slow
def test_nothing_is_created_in_dev_shm(tmp_path):
    before = set(os.listdir("/dev/shm"))
    reports = _launch(2, "init_only", tmp_path)
    assert all(r.get("ok") for r in reports), reports
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("cpuddp")]


# --------------------------------------------------------------------------- eligibility and registration


@pytest.mark.parametrize("n, env, machine, free, ok, words", [
    (2, {}, "x86_64", 1 << 30, True, "2 local ranks on x86_64, 1 GiB of memory available"),
    (8, {}, "AMD64", 1 << 30, True, "8 local ranks"),
    (2, {"CPUDDP_SHM": "0"}, "x86_64", 1 << 30, False, "CPUDDP_SHM=0 opts out"),
    (1, {}, "x86_64", 1 << 30, False, "1 rank(s)"),
    (2, {}, "x86_64", None, True, "unknown memory"),
    (2, {}, "x86_64", 1 << 20, False, "1 MiB of memory is available, and 2 local ranks need 4.0 MiB"),
    (2, {"CPUDDP_SHM_SLOT": "64M"}, "x86_64", 64 << 20, False, "lower CPUDDP_SHM_SLOT"),
    (2, {"CPUDDP_SHM_SLOT": "1000"}, "x86_64", 1 << 30, False, "CPUDDP_SHM_SLOT='1000'"),
])
def test_eligibility(n, env, machine, free, ok, words):
    got, reason = shm_check.eligibility(n, env, machine=machine, free_bytes=lambda: free)
    assert got is ok and words in reason, reason


def test_more_local_ranks_than_node_cpus_is_a_no():
    # measured: 4 ranks on 2 CPUs ran at 0.06x gloo at 4 MiB (waiting ranks take peers' CPUs)
    got, reason = shm_check.eligibility(4, {}, machine="x86_64", free_bytes=lambda: 1 << 40, node_cpus=2)
    assert not got and "4 local ranks share 2 CPU(s)" in reason
    got, _ = shm_check.eligibility(2, {}, machine="x86_64", free_bytes=lambda: 1 << 40, node_cpus=2)
    assert got


def test_reservation_is_two_slots_per_rank_plus_header_control_lines_and_rings():
    assert shm_check.reservation_bytes(2, {}) == 4096 + 4096 + 4096 + 4 * (1 << 20)
    assert shm_check.reservation_bytes(64, {"CPUDDP_SHM_SLOT": "4K"}) == 4096 + 8192 + 64 * 1024 + 128 * 4096


def test_checks_stay_light_and_the_module_registers_once():
    code = ("import sys, cpuddp.backends.shm.protocol.check, cpuddp.backends as b; assert 'torch' not in sys.modules; "
            "print(b.backend_status('shm').available); "
            "import cpuddp.shm, importlib, torch.distributed as d; cpuddp.shm.register(); "
            "importlib.reload(sys.modules['cpuddp.backends.shm.group.process_group']); "
            "print(d.Backend.backend_list.count('shm'), d.Backend.SHM)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1", "shm"]


# --------------------------------------------------------------------------- two hosts x two ranks


@pytest.mark.slow
@pytest.mark.netns
def test_two_namespace_hosts_of_two_ranks_match_gloo_and_each_other(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from netns_util import veth_pair

    addrs = ("10.78.0.1", "10.78.0.2")
    with veth_pair("shm", addrs) as pair:
        procs = []
        for r in range(4):
            node = r // 2
            env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "LOCAL", "MASTER"))}
            env.update(RANK=str(r), WORLD_SIZE="4", MASTER_ADDR=addrs[0], MASTER_PORT="29511",
                       GLOO_SOCKET_IFNAME=pair.interfaces[node], OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(["ip", "netns", "exec", pair.namespaces[node], sys.executable, str(SCRIPT),
                                           "compare", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        try:
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) if (tmp_path / f"rank{r}.json").exists()
               else {"output": outs[r][-3000:]} for r in range(4)]
    from cpuddp.backends.shm import native

    path = "native data path" if native.status()[0] else "Python data path"  # the node part's
    for r in reports:
        reason = r.get("reason", "")
        assert reason.startswith("shared memory within each of 2 nodes (2 ranks each; "), r
        assert reason.endswith("), gloo between them") and path in reason, r
        assert r["bad"] == [], r["bad"][:20]
        assert r["shm_calls"] > 50, r
    assert all(r["digests"] == reports[0]["digests"] for r in reports), "ranks differ"
