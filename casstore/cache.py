"""IndexCache: a per-sample cache for training loops, shared by data loader workers.

``cache = casstore.IndexCache(store, length=N)``; ``cache.put(i, b)`` / ``cache.get(i)``
from any number of processes (fork or spawn); ``cache.freeze()`` ends the puts and
switches every reader to lock-free memory-mapped reads; ``cache.preserve(name)`` keeps
the frozen cache as one content-addressed object pinned under ``name``;
``IndexCache.open(store, name)`` maps it again in the next run.  See
docs/index-cache.md (user guide, pfio migration, on-disk format).

How it is built (the reasons are in docs/index-cache.md):

* **Live cache** (before freeze): a directory ``<store>/tmp/<pid>.<start>.<host>.<hex>.icache``
  named like every staging file, so ``sweep_stale`` removes it once its creator is dead.
  It holds ``index`` (a 64-byte header plus one 32-byte slot per index, memory-mapped
  shared by every process; its blocks are reserved when the cache is made, because a
  store into an unallocated page of a shared map dies by SIGBUS on a full disk),
  ``lock`` (the cache's lock: flock, or the store's other lock strategy -- on filesystems whose
  locks are missing or lie a lease file beside it, and then every slot is also claimed by an
  exclusive create of ``claim.<index>``; see ``_claim``) and one data file ``data.0`` that every
  process appends to.
  A put checksums the payload with no lock, then takes the lock to check the slot, append
  the payload at the shared data end, fill the slot (its tag word last) and move the end.
  A crash before the tag leaves no entry (the tag does not match) and its bytes past the
  end are overwritten by the next put; never a partial record.
* **Frozen file** (after freeze): ``[64-byte header][payloads in the order they were put]
  [table: 32 bytes per index][64-byte footer]``.  Because the data file holds exactly the
  committed records back to back, freeze appends the table to it and renames it: no copy,
  whatever order or processes wrote them (records put in index order give the same bytes,
  so identical in-order runs preserve one object).
* **Checksums**: every record carries one, computed at ``put``: XXH3-64 (format 2; ~25 GB/s
  here; format 1 files carry CRC-32 or BLAKE3-64 and are still read).  The table and footer
  carry CRC-32s; a preserved cache is additionally an object whose whole BLAKE3-256 digest
  ``verify="full"`` checks on ``open``.  See ``verify=`` for when checks run.
* **Preserve time**: that BLAKE3 is computed while the cache is filled, by a helper thread
  of the creating process that follows the shared data end (and starts the writeback of
  what it hashed), so ``preserve`` hashes and fsyncs only what is left (``_Follower``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import operator
import os
import secrets
import shutil
import socket
import stat
import struct
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, TypedDict, Union, cast
from zlib import crc32 as _crc32  # tables and footers at open, format-1 records (docs: "Dependencies")

import blake3
from xxhash import xxh3_64_intdigest as _xxh3

from ._faults import fault
from ._fs import disk_full, pread_upto, process_token, start_writeback
from ._fs import pwrite_all as _pwrite_all
from ._fsprobe import LOCK_UNSUPPORTED, ofd_lock, ofd_unlock
from ._lock import DEFAULT_TIMEOUT, FileLock, degrade, strategy_for
from .digest import Digest, hash_fd
from .errors import (
    CacheIndexError,
    CasstoreError,
    FrozenError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ObjectNotFoundError,
    ReadOnlyError,
    StoreFormatError,
)
from .manifests import pin, read_manifest
from .manifests.model import Entry, encode_manifest
from .objects import LocalObjects
from .objects.reader import open_object_file
from .refs import validate_name

if TYPE_CHECKING:
    import numpy as np  # imported where needed: ``import casstore`` stays numpy-free

    from .store import Store

__all__ = ["IndexCache", "CacheIndexError", "CacheInfo", "FORMAT", "KIND", "ENTRY_KEY", "VERIFY_MODES"]

log = logging.getLogger("casstore.cache")

FORMAT = 2
"""Version of the frozen-file layout and of the manifest metadata (readers refuse newer)."""
KIND = "casstore.index-cache"
"""``meta["kind"]`` of a manifest written by :meth:`IndexCache.preserve`."""
ENTRY_KEY = "index-cache"
"""The manifest key under which :meth:`IndexCache.preserve` records the cache object."""
VERIFY_MODES = ("once", "full", "record", "open")
"""``verify=`` values; ``"once"`` is the default (each record checked the first time this process reads it)."""
DEFAULT_VERIFY = "once"

Buffer = Union[bytes, bytearray, memoryview]

# -- on-disk layout (docs/index-cache.md, "On-disk format") ----------------------

_HDR = 64
_FILE_MAGIC = b"CSICACHE"
_FILE_HEADER = struct.Struct("<8sI52x")  # magic, format; also the first 64 bytes of data.0
_FOOT_MAGIC = b"CSICFOOT"
# magic, format, slot size, length, table offset, data end, records, payload bytes, table crc, footer crc
_FOOTER = struct.Struct("<8sIIQQQQQII")
_INDEX_MAGIC = b"CSICLIVE"
# magic, format, flags, length, payload bytes, records, (unused: was the next data file number), data end
_INDEX_HEADER = struct.Struct("<8sIIQQQI4xQ8x")
_FLAGS_AT, _TOTAL_AT, _COUNT_AT, _END_AT = 12, 24, 32, 48
_DATA = "data.0"  # the one data file every process appends to, under the lock
_FROZEN_FLAG = 1
_DIRTY_FLAG = 2  # a commit is in progress; if its writer died, the next lock holder recounts
_SLOT = struct.Struct("<QQQQ")  # offset, end offset, checksum, meta = tag << 32 | file << 8 | flags
_SLOT28 = struct.Struct("<QQQI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SLOT_SIZE = 32
_PRESENT = 1
_BLAKE3 = 2  # format 1: records above 64 KiB (read, never written now)
_XXH3 = 4  # format 2: every record written (format 1's others carry CRC-32)
_MISSING_SUM = (1 << 64) - 1  # checksum field of an absent index in a frozen table
# A record this large is placed so that its file offset does not sit 1-63 bytes past its
# source buffer's address modulo 4 KiB: the kernel's copy into the page cache then stalls
# on 4K aliasing (loads look dependent on the stores just made), measured 2x slower here;
# exactly what a 4 MiB bytes object (data at 48 mod 4096) written at offset 64 hit.
_ALIGN_MIN = 256 << 10
_ALIASING = 64
_ZEROS = bytes(_ALIASING)
_PARALLEL = 1 << 20  # records this large are hashed on a helper thread while they are written
_BYTES_DATA = bytes.__basicsize__ - 1 if sys.implementation.name == "cpython" else -1  # ob_sval's offset
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5, 0xFF51AFD7ED558CCD)
_SLOT_FIELDS = [("off", "<u8"), ("end", "<u8"), ("sum", "<u8"), ("meta", "<u8")]
_LITTLE = sys.byteorder == "little"

_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_HOST = socket.gethostname()
_CLAIM_DONE = b" committed"  # appended to a slot claim once its record is valid (IndexCache._claim_done)
try:
    _PIDNS = os.readlink("/proc/self/ns/pid")  # a pid is only judged dead within its own pid namespace
except OSError:  # pragma: no cover
    _PIDNS = "-"


class CacheInfo(TypedDict):
    """What :meth:`IndexCache.info` reports (JSON-able)."""

    name: Optional[str]
    digest: Optional[str]
    manifest: Optional[str]
    length: int
    records: int
    bytes: int
    frozen: bool
    verify: str
    file: Optional[str]
    file_bytes: Optional[int]
    format: int


def _tag(i: int, off: int, end: int, s: int, lo: int) -> int:
    """32-bit check word of a slot: detects a slot torn by a crash or read mid-write."""
    h = ((off * _K[0]) ^ (end * _K[1]) ^ (s * _K[2]) ^ (lo * _K[3]) ^ (i * _K[4])) & _M64
    t = (h >> 32) ^ (h & _M32)
    return t or 1


def _tags_np(i: np.ndarray, off: np.ndarray, end: np.ndarray, s: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Vectorised :func:`_tag` (uint64 arithmetic wraps mod 2**64 like the masked Python ints)."""
    import numpy as np

    k = [np.uint64(x) for x in _K]
    h = (off * k[0]) ^ (end * k[1]) ^ (s * k[2]) ^ (lo * k[3]) ^ (i * k[4])
    t = (h >> np.uint64(32)) ^ (h & np.uint64(_M32))
    t[t == 0] = 1
    return t


def _b3_64(buf: Any, n: int) -> int:
    # One thread: measured here, the pool does not speed up 4 MiB records and slows the write next to it.
    return int.from_bytes(blake3.blake3(buf).digest(length=8), "little")


# This process's pid, kept by a fork hook: every "am I a forked child?" check below reads it.
# glibc no longer caches getpid(), and a put that asked the kernel paid a syscall per record.
_pid = os.getpid()


def _note_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_note_fork)


