"""Push and gc markers on a remote: how remote gc and concurrent pushes stay out of each other's way.

A push relies on objects it found on the remote (it skips uploading what is
already there: dedupe) and then moves a ref; remote gc deletes objects no ref
names.  Without coordination a gc could delete an old object a push has just
decided not to upload, and the push would then move a ref to a missing object.
The grace period cannot protect that object: it is old.  So both announce
themselves with a *marker key*, created before they look at anything and
removed when they are done (docs/remotes.md, "Remote gc", has the argument):

``<prefix>locks/push/<id>``   a push between its listing and its last ref write
``<prefix>locks/gc/<id>``     a gc between its root scan and its last delete

* A push writes its marker, *then* lists the gc markers.  A live one: it
  removes its own marker (so the two never wait for each other), waits until
  the gc is done, and tries again.  None: it may go on; any gc that starts
  later will see its marker.
* A gc writes its marker, *then* lists the push markers, and waits while a
  live one exists (keeping its own marker, so no new push starts: a stream of
  pushes cannot starve it).  Only then does it read the roots and delete.

Both write before they read, and the server orders the writes and listings
of one bucket (S3 has been strongly consistent since December 2020; SeaweedFS
and MinIO are too), so of a push and a gc that overlap at least one sees the
other.

Hazard: a process killed (SIGKILL, a lost machine) leaves its marker behind.
Markers therefore carry a heartbeat: the holder rewrites its key every
:data:`BEAT_SECONDS`, and a marker whose ``LastModified`` is more than
:data:`STALE_SECONDS` older than the observer's own marker (server time on
both sides, never a client clock) is ignored as dead.  A holder checks on its
own monotonic clock that its last beat is recent enough (:meth:`Marker.held`)
before the step that needs it (a push's ref write, each gc delete batch); if
not, it may have been judged dead, and it announces itself again and
re-checks what it relied on.  Accepted hazard, as for every lease: a holder
paused for longer than the margin *between* that check and its next request.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

from .._layout import LOCKS
from ..errors import CasstoreError, InvalidInputError, LockTimeout

if TYPE_CHECKING:
    from .remotes import Remote

__all__ = ["Marker", "MarkerInfo", "BEAT_SECONDS", "STALE_SECONDS", "KINDS", "list_markers"]

log = logging.getLogger("casstore.remote")

BEAT_SECONDS = 10.0
"""How often a holder rewrites its marker."""
STALE_SECONDS = 60.0
"""A marker not rewritten for this long (server time) is a dead process's; observers ignore it."""
HELD_MARGIN = 0.5
"""A holder trusts its marker for this fraction of :data:`STALE_SECONDS` after its last beat began
(room for clock-rate drift between the holder and the server, and for the request in flight)."""
POLL_SECONDS = 0.25
"""How often a waiter lists the markers again."""

KINDS = ("push", "gc")


@dataclass(frozen=True, slots=True)
class MarkerInfo:
    """A marker key as listed."""

    kind: str
    """``"push"`` or ``"gc"``."""
    key: str
    modified: float
    """``LastModified`` (server clock, POSIX seconds)."""


def _prefix(rem: Remote) -> str:
    return f"{rem.prefix}{LOCKS}/"


def list_markers(rem: Remote) -> List[MarkerInfo]:
    """Every push and gc marker under the remote's prefix (one listing)."""
    base = _prefix(rem)
    out: List[MarkerInfo] = []
    for k in rem.connection.list_modified(base):
        kind, _, rest = k.key[len(base):].partition("/")
        if kind in KINDS and rest and "/" not in rest:
            out.append(MarkerInfo(kind, k.key, k.modified))
    return out


