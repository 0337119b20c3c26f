"""The object store: content-addressed, immutable objects in a local directory.

Invariants (docs/design.md):

1. An object file, once visible under its name, holds exactly the bytes that
   hash to that name: it is staged in ``tmp/`` under a name unique to the
   writer, fsynced, made read-only and renamed into place; then its directory
   is fsynced.  Two writers of the same content both succeed.
4. Correctness of objects never depends on a lock.
7. ``get`` never returns bytes that do not hash to the digest asked for when
   verification is on.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import (
    IO,
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Tuple,
    Union,
)

from . import _codec
from ._fs import Staging, copy_range, fsync_dir, sweep_stale, syncfs, write_file_atomic
from ._layout import (
    CONFIG_FILE,
    RAW,
    SUBDIRS,
    TMP,
    ZSTD,
    iter_object_files,
    object_path,
)
from .config import StoreConfig
from .digest import Digest, hash_bytes, new_hasher, parse_prefix
from .errors import (
    AmbiguousDigestError,
    CompressedObjectError,
    IntegrityError,
    InvalidTypeError,
    ObjectNotFoundError,
    ReadOnlyError,
    StoreFormatError,
)

if TYPE_CHECKING:
    from .gc import GCPlan, LimitResult, Usage
    from .manifest import Diff, EditTransaction, Manifest
    from .verify import VerifyReport

__all__ = ["Store", "ObjectInfo", "open_store", "DigestLike", "PathLike"]

DigestLike = Union[Digest, str]
PathLike = Union[str, "os.PathLike[str]"]

CHUNK = 1 << 20  # streaming chunk: bounded memory, large enough for fast hashing
_READ_BUFFER = 256 << 10  # BufferedReader size for open(): see Store.open
# Below this size get() reads then hashes; above it a helper thread hashes
# while the caller's thread reads.  Starting a thread and mapping windows
# cost more than they save on small objects (4 MiB: 6.1 vs 8.4 GB/s here).
_OVERLAP_MIN = 16 << 20
_HASH_WINDOW = 32 << 20  # mmap window when hashing a staged file (bounds RSS)
_BATCH = 512  # put_many: objects staged per filesystem sync

# zstd objects end with a skippable frame holding the uncompressed size, so
# stat() needs no decompression; decoders skip it (see docs/format.md).


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What ``Store.stat`` knows about one object without reading it."""

    digest: Digest
    size: int
    """Uncompressed size in bytes."""
    stored_size: int
    """Bytes on disk."""
    codec: str
    """``"raw"`` or ``"zstd"``."""


def _as_buffer(data: object, what: str = "put") -> memoryview:
    if isinstance(data, (bytes, bytearray, memoryview)):
        mv = memoryview(data)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    raise InvalidTypeError(
        f"{what}() takes bytes, bytearray or memoryview, not {type(data).__name__}; "
        "encode text first (s.encode()) or use put_path()/put_stream() for files"
    )




def _load_config(root: Path) -> StoreConfig:
    try:
        return StoreConfig.load(root)
    except NotADirectoryError:  # root (or a parent) is a file
        raise StoreFormatError(f"{root} is not a directory, so not a casstore store") from None


def _hash_fd(fd: int, size: int, *, threaded: bool = True) -> Digest:
    """Hash a file through bounded mmap windows (no copy; RSS stays bounded).

    ``threaded=False`` when another thread is busy reading the same data (the
    second core is then the hasher's, and blake3's pool would only contend).
    """
    h = new_hasher(threaded=threaded)
    off = 0
    while off < size:
        n = min(_HASH_WINDOW, size - off)
        with mmap.mmap(fd, n, prot=mmap.PROT_READ, offset=off) as mm:
            h.update(mm)
        off += n
    return Digest(h.hexdigest())


def _copy_fd(src: int, dst: int, size: int) -> None:
    """Copy ``size`` bytes from offset 0 (in the kernel where possible); refuse a shrinking source."""
    off = copy_range(src, dst, size)
    if off != size:
        raise IntegrityError(f"source file shrank while it was being stored ({off} of {size} bytes)")