class _Hasher:
    """One helper thread per process that hashes large records while the caller writes them.

    The hash and the copy into the page cache each read the record from memory; on one core
    they add up (~25% over a bare ``pwrite`` for 4 MiB records), on two they overlap
    (xxhash releases the GIL).  A forked child gets its own thread: the parent's does not
    exist there, and work queued to it would never run.

    While such a put is in flight it needs both cores, so the process's ``_Follower``
    steps aside (:meth:`wait_quiet`): a follower step running beside it delayed the
    helper's wake-up by up to a scheduler slice (2-4 ms; EEVDF lets a running task reach
    its deadline even at nice 19) and took memory bandwidth from the copy, 0.77x of pfio's
    4 MiB puts against 0.9x without it (issue 15).
    """

    pid = -1
    pool: Optional[ThreadPoolExecutor] = None
    guard = threading.Lock()
    busy = 0  # large puts of this process between submit() and done()
    quiet = threading.Event()  # set while busy == 0

    @classmethod
    def submit(cls, data: Buffer) -> Future[int]:
        """Start hashing ``data`` on the helper thread; the caller must call :meth:`done` after, always."""
        pool = cls.pool
        if pool is None or cls.pid != _pid:
            with cls.guard:
                if cls.pool is None or cls.pid != _pid:
                    cls.pool = ThreadPoolExecutor(1, thread_name_prefix="casstore-cache-hash")
                    cls.pid = _pid
                    cls.busy = 0  # a forked child starts with no puts in flight (the parent's were not its own)
                    cls.quiet = threading.Event()
                pool = cls.pool
        fut = pool.submit(_xxh3, data)  # (raises after interpreter shutdown: then nothing is in flight)
        with cls.guard:
            cls.busy += 1
            cls.quiet.clear()
        return fut

    @classmethod
    def done(cls) -> None:
        """The put that called :meth:`submit` has ended (committed, refused or failed)."""
        with cls.guard:
            cls.busy -= 1
            if cls.busy <= 0:
                cls.busy = 0
                cls.quiet.set()

    @classmethod
    def wait_quiet(cls, stop: threading.Event) -> None:
        """Block while a large put of this process is in flight (or until ``stop`` is set)."""
        while cls.busy and cls.pid == _pid and not stop.is_set():
            cls.quiet.wait(_FOLLOW_POLL)


_Hasher.quiet.set()


def _address(data: Buffer) -> int:
    """The memory address of ``data``'s first byte (to place a large record; see ``_ALIGN_MIN``)."""
    if type(data) is bytes and _BYTES_DATA > 0:
        return id(data) + _BYTES_DATA
    import numpy as np

    return int(np.frombuffer(data, np.uint8).__array_interface__["data"][0])


_BOUNDS_STEP = 1 << 16  # table entries checked per numpy step at open: small temporaries
_BOUNDS_PLAIN = 1 << 12  # a table this small is checked without numpy (~0.1 us per entry; no import at open)


def _out_of_bounds(table: bytes, data_end: int) -> Optional[tuple[int, int, int]]:
    """The first entry of ``table`` read as present (``end != 0``, as the frozen gets and ``verify``
    test it) outside ``_HDR <= offset <= end <= data_end``, as (index, offset, end); None if none is.

    Vectorised in steps when the table is large: a 10^6-index table takes ~6 ms, next to the
    ~10-25 ms of its CRC-32 (docs/index-cache.md, "Checksums").  A small table, or a process that
    cannot import numpy at this point (one that dropped its privileges after importing casstore,
    tests/test_cache_basic.py), is checked entry by entry: ``IndexCache.open`` needs no numpy.
    """
    n = len(table) // _SLOT_SIZE
    np: Any = sys.modules.get("numpy")
    if np is None and n > _BOUNDS_PLAIN:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - the plain loop below is exact, only slower
            np = None
    if np is None:
        for i, (o, e, _s, _m) in enumerate(_SLOT.iter_unpack(table)):
            if e and not _HDR <= o <= e <= data_end:
                return i, o, e
        return None
    dt = np.dtype(_SLOT_FIELDS)
    for start in range(0, n, _BOUNDS_STEP):
        t = np.frombuffer(table, dtype=dt, count=min(_BOUNDS_STEP, n - start), offset=start * _SLOT_SIZE)
        off, end = t["off"], t["end"]
        bad = (end != 0) & ((off < _HDR) | (off > end) | (end > data_end))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            return start + k, int(off[k]), int(end[k])
    return None


def _sum_ok(buf: Any, s: int, lo: int) -> bool:
    """Does ``buf`` match checksum ``s`` of the kind that the slot flags ``lo`` name?"""
    if lo & _XXH3:
        return bool(_xxh3(buf) == s)
    if lo & _BLAKE3:
        return _b3_64(buf, len(buf)) == s
    return _crc32(buf) == s


class _Res:
    """Every descriptor and helper a cache holds, apart from the cache object itself.

    Issue 17: a cache dropped without ``close()`` kept its descriptors (20 caches
    left 60 open on deleted files; on FUSE the directory then cannot be removed).
    The cache's ``weakref.finalize`` holds this object, never the cache, and
    :func:`_release` closes everything in it; ``close()`` runs the same finalizer,
    so each descriptor is closed exactly once (a second close could hit a number
    the process has reused meanwhile).  Maps need no entry: an mmap closes itself
    when the last reference to it goes.
    """

    __slots__ = ("ifd", "ffd", "proc", "follower", "dir", "owner")

    def __init__(self, proc: _Proc) -> None:
        self.ifd = -1
        self.ffd = -1
        self.proc = proc
        self.follower: Optional[_Follower] = None
        self.dir: Optional[str] = None
        self.owner = -1


def _release(res: _Res) -> None:
    """Finalizer of every cache: close its descriptors; in the creating process remove a live cache's directory."""
    for attr in ("ffd", "ifd"):
        fd = getattr(res, attr)
        setattr(res, attr, -1)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass
    res.proc.close()  # in a forked child: only the child's copies
    if res.follower is not None:
        res.follower.close()
    if res.dir is not None and _pid == res.owner:
        shutil.rmtree(res.dir, ignore_errors=True)


_FOLLOW_STEP = 8 << 20  # hash (and start writing back) the data file in steps of this many bytes
_FOLLOW_BUF = 2 << 20  # read (and hash) at most this much at a time
_FINISH_WINDOW = 32 << 20  # preserve maps what is left in windows this large (a multiple of the step)
_FOLLOW_POLL = 0.05  # seconds between looks at the data end while the cache is filled