class Marker:
    """This process's marker on a remote (a push's or a gc's), with its heartbeat.

    ``with Marker(rem, "push", what) as m:`` creates the key, beats it on a
    helper thread, and removes it on exit.  :meth:`others` lists the live and
    stale markers of the other kind, judged against this marker's own
    ``LastModified`` (server time).
    """

    def __init__(self, rem: Remote, kind: str, what: str) -> None:
        if kind not in KINDS:
            raise InvalidInputError(f"marker kind must be one of {KINDS}, not {kind!r}")
        self.rem = rem
        """The remote."""
        self.kind = kind
        """``"push"`` or ``"gc"``."""
        self.key = f"{_prefix(rem)}{kind}/{uuid.uuid4().hex}"
        """The marker's key."""
        self._body = json.dumps({"kind": kind, "what": what, "host": socket.gethostname(), "pid": os.getpid(),
                                 "started": time.time()}).encode()
        self._beat_started: Optional[float] = None  # monotonic start of the last beat that succeeded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._exists = False

    # -- the key --

    def _write(self) -> None:
        t = time.monotonic()  # before the request: the server's LastModified is no earlier than this
        self.rem.connection.put(self.key, self._body, content_type="application/json", action="writing marker")
        with self._lock:
            self._beat_started = t
            self._exists = True

    def announce(self) -> None:
        """Write (or rewrite) the marker now, and keep it beating."""
        self._write()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name=f"casstore-{self.kind}-marker", daemon=True)
            self._thread.start()

    def withdraw(self) -> None:
        """Stop beating and remove the marker (best effort: a leftover expires after STALE_SECONDS)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join()
        with self._lock:
            existed, self._exists, self._beat_started = self._exists, False, None
        if existed:
            try:
                self.rem.connection.delete(self.key)
            except CasstoreError as e:  # it expires on its own; the work itself is done
                log.warning("could not remove marker %s: %s", self.key, e)

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self._write()
            except CasstoreError as e:  # held() turns false if this goes on; the holder then re-checks
                log.warning("marker %s: heartbeat failed: %s", self.key, e)

    def held(self) -> bool:
        """Is the marker certainly still fresh for every observer (its last beat recent, by this host's clock)?"""
        with self._lock:
            b = self._beat_started
        return b is not None and time.monotonic() - b < STALE_SECONDS * HELD_MARGIN

    # -- the others --

    def others(self) -> Tuple[List[MarkerInfo], List[MarkerInfo], float]:
        """``(live, stale, server_now)``: markers of the *other* kind, and the server time they were judged at.

        ``server_now`` is this marker's own ``LastModified`` as listed (a lower
        bound of the server's clock at the listing), so no client clock enters.
        """
        other = "gc" if self.kind == "push" else "push"
        listed = list_markers(self.rem)
        mine = [m.modified for m in listed if m.key == self.key]
        now = mine[0] if mine else self.rem.connection.server_time(_prefix(self.rem))
        live = [m for m in listed if m.kind == other and m.modified > now - STALE_SECONDS]
        stale = [m for m in listed if m.kind == other and m.modified <= now - STALE_SECONDS]
        return live, stale, now

    def wait_clear(self, timeout: Optional[float], *, back_off: bool) -> List[MarkerInfo]:
        """Return once no live marker of the other kind exists (this one written first); the stale ones seen.

        ``back_off`` (pushes): while a gc runs, this marker is removed, so a
        gc waiting for pushes to finish is never waiting for us; it is
        written again before the next look.  Without it (gc) the marker stays
        up, so no new push starts while we wait for the running ones.
        :class:`LockTimeout` after ``timeout`` seconds (``None``: wait forever).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        next_log = time.monotonic() + 10.0
        while True:
            if not self.held():
                self.announce()
            live, stale, _now = self.others()
            if not live:
                return stale
            if back_off:
                self.withdraw()
            if deadline is not None and time.monotonic() > deadline:
                self.withdraw()
                who = "a remote gc is deleting" if self.kind == "push" else f"{len(live)} push(es) are in progress"
                raise LockTimeout(
                    f"{self.rem.describe()}: {who} (marker {live[0].key}); waited {timeout:.0f} s. "
                    "Run again later; a marker of a killed process expires after "
                    f"{STALE_SECONDS:.0f} s without a heartbeat"
                )
            if time.monotonic() > next_log:
                log.info("%s: waiting for %d %s marker(s), e.g. %s", self.rem.describe(), len(live),
                         live[0].kind, live[0].key)
                next_log = time.monotonic() + 10.0
            time.sleep(POLL_SECONDS)

    def __enter__(self) -> Marker:
        self.announce()
        return self

    def __exit__(self, *exc: object) -> None:
        self.withdraw()
