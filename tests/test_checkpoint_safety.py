"""Checkpoints in unsafe places and on full disks (issue 30's red-team cases): a directory
another user can change, or owns, is refused with the fix; so is a file to load that another
user owns; a full disk says "no space left" with the path and the size, and the previous
checkpoint survives.  The full disk is a real 256 KiB tmpfs where the kernel lets us mount
one (a mount namespace), and an injected errno everywhere."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from cpuddp.errors import CheckpointError
from cpuddp.train import checkpoint as ckpt
from cpuddp.train import paths
from cpuddp.train.ckpt_dirs import make_temp_dir, remove_dead_dirs
from cpuddp.train.loop import load_state_dict, save_state_dict
from cpuddp.train.resume import load_checkpoint, save_checkpoint

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root (chown)")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 4)


def _temps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".cpuddp-"))


# --------------------------------------------------------------------------- arguments


def test_save_and_load_state_dict_check_their_arguments(tmp_path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for fn in (save_state_dict, load_state_dict):
        with pytest.raises(CheckpointError, match=rf"cpuddp.{fn.__name__}\(\) takes the model .* got torch.optim.sgd.SGD") as err:
            fn(opt, tmp_path / "m.pt")
        assert "cpuddp.save_checkpoint(directory, model=model, optimizer=optimizer" in err.value.fix
        with pytest.raises(CheckpointError, match="the arguments are swapped"):
            fn(str(tmp_path / "m.pt"), model)
        with pytest.raises(CheckpointError, match="is a directory"):
            fn(model, tmp_path)
        with pytest.raises(CheckpointError, match="path must be a str or os.PathLike; got int"):
            fn(model, 3)
    assert not os.listdir(tmp_path)  # nothing was written


# --------------------------------------------------------------------------- unsafe places


def test_a_world_writable_directory_is_refused_and_the_switch_warns(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(CheckpointError, match=r"'.*shared' \(mode 0777\) is writable by everyone without the sticky bit") as err:
        save_state_dict(_model(), shared / "model.pt")
    assert "chmod go-w" in err.value.fix and "check_permissions=False" in err.value.fix
    assert err.value.path == str(shared)
    assert not os.listdir(shared)
    with pytest.warns(UserWarning, match="writable by everyone"):
        save_state_dict(_model(), shared / "model.pt", check_permissions=False)
    with pytest.raises(CheckpointError, match="writable by everyone"):
        save_checkpoint(str(shared / "ck"), step=1, model=_model())
    # One level up counts too: whoever can rename "shared/mine" can put their own in its place.
    mine = shared / "mine"
    mine.mkdir(mode=0o700)
    with pytest.raises(CheckpointError, match=r"shared' \(mode 0777\)"):
        save_state_dict(_model(), mine / "model.pt")


def test_group_writable_refused_sticky_accepted(tmp_path) -> None:
    d = tmp_path / "group"
    d.mkdir()
    d.chmod(0o770)
    with pytest.raises(CheckpointError, match="writable by its group"):
        save_state_dict(_model(), d / "m.pt")
    d.chmod(0o1777)  # like /tmp: others cannot rename or remove our files
    save_state_dict(_model(), d / "m.pt")
    load_state_dict(_model(), d / "m.pt")


@needs_root
def test_a_directory_of_another_user_is_refused(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(CheckpointError, match=r"directory '.*theirs' is owned by (nobody|uid 65534), not by you"):
        save_state_dict(_model(), theirs / "model.pt")
    with pytest.raises(CheckpointError, match="owned by"):
        load_checkpoint(str(theirs), model=_model())


@needs_root
def test_a_file_another_user_replaced_is_not_loaded(tmp_path) -> None:
    """The issue's case: another user replaced model.pt; the next load must not take their weights."""
    path = tmp_path / "model.pt"
    save_state_dict(_model(1), path)
    save_state_dict(_model(2), tmp_path / "evil.pt")
    os.chown(tmp_path / "evil.pt", NOBODY, NOBODY)
    os.replace(tmp_path / "evil.pt", path)
    victim = _model(3)
    before = victim.weight.clone()
    with pytest.raises(CheckpointError, match=r"file '.*model.pt' is owned by (nobody|uid 65534)") as err:
        load_state_dict(victim, path)
    assert "load only files you wrote yourself" in err.value.fix
    assert torch.equal(victim.weight, before)
    with pytest.warns(UserWarning, match="owned by"):
        load_state_dict(victim, path, check_permissions=False)


