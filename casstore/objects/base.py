"""The object-store protocol: the seam every place objects live is built behind.

Modelled on zarr-python's ``abc/store.py``: a few abstract primitives
(``has``, ``stat``, ``open``, ``write``, ``delete``, ``iter_digests``),
capability properties instead of type checks, and defaults built on the
primitives that an implementation may override when it can do better
(``read``, ``write_many``, ``has_many``).  ``tests/test_objects_conformance.py``
holds the conformance class every implementation's tests subclass.

Every implementation keeps the object invariants of docs/design.md:
objects are create-only (writing existing content is a no-op that succeeds),
an object is never visible half-written, and bytes handed out by a full,
verified read hash to the digest asked for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Iterator, Set, Tuple, Union

from ..digest import Digest

__all__ = ["ObjectStore", "ObjectInfo", "Buffer"]

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What an object store knows about one object without reading it."""

    digest: Digest
    size: int
    """Uncompressed size in bytes."""
    stored_size: int
    """Bytes on disk (or on the remote)."""
    codec: str
    """``"raw"`` or ``"zstd"``."""


class ObjectStore(ABC):
    """Immutable objects addressed by the BLAKE3 digest of their uncompressed bytes."""

    # -- capabilities (override where they differ) --

    @property
    def local_paths(self) -> bool:
        """Can hand out a local file path per raw object (memory maps, h5py)."""
        return False

    @property
    def atomic_publish(self) -> bool:
        """A reader never sees a partially written object."""
        return True

    @property
    def supports_delete(self) -> bool:
        """:meth:`delete` removes objects (False for append-only stores)."""
        return True

    @property
    def writable(self) -> bool:
        """Writes are possible (False on a read-only mount or another user's store)."""
        return True

    # -- primitives --

    @abstractmethod
    def has(self, digest: Digest) -> bool:
        """Is the object present?"""

    @abstractmethod
    def stat(self, digest: Digest) -> ObjectInfo:
        """Size, stored size and codec; :class:`~casstore.errors.ObjectNotFoundError` if absent."""

    @abstractmethod
    def open(self, digest: Digest, *, verify: bool = True) -> BinaryIO:
        """A read-only stream of the uncompressed bytes; a full in-order read is verified."""

    @abstractmethod
    def write(self, digest: Digest, data: Buffer) -> bool:
        """Create the object from its uncompressed bytes; ``False`` if it already existed.

        Bytes that do not hash to ``digest`` raise :class:`~casstore.errors.IntegrityError`
        and nothing is stored.
        """

    @abstractmethod
    def delete(self, digest: Digest) -> bool:
        """Remove the object (every stored form); ``False`` if it was not there."""

    @abstractmethod
    def iter_digests(self) -> Iterator[Digest]:
        """Every object's digest, each once, in digest order."""

    # -- defaults built on the primitives --

    def read(self, digest: Digest, *, verify: bool = True) -> bytes:
        """The whole object, verified unless ``verify=False``."""
        with self.open(digest, verify=verify) as f:
            data: bytes = f.read()
        return data

    def prefetch(self, digests: Iterable[Digest]) -> None:
        """A hint that these objects will be read soon, one by one: start fetching them.

        Never raises for a missing or damaged object (the read that follows
        reports it) and changes nothing.  Default: nothing.
        """
        return None  # a store without a cheaper batch read simply reads each object when asked

    def has_many(self, digests: Iterable[Digest]) -> Set[Digest]:
        """Which of ``digests`` are present."""
        return {d for d in digests if self.has(d)}

    def write_many(self, items: Iterable[Tuple[Digest, Buffer]]) -> int:
        """Write several objects; returns how many were created (not already present)."""
        return sum(1 for d, data in items if self.write(d, data))

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, Digest) and self.has(digest)
