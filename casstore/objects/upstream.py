"""Read-through: where a local store's missing objects come from (issue 14).

A store opened with an *upstream* (a remote: ``casstore.open(path, upstream="origin")``,
docs/remotes.md "Read-through") fetches an object it lacks on the first read
(``get``, ``open``, ``path``, ``get_array``, ``open_hdf5``, ``checkout``, manifests
and the index cache alike: they all find objects through
:meth:`LocalObjects.locate <casstore.objects.LocalObjects.locate>`), verifies it
and keeps it.  :class:`Upstream` is the seam: a small protocol with a capability
(:attr:`Upstream.ranged_min`), four primitives and defaults built on them;
``casstore.sync`` implements it on a remote.

Hazards this is built around:

* **Many readers of one missing object** (the ranks of a job starting at once)
  must download it once.  A fetch takes the lock ``locks/fetch/<2 hex>.lock``
  of the object's fan-out (256 lock files at most: lock files are never
  deleted, so not one per object), re-checks presence under it, and only then
  downloads; a waiter finds the object and takes it.  A dead holder releases
  the lock with its process; a waiter that sees no end after ``FETCH_WAIT``
  seconds (a stopped holder, a huge object) downloads the object itself.  Where locks lie (issue 17)
  the worst case is a second download: publishing is create-only and two
  publishers of one object both succeed with identical bytes.
* **Hostile bytes**: the upstream's bytes are hashed before anything is
  published under ``objects/`` (``fetch_into`` does it); a tampered object is
  an :class:`~casstore.errors.IntegrityError` and leaves nothing behind.
* **Presence checks never fetch**: ``has()`` is what dedupe (puts), gc and
  verify ask, and they must see what is really here.
* **Ranged reads** (:class:`RangedReader`): ``open()`` of a missing object of at
  least ``ranged_min`` bytes fetches only the ranges read.  Such a read is
  verified only if it reads the object from the first byte to the last in
  order (then the object is also kept locally); after any seek elsewhere the
  bytes handed out are *unverified*, as for a local ``open()`` that seeks
  (docs/security.md).
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable, Optional, Set, Union

from .._fs import Staging, seek_target
from ..codecs import RAW
from ..digest import Digest, new_hasher
from ..errors import IntegrityError, ObjectNotFoundError

if TYPE_CHECKING:
    from .local import LocalObjects

__all__ = ["Upstream", "RangedReader", "RANGE_BLOCK"]

RANGE_BLOCK = 4 << 20
"""Bytes a ranged read asks the upstream for at least (reads of a few KiB each would cost a request each)."""


class Upstream(ABC):
    """Where a store's missing objects come from (a remote); see the module docstring."""

    @property
    def ranged_min(self) -> Optional[int]:
        """Objects at least this large are opened with ranged reads (``None``: always fetched whole)."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """The upstream as messages name it (``s3://bucket/prefix``)."""

    @abstractmethod
    def fetch_into(self, digest: Digest, dst: LocalObjects) -> int:
        """Download ``digest``, verify it and publish it into ``dst``; return its size.

        :class:`~casstore.errors.ObjectNotFoundError` if the upstream lacks it,
        :class:`~casstore.errors.IntegrityError` (nothing stored) if its bytes are wrong.
        """

    def fetch_read(self, digest: Digest, dst: LocalObjects) -> Optional[bytes]:
        """:meth:`fetch_into`, also returning the object's verified bytes if they were held in memory
        anyway (small objects); ``None``: read the new local copy.

        Saves a read-through ``get`` reading and hashing what it just downloaded
        and hashed.  The default returns ``None``.
        """
        self.fetch_into(digest, dst)
        return None

    @abstractmethod
    def size(self, digest: Digest) -> int:
        """The object's size on the upstream; :class:`~casstore.errors.ObjectNotFoundError` if absent."""

    @abstractmethod
    def read_range(self, digest: Digest, start: int, length: int) -> bytes:
        """Up to ``length`` bytes of the object from offset ``start`` (unverified: the caller hashes)."""

    def present(self, digests: Iterable[Digest]) -> Set[Digest]:
        """Which of ``digests`` the upstream holds (default: one :meth:`size` each; override to list)."""
        out: Set[Digest] = set()
        for d in digests:
            try:
                self.size(d)
            except ObjectNotFoundError:
                continue
            out.add(d)
        return out


class RangedReader(io.RawIOBase):
    """A seekable read-only stream over an upstream object, fetching only the ranges read.

    Verification (like :class:`~casstore.objects.ObjectReader`): while the
    bytes are read in order from offset 0, they are hashed, and the digest is
    compared *before* the last bytes are handed out (:class:`IntegrityError`
    on a mismatch).  The same in-order bytes are staged into ``keep`` (the
    local store) and published there once verified, so a full read also
    brings the object home.  A seek away from the position the hash has
    reached turns verification (and keeping) off until a seek back to offset 0,
    from where a full read is verified again.
    """

    def __init__(self, upstream: Upstream, digest: Digest, size: int, keep: Optional[LocalObjects]) -> None:
        super().__init__()
        self.digest = digest
        self.name = f"{upstream.describe()} ({digest})"
        self._up = upstream
        self._size = size
        self._pos = 0
        self._seen = 0  # bytes hashed in order from offset 0
        self._hasher = new_hasher()
        self._done = False  # the digest was compared
        self._verifying = True
        self._block = b""
        self._block_at = 0
        self._keep = keep
        self._staging: Optional[Staging] = keep.stage("range") if keep is not None and keep.writable else None

    @property
    def size(self) -> int:
        """The object's size."""
        return self._size

    @property
    def verified(self) -> bool:
        """True once every byte was read in order and hashed to the digest."""
        return self._verifying and self._done

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = self._pos = seek_target(offset, whence, self._pos, self._size)
        if pos == 0 and self._seen != 0:
            # Back to the start: a full in-order read from here is verified (and kept) again.  Hazard
            # (the one found in ObjectReader by a bug hunt): "seek to the end for the size, seek back,
            # read it all" turned verification off for good, and a tampered remote object came back
            # without an error.  Every byte is fetched again, so it is hashed again, even after a
            # verified read.
            self._drop_staging()
            self._hasher = new_hasher()
            self._seen = 0
            self._done = False
            self._verifying = True
            keep = self._keep
            self._staging = keep.stage("range") if keep is not None and keep.writable else None
        elif pos != self._seen and self._verifying and not self._done:
            # Not where the hash has got to: the bytes handed out from here on are unverified.
            self._verifying = False
            self._drop_staging()
        return pos

    def _fill(self, n: int) -> memoryview:
        """The bytes at ``[pos, pos + n)`` (fewer at the end), from the cached block or one ranged GET."""
        end = min(self._pos + n, self._size)
        if not (self._block_at <= self._pos and end <= self._block_at + len(self._block)):
            want = max(end - self._pos, RANGE_BLOCK)
            want = min(want, self._size - self._pos)
            data = self._up.read_range(self.digest, self._pos, want)
            if len(data) != want:
                raise IntegrityError(
                    f"{self.name}: a ranged read at {self._pos} returned {len(data)} bytes, not {want} "
                    f"(the object is {self._size} bytes): the upstream object is damaged or was replaced"
                )
            self._block, self._block_at = data, self._pos
        off = self._pos - self._block_at
        return memoryview(self._block)[off:off + (end - self._pos)]

    def readinto(self, b: Union[bytearray, memoryview]) -> int:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        if self._pos >= self._size or not len(mv):
            if self._pos >= self._size and self._verifying and not self._done and self._seen == self._size:
                self._check()
            return 0
        got = self._fill(len(mv))
        n = len(got)
        if self._verifying and not self._done and self._pos == self._seen:
            self._hasher.update(got)
            if self._staging is not None:
                self._staging.write(got)
            self._seen += n
            if self._seen == self._size:
                self._check()  # before the last bytes are handed out
        mv[:n] = got
        self._pos += n
        return n

    def _check(self) -> None:
        got = self._hasher.hexdigest()
        self._done = True
        if got != self.digest.hex:
            self._drop_staging()
            raise IntegrityError(
                f"object {self.digest} read from {self._up.describe()} is corrupt: its bytes hash to "
                f"blake3:{got}; nothing was stored. Push a good copy to the remote again"
            )
        st, self._staging = self._staging, None
        if st is not None and self._keep is not None:
            try:
                self._keep.publish(st, self.digest, RAW)
            finally:
                st.abort()  # a no-op once published

    def _drop_staging(self) -> None:
        st, self._staging = self._staging, None
        if st is not None:
            st.abort()

    def close(self) -> None:
        if not self.closed:
            self._drop_staging()
            self._block = b""
        super().close()
