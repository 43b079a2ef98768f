"""Where a checkpoint may be written and read: a place only this user controls, and a full disk named.

A checkpoint is code and data the next run loads, so a place another user can change is refused:

- :func:`check_directory` walks the path whole, one component at a time from ``/`` (a relative
  path from the working directory), with ``lstat``, never letting the kernel follow a link:

  * every directory on the way must be owned by this user or by root, and writable by nobody
    else -- no group or other write bit, no POSIX ACL entry (``system.posix_acl_access``)
    granting another user or a group write -- unless it has the sticky bit (``/tmp``), which
    stops others from renaming or removing what they do not own.  Otherwise another user could
    replace the checkpoint (a group- or world-writable directory) or the whole directory under
    it (the same, one level up), and the next run would load their weights;
  * a symbolic link on the way is followed only where nobody else can have made or changed it:
    in a directory only this user (or root) can write, or in a sticky directory when the link
    is this user's (or root's) and has one name -- there only its owner can remove or replace
    it, but anyone can give it a second name (a hard link to the link) where
    ``fs.protected_hardlinks=0``.  Any other link -- one in a directory another user can write
    without the sticky bit, or another user's link in a sticky one (``BASE/runB -> BASE/runA``
    planted in a shared project directory) -- is refused: whoever made it would choose which
    checkpoints are resumed, written over and pruned.  So ``$HOME/ckpt -> /scratch/me/ckpt``
    works, a stranger's link does not.  ``check_permissions=False`` follows it with a warning.

  It returns the directory's real path (every link resolved); the callers work through that
  path, so the place checked is the place written, read and pruned.
- :func:`open_own_file`: a file to load must be a regular file with one name (a second one --
  a hard link -- may have been planted to make a file of yours load in another's place), owned
  by this user (or root) and writable by nobody else, and is opened, in the checked directory,
  without following a symbolic link (``O_NOFOLLOW``: whoever can make a link would choose what
  is loaded); the check is made on the opened descriptor, so the file read is the file checked.

Both raise :class:`~cpuddp.errors.CheckpointError` naming the path, what is wrong and the fix;
with ``check_permissions=False`` they warn instead.  :func:`private_directory` is the check,
then the missing directories made ``0700``, then the check again; :func:`checked_entry` gives the
real path of what a path names, its directory checked, its last component never followed.

:func:`space_error` turns ``ENOSPC``/``EDQUOT`` into a :class:`CheckpointError` that says "no
space left", with the path and how much the checkpoint needs; :func:`check_free_space` says
it before a byte is written when the file system reports too little room.  Nothing here
imports torch.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from cpuddp._units import format_size
from cpuddp.errors import CheckpointError, warn

__all__ = ["check_directory", "private_directory", "checked_entry", "open_own_file", "make_private_dirs",
           "space_error", "check_free_space", "is_space_error", "state_nbytes", "SPACE_ERRNOS"]

#: The errors that mean "the file system is full" (a quota counts).
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: The most symbolic links one path may go through (the kernel's own bound: ELOOP).
_MAX_LINKS = 40
#: A POSIX ACL as Linux stores it: a version word, then (tag, permissions, id) entries.
_ACL_XATTR = "system.posix_acl_access"
_ACL_USER, _ACL_GROUP, _ACL_MASK, _ACL_WRITE = 0x02, 0x08, 0x10, 0x2
_DIRECTORY_FIX = ("save under a directory you own that only you can write (chmod go-w on the one named -- and "
                  "setfacl -b where an ACL lets others write -- or chmod +t to set its sticky bit)")


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def _ancestors(path: str) -> Iterator[str]:
    """``path`` and each directory above it, up to ``/``."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


# --------------------------------------------------------------------------- who can write


def _acl_entries(path: str) -> list[tuple[int, int, int]]:
    """``path``'s POSIX ACL entries (tag, permissions, id); none where it has no ACL."""
    try:
        raw = os.getxattr(path, _ACL_XATTR, follow_symlinks=False)
    except (OSError, AttributeError):  # ENODATA: no ACL; ENOTSUP: no ACLs on this file system; not Linux
        return []
    if len(raw) < 4 or (len(raw) - 4) % 8:
        return []
    return list(struct.iter_unpack("<HHI", raw[4:]))


