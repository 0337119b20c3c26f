"""Fetch once and derive once *across machines*: a remote lease on top of the local name lock.

Processes on different machines share nothing but a remote, so the name lock
(one machine's files) cannot make them work once.  With ``remote=`` a
fetch/derive that misses locally, while holding its local name lock:

1. looks for a usable result on the remote (the remote head of the same
   name; its manifest is read, verified and decoded, never its objects) and,
   if there is one, brings it home (its closure pulled, verified, and the
   local head set to it) -- no work;
2. otherwise takes the name's lease on the remote
   (:class:`casstore.refs.s3lease.S3Lease`: create-only, beaten by
   ``If-Match``, taken over by compare-and-swap once expired) and, holding
   it, looks once more (a holder may have published and released between
   step 1 and the take), does the work, publishes the result (objects, then
   the remote head by compare-and-swap) and releases the lease;
3. or, when another process holds the lease, waits: polls with back-off
   (0.1 s growing to 2 s) for the result or the lease's end, logging every
   ~10 s.  A holder that stops beating for its ``ttl`` is dead: a waiter
   takes the lease over and does the work.

The remote side is a strategy object, :class:`RemoteShare` (implemented in
:mod:`casstore.sync.share`; the store facade resolves ``remote="origin"`` to
one), so this layer needs no import of the sync feature.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol, TypeVar

from .._gclock import commit_lock
from ..digest import Digest
from ..errors import LockTimeout, ObjectNotFoundError
from ..manifests import Manifest, ManifestDoc, load_manifest
from .common import write_head

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["RemoteShare", "RemoteLease", "LeaseHolder", "run_once_remote", "lease_ttl", "adopt_version",
           "write_head_exact", "LEASE_TTL", "POLL_FIRST", "POLL_MAX"]

log = logging.getLogger("casstore.remote-once")

LEASE_TTL = 60.0
"""Longest lease time-to-live a fetch/derive asks for: a dead machine's lease is taken over this long after
its last beat (a shorter ``timeout`` gives a shorter ttl).  Beats come every quarter of the ttl."""

POLL_FIRST = 0.1
"""First wait between two looks of a waiter (seconds); doubles up to :data:`POLL_MAX`."""
POLL_MAX = 2.0
"""Longest wait between two looks of a waiter (seconds)."""

T = TypeVar("T")


def lease_ttl(lock_timeout: Optional[float]) -> float:
    """The lease ttl for a holder whose ``timeout`` is given: ``timeout`` within [0.5, :data:`LEASE_TTL`] s."""
    if lock_timeout is None or math.isinf(lock_timeout):
        return LEASE_TTL
    return min(LEASE_TTL, max(0.5, lock_timeout))


class LeaseHolder(Protocol):
    """Who holds a lease, as a waiter sees it."""

    @property
    def expired(self) -> bool:
        """No beat for the holder's ttl (or not a readable lease)."""

    @property
    def unchanged(self) -> float:
        """Seconds this waiter has seen the lease unchanged."""

    def describe(self) -> str:
        """Who holds it, for messages."""


class RemoteLease(Protocol):
    """A lease on one name of a remote (:class:`casstore.refs.s3lease.S3Lease`)."""

    def try_acquire(self, ttl: float) -> Optional[LeaseHolder]:
        """Take it if free or expired: ``None`` when taken, else the live holder."""

    def start_beats(self, every: Optional[float] = None) -> None:
        """Beat it on a helper thread while the work runs."""

    def release(self) -> bool:
        """Stop beating and remove it (only if still ours)."""

    @property
    def lost(self) -> bool:
        """Was it taken over while held (this holder was presumed dead)?"""


class RemoteShare(Protocol):
    """What fetch and derive need from a remote; :func:`casstore.sync.share.share` makes one."""

    def describe(self) -> str:
        """The remote, for messages."""

    def head(self, name: str) -> Optional[Digest]:
        """The remote's version of ``name`` (its pin, else its head), or ``None``."""

    def read_version(self, digest: Digest) -> ManifestDoc:
        """That version read from the remote (size-bounded, verified, decoded by THE decoder); objects not read."""

    def bring_home(self, digest: Digest) -> None:
        """Pull the version's closure into the local store (each object verified); no local ref moves."""

    def publish(self, name: str) -> None:
        """Push the local head ``name`` with its closure: objects first, the remote head last (compare-and-swap)."""

    def lease(self, name: str, what: str) -> RemoteLease:
        """The lease of ``name`` on the remote."""


