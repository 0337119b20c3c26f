"""Checking a manifest out into a directory, safely against whatever is already there.

Hazards (issue 11, "nothing is written outside the target", "never hang, never follow"):

* The target directory may already hold symbolic links, planted by anyone who
  can write there, at a parent of a key or at a key itself.  Following one
  would write outside the target.  So every path is walked from a directory
  fd of the target, openat-style: each parent is opened with
  ``O_NOFOLLOW | O_DIRECTORY`` relative to its own parent's fd, each file is
  created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a temporary name in
  its directory and then renamed onto the key through the same directory fd
  (a rename replaces a link, it never writes through it).  A link, file or
  special file where a directory must be, or a link or special file at a
  key, is refused with :class:`~casstore.errors.InvalidInputError`;
  ``overwrite=True`` replaces it -- the link itself, inside the target,
  never what it points to.  Directories are never deleted (but by ``sync``,
  below: empty ones, and ones holding only what it wrote).
* The store itself is never written into (found by a bug hunt: a manifest's
  keys ``.casstore/refs/pins/x``, ``.casstore/objects/ab/...`` checked out
  into a project holding its store planted a pin and a fake object; a
  checkout into the store replaced ``store.toml``).  A target that is the
  store or lies inside it is refused (:func:`_refuse_store_target`), and the
  walk refuses a key whose path passes through or is the store (device and
  inode of every directory it opens), both before anything is written;
  ``sync`` never removes anything inside it.
* The target must be a folder's path: an empty one (an unset ``$OUT``: it was the current
  directory), one under a dangling link, through a loop of links or with a name too long is
  refused with :class:`~casstore.errors.InvalidInputError` before anything is written
  (:func:`_bad_target`); one that is not UTF-8 is recorded by its bytes (:func:`_root_field`).
* A FIFO or device at a key's place is never opened (``lstat`` first, and
  ``O_NONBLOCK`` on every open): a checkout never hangs.
* Keys were validated by THE decoder (no ``..``, absolute, empty, ``.`` or
  control-character keys ever reach this module); keys that need a path to be
  both a file and a directory are refused before anything is written.
* Everything is checked before the first write (every object present, no
  file, link or special file in the way unless ``overwrite``), so a refused
  checkout writes nothing.  If the tree changes between the check and the
  writes (a concurrent attacker), the walk still never follows a link: the
  checkout fails with a typed error instead.
* A failure midway never leaves a half-written file under a key: content is
  written to a temporary name, verified (re-hashed), and only then renamed.
  Files completed before the failure stay (each whole and verified), and the
  error ends with how many were written and at which key it stopped.
* ``sync`` (issue 12): only files a previous checkout of the same name into the
  same folder recorded (key, digest, how it was made, dev/ino/size/mtime/ctime
  right after the rename) and that are still casstore's (:func:`_ours`) are
  removed or replaced: a copy whose whole stat is unchanged (ctime too: ``utime``
  puts mtime back, as rsync -t, tar and ``touch -r`` do; nothing sets ctime) and,
  while its entry is racy (taken in the timestamp tick of the file's last
  change), whose bytes still hash to the digest; a hard link that is still the
  object's own inode, a symbolic link still to the object's path (a re-put of
  the object moves the inode's times: never a user's edit).  The record under
  ``<store>/cache/checkout`` is hostile input (bad, or another user's -> empty,
  warned); it keeps every file casstore wrote that is still as it left it, also
  after a failure midway and for files sync kept (changed), so a retry or
  ``force`` finds them; removal walks with ``O_NOFOLLOW`` per segment and runs
  only after every new file is in place -- but for a key that switched between
  file and directory (:class:`_KindSwitch`), whose recorded file or directory
  (holding only what casstore wrote) goes just before its replacement is
  written.  ``link``: copy | reflink (clone or
  error) | hardlink (a copy where the object has the most links the filesystem
  allows) | symlink to the verified raw object.  See docs/manifests.md,
  "Checkout: sync and link modes".
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import itertools
import logging
import os
import re
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import msgpack

from .._faults import fault
from .._fs import (
    NO_SPACE,
    copy_exact,
    dead_writer,
    disk_full,
    inside_dir,
    makedirs,
    process_token,
    stamp_floor_ns,
    write_file_atomic,
)
from .._fsprobe import settled
from .._layout import TMP, object_relpath
from .._progress import Progress
from ..codecs import RAW
from ..digest import Digest, hash_bytes, hash_fd
from ..errors import (
    CasstoreError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
    ReadOnlyError,
)
from ..objects import HashRecord
from ..objects.reader import open_object_file
from .model import Entry
from .ops import Manifest, Target, read_manifest, resolve_target

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["LINK_MODES", "RECORD_DIR", "CheckedOut", "checkout"]

log = logging.getLogger(__name__)
"""Checkout's warnings (``casstore.manifests.checkout``); the CLI rewords their hints as flags."""

LINK_MODES = ("copy", "reflink", "hardlink", "symlink")
"""How ``checkout(link=...)`` materializes a file (see docs/manifests.md, "Checkout: sync and link modes")."""
RECORD_DIR = "cache/checkout"
"""Where the record of what each checkout wrote lives under the store root."""
_RECORD_VERSION = 2  # 1: [hex, dev, ino, size, mtime_ns] (no ctime, no kind): still read
_RECORD_MAX_BYTES = 1 << 30  # bigger is garbage, not a record
StatKey = Tuple[int, int, int, int, int]  # (dev, ino, size, mtime_ns, ctime_ns) right after writing
RecEntry = Tuple[Digest, StatKey, int]  # (digest, stat key, _HARDLINK | _SYMLINK | _SETTLED bits)
_HARDLINK = 1  # the object's own inode: casstore's while it is the object's (times move with every re-put)
_SYMLINK = 2  # a symbolic link: casstore's while it points at the object's path
_SETTLED = 4  # a copy whose stat vouches for its bytes: taken after the tick of its last change
_NO_CTIME = -1  # a version-1 entry: no ctime, so only its bytes can vouch for the file

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FICLONE = 0x40049409  # linux/fs.h
LINK_WORKERS = 4
"""Threads that make the hard or symbolic links of one directory (``link="hardlink"|"symlink"``)."""
LINK_SLICE = 64
"""Fewest keys of one directory a link worker takes as one job (a directory of fewer is one job)."""
LINK_SLICE_MAX = 1024
"""Most keys in one link job (results and progress come a job at a time)."""
# linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N links the open inode itself (Linux; no privilege needed).
_PROC_FD = os.path.isdir("/proc/self/fd")
_CHUNK = 1 << 20


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    if stat.S_ISLNK(m):
        return "a symbolic link"
    if stat.S_ISREG(m):
        return "a file"
    if stat.S_ISDIR(m):
        return "a directory"
    if stat.S_ISFIFO(m):
        return "a FIFO"
    if stat.S_ISSOCK(m):
        return "a socket"
    return "a device"


