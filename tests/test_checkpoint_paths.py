"""Checkpoint paths checked whole (the security review's findings 3 and 4).

Another local user shares a project directory with the victim: mode 3770 (setgid, sticky,
group-writable), owned by root with the other user's group -- both users can create files in it,
neither can remove the other's.  The other user (``cpuddp-intruder``, made as
tests/test_shm_faults.py makes it) plants, as itself, with ``ln``:

- ``BASE/runB -> BASE/runA``, runA an older run of the victim's: run B's resume took run A's
  step 300 and its ``keep=2`` deleted all three of run A's checkpoints;
- a link for the checkpoint directory itself, which redirected ``save_checkpoint`` the same way;
- a second name (a hard link) for a link of the victim's own in the shared directory;
- ``.cpuddp-lock`` as a hard link to the victim's ``results.txt`` (truncated and overwritten with
  the lock's JSON), or as a symbolic link (a bare ``PermissionError`` in a world-writable sticky
  directory such as ``/tmp``, where the kernel answers EACCES, not ELOOP).

Each is now a ``CheckpointError`` naming the path, and the victim's files are untouched; the
victim's own links in directories only it can write keep working.  The victim is this test
process (root, as in the suite's other attack tests); no sysctl is changed.  Where
``fs.protected_hardlinks=1`` (the default) the kernel stops the other user from linking a file it
cannot write, so the hard link is made as the victim: the same name for the same file, as the
other user makes it where the sysctl is 0.
"""

from __future__ import annotations

import os
import pwd
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from cpuddp.errors import CheckpointError
from cpuddp.train.checkpoint.load import list_checkpoints, load_checkpoint
from cpuddp.train.checkpoint.save import save_checkpoint
from cpuddp.train.loop import load_state_dict, save_state_dict

LINK_REFUSED = (r"is a symbolic link \(owned by cpuddp-intruder, to .*which its group can write: sticky, but the "
                r"link is not yours")
LOCK = r"\.cpuddp-lock', the checkpoint directory's lock,"


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 4)


@pytest.fixture
def intruder() -> tuple[int, int]:
    """The second local user: (uid, gid)."""
    from test_shm_faults import _intruder_uid

    uid = _intruder_uid()
    return uid, pwd.getpwuid(uid).pw_gid


@pytest.fixture
def base(intruder):
    """A project directory both users share: mode 3770, group the other user's."""
    path = Path(tempfile.mkdtemp(prefix="cpuddp-project-", dir="/tmp"))
    os.chown(path, 0, intruder[1])
    os.chmod(path, 0o3770)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_intruder(intruder: tuple[int, int], *cmd: str) -> None:
    """Run ``cmd`` as the other user (its own group only), to its end."""
    uid, gid = intruder
    done = subprocess.run(list(cmd), user=uid, group=gid, extra_groups=[], env={"PATH": "/usr/bin:/bin"}, cwd="/",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{cmd} as uid {uid}: {done.stderr}"


def _hard_link(intruder: tuple[int, int], src: Path, dst: Path) -> None:
    """``dst`` made a second name of ``src`` (of a symbolic link itself, not where it points) --
    by the other user where the kernel lets it (``fs.protected_hardlinks=0``), else by the victim
    (the module doc)."""
    with open("/proc/sys/fs/protected_hardlinks") as f:
        protected = f.read().strip() != "0"
    if protected:
        os.link(src, dst, follow_symlinks=False)
    else:
        _as_intruder(intruder, "ln", "-P", str(src), str(dst))


def _shared_dir(base: Path, name: str, mode: int, gid: int) -> Path:
    d = base / name
    d.mkdir()
    os.chown(d, 0, gid)
    os.chmod(d, mode)
    return d


def _run_a(base: Path) -> tuple[Path, dict[str, bytes]]:
    """The victim's older run: runA/ckpt with steps 100, 200, 300; (its directory, its files' bytes)."""
    ckpt = base / "runA" / "ckpt"
    ckpt.parent.mkdir(mode=0o700)
    for step in (100, 200, 300):
        save_checkpoint(str(ckpt), step=step, model=_model(step), keep=None)
    return ckpt, {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt) if n.startswith("step-")}


def _untouched(ckpt: Path, before: dict[str, bytes]) -> None:
    now = {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt) if n.startswith("step-")}
    assert now == before, sorted(now)
    assert load_checkpoint(str(ckpt), model=_model()).step == 300


# --------------------------------------------------------------------------- finding 3: links