def adopt_version(store: Store, name: str, digest: Digest, share: RemoteShare, *,
                  timeout: Optional[float]) -> Manifest:
    """Make the pulled version ``digest`` the local head ``name`` (the caller holds the name's lock).

    No local head, or the local head in its history: the local head becomes
    exactly that version (same digest on every machine).  A local head with
    history of its own (results made here without the remote): the version's
    entries and metadata are recorded as a new version on top of it
    (``meta["remote.pulled"]`` says from where), so nothing local is lost.
    """
    doc = load_manifest(store.objects, digest)
    head = store.refs.get("heads", name)
    if head is None or head == digest or _in_history(store, head, digest):
        if head != digest:
            # The same commit protocol as write_head: the GC lock (shared) around the check and the move.
            write_head_exact(store, name, digest, doc, timeout=timeout)
        return Manifest(digest, doc, name=name)
    meta = dict(doc.meta)
    meta["remote.pulled"] = {"from": str(digest), "remote": share.describe(), "at": time.time()}
    return write_head(store, name, dict(Manifest(digest, doc, name=name)), meta, timeout=timeout)


def write_head_exact(store: Store, name: str, digest: Digest, doc: ManifestDoc, *, timeout: Optional[float]) -> None:
    """Move head ``name`` to the existing version ``digest`` (all its entries must be local)."""
    with commit_lock(store, timeout=timeout):
        for key, e in doc.entries.items():
            if not store.objects.has(e.digest):
                raise ObjectNotFoundError(f"{name!r}: pulled output {key!r} ({e.digest}) vanished before it was "
                                          "recorded (gc or limit?); run again")
        store.refs.write("heads", name, digest)


def _in_history(store: Store, old: Digest, of: Digest, depth: int = 10_000) -> bool:
    """Is ``old`` an ancestor of ``of`` (as far as the versions are local)?"""
    cur: Optional[Digest] = of
    seen = 0
    while cur is not None and seen < depth:
        if cur == old:
            return True
        try:
            cur = load_manifest(store.objects, cur).parent
        except ObjectNotFoundError:
            return False
        seen += 1
    return False


def run_once_remote(share: RemoteShare, name: str, *, what: str, ready: Callable[[], Optional[T]],
                    work: Callable[[], T], lock_timeout: Optional[float]) -> T:
    """Do ``work`` on exactly one machine of those sharing ``share``; the others take its result.

    ``ready()`` looks for a usable result (locally, then on the remote,
    bringing it home) and returns it, or ``None``.  ``work()`` computes the
    result locally and records it; it is then published.  ``lock_timeout``
    (``None``: wait forever) bounds only waiting without a sign of life: a
    holder that beats is waited for however long it works, one that stops
    beating is taken over after its lease's ttl; ``0`` tries once and raises
    :class:`LockTimeout` if another process holds the lease.
    """
    lease = share.lease(name, what)
    ttl = lease_ttl(lock_timeout)
    delay = POLL_FIRST
    last_log = time.monotonic()
    while True:
        got = ready()
        if got is not None:
            return got
        holder = lease.try_acquire(ttl)
        if holder is None:
            try:
                lease.start_beats()
                got = ready()  # a holder may have published and released between our look and our take
                if got is not None:
                    return got
                result = work()
                if lease.lost:
                    log.warning("%s: %s finished after its lease was taken over (this process was presumed "
                                "dead); publishing anyway -- the result published last is the remote head, both "
                                "were made from the same inputs", share.describe(), what)
                share.publish(name)
                return result
            finally:
                lease.release()
        if lock_timeout == 0:
            raise LockTimeout(f"{share.describe()}: {what} is being done by {holder.describe()} (remote lease) "
                              "and timeout=0 does not wait; call again, or wait with a timeout")
        now = time.monotonic()
        if now - last_log >= 10.0:
            last_log = now
            log.info("%s: waiting for %s, done by %s (lease unchanged for %.0f s)", share.describe(), what,
                     holder.describe(), holder.unchanged)
        time.sleep(delay)
        delay = min(POLL_MAX, delay * 2)

