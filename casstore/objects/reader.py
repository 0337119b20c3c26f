"""Opening object files safely, and the verifying stream over one object.

Hazards (issue 11): any member of a shared store can plant a FIFO, a
directory, a device or a symlink where an object file should be.  Opening a
FIFO blocks forever; following a symlink reads (or maps) a file outside the
store.  So every object file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and
must ``fstat`` as a regular file; anything else is an
:class:`~casstore.errors.IntegrityError` at once.  A file deleted between
locating and opening it (gc, ``limit``) is an
:class:`~casstore.errors.ObjectNotFoundError`, never a raw ``FileNotFoundError``.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
from typing import BinaryIO, Optional, Union

from .._fs import Beside, fresh_bytes, run_beside
from ..codecs import Codec
from ..digest import Digest, hash_fd, new_hasher
from ..errors import IntegrityError, ObjectNotFoundError

__all__ = ["open_object_file", "ObjectReader", "OVERLAP_MIN"]

# Raw objects of at least this size are hashed by a helper thread while the
# caller reads (see ObjectReader); smaller ones are hashed inline, chunk by
# chunk: a helper's start-up and mmap windows cost more than they save there.
OVERLAP_MIN = 16 << 20
# The helper's mmap window: small enough that close() stops it within a few ms.
_WINDOW = 16 << 20
# readall() fills its result in steps of this size (each one a verified readinto).
_READALL_STEP = 8 << 20

_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


_NOATIME = getattr(os, "O_NOATIME", 0)


def open_object_file(path: str, digest: Digest, *, noatime: bool = False) -> tuple[int, os.stat_result]:
    """Open an object file read-only without following links or blocking: ``(fd, fstat)``.

    Raises :class:`ObjectNotFoundError` if it is gone and :class:`IntegrityError`
    if it is not a regular file.  ``noatime``: a maintenance read (verify, usage) that must not
    count as a use: ``limit`` evicts the least recently used objects by their access time, and a
    verify that refreshed every atime made the object a user had just read the first to go (found
    by a bug hunt).  ``O_NOATIME`` needs the file's owner; for another user's object the read is
    made without it.
    """
    try:
        if noatime and _NOATIME:
            try:
                fd = os.open(path, _FLAGS | _NOATIME)
            except PermissionError:  # EPERM: not the owner (a shared store)
                fd = os.open(path, _FLAGS)
        else:
            fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise ObjectNotFoundError(f"object {digest} disappeared while being opened (removed by gc or limit?)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise IntegrityError(
                f"object file {path} of {digest} is a symbolic link, not a stored object; "
                "run `casstore verify --repair` to move it aside"
            ) from None
        if e.errno in (errno.ENXIO, errno.EISDIR):
            raise IntegrityError(f"object file {path} of {digest} is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(
                f"object file {path} of {digest} is not a regular file (a FIFO, device or directory); "
                "run `casstore verify --repair` to move it aside"
            )
        # Blocking reads from here on (a regular file never blocks anyway).
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class ObjectReader(io.RawIOBase):
    """Read-only stream over one object; verifies the digest at end of file.

    Verification covers full sequential reads: if every byte was read in
    order, reaching EOF compares the hash and raises IntegrityError on a
    mismatch *before* returning the final chunk.  A ``seek`` away from the
    position the hash has reached turns verification off for this reader (it
    can no longer see every byte).  Decoded output is bounded by ``size``.

    Large raw objects (:data:`OVERLAP_MIN` and up) are hashed by a helper
    thread straight from the file (the page cache, through ``mmap`` windows,
    with blake3's thread pool) from the first ``readinto`` at offset 0, while
    the caller's reads proceed: the caller's buffer is never read after a call
    returns (the caller may reuse or change it at once), and the two threads
    share both cores.  What is compared at EOF is then the file's content, the
    same bytes the caller was handed (an object file is immutable; ``get``
    verifies the same way).  Closing the reader, or seeking elsewhere, stops
    the helper and waits for it.  ``exact=True`` hashes the bytes handed out
    instead, on the caller's thread: for bytes that leave the machine (a push),
    where a file rewritten in place under the reader (it takes a ``chmod``)
    must not go out as verified because the helper had hashed it before.
    """

    def __init__(self, digest: Digest, path: str, fd: int, codec: Codec, verify: bool, size: int, *,
                 exact: bool = False) -> None:
        super().__init__()
        self._exact = exact
        self._size = size
        self._seen = 0
        self.digest = digest
        self.name = path
        self._file: BinaryIO = open(fd, "rb", buffering=0, closefd=True)
        what = f"object {digest} (file {path})"
        self._src: BinaryIO = codec.open_decoder(self._file, size, what=what)
        self._codec = codec
        self._verifying = verify
        self._wanted = verify  # (a seek back to the start verifies again)
        # Single-threaded: fed 1 MiB updates, blake3's pool ran slower here
        # (6.1-6.4 GB/s against 7.0 GB/s).
        self._hasher = new_hasher() if verify else None
        self._beside: Optional[Beside[Digest]] = None
        self._stop = threading.Event()
        self._checked = False

    @property
    def size(self) -> int:
        """The object's uncompressed size."""
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._codec.byte_exact

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if not self._codec.byte_exact:
            raise io.UnsupportedOperation("compressed objects are read sequentially")
        pos = self._file.seek(offset, whence)
        if pos == 0 and self._wanted:
            # Back to the start: a full in-order read from here is verified again.  Hazard (found by a
            # bug hunt): "seek to the end for the size, seek back, read it all" (a common way to size
            # a file) turned verification off for good, and corrupt bytes came back without an error.
            self._stop_helper()
            self._stop = threading.Event()
            self._hasher = new_hasher()
            self._seen = 0
            self._checked = False
            self._verifying = True
        elif pos != self._seen:
            # Not where the hash has got to: this reader can no longer see
            # every byte in order, so it stops verifying (documented).
            self._verifying = False
            self._stop_helper()
        return pos

    def tell(self) -> int:
        return self._file.tell() if self._codec.byte_exact else int(self._src.tell())

    def readinto(self, b: Union[bytearray, memoryview]) -> Optional[int]:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        if (self._verifying and self._seen == 0 and self._beside is None and self._codec.byte_exact
                and self._size >= OVERLAP_MIN and not self._exact):
            fd, size, stop = self._file.fileno(), self._size, self._stop
            self._beside = run_beside(lambda: hash_fd(fd, size, window=_WINDOW, stop=stop), "casstore-verify")
        n: int = self._src.readinto(mv)  # type: ignore[attr-defined]
        if self._checked and n and self._verifying:
            raise IntegrityError(f"object {self.digest} is longer than its recorded size; file {self.name}")
        if self._verifying and not self._checked:
            if n:
                if self._beside is None:
                    assert self._hasher is not None
                    self._hasher.update(mv[:n])
                self._seen += n
            # Check as soon as the last byte is read (before handing it out),
            # not only when the caller asks past the end.
            if self._seen >= self._size or n == 0:
                self._check()
        return n

    def readall(self) -> bytes:
        """The rest of the object in one ``bytes`` (raw objects: built in place, no list of chunks
        joined into a second copy); verified like any in-order read."""
        if not self._codec.byte_exact:
            return super().readall() or b""
        want = max(0, self._size - self._file.tell())
        filled = fresh_bytes(want)
        if filled is None:
            return super().readall() or b""
        data, view = filled
        with view:
            got = 0
            while got < want:
                n = self.readinto(view[got:min(got + _READALL_STEP, want)])
                if not n:
                    break
                got += n
            # One more read: the end of file (or a file longer than recorded) is
            # seen here, exactly as a loop of read() calls would see it.
            tail = self.read(1) if got == want else b""
        if got == want and not tail:
            return data
        # Only without verification (a verifying reader raised above): the file shrank or grew.
        out = data[:got] + tail
        return out + (super().readall() or b"") if tail else out

    def _check(self) -> None:
        self._checked = True
        if self._beside is not None:
            got = self._beside.join().hex  # the helper's IntegrityError (file shrank) propagates
        else:
            assert self._hasher is not None
            got = self._hasher.hexdigest()
        if got != self.digest.hex or self._seen != self._size:
            raise IntegrityError(
                f"object {self.digest} is corrupt: its bytes hash to blake3:{got} "
                f"({self._seen} of {self._size} bytes); file {self.name}. "
                "Run `casstore verify --repair` and put the data again"
            )

    def _stop_helper(self) -> None:
        if self._beside is not None:
            self._stop.set()
            self._beside.wait()  # its result (or error) no longer matters
            self._beside = None

    def close(self) -> None:
        if not self.closed:
            try:
                self._stop_helper()
                if self._src is not self._file:
                    self._src.close()
            finally:
                self._file.close()
        super().close()
