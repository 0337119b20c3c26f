"""fcntl locks on sidecar files in ``<root>/locks``, with timeouts and progress logs.

Why not ``filelock.FileLock`` directly: its default 50 ms poll made contended
waits unfair here (p99 ~100 ms) and its errors do not name what we waited
for.  We take ``flock(LOCK_EX | LOCK_NB)`` and poll with a short, jittered
back-off (0.2 ms doubling to 5 ms; 25 ms after a second of waiting), log a line every ``log_every`` seconds while
waiting, and raise :class:`LockTimeout` naming the lock file.

Hazards these locks are built around:

* The kernel releases an ``flock`` when its holder dies (even by SIGKILL), so a
  crashed writer never leaves a name locked.  A *live* holder that never lets
  go is met with a timeout, not a hang -- unless it beats a heartbeat (below):
  a holder that shows it is alive and working is waited for.
* A lock file is never the file being replaced (refs are replaced by rename;
  renaming over a locked file would silently split the lock), and lock files
  are never deleted (deleting one lets two processes lock different inodes).
* Locks only serialize updates and avoid duplicate work; correctness of
  objects never depends on them (NFS/Lustre locks can silently succeed).

Heartbeats (issue 13): a holder doing long work (a fetch, a derive ``fn``)
takes the lock with ``heartbeat=`` seconds.  It writes a record into the lock
file itself -- pid, host, start time, beat interval, what it is doing -- and a
daemon thread touches the file's mtime every ``heartbeat`` seconds until the
lock is released (the record is cleared then).  The lock file is the one file
every waiter already has, it is never replaced or deleted, so the record can
never be split from the lock it describes.  A waiter's ``timeout`` then means
"no sign of life for ``timeout`` seconds", not "waited ``timeout`` seconds":
it re-opens the lock file every :data:`CHECK_EVERY` seconds (a fresh open, so
NFS close-to-open consistency shows a remote holder's beats) and restarts its
clock whenever the file's mtime or size changed.  A live, beating holder is
waited for however long it works; a stalled one (stopped, hung in the kernel,
its beat thread starved) or a dead one whose lock is still held (another host,
or a child that inherited the descriptor) is met with a :class:`LockTimeout`
that says which.  The stall limit is never below three beat intervals, so a
short ``timeout`` cannot mistake a live holder between two beats for a stalled
one.  Holders without a heartbeat (edits, pins: milliseconds) write nothing,
and their waiters time out after ``timeout`` seconds as before.  Hazard: the
record is written by any process that can open the lock file (a shared store
is group-writable), so it is parsed defensively and only ever shown, never
trusted for a decision other than the message and the stall limit (capped).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import random
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Optional, Tuple, Type

from ._shared import makedirs, share_new_file
from .errors import LockTimeout, ReadOnlyError

__all__ = ["FileLock", "DEFAULT_TIMEOUT", "BEAT_EVERY", "CHECK_EVERY", "Holder", "read_holder"]

log = logging.getLogger("casstore.lock")

DEFAULT_TIMEOUT = 600.0

BEAT_EVERY = 1.0
"""Seconds between a heartbeat holder's beats (one ``futimens`` each: a syscall, or one NFS SETATTR)."""

CHECK_EVERY = 0.25
"""Seconds between a waiter's looks at the lock file's heartbeat (one open, fstat, pread, close)."""

_RECORD_SIZE = 512  # every record is written padded to this size, so a reader never sees an old tail
_MIN_BEATS = 3.0  # a stall is at least this many missed beats, whatever the waiter's timeout
_MAX_EVERY = 60.0  # a hostile record cannot stretch the stall limit beyond 3 minutes
_HOST = socket.gethostname()

# Locks this process holds.  A forked child closes its copies at once (without
# unlocking, which would release the parent's lock too), so a DataLoader
# worker or pool process started inside ``edit()`` or a ``derive`` fn can
# never keep a name locked after its parent released it or died.
_held: weakref.WeakSet[FileLock] = weakref.WeakSet()


def _close_inherited_locks() -> None:
    for lk in list(_held):
        fd, lk._fd = lk._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass
    _held.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


@dataclass(frozen=True, slots=True)
class Holder:
    """What a heartbeat holder wrote into its lock file (:func:`read_holder`)."""

    pid: int
    """Process id of the holder (on :attr:`host`)."""
    host: str
    """Host name of the holder."""
    started: float
    """When it took the lock (``time.time()`` on its host)."""
    every: float
    """Seconds between its beats."""
    what: str
    """What it holds the lock for."""
    beat: float
    """The lock file's mtime: its last beat (``time.time()`` scale, the file system's clock)."""

    def alive(self) -> Optional[bool]:
        """Is the holder process alive?  ``None`` when it runs on another host (unknowable from here)."""
        if self.host != _HOST:
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # EPERM: another user's live process
            return True
        return True

    def describe(self) -> str:
        """``pid 123 on host h, holding it for 4s``: for log lines and errors."""
        return f"pid {self.pid} on host {self.host}, holding it for {max(0.0, time.time() - self.started):.0f}s"


