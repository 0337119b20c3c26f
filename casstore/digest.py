"""Content digests: the address of every object in a store.

A :class:`Digest` is the BLAKE3 hash (32 bytes) of an object's *uncompressed*
content.  Its string form names the algorithm: ``blake3:<64 lowercase hex>``.
"""

from __future__ import annotations

import mmap
import os
import queue
import re
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Optional, Type, Union

import blake3

from ._fs import Beside, read_reused, run_beside
from .errors import IntegrityError, InvalidDigestError, InvalidTypeError

__all__ = ["Digest", "ALGORITHM", "HEX_LEN", "hash_bytes", "hash_raw", "hash_fd", "new_hasher", "HashBeside"]

ALGORITHM = "blake3"
HEX_LEN = 64
_HEX_RE = re.compile(r"[0-9a-f]{64}")
_PREFIX_RE = re.compile(r"[0-9a-f]{1,64}")

# Buffers at least this large are hashed with blake3's own thread pool; below
# it the thread start-up costs more than it saves (64 KiB chunks with AUTO ran
# at 2.9 GB/s here, against 7 GB/s single-threaded).
_MT_THRESHOLD = 1 << 20

Buffer = Union[bytes, bytearray, memoryview]


# blake3's thread pool (Rayon) does not survive fork(): in the child of a
# process that has used it, a multi-threaded update waits forever for worker
# threads that were not copied (e.g. forked DataLoader workers putting >= 1 MiB).
# Any process created by fork() therefore hashes on its own thread.
_forked = False


def _note_fork() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_note_fork)


def new_hasher(*, threaded: bool = False) -> blake3.blake3:
    """Return a fresh BLAKE3 hasher (multi-threaded for large updates if asked and fork-safe)."""
    if threaded and not _forked:
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    return blake3.blake3()


@dataclass(frozen=True, slots=True, order=True)
class Digest:
    """The BLAKE3 digest of an object's uncompressed bytes.

    ``str(d)`` is ``"blake3:<hex>"`` and ``Digest.parse(str(d)) == d``.
    """

    hex: str

    def __post_init__(self) -> None:
        if not isinstance(self.hex, str) or not _HEX_RE.fullmatch(self.hex):
            raise InvalidDigestError(
                f"not a BLAKE3 digest: {self.hex!r}; expected 64 lowercase hex digits"
            )

    @classmethod
    def parse(cls, text: str) -> Digest:
        """Parse ``"blake3:<64 hex>"`` (or the bare 64 hex digits)."""
        if isinstance(text, Digest):
            return text
        if not isinstance(text, str):
            raise InvalidTypeError(f"a digest must be a str or Digest, not {type(text).__name__}")
        body = split_algorithm(text)
        if not _HEX_RE.fullmatch(body):
            raise InvalidDigestError(
                f"malformed digest {text!r}: expected 'blake3:' and 64 lowercase hex digits"
            )
        return cls(body)

    @classmethod
    def coerce(cls, value: object) -> Digest:
        """A Digest from a Digest or its string form; InvalidTypeError for anything else."""
        if isinstance(value, Digest):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        raise InvalidTypeError(f"expected a digest ('blake3:<64 hex>' or a Digest), not {type(value).__name__}")

    @classmethod
    def from_bytes(cls, raw: bytes) -> Digest:
        """Build a digest from its 32 raw bytes."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(f"a raw digest is 32 bytes, not {type(raw).__name__}")
        if len(raw) != 32:
            raise InvalidDigestError(f"a BLAKE3 digest is 32 bytes, got {len(raw)}")
        return _made(raw.hex())

    @classmethod
    def of(cls, data: Buffer) -> Digest:
        """Hash ``data`` and return its digest."""
        return hash_bytes(data)

    @property
    def algorithm(self) -> str:
        """The hash algorithm's name (always ``"blake3"`` in format 1)."""
        return ALGORITHM

    @property
    def raw(self) -> bytes:
        """The 32 digest bytes."""
        return bytes.fromhex(self.hex)

    def short(self, n: int = 12) -> str:
        """An abbreviated form for display: ``blake3:<first n hex>``."""
        return f"{ALGORITHM}:{self.hex[:n]}"

    def __str__(self) -> str:
        return f"{ALGORITHM}:{self.hex}"

    def __repr__(self) -> str:
        return f"Digest('{ALGORITHM}:{self.hex}')"


def _made(hex_: str) -> Digest:
    """A Digest of 64 lowercase hex digits this module made itself (a hash's or 32 bytes' ``hex()``):
    the pattern check of ``Digest(...)`` skipped (a commit makes hundreds; ~1 us each)."""
    d = object.__new__(Digest)
    object.__setattr__(d, "hex", hex_)
    return d


def split_algorithm(text: str) -> str:
    """Strip an optional ``blake3:`` prefix; refuse any other algorithm."""
    if ":" in text:
        algo, _, body = text.partition(":")
        if algo != ALGORITHM:
            raise InvalidDigestError(
                f"unsupported digest algorithm {algo!r} in {text!r}; this store uses {ALGORITHM}"
            )
        return body
    return text


