"""Objects in a local directory: ``<root>/objects/<2 hex>/<62 hex>[.zst]``.

Invariants (docs/design.md):

1. An object file, once visible under its name, holds exactly the bytes that
   hash to that name: it is staged in ``tmp/`` under a name unique to the
   writer, fsynced, made read-only and renamed into place; then its directory
   is fsynced.  Two writers of the same content both succeed.
4. Correctness of objects never depends on a lock.
7. A verified read never returns bytes that do not hash to the digest asked for.

Everything that touches object files lives here: staging, publishing (one
object or a batch with one ``syncfs``), the dedupe check that refreshes an
object for gc's grace period, adopting a finished file by link, the one
directory scanner and (through :func:`casstore.digest.hash_fd`) the one file
hasher; large verified reads and raw puts hash on a helper thread beside the
I/O (:class:`casstore.digest.HashBeside`).
Codec differences are the :mod:`casstore.codecs` strategy's business.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import logging
import os
import re
import select
import stat as stat_mod
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import (
    IO,
    BinaryIO,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypeVar,
    Union,
)

import msgpack

from .._faults import fault
from .._fs import (
    Staging,
    copy_exact,
    copy_range,
    disk_full,
    fresh_bytes,
    fsync_dir,
    makedirs,
    move_into,
    open_store_dir,
    pread_upto,
    pwrite_all,
    read_reused,
    refuse_links_between,
    run_beside,
    stamp_floor_ns,
    syncfs,
)
from .._fsprobe import mount_of, overlay_upper, settled, syncfs_trusted
from .._layout import BAD, LOCKS, OBJECTS, is_fanout, object_path, object_relpath
from .._lock import FileLock
from ..codecs import CODECS, RAW, ZSTD, Codec, CompressArg, file_sample_pays, normalize_compress, sample_pays
from ..digest import Digest, HashBeside, hash_bytes, hash_fd, new_hasher, parse_prefix
from ..errors import (
    AmbiguousDigestError,
    CompressedObjectError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ObjectNotFoundError,
    ReadOnlyError,
    StoreFormatError,
)
from .base import Buffer, ObjectInfo, ObjectStore
from .reader import ObjectReader, open_object_file
from .upstream import RangedReader, Upstream

__all__ = ["LocalObjects", "Located", "ObjFile", "StagedObject", "HashRecord", "as_buffer", "CHUNK",
           "TRUST_SECONDS", "HASHED_DIR"]

CHUNK = 1 << 20  # streaming chunk: bounded memory, large enough for fast hashing
SAMPLE_MIN = 64 << 10  # bytes of a stream read before its compression sample is taken


def read_chunk(stream: IO[bytes], n: int) -> Buffer:
    """Up to ``n`` bytes from ``stream`` (``b""`` at its end), bytes-like or :class:`InvalidTypeError`.

    Hazard (found by a bug hunt): a non-blocking stream (a pipe inherited with O_NONBLOCK, an event
    loop's socket) returns ``None`` when it has nothing *yet*; taken for its end, a truncated object was
    published under the digest of what had arrived.  ``None`` waits until the descriptor is readable
    (as a blocking read would); a stream without one cannot be waited on and is refused.  A chunk of
    the wrong type after the first (``str``) is the same typed error as a first one.
    """
    while True:
        try:
            chunk = stream.read(n)
        except BlockingIOError:  # (a buffered reader over a non-blocking descriptor may raise instead)
            chunk = None
        if chunk is None:
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):
                raise InvalidInputError(
                    "put_stream(): the stream returned None (non-blocking, no data yet) and has no file "
                    "descriptor to wait on; pass a blocking stream") from None
            select.select([fd], [], [])
            continue
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(f"put_stream() needs a *binary* stream (open the file with 'rb'); its read() "
                                   f"returned {type(chunk).__name__}")
        return chunk
_READ_BUFFER = 256 << 10  # BufferedReader size for open(): see LocalObjects.open
# Below this size a verified read reads then hashes; above it a helper thread
# hashes while the caller's thread reads.  Starting a thread and mapping windows
# cost more than they save on small objects (4 MiB: 6.1 vs 8.4 GB/s here).
OVERLAP_MIN = 16 << 20
# get(): window read before it is handed to the hashing helper.
_GET_WINDOW = 8 << 20
# Raw puts from this size up write while a helper thread hashes (see put_parts).
PUT_OVERLAP_MIN = 1 << 20
_PUT_POOL_MIN = 4 << 20
# Durable large raw puts start the writeback of every window this large as soon
# as it is written (durable put_array of 64 MiB: 93 -> 61 ms here, 4 MiB: 9.1 -> 7.3 ms).
_WRITEBACK_STEP = 8 << 20
_BATCH = 512  # put_many: objects staged per filesystem sync
# stage_fd: below this a source file is read into memory once (hash and write the same buffer).
_STAGE_READ_MAX = 1 << 20
_MODE = 0o444  # objects are read-only for everyone
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PREFETCH_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# An object file name under a fan-out directory: 62 hex digits and a codec suffix.
_BY_SUFFIX: Dict[str, Codec] = {c.suffix: c for c in CODECS}
_OBJ_NAME = re.compile("([0-9a-f]{62})(" + "|".join(re.escape(c.suffix) for c in CODECS if c.suffix) + ")?")
# verify_file's memo: (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) -> hex, oldest first.
_VERIFIED: Dict[Tuple[int, int, int, int, int], str] = {}
_VERIFIED_MAX = 4096
_VERIFIED_LOCK = threading.Lock()


def _memo_key(st: os.stat_result) -> Tuple[int, int, int, int, int]:
    # ctime too: a writer can put mtime back with utime(), but not ctime.
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _memo_hit(key: Tuple[int, int, int, int, int], d: Digest) -> bool:
    return _VERIFIED.get(key) == d.hex


def _memo_add(key: Tuple[int, int, int, int, int], d: Digest) -> None:
    with _VERIFIED_LOCK:  # bounded: the oldest entry goes first
        if len(_VERIFIED) >= _VERIFIED_MAX:
            _VERIFIED.pop(next(iter(_VERIFIED)), None)
        _VERIFIED[key] = d.hex


F = TypeVar("F", bound=Callable[..., object])


def _no_space(fn: F) -> F:
    """Turn ENOSPC/EDQUOT from any step of a write into one DiskFullError naming the store.

    Hazard: a full disk can strike in a zstd stream writer, a copy, an fsync or
    a rename; each staging file is removed by its ``with`` block, so the store
    is left exactly as before the call.
    """
    @functools.wraps(fn)
    def wrapper(self: LocalObjects, *args: object, **kwargs: object) -> object:
        try:
            return fn(self, *args, **kwargs)
        except OSError as e:
            raise disk_full(e, self.root, "storing an object") from None
    return wrapper  # type: ignore[return-value]


def as_buffer(data: object, what: str = "put") -> memoryview:
    """``data`` as a flat byte memoryview (a non-contiguous view is copied); InvalidTypeError otherwise."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        mv = memoryview(data)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())  # a strided view cannot be cast or written in one piece
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    if isinstance(data, str):
        hint = "encode text first (s.encode())"
    elif type(data).__module__ == "numpy":
        hint = "store an array with put_array() (it keeps dtype and shape), or its bytes as memoryview(a)"
    else:
        try:  # another buffer (mmap, array.array): say how, not "encode text" (found by a bug hunt)
            memoryview(data)  # type: ignore[arg-type]
            hint = f"pass memoryview(x) to store this {type(data).__name__}'s bytes"
        except TypeError:
            hint = "use put_path()/put_stream() for files"
    raise InvalidTypeError(f"{what}() takes bytes, bytearray or memoryview, not {type(data).__name__}; {hint}")


@dataclass(frozen=True, slots=True)
class Located:
    """An existing object file: where it is and how it is stored."""

    path: str
    codec: Codec


class _SizeLied(Exception):
    """A file held a different number of bytes than its ``st_size`` said (caller re-reads it as a stream)."""


class StagedObject(NamedTuple):
    """A fully written staging file waiting to be published as ``digest``."""

    staging: Staging
    digest: Digest
    codec: Codec


class ObjFile(NamedTuple):
    """One object file as seen by a directory scan (``lstat`` only)."""

    hex: str
    codec: Codec
    path: str
    size: int
    """Bytes on disk."""
    mtime: float
    atime: float
    mtime_ns: int
    ino: int

    @property
    def digest(self) -> Digest:
        """The object's digest."""
        return Digest(self.hex)


HASHED_DIR = "cache/hashed"
"""Per-user records of object files casstore hashed (:class:`HashRecord`), under the store root."""
TRUST_SECONDS = 3600.0
"""How long a :class:`HashRecord` entry vouches for an unchanged object file (link-mode checkouts)."""
_HASHED_VERSION = 1
_HASHED_MAX = 200_000  # newest entries kept: a record of a million-file add stays a few MB
_HASHED_MAX_BYTES = 64 << 20
_HASHED_APPEND_MAX = 8 << 20  # appended to until this size, then merged and rewritten


class HashRecord:
    """Object files this user's casstore hashed, and when: ``hex -> (dev, ino, size, mtime_ns, ctime_ns, at_ns)``.

    Why: a hard- or symlink checkout must never link corrupt bytes, but
    re-hashing every object it links costs as much as copying (the link itself
    is metadata only).  An object file whose exact stat (ctime included: a
    writer can put mtime back with ``utime``, never ctime) is unchanged since
    casstore hashed it within :data:`TRUST_SECONDS` is vouched for; any other
    is hashed again.  Entries come from ``add`` (the staged copy it hashed and
    then published) and from checkouts that hashed or linked the file (a link
    changes only the inode's ctime; the entry is carried over when nothing else
    changed).

    The file ``<root>/cache/hashed/<uid>.msgpack`` is hostile input: read
    tolerantly (anything odd is no entry), and only if this user owns it -- in
    a shared store another member could otherwise vouch for an object file they
    replaced.  Saved by temp file + rename, merged with what is on disk (newest
    entry per object wins; a lost entry only costs a re-hash).
    """

    def __init__(self, root: Path, tmp: Path) -> None:
        self.path = root / HASHED_DIR / f"{os.geteuid()}.msgpack"
        self.tmp = tmp
        # Read on first lookup: an add only notes entries, and save() merges with the file anyway
        # (reading a record of 10,000 objects twice was a tenth of adding 1% of such a folder).
        self.entries: Dict[str, Tuple[int, int, int, int, int, int]] = {}
        self._loaded = False
        self._noted: Dict[str, Tuple[int, int, int, int, int, int]] = {}  # since the last save
        self._damaged = False  # the file read had a damaged document: rewrite it, do not append to it
        self._dirty = False

    def _load(self) -> None:
        if not self._loaded:
            on_disk = self._read()
            on_disk.update(self.entries)  # what was noted here is newer
            self.entries, self._loaded = on_disk, True

    def _read(self) -> Dict[str, Tuple[int, int, int, int, int, int]]:
        out: Dict[str, Tuple[int, int, int, int, int, int]] = {}
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return out
        try:
            st = os.fstat(fd)
            if not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > _HASHED_MAX_BYTES:
                return out  # not ours (a shared store's other member), or not a record at all
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(_HASHED_MAX_BYTES + 1)
        except OSError:
            return out
        finally:
            os.close(fd)
        # One document, then the documents later saves appended (see save); a damaged one ends the
        # reading: what came before it still counts, what follows is hashed again.
        docs = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(raw) + 1)
        docs.feed(raw)
        self._damaged = True  # until the last document is read whole
        end = 0
        try:
            for doc in docs:
                end = docs.tell()
                ents = doc.get("e") if isinstance(doc, dict) and doc.get("v") == _HASHED_VERSION else None
                if not isinstance(ents, dict):
                    return out
                for k, v in ents.items():
                    # (spelled out: a generator per entry was most of reading a record of 10,000 objects)
                    if (type(k) is str and len(k) == 64 and type(v) is list and len(v) == 6 and type(v[0]) is int
                            and type(v[1]) is int and type(v[2]) is int and type(v[3]) is int
                            and type(v[4]) is int and type(v[5]) is int):
                        e = out.get(k)
                        if e is None or e[5] <= v[5]:  # the newest entry per object wins
                            out[k] = (v[0], v[1], v[2], v[3], v[4], v[5])
        except Exception:  # noqa: BLE001 - a damaged tail is no more entries
            return out
        self._damaged = end != len(raw)  # (a document cut off by a crash is not read)
        return out

    def trusted(self, d: Digest, st: os.stat_result, *, max_age: float = TRUST_SECONDS) -> bool:
        """Did casstore hash this very file (same dev, inode, size, mtime_ns, ctime_ns) within ``max_age``?"""
        self._load()
        e = self.entries.get(d.hex)
        return (e is not None and e[:5] == _memo_key(st)
                and time.time_ns() - e[5] <= int(max_age * 1e9))

    def note(self, d: Digest, st: os.stat_result, at_ns: Optional[int] = None) -> None:
        """Record that the object file with stat ``st`` hashed to ``d`` at ``at_ns`` (default: now)."""
        e = (*_memo_key(st), time.time_ns() if at_ns is None else at_ns)
        self.entries[d.hex] = e
        self._noted[d.hex] = e
        self._dirty = True

    def carry(self, d: Digest, before: os.stat_result, after: os.stat_result) -> None:
        """Our own link changed the file's ctime: keep its entry if nothing but ctime changed."""
        self._load()
        e = self.entries.get(d.hex)
        if e is not None and e[:5] == _memo_key(before) and _memo_key(after)[:4] == e[:4]:
            self.note(d, after, e[5])

    def save(self) -> None:
        """Append what was noted to the record, or merge and rewrite it when it grew large
        (not durably: it is a cache); errors are ignored.

        Hazard: rewriting a record of 10,000 objects after every add of a few files cost more
        than those files.  Appends are one ``write`` to an ``O_APPEND`` descriptor, which
        concurrent savers cannot interleave; one that lands in a file a rewrite just replaced is
        lost, which only costs a re-hash.
        """
        if not self._dirty:
            return
        if self._noted and not self._damaged and self._append():
            self._noted.clear()
            self._dirty = False
            return
        merged = self._read()
        for k, v in self.entries.items():
            if k not in merged or merged[k][5] <= v[5]:
                merged[k] = v
        cutoff = time.time_ns() - int(TRUST_SECONDS * 1e9)
        keep = [(k, v) for k, v in merged.items() if v[5] >= cutoff]
        if len(keep) > _HASHED_MAX:  # the newest entries win
            keep = sorted(keep, key=lambda kv: -kv[1][5])[:_HASHED_MAX]
        doc = {"v": _HASHED_VERSION, "e": {k: list(v) for k, v in keep}}
        try:
            makedirs(self.path.parent)
            with Staging(self.tmp, "hashed") as st:
                st.write(msgpack.packb(doc, use_bin_type=True))
                st.commit(self.path, durable=False, mode=0o600)
            self._noted.clear()
            self._dirty = False
        except OSError:  # a read-only store still checks out; it just hashes again next time
            pass

    def _append(self) -> bool:
        """Append the noted entries as one more document; False when the record must be rewritten."""
        data = msgpack.packb({"v": _HASHED_VERSION, "e": {k: list(v) for k, v in self._noted.items()}},
                             use_bin_type=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return False  # none yet (or not a file we may write): written whole
        try:
            st = os.fstat(fd)
            if (not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                    or st.st_size + len(data) > _HASHED_APPEND_MAX):
                return False  # not ours, or large enough to be merged (stale entries dropped)
            return os.write(fd, data) == len(data)  # a short write (disk full): rewritten whole
        except OSError:
            return False
        finally:
            os.close(fd)


log = logging.getLogger("casstore.objects")

FETCH_WORKERS = 8
"""Parallel downloads of :meth:`LocalObjects.fetch_many` (network I/O: more than the CPU count)."""

FETCH_WAIT = 120.0
"""Seconds a read waits for another process's download of the same object before downloading it too."""


class LocalObjects(ObjectStore):
    """The objects of a store rooted at a local directory (see the module docstring)."""

    def __init__(self, root: Path, tmp: Path, *, durable: bool, level: int,
                 compress: CompressArg = None) -> None:
        self.root = root
        """The store root (objects live under ``root/objects``)."""
        self._root_s = str(root)
        self.tmp = tmp
        """The staging directory (same filesystem: publishing is a rename)."""
        self.durable = durable
        """fsync data and directory entries before a write returns."""
        self.level = level
        """The zstd level ``compress=True`` means."""
        self.compress: CompressArg = compress
        """Default ``compress=`` for puts."""
        self._writable = os.access(tmp, os.W_OK)
        self._syncfs_ok: Optional[bool] = None
        self._overlay: Optional[Tuple[str, str]] = None  # (mount, upperdir) or ("", "")
        self.upstream: Optional[Upstream] = None
        """Where missing objects are fetched from on first read (read-through; ``None``: nowhere)."""

    # -- capabilities --

    @property
    def local_paths(self) -> bool:
        """Raw objects are local files."""
        return True

    @property
    def writable(self) -> bool:
        """False on a read-only mount or a store this user may not write."""
        return self._writable

    # -- locating --

    def _path_s(self, d: Digest, codec: Codec) -> str:
        # Strings, not Paths: reads, dedupe probes and presence checks run this per object
        # (a pathlib join cost more than the system call it names: 19 against 6 us per probe).
        return f"{self._root_s}/{object_relpath(d, codec)}"

    def _find(self, d: Digest) -> Optional[Located]:
        for codec in CODECS:
            p = self._path_s(d, codec)
            try:
                os.lstat(p)
            except OSError:  # missing (or ENOTDIR, EACCES: as os.path.lexists says, not here)
                continue
            return Located(p, codec)
        return None

    def locate(self, d: Digest) -> Located:
        """Where an existing object is (raw preferred); :class:`ObjectNotFoundError` otherwise.

        With an :attr:`upstream`, a missing object is fetched first (verified;
        once across the processes that miss it together: :meth:`fetch`).
        """
        loc = self._find(d)
        if loc is None and self.upstream is not None:
            self.fetch(d)
            loc = self._find(d)
        if loc is None:
            raise self._missing(d)
        return loc

    def _missing(self, d: Digest) -> ObjectNotFoundError:
        if self.upstream is not None:
            return ObjectNotFoundError(
                f"object {d} is neither in the store at {self.root} nor on its upstream {self.upstream.describe()}"
            )
        return ObjectNotFoundError(
            f"object {d} is not in the store at {self.root}; put it first or fetch it from a remote"
        )

    def fetch(self, d: Digest) -> bool:
        """Bring a missing object home from the :attr:`upstream`; False if it was here already.

        Under the lock of the object's fan-out (``locks/fetch/<2 hex>.lock``):
        presence is re-checked there, so of many processes (or threads) that
        miss the same object at once, one downloads and the others find it
        (objects/upstream.py).  :class:`ObjectNotFoundError` if the upstream
        lacks it too; :class:`IntegrityError` (nothing kept) if its bytes are wrong.
        """
        return self._fetch(d, False)[0]

    def _fetch(self, d: Digest, want_bytes: bool) -> Tuple[bool, Optional[bytes]]:
        """:meth:`fetch`; with ``want_bytes``, also the verified bytes when the upstream returned them."""
        up = self.upstream
        if up is None:
            raise self._missing(d)
        if self._find(d) is not None:
            return False, None
        # No heartbeat thread: starting and joining one per object cost more than the GET of a 64 KiB
        # object on a loaded machine.  The lock only saves duplicate downloads (publishing is
        # create-only), so a waiter that sees no end after FETCH_WAIT seconds (a stopped holder, a
        # huge object) downloads the object itself instead of failing.
        lock: Optional[FileLock] = FileLock(self.root / LOCKS / "fetch" / f"{d.hex[:2]}.lock", timeout=FETCH_WAIT,
                                            what=f"fetching object {d} from the upstream")
        try:
            assert lock is not None
            lock.acquire()
        except LockTimeout:
            lock = None
        try:
            if self._find(d) is not None:
                return False, None  # another reader brought it while we waited
            try:
                if want_bytes:
                    return True, up.fetch_read(d, self)
                up.fetch_into(d, self)
            except ObjectNotFoundError:
                raise self._missing(d) from None
        finally:
            if lock is not None:
                lock.release()
        return True, None

    def fetch_many(self, digests: Iterable[Digest], *, workers: int = FETCH_WORKERS) -> int:
        """:meth:`fetch` each missing object of ``digests`` from the upstream, ``workers`` at a time.

        Returns how many were downloaded here.  The first failure is raised
        (objects already fetched stay: each is verified and complete).
        """
        todo = sorted({d for d in digests if self._find(d) is None})
        if not todo:
            return 0
        if len(todo) == 1 or workers <= 1:
            return sum(self.fetch(d) for d in todo)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(workers, len(todo)), thread_name_prefix="casstore-fetch") as ex:
            return sum(ex.map(self.fetch, todo))

    def has(self, digest: Digest) -> bool:
        """Is the object present (in any codec)?"""
        return self._find(digest) is not None  # (a checkout of 10,000 files asks 10,000 times)

    def touch(self, d: Digest) -> bool:
        """Dedupe check for puts: True if the object exists, refreshing its mtime.

        A re-put object is "fresh" again, so GC's grace period protects it
        while the writer goes on to reference it (docs/maintenance.md).  One
        ``utime`` replaces the ``stat``; a file GC removed meanwhile gives
        False and the caller writes a new copy.  Another user's object in a
        shared store cannot be refreshed (EPERM); it still counts as present.
        """
        layered = bool(self._overlay_upper()[1])
        for codec in CODECS:
            p = self._path_s(d, codec)  # (a commit probes every new tree node: ~310 for a 1% re-add)
            if layered and self._on_lower_layer(Path(p)):
                return True  # present, and gc cannot delete a lower-layer file anyway: no refresh needed
            try:
                os.utime(p, follow_symlinks=False)
                return True
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError:  # EPERM/EACCES (not ours), EROFS: exists, cannot refresh
                if os.path.lexists(p):
                    return True
        return False

    def _overlay_upper(self) -> Tuple[str, str]:
        """(mount point, upper directory) of the overlayfs the store is on, or ``("", "")`` (cached)."""
        ov = self._overlay
        if ov is None:
            try:
                ov = self._overlay = overlay_upper(os.stat(self.root).st_dev) or ("", "")
            except OSError:
                ov = self._overlay = ("", "")
        return ov

    def _on_lower_layer(self, p: Path) -> bool:
        """Is ``p`` an existing file on a read-only overlayfs lower layer (not copied up)?

        Refreshing its mtime would copy the whole object into the upper
        layer (issue 17: 256 MiB per re-put of an image-baked object).
        """
        mount, upper = self._overlay_upper()
        if not upper:
            return False
        try:
            rel = os.path.relpath(os.path.realpath(p), mount)
        except ValueError:
            return False
        if rel.startswith(".."):
            return False
        return os.path.lexists(p) and not os.path.lexists(os.path.join(upper, rel))

    def stat(self, digest: Digest) -> ObjectInfo:
        """Size, stored size and codec of an object, without reading its content."""
        loc = self.locate(digest)
        fd, st = open_object_file(loc.path, digest)
        try:
            return ObjectInfo(digest, self._size(fd, st.st_size, loc, digest), st.st_size, loc.codec.name)
        finally:
            os.close(fd)

    def _size(self, fd: int, file_size: int, loc: Located, d: Digest) -> int:
        size = loc.codec.size_of(fd, file_size)
        if size is None:
            raise IntegrityError(
                f"{loc.codec.name} object {d} records no size: truncated or damaged ({loc.path}); "
                "run `casstore verify --repair`"
            )
        return size

    # -- writing --

    def level_for(self, compress: CompressArg) -> Optional[int]:
        """The zstd level a put with ``compress`` uses, or ``None`` for raw."""
        return normalize_compress(self.compress if compress is None else compress, self.level)

    def stage(self, kind: str = "obj") -> Staging:
        """A new staging file in ``tmp/``; :class:`ReadOnlyError` where the store cannot be written."""
        try:
            return Staging(self.tmp, kind)
        except OSError as e:
            if isinstance(e, PermissionError) or e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ReadOnlyError(
                    f"store {self.root} is read-only ({e.strerror}); open a writable store to put objects"
                ) from None
            raise

    def publish(self, st: Staging, d: Digest, codec: Codec, *, synced: bool = False,
                durable: Optional[bool] = None, sync_dir: bool = True) -> None:
        """Make a fully written staging file the object ``d`` (stored with ``codec``) by rename."""
        st.commit(self._path_s(d, codec), durable=self.durable if durable is None else durable, mode=_MODE,
                  synced=synced, sync_dir=sync_dir)

    @property
    def syncfs_trusted(self) -> bool:
        """Does one ``syncfs`` on ``tmp/`` make a batch durable?  (``_fsprobe.syncfs_trusted``; cached.)"""
        got = self._syncfs_ok
        if got is None:
            try:
                fstype = mount_of(os.stat(self.tmp).st_dev)[0]
            except OSError:
                fstype = "?"
            got = self._syncfs_ok = syncfs_trusted(fstype)
        return got

    @_no_space
    def publish_batch(self, items: Sequence[StagedObject]) -> None:
        """Publish many staged objects with one ``syncfs`` before and one after (durable stores).

        Every item's staging file is removed whatever happens; an item that
        was not published when an error stops the batch leaves no object.
        """
        try:
            if self.durable and items and not self.syncfs_trusted:
                # FUSE / network filesystem: syncfs never reaches the daemon or server (issue 17),
                # so each object pays its own fsync of file and directory.
                for it in items:
                    self.publish(it.staging, it.digest, it.codec, durable=True)
                return
            if self.durable and items:
                syncfs(self.tmp)
            checked: Set[str] = set()  # fan-out directories refused links once for the whole batch
            for it in items:
                dest = self._path_s(it.digest, it.codec)
                parent = os.path.dirname(dest)
                if parent not in checked:
                    refuse_links_between(parent, self._root_s)
                    checked.add(parent)
                it.staging.commit(dest, durable=False, mode=_MODE, links_checked=True)
            if self.durable and items:
                syncfs(self.tmp)
        finally:
            for it in items:
                it.staging.abort()

    @_no_space
    def write(self, digest: Digest, data: Buffer) -> bool:
        """Create the object from its bytes (checked against ``digest``); ``False`` if present."""
        mv = as_buffer(data, "write")
        got = hash_bytes(mv)
        if got != digest:
            raise IntegrityError(f"refusing to store bytes hashing to {got} as object {digest}")
        if self.touch(digest):
            return False
        self._write_buffer(digest, mv, self.level_for(None), durable=self.durable)
        return True

    @_no_space
    def put(self, data: Buffer, *, compress: CompressArg = None) -> Digest:
        """Store ``data``; return its digest.  Idempotent: same bytes, same digest, one object."""
        return self.put_parts([as_buffer(data)], compress=compress)

    @_no_space
    def put_parts(self, parts: Iterable[Buffer], *, compress: CompressArg = None) -> Digest:
        """Store the concatenation of ``parts`` without concatenating them in memory.

        Large raw puts write the parts to the staging file while a helper
        thread hashes the same buffers (:class:`~casstore.digest.HashBeside`),
        then check for an existing copy (dedupe) before the one fsync.
        """
        mvs = [as_buffer(p, "put_parts") for p in parts]
        total = sum(len(m) for m in mvs)
        level = self.level_for(compress)
        packed = level is not None and total > 0 and sample_pays(max(mvs, key=len))
        if total >= PUT_OVERLAP_MIN and not packed:
            return self._put_raw_overlapped(mvs)
        h = new_hasher(threaded=total >= (1 << 20))
        for m in mvs:
            h.update(m)
        d = Digest(h.hexdigest())
        if self.touch(d):
            return d
        with self.stage() as st:
            if packed:
                assert level is not None
                st.write(ZSTD.encode(mvs[0] if len(mvs) == 1 else memoryview(b"".join(mvs)), level))
                self.publish(st, d, ZSTD)
                return d
            for m in mvs:
                st.write(m)
            self.publish(st, d, RAW)
        return d

    def _put_raw_overlapped(self, mvs: Sequence[memoryview]) -> Digest:
        # Hash (CPU, GIL released) and write (a copy into the page cache) overlap.
        # The dedupe check comes after both, but before the fsync: re-putting an
        # existing object costs a page-cache write that is thrown away, never a sync.
        total = sum(len(m) for m in mvs)
        durable = self.durable
        with self.stage() as st:
            # Durable: reserve the extents first (np.save does too; 64 MiB fsynced writes ran
            # 17.9 -> 12.3 ms), and hash big parts on blake3's pool, which spreads the hash over
            # both cores where it is slower than the write (the CPU's slow phases here).
            # Non-durable, both lost: the write into extents reserved beyond the end of the file
            # and the pool's threads competing with the write for the two cores ran 0.65-0.73x of
            # np.save, against 0.81-0.85x for a plain write beside one hashing thread (2026-12-03,
            # 50 x 4 MiB, 15 interleaved rounds, three runs).
            if durable:
                st.preallocate(total)
            with HashBeside(threaded=durable and total >= _PUT_POOL_MIN) as hasher:
                for m in mvs:
                    hasher.feed(m)
                if durable:
                    self._write_flushing(st, mvs)
                else:
                    for m in mvs:
                        st.write(m)
                d = hasher.digest()
            if self.touch(d):
                return d
            self.publish(st, d, RAW)
        return d

    @staticmethod
    def _write_flushing(st: Staging, mvs: Sequence[memoryview]) -> None:
        # Durable: start each window's writeback as soon as it is written, so the
        # disk flushes while the rest is written and hashed; the one fsync after
        # the dedupe check then waits only for the tail (a duplicate's early
        # writeback is wasted disk work, never latency).
        # Only whole pages before the write position are started: a page under
        # writeback that is written again may have to wait for it (stable pages).
        off = flushed = 0
        for m in mvs:
            for i in range(0, len(m), _WRITEBACK_STEP):
                off += st.write(m[i:i + _WRITEBACK_STEP])
                upto = off & ~0xFFF
                if upto - flushed >= _WRITEBACK_STEP // 2:
                    st.start_writeback(flushed, upto - flushed)
                    flushed = upto

    def _encode(self, mv: memoryview, level: Optional[int]) -> Tuple[Buffer, Codec]:
        if level is not None and sample_pays(mv):
            return ZSTD.encode(mv, level), ZSTD
        return mv, RAW

    @_no_space
    def stage_bytes(self, d: Digest, data: Buffer, level: Optional[int]) -> StagedObject:
        """Encode ``data`` (already known to hash to ``d``) into a staging file, not yet published.

        The caller publishes it (:meth:`publish` or :meth:`publish_batch`) or
        aborts its staging file.
        """
        payload, codec = self._encode(as_buffer(data, "stage_bytes"), level)
        st = self.stage()
        try:
            st.write(payload)
        except BaseException:
            st.abort()
            raise
        return StagedObject(st, d, codec)

    def _write_buffer(self, d: Digest, mv: memoryview, level: Optional[int], *, durable: bool) -> None:
        payload, codec = self._encode(mv, level)
        with self.stage() as st:
            st.write(payload)
            self.publish(st, d, codec, durable=durable)

    @_no_space
    def put_many(self, items: Iterable[Buffer], *, compress: CompressArg = None,
                 first: Sequence[StagedObject] = ()) -> List[Digest]:
        """Store many small objects; durable with one filesystem sync per batch (see :meth:`publish_batch`).

        ``first``: objects staged by the caller (:meth:`stage_fd`, not yet published, known to be
        absent) published in the first batch, before ``items``: a commit publishes a folder's last
        files with its tree nodes under one pair of syncs.  Their staging files are removed
        whatever happens, as :meth:`publish_batch` does.
        """
        out: List[Digest] = []

        def hashed() -> Iterator[Tuple[Digest, memoryview]]:
            for item in items:
                mv = as_buffer(item, "put_many")
                d = hash_bytes(mv)
                out.append(d)
                yield d, mv

        self._store_batched(hashed(), self.level_for(compress), first)
        return out

    @_no_space
    def write_many(self, items: Iterable[Tuple[Digest, Buffer]]) -> int:
        """Batch form of :meth:`write` (one filesystem sync per batch); how many objects were created."""

        def checked() -> Iterator[Tuple[Digest, memoryview]]:
            for d, data in items:
                mv = as_buffer(data, "write_many")
                got = hash_bytes(mv)
                if got != d:
                    raise IntegrityError(f"refusing to store bytes hashing to {got} as object {d}")
                yield d, mv

        return self._store_batched(checked(), self.level_for(None))

    def _store_batched(self, items: Iterable[Tuple[Digest, memoryview]], level: Optional[int],
                       first: Sequence[StagedObject] = ()) -> int:
        """Stage hashed items, publishing each batch with :meth:`publish_batch`; returns how many were new."""
        pending: List[StagedObject] = list(first)
        seen: set[Digest] = {it.digest for it in first}
        created = 0
        try:
            for d, mv in items:
                if d in seen or self.touch(d):
                    continue
                seen.add(d)
                payload, codec = self._encode(mv, level)
                st = self.stage()
                pending.append(StagedObject(st, d, codec))
                st.write(payload)
                created += 1
                if len(pending) >= _BATCH:
                    batch, pending = pending, []
                    seen.clear()
                    self.publish_batch(batch)
            batch, pending = pending, []
            self.publish_batch(batch)
        finally:
            for it in pending:
                it.staging.abort()
        return created

    @_no_space
    def put_path(self, path: Union[str, os.PathLike[str]], *, compress: CompressArg = None) -> Digest:
        """Store a file of any size by streaming it; return its digest.

        Raw: the file is copied in the kernel (``copy_file_range``) into a
        staging file, then the *staged copy* is hashed while a helper thread
        fsyncs it -- so the digest names exactly the bytes published even if
        the source changes meanwhile.  Compressed: read in 1 MiB chunks, each
        hashed and fed to zstd.  Special files (FIFOs, devices, procfs files
        whose size lies) are read to their end as streams.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidTypeError(f"put_path() takes a file path, not {type(path).__name__}")
        p = os.fspath(path)
        try:
            src = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"no such file to put: {p}") from None
        except IsADirectoryError:
            raise InvalidTypeError(f"{p} is a directory; put_path stores one regular file") from None
        try:
            fst = os.fstat(src)
            if stat_mod.S_ISDIR(fst.st_mode):  # os.open() of a directory succeeds on Linux
                raise InvalidTypeError(f"{p} is a directory; put_path stores one regular file")
            os.set_blocking(src, True)
            size = fst.st_size
            fault("objects.put_path.sized")
            if stat_mod.S_ISCHR(fst.st_mode):
                # Hazard: /dev/zero and /dev/urandom never end (a put would fill the disk).
                raise InvalidInputError(
                    f"{p} is a character device; put_path stores files and pipes: read a device "
                    "with put_stream() and a bound of your own"
                )
            if stat_mod.S_ISFIFO(fst.st_mode):
                # Opened non-blocking, a FIFO reads as empty until its writer arrives:
                # reopen it blocking (the caller named the pipe; its writer is theirs).
                fifo = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                os.close(src)
                src = fifo
            # A pipe (the caller named it: its writer is theirs), or a regular file
            # whose st_size is 0 but may still hold data (procfs): stream it to its
            # end instead of trusting the size.
            if not stat_mod.S_ISREG(fst.st_mode) or size == 0:
                with io.FileIO(src, "rb", closefd=False) as f:
                    return self.put_stream(f, compress=compress)
            level = self.level_for(compress)
            with io.FileIO(src, "rb", closefd=False) as f:
                if level is not None and file_sample_pays(src, size):
                    try:
                        return self._put_stream_compressed(f, level, size_hint=size)
                    except _SizeLied:
                        pass
                else:
                    d = self._put_fd_raw(src, size)
                    if d is not None:
                        return d
                # st_size lied (sysfs reports 4096 for a few bytes) or the file
                # shrank while it was read: start again and store exactly what a
                # read to the end gives.
                f.seek(0)
                return self.put_stream(f, compress=compress)
        finally:
            os.close(src)

    def _put_fd_raw(self, src: int, size: int) -> Optional[Digest]:
        """The in-kernel copy; ``None`` when the file held fewer than ``size`` bytes."""
        with self.stage() as st:
            if copy_range(src, st.fd, size) != size:
                return None
            # A file that grew while it was copied: store exactly what was read
            # (the staged copy, which is what gets hashed).
            if os.pread(src, 1, size):
                size += _copy_to_end(src, st.fd, size)
            fsync = run_beside(lambda: os.fsync(st.fd), "casstore-fsync") if self.durable else None
            try:
                # fsync (I/O wait) overlaps with hashing (CPU): blake3 drops the GIL.
                d = hash_fd(st.fd, size)
            finally:
                if fsync is not None:
                    fsync.join()
            if self.touch(d):
                return d
            self.publish(st, d, RAW, synced=fsync is not None)
            return d

    @_no_space
    def put_stream(self, stream: IO[bytes], *, compress: CompressArg = None) -> Digest:
        """Store everything readable from a binary stream; return its digest.

        A non-blocking stream's ``None`` ("no data yet") is waited on, as a blocking read would be
        (:func:`read_chunk`); with compression, the sample that decides is at least
        :data:`SAMPLE_MIN` bytes of the stream (or all of it).
        """
        if not hasattr(stream, "read"):
            raise InvalidTypeError(f"put_stream() needs a readable binary stream, not {type(stream).__name__}")
        level = self.level_for(compress)
        first: Buffer = read_chunk(stream, CHUNK)
        if level is not None and first:
            # The sample decides for the whole stream: a pipe or socket hands out what it has (7 bytes of
            # a header, then 50 MB), so read on to a fair sample (found by a bug hunt: a FIFO's 51 MB of
            # one repeated line were stored raw under compress=True).
            more = bytearray(first)
            while len(more) < SAMPLE_MIN:
                got = read_chunk(stream, CHUNK - len(more))
                if not got:
                    break
                more += got
            first = bytes(more)
        if level is not None and sample_pays(first):
            return self._put_stream_compressed(stream, level, first=bytes(first))
        h = new_hasher(threaded=True)
        with self.stage() as st:
            chunk: Buffer = first
            while chunk:
                h.update(chunk)
                st.write(chunk)
                chunk = read_chunk(stream, CHUNK)
            d = Digest(h.hexdigest())
            if self.touch(d):
                return d
            self.publish(st, d, RAW)
            return d

    def _put_stream_compressed(self, stream: IO[bytes], level: int, *, first: bytes = b"",
                               size_hint: int = -1) -> Digest:
        with self.stage() as st:
            d = self._compress_into(st, stream, level, first=first, size_hint=size_hint)
            if self.touch(d):
                return d
            self.publish(st, d, ZSTD)
            return d

    @staticmethod
    def _compress_into(st: Staging, stream: IO[bytes], level: int, *, first: bytes = b"",
                       size_hint: int = -1) -> Digest:
        """zstd-compress ``stream`` into ``st`` (one frame and the size trailer); the digest of what was read."""
        h = new_hasher(threaded=True)
        total = 0
        with io.FileIO(st.fd, "wb", closefd=False) as raw:
            writer = ZSTD.compressor(level).stream_writer(raw, size=size_hint, closefd=False)
            chunk: Buffer = first or read_chunk(stream, CHUNK)
            while chunk:
                h.update(chunk)
                writer.write(chunk)
                total += len(chunk)
                chunk = read_chunk(stream, CHUNK)
            if size_hint >= 0 and total != size_hint:
                # The frame header promised size_hint bytes; a file that changed
                # size while read would make a frame that lies: the caller starts over.
                raise _SizeLied()
            writer.flush(ZSTD.FLUSH_FRAME)
            raw.write(ZSTD.trailer(total))
        return Digest(h.hexdigest())

    @_no_space
    def stage_fd(self, src: int, size: int, *, compress: CompressArg = None, writeback: bool = True) -> StagedObject:
        """Stage the first ``size`` bytes of the open regular file ``src`` as an object, NOT yet published.

        For batched durable puts (``store.add`` of a folder): the caller
        collects staged objects and publishes them with :meth:`publish_batch`
        (one ``syncfs`` before and after the whole batch instead of two fsyncs
        per object), or aborts them.  What is hashed is what is staged: a raw
        object's *staged copy* is hashed (a file under 1 MiB is read once, in
        pieces through this thread's reused buffer, each piece hashed and written
        from it), a compressed one hashes
        the bytes fed to zstd -- so the digest names exactly the bytes a
        publish makes visible, even if ``src`` changes meanwhile (the caller
        compares its stat before and after to know whether it did).  Nothing is
        fsynced here; a durable store starts the staged file's writeback so the
        batch's ``syncfs`` waits for less (``writeback=False``: not, for a caller
        whose sync is about to start anyway).  A file holding fewer than ``size``
        bytes raises :class:`IntegrityError` (it changed: the caller retries).
        No dedupe check: the caller decides (:meth:`touch`) before publishing.
        """
        level = self.level_for(compress)
        st = self.stage()
        try:
            if level is not None and size > 0 and file_sample_pays(src, size):
                os.lseek(src, 0, os.SEEK_SET)
                try:
                    with io.FileIO(src, "rb", closefd=False) as f:
                        d = self._compress_into(st, f, level, size_hint=size)
                except _SizeLied:
                    raise IntegrityError(f"file changed size while being stored (expected {size} bytes)") from None
                return StagedObject(st, d, ZSTD)
            if size < _STAGE_READ_MAX:
                # One read of the source, then hash and write that same piece: half the page-cache
                # passes of copy-then-hash-the-copy for the many small files of a folder.
                h = new_hasher()
                for piece in read_reused(src, size, "stored"):  # (this thread's buffer: no fresh pages per file)
                    h.update(piece)
                    st.write(piece)
                d = Digest(h.hexdigest())
            else:
                copy_exact(src, st.fd, size)
                d = hash_fd(st.fd, size)
            if self.durable and size and writeback:
                st.start_writeback(0, size)
            return StagedObject(st, d, RAW)
        except BaseException:
            st.abort()
            raise

    @_no_space
    def adopt(self, path: Union[str, os.PathLike[str]], *, link: bool = False,
              digest: Optional[Digest] = None) -> Digest:
        """Make a finished file in this store's ``tmp/`` an object without copying it; return its digest.

        The file is hashed while a helper thread fsyncs it (if durable), made
        mode 0o444, then hard-linked (``link``: the temp name stays valid for
        whoever still reads it) or renamed into ``objects/``, and the directory
        is fsynced.  If the object exists already nothing is published (dedupe).
        The caller must never change the file again.  Where hard links are
        refused the bytes are copied instead.  Used by ``IndexCache.preserve``.
        ``digest``: the file's digest, when the caller hashed exactly these bytes itself
        (``IndexCache`` hashes its data file while it is filled); it is trusted, and the
        file is then only fsynced here.
        """
        p = os.fspath(path)
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if digest is not None:
                d = digest
                if self.durable:
                    os.fsync(fd)
            else:
                fsync = run_beside(lambda: os.fsync(fd), "casstore-fsync") if self.durable else None
                try:
                    d = hash_fd(fd, size)
                finally:
                    if fsync is not None:
                        fsync.join()
            dest = object_path(self.root, d, RAW)
            if self.touch(d):
                if not link:
                    os.unlink(p)
                return d
            os.fchmod(fd, _MODE)
            os.utime(fd)  # a fresh object for GC's grace period, whenever the file was written
            try:
                try:
                    (os.link if link else os.rename)(p, dest)
                except FileNotFoundError:
                    makedirs(dest.parent, self.durable)
                    (os.link if link else os.rename)(p, dest)
            except FileExistsError:
                return d  # another writer published the same object meanwhile
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                with self.stage() as st:  # no hard links here: copy once
                    copy_exact(fd, st.fd, size)
                    self.publish(st, d, RAW)
                return d
        finally:
            os.close(fd)
        if self.durable:
            fsync_dir(dest.parent)
        return d

    def delete(self, digest: Digest) -> bool:
        """Remove every stored form of the object; ``False`` if there was none."""
        gone = False
        for codec in CODECS:
            try:
                os.unlink(object_path(self.root, digest, codec))
                gone = True
            except FileNotFoundError:
                continue
            except PermissionError as e:
                raise ReadOnlyError(f"cannot delete object {digest} from {self.root}: {e.strerror}") from None
        return gone

    # -- reading --

    def open(self, digest: Digest, *, verify: bool = True, exact: bool = False) -> BinaryIO:
        """Open an object for streaming, read-only (see :class:`~casstore.objects.reader.ObjectReader`).

        ``exact=True`` (with ``verify``): the hash is of the very bytes handed out, on the
        caller's thread, never of the file read beside them; for copies that leave the machine.

        A missing object of at least ``upstream.ranged_min`` bytes is not
        downloaded whole: the stream fetches the ranges read
        (:class:`~casstore.objects.upstream.RangedReader`; verified, and kept
        locally, only when read in order to the end).
        """
        up = self.upstream
        if up is not None and up.ranged_min is not None and self._find(digest) is None:
            try:
                size = up.size(digest)
            except ObjectNotFoundError:
                raise self._missing(digest) from None
            if size >= up.ranged_min:
                return io.BufferedReader(RangedReader(up, digest, size, self), buffer_size=_READ_BUFFER)
        loc = self.locate(digest)
        fd, st = open_object_file(loc.path, digest)
        try:
            size = self._size(fd, st.st_size, loc, digest)
        except BaseException:
            os.close(fd)
            raise
        raw = ObjectReader(digest, loc.path, fd, loc.codec, verify, size, exact=exact)
        # A buffer smaller than CHUNK: readinto() calls of >= 256 KiB then go
        # straight to the raw reader instead of being copied through the buffer.
        return io.BufferedReader(raw, buffer_size=_READ_BUFFER)

    def prefetch(self, digests: Iterable[Digest]) -> None:
        """Ask the kernel to start reading these objects into the page cache (``POSIX_FADV_WILLNEED``).

        For reads that follow one by one (a tree version's nodes on the paths to
        changed keys): the disk then serves the misses together instead of one
        round trip each.  A hint only: a missing object, a planted link or FIFO
        (opened without following or blocking) is skipped, and nothing is
        fetched from an :attr:`upstream`.
        """
        for d in digests:
            for codec in CODECS:  # opened directly: a stat first would double the path lookups
                try:
                    fd = os.open(self._path_s(d, codec), _PREFETCH_FLAGS)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except OSError:  # not a regular file (ESPIPE), or a filesystem without it: a hint only
                    pass
                finally:
                    os.close(fd)
                break

    def read(self, digest: Digest, *, verify: bool = True) -> bytes:
        """The object's uncompressed bytes, re-hashed unless ``verify=False``.

        For large raw objects this thread reads into the result in windows
        while a helper thread hashes each window already read, so verification
        costs little and covers exactly the bytes returned.

        With an :attr:`upstream`, a local copy that fails verification (a
        fetched copy torn by a power loss, bit rot) is moved to ``bad/`` with a
        warning and fetched again, once.
        """
        if self.upstream is not None:
            data = self._fetch(digest, True)[1]  # (False, None) at once when the object is here
            if data is not None:
                return data  # verified by the fetch (a small object: reading the new copy would hash it again)
        try:
            return self._read(digest, verify)
        except IntegrityError as e:
            if self.upstream is None or not verify:
                raise
            self._set_aside(digest, e)
        self.fetch(digest)
        return self._read(digest, verify)

    def _set_aside(self, d: Digest, why: IntegrityError) -> None:
        """Move a damaged local copy of ``d`` to ``bad/`` (never deleted: evidence), so it can be fetched again."""
        loc = self._find(d)
        if loc is None:
            return
        bad = self.root / BAD
        # Hazard (found by a bug hunt, as verify --repair's quarantine): a move by path followed a bad/
        # (or objects/<fan>) swapped for a link since the store was opened, out of the store.  Both
        # directories are opened O_NOFOLLOW (StoreFormatError for a link) and the rename is relative to them.
        src_fd = bad_fd = -1
        try:
            try:
                src_fd = open_store_dir(Path(os.path.dirname(loc.path)), create=False)
            except FileNotFoundError:
                return  # removed since it was found
            bad_fd = open_store_dir(bad)
            name = move_into(src_fd, os.path.basename(loc.path), bad_fd,
                             f"{os.path.basename(loc.path)}.{time.time_ns()}")
        except OSError as e:
            raise ReadOnlyError(f"object {d} is damaged ({why}) and cannot be set aside to fetch a good copy: "
                                f"{e.strerror}") from None
        finally:
            for fd in (src_fd, bad_fd):
                if fd >= 0:
                    os.close(fd)
        if name is None:
            return  # another reader moved it first
        dest = bad / name
        log.warning("object %s in %s was damaged (%s); moved to %s, fetching it again from %s",
                    d, self.root, why, dest, self.upstream.describe() if self.upstream is not None else "?")

    def _read(self, digest: Digest, verify: bool) -> bytes:
        loc = self.locate(digest)
        fd, st = open_object_file(loc.path, digest)
        try:
            size = st.st_size
            fault("objects.read_sized")  # (a test truncates the file here: the race the size checks catch)
            if not loc.codec.byte_exact:
                size = self._size(fd, size, loc, digest)
                with open(fd, "rb", buffering=0, closefd=False) as f:
                    data = loc.codec.decode(f.read(), size, what=f"object {digest} (file {loc.path})")
                got = hash_bytes(data) if verify else digest
            else:
                filled = fresh_bytes(size) if size >= OVERLAP_MIN else None
                if filled is not None:
                    data, got = self._read_hashing(fd, size, filled, digest, loc.path, verify)
                else:
                    # pread, no file object: a commit reads hundreds of small tree nodes.
                    data = pread_upto(fd, size, 0)
                    if len(data) != size:
                        raise IntegrityError(f"object {digest} changed size while being read ({loc.path})")
                    got = hash_bytes(data) if verify else digest
        finally:
            os.close(fd)
        if got != digest:
            raise IntegrityError(
                f"object {digest} is corrupt: its bytes hash to {got}; file {loc.path}. "
                "Run `casstore verify --repair` and put the data again"
            )
        return data

    @staticmethod
    def _read_hashing(fd: int, size: int, filled: Tuple[bytes, memoryview], d: Digest,
                      path: str, verify: bool) -> Tuple[bytes, Digest]:
        """Read a raw object into ``filled`` (fresh bytes) in windows while a helper hashes each filled one.

        The hash covers exactly the bytes returned, and nothing but this one
        copy is made: no mapping of the file, no second pass over the page cache.
        ``verify=False``: the same reads, no hash (``d`` is returned as the digest).
        """
        data, view = filled
        with view, HashBeside() if verify else contextlib.nullcontext() as hasher:
            pos = 0
            while pos < size:
                k = os.preadv(fd, [view[pos:min(pos + _GET_WINDOW, size)]], pos)
                if not k:
                    raise IntegrityError(f"object {d} changed size while being read ({path})")
                if hasher is not None:
                    hasher.feed(view[pos:pos + k])
                pos += k
            return data, hasher.digest() if hasher is not None else d

    def path(self, digest: Digest) -> Path:
        """Read-only path of a *raw* object (unverified bytes: see docs/security.md)."""
        loc = self.locate(digest)
        if not loc.codec.byte_exact:
            raise CompressedObjectError(
                f"object {digest} is stored {loc.codec.name}-compressed, so it has no raw path; "
                "read it with store.open()/get(), use store.raw_path(), or put it with compress=False"
            )
        fd, _ = open_object_file(loc.path, digest)  # a regular file, not a planted link or FIFO
        os.close(fd)
        return Path(loc.path)

    @_no_space
    def raw_path(self, digest: Digest) -> Path:
        """Like :meth:`path`, but a compressed object is first materialized raw (once), verified."""
        loc = self.locate(digest)
        if loc.codec.byte_exact:
            return self.path(digest)
        with self.stage("raw") as st:
            # The verifying reader checks the hash AND the recorded size before
            # it hands out the last bytes, so a damaged object is never published raw.
            with self.open(digest, verify=True) as f:
                while True:
                    chunk = f.read(CHUNK)
                    if not chunk:
                        break
                    st.write(chunk)
            self.publish(st, digest, RAW)
        return object_path(self.root, digest, RAW)

    def hash_record(self) -> HashRecord:
        """This user's record of object files casstore hashed recently (see :class:`HashRecord`)."""
        return HashRecord(self.root, self.tmp)

    def verify_file(self, digest: Digest) -> None:
        """Hash the object's file now (IntegrityError if it does not match its name).

        A verified-once memo keyed by (device, inode, size, mtime_ns, ctime_ns)
        makes repeated calls in one process free while the file is unchanged
        (any change to the file, even ``touch``, changes the key; a file changed
        within the clock's last tick is not memoized, see ``_fsprobe.settled``).
        """
        loc = self.locate(digest)
        fd, st = open_object_file(loc.path, digest)
        try:
            if loc.codec.byte_exact:
                self.verify_fd(digest, fd, st, loc.path)
                return

            def read_through() -> Digest:  # the verifying reader raises on a mismatch itself
                with self.open(digest) as f:
                    while f.read(CHUNK):
                        pass
                return digest

            self._check_once(digest, st, loc.path, read_through)
        finally:
            os.close(fd)

    def verify_fd(self, digest: Digest, fd: int, st: os.stat_result, path: str) -> None:
        """Hash an open *raw* object file (``st``: its ``fstat``) unless this process already did.

        The memo of :meth:`verify_file` is shared: the first call hashes the
        file (blake3's thread pool over mmap windows), later calls for the same
        (device, inode, size, mtime_ns, ctime_ns) cost a dict lookup.  Hashing
        the descriptor the caller goes on to use (e.g. to map it) leaves no
        window for the path to be swapped in between.  IntegrityError on a mismatch.
        """
        self._check_once(digest, st, path, lambda: hash_fd(fd, st.st_size))

    def verified_once(self, digest: Digest, st: os.stat_result) -> bool:
        """True if this process already hashed the raw object file with stat ``st`` and found it intact.

        The :meth:`verify_fd` memo, asked without hashing: a caller that would map the file
        differently to hash it (:meth:`verify_mapped`) can then map it the cheap way.
        """
        return _memo_hit(_memo_key(st), digest)

    def verify_mapped(self, digest: Digest, st: os.stat_result, buf: Buffer, path: str) -> None:
        """Check that ``buf`` holds the bytes of the raw object file with stat ``st``: the
        :meth:`verify_fd` memo, but hashing a buffer the caller already holds (a memory map it hands out).

        Why: ``get_array(mmap=True, verify=True)`` hashed the file through a mapping of its own, then
        numpy mapped it again; hashing the very map returned saves a map, an unmap (whose TLB
        shoot-down interrupts both cores after a pooled hash) and the second round of page faults.
        One buffer for the whole file: blake3's pool splits one contiguous update over the cores,
        while a small first update makes the rest run mostly on one.  IntegrityError on a mismatch,
        naming ``path``.
        """
        self._check_once(digest, st, path, lambda: hash_bytes(buf, threaded=True))

    @staticmethod
    def _check_once(digest: Digest, st: os.stat_result, path: str, compute: Callable[[], Digest]) -> None:
        """The verified-once memo around ``compute`` (the digest of the file with stat ``st``)."""
        key = _memo_key(st)
        if _memo_hit(key, digest):
            return
        before = stamp_floor_ns()  # read before the bytes are: see _fsprobe.settled
        got = compute()
        if got != digest:
            raise IntegrityError(
                f"object {digest} is corrupt: its bytes hash to {got}; file {path}. "
                "Run `casstore verify --repair` and put the data again"
            )
        if settled(st, before):  # a file changed within the clock's last tick is hashed again next time
            _memo_add(key, digest)

    # -- listing --

    def scan(self, prefix: str = "") -> Tuple[List[ObjFile], List[Path]]:
        """Every object file and every stray entry (wrong name or type) under ``objects/``.

        THE scanner: ``scandir`` + ``lstat``, it never opens an object.  The
        ``objects/`` and fan-out directories are opened with ``O_NOFOLLOW``: a
        member of a shared store who swaps one for a symlink cannot make the
        scan (or gc, or verify, which act on what it finds) wander outside the
        store; the link is reported as a stray.  ``prefix`` (hex) narrows the
        scan to the fan-out directories that can match (strays are then not
        reported).
        """
        files: List[ObjFile] = []
        strays: List[Path] = []
        objdir = self.root / OBJECTS
        try:
            top = os.open(objdir, _DIR_FLAGS)
        except FileNotFoundError:
            return files, strays
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP):
                raise StoreFormatError(
                    f"{objdir} is not a directory (a file or a symbolic link): the store is damaged"
                ) from None
            raise
        try:
            fans = sorted(os.scandir(top), key=lambda e: e.name)
            for fan in fans:
                if prefix and not fan.name.startswith(prefix[:2]):
                    continue
                fan_path = objdir / fan.name
                if not is_fanout(fan.name) or not fan.is_dir(follow_symlinks=False):
                    strays.append(fan_path)
                    continue
                try:
                    fd = os.open(fan.name, _DIR_FLAGS, dir_fd=top)
                except OSError:  # removed, or swapped for a link since the listing
                    continue
                try:
                    self._scan_fan(fd, fan.name, str(fan_path) + "/", prefix, files, strays)
                finally:
                    os.close(fd)
        finally:
            os.close(top)
        return files, strays

    @staticmethod
    def _scan_fan(fd: int, fan: str, base: str, prefix: str, files: List[ObjFile], strays: List[Path]) -> None:
        # Entries are stat-ed relative to ``fd``: it stays open until the last one.
        for ent in sorted(os.scandir(fd), key=lambda e: e.name):
            m = _OBJ_NAME.fullmatch(ent.name)  # no Digest per file: 100k-object scans stay cheap
            if m is not None and prefix and not (fan + m.group(1)).startswith(prefix):
                continue
            try:
                st = ent.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted while we looked (GC)
            if m is None or not stat_mod.S_ISREG(st.st_mode):
                if not prefix:
                    strays.append(Path(base + ent.name))
                continue
            files.append(ObjFile(fan + m.group(1), _BY_SUFFIX[m.group(2) or ""], base + ent.name,
                                 st.st_size, st.st_mtime, st.st_atime, st.st_mtime_ns, st.st_ino))

    def iter_digests(self) -> Iterator[Digest]:
        """Every object's digest, in digest order (each once, whatever its codec)."""
        last: Optional[str] = None
        for f in self.scan()[0]:
            if f.hex != last:
                yield f.digest
            last = f.hex

    def iter_info(self) -> Iterator[ObjectInfo]:
        """``stat`` of every object (objects removed meanwhile are skipped)."""
        for d in self.iter_digests():
            try:
                yield self.stat(d)
            except ObjectNotFoundError:
                continue

    def resolve(self, prefix: Union[str, Digest]) -> Digest:
        """Turn a unique digest prefix (``"blake3:9f2c"`` or ``"9f2c"``) into a Digest."""
        if isinstance(prefix, Digest) or len(parse_prefix(prefix)) == 64:
            # A whole digest: whatever is planted there is reported by the read, not hidden.  Present on
            # the upstream counts (the read fetches it); resolving never downloads.
            d = prefix if isinstance(prefix, Digest) else Digest(parse_prefix(prefix))
            if self._find(d) is None:
                if self.upstream is None:
                    raise self._missing(d)
                try:
                    self.upstream.size(d)
                except ObjectNotFoundError:
                    raise self._missing(d) from None
            return d
        hexp = parse_prefix(prefix)
        found = sorted({f.hex for f in self.scan(hexp)[0]})
        if not found:
            raise ObjectNotFoundError(f"no object matches {prefix!r} in the store at {self.root}")
        if len(found) > 1:
            shown = ", ".join(Digest(x).short(len(hexp) + 4) for x in found[:5])
            raise AmbiguousDigestError(
                f"{prefix!r} matches {len(found)} objects ({shown}{', ...' if len(found) > 5 else ''}); "
                "give more hex digits"
            )
        return Digest(found[0])

    def __repr__(self) -> str:
        return f"LocalObjects({str(self.root)!r})"


def _copy_to_end(src: int, dst: int, off: int) -> int:
    """Append everything in ``src`` from ``off`` to its end to ``dst`` at the same offset; bytes copied."""
    done = 0
    while True:
        buf = os.pread(src, CHUNK, off + done)
        if not buf:
            return done
        pwrite_all(dst, buf, off + done)
        done += len(buf)
