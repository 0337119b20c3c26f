"""Leases on an S3-compatible remote: one process, on any machine, does a job while the others wait.

A lease is one small JSON object, ``<prefix>leases/<name>``, moved only by the
server's conditional writes (the tools :mod:`casstore.refs.s3` moves refs with):

* **take**: ``PUT`` with ``If-None-Match: *`` -- of any number of racing
  processes, on any number of machines, exactly one creates it;
* **beat**: the holder rewrites it every ``ttl / 4`` seconds with
  ``If-Match: <its own ETag>``; each beat's body differs (a counter), so its
  ETag (the MD5 of the body) changes, and a holder whose beat is refused knows
  it was taken over (:attr:`S3Lease.lost`);
* **release**: ``DELETE`` with ``If-Match: <its own ETag>`` -- never removes a
  lease someone else took over meanwhile;
* **take over**: a lease nobody has rewritten for its ``ttl`` is expired;
  ``PUT`` with ``If-Match: <the expired lease's ETag>`` -- of two waiters
  that judged the same lease expired, exactly one wins (the other's ETag no
  longer matches), and a lease that beat meanwhile is not taken.

Expiry is judged **without a clock shared between machines**: an observer
times how long it has seen the *same* ETag on its own monotonic clock, as the
local lease strategy does (docs/design.md, "Locks on filesystems that lie").
So a newcomer waits one ``ttl`` of observation before it takes over a dead
holder's lease, and a holder whose clock is wrong cannot make its lease look
fresh or stale to anyone.

Hostile lease objects (another tool's key, a hand edit, a broken or malicious
client) never hang anyone and never raise a raw exception: at most
:data:`MAX_LEASE_BYTES` are read; a body that is not a lease record casstore
can read is treated as already expired (it cannot be a live casstore holder:
every casstore holder writes a readable record); a record's ``ttl`` is capped
at :data:`MAX_TTL` whatever it claims, so a lease "valid for a thousand years"
is taken over after ``MAX_TTL`` seconds without a beat.

Accepted hazard (as for every lease): a holder paused for longer than its
``ttl`` (SIGSTOP, a frozen VM, a network partition) may be taken over while it
still works; its next beat fails and it logs so, and the job may then run twice.
Correctness of what is stored never depends on a lease: objects are
content-addressed and refs move by compare-and-swap.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

from ..errors import InvalidInputError
from ..objects.s3 import S3Connection
from .local import validate_name

__all__ = ["S3Lease", "LeaseRecord", "LeaseView", "LEASES", "MAX_TTL", "MIN_TTL", "MAX_LEASE_BYTES", "lease_key"]

log = logging.getLogger("casstore.lease")

LEASES = "leases"
"""Key prefix (under the remote's prefix) of lease objects."""

MAX_TTL = 600.0
"""Longest time-to-live honoured: a record claiming more is judged with this (seconds)."""

MIN_TTL = 0.5
"""Shortest time-to-live a holder may ask for (beats come every quarter of it)."""

MAX_LEASE_BYTES = 4096
"""A lease record is ~250 bytes; at most this much of a lease object is ever read."""

_KIND = "casstore.lease"
_FIELD_MAX = 256  # longest host / what / token string kept from a record


def lease_key(prefix: str, name: str) -> str:
    """``<prefix>leases/<name>`` (``name`` checked as a ref name is)."""
    return f"{prefix}{LEASES}/{validate_name(name)}"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The body of a lease object: who holds it, for how long after each beat, and what it does."""

    host: str
    pid: int
    token: str
    """Random hex, new for every lease taken: tells two holders with the same host and pid apart."""
    ttl: float
    """Seconds after its last rewrite that the lease is expired (judged at most :data:`MAX_TTL`)."""
    beat: int
    """Beats so far (0 when taken); makes every rewrite's body, and so its ETag, new."""
    what: str
    """What the holder does (for messages)."""
    written: float
    """The holder's wall clock at the rewrite (for people only: nothing is decided by it)."""

    def encode(self) -> bytes:
        """Canonical JSON bytes."""
        doc = {"casstore": _KIND, "v": 1, "host": self.host, "pid": self.pid, "token": self.token,
               "ttl": self.ttl, "beat": self.beat, "what": self.what, "written": self.written}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: Optional[bytes]) -> Optional[LeaseRecord]:
        """The record in ``data``, or ``None`` when it is not one (garbage, wrong types, too large)."""
        if data is None or len(data) > MAX_LEASE_BYTES:
            return None
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None
        if not isinstance(doc, dict) or doc.get("casstore") != _KIND:
            return None
        host, pid, token, ttl = doc.get("host"), doc.get("pid"), doc.get("token"), doc.get("ttl")
        beat, what, written = doc.get("beat", 0), doc.get("what", ""), doc.get("written", 0.0)
        if not (isinstance(host, str) and isinstance(token, str) and isinstance(what, str)):
            return None
        if not (_is_int(pid) and _is_int(beat) and _is_num(ttl) and _is_num(written)):
            return None
        assert isinstance(pid, int) and isinstance(beat, int) and isinstance(ttl, (int, float))
        assert isinstance(written, (int, float))
        if not math.isfinite(ttl) or ttl <= 0:
            ttl = MAX_TTL  # nonsense: the longest honoured, never "forever"
        return cls(host[:_FIELD_MAX], pid, token[:_FIELD_MAX], min(float(ttl), MAX_TTL), beat,
                   what[:_FIELD_MAX], float(written) if math.isfinite(written) else 0.0)

    def describe(self) -> str:
        """``pid 123 on host-a (derive 'x')`` for messages."""
        return f"pid {self.pid} on {self.host!r}" + (f" ({self.what})" if self.what else "")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class LeaseView:
    """A lease as one observer sees it."""

    record: Optional[LeaseRecord]
    """``None``: the object is not a lease record casstore can read (treated as expired)."""
    etag: str
    """The version seen (what a takeover must name in ``If-Match``)."""
    unchanged: float
    """Seconds this observer has seen exactly this version (its own monotonic clock)."""

    @property
    def expired(self) -> bool:
        """No rewrite for the record's ttl (capped at :data:`MAX_TTL`), or not a readable record."""
        if not self.etag:
            return False  # nothing seen: a lease that came and went while we looked
        return self.record is None or self.unchanged >= self.record.ttl

    def describe(self) -> str:
        """Who holds it, for messages."""
        if not self.etag:
            return "a lease taken and released while this process looked"
        if self.record is None:
            return "an unreadable lease object (not written by casstore)"
        return self.record.describe()