class _ObjectReader(io.RawIOBase):
    """Read-only stream over one object; verifies the digest at end of file.

    Verification covers full sequential reads: if every byte was read in
    order, reaching EOF compares the hash and raises IntegrityError on a
    mismatch *before* returning the final chunk.  A ``seek`` turns
    verification off for this reader (it can no longer see every byte).
    """

    def __init__(self, digest: Digest, path: str, codec: str, verify: bool, size: int) -> None:
        super().__init__()
        self._size = size
        self._seen = 0
        self.digest = digest
        self.name = path
        self._file: BinaryIO = open(path, "rb", buffering=0)
        self._src: Any = self._file if codec == RAW else _codec.open_decoded(self._file)
        self._codec = codec
        # Single-threaded: fed 1 MiB updates, blake3's pool ran slower here
        # (6.1-6.4 GB/s against 7.0 GB/s).
        self._hasher = new_hasher() if verify else None
        self._checked = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._codec == RAW

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if self._codec != RAW:
            raise io.UnsupportedOperation("compressed objects are read sequentially")
        pos = self._file.seek(offset, whence)
        if pos != self._seen:
            # Not where the hash has got to: this reader can no longer see
            # every byte in order, so it stops verifying (documented).
            self._hasher = None
        return pos

    def tell(self) -> int:
        if self._codec != RAW:
            return int(self._src.tell())
        return self._file.tell()

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        try:
            n: int = self._src.readinto(mv)
        except _codec.DecodeError as e:
            raise IntegrityError(
                f"object {self.digest} is corrupt: its zstd data cannot be decoded ({e}); file {self.name}"
            ) from None
        if self._checked and n and self._hasher is not None:
            raise IntegrityError(f"object {self.digest} is longer than its recorded size; file {self.name}")
        if self._hasher is not None and not self._checked:
            if n:
                self._hasher.update(mv[:n])
                self._seen += n
            # Check as soon as the last byte is read (before handing it out),
            # not only when the caller asks past the end.
            if self._seen >= self._size or n == 0:
                self._check()
        return n

    def _check(self) -> None:
        assert self._hasher is not None
        self._checked = True
        got = self._hasher.hexdigest()
        if got != self.digest.hex or self._seen != self._size:
            raise IntegrityError(
                f"object {self.digest} is corrupt: its bytes hash to blake3:{got} "
                f"({self._seen} of {self._size} bytes); file {self.name}. "
                "Run `casstore verify --repair` and put the data again"
            )

    def close(self) -> None:
        if not self.closed:
            try:
                if self._src is not self._file:
                    self._src.close()
            finally:
                self._file.close()
        super().close()