def test_a_symlinked_parent_planted_by_another_user_is_refused(base, intruder) -> None:
    """The finding: ``BASE/runB -> BASE/runA``; run B must neither resume run A's step 300 nor
    prune run A's checkpoints with its ``keep=2``."""
    ckpt, before = _run_a(base)
    _as_intruder(intruder, "ln", "-s", str(base / "runA"), str(base / "runB"))
    run_b = str(base / "runB" / "ckpt")
    with pytest.raises(CheckpointError, match=LINK_REFUSED) as err:
        load_checkpoint(run_b, model=_model())
    assert err.value.path == str(base / "runB") and "remove the link named" in err.value.fix
    assert "whoever made the link chooses which checkpoints are resumed" in str(err.value)
    for step in (301, 302, 303):
        with pytest.raises(CheckpointError, match=LINK_REFUSED):
            save_checkpoint(run_b, step=step, model=_model(), keep=2)
    with pytest.raises(CheckpointError, match=LINK_REFUSED):
        list_checkpoints(run_b)
    with pytest.raises(CheckpointError, match=LINK_REFUSED):
        load_state_dict(_model(), os.path.join(run_b, "step-000000300.pt"))
    with pytest.raises(CheckpointError, match=LINK_REFUSED):
        save_state_dict(_model(), os.path.join(run_b, "model.pt"))
    _untouched(ckpt, before)
    assert not (ckpt.parent / "model.pt").exists()


def test_a_symlinked_checkpoint_directory_planted_by_another_user_is_refused(base, intruder) -> None:
    ckpt, before = _run_a(base)
    _as_intruder(intruder, "ln", "-s", str(ckpt), str(base / "ckptB"))
    with pytest.raises(CheckpointError, match=LINK_REFUSED) as err:
        save_checkpoint(str(base / "ckptB"), step=301, model=_model(), keep=2)
    assert err.value.path == str(base / "ckptB")
    with pytest.raises(CheckpointError, match=LINK_REFUSED):
        list_checkpoints(str(base / "ckptB"))
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        load_checkpoint(str(base / "ckptB"), model=_model())
    _untouched(ckpt, before)


def test_check_permissions_false_follows_a_strangers_link_with_a_warning(base, intruder) -> None:
    """As for every other place check: the switch turns the refusal into a warning."""
    _run_a(base)
    _as_intruder(intruder, "ln", "-s", str(base / "runA"), str(base / "runB"))
    with pytest.warns(UserWarning, match="is a symbolic link .*whoever made the link chooses"):
        assert load_checkpoint(str(base / "runB" / "ckpt"), model=_model(), check_permissions=False).step == 300


def test_a_second_name_for_your_own_link_in_a_sticky_directory_is_refused(base, intruder) -> None:
    """Your link in the shared directory is followed (only you can replace it) -- until another
    user gives it a second name, a hard link to the link itself, that leads run B into run A."""
    ckpt, before = _run_a(base)
    (base / "mine").symlink_to(base / "runA")
    assert load_checkpoint(str(base / "mine" / "ckpt"), model=_model()).step == 300
    _hard_link(intruder, base / "mine", base / "runB")
    with pytest.raises(CheckpointError, match=r"runB' is a symbolic link .*the link has 2 names \(hard links\)"):
        load_checkpoint(str(base / "runB" / "ckpt"), model=_model())
    with pytest.raises(CheckpointError, match="the link has 2 names"):
        save_checkpoint(str(base / "runB" / "ckpt"), step=301, model=_model(), keep=2)
    _untouched(ckpt, before)


# --------------------------------------------------------------------------- finding 4: the lock


def _results(base: Path) -> Path:
    results = base / "results.txt"
    results.write_text("the victim's results\n")
    results.chmod(0o600)
    return results


def test_a_hard_linked_lock_is_refused_and_the_file_left_untouched(base, intruder) -> None:
    shared = _shared_dir(base, "shared", 0o3770, intruder[1])
    results = _results(base)
    _hard_link(intruder, results, shared / ".cpuddp-lock")
    with pytest.raises(CheckpointError, match=LOCK + " has 2 hard links") as err:
        save_checkpoint(str(shared), step=1, model=_model())
    assert err.value.path == str(shared / ".cpuddp-lock") and "that name only" in err.value.fix
    with pytest.raises(CheckpointError, match="has 2 hard links"):
        load_checkpoint(str(shared), model=_model())
    assert results.read_text() == "the victim's results\n" and os.stat(results).st_nlink == 2
    assert not [n for n in os.listdir(shared) if n.startswith("step-")]


