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
  never what it points to.  Directories are never deleted.
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
  Files completed before the failure stay (each whole and verified).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

from .._faults import fault
from .._fs import copy_exact
from ..digest import hash_fd
from ..errors import IntegrityError, InvalidInputError, InvalidTypeError, ObjectNotFoundError, ReadOnlyError
from ..objects.reader import open_object_file
from .model import Entry
from .ops import Manifest, Target, read_manifest

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["checkout"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FICLONE = 0x40049409  # linux/fs.h
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
    """

    def __init__(self, root_fd: int, out: Path, *, overwrite: bool, create: bool) -> None:
        self.root_fd = root_fd
        self.out = out
        self.overwrite = overwrite
        self.create = create
        self.stack: List[Tuple[str, int]] = []

    def parent(self, parts: Sequence[str]) -> Optional[int]:
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
            if not self.overwrite:
                raise InvalidInputError(
                    f"{path} is {_describe(fd, seg)} where the manifest needs a directory; checkout never "
                    f"writes through it. Remove it, or pass overwrite=True to replace it (inside {self.out} only)"
                ) from None
            if not self.create:
                return None  # replaced in the write pass
            os.unlink(seg, dir_fd=fd)  # the link (or file) itself, never what it points to
        try:
            os.mkdir(seg, 0o777, dir_fd=fd)
        except FileExistsError:
            pass  # made meanwhile: opened below without following links, like any other
        return os.open(seg, _DIR, dir_fd=fd)

    def close(self) -> None:
        while self.stack:
            os.close(self.stack.pop()[1])


def _conflicts(man: Manifest) -> None:
    """Refuse keys that need one path to be both a file and a directory ("a" and "a/b")."""
    keys = list(man)  # sorted
    for key in keys:
        j = bisect.bisect_left(keys, key + "/")
        if j < len(keys) and keys[j].startswith(key + "/"):
            raise InvalidInputError(
                f"manifest {man.digest}: keys {key!r} and {keys[j]!r} conflict ({key!r} would have to be "
                "both a file and a directory); nothing was checked out"
            )


def _same_file(dir_fd: int, leaf: str, e: Entry, size: int) -> bool:
    """Whether the regular file ``leaf`` already holds exactly the entry's bytes."""
    try:
        fd = os.open(leaf, _READ, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and st.st_size == size and hash_fd(fd, size) == e.digest
    finally:
        os.close(fd)


def _reflink(src: int, dst: int) -> bool:
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return True
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF,
                       errno.EPERM):
            return False
        raise


def _fill(store: Store, e: Entry, fd: int) -> None:
    """Write the entry's object into ``fd`` (a new, empty file) and verify what was written."""
    objects = store.objects
    loc = objects.locate(e.digest)
    if loc.codec.byte_exact:
        src, st = open_object_file(loc.path, e.digest)  # a regular file: never a planted link or FIFO
        try:
            size = st.st_size
            if not _reflink(src, fd):
                copy_exact(src, fd, size)
        finally:
            os.close(src)
        got = hash_fd(fd, size)
        if got != e.digest:
            raise IntegrityError(f"object {e.digest} is corrupt (hashes to {got}); not checked out")
    else:
        with objects.open(e.digest, verify=True) as fi, open(fd, "wb", closefd=False) as fo:
            shutil.copyfileobj(fi, fo, _CHUNK)  # the reader raises IntegrityError before the last chunk


def checkout(store: Store, target: Target, outdir: Union[str, os.PathLike[str]], *,
             overwrite: bool = False) -> List[Path]:
    """Materialize a manifest's files under ``outdir``; return the paths written.

    Files already holding the right bytes are left alone (and not returned).
    Each file is written to a temporary name beside its key, verified
    (re-hashed), then renamed, so a failed checkout never leaves a partial
    file under a key.  Files are reflinked where the filesystem can (btrfs,
    XFS), else copied.  Nothing is ever written outside ``outdir``: links in
    the target are never followed (see the module docstring).  A file with
    other content, a link or a special file in the way is an
    :class:`~casstore.errors.InvalidInputError` unless ``overwrite``.
    """
    if not isinstance(outdir, (str, os.PathLike)):
        raise InvalidTypeError(f"checkout() needs a directory path, not {type(outdir).__name__}")
    man = read_manifest(store, target)
    _conflicts(man)
    out = Path(os.fspath(outdir)).absolute()
    for key, e in man.entries.items():
        if not store.objects.has(e.digest):
            raise ObjectNotFoundError(
                f"cannot check out {man.digest}: entry {key!r} refers to {e.digest}, which is not in the store "
                f"at {store.root}; nothing was checked out. Pull it from the remote that holds it"
            )
    try:
        return _checkout(store, man, out, overwrite=overwrite)
    except PermissionError as err:
        raise ReadOnlyError(f"cannot check out into {out}: {err.strerror} ({err.filename})") from None


def _checkout(store: Store, man: Manifest, out: Path, *, overwrite: bool) -> List[Path]:
    todo: List[Tuple[str, Entry, bool]] = []  # (key, entry, expected to exist: a replacement)
    root_fd = _open_target(out, create=False)
    if root_fd is None:
        todo = [(k, e, False) for k, e in man.entries.items()]
    else:
        walker = _Walker(root_fd, out, overwrite=overwrite, create=False)
        try:
            for key, e in man.entries.items():
                parts = key.split("/")
                pfd = walker.parent(parts[:-1])
                if pfd is None:
                    todo.append((key, e, False))
                    continue
                present = _check_leaf(store, pfd, parts[-1], out / key, e, overwrite)
                if present is not None:
                    todo.append((key, e, present))
        finally:
            walker.close()
            os.close(root_fd)
    fault("manifest.checkout_checked")
    written: List[Path] = []
    if not todo:
        return written
    root_fd = _open_target(out, create=True)
    assert root_fd is not None
    walker = _Walker(root_fd, out, overwrite=overwrite, create=True)
    try:
        for key, e, present in todo:
            parts = key.split("/")
            pfd = walker.parent(parts[:-1])
            assert pfd is not None
            _write_one(store, pfd, parts[-1], out / key, e, replace=present or overwrite)
            written.append(out / key)
    finally:
        walker.close()
        os.close(root_fd)
    return written


def _open_target(out: Path, *, create: bool) -> Optional[int]:
    """The target directory's fd (the target itself may be a link: the caller named it)."""
    if create:
        try:
            os.makedirs(out, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise InvalidInputError(f"cannot check out into {out}: it (or a parent) is not a directory") from None
    try:
        return os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        if create:
            raise
        return None
    except NotADirectoryError:
        raise InvalidInputError(f"cannot check out into {out}: it (or a parent) is not a directory") from None


def _check_leaf(store: Store, pfd: int, leaf: str, dest: Path, e: Entry, overwrite: bool) -> Optional[bool]:
    """None: ``dest`` already holds the entry; False: nothing there; True: something to replace."""
    try:
        st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        raise InvalidInputError(
            f"{dest} is a directory where the manifest has a file; remove it (checkout never deletes directories)"
        )
    if stat.S_ISREG(st.st_mode):
        size = e.size if e.size is not None else store.objects.stat(e.digest).size
        if st.st_size == size and _same_file(pfd, leaf, e, size):
            return None
        if not overwrite:
            raise InvalidInputError(f"{dest} exists with other content; pass overwrite=True to replace it")
        return True
    if not overwrite:
        raise InvalidInputError(
            f"{dest} is {_describe(pfd, leaf)}; checkout never writes through it. Remove it, or pass "
            "overwrite=True to replace it (the entry itself, inside the target; never what a link points to)"
        )
    return True


def _write_one(store: Store, pfd: int, leaf: str, dest: Path, e: Entry, *, replace: bool) -> None:
    tmp = f".casstore-{os.getpid()}-{os.urandom(6).hex()}.part"  # not from leaf: a segment may be 255 bytes
    fd = os.open(tmp, _CREATE, 0o666, dir_fd=pfd)
    try:
        try:
            _fill(store, e, fd)
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
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=pfd)
        except FileNotFoundError:
            pass
        raise
