"""Folders as snapshots: ``store.add(name, folder)`` and ``store.status(name, folder)``.

A feature (layer 4, docs/design.md): it reads and writes the store only
through ``store.objects``, ``store.root`` and the manifests layer.  See
docs/folders.md for the user's view.

* **The walk** opens every directory with ``O_DIRECTORY | O_NOFOLLOW``
  relative to its parent's fd and every file with ``O_NOFOLLOW`` relative to
  its directory's fd (as manifests/checkout.py does), so a symlink swapped in
  for a directory or file mid-walk is never followed out of the folder.
  Symlinks and special files (FIFOs, sockets, devices) are skipped with a
  warning: opening a FIFO would block on its writer, a device may never end.
* **Keys** are relative POSIX paths and must pass the manifest key rules; a
  file whose name is not a valid key (a newline, a backslash, bytes that are
  not UTF-8) is refused with :class:`InvalidInputError` naming it *before*
  anything is stored or committed -- silently leaving a file out of a
  snapshot would be worse; ``exclude`` leaves it out on purpose.  ``status``
  refuses them the same way (it says what ``add`` would do).
* **Refusals come first**: the name (:func:`_addable_head`: what ``edit`` would
  refuse), the folder being the store or inside it (:func:`_store_id`), and a
  path this user may not read (:func:`_denied`; never skipped: the version would
  delete its files) are reported before anything is stored; an unreadable file
  is found when it is read, before anything is committed.
* **Consistency**: each file is stored by ``put_path``, which hashes the
  staged copy (so the digest names exactly the stored bytes), and the file's
  stat is compared before and after the copy.  A file whose stat changed is
  retried (3 attempts) and then reported (:class:`FileChangedError`); it is
  never stored mixed.  Timestamps are coarse (a kernel tick), so a write in
  the same tick as the previous one can leave the stat unchanged: for a racy
  file (:func:`_racy`) the source is hashed again after the copy and must match.
* **The stat cache** ``<store>/cache/stat/<blake3(folder realpath)[:32]>.msgpack``
  maps a key to (device, inode, size, mtime_ns, ctime_ns, digest), column-wise
  (:class:`_StatCache`); a save that changed a few rows writes them to a ``.patch``
  beside it instead of rewriting it.  An entry is
  used only on an exact match of all five (ctime too: ``utime`` can put mtime
  back, but nothing can set ctime).  It is written by temp file + atomic rename
  (last writer wins, which is safe because entries are exact-stat keyed) and
  read tolerantly: a damaged file or entry is ignored, never trusted.  Racy
  files (:func:`_racy`: stamped in the tick the operation began in, or, where
  another clock stamps them, modified within ``RACY_SECONDS``) are not cached
  (git's "racy clean" problem: a second write in the same timestamp tick would
  leave the stat unchanged and the cached digest wrong).
"""

from __future__ import annotations

import bisect
import errno
import fnmatch
import logging
import os
import stat as stat_mod
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain, starmap
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import msgpack

from ._faults import fault
from ._fs import (
    collector_paused,
    makedirs,
    read_small_file,
    reserve_fds,
    stamp_floor_ns,
    syncfs,
    write_file_atomic,
)
from ._fsprobe import RACY_SECONDS, fine_local_stamps
from ._layout import TMP
from ._paths import key_problem
from ._progress import Progress
from .codecs import RAW
from .digest import Digest, hash_bytes, hash_fd
from .errors import (
    FileChangedError,
    FrozenError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    ManifestNotFoundError,
)
from .manifests import Manifest, check_new_name
from .objects import StagedObject
from .refs import validate_name

if TYPE_CHECKING:
    from .store import Store

__all__ = ["AddResult", "FolderStatus", "Skipped", "add_folder", "folder_status", "RACY_SECONDS", "ATTEMPTS"]

log = logging.getLogger("casstore.folders")

# RACY_SECONDS (core, _fsprobe): a file modified this recently is re-hashed after its copy and never
# stat-cached where timestamps are coarse or come from another clock.
ATTEMPTS = 3
"""Copies of a changing file before :class:`FileChangedError`."""
CACHE_DIR = "cache/stat"
"""Where stat caches live under the store root."""
BATCH_OBJECTS = 512
"""New objects published per filesystem sync by ``add`` (each waits with an open staging file)."""
BATCH_BYTES = 256 << 20
"""Staged bytes per filesystem sync by ``add`` (bounds the tmp space and dirty page cache in flight)."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CACHE_VERSION = 2  # the stat cache's format (2: column-wise rows; see _StatCache)
_MARK_VERSION = 2  # (2: the fingerprint hashes the keys and the packed stat rows, not msgpack of the walk)
_AT = struct.Struct("<I")  # a stat cache patch's row index in its base (the base's keys are not repeated)
_ROW = struct.Struct("<QQQqq")  # a stat cache row: device, inode, size, mtime_ns, ctime_ns
_IDS = struct.Struct("<QQQ")  # (its first three fields)
_UNMATCHABLE = struct.pack("<qq", -2, -2)  # the times of a walked row that cannot be packed
_DIGEST_SIZE = 32
_CACHE_MAX_BYTES = 1 << 30  # a cache bigger than this is garbage, not a cache
_CACHE_ID_SIZE = 16  # a base file's random id, named by the patch that applies to it
_PATCH_SHARE = 16  # a patch holds at most 1/16 of its base's rows (_PATCH_MIN at least); then the base is rewritten
_PATCH_MIN = 64
_FINDS = 256  # stat cache lookups by bisection before the key -> row map is built (~0.5 ms for 10,000 keys)
_MARK_MAX_BYTES = 64 << 10  # a clean mark is a root path, a version, patterns and a fingerprint

StatKey = Tuple[int, int, int, int, int]


@dataclass(frozen=True)
class Skipped:
    """A path left out of a snapshot, and why (a symlink, a FIFO, a socket, a device...)."""

    path: str
    """The relative POSIX path inside the folder."""
    reason: str
    """Why it was left out."""


@dataclass(frozen=True)
class FolderStatus:
    """How a folder differs from a version (keys, sorted)."""

    added: Tuple[str, ...]
    """Files in the folder that the version does not have."""
    modified: Tuple[str, ...]
    """Files whose content differs from the version's."""
    deleted: Tuple[str, ...]
    """Keys of the version missing from the folder."""
    unchanged: Tuple[str, ...]
    """Files equal to the version's."""
    skipped: Tuple[Skipped, ...] = ()
    """Symlinks and special files that ``add`` would leave out."""
    version: Optional[Digest] = None
    """The version compared against (``None``: the name has no version yet)."""
    hashed: int = 0
    """Files whose contents were read (the rest came from the stat cache or differ in size)."""

    def __bool__(self) -> bool:
        """True if anything was added, modified or deleted."""
        return bool(self.added or self.modified or self.deleted)


@dataclass(frozen=True)
class AddResult:
    """What :meth:`Store.add` did."""

    manifest: Manifest
    """The head after the add (the previous head if nothing changed)."""
    created: bool
    """False when the folder equalled the head: no new version was made."""
    added: Tuple[str, ...]
    """Keys new in this version."""
    modified: Tuple[str, ...]
    """Keys whose content changed."""
    deleted: Tuple[str, ...]
    """Keys of the previous head no longer in the folder."""
    skipped: Tuple[Skipped, ...]
    """Symlinks and special files left out (also logged as warnings)."""
    hashed: int
    """Files read and stored (the rest came from the stat cache)."""
    hashed_bytes: int
    """Bytes of the files read."""

    @property
    def digest(self) -> Digest:
        """The version digest of :attr:`manifest`."""
        return self.manifest.digest


class _File(NamedTuple):
    # A NamedTuple, not a frozen dataclass: one is made per file of the walk (3x cheaper to build).
    key: str
    st: StatKey


def _stat_key(st: os.stat_result) -> StatKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _patterns(exclude: Optional[Iterable[str]]) -> Tuple[str, ...]:
    if exclude is None:
        return ()
    if isinstance(exclude, str):
        exclude = (exclude,)
    out = []
    for g in exclude:
        if not isinstance(g, str):
            raise InvalidTypeError(f"exclude patterns are glob strings, not {type(g).__name__}")
        if not g:
            raise InvalidInputError("an exclude pattern is empty")
        try:
            g.encode("utf-8")  # (kept in the stat cache and clean mark, which are UTF-8 msgpack)
        except UnicodeEncodeError:
            raise InvalidInputError(
                f"the exclude pattern {g!r} is not valid UTF-8 (bytes of another encoding, as a command line "
                "passes them); match such names with wildcards instead: '?' for each byte that is not UTF-8, "
                "or '*'") from None
        out.append(g)
    return tuple(out)


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    """``rel`` matches a glob as a whole path or in any one of its segments."""
    if not patterns:
        return False
    segs = rel.split("/")
    return any(fnmatch.fnmatchcase(rel, g) or any(fnmatch.fnmatchcase(s, g) for s in segs) for g in patterns)