def _text(value: object, limit: int) -> str:
    return value[:limit] if isinstance(value, str) and value.isprintable() else "?"


def _number(value: object) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN
        return None
    return float(value)


def _parse_holder(data: bytes, mtime: float) -> Optional[Holder]:
    # Hostile bytes (any group member can write a shared store's lock files): anything odd is "no record".
    try:
        doc = json.loads(data.decode("utf-8").strip() or "null")
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    pid, started, every = doc.get("pid"), _number(doc.get("started")), _number(doc.get("every"))
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 1 << 31 or started is None \
            or every is None or not 0 < every <= _MAX_EVERY:
        return None
    return Holder(pid, _text(doc.get("host"), 255), started, every, _text(doc.get("what"), 200), mtime)


def _peek(path: Path, fd: int) -> Tuple[Tuple[int, int], Optional[Holder]]:
    """(mtime_ns, size) of the lock file and its holder record, read through a fresh open."""
    try:
        rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        rfd = -1  # unreadable by name (a read-only mount, a swapped path): our own descriptor will do
    try:
        use = rfd if rfd >= 0 else fd
        st = os.fstat(use)
        data = os.pread(use, _RECORD_SIZE, 0) if st.st_size else b""
    except OSError:
        return (0, 0), None
    finally:
        if rfd >= 0:
            os.close(rfd)
    return (st.st_mtime_ns, st.st_size), _parse_holder(data, st.st_mtime_ns / 1e9)


