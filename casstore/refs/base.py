"""The refs protocol: names that move by compare-and-swap.

A ref maps a name to a manifest digest.  ``heads`` move on every commit;
``pins`` never move unless forced.  Every implementation offers a lock-free
:meth:`RefStore.read` returning the digest with an opaque *token*, and
:meth:`RefStore.compare_and_swap`, which succeeds for exactly one of any
number of racing writers that read the same token, whether or not any lock
is held or honoured.  Local refs do it by an exclusive create of the name's
next claim log position (``refs/local.py``; a per-name lock only keeps claims
from losing where locks work); S3 refs with ``If-Match`` / ``If-None-Match``
conditional writes.  ``tests/_conformance.py`` holds the conformance class
every implementation's tests subclass (``tests/test_conformance_refs.py``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Dict, Optional

from ..digest import Digest
from ..errors import StoreFormatError

__all__ = ["Ref", "RefListing", "RefStore", "KINDS"]

log = logging.getLogger("casstore.refs")

KINDS = ("heads", "pins")


@dataclass(frozen=True, slots=True)
class Ref:
    """A ref as read: its digest and the token a compare-and-swap must present."""

    digest: Digest
    token: str
    """Opaque: ``<log position>:<hex>`` for local refs, the ETag for S3 refs."""


@dataclass(frozen=True, slots=True)
class RefListing:
    """Every ref of a kind as listed: the readable ones, and the damaged ones with what is wrong.

    Hazard: a damaged ref (a claim or ref file that holds no digest) names a version nobody can
    know.  Dropped from a listing, its name vanished from ``ls`` and ``verify``, and gc collected
    everything it held; so a listing never drops one silently: :meth:`RefStore.list` raises,
    and callers that can go on without it (``ls``, ``verify``, usage) read it here and report it.
    """

    refs: Dict[str, Digest]
    """Name -> digest of every readable ref, sorted by name."""
    damaged: Dict[str, str]
    """Name -> the reader's message (what is wrong and what to do) of every damaged ref, sorted by name."""


class RefStore(ABC):
    """Heads and pins: read lock-free, move by compare-and-swap."""

    @abstractmethod
    def read(self, kind: str, name: str) -> Optional[Ref]:
        """The ref, or ``None`` if it does not exist."""

    @abstractmethod
    def compare_and_swap(self, kind: str, name: str, new: Optional[Digest], expected: Optional[Ref]) -> bool:
        """Set ``name`` to ``new`` (``None`` removes it) only if it is still ``expected``
        (``None``: only if it does not exist).  ``False`` when another writer won."""

    @abstractmethod
    def scan(self, kind: str) -> RefListing:
        """Every ref of a kind: the readable ones and the damaged ones (never dropped; see :class:`RefListing`)."""

    def list(self, kind: str) -> Dict[str, Digest]:
        """Every ref of a kind, name -> digest, sorted by name.

        :class:`StoreFormatError` if any is damaged: what a damaged ref holds is unknown, so no
        caller that acts on every ref (gc's roots, a push of everything) may go on without it.
        """
        got = self.scan(kind)
        if got.damaged:
            name, why = next(iter(got.damaged.items()))
            more = f" (and {len(got.damaged) - 1} more damaged {kind})" if len(got.damaged) > 1 else ""
            raise StoreFormatError(f"{kind[:-1]} {name!r} cannot be read{more}: {why}")
        return got.refs

    def readable(self, kind: str, left_out: str) -> Dict[str, Digest]:
        """The readable refs of a kind, for a caller that can go on without the damaged ones (a
        listing, a usage count): each is a warning "head 'x' is not <left_out>, ..." (never silent:
        ``casstore verify`` reports it, and gc refuses to run until it is fixed)."""
        got = self.scan(kind)
        for name, why in got.damaged.items():
            log.warning("%s %r is not %s, its ref cannot be read: %s", kind[:-1], name, left_out, why)
        return got.refs

    def get(self, kind: str, name: str) -> Optional[Digest]:
        """The digest a ref points at, or ``None``."""
        r = self.read(kind, name)
        return None if r is None else r.digest
