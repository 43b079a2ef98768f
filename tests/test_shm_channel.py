"""The shm group's one lifecycle state (cpuddp.backends.shm.protocol.channel.Lifecycle): its transitions
and what each state lets a call do.  The multi-process behaviour of each state is tested in
tests/test_shm_lifecycle.py and tests/test_shm_faults.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cpuddp.backends.shm.protocol.channel import Lifecycle, State
from cpuddp.errors import GroupShutDownError


def test_forming_then_live_then_broken_keeps_the_first_error():
    life = Lifecycle()
    assert life.state is State.FORMING
    life.live()
    assert life.state is State.LIVE
    life.check_usable()
    life.check_not_broken()
    life.broke("rank 1 died")
    life.broke("a later error")
    assert (life.state, life.why) == (State.BROKEN, "rank 1 died")
    life.check_usable()  # broken is not gone: the call itself raises, naming the first error
    with pytest.raises(dist.DistBackendError, match="broken by an earlier error: rank 1 died"):
        life.check_not_broken()


def test_left_and_closed_are_gone_and_say_shut_down():
    life = Lifecycle()
    life.live()
    assert life.leave() is True
    assert life.leave() is False  # leaving twice does nothing the second time
    life.broke("an error while leaving")
    assert life.state is State.LEFT  # a group that left stays left
    with pytest.raises(GroupShutDownError, match="was shut down"):
        life.check_usable()
    life.close()
    assert life.state is State.CLOSED and life.gone
    with pytest.raises(GroupShutDownError, match="was shut down"):
        life.check_usable()


def test_a_broken_group_that_leaves_is_gone():
    life = Lifecycle()
    life.live()
    life.broke("mismatch")
    assert life.leave() is True and life.gone