_DENIED = (errno.EACCES, errno.EPERM)


class _Unreadable(Exception):
    """A path under the folder that this user may not read (see :func:`_denied`)."""

    def __init__(self, rel: str, what: str) -> None:
        super().__init__(rel, what)
        self.rel = rel
        """The relative POSIX path ("" for the folder itself)."""
        self.what = what
        """What it is, as the user would say it."""


def _denied(folder: Path, e: _Unreadable, done: str) -> InvalidInputError:
    """The typed error for an unreadable path, naming it and what to do.

    Hazard: a subfolder the walk could not open was taken for one "replaced by a non-directory
    during the walk" and left out, so the new version deleted every file under it; an unreadable
    file was a bare ``PermissionError`` naming only its last segment.  Refusing is the only
    safe answer (a version is the folder); leaving it out is the user's call (``exclude``).
    """
    where = folder / e.rel if e.rel else folder
    leave = f" or leave it out with exclude=[...] (the pattern {e.rel!r})" if e.rel else ""
    return InvalidInputError(f"cannot read {str(where)!r}, {e.what}: permission denied; give this user "
                             f"read access to it (chmod, chown){leave}; {done}")


def _open_root(folder: Path) -> int:
    # The folder itself may be a symlink: the user named it.  Nothing under it is followed.
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InvalidInputError(f"no such folder: {folder}") from None
    except NotADirectoryError:
        raise InvalidInputError(f"{folder} is not a directory; add snapshots a folder (put_path stores a file)") \
            from None
    except PermissionError:
        raise _Unreadable("", "the folder itself (or a folder above it that this user may not enter)") from None
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):  # a path no folder can have, a loop of links
            raise InvalidInputError(f"cannot open the folder {str(folder)[:200]!r}: {e.strerror}") from None
        raise


def _special(mode: int) -> str:
    if stat_mod.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat_mod.S_ISSOCK(mode):
        return "a socket"
    if stat_mod.S_ISCHR(mode) or stat_mod.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _scan(fd: int, prefix: str, patterns: Sequence[str], files: List[_File], skipped: List[Skipped],
          avoid: Tuple[int, int]) -> List[str]:
    """Files of one directory into ``files``; return its subdirectory names (not ``avoid``, the store)."""
    subdirs: List[str] = []
    with os.scandir(fd) as it:
        entries = list(it)  # (the walk's results are sorted once, at its end)
    add, new = files.append, tuple.__new__  # (the hot loop of every status: ~3 us per file)
    for e in entries:
        rel = prefix + e.name
        if patterns and _excluded(rel, patterns):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed since listed
            continue
        except PermissionError:  # a folder we may list but not enter (read without execute permission)
            raise _Unreadable(prefix[:-1], "a folder this user may list but not enter (no execute permission)") \
                from None
        mode = st.st_mode
        if mode & 0o170000 == stat_mod.S_IFREG:
            add(new(_File, (rel, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))))
        elif stat_mod.S_ISLNK(mode):
            skipped.append(Skipped(rel, "a symlink (never followed)"))
        elif stat_mod.S_ISDIR(mode):
            if (st.st_dev, st.st_ino) == avoid:  # a store inside the folder: never snapshot it into itself
                skipped.append(Skipped(rel, "the casstore store itself"))
            else:
                subdirs.append(e.name)
        else:
            skipped.append(Skipped(rel, _special(mode)))
    return subdirs


def _walk(root_fd: int, patterns: Sequence[str], avoid: Tuple[int, int]) -> Tuple[List[_File], List[Skipped]]:
    """Every regular file under ``root_fd`` (depth first; one fd open per level, never more)."""
    files: List[_File] = []
    skipped: List[Skipped] = []
    stack: List[Tuple[int, str, List[str]]] = [(root_fd, "", _scan(root_fd, "", patterns, files, skipped, avoid))]
    try:
        while stack:
            fd, prefix, subdirs = stack[-1]
            if not subdirs:
                stack.pop()
                if fd != root_fd:
                    os.close(fd)
                continue
            name = subdirs.pop(0)
            rel = prefix + name
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ENOENT:  # removed since the scan
                    continue
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink or file swapped in since the scan
                    skipped.append(Skipped(rel, "replaced by a non-directory during the walk"))
                    continue
                # Anything else is no reason to leave the folder out: the version would delete its files.
                if e.errno in _DENIED:
                    raise _Unreadable(rel, "a folder this user may not open") from None
                raise
            try:
                subs = _scan(child, rel + "/", patterns, files, skipped, avoid)
            except BaseException:
                os.close(child)
                raise
            stack.append((child, rel + "/", subs))
    finally:
        for fd, _, _ in stack:
            if fd != root_fd:
                os.close(fd)
    files.sort()  # by key (keys are unique, so the stats never decide)
    skipped.sort(key=lambda s: s.path)
    return files, skipped


