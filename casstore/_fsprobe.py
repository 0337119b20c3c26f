"""What a filesystem really does with locks, hard links and reflinks, probed once per mount.

Issue 17: stores live on NFS, Lustre, GPFS, FUSE and overlay mounts, whose
locks can be missing (``flock`` fails with ENOSYS on Lustre without ``-o
flock``) or lie (some NFS and FUSE setups grant every lock to everyone).  A
lock that lies is worse than a missing one: edits silently serialize nothing.
So before casstore trusts a kind of lock on a mount it checks it, cheaply
(a few syscalls on one probe file, ~0.1 ms on ext4):

* ``flock``: the probe file is opened twice (two open file descriptions, as
  two processes would have); ``LOCK_EX | LOCK_NB`` on the first must succeed
  and on the second must fail.  ENOSYS/EOPNOTSUPP/ENOLCK: missing.
* ``posix``: the same with open-file-description fcntl locks (``F_OFD_SETLK``;
  classic POSIX record locks belong to the process, so one process could not
  test them, and closing any descriptor of the file drops them).
* hard links: ``link()`` the probe file and check both names report
  ``st_nlink == 2`` and one inode (bindfs and some FUSE mounts report 1).
* reflink: ``FICLONE`` of a tiny file.

The result is cached per ``st_dev`` for the life of the process.  A probe
that cannot run (a read-only store, another user's store) answers
``unknown``, and casstore then uses ``flock``, falling back at the first
ENOSYS (``_lock.py``).  What the probe cannot see: locks that are enforced
only between processes of one host (NFS with ``local_lock=all``, Lustre
``-o localflock``) pass it; the ``lock_mode`` setting forces ``lease`` there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

__all__ = ["FsInfo", "probe", "LOCK_UNSUPPORTED", "ofd_lock", "ofd_unlock", "mount_of", "syncfs_trusted",
           "local_timestamps", "fine_local_stamps", "settled", "RACY_SECONDS"]

LOCK_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.ENOTSUP})
"""errnos that mean "this filesystem has no such lock" (never "someone else holds it")."""

_FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
# struct flock on Linux (64-bit off_t): short l_type, l_whence; off_t l_start, l_len; pid_t l_pid (+ pad).
_FLOCK = struct.Struct("@hhqqi")
_cache: Dict[int, FsInfo] = {}
_guard = threading.Lock()


@dataclass(frozen=True, slots=True)
class FsInfo:
    """What :func:`probe` found about the filesystem holding a directory."""

    path: str
    """The directory that was probed."""
    device: int
    """Its ``st_dev`` (the cache key)."""
    fstype: str
    """Filesystem type from ``/proc/self/mountinfo`` (``ext4``, ``nfs4``, ``fuse.sshfs``...), or ``?``."""
    mount: str
    """Mount point, or ``?``."""
    flock: str
    """``enforced``, ``not enforced`` (granted to everyone), ``missing`` or ``unknown``."""
    posix: str
    """Open-file-description fcntl locks: same values as :attr:`flock`."""
    hardlinks: str
    """``ok``, ``wrong link count`` (st_nlink does not count links), ``missing`` or ``unknown``."""
    reflink: str
    """``yes``, ``no`` or ``unknown``."""

    @property
    def lock_mode(self) -> str:
        """The lock kind ``auto`` chooses here: ``flock``, ``posix`` or ``lease``."""
        if self.flock in ("enforced", "unknown"):
            return "flock"
        if self.posix == "enforced":
            return "posix"
        return "lease"

    def reason(self) -> str:
        """Why :attr:`lock_mode` was chosen, in one sentence."""
        mode = self.lock_mode
        if mode == "flock":
            return ("flock locks are enforced" if self.flock == "enforced"
                    else "the probe could not run (read-only?); flock, falling back to leases on ENOSYS")
        if mode == "posix":
            return f"flock is {self.flock} but fcntl (OFD) locks are enforced"
        return (f"flock is {self.flock} and fcntl locks are {self.posix}: casstore coordinates through "
                "exclusive-create lease files")

    @property
    def syncfs_trusted(self) -> bool:
        """Does one ``syncfs(2)`` make a batch durable here?  See :func:`syncfs_trusted`."""
        return syncfs_trusted(self.fstype)


# syncfs(2) flushes the superblock of the local kernel.  A FUSE daemon is never told (issue 17: 0 fsyncs
# reached casfs for 50 objects put with put_many), and network filesystems need per-file COMMITs or
# flushes to reach the server, so there a batch fsyncs each file and its directory instead.
_UNTRUSTED_SYNCFS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs",
                     "9p", "virtiofs", "afs", "beegfs", "orangefs", "ocfs2", "gfs2")


def syncfs_trusted(fstype: str) -> bool:
    """Rule: ``syncfs`` is trusted except on FUSE (``fuse``, ``fuse.*``, ``fuseblk``) and network/cluster filesystems.

    An unknown type (``?``) is trusted: that is a local kernel filesystem
    whose mountinfo line we could not read, and per-file fsyncs would cost
    every batch on the common case.
    """
    return not (fstype.startswith("fuse") or fstype in _UNTRUSTED_SYNCFS)


def local_timestamps(fstype: str) -> bool:
    """Rule: does this kernel's clock stamp the files of this filesystem type?  Not on FUSE (the
    daemon sets them) nor on network and cluster filesystems (the server's clock): the same types
    :func:`syncfs_trusted` leaves out.  An unknown type (``?``) is a local kernel filesystem."""
    return syncfs_trusted(fstype)


_FSTYPES: Dict[int, str] = {}  # st_dev -> filesystem type, for fine_local_stamps (mounts rarely change)


def fine_local_stamps(st_dev: int, ctime_ns: int) -> bool:
    """Does this kernel's clock stamp this file (on device ``st_dev``, ctime ``ctime_ns``) in sub-second
    timestamps?  Then a file stamped below a floor read before its stat (``_fs.stamp_floor_ns``) cannot
    change again without a new stamp.  Not on FUSE and network filesystems (:func:`local_timestamps`),
    nor where the ctime is whole seconds (ext3, FAT, ext4 with 128-byte inodes): there another clock, or
    a second-long stamp, makes a window of seconds the only safe rule (git's "racy clean")."""
    if ctime_ns % 1_000_000_000 == 0:
        return False
    fstype = _FSTYPES.get(st_dev)
    if fstype is None:
        fstype = _FSTYPES[st_dev] = mount_of(st_dev)[0]
    return local_timestamps(fstype)


RACY_SECONDS = 2.0
"""Where a file's stamps come from another clock or are whole seconds, how long after its stamp a
change could still leave its stat unchanged (git's "racy clean" window; :func:`settled`, the folders'
stat cache)."""


def settled(st: os.stat_result, floor: int) -> bool:
    """Would any change made after ``floor`` (a ``_fs.stamp_floor_ns`` read before ``st`` was taken)
    give this file a new ctime?

    Only then may a hash of its bytes stand for the file while its stat holds (the verify memo,
    a verified ``get_array`` that hashes the file beside the copy).  Hazard (CI saw it): put, verify,
    chmod, write and chmod again within one clock tick left (size, mtime_ns, ctime_ns) unchanged,
    and the memo vouched for the rewritten bytes; before Linux 6.13 any file changed within the
    current tick can change again unseen.  Where this kernel does not stamp the file in sub-second
    timestamps (whole seconds; FUSE and network filesystems: :func:`fine_local_stamps`) it is
    settled :data:`RACY_SECONDS` after its stamp, the folders' racy rule.
    """
    c = st.st_ctime_ns
    if fine_local_stamps(st.st_dev, c):
        return c < floor
    return c + int(RACY_SECONDS * 1e9) <= floor


def ofd_lock(fd: int, shared: bool) -> bool:
    """Try an open-file-description fcntl lock on the whole file: True if taken, False if held elsewhere.

    Raises OSError for anything else (ENOSYS and friends: :data:`LOCK_UNSUPPORTED`).
    """
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise
    return True


def ofd_unlock(fd: int) -> None:
    """Release an open-file-description lock taken by :func:`ofd_lock`."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0))


def mount_of(st_dev: int) -> Tuple[str, str]:
    """(fstype, mount point) of the device ``st_dev`` from ``/proc/self/mountinfo`` (``("?", "?")`` if unknown)."""
    want = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 22).splitlines()
    except OSError:
        return "?", "?"
    found = ("?", "?")
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) >= 5 and fields[2] == want and right.split():
            found = (right.split()[0], fields[4])  # the last such line is the mount on top
    return found


def overlay_upper(st_dev: int) -> Optional[Tuple[str, str]]:
    """(mount point, upperdir) if ``st_dev`` is an overlayfs mount with a writable upper layer, else ``None``.

    A file of such a mount that has no counterpart under ``upperdir`` lives
    on a lower (image) layer: any write to it, even ``utime``, copies the
    whole file up (issue 17).
    """
    want = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 22).splitlines()
    except OSError:
        return None
    found: Optional[Tuple[str, str]] = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not (sep and len(fields) >= 5 and fields[2] == want and len(tail) >= 3):
            continue
        found = None
        if tail[0] == "overlay":
            for opt in tail[2].split(","):
                if opt.startswith("upperdir="):
                    # mountinfo escapes space, tab, newline and backslash as octal (\040...)
                    up = opt[len("upperdir="):].encode().decode("unicode_escape")
                    found = (fields[4].encode().decode("unicode_escape"), up)
    return found


def _lock_check(a: int, b: int, take: str) -> str:
    try:
        if take == "flock":
            fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        elif not ofd_lock(a, False):
            return "unknown"  # someone else holds our fresh probe file: cannot judge
    except OSError as e:
        return "missing" if e.errno in LOCK_UNSUPPORTED else "unknown"
    try:
        if take == "flock":
            try:
                fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "enforced"
            return "not enforced"
        return "not enforced" if ofd_lock(b, False) else "enforced"
    except OSError as e:
        return "missing" if e.errno in LOCK_UNSUPPORTED else "unknown"


def _run(d: Path, st_dev: int) -> FsInfo:
    fstype, mount = mount_of(st_dev)
    base = d / f".probe.{os.getpid()}.{os.urandom(6).hex()}"
    flk = posix = links = reflink = "unknown"
    made = []
    try:
        a = os.open(base, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return FsInfo(str(d), st_dev, fstype, mount, flk, posix, links, reflink)
    made.append(base)
    try:
        b = os.open(base, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            flk = _lock_check(a, b, "flock")
            posix = _lock_check(a, b, "posix")
        finally:
            os.close(b)
        try:
            os.write(a, b"casstore filesystem probe\n")
        except OSError:
            # Hazard: a full disk (ENOSPC, EDQUOT) failed the probe, and with it opening the store, so
            # not even a read worked.  The link and clone checks below need no data.
            pass
        link = Path(f"{base}.link")
        try:
            os.link(base, link)
            made.append(link)
            s1, s2 = os.stat(base), os.stat(link)
            links = "ok" if s1.st_nlink == s2.st_nlink == 2 and s1.st_ino == s2.st_ino else "wrong link count"
        except OSError as e:
            links = "missing" if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS) else "unknown"
        clone = Path(f"{base}.clone")
        try:
            c = os.open(clone, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            made.append(clone)
            try:
                fcntl.ioctl(c, _FICLONE, a)
                reflink = "yes"
            except OSError:
                reflink = "no"
            finally:
                os.close(c)
        except OSError:
            pass
    finally:
        os.close(a)  # closing drops the probe's flock and OFD locks
        for p in made:
            try:
                os.unlink(p)
            except OSError:
                pass
    return FsInfo(str(d), st_dev, fstype, mount, flk, posix, links, reflink)


def probe(directory: Path, *, fresh: bool = False) -> FsInfo:
    """What the filesystem holding ``directory`` does (cached per ``st_dev``; ``fresh`` probes again).

    The probe writes (and removes) files named ``.probe.*`` in ``directory``; a
    directory that does not exist or cannot be written gives ``unknown`` answers.
    """
    try:
        st_dev = os.stat(directory).st_dev
    except OSError:
        return FsInfo(str(directory), -1, "?", "?", "unknown", "unknown", "unknown", "unknown")
    with _guard:
        got: Optional[FsInfo] = None if fresh else _cache.get(st_dev)
        if got is None:
            got = _run(directory, st_dev)
            if got.flock != "unknown" or got.posix != "unknown":  # a failed probe is retried next time
                _cache[st_dev] = got
        return got
