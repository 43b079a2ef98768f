"""The backend's part of init in one call (cpuddp.backends.start): decide, then export, load and pin
until the ranks say ready, then form and prove the group -- the session's own steps called in that
order, and none of them after a failure that comes before."""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator

import pytest
import torch.distributed as dist

from cpuddp.backends import types
from cpuddp.backends.start import InitJob, start_backend
from cpuddp.errors import BackendError
from cpuddp.launchers.env import DistEnv

TD = datetime.timedelta(seconds=30)


@contextlib.contextmanager
def _stage(events: list, name: str) -> Iterator[None]:
    events.append(f"{name} begins")
    try:
        yield
    except BaseException as exc:
        events.append(f"{name} failed: {type(exc).__name__}")
        raise
    events.append(f"{name} ends, group formed: {dist.is_initialized()}")


def _job(events: list, *, pin: bool) -> InitJob:
    """A world of one whose session records its steps (the session's own are tested through
    init_distributed: tests/test_init_order.py, tests/test_distributed.py)."""
    return InitJob(DistEnv(), None, None, None, "b", TD, {}, pin,
                   export=lambda settings: events.append(("export", dict(settings))),
                   pin_compute=lambda plan: events.append(("pin", plan.cpus)),
                   until_ready=lambda: _stage(events, "until ready"), forming=lambda: _stage(events, "forming"))


def test_the_steps_run_in_the_sessions_order_and_the_group_is_proven(monkeypatch):
    events: list = []
    real_load = types.BackendSpec.load

    def load(self, choice):
        events.append(("load", choice.name))
        real_load(self, choice)

    monkeypatch.setattr(types.BackendSpec, "load", load)
    try:
        plan = start_backend("gloo", _job(events, pin=True))
        assert dist.is_initialized() and dist.get_backend() == "gloo"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert plan.name == "gloo" and plan.pin_plan is not None
    assert events == [
        "until ready begins",
        ("export", dict(plan.env)),  # before the backend's module is loaded: it reads them
        ("load", "gloo"),
        ("pin", plan.pin_plan.cpus),
        "until ready ends, group formed: False",  # the ranks say ready before any group forms
        "forming begins",
        "forming ends, group formed: True",
    ]


def test_without_pinning_no_pin_step():
    events: list = []
    try:
        plan = start_backend("gloo", _job(events, pin=False))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert plan.pin_plan is None and not [e for e in events if e[0] == "pin"]


def test_a_failed_decision_reaches_the_session_before_anything_is_carried_out():
    """The session publishes it (the others stop naming this rank) and undoes nothing: nothing
    was exported, loaded, pinned or formed."""
    events: list = []
    with pytest.raises(BackendError, match="unknown backend 'nosuch'"):
        start_backend("nosuch", _job(events, pin=True))
    assert events == ["until ready begins", "until ready failed: BackendError"]
    assert not dist.is_initialized()