def _open_file(root_fd: int, key: str) -> int:
    """Open ``key`` under ``root_fd`` without following any symlink on the way."""
    segs = key.split("/")
    fd = root_fd
    try:
        for seg in segs[:-1]:
            nxt = os.open(seg, _DIR, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = nxt
        return os.open(segs[-1], _READ, dir_fd=fd)
    finally:
        if fd != root_fd:
            os.close(fd)


def _store_id(store: Store, folder: Path, real: str, root_fd: int) -> Tuple[int, int]:
    """The store's (device, inode), for the walk to leave out; refuse a folder that is the store or in it.

    Hazard: ``add(name, store.root)`` snapshotted the store into itself (``objects/...``,
    ``store.toml``): the walk only looked for the store among subfolders.  (A store inside the
    folder is left out by the walk: docs/folders.md.)
    """
    st = os.stat(store.root)
    me = os.fstat(root_fd)
    inside = (me.st_dev, me.st_ino) == (st.st_dev, st.st_ino)
    if not inside:
        top = os.path.realpath(store.root)
        inside = real == top or real.startswith(top.rstrip("/") + "/")
    if inside:
        raise InvalidInputError(
            f"{str(folder)!r} is the casstore store at {str(store.root)!r} or a folder inside it; a store is "
            "never snapshotted into itself: give the folder of your files")
    return (st.st_dev, st.st_ino)


def _check_keys(files: Sequence[_File], done: str) -> None:
    bad = [(f.key, p) for f in files for p in (key_problem(f.key),) if p is not None]
    if bad:
        shown = "; ".join(f"{k!r:.120}: {p}" for k, p in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise InvalidInputError(
            f"{len(bad)} file name(s) cannot be manifest keys{more}: {shown}; rename them or leave them out "
            f"with exclude=[...] ({done})"
        )


# -- the stat cache ------------------------------------------------------------


def _cache_path(store: Store, folder: Path) -> Tuple[str, Path]:
    """The folder's real path and this user's stat cache file for it (the clean mark sits beside it).

    Hazard (shared stores): a stat cache vouches for digests without reading a byte, so one planted
    by another member (any member can write ``cache/stat``) named the bytes of another user's
    snapshot.  Each user has a file of their own (the uid is in the name: members adding the same
    folder do not evict each other), and one this user does not own is ignored (``own=True``).
    """
    real = os.path.realpath(folder)
    return real, store.root / CACHE_DIR / f"{hash_bytes(os.fsencode(real)).hex[:32]}.{os.geteuid()}.msgpack"


def _differing_rows(a: bytes, b: bytes, size: int) -> List[int]:
    """The indexes of the rows of ``size`` bytes that differ between ``a`` and ``b`` (of equal length), in order.

    Runs of 16 rows are compared whole first (one ``memcmp`` each), so a folder with 1% of its files
    rewritten compares ~1,000 runs and the rows of the runs that differ, instead of looking up every
    key: 10,000 files in well under 1 ms, instead of 8 ms of lookups.
    """
    out: List[int] = []
    run = 16 * size
    for off in range(0, len(a), run):
        if a[off:off + run] != b[off:off + run]:
            end = min(len(a), off + run)
            out.extend(i // size for i in range(off, end, size) if a[i:i + size] != b[i:i + size])
    return out


class _StatCache:
    """key -> (exact stat, digest) for one folder; optionally "these are exactly version V's entries".

    Stored column-wise (format 2): the sorted keys, one 40-byte row per key
    (``_ROW``: device, inode, size, mtime_ns, ctime_ns) and one 32-byte raw
    digest per key.  Hazard: format 1 (a msgpack map of per-key lists) cost
    15 ms to load and validate and 19 ms to rewrite for 10,000 files, a fixed
    cost on every add or status that read anything -- the bulk of the excess
    over "proportional to what changed" for a 1% change (issue 12).  Rows are
    compared as packed bytes, and a stale or hostile file can only name a wrong
    digest, never an invalid one (the old format's per-entry checks are gone with it).

    A save that changed a few rows of the same keys writes only a **patch** beside the base file
    (``.patch``: those rows with their indexes in the base -- not their keys, which cost every load a
    lookup per row --, the base's random ``id`` and the claim below), until the patch holds
    1/:data:`_PATCH_SHARE` of the base's rows; then the base is rewritten with a new id.  Hazard
    (measured, issue 12): rewriting the 1 MB base after a 1% add of 10,000 files cost 5-8 ms and
    ~700 page faults of copies and packing, plus 256 fresh page-cache pages and the old file's
    discarded blocks, in every such add.  A patch whose ``base`` is not the base's id (the base was
    rewritten meanwhile by another process) is ignored, as is a damaged one: the base alone is
    still true (exact stats), only older, so files are at worst read again.

    ``version``/``patterns``: set only when saved right after the folder was found equal to
    version V (``add`` committed it, or ``status`` found it clean) with every file cached: the
    entries are then exactly the folder's files as walked and their digests exactly V's.  A later
    ``status``/``add`` against V then needs no read of V's entries: a file whose stat still
    matches is unchanged, one with another stat is compared with the digest here, one not here
    is added, one here but not walked is deleted (cost grows with what changed).  A valid patch's
    claim replaces its base's.
    """

    def __init__(self, store: Store, real: str, path: Path, *, load: bool = True) -> None:
        self.path = path
        self.patch_path = path.with_suffix(".patch")
        self.root = _root_field(real)
        self.store = store
        self.keys: List[str] = []  # sorted, as the walk sorts its files (each a str; unique: see _indexed)
        self._pos: Optional[Dict[str, int]] = None  # key -> row, built on first need (see pos)
        self._finds = 0  # lookups by bisection so far (see _find)
        self.rows = b""  # _ROW per key (the base file's)
        self.digests = b""  # 32 raw bytes per key (the base file's)
        self.id: Optional[bytes] = None  # the base file's id (None: an older base, never patched)
        self.over: Dict[int, Tuple[bytes, bytes]] = {}  # row -> (row, raw digest) from the patch (win over the base)
        self.new: Dict[str, Tuple[StatKey, Digest]] = {}  # put since the load (these win over both)
        self.version: Optional[str] = None
        self.patterns: Optional[List[str]] = None
        if load:
            self._load()

    def _load(self) -> None:
        # Tolerant: anything odd means "no cache" (its entries are only ever used on an exact stat match).
        doc = self._doc(self.path)
        if doc is None:
            return
        cols = _columns(doc)
        if cols is None:
            return
        keys, rows, digests = cols
        try:
            "\0".join(keys)  # every key a str (one pass in C; a key of another type is a TypeError)
        except TypeError:
            return
        # Hazard (issue 12): the key -> row map and a Python pass checking each key cost ~1 ms of every
        # 1% add of 10,000 files, whose walk finds exactly these keys.  A key twice is found when the
        # map is built (pos), which only a walk with other keys needs (see vouches).
        self.keys, self.rows, self.digests = keys, rows, digests
        ident = doc.get("id")
        if type(ident) is bytes and len(ident) == _CACHE_ID_SIZE:
            self.id = ident
            patch = self._patch()
            if patch is not None:
                doc = patch
        version, patterns = doc.get("version"), doc.get("patterns")
        if type(version) is str and type(patterns) is list and all(type(g) is str for g in patterns):
            self.version, self.patterns = version, patterns

    def _doc(self, path: Path) -> Optional[Dict[Any, Any]]:
        """The map in ``path`` if it is this user's, of this format and for this folder; else None."""
        raw = read_small_file(path, _CACHE_MAX_BYTES, own=True)  # (never a link followed, a FIFO waited on)
        if raw is None:
            return None
        try:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception:  # noqa: BLE001 - a corrupt cache is no cache
            return None
        if not isinstance(doc, dict) or doc.get("v") != _CACHE_VERSION or doc.get("root") != self.root:
            return None
        return doc

    def _patch(self) -> Optional[Dict[Any, Any]]:
        """The patch of this base, applied to :attr:`over` (its map, for the claim); None if there is none
        that fits (another base's, or damaged: the base alone is then the cache)."""
        doc = self._doc(self.patch_path)
        if doc is None or doc.get("base") != self.id:
            return None
        at, rows, digests = doc.get("at"), doc.get("rows"), doc.get("digests")
        size, dsize = _ROW.size, _DIGEST_SIZE
        if not (type(at) is bytes and type(rows) is bytes and type(digests) is bytes and len(at) % _AT.size == 0):
            return None
        n = len(at) // _AT.size
        if len(rows) != size * n or len(digests) != dsize * n:
            return None
        idx = [i for (i,) in _AT.iter_unpack(at)]
        if any(a >= b for a, b in zip(idx, idx[1:], strict=False)) or (idx and idx[-1] >= len(self.keys)):
            return None  # a row twice (or out of order), or past the base: not a patch of this base
        self.over = {i: (rows[j * size:(j + 1) * size], digests[j * dsize:(j + 1) * dsize]) for j, i in enumerate(idx)}
        return doc

    @property
    def pos(self) -> Dict[str, int]:
        """key -> row, built on first use; a key twice empties the whole cache (see :meth:`_indexed`)."""
        pos = self._pos
        if pos is None:
            pos = dict(zip(self.keys, range(len(self.keys)), strict=True))
            if len(pos) != len(self.keys):  # a key twice: no cache
                self.keys, self.rows, self.digests, self.over, self.id = [], b"", b"", {}, None
                self.version = self.patterns = None
                pos = {}
            self._pos = pos
        return pos

    def _indexed(self) -> bool:
        """Whether the loaded keys are unique (building :attr:`pos`); a cache with a key twice is emptied."""
        n = len(self.keys)
        return len(self.pos) == n

    def _find(self, key: str) -> Optional[int]:
        """The row of ``key`` (None: not cached), without building :attr:`pos` for a few lookups.

        (A bisection of the sorted keys; a hostile file's unsorted keys can only make it miss, and a
        hit is always a row saved for ``key``.)
        """
        pos = self._pos
        if pos is None and self._finds >= _FINDS:
            pos = self.pos  # (many lookups after all: the map pays for itself)
        if pos is not None:
            return pos.get(key)
        self._finds += 1
        keys = self.keys
        i = bisect.bisect_left(keys, key)
        return i if i < len(keys) and keys[i] == key else None

    def __contains__(self, key: str) -> bool:
        return key in self.new or self._find(key) is not None

    def entry(self, key: str) -> Tuple[StatKey, Digest]:
        """The cached stat and digest of ``key`` (which must be cached)."""
        e = self.new.get(key)
        if e is not None:
            return e
        i = self._find(key)
        if i is None:
            raise KeyError(key)
        return self.entry_at(i)

    def entry_at(self, i: int) -> Tuple[StatKey, Digest]:
        """The loaded stat and digest of row ``i`` (the patch's, else the base's)."""
        row, raw = self._at(i)
        return _unpack_row(row, 0), Digest.from_bytes(raw)

    def _at(self, i: int) -> Tuple[bytes, bytes]:
        """Row ``i`` and its raw digest as loaded: the patch's, else the base's."""
        got = self.over.get(i)
        if got is not None:
            return got
        return self.rows[i * _ROW.size:(i + 1) * _ROW.size], self.digests[i * _DIGEST_SIZE:(i + 1) * _DIGEST_SIZE]

    def differing(self, rows: bytes, keys: List[str]) -> Optional[List[int]]:
        """If the walk's keys (``keys``, its stats packed as ``rows``) are exactly the loaded keys, in
        order: the indexes of the files whose stat is not the cached one.  ``None`` otherwise (or once
        rows were put: see :meth:`matches`)."""
        if self.new or keys != self.keys:  # (one comparison in C: the walk's keys are unique and sorted)
            return None
        size = _ROW.size
        idx = [] if rows == self.rows else _differing_rows(rows, self.rows, size)
        if self.over:  # (the patch's rows are newer than the base's)
            at = set(idx)
            for i, (row, _) in self.over.items():
                if rows[i * size:(i + 1) * size] == row:
                    at.discard(i)
                else:
                    at.add(i)
            idx = sorted(at)
        return idx

    def matches(self, files: Sequence[_File], walked: Optional[bytes] = None,
                keys: Optional[List[str]] = None) -> List[bool]:
        """Per file: is it cached with exactly this stat?  (The walk's files in key order, usually.)

        ``walked``: ``files``' stats already packed as rows (:func:`_walk_rows`), and ``keys`` their
        keys, if the caller has them.
        """
        joined = walked if walked is not None else _walk_rows(files)[0]
        idx = self.differing(joined, keys if keys is not None else [f.key for f in files])
        if idx is not None:
            out = [True] * len(files)
            for at in idx:
                out[at] = False
            return out
        new, rows, size, over = self.new, self.rows, _ROW.size, self.over
        find = self._find
        out = []
        for j, f in enumerate(files):
            p = joined[j * size:(j + 1) * size]
            e = new.get(f.key)
            if e is not None:
                out.append(_pack_row(e[0]) == p)
                continue
            i = find(f.key)
            if i is None:
                out.append(False)
            else:
                got = over.get(i)
                out.append((rows[i * size:(i + 1) * size] if got is None else got[0]) == p)
        return out

    def put(self, key: str, st: StatKey, d: Digest) -> None:
        self.new[key] = (st, d)

    def read_stats(self) -> List[StatKey]:
        """The stats put since the load: of the files read since (the others matched a loaded row)."""
        return [st for st, _ in self.new.values()]

    def vouches(self, version: Digest, patterns: Sequence[str], keys: List[str]) -> bool:
        """True if the entries are exactly ``version``'s, for a walk with ``patterns`` that found ``keys``.

        (The loaded keys are checked for a key twice here, unless they are exactly the walk's, which
        are unique: only a valid cache may say which of the version's keys were deleted.)
        """
        if self.version != version.hex or self.patterns != list(patterns):
            return False
        return keys == self.keys or self._indexed()

    def save(self, walked: List[str], gone: AbstractSet[str] = frozenset(), *, floor: int,
             version: Optional[Digest] = None, patterns: Sequence[str] = ()) -> None:
        """Keep the settled entries of the walk's keys ``walked`` (sorted) but ``gone`` (those that went
        away while read); claim ``version`` if every one of them is kept.

        ``floor``: a :func:`stamp_floor_ns` read before the walk (see :func:`_racy`).  With a
        claim, a racy file is kept with its digest (the version's) but mtime and ctime -1: no
        walk ever matches that stat, so the file is read and compared again until a later save
        records it settled (racy clean, as for any entry).  Only entries put since the load are
        checked: a loaded row was settled (or smudged) when it was saved, and time only moves on.
        """
        fresh: Dict[str, Tuple[bytes, bytes]] = {}  # rows put since the load and kept
        for k, (st, d) in self.new.items():
            if k in gone:
                continue
            row = _pack_row(st)
            if _racy(st, floor) or row[-16:] == _UNMATCHABLE:
                if version is None:
                    continue  # (the loaded row, if any, goes too: it is not the file as read)
                row = _pack_row((st[0], st[1], st[2], -1, -1))
            fresh[k] = (row, d.raw)
        keys, find = self.keys, self._find
        # The same keys as loaded: every loaded key still present, and the rows put since are exactly the
        # loaded keys put since (none dropped as racy, none new).  The walk found exactly the loaded keys
        # (one comparison in C) and none went away, or else set operations: never a pass in Python over
        # every key (10,000 keys: 0.9 ms of each add that changed anything).
        present: Optional[Set[str]] = None
        if walked == keys:
            covered = not gone
        else:
            present = set(walked).difference(gone)
            covered = present.issuperset(keys)
        rows_of = {k: find(k) for k in self.new}  # (the few rows put since: no key -> row map for them)
        same = (covered and all(rows_of[k] is not None for k in fresh)
                and sum(1 for i in rows_of.values() if i is not None) == len(fresh))
        if same:
            kept: List[str] = []
            n = len(keys)
        else:
            if present is None:
                present = set(walked).difference(gone)
            kept = [k for k in keys if k in present and k not in self.new]
            n = len(kept) + len(fresh)
        claim = version.hex if version is not None and n == len(walked) - len(gone) else None
        pats = list(patterns) if claim is not None else None
        claimed: Dict[str, Any] = {"version": claim, "patterns": pats} if claim is not None else {}
        if same:
            # The same keys as loaded (the common case): the rows put since go into the patch.
            at_of = {k: i for k, i in rows_of.items() if i is not None and k in fresh}
            if all(self._at(at_of[k]) == got for k, got in fresh.items()) and (claim, pats) == (
                    self.version, self.patterns):
                return  # nothing to write
            over = dict(self.over)
            over.update((at_of[k], got) for k, got in fresh.items())
            if self.id is not None and len(over) <= max(_PATCH_MIN, len(keys) // _PATCH_SHARE):
                at = sorted(over)
                _write_cache(self.store, self.patch_path, {
                    "v": _CACHE_VERSION, "root": self.root, "base": self.id,
                    "at": b"".join(map(_AT.pack, at)),
                    "rows": b"".join([over[i][0] for i in at]), "digests": b"".join([over[i][1] for i in at]),
                    **claimed})
                return
            size, dsize = _ROW.size, _DIGEST_SIZE
            rows, digests = bytearray(self.rows), bytearray(self.digests)
            for i, (row, raw) in over.items():
                rows[i * size:(i + 1) * size] = row
                digests[i * dsize:(i + 1) * dsize] = raw
            out_keys = keys
        else:
            out_keys = sorted(set(kept).union(fresh))
            rows, digests = bytearray(), bytearray()
            pos = self.pos
            for k in out_keys:
                row, raw = fresh.get(k) or self._at(pos[k])
                rows += row
                digests += raw
        # A new base, with a new id: a patch of the old one no longer applies (removed just after).
        _write_cache(self.store, self.path, {"v": _CACHE_VERSION, "root": self.root, "id": os.urandom(_CACHE_ID_SIZE),
                                             "keys": out_keys, "rows": bytes(rows), "digests": bytes(digests),
                                             **claimed})
        try:
            os.unlink(self.patch_path)
        except OSError:  # (none, or a read-only store: a stale patch is ignored anyway)
            pass


def _columns(doc: Mapping[Any, Any]) -> Optional[Tuple[List[Any], bytes, bytes]]:
    """A stat cache base file's keys, rows and digests, if the columns line up; else None.

    (A patch has columns of its own: row indexes, not keys; see :meth:`_StatCache._patch`.)
    """
    keys, rows, digests = doc.get("keys"), doc.get("rows"), doc.get("digests")
    if not (type(keys) is list and type(rows) is bytes and type(digests) is bytes
            and len(rows) == _ROW.size * len(keys) and len(digests) == _DIGEST_SIZE * len(keys)):
        return None
    return keys, rows, digests


def _walk_rows(files: Sequence[_File]) -> Tuple[bytes, bool]:
    """``files``' stats packed as cache rows, in order, and whether every one packed exactly (a
    timestamp past 2262 gets times no row matches: :func:`_pack_row`)."""
    try:
        return b"".join(starmap(_ROW.pack, [f.st for f in files])), True
    except struct.error:  # (rare)
        return b"".join(_pack_row(f.st) for f in files), False


def _pack_row(st: StatKey) -> bytes:
    """A stat as a cache row; one that does not fit (a timestamp past 2262) gets times no cached row has."""
    try:
        return _ROW.pack(*st)
    except struct.error:
        return _IDS.pack(*(v if 0 <= v < 1 << 64 else 0 for v in st[:3])) + _UNMATCHABLE


def _root_field(real: str) -> Union[str, bytes]:
    """A folder's real path as the stat cache and clean mark keep it: a str if it is UTF-8, else its bytes.

    Hazard (found by a bug hunt): a folder whose own path is not UTF-8 (``r\\xe9sultats``, decoded
    with surrogateescape) crashed the cache's save (msgpack packs a str as strict UTF-8), and
    ``add`` saves it after the commit: the version was made, and every add and status of that
    folder then failed "unexpectedly".  Its bytes are the path exactly; a UTF-8 path stays a str,
    so caches written before (and by older versions) still match.
    """
    try:
        real.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(real)
    return real


def _unpack_row(rows: bytes, i: int) -> StatKey:
    dev, ino, size, mtime, ctime = _ROW.unpack_from(rows, i * _ROW.size)
    return (dev, ino, size, mtime, ctime)


def _write_cache(store: Store, path: Path, doc: Mapping[str, Any]) -> None:
    """Write a stat cache or clean mark: temp file + rename, not durable (it is a cache).

    Never raises for a document it cannot pack: ``add`` saves the cache after its commit, and a
    cache that cannot be written must not turn a committed version into an error (see
    :func:`_root_field`); it is only read or compared again next time.
    """
    try:
        data = msgpack.packb(doc, use_bin_type=True)
    except (ValueError, TypeError) as e:  # (UnicodeEncodeError is a ValueError, as msgpack's own are)
        log.warning("%s not written (%s: %s); the folder is read again next time", path, type(e).__name__, e)
        return
    try:
        # (makedirs: in a shared store a new cache/stat copies its setgid parent's group-writable mode;
        # a plain mkdir made it the first user's alone, and every other member lost the cache)
        makedirs(path.parent)
        write_file_atomic(store.root / TMP, path, data, durable=False, mode=0o644)
    except OSError as e:  # a read-only store still answers; it just reads or compares again next time
        log.debug("%s not written: %s", path, e)


# -- the clean mark ------------------------------------------------------------


def _fingerprint(keys: List[str], rows: bytes) -> str:
    """BLAKE3 of every file's key and exact stat, in key order (what a walk saw, in one value).

    ``rows``: their stats packed exactly (:func:`_walk_rows`).  The count, the keys joined by NUL (no
    path holds one) and the fixed-size rows: one value per walk.  Until 2026-12-06 this was msgpack of
    the walk, 3.4 ms of every add and status of 10,000 files; the rows are packed anyway to compare
    with the stat cache, and this costs ~1 ms more.

    Hazard (found by a bug hunt): a key that is not UTF-8 (a file renamed to ``b\\xff``, the count
    unchanged) crashed ``status`` and ``add`` here, before they could refuse it by name: its bytes
    are hashed as they are (surrogateescape).
    """
    joined = "\0".join(keys).encode("utf-8", "surrogateescape")
    return hash_bytes(b"".join([len(keys).to_bytes(8, "little"), joined, b"\0", rows])).hex


class _CleanMark:
    """``<store>/cache/stat/<id>.clean``: "walked with this fingerprint, the folder equals version V".

    Hazard: an unchanged folder still cost a status or re-add one verified read
    per manifest node and a stat-cache load (10,000 files: 0.2 s in-process);
    the mark makes it one walk.  It is the stat cache's promise for the whole
    folder, so it keeps that cache's rules: every file's (device, inode, size,
    mtime_ns, ctime_ns) and the set of keys are in the fingerprint; it is written
    only when the folder was found equal to V with no racy file (:func:`_racy`)
    and none changing while read; it is read tolerantly (any
    oddity is no mark) and names a version digest, so it holds for whichever
    name points there.  Last writer wins (temp file + rename).
    """

    def __init__(self, store: Store, real: str, stat_path: Path) -> None:
        self.path = stat_path.with_suffix(".clean")
        self.root = _root_field(real)
        self.store = store
        # (the walk, its keys, its rows, its fingerprint)
        self._fp: Optional[Tuple[Sequence[_File], List[str], bytes, str]] = None

    def _of(self, files: Sequence[_File]) -> Tuple[List[str], bytes, str]:
        # matches(), keys(), rows() and save() of one add see the same walk: its keys listed, its
        # rows packed and both hashed once.  No fingerprint ("") where a stat did not pack exactly:
        # such a walk is never vouched for.
        got = self._fp
        if got is None or got[0] is not files:
            keys = [f.key for f in files]
            rows, exact = _walk_rows(files)
            got = self._fp = (files, keys, rows, _fingerprint(keys, rows) if exact else "")
        return got[1], got[2], got[3]

    def _fingerprint(self, files: Sequence[_File]) -> str:
        return self._of(files)[2]

    def rows(self, files: Sequence[_File]) -> bytes:
        """The walk's stats as stat-cache rows (packed once for the mark and the cache)."""
        return self._of(files)[1]

    def keys(self, files: Sequence[_File]) -> List[str]:
        """The walk's keys, in its order (listed once for the mark and the cache)."""
        return self._of(files)[0]

    def matches(self, version: Digest, patterns: Sequence[str], files: Sequence[_File]) -> bool:
        """True if the mark says the folder, walked as ``files``, equals ``version``."""
        raw = read_small_file(self.path, _MARK_MAX_BYTES, own=True)
        if raw is None:
            return False
        try:
            doc = msgpack.unpackb(raw, raw=False)
        except Exception:  # noqa: BLE001 - a damaged mark is no mark
            return False
        fp = self._fingerprint(files)
        return (bool(fp) and isinstance(doc, dict) and doc.get("v") == _MARK_VERSION and doc.get("root") == self.root
                and doc.get("version") == version.hex and doc.get("patterns") == list(patterns)
                and doc.get("files") == len(files) and doc.get("fp") == fp)

    def save(self, version: Digest, patterns: Sequence[str], files: Sequence[_File], floor: int,
             read: Iterable[StatKey]) -> None:
        """Record that the folder, walked as ``files`` (after ``floor``), equals ``version`` (unless a file is racy).

        ``read``: the stats of the files this add or status read (:meth:`_StatCache.read_stats`).  Only
        they can be racy: every other file matched a stat cache row, and a row is saved only settled
        (:meth:`_StatCache.save`; time only moves on).  Hazard: the rule applied to every walked file
        was a pass in Python over 10,000 files on each add that changed 1% of them (~2.5 ms here).
        """
        lo = min(floor, time.time_ns() - int(RACY_SECONDS * 1e9))  # (the full rule only for files stamped since)
        if not self._fingerprint(files) or any(_racy(st, floor) for st in read if st[3] >= lo or st[4] >= lo):
            self.drop()  # a write in the same timestamp tick would go unseen (or a stat not packed exactly)
            return
        doc = {"v": _MARK_VERSION, "root": self.root, "version": version.hex, "patterns": list(patterns),
               "files": len(files), "fp": self._fingerprint(files)}
        _write_cache(self.store, self.path, doc)

    def drop(self) -> None:
        """Forget the mark (the folder was seen to differ, or could not be vouched for)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass


# -- hashing -------------------------------------------------------------------


def _racy(st: StatKey, floor: int) -> bool:
    """Could the file change again without its stat changing (git's "racy clean")?

    ``floor``: a :func:`stamp_floor_ns` read before ``st`` was taken.  Where this kernel stamps the
    file in sub-second timestamps (ext4, XFS, btrfs, tmpfs, overlay...: :func:`fine_local_stamps`), a
    change made after the floor gets a stamp at or above it: a file stamped below it is settled at
    once.  Hazard: the rule is only as good as the clock that stamps the file, so on FUSE and
    network filesystems (their daemon's or server's clock), and where timestamps are whole
    seconds, a file modified within ``RACY_SECONDS`` of now is racy instead.  (Before the floor
    rule a file written just before an add was racy for 2 s, and the next add read it again:
    a third of adding 1% of a 10,000-file folder.)
    """
    if fine_local_stamps(st[0], st[4]):
        return st[3] >= floor or st[4] >= floor
    cutoff = time.time_ns() - int(RACY_SECONDS * 1e9)
    return st[3] >= cutoff or st[4] >= cutoff


def _read_one(store: Store, root_fd: int, key: str, keep: bool, hint: bool = True
              ) -> Tuple[Digest, StatKey, int, Optional[StagedObject]]:
    """Stage (``keep``: not yet published) or just hash one file; retried while it changes under us.

    ``hint``: start the staged copy's writeback at once (:meth:`LocalObjects.stage_fd`'s ``writeback``).
    """
    try:
        fd = _open_file(root_fd, key)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):  # replaced by a symlink, or removed
            raise FileNotFoundError(e.errno, f"{key} is gone") from None
        if e.errno in _DENIED:
            raise _Unreadable(key, "a file this user may not read") from None
        raise
    try:
        for attempt in range(ATTEMPTS):
            floor = stamp_floor_ns()  # before the stat: a write during the copy then moves it (see _racy)
            before = os.fstat(fd)
            if not stat_mod.S_ISREG(before.st_mode):  # a FIFO swapped in since the walk (O_NONBLOCK: no hang)
                raise FileNotFoundError(errno.ENOENT, f"{key} is no longer a regular file")
            staged: Optional[StagedObject] = None
            try:
                if keep:
                    # The staged copy is what is hashed (stage_fd), so the digest names exactly the bytes a
                    # publish makes visible; publishing waits for the batch (one syncfs per batch).
                    staged = store.objects.stage_fd(fd, before.st_size, writeback=hint)
                    d = staged.digest
                    fault("folders.staged")
                else:
                    d = hash_fd(fd, before.st_size)
                after = os.fstat(fd)
                st = _stat_key(after)
                if st == _stat_key(before) and (not keep or not _racy(st, floor) or hash_fd(fd, st[2]) == d):
                    return d, st, st[2], staged
            except IntegrityError:  # shrank while hashed
                pass
            except BaseException:
                if staged is not None:
                    staged.staging.abort()
                raise
            if staged is not None:  # changed while copied: throw the copy away and read again
                staged.staging.abort()
            time.sleep(0.01 * (attempt + 1))
        raise FileChangedError(
            f"{key!r} changed every time it was read ({ATTEMPTS} attempts); stop the writer or exclude it "
            "(nothing was committed)"
        )
    finally:
        os.close(fd)


_Read = Tuple[Digest, StatKey, int, Optional[StagedObject]]
"""What :func:`_read_one` gives: digest, stat as read, bytes read, staged object (``keep``)."""

_CHUNK_FILES = 8
_CHUNK_BYTES = 1 << 20
UNHINTED_TAIL = 16 << 20
"""The last bytes an add stages without starting their writeback file by file (see :func:`_digests`)."""


def _chunks(files: Sequence[_File]) -> Iterator[List[_File]]:
    """Files in runs for one pool task each: up to 8 files and about 1 MiB (a task per small file
    cost more in handoffs between threads than reading it; a big file is a run of its own)."""
    run: List[_File] = []
    size = 0
    for f in files:
        run.append(f)
        size += f.st[2]
        if len(run) >= _CHUNK_FILES or size >= _CHUNK_BYTES:
            yield run
            run, size = [], 0
    if run:
        yield run


def _read_chunk(store: Store, root_fd: int, keys: Sequence[str], keep: bool, hint: bool) -> List[Optional[_Read]]:
    """:func:`_read_one` of each key (``None``: gone since the walk); on an error, nothing stays staged."""
    out: List[Optional[_Read]] = []
    try:
        for key in keys:
            try:
                out.append(_read_one(store, root_fd, key, keep, hint))
            except FileNotFoundError:
                out.append(None)
    except BaseException:
        _abort_staged(out)
        raise
    return out


def _abort_staged(reads: Sequence[Optional[_Read]]) -> None:
    for got in reads:
        if got is not None and got[3] is not None:
            got[3].staging.abort()


def _workers() -> int:
    return max(2, min(4, os.cpu_count() or 2))


class _Batcher:
    """Staged objects published in batches: one ``syncfs`` before and one after each (``publish_batch``).

    Hazard: two fsyncs per object made a first add of 2,000 small files take
    6.4 s here.  A batch is bounded in objects (each holds an open staging fd)
    and bytes (staged data waits in ``tmp/`` and the page cache until the
    batch's sync).  An object already in the store, or twice in one batch, is
    not published again (its staged copy is dropped; ``touch`` refreshes the
    existing one for gc's grace period).  Every object of a full batch is published
    and durable before :meth:`add` returns.  The last batch is *held* (:meth:`hold`):
    ``add`` hands it to its commit (``ManifestEditor.publish_with``), which publishes
    it durably in the batch of the version's tree nodes, before the version: one pair
    of ``syncfs`` instead of two (a 1% add of 10,000 files: 7.5 -> 5.9 ms of syncs).  So no version
    ever names an object that a crash could lose, and a crash before it leaves only
    whole objects (and staging files in ``tmp/`` that the sweep removes).
    """

    def __init__(self, store: Store) -> None:
        self.objects = store.objects
        self.root = store.root
        self.record = store.objects.hash_record()  # what was hashed here vouches for link-mode checkouts
        self.items: List[StagedObject] = []
        self.sizes: Dict[Digest, int] = {}
        self.bytes = 0
        self.held: List[StagedObject] = []
        """The last batch, deduped and not yet published (:meth:`hold`)."""
        self.held_sizes: Dict[Digest, int] = {}
        self._head_start: Optional[threading.Thread] = None  # (see hold)

    def add(self, staged: StagedObject, size: int) -> None:
        # The dedupe probe (``touch``) waits for :meth:`flush`: made here, as each file arrives, it
        # waited for the GIL behind the pool threads still hashing (~100 us a probe, 10 ms of a
        # 1% add of 10,000 files); at the flush of the last batch they are done (a 1% add: 7-9 ms less).
        if staged.digest in self.sizes:
            staged.staging.abort()
            return
        self.items.append(staged)
        self.sizes[staged.digest] = size
        self.bytes += size
        if len(self.items) >= BATCH_OBJECTS or self.bytes >= BATCH_BYTES:
            self.flush()

    def _absent(self) -> List[StagedObject]:
        """Take the batch's items, keeping those the store lacks (the others' copies are dropped)."""
        items, self.items = self.items, []
        self.bytes = 0
        new: List[StagedObject] = []
        try:
            while items:
                it = items.pop()
                if self.objects.touch(it.digest):  # already stored: refreshed for gc's grace, copy dropped
                    it.staging.abort()
                else:
                    new.append(it)
        except BaseException:
            for it in new + items:  # (and the one whose probe failed: abort is idempotent)
                it.staging.abort()
            it.staging.abort()
            raise
        return new[::-1]

    def flush(self) -> None:
        items = self._absent()
        self.sizes.clear()
        if items:
            fault("folders.before_batch")
            self.objects.publish_batch(items)  # removes every staging file, published or not
            self._note(items)

    def hold(self) -> None:
        """Keep the last batch for the commit to publish (:attr:`held`, :attr:`held_sizes`).

        A durable store's ``syncfs`` starts here, on a thread of its own, while the commit builds the
        version: a head start only (its outcome is ignored; the commit's batch syncs before any rename,
        as ever), so the writeback of the held files overlaps the tree's rebuild instead of following
        it (a 1% add of 10,000 files: ~15 MB to write back against ~10 ms of commit; the commit's
        publish went from 7.2 to 5.2 ms here).  The thread ends by :meth:`close`.
        """
        items = self._absent()
        self.held.extend(items)
        self.held_sizes.update((it.digest, self.sizes[it.digest]) for it in items)
        self.sizes.clear()
        if items and self.objects.durable and self.objects.syncfs_trusted and self._head_start is None:
            self._head_start = threading.Thread(target=_sync_quietly, args=(self.objects.tmp,),
                                                name="casstore-sync", daemon=True)
            self._head_start.start()

    def _note(self, items: Sequence[StagedObject]) -> None:
        for it in items:
            if it.codec is RAW:
                st = it.staging.published_stat  # (None: not published by this batch)
                if st is not None:
                    self.record.note(it.digest, st)

    def published(self) -> None:
        """The commit published the held batch: vouch for it in the hash record."""
        held, self.held = self.held, []
        self._note(held)

    def abort(self) -> None:
        """Remove the staged copies of the batch being filled (not the held one)."""
        for it in self.items:
            it.staging.abort()
        self.items = []

    def close(self) -> None:
        """Remove whatever of the held batch was not published, save the hash record, and wait for the
        head start of the sync (:meth:`hold`)."""
        held, self.held = self.held, []
        try:
            for it in held:
                it.staging.abort()  # (nothing for a published one)
        finally:
            try:
                self.record.save()
            finally:
                if self._head_start is not None:
                    self._head_start.join()


def _sync_quietly(path: Path) -> None:
    """``syncfs`` of ``path``'s filesystem, errors ignored (a head start: see :meth:`_Batcher.hold`)."""
    try:
        syncfs(path)
    except OSError:
        pass


def _digests(store: Store, root_fd: int, files: Sequence[_File], cache: _StatCache, *,
             batch: Optional[_Batcher], progress: Optional[bool], desc: str,
             need: Optional[Mapping[str, int]] = None) -> Tuple[Dict[str, Digest], int, int, bool]:
    """key -> digest for ``files``: from the cache on an exact stat match, else read (on a pool).

    Also returns the count and bytes of files read, and whether every digest is of the file as
    the walk saw it (no file changed or went away since): only then may a clean mark vouch for it.

    ``batch``: new objects are staged by the pool and published by this thread in batches
    (:class:`_Batcher`); when this returns every one is published and durable but the last
    batch, which is held for the commit (:meth:`_Batcher.hold`).  ``None``: only hashed.
    """
    keep = batch is not None
    out: Dict[str, Digest] = {}
    todo: List[_File] = []
    for f, hit in zip(files, cache.matches(files), strict=True):
        d = cache.entry(f.key)[1] if hit else None
        if d is not None and keep and not store.objects.has(d):
            d = None  # collected since it was cached: store it again
        if d is not None:
            out[f.key] = d
        elif need is not None and f.key in need and need[f.key] != f.st[2]:
            continue  # status: a different size is modified without reading a byte
        else:
            todo.append(f)
    total = sum(f.st[2] for f in todo)
    steady = True
    if not todo:
        return out, 0, 0, steady
    # A bounded window of submitted runs (of up to 8 files): staged objects waiting for this thread
    # (while it syncs a batch) each hold an open fd and tmp space, so they must not pile up without limit.
    window = 3 * _workers()
    with Progress(total, desc=desc, enabled=progress) as bar, ThreadPoolExecutor(
            _workers(), thread_name_prefix="casstore-add") as pool:
        queue = iter(_chunks(todo))
        pending: Dict[Future[List[Optional[_Read]]], List[_File]] = {}
        # Each staged file's writeback is started as it is written (the batch's syncfs then waits for
        # less), except in the last UNHINTED_TAIL bytes: those wait for the held batch's head-start
        # syncfs, which flushes them on its own thread while the commit builds the tree.  Hazard: the
        # hint is a system call per file on the pool's threads, on the add's critical path (a 1% add
        # of 10,000 files, 15 MB in 100 files: file phase 33.8 -> 28.2 ms without it, commit no
        # slower); but a tail too long leaves the commit waiting (5%, 75 MB, no hints: file phase
        # -13 ms, publish +27 ms).
        left = total  # bytes of the files not yet submitted

        def refill() -> None:
            nonlocal left
            while len(pending) < window:
                chunk = next(queue, None)
                if chunk is None:
                    return
                left -= sum(f.st[2] for f in chunk)
                hint = left >= UNHINTED_TAIL
                fut = pool.submit(_read_chunk, store, root_fd, [f.key for f in chunk], keep, hint)
                pending[fut] = chunk
                fut.add_done_callback(finished.put)

        # Finished reads arrive on a queue: ``wait(FIRST_COMPLETED)`` took every pending future's lock
        # and installed a waiter on each, per call, while the pool held the GIL (a 1% add of 10,000
        # files: 5-6 ms less, in-process A/B).
        finished: SimpleQueue[Future[List[Optional[_Read]]]] = SimpleQueue()
        try:
            refill()
            while pending:
                done = [finished.get()]
                while True:
                    try:
                        done.append(finished.get_nowait())
                    except Empty:
                        break
                for fut in done:
                    chunk = pending.pop(fut)
                    for f, got in zip(chunk, fut.result(), strict=True):
                        if got is None:
                            # removed or replaced (by a symlink, a FIFO) since the walk: not in the snapshot
                            log.warning("skipped %s: removed or replaced while the folder was read", f.key)
                            steady = False
                            continue
                        d, st, n, staged = got
                        steady = steady and st == f.st
                        out[f.key] = d
                        cache.put(f.key, st, d)
                        bar.update(n)
                        if staged is not None:
                            assert batch is not None
                            batch.add(staged, n)
                refill()
            if batch is not None:
                batch.hold()
        finally:
            for fut in pending:
                fut.cancel()
            # Staged copies of files still being read when we stopped: never published, always removed.
            for fut in pending:
                if not fut.cancelled():
                    try:
                        _abort_staged(fut.result())
                    except BaseException:  # noqa: BLE001 - already failing: only cleaning up here
                        continue
            if batch is not None:
                batch.abort()
    return out, len(todo), total, steady


# -- the operations ------------------------------------------------------------


def _folder(folder: object) -> Path:
    if not isinstance(folder, (str, os.PathLike)):
        raise InvalidTypeError(f"a folder must be a str or os.PathLike, not {type(folder).__name__}")
    raw = os.fspath(folder)
    if not isinstance(raw, str) or not raw or "\x00" in raw:
        raise InvalidInputError(f"invalid folder {raw!r}")
    try:
        os.fsencode(raw)
    except UnicodeEncodeError:  # (a lone surrogate no file name can hold: no system call could take it)
        raise InvalidInputError(f"invalid folder {raw!r}: it is not valid Unicode (a lone surrogate that no "
                                "file name's bytes decode to); give the folder's path as the system names it") \
            from None
    return Path(os.path.expanduser(raw)).absolute()


def _opened(path: Path, refused: str) -> Tuple[int, int]:
    """The folder's descriptor, and a :func:`stamp_floor_ns` read before its walk's stats (see
    :func:`_racy`); an unreadable folder is refused saying ``refused``."""
    try:
        root_fd = _open_root(path)
    except _Unreadable as e:
        raise _denied(path, e, refused) from None
    return root_fd, stamp_floor_ns()


def _warn(skipped: Sequence[Skipped], folder: Path) -> None:
    for s in skipped:  # (a name from disk may hold an escape sequence: never raw to a terminal)
        log.warning("%s: skipped %s: %s", folder, s.path if s.path.isprintable() else repr(s.path), s.reason)


class _Delta(NamedTuple):
    """A walk against a stat cache that vouches for version V (:meth:`_StatCache.vouches`)."""

    added: List[_File]
    """Files V does not have."""
    changed: List[_File]
    """Files of V whose stat differs: their content must be compared with V's digest."""
    unchanged: List[str]
    """Keys whose stat is exactly the one V's digest was taken with."""
    deleted: List[str]
    """Keys of V not in the folder."""
    was: Dict[str, Tuple[StatKey, Digest]]
    """The cached stat and digest (V's) of each changed file."""


def _delta(files: Sequence[_File], cache: _StatCache, rows: bytes, keys: List[str]) -> _Delta:
    """``files`` (with their stats packed as ``rows`` and their keys listed as ``keys``) against ``cache``."""
    idx = cache.differing(rows, keys)
    if idx is not None:
        # The walk found exactly the cached keys (the common case: files rewritten, none added or
        # deleted): the files whose stat differs are the changed ones, found without a pass in Python
        # over every file (10,000 files: ~2 ms less of a 1% add).
        unchanged: List[str] = []
        prev = 0
        for i in idx:
            unchanged += keys[prev:i]
            prev = i + 1
        unchanged += keys[prev:]
        return _Delta([], [files[i] for i in idx], unchanged, [], {files[i].key: cache.entry_at(i) for i in idx})
    added: List[_File] = []
    changed: List[_File] = []
    unchanged = []
    for f, hit in zip(files, cache.matches(files, rows, keys), strict=True):
        if hit:
            unchanged.append(f.key)
        elif f.key in cache:
            changed.append(f)
        else:
            added.append(f)
    was = {f.key: cache.entry(f.key) for f in changed}
    if not cache.new and len(unchanged) + len(changed) == len(cache.keys):
        return _Delta(added, changed, unchanged, [], was)  # every cached key was walked
    walked = set(keys)
    return _Delta(added, changed, unchanged,
                  sorted(k for k in set(cache.keys).union(cache.new) if k not in walked), was)


@collector_paused()
def add_folder(store: Store, name: str, folder: object, *, message: Optional[str] = None,
               meta: Optional[Mapping[str, Any]] = None, exclude: Optional[Iterable[str]] = None,
               progress: Optional[bool] = None) -> AddResult:
    """Snapshot ``folder`` as one new version of ``name``; see :meth:`casstore.Store.add`."""
    path = _folder(folder)
    if message is not None and not isinstance(message, str):
        raise InvalidTypeError(f"message must be a str, not {type(message).__name__}")
    if meta is not None and not isinstance(meta, Mapping):
        raise InvalidTypeError(f"meta must be a mapping, not {type(meta).__name__}")
    patterns = _patterns(exclude)
    head = _addable_head(store, name)  # before any file is read or stored
    real, cache_path = _cache_path(store, path)
    mark = _CleanMark(store, real, cache_path)
    delta: Optional[_Delta] = None
    verified: Set[str] = set()  # with a delta: changed files found to hold the head's bytes after all
    changed: List[_File] = []  # with a delta: files of the head whose bytes are read and stored anew
    was: Dict[str, Tuple[StatKey, Digest]] = {}  # with a delta: what the cache had for the changed files
    batch = _Batcher(store)  # new objects; its last batch is published by the commit
    try:
        root_fd, floor = _opened(path, "nothing was stored")
        try:
            reserve_fds()  # before the pool holds its staged files open (see reserve_fds)
            files, skipped = _walk(root_fd, patterns, _store_id(store, path, real, root_fd))
            if head is not None and meta is None and mark.matches(head.digest, patterns, files):
                # The folder is the head, file for file: no new version, and nothing to read or lock
                # (a message alone does not make a version; see below).
                _warn(skipped, path)
                return AddResult(manifest=head, created=False, added=(), modified=(), deleted=(),
                                 skipped=tuple(skipped), hashed=0, hashed_bytes=0)
            _warn(skipped, path)
            cache = _StatCache(store, real, cache_path)
            if head is not None and cache.vouches(head.digest, patterns, mark.keys(files)):
                # Only what changed since the head is read, and the head's entries are not listed.
                delta = _delta(files, cache, mark.rows(files), mark.keys(files))
                _check_keys(delta.added, "nothing was stored")  # (the others are the head's keys)
                was = delta.was  # V's (the reads replace them in the cache)
                # A file recorded racy (mtime -1: see _StatCache.save) and of its old size most likely
                # still holds V's bytes: it is hashed first, and copied only if it does not.  (Any other
                # file with a new stat is copied at once: hashing it first would read it twice.)
                same = [f for f in delta.changed
                        if was[f.key][0][3] == -1 and f.st[2] == was[f.key][0][2]]
                scratch = _StatCache(store, real, cache_path, load=False)
                probed, hashed, nbytes, steady = _digests(store, root_fd, same, scratch, batch=None,
                                                          progress=progress, desc="add")
                for f in same:
                    d = probed.get(f.key)
                    if d is not None and d == was[f.key][1]:
                        verified.add(f.key)
                        cache.put(f.key, scratch.entry(f.key)[0], d)  # its stat as read
                changed = [f for f in delta.changed if f.key not in verified]
                digests, n_read, n_bytes, steady_ = _digests(store, root_fd, delta.added + changed, cache,
                                                             batch=batch, progress=progress, desc="add")
                hashed, nbytes, steady = hashed + n_read, nbytes + n_bytes, steady and steady_
            else:
                _check_keys(files, "nothing was stored")  # before anything is stored
                digests, hashed, nbytes, steady = _digests(store, root_fd, files, cache, batch=batch,
                                                           progress=progress, desc="add")
        except _Unreadable as e:  # (from the walk, before anything was stored, or from a read)
            raise _denied(path, e, "nothing was committed") from None
        finally:
            os.close(root_fd)
        fault("folders.before_commit")  # every new object is published and durable by now, but the held batch
        with store.edit(name) as m:
            m.publish_with(batch.held, batch.held_sizes)  # (with the version's nodes, before the version)
            base = m.base
            if delta is not None and base is not None and head is not None and base.digest == head.digest:
                added = tuple(f.key for f in delta.added if f.key in digests)
                modified = tuple(f.key for f in changed if f.key in digests and digests[f.key] != was[f.key][1])
                deleted = tuple(delta.deleted) + tuple(f.key for f in changed if f.key not in digests)
                # (Every other walked key is left as the head has it, and so cached.)
                gone = {f.key for f in delta.added + changed if f.key not in digests}
            else:
                if delta is not None:  # the head moved since we looked: compare with the new one in full
                    digests.update((k, cache.entry(k)[1]) for k in chain(delta.unchanged, verified))
                # One pass over the head's entries (a tree-shaped manifest's random lookups cost more).
                old = {k: e.digest for k, e in base.entries.items()} if base is not None else {}
                added = tuple(k for k in digests if k not in old)
                modified = tuple(k for k, d in digests.items() if k in old and old[k] != d)
                deleted = tuple(k for k in old if k not in digests)
                gone = {f.key for f in files if f.key not in digests}
            for k in added + modified:
                m[k] = digests[k]
            for k in deleted:
                del m[k]
            new_meta: Dict[str, Any] = dict(m.meta)
            new_meta.pop("message", None)
            if meta is not None:
                new_meta.update(meta)
            if message is not None:
                new_meta["message"] = message
            old_meta = {k: v for k, v in m.meta.items() if k != "message"}
            if added or modified or deleted or {k: v for k, v in new_meta.items() if k != "message"} != old_meta \
                    or base is None:
                m.meta.clear()
                m.meta.update(new_meta)
            if base is None and len(gone) == len(files):
                # An empty folder as a new name is still a version: set and drop a placeholder
                # key, which marks the edit changed (it is never looked up, so need not exist).
                m["_"] = hash_bytes(b"")
                del m["_"]
            # else: the same files and metadata: no new version, the head is returned (a message alone
            # does not make one; it describes a change and there is none).
        if m.result is not base:
            batch.published()  # (the held batch went out with the version)
    finally:
        batch.close()  # (whatever of the held batch the commit did not publish is removed)
    result = m.result
    assert result is not None
    whole = steady and not gone  # every file's digest is of the file as walked
    # Hazard (found by a bug hunt): the cache was saved after the commit and its failure (a folder
    # path that is not UTF-8) reported a committed add as failed, on every add.  The version is
    # made: a cache that cannot be saved is only a slower next time, never this add's error.
    try:
        cache.save(mark.keys(files), gone, floor=floor, version=result.digest if whole else None,
                   patterns=patterns)
        if whole:
            mark.save(result.digest, patterns, files, floor, cache.read_stats())
    except Exception as e:  # noqa: BLE001 - committed: nothing after it may fail the add
        log.warning("%s: the stat cache was not saved (%s: %s); the next add or status reads the folder again",
                    path, type(e).__name__, e)
        whole = False
    if not whole:
        mark.drop()
    return AddResult(manifest=result, created=result is not base, added=tuple(sorted(added)),
                     modified=tuple(sorted(modified)), deleted=tuple(sorted(deleted)), skipped=tuple(skipped),
                     hashed=hashed, hashed_bytes=nbytes)


@collector_paused()
def folder_status(store: Store, name: str, folder: object, *, version: Optional[str] = None,
                  exclude: Optional[Iterable[str]] = None, progress: Optional[bool] = None) -> FolderStatus:
    """Compare ``folder`` with a version of ``name``; see :meth:`casstore.Store.status`."""
    path = _folder(folder)
    patterns = _patterns(exclude)
    base: Optional[Manifest]
    try:
        base = store.manifest(version if version is not None else name)
    except ManifestNotFoundError:
        if version is not None:
            raise
        base = None  # nothing added yet: every file is new
    real, cache_path = _cache_path(store, path)
    mark = _CleanMark(store, real, cache_path)
    root_fd, floor = _opened(path, "status cannot compare it")
    try:
        files, skipped = _walk(root_fd, patterns, _store_id(store, path, real, root_fd))
        if base is not None and mark.matches(base.digest, patterns, files):
            # Every file as it was when the folder was last found equal to this version.
            return FolderStatus((), (), (), tuple(f.key for f in files), tuple(skipped), base.digest, 0)
        cache = _StatCache(store, real, cache_path)
        if base is not None and cache.vouches(base.digest, patterns, mark.keys(files)):
            # Cost grows with what changed: only files with a new stat are read, and the version's
            # entries are not listed.  The cache is left as it is (it still vouches for the version).
            delta = _delta(files, cache, mark.rows(files), mark.keys(files))
            _check_keys(delta.added, "add refuses them too")  # (the others are the version's keys)
            need = {f.key: delta.was[f.key][0][2] for f in delta.changed}
            scratch = _StatCache(store, real, cache_path, load=False)
            digests, hashed, _, steady = _digests(store, root_fd, delta.changed, scratch, batch=None,
                                                  progress=progress, desc="status", need=need)
            same = {f.key for f in delta.changed
                    if f.key in digests and digests[f.key] == delta.was[f.key][1]}
            if steady and not delta.added and not delta.deleted and len(same) == len(delta.changed):
                # Clean after all (touched, or racy files read again): record their stats as read, so
                # the next status is one walk again.
                for k in same:
                    cache.put(k, scratch.entry(k)[0], digests[k])
                cache.save(mark.keys(files), floor=floor, version=base.digest, patterns=patterns)
                mark.save(base.digest, patterns, files, floor, cache.read_stats())
            return FolderStatus(tuple(f.key for f in delta.added),
                                tuple(f.key for f in delta.changed if f.key not in same), tuple(delta.deleted),
                                tuple(sorted(delta.unchanged + list(same))), tuple(skipped), base.digest, hashed)
        # One pass over the version's entries (a tree-shaped manifest's random lookups cost more).
        entries = list(base.entries.items()) if base is not None else []
        old = {k: e.digest for k, e in entries}
        sizes = {k: e.size for k, e in entries if e.size is not None}
        # Hazard: a name that is not UTF-8 crashed the stat cache's save (msgpack); status says what add would.
        _check_keys(files, "add refuses them too")
        digests, hashed, _, steady = _digests(store, root_fd, files, cache, batch=None, progress=progress,
                                              desc="status", need=sizes)
    except _Unreadable as e:
        raise _denied(path, e, "status cannot compare it") from None
    finally:
        os.close(root_fd)
    keys = {f.key for f in files}
    added = sorted(k for k in keys if k not in old)
    modified = sorted(k for k in keys if k in old and digests.get(k) != old[k])
    unchanged = sorted(k for k in keys if k in old and digests.get(k) == old[k])
    deleted = sorted(k for k in old if k not in keys)
    clean = base is not None and steady and not (added or modified or deleted)
    walked = [f.key for f in files]
    if clean and base is not None:
        cache.save(walked, floor=floor, version=base.digest, patterns=patterns)
    elif cache.version is None:  # (a cache vouching for another version, the head say, stays as it was)
        cache.save(walked, floor=floor)
    if clean and base is not None:
        mark.save(base.digest, patterns, files, floor, cache.read_stats())
    return FolderStatus(tuple(added), tuple(modified), tuple(deleted), tuple(unchanged), tuple(skipped),
                        base.digest if base is not None else None, hashed)


def _addable_head(store: Store, name: object) -> Optional[Manifest]:
    """``name``'s head (``None``: a new name), or the error the commit's ``edit`` would raise.

    Hazard: an add to a name that can take no version (invalid, ``x~1``, a pin) copied the whole
    folder into the store durably and only then did ``edit`` refuse it.  The same checks as
    ``edit``'s, without its lock: ``edit`` checks again under the lock at the commit (a name
    frozen meanwhile is still refused there).
    """
    checked = validate_name(name)
    if store.refs.get("pins", checked) is not None:
        raise FrozenError(f"{checked!r} is frozen (a pin) and can never change; add to a new name, "
                          f"e.g. store.add({checked + '-v2'!r}, ...); nothing was stored")
    head = store.refs.get("heads", checked)  # a name, not a target: "x~1" is no head to add to
    if head is None:
        check_new_name(checked)
        return None
    try:
        return store.manifest(head)
    except ManifestNotFoundError:
        return None