def _describe(dir_fd: int, name: str) -> str:
    """What is at ``name`` (never following it): "a symbolic link (to '...')", "a FIFO"..."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "gone (removed meanwhile)"
    what = _kind(st)
    if stat.S_ISLNK(st.st_mode):
        try:
            what += f" (to {os.readlink(name, dir_fd=dir_fd)!r:.200})"
        except OSError:
            pass
    return what


class _Walker:
    """Directory fds along the current key's parent path, opened from the target's fd without following links.

    Keys come sorted, so the keys under one directory are contiguous and the
    stack of open fds is at most one key deep.  ``create``: make missing
    directories (the write pass); otherwise report them missing (the check pass).
    ``switch`` (sync only): a file an earlier checkout of the name wrote where this version needs a
    directory is replaced without ``overwrite`` (:class:`_KindSwitch`); ``store_id``: the store's
    (device, inode), never entered (:func:`_in_store`).
    """

    def __init__(self, root_fd: int, out: Path, *, overwrite: bool, create: bool,
                 switch: Optional[_KindSwitch] = None, store: Optional[Store] = None,
                 store_id: Optional[Tuple[int, int]] = None) -> None:
        self.root_fd = root_fd
        self.out = out
        self.overwrite = overwrite
        self.create = create
        self.switch = switch
        self.store = store
        self.store_id = store_id
        self.stack: List[Tuple[str, int]] = []
        self.created: List[str] = []  # directories this walk made ("a/b"), for the checkout record
        self.replaced: List[str] = []  # files (or links) this walk removed to make a directory there

    def parent(self, parts: Sequence[str], key: str = "") -> Optional[int]:
        """The fd of directory ``parts`` (key segments without the leaf), or None if it does not exist yet."""
        i = 0
        while i < len(self.stack) and i < len(parts) and self.stack[i][0] == parts[i]:
            i += 1
        while len(self.stack) > i:
            os.close(self.stack.pop()[1])
        fd = self.stack[-1][1] if self.stack else self.root_fd
        for j in range(i, len(parts)):
            child = self._open_dir(fd, parts[j], parts[: j + 1])
            if child is None:
                return None
            if self.store_id is not None and self.store is not None:
                st = os.fstat(child)
                if (st.st_dev, st.st_ino) == self.store_id:
                    os.close(child)
                    raise _in_store(self.store, key, self.out.joinpath(*parts[: j + 1]), checked=not self.create)
            self.stack.append((parts[j], child))
            fd = child
        return fd

    def _open_dir(self, fd: int, seg: str, rel: Sequence[str]) -> Optional[int]:
        try:
            return os.open(seg, _DIR, dir_fd=fd)
        except FileNotFoundError:
            if not self.create:
                return None
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            path = self.out.joinpath(*rel)
            rel_s = "/".join(rel)
            if not self.overwrite:
                why = self._no_switch(fd, seg, rel_s)
                if why is not None:
                    raise InvalidInputError(
                        f"{path} is {_describe(fd, seg)} where the manifest needs a directory{why}; checkout "
                        f"never writes through it. Remove it, or pass overwrite=True to replace it (inside "
                        f"{self.out} only)"
                    ) from None
            if not self.create:
                return None  # replaced in the write pass
            os.unlink(seg, dir_fd=fd)  # the link (or file) itself, never what it points to
            self.replaced.append(rel_s)
        try:
            os.mkdir(seg, 0o777, dir_fd=fd)
            self.created.append("/".join(rel))
        except FileExistsError:
            pass  # made meanwhile: opened below without following links, like any other
        except OSError as e:
            raise _target_error(e, str(self.out.joinpath(*rel)), "create directory") from None
        return os.open(seg, _DIR, dir_fd=fd)

    def _no_switch(self, fd: int, seg: str, rel: str) -> Optional[str]:
        """None if sync may replace the file at ``rel`` by a directory (decided once, by the check pass);
        else what to add to the error (may be "")."""
        if self.switch is None:
            return ""
        if rel in self.switch.files_ok:
            return None
        if self.create:
            return ""  # not there when the check pass looked: appeared meanwhile
        why = self.switch.replaceable(fd, seg, rel)
        if why is None:
            self.switch.files_ok.add(rel)
        return why

    def close(self) -> None:
        while self.stack:
            os.close(self.stack.pop()[1])


def _conflicts(man: Manifest, ents: Dict[str, Entry]) -> None:
    """Refuse keys that need one path to be both a file and a directory ("a" and "a/b")."""
    keys = sorted(ents)
    for key in keys:
        j = bisect.bisect_left(keys, key + "/")
        if j < len(keys) and keys[j].startswith(key + "/"):
            raise InvalidInputError(
                f"manifest {man.digest}: keys {key!r} and {keys[j]!r} conflict ({key!r} would have to be "
                "both a file and a directory); nothing was checked out"
            )


def _same_file(dir_fd: int, leaf: str, digest: Digest, size: int) -> bool:
    """Whether the regular file ``leaf`` holds exactly the bytes of ``digest`` (``size`` long)."""
    try:
        fd = os.open(leaf, _READ, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and st.st_size == size and hash_fd(fd, size) == digest
    finally:
        os.close(fd)


_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def _target_error(err: OSError, dest: str, what: str = "write") -> OSError:
    """``err`` from writing ``dest`` (its temp name, a link, the rename) as the typed error naming ``dest``.

    Hazard: the failing system call names the temp file (``.casstore-PID-....part``), ``/proc/self/fd/N``
    or the object a link points at: none says which key failed, nor where.
    """
    if err.errno in NO_SPACE:  # (the copy's own DiskFullError names only the directory: said again)
        return disk_full(OSError(err.errno, os.strerror(err.errno)), os.path.dirname(dest), f"checking out {dest}")
    if isinstance(err, CasstoreError) or err.errno not in _READ_ONLY:
        return err
    return ReadOnlyError(f"cannot {what} {dest}: {os.strerror(err.errno)} (the folder is read-only for this user, "
                         "or on a read-only mount); make it writable, or check out into another folder")


class _TooManyLinks(Exception):
    """The object file has the most hard links its filesystem allows (EMLINK): the key gets a copy."""


_NOT_SUPPORTED = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF, errno.EPERM)


def _reflink(src: int, dst: int) -> bool:
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return True
    except OSError as e:
        if e.errno in _NOT_SUPPORTED:
            return False
        raise


def _fill(store: Store, e: Entry, fd: int, dest: str, *, strict_reflink: bool) -> None:
    """Write the entry's object into ``fd`` (a new, empty file) and verify what was written."""
    objects = store.objects
    loc = objects.locate(e.digest)
    if strict_reflink and not loc.codec.byte_exact:
        path = str(objects.raw_path(e.digest))  # a clone needs the raw bytes: materialized once, verified
    else:
        path = loc.path
    if strict_reflink or loc.codec.byte_exact:
        src, st = open_object_file(path, e.digest)  # a regular file: never a planted link or FIFO
        try:
            size = st.st_size
            if not _reflink(src, fd):
                if strict_reflink:
                    raise InvalidInputError(
                        f"cannot reflink {dest}: the filesystem does not support cloning from the store at "
                        f"{store.root} (FICLONE refused; btrfs and XFS on one filesystem can). Use link='copy' "
                        "(reflinks where it can, copies otherwise), link='hardlink' or link='symlink'"
                    )
                try:
                    copy_exact(src, fd, size)
                except OSError as err:
                    raise _target_error(err, dest) if err.errno in NO_SPACE else err from None
        finally:
            os.close(src)
        got = hash_fd(fd, size)
        if got != e.digest:
            raise IntegrityError(f"object {e.digest} is corrupt (hashes to {got}); not checked out")
    else:
        try:
            with objects.open(e.digest, verify=True) as fi, open(fd, "wb", closefd=False) as fo:
                shutil.copyfileobj(fi, fo, _CHUNK)  # the reader raises IntegrityError before the last chunk
        except OSError as err:
            raise _target_error(err, dest) if err.errno in NO_SPACE else err from None


