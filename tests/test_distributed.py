"""init_distributed(): world of 1, idempotence, timeouts, exports, errors, and real 2-rank groups."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch
import torch.distributed as dist

import cpuddp
from cpuddp.distributed import Session, get_session
from cpuddp.launchers.exports import timeout_from as _timeout
from cpuddp.launchers.env import DistEnv
from cpuddp.errors import RendezvousError


def test_world_of_one_without_launcher_just_works():
    environ: dict[str, str] = {}
    env = cpuddp.init_distributed(environ=environ, pin=False)
    try:
        assert (env.rank, env.world_size, env.launcher, get_session().backend) == (0, 1, "none", "gloo")
        assert get_session().env is env and get_session().pin_plan is None  # pin=False
        assert dist.is_initialized() and dist.get_world_size() == 1
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        # No launcher: no rank variables, so a framework started after init still launches its own ranks.
        assert environ == {}
        assert cpuddp.init_distributed(environ=environ, pin=False) is env  # safe to call twice
        assert cpuddp.get_env() is env
    finally:
        cpuddp.shutdown()
    assert not dist.is_initialized() and cpuddp.get_env() is None and get_session() is None
    cpuddp.shutdown()  # and safe when nothing is initialized


def test_env_backend_and_pin_plan_are_deprecated_and_forward_to_the_session():
    env = cpuddp.init_distributed(environ={}, pin=True)
    try:
        sess = get_session()
        assert isinstance(sess, Session) and sess.backend == "gloo" and sess.pin_plan is not None
        with pytest.warns(DeprecationWarning, match="get_session"):
            assert env.backend == "gloo"
        with pytest.warns(DeprecationWarning, match="get_session"):
            assert env.pin_plan is sess.pin_plan
        # the plain-data views keep the keys they always had (DistEnv's for one release)
        assert env.as_dict()["backend"] == "gloo" == sess.as_dict()["backend"]
        assert env.as_dict()["pin_plan"] == sess.pin_plan.as_dict() == sess.as_dict()["pin_plan"]
        assert sess.as_dict()["rank"] == 0 and sess.as_dict()["sources"]["rank"] == "default"
    finally:
        cpuddp.shutdown()
    with pytest.warns(DeprecationWarning):
        assert DistEnv().backend is None  # a DistEnv no init made has no backend
    with pytest.warns(DeprecationWarning):
        assert DistEnv().pin_plan is None


def test_session_context_manager_tears_down():
    with cpuddp.session(environ={}, pin=False) as env:
        assert dist.is_initialized() and env.world_size == 1
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "value, seconds",
    [(None, 300.0), (12, 12.0), (1.5, 1.5), (datetime.timedelta(minutes=2), 120.0)],
)
def test_timeout_accepts_seconds_or_timedelta(value, seconds):
    assert _timeout(value, {}).total_seconds() == seconds


def test_timeout_from_environment_and_bad_values():
    assert _timeout(None, {"CPUDDP_TIMEOUT": "42"}).total_seconds() == 42
    with pytest.raises(ValueError, match="CPUDDP_TIMEOUT"):
        _timeout(None, {"CPUDDP_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="positive"):
        _timeout(-1, {})


def test_user_value_that_must_change_is_logged_and_restored_at_shutdown(caplog):
    # Under a launcher the rank variables must describe this process (a plain `python` run
    # exports none since issue 20, so the exporter is driven directly here).
    from cpuddp.launchers.exports import Exports

    environ = {"LOCAL_WORLD_SIZE": "7"}
    exports = Exports()
    with caplog.at_level("WARNING", logger="cpuddp"):
        exports.export(environ, {"LOCAL_WORLD_SIZE": "1"}, reason="describes this process", strict=True)
        assert environ["LOCAL_WORLD_SIZE"] == "1"
        exports.unexport()
    assert any("LOCAL_WORLD_SIZE was '7'" in r.getMessage() for r in caplog.records)
    assert environ == {"LOCAL_WORLD_SIZE": "7"}  # shutdown puts back what init exported


def test_port_in_use_on_rank0_fails_at_once():
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.monotonic()
    try:
        with pytest.raises(RendezvousError) as info:
            cpuddp.init_distributed(environ=environ, pin=False, timeout=30)
    finally:
        holder.close()
    assert time.monotonic() - start < 5
    assert f"MASTER_PORT={port}" in str(info.value) and "in use" in str(info.value)
    assert not dist.is_initialized()


def _allreduce_rank() -> dict:
    env = cpuddp.get_env()
    t = torch.full((4,), float(env.rank + 1))
    dist.all_reduce(t)
    return {"rank": env.rank, "sum": t[0].item(), "backend": get_session().backend, "launcher": env.launcher}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_real_gloo_group(run_distributed, world_size):
    out = run_distributed(_allreduce_rank, world_size=world_size, timeout=90)
    total = world_size * (world_size + 1) / 2
    assert out == [{"rank": r, "sum": total, "backend": "gloo", "launcher": "env"} for r in range(world_size)]


def test_a_failed_first_collective_is_explained_with_the_transport_and_the_fix(monkeypatch):
    """The group formed but cannot communicate: init's check raises the backend's explanation."""
    from cpuddp.backends.forming import first_collective
    from cpuddp.backends.types import BackendChoice
    from cpuddp.errors import BackendError

    def broken(*args, **kwargs):
        raise RuntimeError("oneCCL: atl_ofi.cpp: failed to initialize ATL")

    monkeypatch.setattr(dist, "all_reduce", broken)
    monkeypatch.setenv("CCL_ATL_TRANSPORT", "ofi")
    with pytest.raises(BackendError, match="failed to initialize ATL") as info:
        first_collective(DistEnv(world_size=2), BackendChoice("ccl", "named"))
    assert "oneCCL transport CCL_ATL_TRANSPORT=ofi" in str(info.value)
