"""Read-through from a remote: the :class:`~casstore.objects.upstream.Upstream` of a store (issue 14).

A store whose upstream is a remote fetches a missing object on first read
(the object layer decides when, and takes the per-fan-out lock: see
:mod:`casstore.objects.upstream`); this module says how: the same verified
download as ``pull`` (:func:`~casstore.sync.transfer.download_object`: hashed
before anything is published, so a tampered remote object leaves nothing
behind), and ranged GETs for large objects opened as streams.

The remote is resolved on first use, not when the store is opened: opening
a store must not import boto3 or read credentials, and a store whose every
object is local never talks to the remote.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional, Set

from ..digest import Digest
from ..objects import LocalObjects
from ..objects.upstream import Upstream
from .remotes import Remote
from .transfer import download_object, download_object_bytes

__all__ = ["RemoteUpstream", "RANGED_MIN"]

RANGED_MIN = 64 << 20
"""Objects at least this large opened as streams (``store.open``) fetch only the ranges read."""


class RemoteUpstream(Upstream):
    """A remote as a store's upstream; ``resolve`` builds the :class:`Remote` on first use."""

    def __init__(self, resolve: Callable[[], Remote], label: str, *, ranged_min: Optional[int] = RANGED_MIN) -> None:
        self._resolve = resolve
        self._remote: Optional[Remote] = None
        self._lock = threading.Lock()
        self.label = label
        """The remote's name (or URL) before it is resolved."""
        self._ranged_min = ranged_min

    @classmethod
    def of(cls, remote: Remote, *, ranged_min: Optional[int] = RANGED_MIN) -> RemoteUpstream:
        """An upstream over an already built :class:`Remote`."""
        up = cls(lambda: remote, remote.name or remote.url, ranged_min=ranged_min)
        up._remote = remote
        return up

    @property
    def remote(self) -> Remote:
        """The remote (built on first use)."""
        with self._lock:
            if self._remote is None:
                self._remote = self._resolve()
            return self._remote

    @property
    def ranged_min(self) -> Optional[int]:
        """Objects at least this large are streamed by ranges (:data:`RANGED_MIN`)."""
        return self._ranged_min

    def describe(self) -> str:
        """The remote as messages name it."""
        return self.remote.describe()

    def fetch_into(self, digest: Digest, dst: LocalObjects) -> int:
        """Download ``digest`` (verified) and publish it into ``dst``, without fsync.

        A fetched copy is a cache of the remote: a power loss may lose it (the
        next read fetches it again) or leave it torn, which the next verified
        read finds and heals (``LocalObjects.read`` sets it aside and fetches
        again; ``verify`` reports it and the upstream's copy as not lost).  An
        fsync per object cost half the throughput of many small read-throughs
        from 4 processes (benchmarks/bench_readthrough.py).
        """
        return download_object(self.remote.objects, dst, digest, None, durable=False)

    def fetch_read(self, digest: Digest, dst: LocalObjects) -> Optional[bytes]:
        """:meth:`fetch_into`, returning the bytes of an object small enough to be downloaded into memory."""
        return download_object_bytes(self.remote.objects, dst, digest, None, durable=False)[1]

    def size(self, digest: Digest) -> int:
        """The object's size on the remote (one ``HeadObject``)."""
        return self.remote.objects.stat(digest).size

    def read_range(self, digest: Digest, start: int, length: int) -> bytes:
        """One ranged ``GetObject``."""
        return self.remote.objects.read_range(digest, start, length)

    def present(self, digests: Iterable[Digest]) -> Set[Digest]:
        """Which of ``digests`` the remote holds, by listing (never one request per object)."""
        return self.remote.objects.present(digests)

    def __repr__(self) -> str:
        return f"RemoteUpstream({self.label!r})"