def parse_prefix(text: str) -> str:
    """Validate a (possibly abbreviated) digest and return its hex prefix."""
    if not isinstance(text, str):
        raise InvalidTypeError(f"a digest prefix must be a str, not {type(text).__name__}")
    body = split_algorithm(text.strip())
    if not _PREFIX_RE.fullmatch(body):
        raise InvalidDigestError(
            f"malformed digest or prefix {text!r}: expected 1-64 lowercase hex digits,"
            " optionally after 'blake3:'"
        )
    return body


def hash_raw(data: Buffer) -> bytes:
    """The 32-byte BLAKE3 digest of a small in-memory buffer (one thread), with no :class:`Digest` made.

    For code hashing many small buffers: a tree commit hashes each node it writes and each node it
    reads (~400 for a 1% add of a 10,000-file folder), and the hex round trip of ``hash_bytes(...).raw``
    doubled the cost of each (1.8 against 0.9 us here).
    """
    return blake3.blake3(data).digest()


def hash_bytes(data: Buffer, *, threaded: Optional[bool] = None) -> Digest:
    """Return the digest of an in-memory buffer.

    ``threaded``: use BLAKE3's thread pool (default: for buffers of 1 MiB and
    more).  Callers already running on many threads pass ``False``.
    """
    h = new_hasher(threaded=len(data) >= _MT_THRESHOLD if threaded is None else threaded)
    h.update(data)
    return _made(h.hexdigest())


_SMALL_FILE = 1 << 20  # below this, read() + one-thread blake3 beats mmap + the thread pool
_HASH_WINDOW = 32 << 20  # mmap window when hashing a file: bounds address space and RSS (put_path's peak)


def hash_fd(fd: int, size: int, *, threaded: bool = True, window: int = _HASH_WINDOW,
            stop: Optional[threading.Event] = None) -> Digest:
    """The digest of the first ``size`` bytes of an open file: THE file hasher of casstore.

    Small files are read through this thread's reused buffer; larger ones are hashed through bounded
    ``mmap`` windows (no copy).  ``threaded=False`` when another thread is busy
    reading the same data (the second core is then this hasher's, and blake3's
    pool would only contend).  ``window``: bytes mapped at a time (verify maps
    64 MiB: fewer pool start-ups on big files).  A file shorter than ``size`` raises
    :class:`IntegrityError` (it changed while being hashed).
    """
    if size < _SMALL_FILE:
        h = blake3.blake3()
        for piece in read_reused(fd, size, "hashed"):  # (this thread's buffer: status reads many small files)
            h.update(piece)
        return Digest(h.hexdigest())
    # Hazard: a file truncated under a live mapping raises SIGBUS on access, so
    # the size is checked against fstat before each window is mapped.
    h = new_hasher(threaded=threaded)
    off = 0
    while off < size:
        if stop is not None and stop.is_set():
            break
        if os.fstat(fd).st_size < size:
            raise IntegrityError(f"file shrank while being hashed (expected {size} bytes)")
        n = min(window, size - off)
        with mmap.mmap(fd, n, prot=mmap.PROT_READ, offset=off) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            h.update(mm)
        off += n
    return Digest(h.hexdigest())


class HashBeside:
    """Hash buffers, in the order given, on a helper thread while the caller fills the next ones.

    The pipelined verified read: the caller reads block *k+1* while the helper
    hashes block *k* (blake3 drops the GIL), so the cost is spread over two
    cores instead of summed.  Every buffer passed to :meth:`feed` must stay
    unchanged until :meth:`digest` returns (or :meth:`cancel`).  Use it as a
    context manager: leaving the block without :meth:`digest` cancels and
    waits for the helper, so no work outlives the caller.  An exception on the
    helper is raised by :meth:`digest`.
    """

    __slots__ = ("_h", "_q", "_stop", "_job", "_open")

    def __init__(self, *, threaded: bool = False) -> None:
        self._h = new_hasher(threaded=threaded)
        self._q: queue.SimpleQueue[Optional[Buffer]] = queue.SimpleQueue()
        self._stop = False
        self._open = True
        self._job: Beside[str] = run_beside(self._work, "casstore-hash")

    def _work(self) -> str:
        while True:
            buf = self._q.get()
            if buf is None:
                return self._h.hexdigest()
            if not self._stop:
                self._h.update(buf)

    def feed(self, buf: Buffer) -> None:
        """Queue ``buf`` (next in order) for hashing; returns at once."""
        self._q.put(buf)

    def digest(self) -> Digest:
        """Wait for everything fed to be hashed; the digest (or the helper's exception)."""
        self._open = False
        self._q.put(None)
        return Digest(self._job.join())

    def cancel(self) -> None:
        """Stop hashing (what is queued is skipped) and wait for the helper to be done.

        It always waits, even after :meth:`digest` was interrupted (KeyboardInterrupt):
        the helper may still be reading buffers the caller is about to free.
        """
        self._stop = True
        if self._open:
            self._open = False
            self._q.put(None)
        self._job.wait()

    def __enter__(self) -> HashBeside:
        return self

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.cancel()
