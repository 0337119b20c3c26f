"""The remote side of fetch/derive across machines: :class:`S3Share`, the pipelines' ``RemoteShare``.

``casstore.pipelines.remote`` defines what a fetch or derive needs from a
remote (look a result up, bring it home, publish one, a lease per name) as a
protocol, so that the pipelines feature never imports this one; the store
facade resolves ``remote="origin"`` to an :class:`S3Share` and passes it in.

* look-up: the remote pin (else head) of the name, and its version read with
  a size bound, verified (hashed) and decoded by THE manifest decoder --
  never its objects, so judging a remote result costs two small GETs;
* bring home: :func:`casstore.sync.pull.pull_closure` -- the version (with its
  history) and every object it names, each verified before it is stored; no
  local ref moves (the caller holds the name's lock and moves it);
* publish: :func:`casstore.sync.push.push` of the local head -- objects first
  (create-only), the remote head last by compare-and-swap on the ETag read
  just before.  ``force=True``: the holder of the lease is the one producer
  of this name right now, and the remote head it replaces held a result for
  another key (otherwise it would have been taken); its objects stay.
* lease: :class:`casstore.refs.s3lease.S3Lease` on ``<prefix>leases/<name>``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Union

from ..digest import Digest
from ..errors import RemoteConflictError, StoreFormatError
from ..manifests.model import ManifestDoc, decode_manifest
from ..refs.s3lease import S3Lease
from .pull import MAX_MANIFEST_BYTES, pull_closure
from .push import push
from .remotes import Remote, resolve_remote

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["S3Share", "share"]

log = logging.getLogger("casstore.share")


class S3Share:
    """A remote as fetch/derive use it to work once across machines (see the module docstring)."""

    def __init__(self, store: Store, remote: Remote) -> None:
        self.store = store
        """The local store results are brought into and published from."""
        self.remote = remote
        """The remote shared with the other machines."""

    def describe(self) -> str:
        """The remote, for messages."""
        return self.remote.describe()

    def head(self, name: str) -> Optional[Digest]:
        """The remote's version of ``name``: its pin, else its head; ``None`` if it has neither."""
        return self.remote.refs.get("pins", name) or self.remote.refs.get("heads", name)

    def read_version(self, digest: Digest) -> ManifestDoc:
        """Version ``digest`` from the remote: bounded, hashed, decoded (hostile content refused)."""
        data = self.remote.objects.read_at_most(digest, MAX_MANIFEST_BYTES, chunked=True)
        if data is None:
            raise StoreFormatError(f"{self.describe()}: manifest version {self.remote.objects.url(digest)} is "
                                   f"larger than {MAX_MANIFEST_BYTES} bytes; refused")
        return decode_manifest(data, digest)

    def bring_home(self, digest: Digest) -> None:
        """Pull version ``digest``'s closure (verified); no local ref moves."""
        pull_closure(self.store, self.remote, digest)

    def publish(self, name: str) -> None:
        """Push the local head ``name`` (objects first, then the remote head by compare-and-swap)."""
        try:
            push(self.store, self.remote, name, force=True)
        except RemoteConflictError as e:
            # Someone moved the remote head between our read and our compare-and-swap: a holder
            # presumed dead that finished late, or a plain push.  Their result stays; ours is local.
            log.warning("%s: the result of %r was kept locally, not published: %s", self.describe(), name, e)

    def lease(self, name: str, what: str) -> S3Lease:
        """The lease of ``name`` on the remote (``<prefix>leases/<name>``)."""
        return S3Lease(self.remote.connection, self.remote.prefix, name, what=what)

    def __repr__(self) -> str:
        return f"S3Share({self.remote!r})"


def share(store: Store, remote: Union[Remote, str]) -> S3Share:
    """The :class:`S3Share` of ``remote`` (a :class:`Remote`, a configured name or an ``s3://`` URL)."""
    return S3Share(store, resolve_remote(store, remote))