class S3Lease:
    """One lease key on a remote, from the point of view of one process (see the module docstring).

    Not shared between threads except with its own heartbeat thread
    (:meth:`start_beats`); every method is safe against that thread.
    """

    def __init__(self, connection: S3Connection, prefix: str, name: str, *, what: str = "") -> None:
        self.connection = connection
        """The bucket and client."""
        self.key = lease_key(prefix, name)
        """The lease object's key."""
        self.what = what[:_FIELD_MAX]
        self._lock = threading.Lock()
        self._etag: Optional[str] = None  # ours, while held
        self._record: Optional[LeaseRecord] = None
        self._seen: Optional[str] = None  # ETag observed, and since when (monotonic)
        self._seen_since = 0.0
        self._lost = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- state --

    @property
    def held(self) -> bool:
        """Does this process hold the lease (as far as its last write knows)?"""
        with self._lock:
            return self._etag is not None and not self._lost

    @property
    def lost(self) -> bool:
        """A beat was refused: someone took the lease over (this holder was presumed dead)."""
        with self._lock:
            return self._lost

    # -- observing and taking --

    def observe(self) -> Optional[LeaseView]:
        """Read the lease: ``None`` if there is none; else what it holds and how long it has been unchanged."""
        got = self.connection.get(self.key, limit=MAX_LEASE_BYTES, action="reading lease")
        now = time.monotonic()
        if got is None:
            self._seen = None
            return None
        if got.etag != self._seen:
            self._seen, self._seen_since = got.etag, now
        return LeaseView(LeaseRecord.decode(got.data), got.etag, now - self._seen_since)

    def try_acquire(self, ttl: float) -> Optional[LeaseView]:
        """Take the lease if it is free or expired; ``None`` when taken, else the live holder's view.

        Free: create-only PUT.  Expired (see :attr:`LeaseView.expired`):
        PUT with ``If-Match`` on the ETag judged expired, so of two waiters
        racing to take it over exactly one wins.
        """
        if not (isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and MIN_TTL <= ttl <= MAX_TTL):
            raise InvalidInputError(f"a lease ttl must be between {MIN_TTL} and {MAX_TTL} seconds, not {ttl!r}")
        if self.held:
            return None
        for _ in range(3):  # a lease released between our reads: try the create again, a bounded number of times
            rec = self._new_record(float(ttl))
            etag = self.connection.put(self.key, rec.encode(), create_only=True, content_type="application/json",
                                       action="creating lease")
            if etag is not None:
                self._took(etag, rec)
                return None
            view = self.observe()
            if view is None:
                continue  # released meanwhile: create again
            if not view.expired:
                return view
            etag = self.connection.put(self.key, rec.encode(), if_match=view.etag, content_type="application/json",
                                       action="taking over lease")
            if etag is not None:
                log.warning("%s: took over the lease %s from %s (no beat for %.1f s)",
                            self.connection.where, self.connection.s3_url(self.key), view.describe(),
                            view.unchanged)
                self._took(etag, rec)
                return None
            view = self.observe()  # another waiter won the takeover (or the holder beat): its lease now
            if view is not None:
                return view
        # Bounded: a lease that keeps coming and going (or a server that refuses creates of a missing
        # key) must not spin here; the caller waits and asks again.
        return self.observe() or LeaseView(None, "", 0.0)

    def _new_record(self, ttl: float) -> LeaseRecord:
        return LeaseRecord(socket.gethostname()[:_FIELD_MAX], os.getpid(), os.urandom(12).hex(), ttl, 0,
                           self.what, time.time())

    def _took(self, etag: str, rec: LeaseRecord) -> None:
        with self._lock:
            self._etag, self._record, self._lost = etag, rec, False

    # -- holding --

    def renew(self) -> bool:
        """One beat: rewrite the lease with ``If-Match`` on our ETag.  ``False``: not held, or taken over."""
        with self._lock:
            etag, rec = self._etag, self._record
            if etag is None or rec is None or self._lost:
                return False
        new = LeaseRecord(rec.host, rec.pid, rec.token, rec.ttl, rec.beat + 1, rec.what, time.time())
        got = self.connection.put(self.key, new.encode(), if_match=etag, content_type="application/json",
                                  action="renewing lease")
        with self._lock:
            if self._etag != etag:  # released meanwhile
                return False
            if got is None:
                self._lost = True
                log.warning("%s: lease %s was taken over by another process while this one (%s) held it; "
                            "it was presumed dead (no beat seen for %.1f s) -- the work may run twice",
                            self.connection.where, self.connection.s3_url(self.key), rec.describe(), rec.ttl)
                return False
            self._etag, self._record = got, new
            return True

    def start_beats(self, every: Optional[float] = None) -> None:
        """Beat on a daemon thread every ``every`` seconds (default: a quarter of the ttl) until released."""
        with self._lock:
            rec = self._record
            if rec is None or self._thread is not None:
                return
            interval = rec.ttl / 4 if every is None else every
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat_loop, args=(interval,), daemon=True,
                                            name="casstore-lease-beat")
            self._thread.start()

    def _beat_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                if not self.renew() and (self.lost or not self.held):
                    return
            except Exception as e:  # noqa: BLE001 - a failed beat is retried; the ttl has 4 beats of slack
                log.warning("%s: could not renew lease %s (%s); trying again",
                            self.connection.where, self.connection.s3_url(self.key), e)

    def stop_beats(self) -> None:
        """Stop the heartbeat thread (returns once it has stopped)."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join()
        self._thread = None

    def release(self) -> bool:
        """Stop beating and delete the lease with ``If-Match`` on our ETag; ``False`` if it was taken over."""
        self.stop_beats()
        with self._lock:
            etag, self._etag = self._etag, None
            lost = self._lost
            rec, self._record = self._record, None
        if etag is None or lost:
            return False
        ok = self.connection.delete(self.key, if_match=etag)
        if not ok and rec is not None:
            log.warning("%s: lease %s was taken over before %s released it (presumed dead)",
                        self.connection.where, self.connection.s3_url(self.key), rec.describe())
        return ok

    def status(self) -> Dict[str, object]:
        """What this process knows of the lease (for messages and tests)."""
        with self._lock:
            return {"key": self.key, "held": self._etag is not None and not self._lost, "lost": self._lost,
                    "beat": None if self._record is None else self._record.beat}

    def __repr__(self) -> str:
        return f"S3Lease({self.connection.s3_url(self.key)!r})"
