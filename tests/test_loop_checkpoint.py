"""cpuddp.train.checkpoint.atomic and save_state_dict's files: no temporary file outlives a failed or
killed save, the old checkpoint stays loadable, and only dead saves' files of this user are
ever removed.  The killed save is a real process, SIGKILLed while it writes."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from cpuddp.train.loop import load_state_dict, save_state_dict
from cpuddp.train.checkpoint.atomic import is_temp_name, remove_leftovers, write_atomically


def _temps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".cpuddp-"))


@pytest.mark.parametrize("name, ours", [
    (".cpuddp-model.pt.k2j4_x9a.pt", True),
    (".cpuddp-abc123.pt", True),  # the naming of earlier versions
    (".cpuddp-.pt", True),
    ("cpuddp-model.pt.x.pt", False),  # not hidden: not ours
    (".cpuddp-model.pt.x.tmp", False),
    (".cpuddp-model.pt.x.pt~", False),
    ("model.pt", False),
    (".cpuddp-x.pt\n", False),
])
def test_temp_names(name, ours):
    assert is_temp_name(name) is ours


class _Breaks(nn.Linear):
    """A module whose state dict cannot be pickled: torch.save fails after it has begun."""

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        out = super().state_dict(*args, **kwargs)
        out["broken"] = lambda: None
        return out


def test_a_save_that_raises_midway_leaves_nothing_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "model.pt"
    good = nn.Linear(4, 2)
    save_state_dict(good, path)
    before = path.read_bytes()
    with pytest.raises(Exception, match="lambda|pickle"):
        save_state_dict(_Breaks(4, 2), path)
    assert _temps(tmp_path) == []
    assert path.read_bytes() == before
    other = nn.Linear(4, 2)
    load_state_dict(other, path)
    assert torch.equal(other.weight, good.weight)


def test_write_atomically_removes_its_file_on_an_interrupt(tmp_path):
    def write(f) -> None:
        f.write(b"x" * 100_000)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(str(tmp_path / "m.pt"), write)
    assert os.listdir(tmp_path) == []


def test_checkpoint_is_private_and_durable_names(tmp_path):
    path = tmp_path / "model.pt"
    save_state_dict(nn.Linear(2, 2), path)
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert _temps(tmp_path) == []


_KILLED_SAVE = textwrap.dedent("""
    import sys, time, torch
    from torch import nn
    from cpuddp.train.loop import save_state_dict

    class Stall:
        def __reduce__(self):  # called while torch.save writes the temporary file
            print("WRITING", flush=True)
            time.sleep(600)
            return (int, ())

    class M(nn.Linear):
        def state_dict(self, *a, **k):
            out = super().state_dict(*a, **k)
            out["stall"] = Stall()
            return out

    save_state_dict(M(4, 2), sys.argv[1])
""")


def _killed_save(path) -> None:
    """Start a real save of ``path`` in another process and SIGKILL it while it writes."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", f"the save did not start: {line!r} {proc.stderr.read()}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.timeout(120)
def test_a_killed_save_leaves_a_temp_file_that_the_next_save_removes(tmp_path):
    path = tmp_path / "model.pt"
    old = nn.Linear(4, 2)
    save_state_dict(old, path)
    _killed_save(path)
    left = _temps(tmp_path)
    assert len(left) == 1 and left[0].startswith(".cpuddp-model.pt."), left
    # the old checkpoint is still whole
    other = nn.Linear(4, 2)
    load_state_dict(other, path)
    assert torch.equal(other.weight, old.weight)
    # the next save removes the dead save's file and writes the new checkpoint
    new = nn.Linear(4, 2)
    save_state_dict(new, path)
    assert _temps(tmp_path) == []
    load_state_dict(other, path)
    assert torch.equal(other.weight, new.weight)


def test_a_save_in_flight_is_never_removed(tmp_path):
    live = tmp_path / ".cpuddp-model.pt.inflight.pt"
    live.write_bytes(b"partial")
    with open(live, "rb") as holder:  # a writer holds its temporary file locked
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert remove_leftovers(str(tmp_path)) == []
        assert live.exists()
    assert remove_leftovers(str(tmp_path)) == [live.name]  # its writer is gone: removed


def test_only_our_own_regular_files_are_removed(tmp_path):
    victim = tmp_path / "precious.pt"
    victim.write_text("keep me")
    (tmp_path / ".cpuddp-link.pt").symlink_to(victim)  # a symlink is never followed nor removed
    (tmp_path / ".cpuddp-dir.pt").mkdir()
    (tmp_path / "model.pt.tmp").write_text("not our naming")
    assert remove_leftovers(str(tmp_path)) == []
    assert victim.read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == [".cpuddp-dir.pt", ".cpuddp-link.pt", "model.pt.tmp", "precious.pt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_temp_file_is_left_alone(tmp_path):
    theirs = tmp_path / ".cpuddp-model.pt.theirs.pt"
    theirs.write_bytes(b"their save")
    os.chown(theirs, 1001, 1001)
    assert remove_leftovers(str(tmp_path)) == []
    assert theirs.exists()
