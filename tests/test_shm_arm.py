"""The shm backend on a CPU that is not x86 (aarch64): the native data path only.

The Python data path relies on x86's store ordering; on aarch64 a group forms only where every
local rank agrees on the native one, the Python engine's own steps (the collectives the library
does not run, the agreement) call the library's fence, and ``backend="auto"`` offers shm only
where the library loads.  No Arm CPU is at hand: the decisions are tested here as pure
functions and, with real ranks on this machine, on a CPU the group takes for aarch64
(``arch.machine`` replaced in each rank); the library itself is built for aarch64 and its
protocol run under qemu-aarch64 by .ci/native.sh (tests/native/threads.c).
"""

from __future__ import annotations

import pytest

from cpuddp.backends.shm.protocol import check as shm_check
from cpuddp.testing import run_distributed

GiB = 1 << 30


# --------------------------------------------------------------------------- eligibility (pure)


def test_auto_offers_shm_on_aarch64_where_the_native_library_loads():
    ok, reason = shm_check.eligibility(2, {}, machine="aarch64", free_bytes=lambda: GiB,
                                       native_unavailable=lambda env: None)
    assert ok and reason.startswith("2 local ranks on aarch64 (native data path), 1 GiB"), reason


@pytest.mark.parametrize("why", ["no C compiler was found when cpuddp was installed", "CPUDDP_SHM_NATIVE=0"])
def test_auto_does_not_offer_shm_on_aarch64_without_the_native_library_and_says_why(why):
    asked = []
    ok, reason = shm_check.eligibility(2, {"X": "1"}, machine="aarch64", free_bytes=lambda: GiB,
                                       native_unavailable=lambda env: asked.append(dict(env)) or why)
    assert not ok and asked == [{"X": "1"}]
    assert "the CPU is aarch64" in reason and "native data path only" in reason, reason
    assert "relies on x86's store ordering" in reason and reason.endswith(f"it cannot run here: {why}"), reason


def test_x86_never_asks_the_native_library():
    def never(env):
        raise AssertionError("asked on x86")

    for machine in ("x86_64", "AMD64", "i686"):
        ok, reason = shm_check.eligibility(2, {}, machine=machine, free_bytes=lambda: GiB, native_unavailable=never)
        assert ok and "native data path" not in reason, reason


def test_the_earlier_checks_still_come_first_on_aarch64():
    def never(env):
        raise AssertionError("asked before the opt-out and the rank count")

    assert "opts out" in shm_check.eligibility(2, {"CPUDDP_SHM": "0"}, machine="aarch64", native_unavailable=never)[1]
    assert "1 rank(s)" in shm_check.eligibility(1, {}, machine="aarch64", native_unavailable=never)[1]


def test_doctors_line_names_the_native_data_path_on_aarch64(monkeypatch):
    import platform

    from cpuddp.backends.shm import native

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(native, "unavailable", lambda env=None: None)
    assert shm_check.probe(object()) == (True, "aarch64 CPU with the native data path, and memory for the segment")
    monkeypatch.setattr(native, "unavailable", lambda env=None: "its library does not load: (pretend)")
    ok, reason = shm_check.probe(object())
    assert not ok and reason.endswith("it cannot run here: its library does not load: (pretend)"), reason


@pytest.mark.parametrize("env, fix", [
    ({}, "build the native library: pip install cpuddp again where a C compiler is"),
    ({"CPUDDP_SHM_NATIVE": "0"}, "unset CPUDDP_SHM_NATIVE (on aarch64 shm runs on the native data path"),
])
def test_backend_shm_named_on_aarch64_without_the_native_path_gets_its_fix(monkeypatch, env, fix):
    import platform

    from cpuddp.backends import registry  # noqa: F401  (the built-in backends)
    from cpuddp.backends.shm import native
    from cpuddp.backends.types import BACKENDS, BackendName, Lookups

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(native, "unavailable", lambda environ=None: env.get("CPUDDP_SHM_NATIVE") or "(pretend)")
    spec, lk = BACKENDS[BackendName.SHM], Lookups(lambda d: None, lambda m: True, env)
    st = spec.status(lk)
    err = spec.refusal(st, lk)
    assert not st.available and shm_check.NATIVE_ONLY in str(err), err
    assert err.fix.startswith(fix), err.fix
    assert err.fix.endswith("or pass backend='auto' (it takes gloo here) or 'gloo'"), err.fix


def test_the_channel_gets_no_fence_on_x86_and_the_librarys_elsewhere(monkeypatch):
    from cpuddp.backends.shm import native
    from cpuddp.backends.shm.group import arch

    monkeypatch.setattr(arch, "machine", lambda: "x86_64")
    assert arch.fence_here() is None
    monkeypatch.setattr(arch, "machine", lambda: "aarch64")
    try:
        lib = native.load()
    except native.Unavailable:
        lib = None
    if lib is not None:
        assert arch.fence_here() is lib.fence and lib.fence() is None
    monkeypatch.setattr(native, "_loaded", (None, "(pretend)"))
    assert arch.fence_here() is None  # the node then agrees on the Python path, which check_path refuses