def _link_object(store: Store, e: Entry, pfd: int, tmp: str, dest: str, link: str,
                 trust: Optional[HashRecord], *, direct: bool = False) -> Optional[os.stat_result]:
    """Make ``tmp`` (in ``pfd``) a hard or symbolic link to the entry's raw object, verified first.

    ``trust``: skip the hash when casstore hashed this very file (exact stat, ctime included)
    within ``TRUST_SECONDS`` (:class:`~casstore.objects.HashRecord`); ``None``: always hash.
    ``direct`` (hard links to a key nothing occupies): ``tmp`` is the key itself; the link
    fails if anything appeared there, so nothing is replaced and no temp name or rename is
    needed (a metadata-bound checkout: fewer system calls per file).
    Returns the object file's stat before a hard link (whose ctime the link and rename move).
    """
    objects = store.objects
    loc = objects.locate(e.digest)
    # A compressed object is materialized raw once (verified); a raw one is opened right here (as a
    # regular file, never a planted link or FIFO) -- one lookup and one open per key.
    path = loc.path if loc.codec.byte_exact else str(objects.raw_path(e.digest))
    src, st = open_object_file(path, e.digest)
    try:
        if trust is None or not trust.trusted(e.digest, st):
            objects.verify_fd(e.digest, src, st, path)  # never link to corrupt bytes
            if trust is not None:
                trust.note(e.digest, st)
        if link == "symlink":
            try:
                os.symlink(path, tmp, dir_fd=pfd)  # the object's inode is untouched: its record stays valid
            except OSError as err:
                raise _target_error(err, dest) from None
            return None
        if direct:
            fault("manifest.checkout_before_rename")  # the point just before a file appears under its key
        try:
            if _PROC_FD:
                # The very inode just verified (open fd), whatever the object path names by now.
                os.link(f"/proc/self/fd/{src}", tmp, dst_dir_fd=pfd, follow_symlinks=True)
            else:
                os.link(path, tmp, dst_dir_fd=pfd, follow_symlinks=False)
        except FileExistsError:
            if not direct:
                raise
            raise InvalidInputError(
                f"{dest} appeared while checking out (now {_describe(pfd, tmp)}); pass overwrite=True to replace it"
            ) from None
        except OSError as err:
            if err.errno == errno.EMLINK:  # this object's limit (ext4: 65,000), not the filesystem's fault
                raise _TooManyLinks() from None
            if err.errno in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP):
                raise InvalidInputError(
                    f"cannot hardlink {dest} to object {e.digest} ({err.strerror}; the store at {store.root} and "
                    "the folder must be on one filesystem that allows links). Use link='symlink' or link='copy'"
                ) from None
            raise _target_error(err, dest) from None
        if not _PROC_FD:
            got = os.stat(tmp, dir_fd=pfd, follow_symlinks=False)
            if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):  # the object path was swapped after verifying
                os.unlink(tmp, dir_fd=pfd)
                raise IntegrityError(f"object file {path} of {e.digest} changed while being linked; not checked out")
        return st
    finally:
        os.close(src)


# -- the checkout record (what each checkout wrote; read as hostile input) --------


class _Record:
    """Files and directories that checkouts of one name wrote into one folder (``sync`` removes only these)."""

    def __init__(self, store: Store, out: Path, name: str) -> None:
        self.root = os.path.realpath(out)
        self.name = name
        self.root_field = _root_field(self.root)  # (as saved: a str if UTF-8, else the path's bytes)
        ident = hash_bytes(os.fsencode(self.root) + b"\0" + name.encode("utf-8", "surrogateescape"))
        self.path = store.root / RECORD_DIR / ident.hex[:32]
        self.store = store
        self.files: Dict[str, RecEntry] = {}
        self.dirs: Set[str] = set()
        self.damaged: Optional[str] = None

    def load(self) -> None:
        """Read the record; a missing one is empty, a damaged one is empty and ``damaged`` says why."""
        try:
            fd = os.open(self.path, _READ)
        except FileNotFoundError:
            return
        except OSError as e:
            self.damaged = f"unreadable ({e.strerror})"
            return
        try:
            st = os.fstat(fd)
            # Hazard: in a shared store every member may write cache/checkout, so a record planted by
            # another member could name this user's own files, at their exact stat, for sync to delete.
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                self.damaged = f"not this user's (written by another user, uid {st.st_uid})"
                return
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(_RECORD_MAX_BYTES + 1)
        except OSError as e:
            self.damaged = f"unreadable ({e.strerror})"
            return
        finally:
            os.close(fd)
        try:
            if len(raw) > _RECORD_MAX_BYTES:
                raise ValueError("too large")
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            files, dirs = self._parse(doc)
        except Exception as e:  # noqa: BLE001 - hostile bytes: any failure means "no record"
            self.damaged = f"damaged ({type(e).__name__}: {e})"[:300]
            return
        self.files, self.dirs = files, dirs

    def _parse(self, doc: object) -> Tuple[Dict[str, RecEntry], Set[str]]:
        version = doc.get("v") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or version not in (1, _RECORD_VERSION):
            raise ValueError("not a version-1 or -2 checkout record")
        if doc.get("root") != self.root_field or doc.get("name") != self.name:
            raise ValueError("written for another folder or name")
        ents, dirs = doc.get("files"), doc.get("dirs")
        if not isinstance(ents, dict) or not isinstance(dirs, list):
            raise ValueError("files or dirs missing")
        files: Dict[str, RecEntry] = {}
        n = 5 if version == 1 else 7  # 1: [hex, dev, ino, size, mtime]; 2: [hex, how, dev, ino, size, mtime, ctime]
        for k, v in ents.items():
            if not (isinstance(k, str) and _safe_key(k) and isinstance(v, list) and len(v) == n
                    and isinstance(v[0], str) and all(type(x) is int for x in v[1:])):
                raise ValueError(f"bad entry {k!r:.100}")
            if version == 1:  # no ctime, made by any mode: its bytes must vouch for it (see _ours)
                how, key = 0, (v[1], v[2], v[3], v[4], _NO_CTIME)
            else:
                how, key = v[1], (v[2], v[3], v[4], v[5], v[6])
                if how & ~(_HARDLINK | _SYMLINK | _SETTLED) or how & _HARDLINK and how & (_SYMLINK | _SETTLED):
                    raise ValueError(f"bad kind for {k!r:.100}")
            try:
                files[k] = (Digest(v[0]), key, how)
            except InvalidDigestError:
                raise ValueError(f"bad digest for {k!r:.100}") from None
        if not all(isinstance(d, str) and _safe_key(d) for d in dirs):
            raise ValueError("bad directory")
        return files, set(dirs)

    def save(self) -> None:
        doc = {"v": _RECORD_VERSION, "root": self.root_field, "name": self.name,
               "files": {k: [d.hex, how, *st] for k, (d, st, how) in sorted(self.files.items())},
               "dirs": sorted(self.dirs)}
        try:
            data = msgpack.packb(doc, use_bin_type=True)
        except (ValueError, TypeError) as e:  # (the files are written: a record is never worth failing for)
            log.warning("checkout record %s not written (%s: %s): a later sync will not remove these files",
                        self.path, type(e).__name__, e)
            return
        try:
            makedirs(self.path.parent)  # in a shared store group-writable, as cache/hashed: every member records
            write_file_atomic(self.store.root / TMP, self.path, data, durable=False, mode=0o644)
        except OSError as e:  # a read-only store still checks out; a later sync just removes less
            log.warning("checkout record %s not written (%s): a later sync will not remove these files",
                        self.path, e.strerror)


def _root_field(real: str) -> Union[str, bytes]:
    """A target's real path as its checkout record keeps it: a str if it is UTF-8, else its bytes.

    Hazard (found by a bug hunt): a target whose path is not UTF-8 (``caf\\xe9``, decoded with
    surrogateescape) crashed the record's save (msgpack packs a str as strict UTF-8) after the
    files were written: every checkout there failed "unexpectedly" and, with no record, ``sync``
    never worked.  Its bytes are the path exactly; a UTF-8 path stays a str, so records written
    before (and by older versions) still match.
    """
    try:
        real.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(real)
    return real


def _safe_key(k: str) -> bool:
    """A relative path of plain segments (the record is hostile input: no '..', absolute or empty parts)."""
    parts = k.split("/")
    return bool(k) and "\0" not in k and all(p not in ("", ".", "..") for p in parts)


def _stat_key(st: os.stat_result) -> StatKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _object_file(store: Store, d: Digest) -> str:
    """The raw object file's path (what hard and symbolic links are made to; not materialized here)."""
    return f"{store.objects.root}/{object_relpath(d, RAW)}"


