"""Shared multi-user stores: group-writable directories and lock files.

A store created with ``casstore init --shared`` (``Store(path, shared=True)``)
is used by several accounts of one Unix group.  What has to hold, whatever the
creating process's umask:

* every directory is setgid and group-writable (``rwxrwsr-x``, 0o2775): files
  and directories created in it inherit the directory's group, and any member
  may create objects and refs, rename over refs, and unlink (GC) in it;
* lock files are group-writable (0o664): ``flock`` needs a descriptor and an
  exclusive lock here is taken on one opened for writing;
* objects, refs and ``store.toml`` stay read-only (0o444) -- they are
  replaced or removed through their directory, never written in place.

The setgid bit on a directory is how later code recognises a shared store
without reading ``store.toml``: a directory casstore creates inside a setgid
directory copies its parent's mode, and a lock file created in one is made
group-writable.  In a private store nothing changes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Dict, List, Optional

from ._layout import BAD, LOCKS, OBJECTS, REFS, SUBDIRS, TMP
from .errors import StoreFormatError

__all__ = ["DIR_MODE", "LOCK_MODE", "share_layout", "makedirs", "share_new_file", "is_shared_dir", "STATE"]

DIR_MODE = 0o2775
LOCK_MODE = 0o664
STATE = "state"
"""``<root>/state``: maintenance bookkeeping (verify's incremental record)."""

_shared_cache: Dict[str, bool] = {}


def is_shared_dir(path: Path | str) -> bool:
    """Whether ``path`` is a directory of a shared store (setgid bit set); cached per path."""
    key = os.fspath(path)
    hit = _shared_cache.get(key)
    if hit is None:
        try:
            hit = bool(os.stat(key).st_mode & stat.S_ISGID)
        except OSError:
            return False
        _shared_cache[key] = hit
    return hit


def _chmod_dir(path: Path, gid: int) -> None:
    os.chmod(path, DIR_MODE)
    st = os.stat(path)
    if st.st_gid != gid:
        try:
            os.chown(path, -1, gid)
        except PermissionError:
            pass  # not a member of that group: keep ours (the setgid bit still propagates ours)


def share_layout(root: Path) -> None:
    """Make a freshly created store layout group-shared (before ``store.toml`` appears).

    The store's group is the root directory's group: create the directory and
    ``chgrp`` it to the team's group before ``casstore init --shared``.  All 256
    fan-out directories are created now, so no later put has to create one.
    """
    gid = os.stat(root).st_gid
    _chmod_dir(root, gid)
    dirs: List[Path] = [root / REFS]
    dirs += [root / sub for sub in SUBDIRS]
    dirs += [root / LOCKS / "names", root / BAD, root / STATE]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        _chmod_dir(d, gid)
    objdir = root / OBJECTS
    for i in range(256):
        fan = objdir / f"{i:02x}"
        fan.mkdir(exist_ok=True)
        _chmod_dir(fan, gid)
    for name in ("gc.lock", "gc.gate"):
        # Never through a link or into a FIFO planted before init (the root may have been group-writable
        # already): the same hazard as FileLock's (_lock.py), refused the same way.
        p = root / LOCKS / name
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, LOCK_MODE)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            fd = -1
        try:
            if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreFormatError(f"lock file {p} is not a regular file (a link, directory or FIFO planted "
                                       f"there): remove it (`rm {p}`, or `rmdir` for a directory) and run "
                                       "`casstore init --shared` again")
            os.fchmod(fd, LOCK_MODE)
        finally:
            if fd >= 0:
                os.close(fd)
    os.chmod(root / TMP, DIR_MODE)


def makedirs(path: Path) -> None:
    """``path.mkdir(parents=True, exist_ok=True)``; new directories copy a setgid parent's mode.

    Kept for callers that do not need durability; see :func:`casstore._fs.makedirs`.
    """
    from ._fs import makedirs as _mk

    _mk(path)


def share_new_file(fd: int, directory: Path | str, mode: int = LOCK_MODE, *,
                   st: Optional[os.stat_result] = None) -> None:
    """Give a file we own in a shared (setgid) directory group read/write, whatever the umask.

    Cheap when nothing is to be done: one ``fstat`` (none if the caller passes ``st``, the
    ``fstat`` of ``fd`` it just made; plus one cached ``stat`` of the directory the first time).
    Only a regular file with no other name is changed.
    """
    if st is None:
        st = os.fstat(fd)
    if st.st_mode & 0o060 == 0o060 or st.st_uid != os.geteuid():
        return
    # Hazard (found by a bug hunt): a link planted at a lock file's name got the victim's own file
    # (~/.ssh/authorized_keys) chmod-ed to 0664 here.  Callers open with O_NOFOLLOW now; a hard link
    # (another name of the same file, possibly outside the store) or anything but a regular file is
    # never chmod-ed either.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        return
    if is_shared_dir(directory):
        try:
            os.fchmod(fd, mode)
        except OSError:  # pragma: no cover - not the owner after all
            pass