def _acl_writer(path: str, uid: int) -> Optional[str]:
    """Another user or a group that ``path``'s ACL lets write (its mask permitting); None when none."""
    entries = _acl_entries(path)
    if not all(perm & _ACL_WRITE for tag, perm, _ in entries if tag == _ACL_MASK):
        return None
    for tag, perm, ident in entries:
        if perm & _ACL_WRITE and tag == _ACL_USER and ident not in (uid, 0):
            return f"user {_owner(ident)} (an ACL entry)"
        if perm & _ACL_WRITE and tag == _ACL_GROUP:
            return f"group {_group(ident)} (an ACL entry)"
    return None


def _others_write(path: str, st: os.stat_result, uid: int) -> Optional[str]:
    """Who besides its owner (and root) can write ``path``; None when nobody.  A directory's ACL
    counts as well as its mode."""
    acl = _acl_writer(path, uid) if stat.S_ISDIR(st.st_mode) else None
    if acl is not None:
        return acl
    if st.st_mode & stat.S_IWOTH:
        return "everyone"
    return "its group" if st.st_mode & stat.S_IWGRP else None


def _problem(path: str, st: os.stat_result, uid: int, what: str) -> Optional[str]:
    """Why ``path`` lets another user change it (None when it does not)."""
    if st.st_uid not in (uid, 0):
        return f"{what} {path!r} is owned by {_owner(st.st_uid)}, not by you ({_owner(uid)})"
    who = _others_write(path, st, uid)
    if who and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        sticky = " without the sticky bit" if stat.S_ISDIR(st.st_mode) else ""
        return f"{what} {path!r} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by {who}{sticky}"
    return None


def _link_problem(parent: str, link: str, st: os.stat_result, uid: int) -> Optional[str]:
    """Why the symbolic link ``link``, in directory ``parent``, may be another user's choice (None:
    only this user or root can have made it, and nobody else can replace it)."""
    pst = os.lstat(parent)
    who = _others_write(parent, pst, uid)
    sticky = bool(pst.st_mode & stat.S_ISVTX)
    if who is None or (sticky and st.st_uid in (uid, 0) and st.st_nlink == 1):
        return None  # in a sticky directory only a link's owner (or root) can remove or replace it
    if not sticky:
        why = "without the sticky bit, so whoever can write there can replace the link"
    elif st.st_uid in (uid, 0):  # a hard link to a link of yours: another user can give it a new name
        why = f"sticky, but the link has {st.st_nlink} names (hard links), one of them made by anyone"
    else:
        why = "sticky, but the link is not yours"
    return (f"{link!r} is a symbolic link (owned by {_owner(st.st_uid)}, to {os.readlink(link)!r}) in {parent!r} "
            f"(mode {stat.S_IMODE(pst.st_mode):04o}), which {who} can write: {why}")


# --------------------------------------------------------------------------- the walk


@dataclass
class _Walk:
    """A path resolved one component at a time: where it leads, and what is wrong on the way."""

    real: str = "/"
    directories: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    followed: int = 0


def _parts(path: str) -> list[str]:
    """``path``'s components, the last first (to ``pop()`` in order); empty ones and ``.`` dropped."""
    return [p for p in reversed(path.split("/")) if p not in ("", ".")]


def _follow(walk: _Walk, link: str, st: os.stat_result, uid: int) -> list[str]:
    """Note what is wrong with ``link`` (in ``walk.real``); the components of its target, to walk next."""
    walk.followed += 1
    if walk.followed > _MAX_LINKS:
        raise CheckpointError(f"{link!r}: more than {_MAX_LINKS} symbolic links on the way (a loop)", path=link,
                              fix="pass the directory itself, not a chain of links")
    why = _link_problem(walk.real, link, st, uid)
    if why:
        walk.links.append(why)
    target = os.readlink(link)
    if target.startswith("/"):
        walk.real = "/"
    return _parts(target)