def _is_object_inode(store: Store, d: Digest, st: os.stat_result) -> bool:
    """Is the file ``st`` describes the store's raw object file of ``d`` itself (a hard link to it)?"""
    try:
        obj = os.stat(_object_file(store, d), follow_symlinks=False)
    except OSError:
        return False
    return (obj.st_dev, obj.st_ino) == (st.st_dev, st.st_ino)


def _ours(store: Store, pfd: int, leaf: str, st: os.stat_result, rec: RecEntry, floor: int) -> Optional[RecEntry]:
    """The record's entry for ``leaf`` (lstat ``st``), refreshed, if the file is still as casstore left it;
    None if it is not (changed since, replaced, or no longer what casstore made).

    ``floor``: a :func:`~casstore._fs.stamp_floor_ns` read before ``st`` (and before any hash here).
    """
    d, key, how = rec
    if how & _HARDLINK:
        # The object's own inode: every re-put of its bytes (``touch``, gc's grace period) moves its
        # mtime and ctime, so times say nothing; being the object file's inode says it all.
        if not stat.S_ISREG(st.st_mode):
            return None
        if _is_object_inode(store, d, st):
            return (d, _stat_key(st), how)
        # The object is gone (gc) or another file now: the inode casstore linked, with its bytes, is still ours.
        if (st.st_dev, st.st_ino) == key[:2] and _same_file(pfd, leaf, d, st.st_size):
            return (d, _stat_key(st), how)
        return None
    if how & _SYMLINK:
        if not stat.S_ISLNK(st.st_mode):
            return None
        try:
            return rec if os.readlink(leaf, dir_fd=pfd) == _object_file(store, d) else None
        except OSError:
            return None
    now = _stat_key(st)
    if now != key and not (key[4] == _NO_CTIME and now[:4] == key[:4]):
        return None  # modified, replaced or re-created since (ctime too: utime can put mtime back)
    if how & _SETTLED:
        return rec
    # Racy: the entry was taken in the timestamp tick of the file's last change (always so right after
    # casstore wrote it), so a change in that same tick left the stat as it was: only the bytes can tell.
    if not stat.S_ISREG(st.st_mode) or not _same_file(pfd, leaf, d, st.st_size):
        return None
    return (d, now, how | _SETTLED) if settled(st, floor) else (d, now, how)


class _InStore(Exception):
    """A path :func:`_open_parent` was to open passes through the store (its ``avoid``)."""


def _open_parent(root_fd: int, parts: Sequence[str], avoid: Optional[Tuple[int, int]] = None) -> Optional[int]:
    """fd of directory ``parts`` under ``root_fd``, never following a link; None if it is not a directory.

    ``avoid``: the store's (device, inode): :class:`_InStore` if the path passes through it.
    """
    fd = os.dup(root_fd)
    for seg in parts:
        try:
            child = os.open(seg, _DIR, dir_fd=fd)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
                return None  # gone, or a link/file planted where the directory was: never followed
            raise
        os.close(fd)
        fd = child
        if avoid is not None:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == avoid:
                os.close(fd)
                raise _InStore()
    return fd


def _store_id(store: Store) -> Tuple[int, int]:
    """The store root's (device, inode): what a checkout never writes into nor removes from."""
    st = os.stat(store.root)
    return (st.st_dev, st.st_ino)


def _in_store(store: Store, key: str, path: Union[str, Path], *, checked: bool) -> InvalidInputError:
    """The error for a key whose path lies inside the store (``checked``: found before anything was written)."""
    where = str(path) if str(path) == str(store.root) else f"{path}, the store at {store.root}"
    return InvalidInputError(
        f"manifest key {key!r} lies inside the casstore store ({where}); a checkout never writes into the "
        f"store{'; nothing was checked out' if checked else ''}. Check out into a folder that does not "
        "contain the store"
    )


def _refuse_store_target(store: Store, out: Path) -> None:
    """Refuse a target that is the store's root or lies inside it, before anything is written.

    Hazard (found by a bug hunt): ``checkout NAME <store> --overwrite`` replaced ``store.toml`` with a
    manifest's file and broke the store; a checkout into ``<store>/objects`` or ``refs/`` planted
    object files whose bytes are not their names, and pins.  Compared by real path and by device and
    inode of the target and every existing directory above it (:func:`~casstore._fs.inside_dir`: through
    a link or a bind mount too), like ``add``'s and ``status``'s check (casstore/folders.py).
    """
    if inside_dir(out, store.root):
        raise InvalidInputError(
            f"cannot check out into {out}: it is the casstore store at {store.root} or a folder inside it; a "
            "checkout never writes into the store (a manifest's files would replace its objects, refs and "
            "settings). Check out into a folder outside the store"
        )