# --------------------------------------------------------------------------- real ranks, a pretend aarch64


def _as_aarch64(no_library: bool = False) -> dict:
    """This rank's group takes the CPU for aarch64; its library's fence counts its calls."""
    from cpuddp.backends.shm import native
    from cpuddp.backends.shm.group import arch

    arch.machine = lambda: "aarch64"  # this process only
    calls = {"fence": 0}
    if no_library:
        native._loaded = (None, "no C compiler was found when cpuddp was installed (pretend)")
        return calls
    lib = native.load()
    real = lib.fence

    def counted() -> None:
        calls["fence"] += 1
        real()

    lib.fence = counted
    return calls


def _collectives_on_aarch64() -> dict:
    import torch
    import torch.distributed as dist

    import cpuddp.shm  # noqa: F401  (registers "shm" with torch)

    calls = _as_aarch64()
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(n)), backend="shm")
    formed = calls["fence"]
    t = torch.arange(1000, dtype=torch.float32) + rank
    dist.all_reduce(t, group=group)  # the native data path
    after_native = calls["fence"]
    c = torch.full((300,), complex(rank, 1), dtype=torch.complex64)
    dist.all_reduce(c, group=group)  # the library reduces no complex: the Python engine, fenced
    outs = [torch.empty(5, dtype=torch.int64) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((5,), 10 * rank + j) for j in range(n)], group=group)
    gathered = [torch.empty(3) for _ in range(n)]
    dist.all_gather(gathered, torch.full((3,), float(rank)), group=group)
    dist.barrier(group=group)
    return {"path": group.data_path, "reason": group.reason, "formed": formed, "native": after_native - formed,
            "python": calls["fence"] - after_native, "sum": t[:3].tolist(), "complex": c[0].item(),
            "a2a": [o[0].item() for o in outs], "gathered": [g[0].item() for g in gathered]}


@pytest.mark.slow
@pytest.mark.parametrize("ranks, env", [(2, {}), (3, {"CPUDDP_SHM_NUMA": "0,0,1"})])
def test_on_aarch64_the_group_runs_the_native_path_and_python_steps_take_the_fence(ranks, env):
    from cpuddp.backends.shm import native

    try:
        native.load()
    except native.Unavailable as exc:
        pytest.skip(f"no native library here: {exc}")
    res = run_distributed(_collectives_on_aarch64, ranks, backend="gloo", timeout=240,
                          env={"CPUDDP_SHM_NATIVE": "auto", **env})
    total = sum(range(ranks))
    for rank, got in enumerate(res):
        # a node spread over NUMA nodes runs the native one-level path (the two-level plan is Python's)
        assert got["path"].startswith("native data path"), got
        assert got["formed"] > 0 and got["native"] == 0 and got["python"] > 0, got
        assert got["sum"] == [float(ranks * i + total) for i in range(3)], got
        assert got["complex"] == complex(total, ranks), got
        assert got["a2a"] == [10 * j + rank for j in range(ranks)], got
        assert got["gathered"] == [float(j) for j in range(ranks)], got


def _refused_on_aarch64(no_library_on: tuple) -> str:
    import torch.distributed as dist

    import cpuddp.shm  # noqa: F401

    _as_aarch64(no_library=dist.get_rank() in no_library_on)
    try:
        dist.new_group(list(range(dist.get_world_size())), backend="shm")
        return "formed"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


HEAD = "shm: the Python data path relies on x86's store ordering; this CPU is aarch64 and "


@pytest.mark.slow
def test_on_aarch64_a_group_that_would_take_the_python_path_is_refused_naming_why():
    for got in run_distributed(_refused_on_aarch64, 2, args=((),), backend="gloo", timeout=120,
                               env={"CPUDDP_SHM_NATIVE": "0"}):
        assert got.startswith("BackendError: " + HEAD + "CPUDDP_SHM_NATIVE=0 asks for the Python data path"), got
        assert "unset CPUDDP_SHM_NATIVE" in got, got
    for got in run_distributed(_refused_on_aarch64, 2, args=((0, 1),), backend="gloo", timeout=120,
                               env={"CPUDDP_SHM_NATIVE": "auto"}):
        assert HEAD + "the native library did not load: no C compiler was found" in got, got
        assert "python -m cpuddp.backends.shm.native.build" in got and "backend='gloo'" in got, got


@pytest.mark.slow
def test_on_aarch64_a_node_where_one_rank_lacks_the_library_is_refused_on_every_rank():
    from cpuddp.backends.shm import native

    try:
        native.load()
    except native.Unavailable as exc:
        pytest.skip(f"no native library here: {exc}")
    lacks, has = run_distributed(_refused_on_aarch64, 2, args=((0,),), backend="gloo", timeout=120,
                                 env={"CPUDDP_SHM_NATIVE": "auto"})
    assert HEAD + "the native library did not load" in lacks, lacks
    assert HEAD + "not every rank of this node can run the native one" in has, has
    assert "rank(s) [0] on this node have no native library" in has, has