def _walk(path: str, uid: int) -> _Walk:
    """Resolve ``path`` as the kernel would, ``lstat``-ing each component and checking each
    directory and link on the way (the module doc).  What does not exist yet ends the walk: it is
    made ``0700`` (:func:`make_private_dirs`) or is an error when used."""
    walk = _Walk()
    todo = _parts(os.path.join(os.getcwd(), path))
    st = os.lstat("/")
    while True:
        if stat.S_ISDIR(st.st_mode):
            why = _problem(walk.real, st, uid, "directory")
            if why and why not in walk.directories:
                walk.directories.append(why)
        if not todo:
            return walk
        name = todo.pop()
        if name == "..":  # walk.real is a real directory: its parent is the kernel's ".." too
            walk.real = os.path.dirname(walk.real)
            st = os.lstat(walk.real)
            continue
        here = os.path.join(walk.real, name)
        try:
            st = os.lstat(here)
        except (FileNotFoundError, NotADirectoryError):
            walk.real = os.path.normpath(os.path.join(here, *reversed(todo)))
            return walk
        if stat.S_ISLNK(st.st_mode):
            todo += _follow(walk, here, st, uid)
            st = os.lstat(walk.real)
        else:
            walk.real = here


def _refuse(problems: list[str], path: str, fix: str, check_permissions: bool,
            harm: str = "another user could replace the checkpoint") -> None:
    if not problems:
        return
    msg = "; ".join(problems) + f": {harm}"
    full_fix = f"{fix}; or pass check_permissions=False to accept it (with a warning)"
    if check_permissions:
        raise CheckpointError(msg, path=path, fix=full_fix)
    warn(f"cpuddp: {msg} (check_permissions=False: going on)")


def check_directory(directory: str, *, check_permissions: bool = True) -> str:
    """Refuse (or warn about) a checkpoint directory another user can change, or redirect with a
    symbolic link (the module doc); return its real path, every link resolved: work through that."""
    walk = _walk(directory, os.geteuid())
    _refuse(walk.directories, directory, _DIRECTORY_FIX, check_permissions)
    _refuse(walk.links, directory,
            "remove the link named (or have its owner remove it) and make the directory yourself, or pass a path "
            "without it; a link of your own works in a directory only you can write, or in a sticky one",
            check_permissions,
            harm="whoever made the link chooses which checkpoints are resumed, written over and pruned")
    return walk.real


def make_private_dirs(directory: str) -> bool:
    """Create ``directory`` and any missing parent, each ``0700`` (only this user); True when one
    was made.  ``directory`` is a real path (:func:`check_directory`'s): a symbolic link on it was
    put there since, and is an error, as is any other component that is not a directory."""
    missing = []
    for d in _ancestors(os.path.abspath(directory)):
        try:
            st = os.lstat(d)
        except (FileNotFoundError, NotADirectoryError):
            missing.append(d)
            continue
        if stat.S_ISDIR(st.st_mode):
            break
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise CheckpointError(f"{d!r} is {what}, so the checkpoint directory {directory!r} cannot be made",
                              path=d, fix=f"remove or rename {d!r}, or save somewhere else")
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # made by someone else in the meantime: private_directory checks it again
    return bool(missing)


def private_directory(directory: str, *, check_permissions: bool = True) -> str:
    """:func:`check_directory`, the missing directories made ``0700``, and -- when one was made --
    the check again (another user may have made it first, in a sticky directory); the real path."""
    real = check_directory(directory, check_permissions=check_permissions)
    if make_private_dirs(real):
        real = check_directory(real, check_permissions=check_permissions)
    return real


def _split(path: str) -> tuple[str, str]:
    """``path`` as (its directory, its last component), trailing slashes dropped; a path ending in
    ``.`` or ``..`` is all directory.  Not ``abspath``: its lexical ``..`` is not the kernel's after a link."""
    trimmed = path.rstrip("/") or path[:1]
    head, name = os.path.split(trimmed)
    if name in ("", ".", ".."):
        return trimmed or ".", ""
    return head or ".", name