class _KindSwitch:
    """Keys that are a file in one version and a directory in the next, or the reverse (``sync`` only).

    Hazard (found by a bug hunt): v1 has the file ``model``, v2 ``model/weights.bin``.  ``sync``
    refused the file in the directory's way (and the directory in the file's way, going back); with
    ``overwrite`` the file was replaced but stayed in the record, and every later sync reported it
    "kept" (changed since), even with ``force``.  Now sync replaces what an earlier checkout of the
    name wrote, as it replaces a recorded file with new bytes: still casstore's (:func:`_ours`; with
    ``force`` any file or link it recorded).  A recorded file where a directory is needed is replaced
    by the walker (:meth:`replaceable`, asked by the check pass); a directory a checkout of the name
    made, where a file is needed, is removed when nothing is in it but directories it made and files
    it wrote (:meth:`plan` in the check pass; :meth:`clear` checks again and removes them just before
    that key's file is written: the one removal that cannot wait until every new file is in place).
    Never a user's file, never a directory casstore did not make, never anything in the store.
    """

    def __init__(self, store: Store, out: Path, rec: _Record, store_id: Tuple[int, int], *, force: bool,
                 floor: int) -> None:
        self.store = store
        self.out = out
        self.rec = rec
        self.store_id = store_id
        self.force = force
        self.floor = floor
        self.files_ok: Set[str] = set()  # recorded files the check pass found replaceable by a directory
        self.dirs_ok: Set[str] = set()  # keys whose directory the check pass found removable
        self.files: List[str] = []  # keys of recorded files removed by clear
        self.dirs: List[str] = []  # recorded directories removed by clear

    def _still_ours(self, fd: int, name: str, st: os.stat_result, rel: str) -> Optional[str]:
        """None if the recorded file ``rel`` may go; else why not, for an error message."""
        ours = self.rec.files.get(rel)
        if ours is None:
            return f"{self.out}/{rel} is not a file it wrote"
        if self.force and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return None
        if _ours(self.store, fd, name, st, ours, self.floor) is not None:
            return None
        return f"{self.out}/{rel} changed since it was written (pass force=True to remove it)"

    def replaceable(self, fd: int, seg: str, rel: str) -> Optional[str]:
        """None if the recorded file ``rel`` (``seg`` in ``fd``) may be replaced by a directory; else what
        the error should add (may be "")."""
        if rel not in self.rec.files:
            return ""
        try:
            st = os.stat(seg, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return ""
        if self._still_ours(fd, seg, st, rel) is None:
            return None
        return " (an earlier checkout of this name wrote it, but it changed since: pass force=True to replace it)"

    def plan(self, pfd: int, leaf: str, key: str) -> Union[str, Tuple[List[str], List[str]]]:
        """What removing the directory at ``key`` (``leaf`` in ``pfd``) takes: the recorded files in it and its
        recorded directories (keys; the directories deepest first); or why it may not be removed."""
        if key not in self.rec.dirs:
            return "no checkout of this name made it"
        files: List[str] = []
        dirs: List[str] = []
        try:
            stack = [(os.open(leaf, _DIR, dir_fd=pfd), key)]
        except OSError as e:
            return f"it cannot be opened ({e.strerror})"
        try:
            while stack:
                fd, rel = stack.pop()
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) == self.store_id:
                        return f"{self.out}/{rel} is the casstore store"
                    for n in sorted(os.listdir(fd)):
                        sub = f"{rel}/{n}"
                        st = os.stat(n, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            if sub not in self.rec.dirs:
                                return f"{self.out}/{sub} is a directory it did not make"
                            stack.append((os.open(n, _DIR, dir_fd=fd), sub))
                            dirs.append(sub)
                            continue
                        why = self._still_ours(fd, n, st, sub)
                        if why is not None:
                            return why
                        files.append(sub)
                finally:
                    os.close(fd)
        except OSError as e:
            return f"it changed while being read ({e.strerror})"
        finally:
            for fd, _ in stack:
                os.close(fd)
        dirs.reverse()  # each was listed after its parent: children first
        return files, dirs

    def clear(self, pfd: int, leaf: str, key: str, dest: str) -> None:
        """Remove the directory at ``key`` found removable by the check pass, checking it again first."""
        got = self.plan(pfd, leaf, key)
        if isinstance(got, str):
            raise InvalidInputError(f"{dest} is a directory where the manifest has a file, and it changed while "
                                    f"checking out ({got}); remove it, or leave it and check out again")
        files, dirs = got
        top = os.open(leaf, _DIR, dir_fd=pfd)
        try:
            for k in files:
                parts = k[len(key) + 1:].split("/")
                fd = _open_parent(top, parts[:-1])
                if fd is not None:
                    try:
                        os.unlink(parts[-1], dir_fd=fd)  # the entry itself: a link is removed, never followed
                    except FileNotFoundError:
                        pass
                    finally:
                        os.close(fd)
                self.files.append(k)
            for d in dirs:
                parts = d[len(key) + 1:].split("/")
                fd = _open_parent(top, parts[:-1])
                if fd is not None:
                    try:
                        self._rmdir(fd, parts[-1], f"{self.out}/{d}", dest)
                    finally:
                        os.close(fd)
                self.dirs.append(d)
        finally:
            os.close(top)
        self._rmdir(pfd, leaf, dest, dest)
        self.dirs.append(key)

    @staticmethod
    def _rmdir(fd: int, name: str, path: str, dest: str) -> None:
        try:
            os.rmdir(name, dir_fd=fd)  # only if empty: a file written meanwhile stays
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise InvalidInputError(f"{dest} is a directory where the manifest has a file, and {path} was "
                                        "written into meanwhile; move that out, and check out again") from None
            raise _target_error(e, path, "remove directory") from None


class CheckedOut(List[Path]):
    """What a checkout did: the paths it wrote (it is that list), and what ``sync`` removed.

    ``removed``: keys of files an earlier checkout of the name wrote into the folder that
    ``sync`` deleted (the new version lacks them); ``kept``: such files ``sync`` left because they
    changed since casstore wrote them (``force=True`` removes those too).  Both are empty
    without ``sync``.
    """

    __slots__ = ("removed", "kept")

    def __init__(self, written: Iterable[Path] = (), removed: Iterable[str] = (), kept: Iterable[str] = ()) -> None:
        super().__init__(written)
        self.removed: Tuple[str, ...] = tuple(removed)
        self.kept: Tuple[str, ...] = tuple(kept)


def checkout(store: Store, target: Target, outdir: Union[str, os.PathLike[str]], *,
             overwrite: bool = False, sync: bool = False, link: str = "copy", force: bool = False,
             progress: Optional[bool] = None, rehash: bool = False) -> CheckedOut:
    """Materialize a manifest's files under ``outdir``; return the paths written (:class:`CheckedOut`:
    also the keys ``sync`` removed, and those it kept).

    Files already holding the right bytes are left alone (and not returned).
    Each file is written to a temporary name beside its key, verified
    (re-hashed), then renamed, so a failed checkout never leaves a partial
    file under a key.  Nothing is ever written outside ``outdir``: links in
    the target are never followed (see the module docstring).  A file with
    other content, a link or a special file in the way is an
    :class:`~casstore.errors.InvalidInputError` unless ``overwrite``.  So is
    a target that is the store or lies inside it, and (the store inside
    ``outdir``) a key whose path lies inside the store: nothing is written.

    ``link``: ``"copy"`` (reflinked where the filesystem can, else copied),
    ``"reflink"`` (a clone or an error), ``"hardlink"`` / ``"symlink"`` (to
    the read-only object file; where the object already has the most hard
    links its filesystem allows, that file is copied, with a warning).  Every
    checkout records what it wrote (key, how, and the file's device, inode,
    size, mtime and ctime) under the store; ``sync=True`` also removes the
    files a previous checkout of the same name into this folder wrote that this
    version lacks, and updates the ones it changes -- never a file casstore did
    not write, and never one modified since unless ``force=True`` (a copy whose
    stat differs, or whose bytes do while its stat cannot tell; a link that is
    no longer the object's).  A key that is a file in one version and a
    directory in the other is followed both ways: the file casstore wrote, or
    the directory it made holding only what it wrote, makes way.

    Every object is verified before it is used: a copy is re-hashed after it
    is written; a hard or symbolic link is made only to an object file that
    is hashed now, or that casstore hashed within ``TRUST_SECONDS`` and whose
    stat (device, inode, size, mtime_ns, ctime_ns) is unchanged since
    (:class:`~casstore.objects.HashRecord`); ``rehash=True`` hashes every
    linked object regardless.  ``progress``: a bar by bytes on stderr
    (``None``: only when it is a terminal).
    """
    if not isinstance(outdir, (str, os.PathLike)):
        raise InvalidTypeError(f"checkout() needs a directory path, not {type(outdir).__name__}")
    raw = os.fspath(outdir)
    if not isinstance(raw, str):
        raise InvalidTypeError(f"checkout() needs a str directory path, not {type(raw).__name__}")
    if not raw or "\x00" in raw:
        # Hazard (found by a bug hunt): an empty target (an unset $OUT) was the current directory, and
        # --overwrite replaced the user's files there; add and status refuse '' the same way.
        raise InvalidInputError(f"invalid folder {raw!r}: {'an empty path' if not raw else 'a NUL byte'} names "
                                "no folder (an unset variable?); give the folder to check out into ('.' for "
                                "the current directory); nothing was checked out")
    try:
        os.fsencode(raw)
    except UnicodeEncodeError:  # (a lone surrogate no file name can hold: no system call could take it)
        raise InvalidInputError(f"invalid folder {raw!r}: it is not valid Unicode (a lone surrogate that no "
                                "file name's bytes decode to); give the folder's path as the system names it; "
                                "nothing was checked out") from None
    if link not in LINK_MODES:
        raise InvalidInputError(f"link={link!r:.50} is not one of {', '.join(LINK_MODES)}")
    for flag, what in ((overwrite, "overwrite"), (sync, "sync"), (force, "force"), (rehash, "rehash")):
        if not isinstance(flag, bool):
            raise InvalidTypeError(f"checkout({what}=...) needs True or False, not {type(flag).__name__}")
    if force and not sync:
        raise InvalidInputError("force=True only applies with sync=True (it lets sync remove or replace "
                                "files changed since casstore wrote them); for other files use overwrite=True")
    digest, name, _ = resolve_target(store, target)
    man = read_manifest(store, digest)
    # One pass over the entries: a large (tree-shaped) manifest is walked once, not once per step.
    ents: Dict[str, Entry] = dict(man.entries.items())
    _conflicts(man, ents)
    out = Path(raw).absolute()
    store_id = _store_id(store)
    _refuse_store_target(store, out)
    if store.objects.upstream is not None:  # read-through: bring every missing object home before writing a file
        store.objects.fetch_many([e.digest for e in ents.values() if not store.objects.has(e.digest)])
    for key, e in ents.items():
        if not store.objects.has(e.digest):
            raise ObjectNotFoundError(
                f"cannot check out {man.digest}: entry {key!r} refers to {e.digest}, which is not in the store "
                f"at {store.root}; nothing was checked out. Pull it from the remote that holds it"
            )
    rec = _Record(store, out, name if name is not None else "")
    rec.load()
    if rec.damaged is not None:
        log.warning("checkout record %s for %s is %s; treated as empty (sync removes nothing this time)",
                    rec.path, out, rec.damaged)
    try:
        return _checkout(store, ents, out, rec, overwrite=overwrite, sync=sync, link=link, force=force,
                         progress=progress, rehash=rehash, store_id=store_id)
    except PermissionError as err:
        if isinstance(err, CasstoreError):  # already names the key's path (_target_error)
            raise
        raise ReadOnlyError(f"cannot check out into {out}: {err.strerror} ({err.filename})") from None


def _checkout(store: Store, ents: Dict[str, Entry], out: Path, rec: _Record, *, overwrite: bool, sync: bool, link: str,
              force: bool, progress: Optional[bool], rehash: bool, store_id: Tuple[int, int]) -> CheckedOut:
    todo: List[Tuple[str, Entry, bool]] = []  # (key, entry, expected to exist: a replacement)
    seen: Dict[str, RecEntry] = {}  # recorded files found still casstore's (entries refreshed)
    floor = stamp_floor_ns()  # before every stat and hash below (see _ours)
    switch = _KindSwitch(store, out, rec, store_id, force=force, floor=floor) if sync else None
    root_fd = _open_target(out, create=False)
    if root_fd is None:
        todo = [(k, e, False) for k, e in ents.items()]
    else:
        # Hazard (found by a bug hunt): with the store inside the folder (proj/.casstore), a manifest's keys
        # ".casstore/refs/pins/x" and ".casstore/objects/ab/..." planted a pin and a fake object.  The walk
        # refuses a key whose path passes through (or is) the store, before anything is written.
        walker = _Walker(root_fd, out, overwrite=overwrite, create=False, switch=switch, store=store,
                         store_id=store_id)
        swept: Set[Tuple[str, ...]] = set()
        try:
            for key, e in ents.items():
                parts = key.split("/")
                pfd = walker.parent(parts[:-1], key)
                if pfd is None:
                    todo.append((key, e, False))
                    continue
                where = tuple(parts[:-1])
                if where not in swept:  # (once per directory: keys come sorted)
                    swept.add(where)
                    _sweep_parts(pfd)
                ours = rec.files.get(key) if sync else None  # replacing a file casstore wrote is sync's job
                present, mine = _check_leaf(store, pfd, parts[-1], f"{out}/{key}", e, overwrite, link=link,
                                            ours=ours, force=force, floor=floor, key=key, switch=switch,
                                            store_id=store_id)
                if present is not None:
                    todo.append((key, e, present))
                if mine is not None:
                    seen[key] = mine
        finally:
            walker.close()
            os.close(root_fd)
    fault("manifest.checkout_checked")
    written: List[Path] = []
    new_files: Dict[str, RecEntry] = {}
    created: List[str] = []
    replaced: List[str] = []  # files (or links) replaced by a directory the new version needs
    removed: Tuple[Set[str], List[str], List[str], List[str]] = (set(), [], [], [])  # dirs, removed, kept, gone
    ok = False
    try:
        if todo:
            _write_all(store, out, todo, written, new_files, created, replaced, overwrite=overwrite, link=link,
                       progress=progress, rehash=rehash, sync=sync, switch=switch, store_id=store_id)
        ok = True
    finally:
        # Files and directories removed to switch a key between file and directory are gone, whatever
        # happened after: forgotten by the record (and, with sync, reported as removed: they were its doing).
        switched = [k for k in itertools.chain(switch.files if switch is not None else (), replaced)
                    if rec.files.pop(k, None) is not None]
        if switch is not None:
            rec.dirs.difference_update(switch.dirs)
        # Record what was written even after a failure midway: those files are casstore's to sync later.
        # Removal runs only after every new file is in place, so a failed sync removes nothing (but what
        # was in the way of a key that switched between file and directory).
        if sync and ok:
            removed = _remove_stale(store, out, ents, rec, force=force, floor=floor, store_id=store_id)
        # Every entry stays until its file is gone: one this run did not get to (a failure midway) is
        # still as casstore left it, so a retry replaces it; one sync kept (changed since) stays
        # recorded as it was, so ``force`` can still remove it.
        files = rec.files
        files.update(seen)
        files.update(new_files)
        for k in itertools.chain(removed[1], removed[3]):
            files.pop(k, None)
        rec.dirs = (rec.dirs | set(created)) - removed[0]
        rec.save()
    return CheckedOut(written, sorted([*removed[1], *switched]) if sync else (), removed[2])


def _write_all(store: Store, out: Path, todo: Sequence[Tuple[str, Entry, bool]], written: List[Path],
               new_files: Dict[str, RecEntry], created: List[str], replaced: List[str], *, overwrite: bool,
               link: str, progress: Optional[bool], rehash: bool, sync: bool, switch: Optional[_KindSwitch],
               store_id: Tuple[int, int]) -> None:
    root_fd = _open_target(out, create=True)
    assert root_fd is not None
    walker = _Walker(root_fd, out, overwrite=overwrite, create=True, switch=switch, store=store, store_id=store_id)
    out_s = str(out)
    trust = store.objects.hash_record() if link in ("hardlink", "symlink") and not rehash else None
    bar = Progress(sum(e.size or 0 for _, e, _ in todo), desc="checkout", enabled=progress)
    # Links are metadata only: a checkout of many small links waits on one system call after another,
    # so the keys of one directory are linked on a few threads (the directory's fd stays open until
    # all of them are done; results are taken in key order).  Copies are bound by bytes: one at a time.
    pool = ThreadPoolExecutor(LINK_WORKERS, thread_name_prefix="casstore-link") \
        if link in ("hardlink", "symlink") and len(todo) > 1 else None
    key = ""
    copied: List[str] = []  # hard-link checkout: keys copied because their object had the most links allowed
    try:
        i = 0
        while i < len(todo):
            key = todo[i][0]
            parts = key.split("/")
            pfd = walker.parent(parts[:-1], key)
            assert pfd is not None
            base = key[:len(key) - len(parts[-1])]  # "dir/" ("" at the top)
            j = i + 1
            while j < len(todo) and todo[j][0].startswith(base) and "/" not in todo[j][0][len(base):]:
                j += 1
            group = todo[i:j] if pool is not None else todo[i:i + 1]
            if switch is not None and switch.dirs_ok:
                for k, _, _ in group:
                    if k in switch.dirs_ok:  # a directory an earlier checkout made, where this key is a file
                        key = k
                        switch.clear(pfd, k[len(base):], k, f"{out_s}/{k}")
                key = todo[i][0]
            got: Iterator[Union[Tuple[StatKey, int], BaseException]]
            if pool is not None:
                # Slices of LINK_SLICE keys and up, one job each: a job per key cost ~24 futex calls
                # per link (the GIL handed between the workers and this thread), and 10,000 hard
                # links took 2.3 CPU-s against 1.5 with slices of 64 (wall 2.1 s against 1.4 s).
                # At most LINK_SLICE_MAX: the results (and the progress bar) come slice by slice.
                step = min(LINK_SLICE_MAX, max(LINK_SLICE, -(-len(group) // LINK_WORKERS)))
                jobs = [pool.submit(_write_slice, store, pfd, base, out_s, group[a:a + step],
                                    overwrite=overwrite, link=link, trust=trust)
                        for a in range(0, len(group), step)]
                got = itertools.chain.from_iterable(job.result() for job in jobs)  # in key order
            else:  # copies: one key at a time, on this thread
                got = iter(_write_slice(store, pfd, base, out_s, group, overwrite=overwrite, link=link, trust=trust))
            first: Optional[BaseException] = None
            for k, en, _ in group:
                try:
                    r = next(got)
                    if isinstance(r, BaseException):
                        raise r
                    st, how = r
                except BaseException as ex:  # the others of the group finish first; the first error is raised
                    if first is None:
                        first, key = ex, k
                    continue
                if link == "hardlink" and not how & _HARDLINK:
                    copied.append(k)
                new_files[k] = (en.digest, st, how)
                written.append(out / k)
                bar.update(en.size or 0)
            if first is not None:
                raise first
            i += len(group)
    except (CasstoreError, OSError) as err:
        # Hazard (found by a bug hunt): "sync removed nothing" was said without sync too.
        n = len(walker.replaced) + (len(switch.files) if switch is not None else 0)
        what = "" if not sync else "; sync removed nothing" if not n else (
            f"; sync removed only the {n} file(s) in the way of keys that switched between file and directory")
        done = (f"checkout into {out} stopped at {key!r} after writing {len(written)} of {len(todo)} file(s) "
                f"(each written file is whole and verified; nothing half-written is left{what})")
        # Said in the error itself (its type kept, so callers catch it as before).
        if isinstance(err, OSError) and err.strerror:
            err.strerror = f"{err.strerror}. {done}"
        else:
            err.args = (f"{err}. {done}",)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        if copied:
            log.warning("%d file(s) in %s were copied, not hard-linked: their object already has the most links "
                        "the filesystem allows (too many links, EMLINK; ext4 allows 65,000): %s", len(copied), out,
                        ", ".join(copied[:10]))
        if trust is not None:
            trust.save()
        created.extend(walker.created)
        replaced.extend(walker.replaced)
        walker.close()
        os.close(root_fd)


def _remove_stale(store: Store, out: Path, ents: Dict[str, Entry], rec: _Record, *, force: bool,
                  floor: int, store_id: Tuple[int, int]) -> Tuple[Set[str], List[str], List[str], List[str]]:
    """Remove recorded files the new version lacks (still casstore's, :func:`_ours`; or any file/link
    with ``force``); then recorded directories left empty.  Returns the directories removed, the keys of
    the files removed, those of the files left (changed since casstore wrote them) and those no longer
    in the folder.  Nothing inside the store (``store_id``) is ever removed: such keys are forgotten."""
    stale = sorted(k for k in rec.files if k not in ents)
    gone_dirs: Set[str] = set()
    removed: List[str] = []
    left: List[str] = []
    gone: List[str] = []
    in_store: List[str] = []
    if not stale and not rec.dirs:
        return gone_dirs, removed, left, gone
    try:
        root_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return gone_dirs, removed, left, gone
    try:
        for key in stale:
            parts = key.split("/")
            try:
                # Hazard (found by a bug hunt): a record written before checkout refused keys inside the
                # store (or a store made inside the folder since) named files in it for sync to delete.
                pfd = _open_parent(root_fd, parts[:-1], store_id)
            except _InStore:
                in_store.append(key)
                gone.append(key)
                continue
            if pfd is None:
                gone.append(key)  # its directory is gone (or a link now: never followed)
                continue
            try:
                try:
                    st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
                except FileNotFoundError:
                    gone.append(key)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    # Hazard (found by a bug hunt): a key that became a directory (v1 "model", v2
                    # "model/w.bin") was "kept" (changed since) by every later sync, even with force:
                    # the file casstore wrote is gone; a directory is never removed here.
                    gone.append(key)
                elif (force and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode))
                        or _ours(store, pfd, parts[-1], st, rec.files[key], floor) is not None):
                    os.unlink(parts[-1], dir_fd=pfd)  # the entry itself: a link is removed, never followed
                    removed.append(key)
                else:
                    left.append(key)
            finally:
                os.close(pfd)
        needed = {"/".join(k.split("/")[:i]) for k in ents for i in range(1, k.count("/") + 1)}
        for d in sorted(rec.dirs - needed, key=lambda d: -d.count("/")):  # deepest first
            parts = d.split("/")
            try:
                dfd = _open_parent(root_fd, parts, store_id)  # (the directory itself may be the store, too)
            except _InStore:
                gone_dirs.add(d)  # never removed: forgotten
                continue
            if dfd is not None:
                os.close(dfd)
            pfd = _open_parent(root_fd, parts[:-1])
            if pfd is None:
                continue
            try:
                os.rmdir(parts[-1], dir_fd=pfd)  # only if empty; a link in its place is ENOTDIR: left alone
                gone_dirs.add(d)
            except FileNotFoundError:
                gone_dirs.add(d)
            except OSError:
                pass
            finally:
                os.close(pfd)
    finally:
        os.close(root_fd)
    if in_store:
        log.warning("sync left %d file(s) in %s alone that lie inside the casstore store at %s (a checkout never "
                    "removes anything there), and forgot them: %s", len(in_store), out, store.root,
                    ", ".join(in_store[:10]))
    if left:
        log.warning("sync kept %d file(s) in %s that changed since casstore wrote them (pass force=True to "
                    "remove them): %s", len(left), out, ", ".join(left[:10]))
    return gone_dirs, removed, left, gone


def _bad_target(out: Path, err: OSError, *, making: bool) -> Optional[CasstoreError]:
    """The typed error for a target no folder can be made (``making``) or opened at (``None``: not such a case).

    Hazard (found by a bug hunt): a target under a dangling symbolic link (ENOENT from
    ``makedirs``), through a loop of links (ELOOP) or with a name too long (ENAMETOOLONG) was
    "checkout failed unexpectedly"; add, status and get -o say what is wrong with the path.
    """
    where = f"cannot check out into {str(out)[:200]!r}"
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        return InvalidInputError(f"{where}: it (or a parent) is not a directory (a file, or a symbolic link "
                                 "to nothing); give a folder, or a path where one can be made")
    if err.errno == errno.ENOENT:
        return InvalidInputError(f"{where}: a parent folder is missing though it is named on the path -- a "
                                 "symbolic link to nothing (dangling), or removed meanwhile; fix or remove "
                                 "that link, or check out elsewhere")
    if err.errno == errno.ELOOP:
        return InvalidInputError(f"{where}: too many levels of symbolic links on its path (a loop of links); "
                                 "fix the links, or check out elsewhere")
    if err.errno == errno.ENAMETOOLONG:
        return InvalidInputError(f"{where}: the path or a name on it is too long for the filesystem (a name "
                                 "is at most 255 bytes); give a shorter one")
    if making and (err.errno in _READ_ONLY or err.errno in NO_SPACE):  # (EACCES opening: checkout's own words)
        made = _target_error(err, str(out), "create directory")
        return made if isinstance(made, CasstoreError) else None
    return None


def _open_target(out: Path, *, create: bool) -> Optional[int]:
    """The target directory's fd (the target itself may be a link: the caller named it)."""
    if create:
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            typed = _bad_target(out, e, making=True)
            if typed is None:
                raise
            raise typed from None
    try:
        return os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if isinstance(e, FileNotFoundError) and not create:
            return None  # (made by the write pass)
        typed = _bad_target(out, e, making=False)
        if typed is None:
            raise
        raise typed from None


def _check_leaf(store: Store, pfd: int, leaf: str, dest: str, e: Entry, overwrite: bool, *, link: str,
                ours: Optional[RecEntry], force: bool, floor: int, key: str, switch: Optional[_KindSwitch],
                store_id: Tuple[int, int]) -> Tuple[Optional[bool], Optional[RecEntry]]:
    """None: ``dest`` already holds the entry; False: nothing there; True: something to replace.  Also the
    record's entry for it, refreshed, if the file is still casstore's (:func:`_ours`), else None.

    ``ours``: what the previous checkout recorded at this key (sync only): a file still as casstore
    left it may be replaced without ``overwrite``; with ``force``, whatever file it is now.
    ``switch`` (sync only): a directory an earlier checkout made here may go (:class:`_KindSwitch`).
    """
    try:
        st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return False, None
    if stat.S_ISDIR(st.st_mode):
        if (st.st_dev, st.st_ino) == store_id:
            raise _in_store(store, key, dest, checked=True)
        if switch is None:
            raise InvalidInputError(
                f"{dest} is a directory where the manifest has a file; remove it (checkout never deletes "
                "directories; with sync=True it removes one an earlier checkout of this name made, when "
                "nothing is in it but what that checkout wrote)"
            )
        why = switch.plan(pfd, leaf, key)
        if isinstance(why, str):
            raise InvalidInputError(
                f"{dest} is a directory where the manifest has a file, and sync removes only a directory an "
                f"earlier checkout of this name made, holding nothing but what that checkout wrote: {why}. "
                "Move those files out, or remove the directory yourself"
            )
        switch.dirs_ok.add(key)
        return True, None  # removed just before this key's file is written (_KindSwitch.clear)
    mine = _ours(store, pfd, leaf, st, ours, floor) if ours is not None else None
    if mine is not None and mine[0] == e.digest and (stat.S_ISREG(st.st_mode) or link == "symlink"):
        return None, mine  # casstore's, with these bytes (a settled stat, hashed now, or the object itself)
    replaceable = overwrite or mine is not None or (ours is not None and force)
    if stat.S_ISLNK(st.st_mode) and link == "symlink":
        loc = store.objects.locate(e.digest)
        try:
            if loc.codec.byte_exact and os.readlink(leaf, dir_fd=pfd) == loc.path:
                return None, mine
        except OSError:
            pass
    if stat.S_ISREG(st.st_mode):
        if mine is None:  # (casstore's file holds its recorded bytes, which are not these)
            size = e.size if e.size is not None else store.objects.stat(e.digest).size
            if st.st_size == size and _same_file(pfd, leaf, e.digest, size):
                if ours is not None:
                    # The key was casstore's and now holds exactly this entry's bytes (just hashed): a sync
                    # killed after writing it but before saving its record (found by a bug hunt: every
                    # later sync refused the file as changed).  Casstore's again, recorded as it is now.
                    how = _HARDLINK if _is_object_inode(store, e.digest, st) else (  # see _ours
                        _SETTLED if settled(st, floor) else 0)
                    return None, (e.digest, _stat_key(st), how)
                return None, None  # the right bytes, but not casstore's as it left them: left alone, unrecorded
        if not replaceable:
            raise InvalidInputError(f"{dest} exists with other content; pass overwrite=True to replace it")
        return True, mine
    if not replaceable:
        raise InvalidInputError(
            f"{dest} is {_describe(pfd, leaf)}; checkout never writes through it. Remove it, or pass "
            "overwrite=True to replace it (the entry itself, inside the target; never what a link points to)"
        )
    return True, mine


_PART = ".casstore-"
"""A file being written at a key is ``.casstore-<pid>.<start ticks>.<host>.<hex>.part`` beside it."""
_OLD_PART = re.compile(r"^\.casstore-[0-9]+-[0-9a-f]{12}\.part$")  # before 2026-12-06: no host, no start time
_OLD_PART_AGE = 24 * 3600.0


def _sweep_parts(pfd: int) -> None:
    """Remove the temp files a killed checkout left in this directory.

    Hazard (found by a bug hunt): a checkout SIGKILLed while writing left
    ``.casstore-...part`` (part of an object's bytes) in the user's folder; reruns, syncs and
    verify never removed it, and a later ``add`` stored it as content.  Only a provably dead
    writer's file goes (:func:`~casstore._fs.dead_writer`; a name of the old form, which cannot
    say which host wrote it, once a day old).
    """
    try:
        names = os.listdir(pfd)
    except OSError:
        return
    for n in names:
        if not (n.startswith(_PART) and n.endswith(".part")):
            continue
        try:
            if dead_writer(n[len(_PART):]) or (
                    _OLD_PART.match(n) and time.time() - os.stat(n, dir_fd=pfd, follow_symlinks=False).st_mtime
                    > _OLD_PART_AGE):
                os.unlink(n, dir_fd=pfd)
                log.info("removed %r, the temp file of a checkout that died", n)
        except OSError:
            continue


def _write_slice(store: Store, pfd: int, base: str, out_s: str, keys: Sequence[Tuple[str, Entry, bool]], *,
                 overwrite: bool, link: str, trust: Optional[HashRecord]
                 ) -> List[Union[Tuple[StatKey, int], BaseException]]:
    """:func:`_write_one` for a slice of one directory's keys, in order (on a link worker, or inline).

    A key's error is kept in its place and the rest of the slice still runs, as when each key was
    a job of its own: the caller raises the first error in key order after the whole group.
    """
    out: List[Union[Tuple[StatKey, int], BaseException]] = []
    for k, en, pr in keys:
        try:
            # ``dest`` (for messages) is a string: a Path per key cost more than a hard link does.
            out.append(_write_one(store, pfd, k[len(base):], f"{out_s}/{k}", en, replace=pr or overwrite,
                                  link=link, trust=trust))
        except BaseException as ex:  # noqa: BLE001 - handed to the caller, which raises it in key order
            out.append(ex)
    return out


def _write_one(store: Store, pfd: int, leaf: str, dest: str, e: Entry, *, replace: bool, link: str,
               trust: Optional[HashRecord]) -> Tuple[StatKey, int]:
    """Write one key (temp name, verify, rename); return its stat key and how it was made, for the record.

    A hard link whose object already has the most links its filesystem allows (EMLINK) is a copy instead.
    """
    linked: Optional[os.stat_result] = None
    how = _HARDLINK if link == "hardlink" else _SYMLINK if link == "symlink" else 0
    if how == _HARDLINK and not replace:
        try:
            linked = _link_object(store, e, pfd, leaf, dest, link, trust, direct=True)
        except _TooManyLinks:
            how = 0  # copied below, under a temp name like any copy
        else:
            now = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
            if trust is not None and linked is not None:
                trust.carry(e.digest, linked, now)  # link() moved the inode's ctime: our own change
            return _stat_key(now), how
    tmp = f"{_PART}{process_token()}.{os.urandom(6).hex()}.part"  # not from leaf: a segment may be 255 bytes
    try:
        if how:
            try:
                linked = _link_object(store, e, pfd, tmp, dest, link, trust)
            except _TooManyLinks:
                how = 0
        if not how:
            try:
                fd = os.open(tmp, _CREATE, 0o666, dir_fd=pfd)
            except OSError as err:
                raise _target_error(err, dest) from None
            try:
                _fill(store, e, fd, dest, strict_reflink=link == "reflink")
            finally:
                os.close(fd)
        fault("manifest.checkout_before_rename")
        if not replace:
            try:
                os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                raise InvalidInputError(
                    f"{dest} appeared while checking out (now {_describe(pfd, leaf)}); "
                    "pass overwrite=True to replace it"
                )
        try:
            os.replace(tmp, leaf, src_dir_fd=pfd, dst_dir_fd=pfd)
        except IsADirectoryError:
            raise InvalidInputError(
                f"{dest} became a directory while checking out; remove it (checkout never deletes directories)"
            ) from None
        except OSError as err:
            raise _target_error(err, dest) from None
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=pfd)
        except OSError:  # never made (ENOENT; EROFS on a read-only mount): the first error is the one
            pass
        raise
    now = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
    if trust is not None and linked is not None and how:
        # link() and the rename moved the object inode's ctime (our own changes, nothing else):
        # the record follows, so the next link-mode checkout need not hash it again.
        trust.carry(e.digest, linked, now)
    return _stat_key(now), how