@pytest.mark.parametrize("mode", [0o3770, 0o1777], ids=["group-shared", "like-tmp"])
def test_a_symlinked_lock_is_a_checkpoint_error(base, intruder, mode) -> None:
    """3770: open(O_NOFOLLOW) fails with ELOOP; 1777 (world-writable sticky, like /tmp): the kernel
    refuses to open another user's link there with EACCES -- a bare PermissionError before."""
    shared = _shared_dir(base, "shared", mode, intruder[1])
    results = _results(base)
    _as_intruder(intruder, "ln", "-s", str(results), str(shared / ".cpuddp-lock"))
    with pytest.raises(CheckpointError, match=LOCK + " is a symbolic link") as err:
        save_checkpoint(str(shared), step=1, model=_model())
    assert err.value.path == str(shared / ".cpuddp-lock")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        load_checkpoint(str(shared), model=_model())
    assert results.read_text() == "the victim's results\n"
    assert not [n for n in os.listdir(shared) if n.startswith("step-")]


# --------------------------------------------------------------------------- hard links to load


def test_a_file_with_a_second_name_is_not_loaded(tmp_path) -> None:
    """A checkpoint file or record with another hard link is refused (check_permissions=False: a warning)."""
    model = _model()
    save_state_dict(model, tmp_path / "m.pt")
    os.link(tmp_path / "m.pt", tmp_path / "other-name.pt")
    with pytest.raises(CheckpointError, match=r"file '.*m.pt' has 2 hard links: another user can give one") as err:
        load_state_dict(model, tmp_path / "m.pt")
    assert "load a copy (cp) instead" in err.value.fix
    with pytest.warns(UserWarning, match="has 2 hard links"):
        load_state_dict(model, tmp_path / "m.pt", check_permissions=False)
    d = tmp_path / "ck"
    save_checkpoint(str(d), step=1, model=model)
    os.link(d / ".cpuddp-checkpoints.json", tmp_path / "record-elsewhere.json")
    with pytest.raises(CheckpointError, match=r"\.cpuddp-checkpoints.json' has 2 hard links"):
        load_checkpoint(str(d), model=model)


# --------------------------------------------------------------------------- what keeps working


def test_your_own_symlinks_in_private_directories_keep_working(tmp_path, monkeypatch) -> None:
    """``$HOME/ckpt -> /scratch/me/ckpt``: the link is yours, in a directory only you can write."""
    home, scratch = tmp_path / "home", tmp_path / "scratch" / "me"
    home.mkdir(mode=0o700)
    (scratch / "ckpt").mkdir(mode=0o700, parents=True)
    (home / "ckpt").symlink_to(scratch / "ckpt")
    model = _model()
    paths = [save_checkpoint(str(home / "ckpt"), step=s, model=model, keep=2) for s in (1, 2, 3)]
    assert sorted(os.listdir(scratch / "ckpt")) == [".cpuddp-checkpoints.json", ".cpuddp-lock",
                                                    "step-000000002.pt", "step-000000003.pt"]
    assert list_checkpoints(str(home / "ckpt")) == paths[1:]
    assert load_checkpoint(paths[-1], model=model).step == 3
    assert load_checkpoint(str(home / "ckpt"), model=model).step == 3  # the directory named by the link itself
    monkeypatch.chdir(home)  # a relative path through the link, in a run below it
    for s in (10, 20, 30):
        save_checkpoint("ckpt/run1", step=s, model=model, keep=2)
    assert load_checkpoint("ckpt/run1", model=model).step == 30
    assert sorted(os.listdir(scratch / "ckpt" / "run1"))[-2:] == ["step-000000020.pt", "step-000000030.pt"]
    save_state_dict(model, "ckpt/model.pt")
    load_state_dict(model, home / "ckpt" / "model.pt")


def test_your_own_symlink_in_a_sticky_directory_works(tmp_path) -> None:
    """In a sticky directory only a link's owner can remove or replace it: your link there is followed."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (sticky / "link").symlink_to(mine)
    model = _model()
    for step in (1, 2):
        save_checkpoint(str(sticky / "link" / "run"), step=step, model=model, keep=1)
    assert load_checkpoint(str(sticky / "link" / "run"), model=model).step == 2
    assert os.listdir(mine / "run").count("step-000000002.pt") == 1


def _acl(entries: list[tuple[int, int, int]]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def test_a_directory_an_acl_lets_another_user_write_is_refused(tmp_path) -> None:
    d = tmp_path / "acl"
    d.mkdir(mode=0o700)
    nobody = 65534  # user::rwx user:nobody:rwx group::--- mask::rwx other::---
    acl = _acl([(0x01, 7, 0xFFFFFFFF), (0x02, 7, nobody), (0x04, 0, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF),
                (0x20, 0, 0xFFFFFFFF)])
    try:
        os.setxattr(d, "system.posix_acl_access", acl)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs here: {exc}")
    with pytest.raises(CheckpointError, match=r"writable by user (nobody|uid 65534) \(an ACL entry\) without") as err:
        save_checkpoint(str(d / "ck"), step=1, model=_model())
    assert "setfacl -b" in err.value.fix
