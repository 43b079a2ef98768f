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
from cpuddp.train.checkpoint import atomic as ckpt
from cpuddp.train.checkpoint import paths
from cpuddp.train.checkpoint.ckpt_dirs import finish, make_temp_dir, remove_dead_dirs
from cpuddp.train.loop import load_state_dict, save_state_dict
from cpuddp.train.checkpoint.load import list_checkpoints, load_checkpoint
from cpuddp.train.checkpoint.save import save_checkpoint

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


# --------------------------------------------------------------------------- shared directories (round 5)


def _planted(path, step: int, owner: int = NOBODY) -> str:
    """A file with a checkpoint's name that another user (``owner``) put in a shared directory."""
    p = os.path.join(path, f"step-{step:09d}.pt")
    torch.save({"format": "cpuddp-checkpoint/1", "step": step, "model": {}}, p)
    os.chown(p, owner, owner)
    return p


@needs_root
def test_files_a_stranger_plants_in_a_sticky_directory_are_never_counted_nor_removed(tmp_path, caplog) -> None:
    """Another local user fills /tmp-like ``shared`` with checkpoint names: our keep=3 must not
    count them, so our own checkpoints stay, and theirs are neither removed nor resumed."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    theirs = [_planted(shared, s) for s in (999999997, 999999998, 999999999, 1)]
    model = _model()
    p100 = save_checkpoint(str(shared), step=100, model=model)
    p200 = save_checkpoint(str(shared), step=200, model=model)
    assert os.path.exists(p100) and os.path.exists(p200)
    assert all(os.path.exists(p) for p in theirs)
    assert list_checkpoints(str(shared)) == [p100, p200]
    assert load_checkpoint(str(shared), model=model).step == 200
    assert "owned by uid 65534, not by you" in caplog.text and "step-999999999.pt" in caplog.text
    for step in (300, 400, 500):  # keep=3 along our own
        save_checkpoint(str(shared), step=step, model=model)
    assert [os.path.basename(p) for p in list_checkpoints(str(shared))] == [
        "step-000000300.pt", "step-000000400.pt", "step-000000500.pt"]
    assert all(os.path.exists(p) for p in theirs)


@needs_root
def test_a_record_or_lock_another_user_planted_is_refused(tmp_path) -> None:
    for planted in (".cpuddp-checkpoints.json", ".cpuddp-lock"):
        shared = tmp_path / planted
        shared.mkdir()
        shared.chmod(0o1777)
        (shared / planted).write_text('{"format": "cpuddp-checkpoints/1", "checkpoints": ["step-000000001.pt"]}')
        os.chown(shared / planted, NOBODY, NOBODY)
        theirs = _planted(shared, 1)
        with pytest.raises(CheckpointError, match=r"owned by (nobody|uid 65534)|not a file of yours"):
            save_checkpoint(str(shared), step=5, model=_model())
        assert os.path.exists(theirs)


def test_loading_never_follows_a_symlink(tmp_path, caplog) -> None:
    """``ln -s step-100.pt step-999999999.pt`` must not make the directory resume step 100."""
    d = tmp_path / "ck"
    model = _model()
    p100 = save_checkpoint(str(d), step=100, model=model)
    save_checkpoint(str(d), step=200, model=model)
    os.symlink(p100, d / "step-999999999.pt")
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / ".metadata").write_bytes(b"x")
    os.symlink(real, d / "step-999999998")  # a directory checkpoint, through a link
    assert load_checkpoint(str(d), model=model).step == 200
    assert "step-999999999.pt skipped: a symbolic link" in caplog.text
    assert "step-999999998 skipped: a symbolic link" in caplog.text
    for link in ("step-999999999.pt", "step-999999998"):
        with pytest.raises(CheckpointError, match="is a symbolic link: a checkpoint is never loaded through one"):
            load_checkpoint(str(d / link), model=model)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        load_state_dict(model, d / "step-999999999.pt")
    os.unlink(d / ".cpuddp-checkpoints.json")  # a directory written before the record: the same
    assert load_checkpoint(str(d), model=model).step == 200
    save_checkpoint(str(d), step=300, model=model, keep=1)
    assert os.path.islink(d / "step-999999999.pt") and os.path.exists(p100) is False


@needs_root
def test_the_newest_is_chosen_among_our_own_files(tmp_path) -> None:
    d = tmp_path / "ck"
    model = _model()
    save_checkpoint(str(d), step=100, model=model)
    d.chmod(0o1777)
    _planted(d, 999999999)
    assert load_checkpoint(str(d), model=model).step == 100
    os.unlink(d / ".cpuddp-checkpoints.json")  # without the record: ownership still decides
    assert load_checkpoint(str(d), model=model).step == 100


def test_check_permissions_false_still_saves_keeps_and_loads(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(UserWarning, match="writable by everyone"):
        for step in (1, 2, 3):
            save_checkpoint(str(shared), step=step, model=_model(), keep=2, check_permissions=False)
        assert load_checkpoint(str(shared), model=_model(), check_permissions=False).step == 3
        kept = list_checkpoints(str(shared), check_permissions=False)
    assert [os.path.basename(p) for p in kept] == ["step-000000002.pt", "step-000000003.pt"]


def test_a_directory_checkpoint_never_replaces_a_symlink(tmp_path) -> None:
    """A link with the name of the directory checkpoint being saved: moving it aside and removing
    it would reach where it points (as root, another user's files)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".metadata").write_bytes(b"theirs")
    d = tmp_path / "ck"
    d.mkdir(mode=0o700)
    os.symlink(elsewhere, d / "step-000000001")
    temp = make_temp_dir(str(d), "step-000000001")
    with pytest.raises(CheckpointError, match="is a symbolic link: cpuddp does not replace it"):
        finish(temp, str(d / "step-000000001"))
    temp.close(remove=True)
    assert (elsewhere / ".metadata").read_bytes() == b"theirs" and os.path.islink(d / "step-000000001")


@pytest.mark.timeout(60)
def test_a_fifo_with_a_checkpoints_name_is_refused_not_waited_on(tmp_path) -> None:
    """Opening a planted FIFO for reading would block until someone writes to it."""
    os.mkfifo(tmp_path / "model.pt", 0o600)
    with pytest.raises(CheckpointError, match=r"'.*model.pt' is not a regular file \(mode p"):
        load_state_dict(_model(), tmp_path / "model.pt")
    d = tmp_path / "ck"
    save_checkpoint(str(d), step=1, model=_model())
    os.unlink(d / ".cpuddp-checkpoints.json")
    os.mkfifo(d / ".cpuddp-checkpoints.json", 0o600)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        save_checkpoint(str(d), step=2, model=_model())