class Store:
    """A content-addressed object store rooted at a local directory.

    Create or open one with :func:`casstore.open`.  Objects are immutable and
    addressed by the BLAKE3 digest of their uncompressed bytes.
    """

    def __init__(self, root: PathLike, *, create: bool = True, compress: Any = None,
                 durable: Optional[bool] = None, shared: bool = False) -> None:
        self.root = Path(os.path.expanduser(os.fspath(root))).absolute()
        if create and not (self.root / CONFIG_FILE).exists():
            self._init_layout(StoreConfig(
                compression="zstd" if _codec.normalize_compress(compress, 3) else "raw",
                level=_codec.normalize_compress(compress, 3) or 3,
                durable=True if durable is None else durable,
                shared=shared,
            ))
        self.config = _load_config(self.root)
        self._level = self.config.level
        self.compress: Any = compress if compress is not None else (
            self._level if self.config.compression == ZSTD else None)
        self.durable: bool = self.config.durable if durable is None else durable
        self._tmp = self.root / TMP
        self.writable = os.access(self.root / TMP, os.W_OK)
        if self.writable:
            try:
                sweep_stale(self._tmp)
            except OSError:  # pragma: no cover - e.g. a read-only bind mount
                pass

    # -- creation ---------------------------------------------------------

    def _init_layout(self, cfg: StoreConfig) -> None:
        root = self.root
        if root.exists():
            if not root.is_dir():
                raise StoreFormatError(f"{root} exists and is not a directory")
            entries = set(os.listdir(root)) - {s.split("/")[0] for s in SUBDIRS}
            if entries == {CONFIG_FILE}:
                return  # another process created this store since our check: use it
            if entries:
                raise StoreFormatError(
                    f"{root} is not empty and is not a casstore store (no {CONFIG_FILE}); "
                    "choose an empty or new directory"
                )
        try:
            for sub in SUBDIRS:
                (root / sub).mkdir(parents=True, exist_ok=True)
            if cfg.shared:  # setgid, group-writable dirs and lock files (docs/maintenance.md)
                from ._shared import share_layout

                share_layout(root)
            # store.toml is written last: its presence marks a complete store.
            # Two processes creating the same store write identical bytes.
            write_file_atomic(root / TMP, root / CONFIG_FILE, cfg.to_toml(), mode=0o444)
            fsync_dir(root)
        except PermissionError as e:
            raise ReadOnlyError(f"cannot create a store at {root}: {e.strerror}") from None

    # -- helpers ----------------------------------------------------------

    def _digest(self, d: DigestLike) -> Digest:
        return d if isinstance(d, Digest) else Digest.parse(d)

    def _locate(self, d: Digest) -> Tuple[str, str]:
        """Return (path, codec) of an existing object or raise ObjectNotFoundError."""
        for codec in (RAW, ZSTD):
            p = object_path(self.root, d, codec)
            if os.path.exists(p):
                return str(p), codec
        raise ObjectNotFoundError(
            f"object {d} is not in the store at {self.root}; put it first or fetch it from a remote"
        )

    def _exists(self, d: Digest) -> bool:
        return any(os.path.exists(object_path(self.root, d, c)) for c in (RAW, ZSTD))

    def _touch(self, d: Digest) -> bool:
        """Dedupe check for puts: True if the object exists, refreshing its mtime.

        A re-put object is "fresh" again, so GC's grace period protects it
        while the writer goes on to reference it (docs/maintenance.md).  One
        ``utime`` replaces the ``stat``; a file GC removed meanwhile gives
        False and the caller writes a new copy.  Another user's object in a
        shared store cannot be refreshed (EPERM); it still counts as present.
        """
        for codec in (RAW, ZSTD):
            p = object_path(self.root, d, codec)
            try:
                os.utime(p)
                return True
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError:  # EPERM/EACCES (not ours), EROFS: exists, cannot refresh
                if os.path.exists(p):
                    return True
        return False

    def _stage(self, kind: str = "obj") -> Staging:
        try:
            return Staging(self._tmp, kind)
        except (PermissionError, OSError) as e:
            if isinstance(e, PermissionError) or e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ReadOnlyError(
                    f"store {self.root} is read-only ({e.strerror}); open a writable store to put objects"
                ) from None
            raise

    def _level_for(self, compress: Any) -> Optional[int]:
        return _codec.normalize_compress(self.compress if compress is None else compress, self._level)

    @property
    def _mode(self) -> int:
        return 0o444

    def _publish(self, st: Staging, d: Digest, codec: str, *, synced: bool = False,
                 durable: Optional[bool] = None, sync_dir: bool = True) -> None:
        dest = object_path(self.root, d, codec)
        st.commit(dest, durable=self.durable if durable is None else durable, mode=self._mode,
                  synced=synced, sync_dir=sync_dir)

    # -- writing ----------------------------------------------------------

    def put(self, data: Union[bytes, bytearray, memoryview], *, compress: Any = None) -> Digest:
        """Store ``data``; return its digest.  Idempotent: same bytes, same digest, one object.

        ``compress``: ``None`` (store default), ``False``/``"raw"``, ``True``/``"zstd"`` or a
        zstd level.  Compression is skipped when a sample shows it would not pay.
        """
        mv = _as_buffer(data)
        d = hash_bytes(mv)
        if self._touch(d):
            return d
        self._write_buffer(d, mv, self._level_for(compress), durable=self.durable)
        return d

    def put_parts(self, parts: Iterable[Union[bytes, bytearray, memoryview]], *, compress: Any = None) -> Digest:
        """Store the concatenation of ``parts`` without concatenating them in memory.

        Used for a header plus a large buffer (``put_array``): hashes and writes
        each part in turn.  Same digest as ``put(b"".join(parts))``.
        """
        mvs = [_as_buffer(p, "put_parts") for p in parts]
        total = sum(len(m) for m in mvs)
        h = new_hasher(threaded=total >= (1 << 20))
        for m in mvs:
            h.update(m)
        d = Digest(h.hexdigest())
        if self._touch(d):
            return d
        level = self._level_for(compress)
        if level is not None and total and _codec.sample_pays(max(mvs, key=len)):
            self._write_buffer(d, memoryview(b"".join(mvs)), level, durable=self.durable)
            return d
        st = self._stage()
        try:
            for m in mvs:
                st.write(m)
            self._publish(st, d, RAW)
        except BaseException:
            st.abort()
            raise
        return d

    def _write_buffer(self, d: Digest, mv: memoryview, level: Optional[int], *, durable: bool,
                      sync_dir: bool = True, defer: Optional[List[Tuple[Staging, Digest, str]]] = None) -> None:
        codec = RAW
        payload: Any = mv
        if level is not None and _codec.sample_pays(mv):
            payload = _codec.compressor(level).compress(mv) + _codec.size_trailer(len(mv))
            codec = ZSTD
        st = self._stage()
        try:
            st.write(payload)
            if defer is not None:
                defer.append((st, d, codec))
                return
            self._publish(st, d, codec, durable=durable, sync_dir=sync_dir)
        except BaseException:
            st.abort()
            raise

    def put_many(self, items: Iterable[Union[bytes, bytearray, memoryview]], *,
                 compress: Any = None) -> List[Digest]:
        """Store many small objects; durable with one filesystem sync per batch.

        Equivalent to ``[put(x) for x in items]`` but stages a batch, flushes it
        with one ``syncfs``, renames every file into place, then syncs again
        (instead of two fsyncs per object).  Returns digests in input order.
        """
        level = self._level_for(compress)
        out: List[Digest] = []
        pending: List[Tuple[Staging, Digest, str]] = []
        seen: set[Digest] = set()

        def flush() -> None:
            if not pending:
                return
            try:
                if self.durable:
                    syncfs(self._tmp)
                for st, d, codec in pending:
                    self._publish(st, d, codec, durable=False)
                if self.durable:
                    syncfs(self._tmp)
            finally:
                for st, _, _ in pending:
                    st.abort()
                pending.clear()
                seen.clear()

        try:
            for item in items:
                mv = _as_buffer(item, "put_many")
                d = hash_bytes(mv)
                out.append(d)
                if d in seen or self._touch(d):
                    continue
                seen.add(d)
                self._write_buffer(d, mv, level, durable=False, defer=pending)
                if len(pending) >= _BATCH:
                    flush()
            flush()
        finally:
            for st, _, _ in pending:
                st.abort()
        return out

    def put_path(self, path: PathLike, *, compress: Any = None) -> Digest:
        """Store a file of any size by streaming it; return its digest.

        Raw: the file is copied in the kernel (``copy_file_range``) into a
        staging file, then the *staged copy* is hashed while a helper thread
        fsyncs it -- so the digest names exactly the bytes published even if
        the source changes meanwhile.  Compressed: read in 1 MiB chunks, each
        hashed and fed to zstd.  Memory stays bounded either way.
        """
        p = os.fspath(path)
        try:
            src = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"no such file to put: {p}") from None
        except IsADirectoryError:
            raise InvalidTypeError(f"{p} is a directory; put_path stores one regular file") from None
        try:
            fst = os.fstat(src)
            if stat.S_ISDIR(fst.st_mode):  # os.open() of a directory succeeds on Linux
                raise InvalidTypeError(f"{p} is a directory; put_path stores one regular file")
            if not stat.S_ISREG(fst.st_mode):  # pipe, FIFO, device: st_size is not the content size
                with io.FileIO(src, "rb", closefd=False) as f:
                    return self.put_stream(f, compress=compress)
            size = fst.st_size
            level = self._level_for(compress)
            if level is not None and _codec.file_sample_pays(src, size):
                with io.FileIO(src, "rb", closefd=False) as f:
                    return self._put_stream_compressed(f, level, size_hint=size)
            return self._put_fd_raw(src, size)
        finally:
            os.close(src)

    def _put_fd_raw(self, src: int, size: int) -> Digest:
        st = self._stage()
        try:
            _copy_fd(src, st.fd, size)
            synced = False
            err: List[BaseException] = []
            th: Optional[threading.Thread] = None
            if self.durable:
                # fsync (I/O wait) overlaps with hashing (CPU): blake3 drops the GIL.
                def sync() -> None:
                    try:
                        os.fsync(st.fd)
                    except BaseException as e:  # pragma: no cover - I/O error
                        err.append(e)
                th = threading.Thread(target=sync, name="casstore-fsync")
                th.start()
            try:
                d = _hash_fd(st.fd, size)
            finally:
                if th is not None:
                    th.join()
                    synced = True
            if err:
                raise err[0]
            if self._touch(d):
                st.abort()
                return d
            self._publish(st, d, RAW, synced=synced)
            return d
        except BaseException:
            st.abort()
            raise

    def put_stream(self, stream: IO[bytes], *, compress: Any = None) -> Digest:
        """Store everything readable from a binary stream; return its digest."""
        if not hasattr(stream, "read"):
            raise InvalidTypeError(f"put_stream() needs a readable binary stream, not {type(stream).__name__}")
        level = self._level_for(compress)
        first = stream.read(CHUNK)
        if not isinstance(first, (bytes, bytearray, memoryview)):
            raise InvalidTypeError("put_stream() needs a *binary* stream (open the file with 'rb')")
        if level is not None and _codec.sample_pays(first):
            return self._put_stream_compressed(stream, level, first=bytes(first))
        h = new_hasher(threaded=True)
        st = self._stage()
        try:
            chunk: Any = first
            while chunk:
                h.update(chunk)
                st.write(chunk)
                chunk = stream.read(CHUNK)
            d = Digest(h.hexdigest())
            if self._touch(d):
                st.abort()
                return d
            self._publish(st, d, RAW)
            return d
        except BaseException:
            st.abort()
            raise

    def _put_stream_compressed(self, stream: IO[bytes], level: int, *, first: bytes = b"",
                               size_hint: int = -1) -> Digest:
        h = new_hasher(threaded=True)
        st = self._stage()
        total = 0
        try:
            with io.FileIO(st.fd, "wb", closefd=False) as raw:
                writer = _codec.compressor(level).stream_writer(raw, size=size_hint, closefd=False)
                chunk: Any = first or stream.read(CHUNK)
                while chunk:
                    h.update(chunk)
                    writer.write(chunk)
                    total += len(chunk)
                    chunk = stream.read(CHUNK)
                writer.flush(_codec.FLUSH_FRAME)
                raw.write(_codec.size_trailer(total))
            d = Digest(h.hexdigest())
            if self._touch(d):
                st.abort()
                return d
            self._publish(st, d, ZSTD)
            return d
        except BaseException:
            st.abort()
            raise

    # -- reading ----------------------------------------------------------

    def get(self, digest: DigestLike, *, verify: bool = True) -> bytes:
        """Return the object's uncompressed bytes.

        With ``verify`` (the default) the bytes are re-hashed and
        :class:`IntegrityError` is raised instead of returning corrupt data.
        For raw objects the hash runs on a helper thread over the same file
        (page cache) while this thread reads, so verification costs little.
        """
        d = self._digest(digest)
        path, codec = self._locate(d)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:  # deleted between locate and open (GC)
            raise ObjectNotFoundError(f"object {d} disappeared while being read") from None
        with f:
            if codec == ZSTD:
                try:
                    data = _codec.open_decoded(f).read()
                except _codec.DecodeError as e:
                    raise IntegrityError(
                        f"object {d} is corrupt: its zstd data cannot be decoded ({e}); file {path}"
                    ) from None
                got = hash_bytes(data) if verify else d
            else:
                size = os.fstat(f.fileno()).st_size
                box: List[Any] = []
                th: Optional[threading.Thread] = None
                if verify and size >= _OVERLAP_MIN:
                    def work() -> None:
                        try:
                            box.append(_hash_fd(f.fileno(), size, threaded=False))
                        except BaseException as e:  # pragma: no cover
                            box.append(e)
                    th = threading.Thread(target=work, name="casstore-verify")
                    th.start()
                data = f.read(size) if size else b""
                if 0 < len(data) < size:  # one read(2) returns at most ~2 GiB on Linux
                    parts = [data]
                    got_n = len(data)
                    while got_n < size:
                        more = f.read(size - got_n)
                        if not more:
                            break
                        parts.append(more)
                        got_n += len(more)
                    data = b"".join(parts)
                if len(data) != size:
                    raise IntegrityError(f"object {d} changed size while being read ({path})")
                if th is not None:
                    th.join()
                    if isinstance(box[0], BaseException):
                        raise box[0]
                    got = box[0]
                else:
                    got = hash_bytes(data) if verify else d
        if got != d:
            raise IntegrityError(
                f"object {d} is corrupt: its bytes hash to {got}; file {path}. "
                "Run `casstore verify --repair` and put the data again"
            )
        return data

    def open(self, digest: DigestLike, *, verify: bool = True) -> BinaryIO:
        """Open an object for streaming, read-only.

        Reading it to the end in order verifies the digest (IntegrityError
        before the last bytes are returned).  Seeking anywhere but the current
        position turns verification off for this reader: it can no longer see
        every byte in order.
        """
        d = self._digest(digest)
        path, codec = self._locate(d)
        size = self._zstd_size(path, d) if codec == ZSTD else os.stat(path).st_size
        raw = _ObjectReader(d, path, codec, verify, size)
        # A buffer smaller than CHUNK: readinto() calls of >= 256 KiB then go
        # straight to the raw reader instead of being copied through the buffer.
        return io.BufferedReader(raw, buffer_size=_READ_BUFFER)

    def path(self, digest: DigestLike) -> Path:
        """Read-only path of a *raw* object, for h5py, ``numpy.memmap`` or any tool.

        The file is mode 0o444 and must never be modified.  Compressed objects
        have no raw path: :class:`CompressedObjectError`.
        """
        d = self._digest(digest)
        path, codec = self._locate(d)
        if codec != RAW:
            raise CompressedObjectError(
                f"object {d} is stored zstd-compressed, so it has no raw path; "
                "read it with store.open()/get(), or put it with compress=False"
            )
        return Path(path)

    def stat(self, digest: DigestLike) -> ObjectInfo:
        """Size, stored size and codec of an object, without reading its content."""
        d = self._digest(digest)
        path, codec = self._locate(d)
        stored = os.stat(path).st_size
        size = stored
        if codec == ZSTD:
            size = self._zstd_size(path, d)
        return ObjectInfo(d, size, stored, codec)

    def _zstd_size(self, path: str, d: Digest) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = _codec.read_size_trailer(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if size is None:
            raise IntegrityError(f"compressed object {d} has no size trailer: truncated or damaged ({path})")
        return size

    def __contains__(self, digest: object) -> bool:
        if not isinstance(digest, (Digest, str)):
            return False
        return self._exists(self._digest(digest))

    def contains(self, digest: DigestLike) -> bool:
        """``digest in store``."""
        return self._exists(self._digest(digest))

    def resolve(self, prefix: str) -> Digest:
        """Turn a unique digest prefix (``"blake3:9f2c"`` or ``"9f2c"``) into a Digest."""
        if isinstance(prefix, Digest):
            return self._locate(prefix) and prefix
        hexp = parse_prefix(prefix)
        found = sorted({d for d, _, _ in iter_object_files(self.root, hexp)})
        if not found:
            raise ObjectNotFoundError(f"no object matches {prefix!r} in the store at {self.root}")
        if len(found) > 1:
            shown = ", ".join(x.short(len(hexp) + 4) for x in found[:5])
            raise AmbiguousDigestError(
                f"{prefix!r} matches {len(found)} objects ({shown}{', ...' if len(found) > 5 else ''}); "
                "give more hex digits"
            )
        return found[0]

    def iter_objects(self) -> Iterator[Digest]:
        """Every object's digest, in digest order (each once, whatever its codec)."""
        last: Optional[Digest] = None
        for d, _, _ in iter_object_files(self.root):
            if d != last:
                yield d
            last = d

    def iter_info(self) -> Iterator[ObjectInfo]:
        """``stat`` of every object."""
        for d in self.iter_objects():
            yield self.stat(d)

    # -- manifests, heads and pins (implemented in casstore.manifest) ---------

    def edit(self, name: str, *, timeout: Optional[float] = 600.0,
             allow_missing: bool = False) -> EditTransaction:
        """Edit manifest ``name`` in a transaction: ``with store.edit("exp") as m: m["k"] = d``.

        Takes the fcntl lock of this name only; commits a new version on a
        clean exit (version object first, then the ref by atomic rename) and
        discards everything on an exception.  Raises :class:`FrozenError` for a
        pin and :class:`LockTimeout` after ``timeout`` seconds.  Entries must
        refer to objects in the store unless ``allow_missing``.
        """
        from .manifest import EditTransaction

        return EditTransaction(self, name, timeout=timeout, allow_missing=allow_missing)

    def manifest(self, target: DigestLike) -> Manifest:
        """Lock-free read of a name's current version (pins first), or a version by digest."""
        from .manifest import read_manifest

        return read_manifest(self, target)

    def history(self, target: DigestLike, limit: Optional[int] = None) -> List[Manifest]:
        """Versions of a name (or from a version digest), newest first."""
        from .manifest import history

        return history(self, target, limit)

    def freeze(self, name: str, *, timeout: Optional[float] = 600.0) -> Digest:
        """Make head ``name`` a pin: it never changes again.  Returns the version digest."""
        from .manifest import freeze

        return freeze(self, name, timeout=timeout)

    def pin(self, name: str, target: DigestLike, *, force: bool = False,
            timeout: Optional[float] = 600.0, allow_missing: bool = False) -> Digest:
        """Name a manifest version (digest or another name) with a pin; moving one needs ``force``.

        Every object the version names must be present unless ``allow_missing``.
        """
        from .manifest import pin

        return pin(self, name, target, force=force, timeout=timeout, allow_missing=allow_missing)

    def unpin(self, name: str, *, timeout: Optional[float] = 600.0) -> Digest:
        """Remove a pin's name; its objects are collected later by GC if nothing else holds them."""
        from .manifest import unpin

        return unpin(self, name, timeout=timeout)

    def pins(self) -> Dict[str, Digest]:
        """Every pin: name -> frozen manifest digest."""
        from .refs import list_refs

        return list_refs(self.root, "pins")

    def heads(self) -> Dict[str, Digest]:
        """Every head: name -> current manifest version digest."""
        from .refs import list_refs

        return list_refs(self.root, "heads")

    def diff(self, a: Any, b: Any) -> Diff:
        """Keys added, removed and changed from ``a`` to ``b`` (names, digests or Manifests)."""
        from .manifest import diff

        return diff(self, a, b)

    def checkout(self, target: DigestLike, outdir: PathLike, *, overwrite: bool = False) -> List[Path]:
        """Write a manifest's files under ``outdir`` (verified; reflinked where possible)."""
        from .manifest import checkout

        return checkout(self, target, outdir, overwrite=overwrite)

    # -- raw copies, fetch/derive, numpy and HDF5 adapters ------------------------

    def raw_path(self, digest: DigestLike) -> Path:
        """Like :meth:`path`, but a compressed object is first materialized raw (once).

        The raw copy is published under the same digest (both forms may exist;
        readers prefer raw), verified before it becomes visible.
        """
        d = self._digest(digest)
        path, codec = self._locate(d)
        if codec == RAW:
            return Path(path)
        h = new_hasher(threaded=True)
        st = self._stage("raw")
        try:
            with self.open(d, verify=False) as f:
                while True:
                    chunk = f.read(CHUNK)
                    if not chunk:
                        break
                    h.update(chunk)
                    st.write(chunk)
            got = Digest(h.hexdigest())
            if got != d:
                raise IntegrityError(f"object {d} is corrupt: it decodes to {got}; file {path}")
            self._publish(st, d, RAW)
        except BaseException:
            st.abort()
            raise
        return object_path(self.root, d, RAW)

    def fetch(self, url: str, **kwargs: Any) -> Digest:
        """Download ``url`` once across processes; see :func:`casstore.fetch.fetch`."""
        from .fetch import fetch

        return fetch(self, url, **kwargs)

    def derive(self, name: str, *, inputs: Any, fn: Any, params: Any = None, **kwargs: Any) -> Manifest:
        """Compute ``fn`` once per (name, inputs, params, version); see :func:`casstore.fetch.derive`."""
        from .fetch import derive

        return derive(self, name, inputs=inputs, fn=fn, params=params, **kwargs)

    def put_array(self, a: Any, *, compress: Any = None) -> Digest:
        """Store a numpy array as a ``.npy`` object (see :mod:`casstore.arrays`)."""
        from .arrays import put_array

        return put_array(self, a, compress=compress)

    def get_array(self, digest: DigestLike, *, mmap: bool = False, verify: bool = True) -> Any:
        """Read an array; ``mmap=True`` memory-maps a raw object read-only, no copy."""
        from .arrays import get_array

        return get_array(self, digest, mmap=mmap, verify=verify)

    def put_arrays(self, arrays: Any, *, compress: Any = None) -> Digest:
        """Store a dict of arrays; returns the digest of a manifest bundle."""
        from .arrays import put_arrays

        return put_arrays(self, arrays, compress=compress)

    def get_arrays(self, digest: DigestLike, *, mmap: bool = False, verify: bool = True) -> Dict[str, Any]:
        """Read a bundle written by :meth:`put_arrays`."""
        from .arrays import get_arrays

        return get_arrays(self, digest, mmap=mmap, verify=verify)

    def open_hdf5(self, digest: DigestLike, **kwargs: Any) -> Any:
        """A read-only ``h5py.File`` on an object, safe with many concurrent readers."""
        from .h5 import open_hdf5

        return open_hdf5(self, digest, **kwargs)

    # -- remotes on an S3-compatible object store (implemented in casstore.remote) ---

    def push(self, remote: Any, *names: str, force: bool = False) -> Any:
        """Upload pins/heads and their closures to ``remote`` (objects the remote lacks first, refs last).

        ``remote`` is a :class:`casstore.Remote` or the name of one in ``remotes.toml``.
        Refs move by compare-and-swap: a lost race raises :class:`RemoteConflictError`
        (pull, then push again).  Returns a :class:`casstore.remote.TransferReport`.
        """
        from .remote import push

        return push(self, remote, *names, force=force)

    def pull(self, remote: Any, *names: str, merge: bool = True) -> Any:
        """Download pins/heads from ``remote``: each object verified as it arrives, refs created last.

        A head that diverged from the local one is merged (three-way, by key)
        unless ``merge=False``.  Returns a :class:`casstore.remote.TransferReport`.
        """
        from .remote import pull

        return pull(self, remote, *names, merge=merge)

    def fetch_object(self, digest: DigestLike, *, remotes: Optional[Iterable[Any]] = None,
                     verify: bool = True) -> bytes:
        """``get``, but a local miss downloads the object (verified) from the first remote holding it."""
        from .remote import fetch_object

        return fetch_object(self, digest, remotes=remotes, verify=verify)

    def _adopt_file(self, path: PathLike, *, link: bool = False) -> Digest:
        """Make a finished file in this store's ``tmp/`` an object without copying it; return its digest.

        The file is hashed through mmap windows while a helper thread fsyncs it
        (if the store is durable), made mode 0o444, then hard-linked (``link``:
        the temp name stays valid for whoever still reads it) or renamed into
        ``objects/``, and the directory is fsynced.  If the object exists already
        nothing is published (dedupe).  The caller must never change the file
        again.  Where hard links are refused the bytes are copied instead.  Used by
        ``IndexCache.preserve`` (casstore/cache.py).
        """
        from ._fs import _makedirs

        p = os.fspath(path)
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            err: List[BaseException] = []
            th: Optional[threading.Thread] = None
            if self.durable:
                def sync() -> None:
                    try:
                        os.fsync(fd)
                    except BaseException as e:  # pragma: no cover - I/O error
                        err.append(e)
                th = threading.Thread(target=sync, name="casstore-fsync")
                th.start()
            try:
                d = _hash_fd(fd, size)
            finally:
                if th is not None:
                    th.join()
            if err:
                raise err[0]
            dest = object_path(self.root, d, RAW)
            try:
                os.utime(dest)  # exists: refresh it, so GC's grace period covers the caller's next step
                exists = True
            except (FileNotFoundError, NotADirectoryError):
                exists = False
            except OSError:  # not ours (shared store) or read-only: present all the same
                exists = os.path.exists(dest)
            if exists:
                if not link:
                    os.unlink(p)
                return d
            os.fchmod(fd, self._mode)
            os.utime(fd)  # a fresh object for GC's grace period, whenever the file was written
            try:
                try:
                    (os.link if link else os.rename)(p, dest)
                except FileNotFoundError:
                    _makedirs(dest.parent, self.durable)
                    (os.link if link else os.rename)(p, dest)
            except FileExistsError:
                return d  # another writer published the same object meanwhile
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                st = self._stage()  # no hard links here: copy once
                try:
                    _copy_fd(fd, st.fd, size)
                    self._publish(st, d, RAW)
                except BaseException:
                    st.abort()
                    raise
                return d
        finally:
            os.close(fd)
        if self.durable:
            fsync_dir(dest.parent)
        return d

    # -- maintenance: gc, verify, usage, size limits (casstore.gc, casstore.verify) -------

    def plan_gc(self, keep_history: int = 5, grace: Any = "1h") -> GCPlan:
        """Plan a garbage collection; nothing is deleted until ``plan.execute()``.

        Keeps every pin, each head's current version and its last
        ``keep_history`` versions (and everything they reference), and every
        object written or re-put within ``grace`` (seconds, timedelta or
        ``"90s"``/``"10m"``/``"1h"``).  Reads no data object.  See docs/maintenance.md.
        """
        from .gc import plan_gc

        return plan_gc(self, keep_history=keep_history, grace=grace)

    def verify(self, *, fast: bool = False, repair: bool = False, incremental: bool = False,
               progress: Optional[bool] = None) -> VerifyReport:
        """Re-hash every object and resolve every reference; return a :class:`~casstore.verify.VerifyReport`.

        ``fast``: sizes and headers only.  ``incremental``: skip files unchanged
        since a recent verification.  ``repair``: move corrupt and stray files
        to ``bad/`` and remove stale staging files (never deletes data; lost
        pinned or head-referenced data is reported).  ``progress``: a bar on
        stderr (default: only on a terminal).
        """
        from .verify import verify

        return verify(self, fast=fast, repair=repair, incremental=incremental, progress=progress)

    def usage(self) -> Usage:
        """Objects, logical and stored bytes, compression ratio, dedupe savings, per head and pin."""
        from .gc import usage

        return usage(self)

    def limit(self, max_bytes: Union[int, str], *, keep_history: int = 5, grace: Any = "1h",
              dry_run: bool = False) -> LimitResult:
        """Evict least-recently-used *unreferenced* objects until the objects fit in ``max_bytes``.

        Pinned and head-referenced objects are never evicted; when the limit
        cannot be met the result says so (``met`` is False, ``message`` why).
        """
        from .gc import limit

        return limit(self, max_bytes, keep_history=keep_history, grace=grace, dry_run=dry_run)

    def sweep_tmp(self) -> List[Path]:
        """Remove staging files of dead writers now (also done on open)."""
        return sweep_stale(self._tmp)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def open_store(path: Optional[PathLike] = None, *, create: bool = True, compress: Any = None,
               durable: Optional[bool] = None, shared: bool = False) -> Store:
    """Open the store at ``path``; create it there on first use unless ``create=False``.

    ``compress``: default codec for puts (``None``/``False`` raw, ``True`` zstd
    level 3, or a level); ``durable=False`` skips fsyncs (scratch stores:
    faster, but a power loss may lose recent puts -- never corrupt them, since
    visibility still goes through rename, but a file may be empty after a
    crash of the machine, which ``verify`` reports).
    """
    from .settings import current

    cfg = current()
    if path is None:
        path = cfg.store
    if compress is None and cfg.compression is not None:
        compress = int(cfg.compression) if cfg.compression.isdigit() else cfg.compression
    if durable is None:
        durable = cfg.durable
    p = Path(os.path.expanduser(os.fspath(path)))
    if not create and not (p / CONFIG_FILE).exists():
        _load_config(p)  # raises StoreFormatError with the reason
    return Store(p, create=create, compress=compress, durable=durable, shared=shared)

