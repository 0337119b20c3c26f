"""Moving verified objects between a local object store and a remote one.

``upload_object``: :class:`~casstore.objects.LocalObjects` -> :class:`~casstore.objects.s3.S3Objects`
(the local bytes are verified on the way; a corrupt local object is never pushed).
``download_object``: S3Objects -> LocalObjects (the remote bytes are hashed
before anything is published; a corrupt or oversized remote object leaves
nothing behind).  ``Publisher`` batches what a pull downloads, ``run_parallel``
runs the transfers on a thread pool, and :class:`TransferReport` is what a
push or pull returns.

Hazards:

* A pull publishes only verified bytes: small objects are hashed in memory,
  large ones after their parallel ranged download into a staging file -- the
  staged copy is what is hashed and what is renamed into place.
* A remote may serve more bytes than a manifest records for an object (a
  disk-filling attack): a read never goes beyond the recorded size (bounded
  GET, or a size check before a ranged download), and is refused.
* A remote may name, in a tiny recipe, one chunk many times (a file of zeros
  does it legitimately): the object it describes can be any size.  With a
  recorded size (a pull: the manifest's), a recipe or object larger than it
  is refused before any byte is written; without one (read-through), a
  download stops with :class:`~casstore.errors.DiskFullError` before it would
  leave the store's filesystem less than :func:`space_floor` free (checked
  before it starts, from the size the recipe or ``HeadObject`` announces, and
  again every :data:`SPACE_RECHECK` bytes written), as a fetch does
  (``casstore/pipelines/fetch.py``).  Hazard (found by a bug hunt): a 36 KB
  recipe made a read-through ``get`` write 900 MiB before its hash check failed.
* A durable pull must not pay an fsync per object: verified objects are
  staged unsynced and published in batches by
  :meth:`LocalObjects.publish_batch` (one ``syncfs`` before the renames, one
  after), on a helper thread while downloads go on; at most one batch is in
  flight, and the download window bounds the staged files (open fds) waiting.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from .._fs import (
    FLOOR_EXEMPT,
    Beside,
    Staging,
    free_bytes,
    pread_upto,
    pwrite_all,
    reserve_fds,
    run_beside,
    space_floor,
)
from ..codecs import RAW
from ..digest import Digest, hash_bytes, hash_fd, new_hasher
from ..errors import CasstoreError, DiskFullError, IntegrityError, ObjectNotFoundError
from ..objects.chunking import ChunkIndex, ChunkRef, Recipe
from ..objects.local import LocalObjects, StagedObject
from ..objects.reader import open_object_file
from ..objects.s3 import MiB, S3Objects

__all__ = ["TransferReport", "Publisher", "upload_object", "download_object", "download_object_bytes",
           "run_parallel", "BATCH_OBJECTS", "BATCH_BYTES"]

BATCH_OBJECTS = 256  # staged files per batch (each holds an open fd until published)
BATCH_BYTES = 256 * MiB

I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class TransferReport:
    """What a push or pull did."""

    remote: str
    """The remote's description."""
    refs: Mapping[str, str] = field(default_factory=dict)
    """``"pins/NAME"`` or ``"heads/NAME"`` -> what happened (``"created"``, ``"fast-forward"`` ...)."""
    objects: int = 0
    """Objects transferred."""
    bytes: int = 0
    """Content bytes transferred."""
    present: int = 0
    """Objects of the closures that the other side already had."""
    seconds: float = 0.0
    """Wall time."""

    def __str__(self) -> str:
        mib = self.bytes / MiB
        refs = ", ".join(f"{k}: {v}" for k, v in self.refs.items()) or "no refs"
        return (f"{self.remote}: {refs}; {self.objects} object(s), {mib:.1f} MiB transferred, "
                f"{self.present} already there, {self.seconds:.1f} s")


# -- push: local -> remote ----------------------------------------------------------------------