def checked_entry(path: str, *, check_permissions: bool = True, make: bool = False) -> str:
    """The real path of what ``path`` names: its directory checked whole and resolved
    (:func:`check_directory`; ``make``: :func:`private_directory`), its last component kept as it is
    -- never followed, so that the caller refuses a link there (``lstat``, ``O_NOFOLLOW``) or
    replaces it (a rename)."""
    head, name = _split(path)
    check = private_directory if make else check_directory
    real = check(head, check_permissions=check_permissions)
    return os.path.join(real, name) if name else real


def _open_no_link(real: str, path: str) -> int:
    """``real`` opened for reading without following a link (a link is a CheckpointError naming ``path``)."""
    try:
        return os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CheckpointError(f"{path!r} is a symbolic link: a checkpoint is never read through one (whoever "
                              "can make the link chooses what is loaded)", path=path,
                              fix=f"pass the file itself ({os.path.realpath(path)!r}) after checking it is yours"
                              ) from None


def _refuse_hard_links(path: str, st: os.stat_result, check_permissions: bool) -> None:
    """A file to load with a second name (a hard link) is refused: the name may have been planted."""
    if st.st_nlink <= 1:
        return
    _refuse([f"file {path!r} has {st.st_nlink} hard links"], path,
            f"if the other name is yours (a backup made with ln or cp -l), load a copy (cp) instead; "
            f"otherwise remove {path!r}", check_permissions,
            harm="another user can give one of your files a second name, so that it loads in place of the one meant")


def open_own_file(path: str, *, check_permissions: bool = True) -> Any:
    """Open ``path`` for reading (a binary file object) after checking, on the open descriptor,
    that only this user (or root) can have written it and that it has one name, and that its
    directories and links are safe (it is opened in the checked directory)."""
    real = checked_entry(path, check_permissions=check_permissions)
    fd = _open_no_link(real, path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path!r} is not a regular file (mode {stat.filemode(st.st_mode)})", path=path,
                                  fix="pass a checkpoint file that save_state_dict() or save_checkpoint() wrote")
        os.set_blocking(fd, True)
        problem = _problem(path, st, os.geteuid(), "file")
        _refuse([problem] if problem else [], path,
                "load only files you wrote yourself (chown them, or copy them into a directory of your own)",
                check_permissions)
        _refuse_hard_links(path, st, check_permissions)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# --------------------------------------------------------------------------- space


def state_nbytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples walked; shared storage counted once)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "untyped_storage") and hasattr(x, "element_size"):
            try:
                storage = x.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, TypeError, NotImplementedError):  # a tensor without storage
                key, size = id(x), x.numel() * x.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


def free_bytes(directory: str) -> Optional[int]:
    """Bytes this user may still write on ``directory``'s file system (None when unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def is_space_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


def space_error(path: str, needed: Optional[int], written: int, exc: Optional[BaseException] = None) -> CheckpointError:
    """The "no space left" error for a save of ``path`` (``needed``: the checkpoint's size, when known)."""
    directory = os.path.dirname(os.path.abspath(path))
    free = free_bytes(directory)
    quota = isinstance(exc, OSError) and exc.errno == errno.EDQUOT
    need = f"needs about {format_size(needed)}" if needed else f"needed more than the {format_size(written)} written"
    msg = (f"no space left{' (disk quota exceeded)' if quota else ''} saving {path!r}: the checkpoint {need}"
           + (f", {format_size(written)} were written when the disk filled" if needed and written else "")
           + (f"; {format_size(free)} free on that file system" if free is not None else "")
           + "; the previous checkpoint is untouched")
    return CheckpointError(msg, path=path, fix=f"free space under {directory!r} (or raise the quota), save to "
                                               "another directory, or keep fewer checkpoints (keep=)")


def check_free_space(path: str, needed: Optional[int]) -> None:
    """Raise the "no space left" error at once when the file system reports less room than ``needed``."""
    if not needed:
        return
    free = free_bytes(os.path.dirname(os.path.abspath(path)))
    if free is not None and free < needed:
        raise space_error(path, needed, 0)