class _Follower:
    """BLAKE3 of a live cache's data file, computed while it is filled, in the process that created it.

    ``preserve`` must name the frozen file by its BLAKE3-256 and make it durable; done
    then, that is one hash pass over the whole file plus an fsync of everything still
    dirty (issue 13: 2-4x one sequential read).  Every byte below the shared data end
    is final once committed (puts append past it; freeze only cuts bytes past it and
    appends the table), so this helper thread hashes ``[0, end)`` in steps as the end
    moves, and asks the kernel to start writing each hashed step back
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous, off the put path), so
    preserve is left with the last step, the table and a short fsync.  It reads the end
    with ``pread`` from its own descriptors (never the caller's maps), holds no
    reference to the cache, and exists only in the creating process: a forked child
    has no such thread, and its ``preserve`` hashes the whole file as before.
    """

    __slots__ = ("pid", "dfd", "ifd", "ino", "pos", "h", "guard", "stop", "thread", "failed", "writeback", "buf")

    def __init__(self, data: Path, index: Path, durable: bool) -> None:
        self.pid = _pid
        self.dfd = os.open(data, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            self.ifd = os.open(index, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except BaseException:
            os.close(self.dfd)
            raise
        st = os.fstat(self.dfd)
        self.ino = (st.st_dev, st.st_ino)
        self.pos = 0
        # One thread: with blake3's pool the fill was measured up to 1.5x slower here (the
        # loader's workers need the cores), for ~30 ms less at preserve.
        self.h = blake3.blake3()
        self.buf = bytearray(_FOLLOW_BUF)
        self.guard = threading.Lock()  # the thread's steps and finish() never interleave
        self.stop = threading.Event()
        self.failed = False
        self.writeback = durable  # start each step's writeback at once: the fsync at preserve is short
        self.thread = threading.Thread(target=self._run, name="casstore-cache-follow", daemon=True)
        self.thread.start()

    def _end(self) -> int:
        b = os.pread(self.ifd, 8, _END_AT)
        return int(_U64.unpack(b)[0]) if len(b) == 8 else 0

    def _run(self) -> None:
        # Background work: at the lowest priority (Linux nices threads one by one), so on a
        # busy machine the puts and the loader it follows get the cores first, and preserve
        # hashes whatever is left.  Its writeback starts at once behind the writer: issue 13's
        # preserve bound needs a fill's bytes on disk by the time it ends (see docs/index-cache.md).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):  # pragma: no cover - not Linux, or a sandbox that refuses
            pass
        try:
            while not self.stop.wait(_FOLLOW_POLL):
                end = self._end() // _FOLLOW_STEP * _FOLLOW_STEP
                if end > self.pos:
                    with self.guard:
                        if self.stop.is_set():
                            return
                        self._hash_to(end, writeback=True)
        except Exception as e:  # pragma: no cover - EIO and the like: preserve hashes the file itself
            self.failed = True
            log.debug("index cache follower stopped: %s", e)

    def _hash_to(self, end: int, *, writeback: bool) -> None:
        # pread into one reused buffer, not a map: a live file truncated behind our back
        # (damage) must be a short read here, never a SIGBUS that kills the process.
        buf = self.buf
        while self.pos < end and not self.failed:
            _Hasher.wait_quiet(self.stop)
            if self.stop.is_set():
                return  # finish() or close(): the caller takes over (at its own priority, not nice 19)
            n = os.preadv(self.dfd, [memoryview(buf)[:min(len(buf), end - self.pos)]], self.pos)
            if n <= 0:
                self.failed = True  # shorter than its committed end: preserve hashes (and checks) it itself
                return
            self.h.update(memoryview(buf)[:n])
            if writeback and self.writeback:
                start_writeback(self.dfd, self.pos, n)
            self.pos += n

    def _finish_to(self, size: int) -> None:
        """Hash the rest of the frozen file in large mapped windows (no copy through a buffer).

        The file is frozen (final size, in this process's own directory); each window is
        checked against the file's size first (a map past the end would SIGBUS), and its
        writeback starts before the next one is hashed, so the fsync that follows is short.
        """
        while self.pos < size:
            if os.fstat(self.dfd).st_size < size:
                self.failed = True
                return
            n = min(_FINISH_WINDOW, size - self.pos)
            with mmap.mmap(self.dfd, n, prot=mmap.PROT_READ, offset=self.pos) as mm:
                if self.writeback:
                    start_writeback(self.dfd, self.pos, n)
                self.h.update(mm)
            self.pos += n

    def finish(self, fd: int, size: int) -> Optional[Digest]:
        """The BLAKE3-256 of the frozen file open as ``fd`` (``size`` bytes), or None if unknown here."""
        if _pid != self.pid or self.failed:
            return None
        st = os.fstat(fd)
        self.stop.set()
        with self.guard:
            if (st.st_dev, st.st_ino) != self.ino or self.failed or self.pos > size:
                return None
            try:
                self._finish_to(size)
            except Exception:  # pragma: no cover
                return None
            return None if self.failed else Digest(self.h.hexdigest())

    def close(self) -> None:
        """Stop the thread and close its descriptors (a forked child closes only its copies)."""
        if _pid != self.pid:  # no thread here, and the guard may be a copy taken mid-step
            for fd in (self.dfd, self.ifd):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.dfd = self.ifd = -1
            return
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()
        with self.guard:
            for fd in (self.dfd, self.ifd):
                if fd >= 0:
                    os.close(fd)
            self.dfd = self.ifd = -1
            self.failed = True


def _check_lock_timeout(value: object) -> Optional[float]:
    """``lock_timeout`` checked at construction: ``None``/``inf`` -> ``None`` (wait forever), else seconds >= 0.

    Hazard: it is first used only at a contended put, so a bad value used to surface there, far
    from its cause: ``"10"`` a bare TypeError, NaN waited forever (every comparison is False),
    a negative timed out at once.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(
            f"IndexCache lock_timeout must be a number of seconds or None, not {type(value).__name__} {value!r:.40}")
    v = float(value)
    if math.isnan(v) or v < 0:
        raise InvalidInputError(f"IndexCache lock_timeout must be a non-negative number of seconds, not {value!r}")
    return None if math.isinf(v) else v  # as the pipelines' lock_seconds: inf means wait forever


def _check_store(store: object) -> Store:
    """``store`` if it is a store (anything whose ``objects`` is the local object layer)."""
    if isinstance(getattr(store, "objects", None), LocalObjects):
        return cast("Store", store)  # the facade is only a type here (layer rule)
    hint = " (open it first: casstore.open(path))" if isinstance(store, (str, os.PathLike)) else ""
    raise InvalidTypeError(f"IndexCache needs a casstore.Store{hint}, not {type(store).__name__}")


def _reserve(fd: int, size: int, where: Path) -> None:
    """Give the file ``size`` bytes of real disk blocks before it is memory-mapped for writing.

    Hazard (issue 11): a store of a sparse file's pages through a shared map
    allocates blocks at the moment of the store; on a full disk the kernel
    can only answer with SIGBUS, which kills the process.  Reserved blocks
    make a full disk an ENOSPC here, as a :class:`~casstore.errors.DiskFullError`.
    (On copy-on-write filesystems such as btrfs or ZFS a reservation does not
    promise room for later overwrites: there a full disk can still fault.)
    """
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno == errno.EFBIG:
            raise InvalidInputError(f"an index cache of {size:,} index bytes is too large for {where}") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise disk_full(e, where, "reserving an index cache's index") from None
    zeros = bytes(min(size, 1 << 20))  # no fallocate here: write the blocks instead
    for off in range(0, size, len(zeros)):
        _pwrite_all(fd, zeros[: size - off], off)


def _open_private(path: Path) -> int:
    """Open a file of a live cache's own directory read-only, never following a link or blocking."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IntegrityError(f"index cache file {path} is not a regular file; create a new cache")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Proc:
    """What one process owns of a live cache: its lock descriptor and its data file."""

    __slots__ = ("pid", "tlock", "lock_fd", "wfd", "rfds", "mode", "key", "lease")

    def __init__(self) -> None:
        self.pid = _pid
        self.tlock = threading.Lock()  # threads of this process share one flock (same descriptor)
        self.mode = ""  # the store's lock strategy (flock, posix, lease), chosen at the first lock
        self.key = "?"
        self.lease: Optional[FileLock] = None  # lease path: the cache's lock as a lease file
        self.lock_fd = -1
        self.wfd = -1
        self.rfds: Dict[int, int] = {}

    def close(self) -> None:
        for fd in [self.lock_fd, self.wfd, *self.rfds.values()]:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:  # pragma: no cover
                    pass
        self.lock_fd = self.wfd = -1
        self.rfds = {}


class IndexCache:
    """A cache of ``length`` byte records addressed by index ``0 .. length-1``.

    Typical use, a cache in front of an expensive ``dataset[i]``::

        cache = casstore.IndexCache(store, length=len(dataset))
        for i in range(len(dataset)):            # or from many DataLoader workers
            if i not in cache:
                cache.put(i, encode(dataset[i]))
        cache.freeze()                           # no more puts; lock-free mmap reads
        cache.preserve("imagenet-train-v1")      # one object, pinned under a name
        cache = casstore.IndexCache.open(store, "imagenet-train-v1")   # next run

    * ``store``: a :class:`~casstore.Store` (``casstore.open(path)``).  The live cache
      lives in the store's ``tmp/`` and dies with the process that created it.  Its
      index is reserved on disk up front (32 bytes per index), so a full disk is a
      :class:`~casstore.errors.DiskFullError` from the constructor or ``put``, never a
      SIGBUS; once space is freed the cache (and the store) work on.
    * ``max_bytes``: once the payload bytes would exceed it, ``put`` stores nothing and
      returns False (smaller records may still fit).  ``None``: no limit.
    * ``verify``: ``"once"`` (default) checks each record's checksum the first time this
      process reads it from the frozen cache (the bytes returned are the bytes checked)
      and remembers that, so every byte is checked and repeated epochs cost no more
      than unchecked reads; a byte that changes on disk *after* its record was checked
      here is not caught by later gets (run :meth:`verify`).  ``"full"`` checks every
      record's checksum on every ``get``
      and, in :meth:`open`, the preserved object's whole BLAKE3-256 digest first;
      ``"record"`` skips that whole-object hash (instant open of a huge cache; every get
      is still checked); ``"open"`` checks everything once -- the whole digest in
      :meth:`open`, every record's checksum in :meth:`freeze` -- and then serves frozen
      reads with no per-record check (fastest; a byte that rots on disk later is not
      caught).  Reads of a live (unfrozen) cache are always checked.
    * ``lock_timeout``: seconds a ``put`` or ``freeze`` waits for the cache's lock
      before :class:`~casstore.LockTimeout` (the lock is held for microseconds); ``None``
      or ``inf`` waits forever, ``0`` tries once.

    ``get(i)`` returns ``None`` for an index that has no record (it never raises
    ``KeyError``).  The object can be pickled to spawned workers and survives fork.
    """

    __slots__ = (
        "store", "length", "max_bytes", "verify_mode", "lock_timeout", "name", "digest",
        "_dir", "_owner", "_imm", "_res", "_fmm", "_fq", "_fcheck", "_fpath",
        "_fcount", "_ftotal", "_finalizer", "_manifest_digest", "_qo", "_qe", "_qs", "_qm", "_seen", "_ffmt",
        "__weakref__",
    )
    _dir: Optional[Path]
    _imm: Any
    _finalizer: weakref.finalize[Any, Any]

    # Descriptors live in self._res, which the finalizer closes even if close() is never called.
    @property
    def _ifd(self) -> int:
        return self._res.ifd

    @_ifd.setter
    def _ifd(self, fd: int) -> None:
        self._res.ifd = fd

    @property
    def _ffd(self) -> int:
        return self._res.ffd

    @_ffd.setter
    def _ffd(self, fd: int) -> None:
        self._res.ffd = fd

    @property
    def _proc(self) -> _Proc:
        return self._res.proc

    @_proc.setter
    def _proc(self, p: _Proc) -> None:
        self._res.proc = p

    @property
    def _follower(self) -> Optional[_Follower]:
        return self._res.follower

    @_follower.setter
    def _follower(self, f: Optional[_Follower]) -> None:
        self._res.follower = f

    def __init__(self, store: Store, length: int, *,
                 max_bytes: Optional[int] = None, verify: str = DEFAULT_VERIFY,
                 lock_timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        self._init_fields(_check_store(store), length, max_bytes, verify, lock_timeout)
        root_tmp = self.store.objects.tmp
        d = root_tmp / f"{process_token()}.{secrets.token_hex(8)}.icache"
        try:
            os.mkdir(d, 0o700)
        except OSError as e:
            if isinstance(e, PermissionError) or e.errno == errno.EROFS:
                raise ReadOnlyError(
                    f"cannot create an index cache in {root_tmp}: {e.strerror}; open a writable store "
                    "(IndexCache.open(store, name) reads a preserved cache from a read-only store)"
                ) from None
            raise disk_full(e, root_tmp, "creating an index cache") from None
        self._dir = d
        self._owner = _pid
        self._res.dir, self._res.owner = str(d), self._owner
        try:
            fd = os.open(d / "index", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self._ifd = fd
            # Zero slots are empty; the blocks are reserved, not left sparse (see _reserve: SIGBUS).
            _reserve(fd, _HDR + _SLOT_SIZE * self.length, d)
            _pwrite_all(fd, _INDEX_HEADER.pack(_INDEX_MAGIC, FORMAT, 0, self.length, 0, 0, 1, _HDR), 0)
            self._imm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(os.open(d / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            dfd = os.open(d / _DATA, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _pwrite_all(dfd, _FILE_HEADER.pack(_FILE_MAGIC, FORMAT), 0)
            finally:
                os.close(dfd)
            self._follower = _Follower(d / _DATA, d / "index", self.store.objects.durable)
        except OSError as e:
            self.close()
            raise disk_full(e, root_tmp, "creating an index cache") from None
        except BaseException:
            self.close()
            raise

    def _init_fields(self, store: Store, length: object, max_bytes: object, verify: object,
                     lock_timeout: object) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise InvalidTypeError(f"IndexCache length must be an int (len(dataset)), not {type(length).__name__}")
        if not 0 <= length < (1 << 48):
            raise InvalidInputError(f"IndexCache length must be between 0 and 2**48, not {length}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 0):
            raise InvalidInputError(f"max_bytes must be None or a non-negative int, not {max_bytes!r}")
        if verify not in VERIFY_MODES:
            raise InvalidInputError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        timeout = _check_lock_timeout(lock_timeout)
        self.store = store
        """The :class:`~casstore.Store` the cache lives in."""
        self.length: int = length
        """Number of indices (``0 .. length-1``)."""
        self.max_bytes: Optional[int] = max_bytes
        """Payload limit in bytes, or ``None``."""
        self.verify_mode: str = str(verify)
        """``"once"``, ``"full"``, ``"record"`` or ``"open"`` (see the class docstring)."""
        self.lock_timeout: Optional[float] = timeout
        """Seconds a ``put`` or ``freeze`` waits for the cache's lock; ``None``: forever."""
        self.name: Optional[str] = None
        """The pin name after :meth:`preserve` or :meth:`open` by name."""
        self.digest: Optional[Digest] = None
        """Digest of the cache object after :meth:`preserve` or :meth:`open`."""
        self._manifest_digest: Optional[Digest] = None
        self._dir = None
        self._owner = -1
        self._imm = None
        self._fmm: Any = None
        self._fq: Any = None
        self._qo: Any = None
        self._qe: Any = None
        self._qs: Any = None
        self._qm: Any = None
        self._fcheck = "every"
        self._seen: Any = None
        self._ffmt = FORMAT
        self._fpath: Optional[Path] = None
        self._fcount = 0
        self._ftotal = 0
        self._res = _Res(_Proc())
        self._finalizer = weakref.finalize(self, _release, self._res)

    # -- opening a preserved cache --------------------------------------------------

    @classmethod
    def open(cls, store: Store, target: Union[str, Digest], *, verify: str = DEFAULT_VERIFY) -> IndexCache:
        """Map a cache kept by :meth:`preserve`: frozen, lock-free, nothing rebuilt.

        ``target`` is the pin name given to ``preserve``, a manifest version digest, or the
        cache object's digest (what ``preserve`` returned).  With ``verify="full"`` or
        ``"open"`` the whole object is hashed once and compared with its digest
        (:class:`~casstore.IntegrityError` on a mismatch); ``"once"`` (default) and
        ``"record"`` check only the header, table and footer here and each record when read
        (``"once"``: the first time this process reads it).  A name that is not an index cache raises
        :class:`~casstore.InvalidInputError`; a missing name or object (collected by gc or
        ``limit`` even while this runs) :class:`~casstore.ObjectNotFoundError`; an object
        file that is not a regular file (a planted FIFO, device or link)
        :class:`~casstore.IntegrityError` at once.
        """
        st = _check_store(store)
        if verify not in VERIFY_MODES:
            raise InvalidInputError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        if not isinstance(target, (str, Digest)):
            raise InvalidTypeError(f"IndexCache.open() takes a name or a digest, not {type(target).__name__}")
        what = repr(target) if isinstance(target, str) else str(target)
        length: Optional[int] = None
        manifest_digest: Optional[Digest] = None
        name: Optional[str] = None
        digest: Optional[Digest] = None
        version: Union[str, Digest] = target
        if isinstance(target, Digest) or target.startswith("blake3:"):
            try:
                version = Digest.coerce(target)
            except InvalidDigestError:  # a unique prefix
                version = st.objects.resolve(target)
            # The cache object itself (preserve's return value) is recognized by its first
            # bytes: never read a cache of many GB into memory to find it is not a manifest.
            with st.objects.open(version, verify=False) as f:
                if f.read(len(_FILE_MAGIC)) == _FILE_MAGIC:
                    digest = version
        if digest is None:
            try:
                man = read_manifest(st, version)
            except StoreFormatError:
                if isinstance(version, Digest):
                    raise InvalidInputError(
                        f"{what} is not an index cache: object {version} is neither an index cache file "
                        "nor a manifest; IndexCache.open needs a name or digest made by IndexCache.preserve"
                    ) from None
                raise
            kind = man.meta.get("kind")
            if kind != KIND or ENTRY_KEY not in man:
                raise InvalidInputError(
                    f"{what} is not an index cache: its manifest has kind {kind!r} and keys "
                    f"{sorted(man)[:5]!r}; IndexCache.open needs a name made by IndexCache.preserve"
                )
            fmt = man.meta.get("format")
            if not isinstance(fmt, int) or fmt > FORMAT:
                raise StoreFormatError(
                    f"index cache {what} has format {fmt!r}, newer than this casstore ({FORMAT}); upgrade casstore"
                )
            digest = man[ENTRY_KEY].digest
            lv = man.meta.get("length")
            length = lv if isinstance(lv, int) else None
            manifest_digest = man.digest
            name = man.name
        loc = st.objects.locate(digest)
        if not loc.codec.byte_exact:
            raise StoreFormatError(
                f"index cache {what}: object {digest} is stored {loc.codec.name}-compressed and cannot be "
                "memory-mapped; store it raw again (casstore get it and put it with compress=False)"
            )
        # Through the object layer: O_NOFOLLOW | O_NONBLOCK and a regular file, or a typed error.
        fd, _ = open_object_file(loc.path, digest)
        self = cls.__new__(cls)
        self._init_fields(st, 0, None, verify, DEFAULT_TIMEOUT)
        self.name = name
        self.digest = digest
        self._manifest_digest = manifest_digest
        path = Path(loc.path)
        self._map_frozen(fd, path, whole=digest if verify in ("full", "open") else None,
                         check=_CHECKS[verify], what=f"index cache {what}")
        if length is not None and length != self.length:
            self.close()
            raise IntegrityError(f"index cache {what}: its manifest says length {length}, its file {path} "
                                 f"holds {self.length} slots; the object is damaged")
        return self

    # -- the hot paths ------------------------------------------------------------

    def get(self, i: int) -> Optional[bytes]:
        """The record stored at index ``i`` as ``bytes``, or ``None`` if there is none.

        Raises :class:`CacheIndexError` for an index outside ``0 .. length-1`` and
        :class:`~casstore.IntegrityError` (naming the index) if the record's checksum does
        not match -- damaged bytes are never returned.  Frozen caches take no lock.
        """
        if self._fq is None:
            return self._get_live(i)
        return _FROZEN_GETS[self._fcheck](self, i)

    def put(self, i: int, data: Buffer) -> bool:
        """Store ``data`` (bytes-like) at index ``i``; return True if this call stored it.

        Returns False, storing nothing, if index ``i`` already has a record (the first
        writer wins; records are never replaced) or if ``max_bytes`` would be exceeded.
        Safe from any number of threads and processes at once.  Raises
        :class:`~casstore.FrozenError` once the cache is frozen, :class:`CacheIndexError`
        for a bad index and :class:`~casstore.InvalidTypeError` for data that is not
        bytes, bytearray, memoryview or another C-contiguous buffer (a numpy array, array.array, mmap).
        """
        if type(data) is not bytes:
            data = self._as_buffer(i, data)
        if type(i) is not int or i < 0 or i >= self.length:
            i = self._check_index(i)
        mm = self._imm
        if mm is None or mm[_FLAGS_AT] & _FROZEN_FLAG:
            raise self._frozen_error(i)
        base = _HDR + _SLOT_SIZE * i
        if _U32.unpack_from(mm, base + 28)[0] and self._slot_valid(mm, i, base):
            return False
        n = len(data)
        mb = self.max_bytes
        if mb is not None and _U64.unpack_from(mm, _TOTAL_AT)[0] + n > mb:
            return False
        # XXH3-64 outside the lock: ~25 GB/s here against CRC-32's 9 and BLAKE3's 3-8 (issue 15).
        fl = _PRESENT | _XXH3
        src = _address(data) if n >= _ALIGN_MIN else -1
        hashing = _Hasher.submit(data) if n >= _PARALLEL else None
        try:
            s = _xxh3(data) if hashing is None else -1
            p = self._proc
            if p.pid != _pid:
                p = self._after_fork()
            with p.tlock:
                if p.wfd < 0:
                    self._open_writer(p, i)
                # The payload is appended under the lock, at the data end every process shares:
                # the data file then holds exactly the committed records, back to back, so
                # freeze appends the table in place and preserve links it (no copy, ever).
                self._lock(p)
                claim = -1  # lease path: our claim on slot i, open until the record is committed
                try:
                    if mm[_FLAGS_AT] & _FROZEN_FLAG:
                        raise self._frozen_error(i)
                    if self._slot_valid(mm, i, base):
                        return False
                    total = _U64.unpack_from(mm, _TOTAL_AT)[0]
                    if mb is not None and total + n > mb:
                        return False
                    if p.mode == "lease":
                        claim = self._claim(i)
                        if claim < 0:
                            return False
                    off = _U64.unpack_from(mm, _END_AT)[0]
                    if src >= 0 and 0 < (off - src) % 4096 < _ALIASING:  # see _ALIGN_MIN: up to 63 zero bytes first
                        pad = _ALIASING - (off - src) % 4096
                        _pwrite_all(p.wfd, _ZEROS[:pad], off)
                        off += pad
                    _pwrite_all(p.wfd, data, off)
                    if hashing is not None:
                        s = hashing.result()
                    fault("cache.put_after_data")  # dies here: nothing committed, the end is not moved
                    mm[_FLAGS_AT] |= _DIRTY_FLAG
                    _SLOT28.pack_into(mm, base, off, off + n, s, fl)
                    fault("cache.put_torn_slot")
                    _U32.pack_into(mm, base + 28, _tag(i, off, off + n, s, fl))  # the slot is valid from here
                    fault("cache.put_after_slot")
                    _U64.pack_into(mm, _TOTAL_AT, total + n)
                    _U64.pack_into(mm, _COUNT_AT, _U64.unpack_from(mm, _COUNT_AT)[0] + 1)
                    _U64.pack_into(mm, _END_AT, off + n)
                    mm[_FLAGS_AT] &= ~_DIRTY_FLAG
                    if claim >= 0:
                        self._claim_done(claim)
                        claim = -1
                finally:
                    if claim >= 0:
                        os.close(claim)
                    self._unlock(p)
            return True
        finally:
            if hashing is not None:
                _Hasher.done()

    def __contains__(self, i: object) -> bool:
        """``i in cache``: index ``i`` has a record (False for anything that is not a valid index)."""
        try:
            k = self._check_index(i)
        except (InvalidInputError, InvalidTypeError):
            return False
        q = self._fq
        if q is not None:
            return bool(self._qe[k])
        mm = self._imm
        if mm is None:
            raise self._closed_error()
        if mm[_FLAGS_AT] & _FROZEN_FLAG and self._adopt_frozen():
            return k in self
        return self._slot_valid(mm, k, _HDR + _SLOT_SIZE * k)

    def __len__(self) -> int:
        """The cache's ``length`` (number of indices, not of records; see :attr:`count`)."""
        return self.length

    # -- live (unfrozen) internals -------------------------------------------------

    def _get_live(self, i: object) -> Optional[bytes]:
        k = self._check_index(i)
        mm = self._imm
        if mm is None:
            raise self._closed_error()
        if mm[_FLAGS_AT] & _FROZEN_FLAG and self._adopt_frozen():
            return self.get(k)
        base = _HDR + _SLOT_SIZE * k
        off, end, s, meta = _SLOT.unpack_from(mm, base)
        lo = meta & _M32
        if not lo & _PRESENT or meta >> 32 != _tag(k, off, end, s, lo) or end < off:
            return None  # empty, or being written right now (the tag is written last)
        fno = (lo >> 8) & 0xFFFFFF
        try:
            fd = self._read_fd(fno)
        except FileNotFoundError:
            if self._adopt_frozen():  # frozen in place meanwhile: data.0 became the frozen file
                return self.get(k)
            raise
        n = end - off
        b = pread_upto(fd, n, off)
        if len(b) != n or not _sum_ok(b, s, lo):
            assert self._dir is not None
            raise IntegrityError(
                f"index cache record {k} is corrupt: its checksum does not match (data file "
                f"{self._dir / f'data.{fno}'}, offset {off}, {n} bytes); the cache directory was damaged -- "
                "create a new cache"
            )
        return b

    def _slot_valid(self, mm: Any, i: int, base: int) -> bool:
        off, end, s, meta = _SLOT.unpack_from(mm, base)
        lo = meta & _M32
        return bool(lo & _PRESENT) and meta >> 32 == _tag(i, off, end, s, lo)

    def _after_fork(self) -> _Proc:
        """A forked child gets its own lock descriptor (flock is per open file) and data file."""
        old = self._proc
        old.close()  # the child's copies only; the parent's stay open
        self._proc = _Proc()
        return self._proc

    def _lock_path(self) -> Path:
        assert self._dir is not None
        return self._dir / "lock"

    def _lock(self, p: _Proc) -> None:
        if not p.mode:
            strategy, p.key = strategy_for(self._lock_path())
            p.mode = strategy.name
        if p.mode != "lease":
            if p.lock_fd < 0:
                p.lock_fd = os.open(self._lock_path(), os.O_RDWR | os.O_CLOEXEC)
            try:
                if p.mode == "flock":  # inline, the common case: a 1 KiB put is ~5 us, the wrappers were a tenth
                    try:
                        fcntl.flock(p.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        self._lock_wait(p)
                elif not self._try_lock(p):
                    self._lock_wait(p)
            except OSError as e:
                if e.errno not in LOCK_UNSUPPORTED:
                    raise
                degrade(p.key, self._lock_path(), e)  # ENOSYS and friends: leases, never a raw OSError
                p.mode = "lease"
        if p.mode == "lease":
            if p.lease is None:
                p.lease = FileLock(self._lock_path(), timeout=self.lock_timeout, what=f"index cache {self._dir}",
                                   mode=0o600)
            p.lease.acquire()
        if self._imm[_FLAGS_AT] & _DIRTY_FLAG:
            self._recount()

    @staticmethod
    def _try_lock(p: _Proc) -> bool:
        """One non-blocking attempt at the kernel lock (the store's strategy: flock or OFD fcntl)."""
        if p.mode == "posix":
            return ofd_lock(p.lock_fd, False)
        try:
            fcntl.flock(p.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    @staticmethod
    def _unlock(p: _Proc) -> None:
        if p.mode == "lease":
            assert p.lease is not None
            p.lease.release()
        elif p.mode == "posix":
            ofd_unlock(p.lock_fd)
        else:
            fcntl.flock(p.lock_fd, fcntl.LOCK_UN)

    def _claim(self, i: int) -> int:
        """Lease path: claim slot ``i`` by creating ``claim.<i>`` with O_EXCL: its descriptor, or -1 if
        another writer has it (live, or its record is committed).

        First-writer-wins must not rest on the lease alone: a holder presumed dead and
        taken over while still alive (stopped longer than the expiry) would otherwise
        commit a second record for the same index.  An exclusive create is atomic
        wherever leases work.  The claim names its writer (pid, host, pid namespace);
        a claim whose writer is this process (an earlier put that failed: threads of a
        process put one at a time) or is dead on this host is taken over -- under the
        lease, so by one writer only -- unless it says its record was committed
        (:meth:`_claim_done`).  That mark, not the slot as this process's memory map
        shows it, is what keeps a finished writer's record from being written twice: on
        FUSE mounts that lie about locks a map's view of another process's fresh slot
        was seen to lag (CI: one index won twice, by a live writer and the taker-over
        of a writer that had exited after committing it).
        """
        assert self._dir is not None
        path = self._dir / f"claim.{i}"
        me = f"{_pid} {_HOST} {_PIDNS}".encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            if not self._claimer_gone(path):
                return -1
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            _pwrite_all(fd, me, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _claim_done(fd: int) -> None:
        """Mark the claim open as ``fd`` committed (its slot is valid) and close it: never taken over."""
        try:
            _pwrite_all(fd, _CLAIM_DONE, os.fstat(fd).st_size)
        except OSError:
            pass  # the record is committed and put has won; only the extra guard is missing (full disk)
        finally:
            os.close(fd)

    @staticmethod
    def _claimer_gone(path: Path) -> bool:
        try:
            fd = os.open(path, _OPEN_FLAGS)
            try:
                words = os.pread(fd, 512, 0).decode("utf-8", "replace").split()
            finally:
                os.close(fd)
        except OSError:
            return False
        if not words:
            # Its writer died between the exclusive create and writing its name (the next syscall):
            # we hold the lease, so no live writer of this process group is in that window.
            return True
        if words[-1] == _CLAIM_DONE.decode().strip():
            return False  # committed: the record exists, whatever this process's map shows
        if len(words) != 3 or not words[0].isdigit() or words[1] != _HOST or words[2] != _PIDNS:
            return False  # hostile, or a writer on another host or in another container: not ours to judge
        pid = int(words[0])
        if pid == _pid:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: alive, another user's
            return False
        return False

    def _recount(self) -> None:
        """A writer died mid-commit (caller holds the lock): recount records and bytes from the slots."""
        import numpy as np

        mm = self._imm
        raw = np.frombuffer(mm, dtype=np.dtype(_SLOT_FIELDS), count=self.length, offset=_HDR).copy()
        off, end, s, meta = raw["off"], raw["end"], raw["sum"], raw["meta"]
        lo = meta & np.uint64(_M32)
        idx = np.arange(self.length, dtype=np.uint64)
        valid = (((lo & np.uint64(_PRESENT)) != 0) & ((meta >> np.uint64(32)) == _tags_np(idx, off, end, s, lo))
                 & (end >= off))
        _U64.pack_into(mm, _TOTAL_AT, int((end[valid] - off[valid]).sum()))
        _U64.pack_into(mm, _COUNT_AT, int(valid.sum()))
        # Appends resume after the last committed record (a dead writer's payload beyond it is overwritten).
        _U64.pack_into(mm, _END_AT, int(end[valid].max()) if valid.any() else _HDR)
        mm[_FLAGS_AT] &= ~_DIRTY_FLAG
        log.info("index cache %s: a writer died mid-put; recounted %d records", self._dir, int(valid.sum()))

    def _lock_wait(self, p: _Proc) -> None:
        # Contended: the holder keeps it for a few microseconds, so yield first, then
        # back off; give up after lock_timeout (a live holder stopped by a debugger).
        start = time.monotonic()
        spins = 0
        delay = 0.0001
        while True:
            if spins < 100:
                spins += 1
                os.sched_yield()
            else:
                time.sleep(delay)
                delay = min(delay * 2, 0.002)
            if self._try_lock(p):
                return
            if self.lock_timeout is not None and time.monotonic() - start > self.lock_timeout:
                raise LockTimeout(
                    f"timed out after {self.lock_timeout:g}s waiting for the lock of index cache "
                    f"{self._dir} (lock file {self._lock_path()}); another process holds it -- find it with "
                    f"`fuser {self._lock_path()}`"
                )

    def _open_writer(self, p: _Proc, i: int) -> None:
        """Open the shared data file for appending (its offsets are handed out under the lock)."""
        assert self._dir is not None
        try:
            p.wfd = os.open(self._dir / _DATA, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            if self._adopt_frozen():  # frozen in place meanwhile: the data file became the frozen file
                raise self._frozen_error(i) from None
            raise

    def _read_fd(self, fno: int) -> int:
        p = self._proc
        if p.pid != _pid:
            p = self._after_fork()
        fd = p.rfds.get(fno)
        if fd is None:
            assert self._dir is not None
            fd = os.open(self._dir / f"data.{fno}", os.O_RDONLY | os.O_CLOEXEC)
            p.rfds[fno] = fd
        return fd

    # -- freeze -------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        """True once no more puts are accepted (after :meth:`freeze` in any process)."""
        if self._fq is not None:
            return True
        mm = self._imm
        return mm is None or bool(mm[_FLAGS_AT] & _FROZEN_FLAG)

    def freeze(self) -> None:
        """Accept no more puts; from now on every process reads lock-free from a memory map.

        Idempotent, and callable from any process that shares the cache: the first call
        writes the frozen file (canonical layout: the same records always give the same
        bytes), later ones map it.  A put racing with freeze either lands in the frozen
        file or raises :class:`~casstore.FrozenError`.  The frozen cache still dies with
        the run unless :meth:`preserve` keeps it.  On a full disk freeze raises
        :class:`~casstore.errors.DiskFullError` and the cache stays live (puts work again
        once space is freed; so does a second freeze).
        """
        if self._fq is not None:
            return
        mm = self._imm
        if mm is None:
            raise self._closed_error()
        assert self._dir is not None
        p = self._proc
        if p.pid != _pid:
            p = self._after_fork()
        with p.tlock:
            self._lock(p)
            try:
                flags = _U32.unpack_from(mm, _FLAGS_AT)[0]
                _U32.pack_into(mm, _FLAGS_AT, flags | _FROZEN_FLAG)
                if not (self._dir / "frozen").exists():
                    try:
                        self._build_frozen(p)
                    except OSError as e:
                        # Nothing was published (the frozen file appears by rename, last):
                        # undo the flag so the cache is exactly as before this call.
                        _U32.pack_into(mm, _FLAGS_AT, flags)
                        raise disk_full(e, self._dir, "freezing an index cache") from None
            finally:
                self._unlock(p)
        if not self._adopt_frozen():  # pragma: no cover - removed behind our back
            raise StoreFormatError(f"index cache {self._dir}: the frozen file vanished while freezing")

    def _build_frozen(self, p: _Proc) -> None:
        """Turn the data file into ``<dir>/frozen`` in place (caller holds the lock, frozen flag set).

        Every payload is appended under the lock, so ``data.0`` holds exactly the
        committed records back to back (in the order they were put) up to the data
        end: the table and footer are appended after it and the file is renamed.
        Nothing is copied whatever order or processes wrote the records.  No writer
        can touch the file afterwards: writes happen only under the lock, after a
        check of the frozen flag.
        """
        import numpy as np

        assert self._dir is not None
        d = self._dir
        L = self.length
        raw = np.frombuffer(self._imm, dtype=np.dtype(_SLOT_FIELDS), count=L, offset=_HDR).copy()
        off, end, s, meta = raw["off"], raw["end"], raw["sum"], raw["meta"]
        del raw
        lo = meta & np.uint64(_M32)
        idx = np.arange(L, dtype=np.uint64)
        valid = (((lo & np.uint64(_PRESENT)) != 0) & ((meta >> np.uint64(32)) == _tags_np(idx, off, end, s, lo))
                 & (end >= off))
        pres = np.flatnonzero(valid)
        total = int((end[pres] - off[pres]).sum()) if len(pres) else 0
        data_end = int(_U64.unpack_from(self._imm, _END_AT)[0])
        # Records sit back to back from offset 64, large ones after up to 63 zero bytes (_ALIGN_MIN).
        if (data_end < _HDR + total or data_end - _HDR - total > _ALIASING * len(pres)
                or (len(pres) and (int(off[pres].min()) < _HDR or int(end[pres].max()) != data_end))):
            raise IntegrityError(f"index cache {d}: its index does not match its data file (records {total} bytes, "
                                 f"data end {data_end}); the cache directory was damaged -- create a new cache")
        table = np.zeros(L, dtype=np.dtype(_SLOT_FIELDS))
        table["sum"] = np.uint64(_MISSING_SUM)
        flags = lo[pres] & np.uint64(0xFF)  # the data file number (bits 8-31) is 0 in a frozen table
        table["off"][pres] = off[pres]
        table["end"][pres] = end[pres]
        table["sum"][pres] = s[pres]
        table["meta"][pres] = flags | (_tags_np(pres.astype(np.uint64), off[pres], end[pres], s[pres], flags)
                                       << np.uint64(32))
        tbytes = table.tobytes()
        table_off = (data_end + 7) & ~7
        footer = self._footer(L, table_off, data_end, len(pres), total, _crc32(tbytes))
        tail = b"\0" * (table_off - data_end) + tbytes + footer
        src = d / _DATA
        if p.wfd < 0:
            p.wfd = os.open(src, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        if os.fstat(p.wfd).st_size < data_end:
            raise IntegrityError(f"index cache {d}: {src} is shorter than its records; the cache directory was "
                                 "damaged -- create a new cache")
        # A writer or freezer that died left bytes past the data end: drop them, then append.
        os.ftruncate(p.wfd, data_end)
        _pwrite_all(p.wfd, tail, data_end)
        if self.verify_mode == "open":
            self._check_all_records(p.wfd, table, pres, src)
        fault("cache.freeze_built")
        os.rename(src, d / "frozen")
        os.close(p.wfd)
        p.wfd = -1

    def _check_all_records(self, fd: int, table: np.ndarray, pres: np.ndarray, path: Path) -> None:
        """verify="open": check every record of a new frozen file once, before it is published."""
        size = os.fstat(fd).st_size
        if not size:
            return
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            bad = [int(i) for i, o, e, sm, me in zip(pres.tolist(), table["off"][pres].tolist(),
                                                     table["end"][pres].tolist(), table["sum"][pres].tolist(),
                                                     table["meta"][pres].tolist(), strict=True)
                   if not _sum_ok(mm[o:e], sm, me & _M32)]
        if bad:
            raise IntegrityError(f"index cache {self._dir}: records {bad[:10]} are corrupt (checksum mismatch) "
                                 f"in {path}; not freezing -- create a new cache")

    @staticmethod
    def _footer(length: int, table_off: int, data_end: int, count: int, total: int, table_crc: int) -> bytes:
        body = _FOOTER.pack(_FOOT_MAGIC, FORMAT, _SLOT_SIZE, length, table_off, data_end, count, total,
                            table_crc, 0)[:-4]
        return body + _U32.pack(_crc32(body))

    def _adopt_frozen(self) -> bool:
        """Map ``<dir>/frozen`` if it exists (the cache was frozen, perhaps by another process)."""
        if self._fq is not None:
            return True
        assert self._dir is not None
        path = self._dir / "frozen"
        try:
            # Whoever froze it checked it (verify="open"); this process checks every read otherwise.
            fd = _open_private(path)
        except FileNotFoundError:
            return False
        self._map_frozen(fd, path, whole=None, check=_CHECKS[self.verify_mode], what=f"index cache {self._dir}")
        return True

    def _map_frozen(self, fd: int, path: Path, *, whole: Optional[Digest], check: str, what: str) -> None:
        """Map the frozen file open as ``fd`` (owned from here on) and validate its header, footer
        and table (and whole digest).

        The file is untrusted input: every field is checked against the file's size
        before it is used, and every table entry against the data region (once, here:
        the frozen gets slice the map without a bounds test), so a damaged or hostile
        file is a typed error, never an out-of-range map access nor bytes of the
        table or footer returned as a record.
        """
        mm: Any = None
        try:
            size = os.fstat(fd).st_size
            if whole is not None:
                got = hash_fd(fd, size)
                if got != whole:
                    raise IntegrityError(
                        f"{what} is corrupt: object {whole} hashes to {got} (file {path}); "
                        "run `casstore verify` and rebuild the cache"
                    )
            if size < _HDR + _FOOTER.size:
                raise IntegrityError(f"{what}: {path} is not an index cache file (too short: {size} bytes)")
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            magic, fmt = _FILE_HEADER.unpack_from(mm, 0)
            if magic != _FILE_MAGIC:
                raise IntegrityError(f"{what}: {path} is not an index cache file (no {_FILE_MAGIC!r} header)")
            if fmt > FORMAT:
                raise StoreFormatError(f"{what}: file format {fmt} is newer than this casstore ({FORMAT}); "
                                       "upgrade casstore")
            fo = size - _FOOTER.size
            (fmagic, ffmt, slot, length, table_off, data_end, count, total, tcrc,
             fcrc) = _FOOTER.unpack_from(mm, fo)
            if fmagic != _FOOT_MAGIC or fcrc != _crc32(mm[fo:fo + _FOOTER.size - 4]):
                raise IntegrityError(f"{what}: the footer of {path} is damaged or missing (truncated file?)")
            if ffmt > FORMAT:
                raise StoreFormatError(f"{what}: file format {ffmt} is newer than this casstore; upgrade casstore")
            if (slot != _SLOT_SIZE or table_off % 8 or table_off + _SLOT_SIZE * length != fo
                    or not _HDR + total <= data_end <= table_off
                    or (fmt < 2 and data_end != _HDR + total)):  # format 2: padding before large records
                raise IntegrityError(f"{what}: the footer of {path} does not match the file's size; it is damaged")
            pad = mm[data_end:table_off]
            if fmt < 1 or mm[:_HDR] != _FILE_HEADER.pack(_FILE_MAGIC, fmt) or pad.count(0) != len(pad):
                raise IntegrityError(f"{what}: reserved bytes of {path} are not zero; the file is damaged")
            table = mm[table_off:fo]  # one copy for the CRC and the bounds: no view of the map outlives them
            if _crc32(table) != tcrc:
                raise IntegrityError(f"{what}: the index table of {path} is damaged (CRC-32 mismatch); "
                                     "rebuild the cache")
            # The CRCs only say the table is as its writer left it, not that its writer was honest:
            # every entry read as present must lie in the data region, checked here once so that no
            # frozen get has to (a slice of the map past its end is b'', and one over the table or
            # footer returns those bytes -- both passed their checksum when it was forged to match).
            bad = _out_of_bounds(table, int(data_end))
            del table
            if bad is not None:
                i, o, e = bad
                raise IntegrityError(
                    f"{what}: record {i} lies outside the data region of {path} (offset {o}, end {e}; a record "
                    f"must lie in {_HDR} <= offset <= end <= data end {data_end}); the file is damaged or forged "
                    "-- rebuild the cache"
                )
            tv = memoryview(mm)[table_off:fo]
            if _LITTLE:
                q: Any = tv.cast("Q")
            else:  # pragma: no cover - big-endian hosts decode the table once
                import numpy as np

                q = np.frombuffer(tv, dtype="<u8").tolist()
                tv.release()
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise
        self.length = int(length)
        self._fmm, self._fq, self._ffd, self._fpath = mm, q, fd, path
        # Strided views: offsets, ends, checksums, meta of every index (no arithmetic per get).
        self._qo, self._qe, self._qs, self._qm = q[0::4], q[1::4], q[2::4], q[3::4]
        if check == "first":
            # One byte per index, zero until that record has been checked in this process.
            # Anonymous and private: pages cost memory only once touched (a 10^8-index
            # cache does not allocate 100 MB at open), and a forked worker starts from
            # what its parent had checked (the same file's bytes).
            self._seen = mmap.mmap(-1, max(1, int(length)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if type(self) in _SWAPPABLE:  # frozen for good: switch to the lock-free read path
            self.__class__ = _FROZEN_CLASSES[check]
        self._fcheck = check
        self._fcount, self._ftotal = int(count), int(total)
        self._ffmt = int(fmt)

    # -- preserve -----------------------------------------------------------------

    def preserve(self, name: str, *, overwrite: bool = False) -> Digest:
        """Freeze, then keep the cache as one object pinned under ``name``; return the object's digest.

        The frozen file becomes the object without a second copy: it is named by its
        BLAKE3-256 (in the creating process mostly computed while the cache was filled,
        see ``_Follower``), fsynced, then hard-linked into ``objects/``.  A manifest with
        one entry (``"index-cache"``) and meta ``{"kind": "casstore.index-cache", "length": N,
        "format": 2}`` is written, then pinned: the name appears only once everything
        it needs is durable, so a crash leaves the name absent or complete.  Identical
        runs store one object and preserving again under the same name is a no-op; a name
        already pinned to something else raises :class:`~casstore.FrozenError` unless
        ``overwrite`` (then the pin moves to this cache, atomically).  A full
        disk raises :class:`~casstore.errors.DiskFullError`; preserving again once space
        is freed completes the job.
        """
        name = validate_name(name)
        self.freeze()
        fault("cache.preserve_after_freeze")
        assert self._fpath is not None
        d = self.digest
        if d is None:
            # Hashed while it was filled (see _Follower), else hashed now by adopt.
            f = self._follower
            known = f.finish(self._ffd, os.fstat(self._ffd).st_size) if f is not None else None
            d = self.store.objects.adopt(self._fpath, link=True, digest=known)
        fault("cache.preserve_after_object")
        size = os.fstat(self._ffd).st_size
        meta = {"kind": KIND, "length": self.length, "format": FORMAT}
        mdata = encode_manifest({ENTRY_KEY: Entry(d, size)}, meta, None)
        md = self.store.objects.put(mdata, compress=False)
        fault("cache.preserve_after_manifest")
        try:
            pin(self.store, name, md, force=overwrite)
        except FrozenError as e:
            raise FrozenError(
                f"cannot preserve index cache {self._dir or self._fpath} as {name!r}: that name is already pinned "
                f"to a different cache ({e}); choose a new name (e.g. {name + '-v2'!r}) or unpin the old one"
            ) from None
        self.digest, self.name, self._manifest_digest = d, name, md
        return d

    # -- information --------------------------------------------------------------

    @property
    def count(self) -> int:
        """Number of indices that have a record."""
        if self._fq is not None:
            return self._fcount
        return int(_U64.unpack_from(self._settled(), _COUNT_AT)[0])

    @property
    def nbytes(self) -> int:
        """Payload bytes stored (the sum of the records' lengths)."""
        if self._fq is not None:
            return self._ftotal
        return int(_U64.unpack_from(self._settled(), _TOTAL_AT)[0])

    def _settled(self) -> Any:
        """The live index map, its counters exact: a writer that died mid-put is accounted for."""
        mm = self._imm
        if mm is None:
            raise self._closed_error()
        if mm[_FLAGS_AT] & _DIRTY_FLAG:
            p = self._proc
            if p.pid != _pid:
                p = self._after_fork()
            with p.tlock:
                self._lock(p)  # recounts if the commit's writer is dead
                self._unlock(p)
        return mm

    @property
    def path(self) -> Optional[Path]:
        """The frozen file (read-only; mode 0444 once preserved), or None before freeze."""
        return self._fpath

    def info(self) -> CacheInfo:
        """A JSON-able summary: name, digest, length, records, bytes, frozen, verify mode, file."""
        return {
            "name": self.name,
            "digest": str(self.digest) if self.digest else None,
            "manifest": str(self._manifest_digest) if self._manifest_digest else None,
            "length": self.length,
            "records": self.count,
            "bytes": self.nbytes,
            "frozen": self.frozen,
            "verify": self.verify_mode,
            "file": str(self._fpath) if self._fpath else None,
            "file_bytes": os.fstat(self._ffd).st_size if self._ffd >= 0 else None,
            "format": self._ffmt,  # the frozen file's (a format-1 cache stays format 1)
        }

    def verify(self) -> int:
        """Check every record's checksum (and a preserved object's whole digest); return the record count.

        Raises :class:`~casstore.IntegrityError` naming the first damaged indices.
        """
        if self._fq is None:
            bad = []
            for i in range(self.length):
                try:
                    self._get_live(i)
                except IntegrityError:
                    bad.append(i)
            if bad:
                raise IntegrityError(f"index cache {self._dir}: records {bad[:10]} are corrupt; create a new cache")
            return self.count
        if self.digest is not None:
            got = hash_fd(self._ffd, os.fstat(self._ffd).st_size)
            if got != self.digest:
                raise IntegrityError(f"index cache object {self.digest} is corrupt: it hashes to {got} "
                                     f"(file {self._fpath})")
        q = self._fq
        mm = self._fmm
        bad = []
        for i in range(self.length):
            j = 4 * i
            meta = q[j + 3]
            if q[j + 1]:
                if not meta & _PRESENT or not _sum_ok(mm[q[j]:q[j + 1]], q[j + 2], meta & _M32):
                    bad.append(i)
            elif q[j] or q[j + 2] != _MISSING_SUM or meta:
                bad.append(i)
        if bad:
            raise IntegrityError(f"index cache {self.name or self._fpath}: records {bad[:10]} are corrupt "
                                 f"(checksum mismatch) in {self._fpath}")
        return self._fcount

    # -- errors -------------------------------------------------------------------

    def _label(self) -> str:
        if self.name:
            return f"index cache {self.name!r}"
        return f"index cache {self._dir or self._fpath}"

    def _check_index(self, i: object) -> int:
        try:
            if isinstance(i, bool):  # operator.index(True) == 1: a bool is a mistake, not index 1
                raise TypeError
            k = operator.index(i)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidTypeError(
                f"{self._label()}: an index must be an int, not {type(i).__name__} ({i!r:.40})"
            ) from None
        if not 0 <= k < self.length:
            raise CacheIndexError(
                f"{self._label()}: index {k} is out of range; valid indices are 0..{self.length - 1} "
                f"(length {self.length})"
            )
        return k

    def _index_error(self, i: object) -> CasstoreError:
        try:
            self._check_index(i)
        except (InvalidTypeError, CacheIndexError) as e:
            return e
        return CacheIndexError(f"{self._label()}: bad index {i!r}")  # pragma: no cover

    def _as_buffer(self, i: object, data: object) -> Buffer:
        if isinstance(data, (bytes, bytearray)):
            return data
        if isinstance(data, memoryview):
            try:
                return data if data.format == "B" and data.ndim == 1 and data.contiguous else memoryview(
                    data.tobytes())
            except ValueError:  # every attribute of a released memoryview raises ValueError
                raise InvalidInputError(
                    f"{self._label()}: put({i!r}, ...) was given a released memoryview; pass the bytes "
                    "while the memoryview is alive (or bytes(view) before releasing it)"
                ) from None
        # Hazard (found by a bug hunt): only the three types above were taken, so pfio code that
        # puts a numpy array, array.array or mmap (pfio writes any buffer) failed on switching.
        # Any other object with the buffer protocol is taken as its bytes, without a copy, when
        # C-contiguous; a strided one is refused (its bytes are not one run: say how to get them).
        try:
            view = memoryview(data)  # type: ignore[arg-type]  # non-buffers raise TypeError here
        except TypeError:
            raise InvalidTypeError(
                f"{self._label()}: put({i!r}, ...) takes bytes, bytearray or memoryview (or another buffer: a "
                f"numpy array, array.array, mmap), not {type(data).__name__}; encode the sample first "
                "(pickle.dumps(x), s.encode(), or numpy's tobytes())"
            ) from None
        if not view.c_contiguous:
            view.release()
            raise InvalidTypeError(
                f"{self._label()}: put({i!r}, ...) was given a non-contiguous {type(data).__name__} buffer; pass "
                "a C-contiguous copy (numpy.ascontiguousarray(x) or x.tobytes())"
            )
        return view.cast("B")

    def _missing(self, i: int) -> Optional[bytes]:
        """An absent index reads as None -- if its table entry is exactly the 'absent' pattern."""
        if self._qo[i] or self._qs[i] != _MISSING_SUM or self._qm[i]:
            raise self._corrupt(i)
        return None

    def _corrupt(self, i: int) -> IntegrityError:
        return IntegrityError(
            f"{self._label()}: record {i} is corrupt (its checksum does not match; file {self._fpath}); "
            "the damaged bytes were not returned -- rebuild the cache or run `casstore verify`"
        )

    def _frozen_error(self, i: int) -> CasstoreError:
        if self._fq is None and self._imm is None:
            return self._closed_error()
        return FrozenError(
            f"{self._label()} is frozen: put({i}, ...) is refused; create a new IndexCache to cache more "
            "(a frozen cache is read-only for every process)"
        )

    def _closed_error(self) -> CasstoreError:
        return InvalidInputError(f"{self._label()} is closed; open it again")

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Release maps and descriptors.  In the process that created a live cache this also
        removes its temp directory (a preserved object stays in the store)."""
        views = [self._qo, self._qe, self._qs, self._qm, self._fq]
        self._qo = self._qe = self._qs = self._qm = self._fq = None
        for v in views:
            if isinstance(v, memoryview):
                v.release()
        if type(self) in _SWAPPABLE:
            self.__class__ = IndexCache
        for attr in ("_fmm", "_imm", "_seen"):
            m = getattr(self, attr)
            setattr(self, attr, None)
            if m is not None:
                m.close()
        self._finalizer()  # descriptors, helper thread, and the live directory in its creator (_release)

    def __enter__(self) -> IndexCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "frozen" if self._fq is not None else ("closed" if self._imm is None else "live")
        label = f" {self.name!r}" if self.name else ""
        return f"<IndexCache{label} length={self.length} {state}>"

    # -- pickling (spawned workers) -------------------------------------------

    def __getstate__(self) -> Dict[str, Any]:
        if self._fq is None and self._imm is None:
            raise self._closed_error()
        return {
            # The store pickles as itself (its settings and layers); reopening it by path
            # would need the facade, which a feature never imports (layer rule).
            "store": self.store, "length": self.length,
            "max_bytes": self.max_bytes, "verify": self.verify_mode, "lock_timeout": self.lock_timeout,
            "name": self.name, "digest": str(self.digest) if self.digest else None,
            "manifest": str(self._manifest_digest) if self._manifest_digest else None,
            "dir": str(self._dir) if self._dir else None,
            "frozen": str(self._fpath) if self._fq is not None and self._fpath else None,
            "check": self._fcheck,
        }

    def __setstate__(self, st: Dict[str, Any]) -> None:
        self._init_fields(_check_store(st["store"]), st["length"], st["max_bytes"], st["verify"],
                          st["lock_timeout"])
        self.name = st["name"]
        self.digest = Digest.parse(st["digest"]) if st["digest"] else None
        self._manifest_digest = Digest.parse(st["manifest"]) if st["manifest"] else None
        self._dir = Path(st["dir"]) if st["dir"] else None
        gone = ObjectNotFoundError(
            f"index cache {self._dir} no longer exists: the process that created it closed it or exited; "
            "keep the IndexCache open in the main process while workers use it"
        )
        if st["frozen"]:
            # The sending process already checked this file as its mode asks; only records are checked here.
            if self.digest is not None:  # preserved: the object, opened through the object layer
                path = Path(self.store.objects.locate(self.digest).path)
                ffd, _ = open_object_file(str(path), self.digest)
            else:
                path = Path(st["frozen"])
                try:
                    ffd = _open_private(path)
                except FileNotFoundError:
                    raise gone from None
            self._map_frozen(ffd, path, whole=None, check=st["check"], what=self._label())
            return
        assert self._dir is not None
        try:
            fd = os.open(self._dir / "index", os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise gone from None
        self._ifd = fd
        self._imm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if self._imm[_FLAGS_AT] & _FROZEN_FLAG:
            self._adopt_frozen()


# _FROZEN_INDEX: the frozen gets type-check their index only on the error path, where the
# comparison or the table lookup failed, and _index_error then raises what the live get raises
# (_check_index).  Hazard: ``i < 0`` on a numpy array is an array whose truth value raises
# ValueError ("ambiguous"; empty arrays too, numpy >= 2.2), which escaped raw; a one-element array
# passes the comparison and fails the lookup with TypeError (no __index__).  A ``type(i) is int``
# test up front instead cost numpy-integer indices ~40 ns per get (+13%, verify="once").
def _frozen_get_checked(self: IndexCache, i: int) -> Optional[bytes]:
    """:meth:`IndexCache.get` of a frozen cache that checks each record (verify "full"/"record")."""
    try:
        if i < 0 or i is True or i is False:  # a bool is not an index (True would read record 1)
            raise IndexError
        e = self._qe[i]
    except (IndexError, TypeError, ValueError):  # ValueError: see _FROZEN_INDEX
        raise self._index_error(i) from None
    if e:
        b: bytes = self._fmm[self._qo[i]:e]
        m = self._qm[i]
        if m & _XXH3:
            if _xxh3(b) != self._qs[i]:
                raise self._corrupt(i)
        elif not _sum_ok(b, self._qs[i], m):
            raise self._corrupt(i)
        return b
    return self._missing(i)


def _frozen_get_fast(self: IndexCache, i: int) -> Optional[bytes]:
    """:meth:`IndexCache.get` of a frozen cache checked once (verify="open"): the mapped bytes as they are."""
    try:
        if i < 0 or i is True or i is False:  # a bool is not an index (True would read record 1)
            raise IndexError
        e = self._qe[i]
    except (IndexError, TypeError, ValueError):  # ValueError: see _FROZEN_INDEX
        raise self._index_error(i) from None
    if e:
        b: bytes = self._fmm[self._qo[i]:e]
        return b
    return self._missing(i)


def _frozen_get_once(self: IndexCache, i: int) -> Optional[bytes]:
    """:meth:`IndexCache.get` of a frozen cache with verify="once": a record is checked the first time this
    process reads it (the returned copy is what is checked), then remembered as checked."""
    try:
        if i < 0 or i is True or i is False:  # a bool is not an index (True would read record 1)
            raise IndexError
        e = self._qe[i]
    except (IndexError, TypeError, ValueError):  # ValueError: see _FROZEN_INDEX
        raise self._index_error(i) from None
    if e:
        b: bytes = self._fmm[self._qo[i]:e]
        seen = self._seen
        if not seen[i]:
            m = self._qm[i]
            if m & _XXH3:
                if _xxh3(b) != self._qs[i]:
                    raise self._corrupt(i)
            elif not _sum_ok(b, self._qs[i], m):
                raise self._corrupt(i)
            seen[i] = 1
        return b
    return self._missing(i)


class _FrozenChecked(IndexCache):
    """A frozen IndexCache whose gets check each record's checksum.

    ``IndexCache`` switches its own instances to this class once frozen, so the hot
    path tests no state; ``isinstance(x, IndexCache)`` still holds.
    """

    __slots__ = ()
    get = _frozen_get_checked


class _FrozenFast(IndexCache):
    """A frozen IndexCache checked once (verify="open")."""

    __slots__ = ()
    get = _frozen_get_fast


class _FrozenOnce(IndexCache):
    """A frozen IndexCache that checks each record the first time this process reads it (verify="once")."""

    __slots__ = ()
    get = _frozen_get_once


# Hazard (found by a bug hunt): ``pickle.dumps(cache.get)`` pickles a bound method as
# ``getattr(cache, get.__func__.__name__)``; named ``_frozen_get_once``, the frozen gets were
# looked up under that name in the unpickling process, which failed there, so
# ``Pool().map(cache.get, ...)`` on a frozen cache hung forever (the worker's result never came
# back).  They are the class's ``get``, so they answer to that name: set once here, no cost per get.
for _f in (_frozen_get_checked, _frozen_get_fast, _frozen_get_once):
    _f.__name__ = "get"
del _f

_SWAPPABLE = (IndexCache, _FrozenChecked, _FrozenFast, _FrozenOnce)
_CHECKS = {"once": "first", "full": "every", "record": "every", "open": "none"}  # verify mode -> frozen-get check
_FROZEN_GETS: Dict[str, Callable[[IndexCache, int], Optional[bytes]]] = {
    "every": _frozen_get_checked, "first": _frozen_get_once, "none": _frozen_get_fast}
_FROZEN_CLASSES: Dict[str, type] = {"every": _FrozenChecked, "first": _FrozenOnce, "none": _FrozenFast}