class _NoSeek(io.RawIOBase):
    """A read-only, non-seekable view of a stream.

    boto3 seeks and tells on seekable uploads; a local verifying reader stops
    verifying when moved, so it is handed over as a plain stream.
    """

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        data = self._f.read(len(mv))
        mv[: len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            super().close()


def _corrupt_local(src: LocalObjects, d: Digest, got: Optional[Digest] = None) -> IntegrityError:
    why = f" (hashes to {got})" if got is not None else ""
    return IntegrityError(
        f"object {d} in the store at {src.root} is corrupt{why}; not pushed. "
        "Run `casstore verify --repair` and put the data again"
    )


def upload_object(src: LocalObjects, dst: S3Objects, d: Digest, size: int) -> int:
    """Upload one local object, verified, as raw bytes (create-only: an object already there is success).

    An object the remote stores chunked (``dst.chunking``) sends only the
    chunks the remote lacks, then its recipe.  Returns the bytes sent.
    """
    if dst.chunking is not None and dst.chunking.chunks_of(size):
        return _upload_chunked(src, dst, d)
    if size < dst.connection.multipart_threshold:
        data = src.read(d, verify=False)  # S3Objects.write hashes it: one hash, before anything is sent
        try:
            dst.write(d, data)
        except IntegrityError:
            raise _corrupt_local(src, d) from None
        return size
    # Streamed through a reader that hashes exactly what it hands over (exact=True: not the file,
    # beside the reads) and raises at a short or long file or wrong bytes before the last part
    # goes up, so the upload is never completed.  Hazard: hashing the file first and then
    # uploading it from its descriptor let a file truncated or rewritten in between go up, create-
    # only, for good (boto3 sizes a seekable upload by seeking to its end, and never compares).
    with _NoSeek(src.open(d, exact=True)) as f:
        try:
            dst.upload(d, f)
        except IntegrityError:
            raise _corrupt_local(src, d) from None
    return size


def _upload_chunked(src: LocalObjects, dst: S3Objects, d: Digest) -> int:
    """Cut a local object into content-defined chunks (verified as cut), upload what the remote lacks."""
    assert dst.chunking is not None
    loc = src.locate(d)
    staged = None
    if loc.codec.byte_exact:
        fd, st = open_object_file(loc.path, d)
    else:  # a zstd object: chunks are of the raw bytes, so decode it (verified at EOF) into a staging file
        staged = src.stage("chunk")
        with src.open(d) as f:
            while block := f.read(1 << 20):
                staged.write(block)
        fd, st = staged.fd, os.fstat(staged.fd)
    try:
        # Read, never mapped: a file truncated under a map kills the process (SIGBUS), and a
        # read sees the bytes once.  The recipe hashes the object over the very chunks it names;
        # each chunk is read and hashed again as it is sent (a file rewritten meanwhile raises).
        with open(fd, "rb", buffering=0, closefd=False) as f:
            recipe = dst.chunking.recipe_of(d, f, st.st_size)
        with ThreadPoolExecutor(min(8, dst.connection.workers), thread_name_prefix="casstore-chunks") as ex:
            sent = dst.upload_chunked(recipe, lambda off, n: pread_upto(fd, n, off), executor=ex)
    except IntegrityError:
        raise _corrupt_local(src, d) from None
    finally:
        if staged is not None:
            staged.abort()
        else:
            os.close(fd)
    ChunkIndex(src.root).add(recipe)  # this store holds these chunks: a later pull of a relative reuses them
    return sent


# -- pull: remote -> local ----------------------------------------------------------------------


class Publisher:
    """Publishes a pull's verified, staged objects in batches, on a helper thread.

    Workers :meth:`add` each object once it is verified and written to its
    staging file (not fsynced).  :meth:`flush` hands what has accumulated to
    :meth:`LocalObjects.publish_batch` on a helper thread; downloads go on
    meanwhile, and one batch is in flight at a time.  :meth:`finish`
    publishes the rest (so every rename is durable before a ref names the
    objects); :meth:`discard` removes what is still staged.
    """

    def __init__(self, objects: LocalObjects, *, max_objects: int = BATCH_OBJECTS,
                 max_bytes: int = BATCH_BYTES) -> None:
        self.objects = objects
        """Where the objects are published."""
        self.max_objects = max_objects
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._staged: List[StagedObject] = []
        self._bytes = 0
        self._inflight: Optional[Beside[None]] = None
        reserve_fds()  # before the workers hold their staged files open (see reserve_fds)

    def add(self, item: StagedObject, size: int) -> None:
        """Take a verified, staged object (any thread)."""
        with self._lock:
            self._staged.append(item)
            self._bytes += size

    def due(self) -> bool:
        """Whether enough has accumulated for a batch."""
        with self._lock:
            return len(self._staged) >= self.max_objects or self._bytes >= self.max_bytes

    def _take(self) -> List[StagedObject]:
        with self._lock:
            items, self._staged, self._bytes = self._staged, [], 0
        return items

    def _wait(self) -> None:
        job, self._inflight = self._inflight, None
        if job is not None:
            job.join()  # raises the publisher's error

    def flush(self) -> None:
        """Start publishing what has accumulated (after the batch in flight is done)."""
        self._wait()
        items = self._take()
        if items:
            self._inflight = run_beside(lambda: self.objects.publish_batch(items), "casstore-publish")

    def finish(self) -> None:
        """Publish everything staged (this thread); on error, what is left staged is removed."""
        try:
            self._wait()
            self.objects.publish_batch(self._take())
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove every staged file not yet published (after waiting for the batch in flight)."""
        job, self._inflight = self._inflight, None
        if job is not None:
            try:
                job.join()
            except BaseException:  # noqa: B036 - its staging files are removed by publish_batch; the caller's error wins
                pass
        for it in self._take():
            it.staging.abort()


SPACE_RECHECK = 256 << 20
"""Bytes a chunked download writes between two looks at free space (parallel downloads share the disk)."""


def _check_room(src: S3Objects, dst: LocalObjects, d: Digest, size: int, written: int = 0) -> None:
    """:class:`DiskFullError` (before writing more) if the ``size - written`` bytes still to come would leave
    less than :func:`space_floor` free under the store."""
    if size <= FLOOR_EXEMPT:
        return
    free = free_bytes(dst.root)
    if free is None:  # unknown (statvfs failed): ENOSPC on write is still a DiskFullError
        return
    floor = space_floor(dst.root)
    if size - written > free - floor:
        raise DiskFullError(
            f"{src.connection.where}: object {d} is {size:,} bytes (as the remote describes it), more than the store "
            f"at {dst.root} can take: only {free:,} bytes are free there, and a download leaves {floor:,} free "
            "for everyone else; nothing was stored. Free space (casstore gc, store.limit), or if the object cannot "
            f"be that large, its recipe or key on the remote is hostile or damaged: delete it ({src.url(d)} or "
            "its recipe) and push it again from a good copy",
            errno.ENOSPC,
        )


def _too_large(src: S3Objects, d: Digest, recorded: int, size: int) -> IntegrityError:
    return IntegrityError(
        f"{src.connection.where}: object {src.url(d)} is larger ({size} bytes or more) than the {recorded} bytes "
        "its manifest records; it was not downloaded or stored. Delete that key and push the object again "
        "from a good copy"
    )


def download_object(src: S3Objects, dst: LocalObjects, d: Digest, size_hint: Optional[int],
                    publisher: Optional[Publisher] = None, *, durable: Optional[bool] = None) -> int:
    """Download one object, verify it, then publish it (or hand it to ``publisher``); returns the bytes
    downloaded (its size; for a chunked object, the chunks fetched).

    An object the remote stores as chunks (issue 16) is reassembled: chunks this
    store already holds (the local chunk index) are read locally, each verified
    by its name, the rest are downloaded, and the whole is verified by its digest
    (:func:`_download_chunked`).
    """
    return download_object_bytes(src, dst, d, size_hint, publisher, durable=durable)[0]


def download_object_bytes(src: S3Objects, dst: LocalObjects, d: Digest, size_hint: Optional[int],
                          publisher: Optional[Publisher] = None, *,
                          durable: Optional[bool] = None) -> Tuple[int, Optional[bytes]]:
    """:func:`download_object`, also returning the object's verified bytes when they were downloaded
    into memory (a whole object below the multipart threshold; ``None`` otherwise).

    Read-through ``get`` hands them to the caller instead of reading and hashing the new local copy again.
    """
    try:
        return _download_whole(src, dst, d, size_hint, publisher, durable)
    except ObjectNotFoundError:
        recipe = src.read_recipe(d)
        if recipe is None:
            raise
    return _download_chunked(src, dst, recipe, size_hint, publisher, durable), None


def _local_chunk(dst: LocalObjects, where: Optional[Tuple[Digest, int, int]], c: ChunkRef) -> Optional[bytes]:
    """The chunk's bytes from a local raw object the chunk index names, if they still hash to its name."""
    if where is None or where[2] != c.length or not dst.has(where[0]):  # has(): never fetches
        return None
    try:
        loc = dst.locate(where[0])
        if not loc.codec.byte_exact:
            return None
        fd, _ = open_object_file(loc.path, where[0])
        try:
            data = os.pread(fd, c.length, where[1])
        finally:
            os.close(fd)
    except (CasstoreError, OSError):
        return None  # gone or damaged meanwhile: download it instead
    return data if len(data) == c.length and hash_bytes(data, threaded=False) == c.digest else None


CHUNK_WINDOW = 32
"""Chunks downloaded ahead of the one being hashed (bounds the memory a chunked pull holds)."""


def _download_chunked(src: S3Objects, dst: LocalObjects, recipe: Recipe, size_hint: Optional[int],
                      publisher: Optional[Publisher], durable: Optional[bool]) -> int:
    """Reassemble a chunked object in a staging file, in order, hashing the whole as it goes.

    Each chunk is brought once, on a pool of threads up to :data:`CHUNK_WINDOW`
    ahead, and written in place: from a local object the chunk index names
    (verified by its name; downloaded if it no longer matches) or downloaded.
    This thread hashes the whole in order as chunks arrive, so the hash
    overlaps the transfers, and that hash is the check: downloaded chunks are
    not hashed one by one unless it fails, to name the bad chunk (a second
    pass over a 1 GiB staging file and a hash per chunk cost a third of a
    chunked pull).
    """
    d = recipe.digest
    if size_hint is not None and recipe.size > size_hint:
        raise _too_large(src, d, size_hint, recipe.size)
    _check_room(src, dst, d, recipe.size)  # the recipe may repeat one chunk without end (module docstring)
    index = ChunkIndex(dst.root)
    seen = index.find({c.digest for c in recipe.chunks})
    first: Dict[Digest, ChunkRef] = {}  # each chunk's first occurrence, in recipe order
    for c in recipe.chunks:
        first.setdefault(c.digest, c)
    fetched = 0
    written = checked = 0
    hasher = new_hasher()
    st = dst.stage("pull")
    try:
        def bring(c: ChunkRef) -> Tuple[bytes, int]:
            """On a worker: the chunk from a local object the index names (verified by its name), else
            downloaded; written in place.  ``(bytes, bytes downloaded)``."""
            data = _local_chunk(dst, seen.get(c.digest), c)
            moved = 0
            if data is None:  # not here, or gone or changed since it was indexed
                data = src.read_chunk(c, verify=False)  # its length checked; the whole hash covers its bytes
                moved = c.length
            pwrite_all(st.fd, data, c.offset)
            return data, moved

        # Leaving this block waits for every running task: none writes to the staging file after it.
        with ThreadPoolExecutor(min(16, src.connection.workers), thread_name_prefix="casstore-chunks") as ex:
            ahead: Deque[Tuple[ChunkRef, Future[Tuple[bytes, int]]]] = deque()
            todo = iter(first.values())
            try:
                for c in recipe.chunks:
                    if written - checked >= SPACE_RECHECK:
                        _check_room(src, dst, d, recipe.size, written)
                        checked = written
                    written += c.length
                    while len(ahead) < CHUNK_WINDOW and (nxt := next(todo, None)) is not None:
                        ahead.append((nxt, ex.submit(bring, nxt)))
                    at = first[c.digest].offset
                    if at != c.offset:  # a repeat: its first occurrence is already staged
                        data = os.pread(st.fd, c.length, at)
                        pwrite_all(st.fd, data, c.offset)
                    else:
                        head, fut = ahead.popleft()
                        assert head is c  # first occurrences, in recipe order
                        data, moved = fut.result()
                        fetched += moved
                    hasher.update(data)
            except BaseException:
                for _, fut in ahead:
                    fut.cancel()
                raise
        os.ftruncate(st.fd, recipe.size)  # a recipe of zero chunks is the empty object
        got = Digest.from_bytes(hasher.digest())
        if got != d:
            for c in recipe.chunks:  # name the culprit: a chunk whose bytes are not its name's
                if hash_bytes(os.pread(st.fd, c.length, c.offset)) != c.digest:
                    raise src.bad_chunk_error(c)
            raise src.corrupt_error(d, got, recipe.size)  # every chunk genuine: the recipe lies
        _publish_staged(dst, st, d, recipe.size, publisher, durable)
    except BaseException:
        st.abort()
        raise
    index.add(recipe)  # its chunks are now here: a later pull of a relative reuses them
    return fetched


def _publish_staged(dst: LocalObjects, st: Staging, d: Digest, size: int, publisher: Optional[Publisher],
                    durable: Optional[bool]) -> None:
    """Publish a verified raw staging file: recompressed as the store's default says, handed to the
    batch ``publisher``, or published at once."""
    if dst.level_for(None) is not None:
        dst.put_path(st.path)  # compressed as the store's default says (re-hashed, durable)
        st.abort()
    elif publisher is not None:
        publisher.add(StagedObject(st, d, RAW), size)
    else:
        dst.publish(st, d, RAW, durable=durable)


def _download_whole(src: S3Objects, dst: LocalObjects, d: Digest, size_hint: Optional[int],
                    publisher: Optional[Publisher], durable: Optional[bool]) -> Tuple[int, Optional[bytes]]:
    """Download one whole (unchunked) object (see :func:`download_object`).

    The bytes are hashed before anything is written under ``objects/``: a
    corrupt object raises :class:`IntegrityError` and leaves nothing behind,
    and so does one larger than ``size_hint`` (the size its manifest records),
    which is never read past that size.  Without ``publisher`` the object is
    published at once, durably if the store is (``durable=False``: no fsync,
    for copies that can be fetched again: read-through).
    """
    threshold = src.connection.multipart_threshold
    if size_hint is None or size_hint < threshold:
        limit = threshold - 1 if size_hint is None else size_hint
        data = src.read_at_most(d, limit)  # verified; ObjectNotFoundError if absent
        if data is not None:
            staged = dst.stage_bytes(d, data, dst.level_for(None))
            if publisher is not None:
                publisher.add(staged, len(data))
            else:
                try:
                    dst.publish(staged.staging, d, staged.codec, durable=durable)
                finally:
                    staged.staging.abort()  # no-op once published
            return len(data), data
        if size_hint is not None:
            raise _too_large(src, d, size_hint, size_hint + 1)
    else:
        info = src.stat(d)  # before a ranged download: never fetch more than the manifest records
        if info.size > size_hint:
            raise _too_large(src, d, size_hint, info.size)
    if size_hint is None:
        info = src.stat(d)  # the size the server announces: the download writes no more (S3Connection.download)
    _check_room(src, dst, d, info.size)
    # Large: parallel ranged download into a staging file, then hash the staged bytes.
    st = dst.stage("pull")
    try:
        with io.FileIO(st.fd, "r+b", closefd=False) as f:
            src.download_to(d, f)
        size = os.fstat(st.fd).st_size
        if size_hint is not None and size > size_hint:
            raise _too_large(src, d, size_hint, size)  # replaced on the server since the size check
        got = hash_fd(st.fd, size)
        if got != d:
            raise src.corrupt_error(d, got, size)
        _publish_staged(dst, st, d, size, publisher, durable)
        return size, None
    except BaseException:
        st.abort()
        raise


# -- running transfers in parallel --------------------------------------------------------------


def run_parallel(fn: Callable[[I], R], items: Sequence[I], on_done: Callable[[I, R], None],
                 executor: ThreadPoolExecutor, *, window: Optional[int] = None) -> None:
    """Run ``fn`` over ``items`` on the pool; ``on_done(item, result)`` in this thread as each finishes.

    ``window``: at most that many items submitted and not yet handed to
    ``on_done`` (bounds what finished results hold, e.g. open staging files).
    The first failure (or an interrupt) cancels what has not started, waits
    for what has (each worker cleans up after itself) and is raised.  Calls
    are bounded by the client's retries and timeouts.
    """
    if window is None or window >= len(items):
        futs: Dict[Future[R], I] = {executor.submit(fn, it): it for it in items}
        try:
            for f in as_completed(futs):
                on_done(futs[f], f.result())  # raises the worker's exception
        except BaseException:
            for f in futs:
                f.cancel()
            wait(list(futs))
            raise
        return
    todo = iter(items)
    running: Dict[Future[R], I] = {}
    try:
        for it in todo:
            running[executor.submit(fn, it)] = it
            if len(running) >= window:
                break
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for f in done:
                it = running.pop(f)
                on_done(it, f.result())  # raises the worker's exception
                for nxt in todo:  # the next item, if any
                    running[executor.submit(fn, nxt)] = nxt
                    break
    except BaseException:
        for f in running:
            f.cancel()
        wait(list(running))
        raise