def read_holder(path: Path) -> Optional[Holder]:
    """The heartbeat record in the lock file at ``path``, or ``None`` (no heartbeat holder, or unreadable).

    A record can outlive its writer if it died (the lock is then free, or held
    by someone else): check :meth:`Holder.alive` and whether the lock is held.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return _peek(path, fd)[1]
    finally:
        os.close(fd)


class _Beat:
    """The daemon thread that touches a held lock file every ``every`` seconds."""

    __slots__ = ("_stop", "_thread", "_fd", "_every")

    def __init__(self, fd: int, every: float) -> None:
        self._fd = fd
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="casstore-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                os.utime(self._fd)  # futimens: the beat is the mtime
            except OSError:  # pragma: no cover - a full or read-only file system: waiters see a stall
                pass

    def stop(self) -> None:
        """Stop beating; returns once the thread is done (so the descriptor may be closed)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class FileLock:
    """An exclusive (or shared) fcntl lock on ``path``, usable as a context manager.

    ``timeout=None`` waits forever; ``0`` tries once.  Otherwise a waiter gives
    up after ``timeout`` seconds *without a sign of life from the holder*: a
    holder that beats (``heartbeat``) is waited for as long as it beats (see
    the module docstring).  ``what`` describes the purpose in log lines and
    errors ("manifest 'exp-42'").  ``heartbeat``: seconds between this
    holder's beats while it holds the lock (exclusive locks only; ``None``:
    no heartbeat, for locks held for milliseconds).
    """

    __slots__ = ("path", "timeout", "what", "shared", "log_every", "heartbeat", "_fd", "mode", "_pid", "_beat",
                 "_record", "__weakref__")

    def __init__(self, path: Path, *, timeout: Optional[float] = DEFAULT_TIMEOUT, what: str = "",
                 shared: bool = False, log_every: float = 10.0, mode: int = 0o666,
                 heartbeat: Optional[float] = None) -> None:
        self.path = path
        self.timeout = timeout
        self.what = what or str(path)
        self.shared = shared
        self.log_every = log_every
        self.mode = mode
        self.heartbeat = heartbeat
        self._fd = -1
        self._pid = 0
        self._beat: Optional[_Beat] = None
        self._record = False

    @property
    def held(self) -> bool:
        """Whether this object currently holds the lock."""
        return self._fd >= 0

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
        except FileNotFoundError:
            makedirs(self.path.parent)  # new dirs copy a shared (setgid) parent's mode
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
        except OSError as e:
            # EACCES/EPERM (another user's store) or EROFS (a read-only mount).
            if not isinstance(e, PermissionError) and e.errno != errno.EROFS:
                raise
            if self.shared:
                # Readers of a read-only store may still take shared locks.
                try:
                    return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    pass
            raise ReadOnlyError(
                f"cannot open lock file {self.path}: {e.strerror}; the store is read-only for this process"
            ) from None
        share_new_file(fd, self.path.parent)  # group-writable in a shared store, whatever the umask
        return fd

    def acquire(self) -> FileLock:
        """Take the lock or raise :class:`LockTimeout` once the holder showed no life for ``timeout`` s."""
        if self._fd >= 0:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        fd = self._open()
        op = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        start = time.monotonic()
        next_log = start + self.log_every
        delay = 0.0002
        last_life = start  # when the holder last showed life, as this waiter saw it
        seen: Optional[Tuple[int, int]] = None
        holder: Optional[Holder] = None
        next_check = start
        try:
            while True:
                try:
                    fcntl.flock(fd, op)
                    self._fd = fd
                    self._pid = os.getpid()
                    _held.add(self)
                    if not self.shared:
                        self._announce(fd)
                    return self
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                now = time.monotonic()
                if now >= next_check:
                    sig, holder = _peek(self.path, fd)
                    if seen is not None and sig != seen:
                        last_life = now  # a beat, or the lock changed hands
                    seen = sig
                    next_check = now + CHECK_EVERY
                limit = self._limit(holder)
                if limit is not None and now - last_life >= limit:
                    raise self._timed_out(holder, now - start)
                if now >= next_log:
                    log.warning("still waiting for the lock on %s (%s) after %.0fs%s", self.what, self.path,
                                now - start, self._holder_note(holder))
                    next_log = now + self.log_every
                sleep = delay * (0.5 + random.random())
                if limit is not None:
                    sleep = min(sleep, max(0.0, last_life + limit - now))
                time.sleep(sleep)
                # 5 ms keeps short waits (edits) fair; after a second the holder is doing real work
                # (a fetch, a derive) and 7 waiting ranks polling 200 times a second each would take
                # CPU from it on a small machine: 25 ms (40 polls/s) costs at most 25 ms at hand-over.
                delay = min(delay * 2, 0.005 if now - start < 1.0 else 0.025)
        except BaseException:
            if self._fd < 0:
                os.close(fd)
            raise

    def _limit(self, holder: Optional[Holder]) -> Optional[float]:
        """Seconds without life before giving up (``None``: never)."""
        if self.timeout is None or self.timeout == 0 or holder is None:
            return self.timeout
        return max(self.timeout, _MIN_BEATS * holder.every)

    @staticmethod
    def _holder_note(holder: Optional[Holder]) -> str:
        if holder is None:
            return ""
        return f"; holder {holder.describe()}, last beat {max(0.0, time.time() - holder.beat):.0f}s ago"

    def _timed_out(self, holder: Optional[Holder], waited: float) -> LockTimeout:
        head = (f"timed out after {self.timeout:g}s waiting for the lock on {self.what} (lock file {self.path})")
        if holder is None:
            return LockTimeout(
                f"{head}; another process holds it (it records no heartbeat) -- wait, or find and stop it "
                f"(e.g. `fuser {self.path}`)"
            )
        ago = max(0.0, time.time() - holder.beat)
        if holder.alive() is False:
            return LockTimeout(
                f"{head}: its holder is dead -- pid {holder.pid} on host {holder.host} is gone, yet the lock is "
                f"still held (a child process that inherited it, or a lock server that has not noticed), and "
                f"nothing has beaten for {ago:.0f}s; find what holds it with `fuser {self.path}`"
            )
        return LockTimeout(
            f"{head}: its holder is stalled -- last beat {ago:.0f}s ago (it beats every {holder.every:g}s; "
            f"waited {waited:.0f}s), holder {holder.describe()} ({holder.what}); it may be stopped (SIGSTOP, "
            f"a debugger) or hung -- resume it or stop it, then run again"
        )

    def _announce(self, fd: int) -> None:
        """Write (heartbeat) or clear (no heartbeat) the holder record, and start beating."""
        try:
            if self.heartbeat is None:
                if os.fstat(fd).st_size:  # a dead heartbeat holder's record must not describe us
                    os.ftruncate(fd, 0)
                return
            every = min(max(float(self.heartbeat), 0.01), _MAX_EVERY)
            doc = {"pid": os.getpid(), "host": _HOST, "started": time.time(), "every": every,
                   "what": self.what[:200]}
            data = json.dumps(doc).encode("utf-8")[: _RECORD_SIZE - 1]
            os.pwrite(fd, data.ljust(_RECORD_SIZE - 1) + b"\n", 0)
            os.ftruncate(fd, _RECORD_SIZE)
            self._record = True
            self._beat = _Beat(fd, every)
        except OSError as e:  # a read-only lock file (shared store of another user): no record, no beats
            log.debug("no heartbeat record for %s: %s", self.path, e)

    def release(self) -> None:
        """Release the lock: unlock explicitly, then close.

        Closing alone is not enough: a child forked while the lock was held
        shares the open file description, and the flock would live on in it.
        """
        if self._fd >= 0:
            beat, self._beat = self._beat, None
            if beat is not None:
                beat.stop()  # before the close: it must never touch a reused descriptor
            fd, self._fd = self._fd, -1
            _held.discard(self)
            try:
                if os.getpid() == self._pid:
                    if self._record:
                        self._record = False
                        try:
                            os.ftruncate(fd, 0)  # the record describes a holder: we are done holding
                        except OSError:  # pragma: no cover
                            pass
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.release()