def test_a_file_others_may_write_is_refused(tmp_path) -> None:
    path = tmp_path / "model.pt"
    save_state_dict(_model(), path)
    path.chmod(0o666)
    with pytest.raises(CheckpointError, match=r"file .* \(mode 0666\) is writable by everyone"):
        load_state_dict(_model(), path)


# --------------------------------------------------------------------------- full disks


def _enospc(code: int = errno.ENOSPC):
    real = ckpt._Counting.write

    def write(self, data):
        if self.written + len(memoryview(data).cast("B")) > 600:
            self.error = OSError(code, os.strerror(code))
            raise self.error
        return real(self, data)

    return write


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left saving"),
                                         (errno.EDQUOT, r"no space left \(disk quota exceeded\) saving")])
def test_a_full_disk_says_so_and_keeps_the_old_checkpoint(tmp_path, monkeypatch, code, words) -> None:
    path = tmp_path / "model.pt"
    save_state_dict(_model(1), path)
    before = path.read_bytes()
    monkeypatch.setattr(ckpt._Counting, "write", _enospc(code))
    big = nn.Linear(64, 64)
    with pytest.raises(CheckpointError, match=rf"{words} '.*model.pt': the checkpoint needs about 16.2 KiB") as err:
        save_state_dict(big, path)
    assert "free space under" in err.value.fix and err.value.path == str(path)
    assert path.read_bytes() == before and _temps(tmp_path) == []
    with pytest.raises(CheckpointError, match="no space left"):
        save_checkpoint(str(tmp_path / "ck"), step=1, model=big)


def test_too_little_room_is_said_before_writing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(paths, "free_bytes", lambda d: 1000)
    with pytest.raises(CheckpointError, match=r"needs about 16.2 KiB; 1000 B free on that file system"):
        save_state_dict(nn.Linear(64, 64), tmp_path / "m.pt")
    assert not os.listdir(tmp_path)


_ON_TMPFS = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import cpuddp
    from cpuddp.errors import CheckpointError
    path = sys.argv[1] + "/model.pt"
    cpuddp.save_state_dict(nn.Linear(8, 8), path)
    try:
        cpuddp.save_state_dict(nn.Linear(256, 512), path)   # 513 KiB: more than the tmpfs holds
    except CheckpointError as exc:
        print("ERROR", exc)
    torch.load(path, weights_only=True)
    print("OLD OK")
""")


@pytest.mark.timeout(120)
def test_a_real_full_tmpfs(tmp_path) -> None:
    """A 256 KiB tmpfs in a mount namespace of its own (skipped where the kernel refuses one)."""
    mnt = tmp_path / "small"
    mnt.mkdir(mode=0o700)
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here")
    root = [] if os.geteuid() == 0 else ["-r"]
    cmd = [unshare, *root, "-m", "sh", "-c", f'mount -t tmpfs -o size=256k,mode=0700 tmpfs "$0" && exec "$1" -c "$2" "$0"',
           str(mnt), sys.executable, _ON_TMPFS]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    if res.returncode != 0 and ("mount" in res.stderr or "unshare" in res.stderr) and "ERROR" not in res.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()[:200]}")
    assert "ERROR no space left saving" in res.stdout and "model.pt" in res.stdout, res.stdout + res.stderr
    assert "the checkpoint needs about 514" in res.stdout and "OLD OK" in res.stdout, res.stdout + res.stderr


# --------------------------------------------------------------------------- killed directory saves


def test_a_killed_directory_save_is_removed_by_the_next(tmp_path) -> None:
    live = make_temp_dir(str(tmp_path), "step-000000001")
    assert remove_dead_dirs(str(tmp_path)) == []  # its lock is held: a save in flight
    live.close(remove=False)  # as if its process had died
    assert remove_dead_dirs(str(tmp_path)) == [os.path.basename(live.path)]
    assert os.listdir(tmp_path) == []
