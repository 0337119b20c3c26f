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
* A shared store's ``locks/`` is group-writable, so anything may be planted at
  a lock file's name.  Hazard (found by a bug hunt): a symlink at
  ``locks/gc.gate`` made every member's commit create its target outside the
  store, or chmod the member's own file there to 0664.  A lock file is opened
  with ``O_NOFOLLOW | O_NONBLOCK`` and must ``fstat`` as a regular file; a
  link, directory, FIFO or socket there is a :class:`StoreFormatError` naming
  it and saying to remove it (never followed, never waited on, never chmod-ed).
* A thread that asks for a lock it holds already (a derive ``fn`` deriving
  or editing its own name, a chain of derives back to it) would wait for
  itself forever: its own heartbeat says the holder is alive.  Each thread's
  holds are counted (:func:`_thread_holds`) and such a request is a
  :class:`LockCycleError` at once; other threads of the process wait as usual.

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

Locks that are missing or lie (issue 17).  How a lock is taken is a strategy
object chosen per store (``configure``, from the ``lock_mode`` setting and a
probe of the filesystem, ``_fsprobe.py``), never a branch on strings at each
call: :class:`FlockStrategy` (``flock``, the fast path), :class:`PosixStrategy`
(open-file-description fcntl locks, for mounts where only those are enforced)
and :class:`LeaseStrategy`.  ENOSYS/EOPNOTSUPP/ENOLCK from a kernel lock is
never a raw OSError: the store (or, for a lock outside any opened store, the
mount) switches to leases at once and logs one warning per store.

Leases: the holder of ``<lock>`` is whoever created ``<lock>.lease`` with
``O_CREAT | O_EXCL`` (atomic on local filesystems and on NFSv3+, whatever the
locks do).  The lease file holds the same JSON record as a heartbeat holder's
lock file; a holder with ``heartbeat=`` beats the lease's mtime, one without
writes ``"beats": false`` and holds it for milliseconds.  A waiter polls with
the same back-off and judges the lease by what it *sees change*, on its own
monotonic clock (no clock shared between hosts is assumed): a lease whose
identity ``(inode, mtime, size, record)`` has not changed for three beat
intervals (non-beating leases: :data:`LEASE_EXPIRY` seconds; a lease with no
readable record, whose creator died between the exclusive create and writing
it: 2 s), or whose holder runs on this host (and pid namespace) and is dead,
is stale.  A waiter polls with one ``lstat`` of the lease and reads it fully
(open, fstat, pread, close) only when it looks different or every
:data:`CHECK_EVERY` seconds, to judge its holder: on FUSE or NFS each of those is
a round trip the holder's own work queues behind.  Release removes the lease
file (below: with an end claim only for an old or beating lease).

Taking over a stale lease, and why exactly one party can: every *end* of a
lease -- its holder releasing it, or a waiter stealing it -- first wins the
claim file ``<lock>.lease.end.<inode>.<n>`` with ``O_EXCL``, where ``inode``
names the lease being ended.  Only the party holding the claim may remove or
replace that lease, and while the lease exists nobody can create a new one
(``O_EXCL`` on the lease path fails).  A stealer that won the claim then
re-reads the lease: if its identity is still exactly the stale one it judged
(same inode, mtime and size), nobody has touched it -- the holder cannot
release it without the claim, a second stealer cannot win the claim, a new
acquirer cannot create over it -- so it renames its own new lease file over
it; otherwise it backs off.  Two stealers of one stale lease race for one
``O_EXCL`` name: one wins, the other sees EEXIST and waits on the new lease.
A holder whose release finds the claim taken knows it was presumed dead (it
was stopped longer than the expiry), says so in a warning, and leaves the
lease alone.  A non-beating lease younger than a second (:data:`_QUICK_RELEASE`,
half the shortest expiry, on the monotonic and the wall clock both) skips the
claim: no waiter can judge it stale (that takes seeing it unchanged for the
whole expiry, or its holder dead), so nobody else can be ending it; its holder
checks that the lease is
still its inode and unlinks it (two operations instead of seven: an edit's
critical section on FUSE, 4 writers: 0.5x -> 0.6x of the same mount with
working locks).  A claim whose creator died before finishing is older than
:data:`LEASE_EXPIRY` (or names a dead local pid): the next claimant uses
``n + 1``.  Hazard left open, as with every lease: a holder paused for longer
than the expiry (SIGSTOP, a VM freeze) may be taken over while it still
believes it holds the lock; heartbeat holders beat from a thread, so only a
stopped process or a starved host gets there.

Shared leases (the GC lock that every commit holds shared).  A shared holder
creates its own file ``<lock>.shared/<host>.<pid>.<random>`` (a unique name:
a plain ``O_EXCL`` create, with its record), *then* looks for ``<lock>.lease``:
if it is there, it removes its file and waits as an exclusive waiter would.
An exclusive acquirer creates ``<lock>.lease`` first, *then* lists
``<lock>.shared/`` and waits until no live holder file is left.  Whichever of
the two goes second sees the other (each one's create is visible before its
look), so an exclusive holder never overlaps a shared one, shared holders
never wait for each other, and a waiting exclusive acquirer stops new shared
holders at once (``writer_first``: no gate needed).  A holder file is judged
as a lease is (dead local pid; unchanged for its expiry; no record for 2 s)
and removed when stale; only regular files count (anything else planted
there is never opened nor waited for).  A shared hold costs four operations
(create, write, look, unlink) where an exclusive lease costs about ten:
on FUSE and NFS, where each is a round trip, that is most of a commit.
An exclusive acquirer that holds the same lock shared in its own process
would wait for itself until its timeout -- casstore never nests them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Dict, List, Optional, Set, Tuple, Type

from ._fsprobe import LOCK_UNSUPPORTED, ofd_lock, ofd_unlock, probe
from ._shared import makedirs, share_new_file
from .errors import LockCycleError, LockTimeout, ReadOnlyError, StoreFormatError

__all__ = ["FileLock", "DEFAULT_TIMEOUT", "BEAT_EVERY", "CHECK_EVERY", "Holder", "read_holder", "LEASE_EXPIRY",
           "LockStrategy", "FlockStrategy", "PosixStrategy", "LeaseStrategy", "STRATEGIES", "configure",
           "strategy_for", "degrade", "lease_path", "shared_dir", "LocksUnsupported", "Filesystem", "filesystem"]

log = logging.getLogger("casstore.lock")

DEFAULT_TIMEOUT = 600.0

BEAT_EVERY = 1.0
"""Seconds between a heartbeat holder's beats (one ``futimens`` each: a syscall, or one NFS SETATTR)."""

CHECK_EVERY = 0.25
"""Seconds between a waiter's looks at the lock file's heartbeat (one open, fstat, pread, close)."""

_RECORD_SIZE = 512  # every record is written padded to this size, so a reader never sees an old tail
_MIN_BEATS = 3.0  # a stall is at least this many missed beats, whatever the waiter's timeout
_MAX_EVERY = 60.0  # a hostile record cannot stretch the stall limit beyond 3 minutes
_HOST = os.uname().nodename


def _pid_namespace() -> str:
    # Containers on one host often share a host name (``--net=host``) but not a pid namespace:
    # a pid that is "dead" here may be a live holder in the container next door, whose lease
    # must not be taken over as dead.  The namespace's inode names it ("" where unknowable).
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_PIDNS = _pid_namespace()

LEASE_EXPIRY = 30.0
"""Seconds a lease whose holder does not beat (an edit, a pin: milliseconds) may stay unchanged before a
waiter takes it over; a beating holder's lease is stale after three missed beats instead."""
_NO_RECORD_EXPIRY = 2.0  # seconds a lease without a readable record may stay unchanged
_MAX_CLAIMS = 8  # claim generations for one stale lease (each one only after the previous claimant died)

# Locks this process holds.  A forked child closes its copies at once (without
# unlocking, which would release the parent's lock too), so a DataLoader
# worker or pool process started inside ``edit()`` or a ``derive`` fn can
# never keep a name locked after its parent released it or died.
_held: weakref.WeakSet[FileLock] = weakref.WeakSet()
_per_thread = threading.local()


def _thread_holds() -> Dict[str, List[int]]:
    """This thread's held locks: lock file path -> [holds, exclusive holds] (see :meth:`FileLock.acquire`)."""
    d: Optional[Dict[str, List[int]]] = getattr(_per_thread, "holds", None)
    if d is None:
        d = _per_thread.holds = {}
    return d


def _close_inherited_locks() -> None:
    for lk in list(_held):
        lk._strategy = None  # the child holds nothing: its release must not unlock or remove a lease
        fd, lk._fd = lk._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass
        lk._mine = None
    _held.clear()
    _per_thread.holds = {}  # (the forking thread's holds were the parent's: the child holds nothing)


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
    pidns: str = ""
    """The holder's pid namespace (``pid:[4026531836]``), "" if it did not record one."""

    def alive(self) -> Optional[bool]:
        """Is the holder process alive?  ``None`` when it runs on another host or in another pid
        namespace (a container sharing this host name): unknowable from here."""
        if self.host != _HOST or (self.pidns and self.pidns != _PIDNS):
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
    import json  # (on use: a command that takes no lock, such as an unchanged status, never loads it)

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
    return Holder(pid, _text(doc.get("host"), 255), started, every, _text(doc.get("what"), 200), mtime,
                  _text(doc.get("pidns", ""), 64) if doc.get("pidns") else "")


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
    """The heartbeat record of the lock at ``path``, or ``None`` (no heartbeat holder, or unreadable).

    The record is in the lock file (kernel locks) or in its lease file
    (``<path>.lease``, lease mode).  A record can outlive its writer if it died
    (the lock is then free, or held by someone else): check
    :meth:`Holder.alive` and whether the lock is held.
    """
    for p in (path, lease_path(path)):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            got = _peek(p, fd)[1]
        finally:
            os.close(fd)
        if got is not None:
            return got
    return None


def lease_path(path: Path) -> Path:
    """The lease file of the lock at ``path`` (lease mode)."""
    return path.with_name(path.name + ".lease")


def _record(what: str, every: float, beats: bool) -> bytes:
    import json  # (on use, as in _parse_holder)

    doc = {"pid": os.getpid(), "host": _HOST, "pidns": _PIDNS, "started": time.time(), "every": every,
           "what": what[:200], "beats": beats}
    data = json.dumps(doc).encode("utf-8")[: _RECORD_SIZE - 1]
    return data.ljust(_RECORD_SIZE - 1) + b"\n"


def _beats(data: bytes) -> bool:
    """Whether a record says its holder beats (kernel-lock records always do; hostile bytes: no)."""
    import json  # (on use, as in _parse_holder)

    try:
        doc = json.loads(data.decode("utf-8").strip() or "null")
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("beats", True) is True


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


class LocksUnsupported(OSError):
    """A kernel lock failed with ENOSYS/EOPNOTSUPP/ENOLCK: the caller switches to leases (never escapes)."""


class LockStrategy:
    """How a :class:`FileLock` is taken and released: one object per kind of lock (see the module docstring)."""

    name = "?"
    """``flock``, ``posix`` or ``lease``: the ``lock_mode`` value that selects it."""

    writer_first = False
    """Does an exclusive acquirer stop new shared holders at once, while it waits for the current ones
    to leave?  Kernel locks have no queue (``_gclock.py`` adds a gate for that); leases do."""

    def acquire(self, lock: FileLock) -> None:
        """Take ``lock`` (waiting as its timeout allows) or raise :class:`LockTimeout` / :class:`LocksUnsupported`."""
        raise NotImplementedError

    def release(self, lock: FileLock) -> None:
        """Release ``lock``, which this strategy took."""
        raise NotImplementedError


class _KernelStrategy(LockStrategy):
    """A lock the kernel keeps on the lock file (flock or OFD fcntl): dropped when its holder dies."""

    def try_lock(self, fd: int, shared: bool) -> bool:
        """One non-blocking attempt: True if taken, False if held elsewhere; OSError otherwise."""
        raise NotImplementedError

    def unlock(self, fd: int) -> None:
        """Release the kernel lock on ``fd``."""
        raise NotImplementedError

    def acquire(self, lock: FileLock) -> None:
        """Poll :meth:`try_lock` with a jittered back-off until taken or the holder showed no life for long."""
        fd = lock._open()
        w = _Wait(lock)
        try:
            while True:
                try:
                    if self.try_lock(fd, lock.shared):
                        break
                except OSError as e:
                    if e.errno in LOCK_UNSUPPORTED:
                        raise LocksUnsupported(e.errno, f"{self.name} locks: {e.strerror}") from None
                    raise
                now = time.monotonic()
                if now >= w.next_check:
                    sig, holder = _peek(lock.path, fd)
                    w.saw(sig, holder, now)
                w.pause(now)
        except BaseException:
            os.close(fd)
            raise
        lock._fd = fd
        lock._pid = os.getpid()
        lock._strategy = self
        _held.add(lock)
        if not lock.shared:
            lock._announce(fd)

    def release(self, lock: FileLock) -> None:
        """Clear the holder record, unlock explicitly (a forked child may share the description), close."""
        fd = lock._end_beat()
        if fd < 0:
            return
        try:
            if os.getpid() == lock._pid:
                if lock._record:
                    lock._record = False
                    try:
                        os.ftruncate(fd, 0)  # the record describes a holder: we are done holding
                    except OSError:  # pragma: no cover
                        pass
                self.unlock(fd)
        finally:
            os.close(fd)


class FlockStrategy(_KernelStrategy):
    """``flock(2)``: per open file description, released by the kernel when the holder dies."""

    name = "flock"

    def try_lock(self, fd: int, shared: bool) -> bool:
        """One ``LOCK_NB`` attempt."""
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise
        return True

    def unlock(self, fd: int) -> None:
        """``LOCK_UN``."""
        fcntl.flock(fd, fcntl.LOCK_UN)


class PosixStrategy(_KernelStrategy):
    """Open-file-description fcntl locks (``F_OFD_SETLK``): what NFS and some cluster filesystems
    enforce when ``flock`` is missing or only local.  Per open file description like flock, so the
    hazards of classic POSIX locks (shared by a whole process, dropped by any close) do not apply."""

    name = "posix"

    def try_lock(self, fd: int, shared: bool) -> bool:
        """One ``F_OFD_SETLK`` attempt."""
        return ofd_lock(fd, shared)

    def unlock(self, fd: int) -> None:
        """``F_UNLCK``."""
        ofd_unlock(fd)


class LeaseStrategy(LockStrategy):
    """Exclusive-create lease files with holder, heartbeat and expiry (module docstring: "Leases")."""

    name = "lease"

    writer_first = True

    def acquire(self, lock: FileLock) -> None:
        """Create the lease (or, ``shared``, a holder file beside it), or wait for it (taking over a stale
        one, exactly one waiter winning); an exclusive holder then waits for shared holders to leave."""
        lease = lease_path(lock.path)
        w = _Wait(lock)
        seen: Optional[_Sig] = None
        changed = w.start
        look_first = False
        while True:
            # A waiter looks before it tries: a failed create is four operations (a round trip each on
            # FUSE or NFS) that slow the holder down.  The look is one lstat: the full look (open, fstat,
            # pread, close) only when the lease looks different from the last full look, or when its
            # holder is due for a check (CHECK_EVERY).  3 waiters polling a FUSE lease fully cost 11 full
            # looks per edit, ~4 daemon round trips each, while the holder was working.
            sig, holder, beats = None, None, False
            quick = _stat_sig(lease) if look_first else None
            if quick is not None:
                now = time.monotonic()
                if seen is not None and quick == seen[:3] and now < w.next_check:
                    w.pause(now)
                    continue
                sig, holder, beats = _look(lease)
            if sig is None:
                if lock.shared:
                    if self._try_shared(lock, lease):
                        return
                else:
                    born = _now()  # before the create: the lease may exist from here on
                    fd = self._create(lock, lease)
                    if fd >= 0:
                        self._hold(lock, fd, born)
                        self._drain_shared(lock, w)
                        return
                sig, holder, beats = _look(lease)
            look_first = True
            now = time.monotonic()
            if sig is None:  # released between our try and our look (or unreadable: the timeout applies)
                w.pause(now)
                continue
            if sig != seen:
                seen, changed = sig, now
            if now >= w.next_check:
                w.saw((sig[1], sig[2]), holder if beats else None, now)
            # No record: its creator died between the exclusive create and the write of its record
            # (the very next syscall), or the bytes are hostile; judged on a short clock.
            if _stale(holder, now - changed):
                if self._steal(lock, lease, sig, holder):
                    if not lock.shared:
                        self._drain_shared(lock, w)
                        return
                    self.release(lock)  # we ended the stale exclusive lease; now enter as a shared holder
                    continue
            w.pause(now)

    def _try_shared(self, lock: FileLock, lease: Path) -> bool:
        """Become a shared holder unless an exclusive lease is in the way (module docstring: "Shared leases").

        The holder file is created first, the lease looked for second; an exclusive acquirer creates
        its lease first and lists holder files second: whichever goes second sees the other.
        """
        # (No look for the lease before the create: the caller just found none, or is on its first try.)
        where = shared_dir(lock.path)
        path = where / f"{_HOST.replace('/', '_')}.{os.getpid()}.{os.urandom(6).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            try:
                fd = os.open(path, flags, lock.mode)
            except FileNotFoundError:
                makedirs(where)
                fd = os.open(path, flags, lock.mode)
        except OSError as e:
            if not isinstance(e, PermissionError) and e.errno != errno.EROFS:
                raise
            # A reader of a read-only store: nothing to exclude, nothing to hold (as with kernel locks).
            lock._pid = os.getpid()
            lock._strategy = self
            return True
        try:
            share_new_file(fd, where)
            every, beats = _lease_beat(lock)
            os.pwrite(fd, _record(lock.what, every, beats), 0)  # (a holder killed before this: no record, 2 s)
            if os.path.lexists(lease):  # an exclusive holder came first: leave, and wait for it
                _unlink(path)
                os.close(fd)
                return False
        except BaseException:
            _unlink(path)
            os.close(fd)
            raise
        lock._shared_file = path
        self._own(lock, fd, every, beats)
        return True

    def _drain_shared(self, lock: FileLock, w: _Wait) -> None:
        """Holding the exclusive lease, wait until no shared holder is left (a dead or stale one's file is
        removed); on a timeout the lease is released before :class:`LockTimeout` is raised."""
        try:
            _drain(lock, w)
        except BaseException:
            self.release(lock)
            raise

    @staticmethod
    def _create(lock: FileLock, lease: Path) -> int:
        """The new lease's descriptor, or -1 if one exists."""
        try:
            try:
                fd = LeaseStrategy._publish(lock, lease)
            except FileNotFoundError:
                makedirs(lease.parent)
                fd = LeaseStrategy._publish(lock, lease)
        except FileExistsError:
            return -1
        except OSError as e:
            if not isinstance(e, PermissionError) and e.errno != errno.EROFS:
                raise
            raise ReadOnlyError(
                f"cannot create lease file {lease}: {e.strerror}; the store is read-only for this process"
            ) from None
        share_new_file(fd, lease.parent)
        return fd

    @staticmethod
    def _publish(lock: FileLock, lease: Path) -> int:
        """Create the lease with its record already in it (:func:`_publish_record`), so no lease is ever
        seen without a record and a creator killed mid-way costs its waiters nothing."""
        every, beats = _lease_beat(lock)
        return _publish_record(lease, _record(lock.what, every, beats), lock.mode)

    def _hold(self, lock: FileLock, fd: int, born: Tuple[float, float], *, write: bool = False) -> None:
        """Hold the lease open as ``fd`` (writing our record into it if ``write``) and start beating if asked.
        ``born``: :func:`_now` before the lease could first be seen (its age decides how it is released)."""
        every, beats = _lease_beat(lock)
        try:
            if write:
                os.pwrite(fd, _record(lock.what, every, beats), 0)
            lock._lease_ino = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        lock._lease_born = born
        self._own(lock, fd, every, beats)

    def _own(self, lock: FileLock, fd: int, every: float, beats: bool) -> None:
        """``lock`` now holds ``fd`` (its lease or shared holder file); beat it if asked."""
        lock._fd = fd
        lock._pid = os.getpid()
        lock._strategy = self
        _held.add(lock)
        if beats:
            lock._beat = _Beat(fd, every)

    def _steal(self, lock: FileLock, lease: Path, sig: _Sig, holder: Optional[Holder]) -> bool:
        """Replace the stale lease ``sig`` by ours; False if someone else ends it or it showed life."""
        claims = _claim(lease, sig[0])
        if claims is None:
            return False
        try:
            now_sig, _, _ = _look(lease)
            if now_sig != sig:
                return False  # released, beaten or replaced since we judged it: not ours to end
            tmp = lease.with_name(f"{lease.name}.new.{os.getpid()}.{os.urandom(4).hex()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, lock.mode)
            try:
                share_new_file(fd, lease.parent)
                born = _now()
                os.rename(tmp, lease)  # we hold the claim: the stale lease is still exactly there
            except BaseException:
                os.close(fd)
                _unlink(tmp)
                raise
            self._hold(lock, fd, born, write=True)
        finally:
            for c in claims:
                _unlink(c)
        who = holder.describe() if holder is not None else "a holder that wrote no record"
        log.warning("took over the stale lease on %s (%s) from %s: %s", lock.what, lease, who,
                    "its process is dead" if holder is not None and holder.alive() is False
                    else "it showed no sign of life within the lease expiry")
        return True

    def release(self, lock: FileLock) -> None:
        """Remove our lease file -- an old or beating one after winning its end claim, so a stealer cannot
        replace it meanwhile -- or our shared holder file."""
        shared, lock._shared_file = lock._shared_file, None
        fd = lock._end_beat()
        if fd < 0:  # the read-only shared no-op hold
            return
        if shared is not None:
            try:
                if os.getpid() == lock._pid:
                    try:
                        os.unlink(shared)
                    except FileNotFoundError:
                        _taken_over(lock, shared)  # an exclusive acquirer judged us stale and removed it
            finally:
                os.close(fd)
            return
        try:
            if os.getpid() != lock._pid:
                return
            lease = lease_path(lock.path)
            ino = lock._lease_ino
            claims: List[Path] = []
            if lock.heartbeat is not None or _age(lock._lease_born) >= _QUICK_RELEASE:
                got = _claim(lease, ino)  # a dead claimant's leftover (same inode number, reused) is skipped
                if got is None:
                    _taken_over(lock, lease)  # a stealer is ending it right now
                    return
                claims = got
            # else no end claim (five operations, a round trip each on FUSE or NFS, inside every edit's
            # critical section): nobody can be ending a non-beating lease this young but us.  A waiter
            # steals only a lease it saw unchanged for its expiry (2 s at the least; ours has not
            # existed half that long, on either clock) or whose holder is dead (we are not).  The inode
            # check below stays, for a frozen VM whose clocks both stood still (the hazard the module
            # docstring leaves open).
            try:
                st = os.stat(lease)
                if st.st_ino == ino:  # our open descriptor keeps our inode number from being reused
                    os.unlink(lease)
                else:
                    _taken_over(lock, lease)
            except FileNotFoundError:
                _taken_over(lock, lease)
            finally:
                for c in claims:
                    _unlink(c)
        finally:
            os.close(fd)


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
"""How a lock file is opened (or created): never through a link at its name, never waiting on a FIFO."""

# What opening something planted at a lock file's name gives: a symbolic link (ELOOP, O_NOFOLLOW), a
# directory (EISDIR, O_RDWR), a socket (ENXIO).  (A FIFO opens at once, O_NONBLOCK: its fstat refuses it.)
_PLANTED_ERRNOS = (errno.ELOOP, errno.EISDIR, errno.ENXIO)


def _kind(path: Path) -> str:
    """What is at ``path`` (not followed), for an error message."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "not a regular file"
    for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return kind
    return "not a regular file"


def _not_a_lock_file(path: Path) -> StoreFormatError:
    """The typed error for something other than a regular file planted at the lock file ``path``."""
    kind = _kind(path)
    how = "rmdir" if kind == "a directory" else "rm"
    return StoreFormatError(
        f"lock file {path} is {kind}, not a regular file: casstore never locks through a link or anything "
        "else planted in a lock's place (in a shared store, another member can plant one there to make "
        f"your process create or chmod a file outside the store); remove it (`{how} {path}`) and run again "
        "-- casstore creates a fresh lock file"
    )


def _checked_lock(fd: int, path: Path) -> os.stat_result:
    """``fstat`` of the just-opened lock file ``fd``, in blocking mode again; closes ``fd`` and raises
    :class:`StoreFormatError` unless it is a regular file (a FIFO, device or socket planted there)."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_lock_file(path)
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open only (a FIFO); the descriptor stays as before
    except BaseException:
        os.close(fd)
        raise
    return st


_QUICK_RELEASE = min(LEASE_EXPIRY, _NO_RECORD_EXPIRY) / 2
"""A non-beating lease younger than this (on both clocks) is released without an end claim: half the
shortest expiry any waiter applies (2 s, for a lease whose record it could not read)."""


def _now() -> Tuple[float, float]:
    """(monotonic, wall) time: a lease's age is the larger of the two, so neither a wall clock set back
    nor a monotonic clock that stood still (suspend) makes an old lease look young."""
    return time.monotonic(), time.time()


def _age(born: Tuple[float, float]) -> float:
    mono, wall = _now()
    return max(mono - born[0], wall - born[1])


def _stat_sig(lease: Path) -> Optional[Tuple[int, int, int]]:
    """(inode, mtime_ns, size) of the lease (one lstat); ``None`` if there is none."""
    try:
        st = os.lstat(lease)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _lease_beat(lock: FileLock) -> Tuple[float, bool]:
    """(seconds between beats, whether it beats) for ``lock``'s lease record."""
    if lock.heartbeat is not None:
        return min(max(float(lock.heartbeat), 0.01), _MAX_EVERY), True
    return LEASE_EXPIRY / _MIN_BEATS, False


def _stale(holder: Optional[Holder], unchanged: float) -> bool:
    """Is a lease (or shared holder file) with ``holder``'s record, unchanged for ``unchanged`` seconds as a
    waiter saw it, stale?  Its holder is dead on this host, or it missed three beats (non-beating records say
    LEASE_EXPIRY / 3); no record: its creator died between create and write, or the bytes are hostile (2 s)."""
    if holder is not None and holder.alive() is False:
        return True
    return unchanged >= (_MIN_BEATS * holder.every if holder is not None else _NO_RECORD_EXPIRY)


def shared_dir(path: Path) -> Path:
    """The directory of the shared holders' files of the lock at ``path`` (lease mode)."""
    return path.with_name(path.name + ".shared")


def _drain(lock: FileLock, w: _Wait) -> None:
    """Wait until the shared-holder directory of ``lock`` holds no live holder's file."""
    where = shared_dir(lock.path)
    seen: Dict[str, Tuple[_Sig, float]] = {}
    while True:
        try:
            dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # never taken shared (ENOENT), or not a directory we made (a planted link): no holders
        try:
            # Hostile entries (anyone who can write the store can plant them): only regular files are
            # holders; a directory, FIFO or symlink is never opened and never waited for.
            names = [e.name for e in os.scandir(dfd) if e.is_file(follow_symlinks=False)]
        finally:
            os.close(dfd)
        now = time.monotonic()
        live: List[Tuple[_Sig, Optional[Holder]]] = []
        for name in names:
            path = where / name
            sig, holder, beats = _look(path)
            if sig is None:
                continue  # released meanwhile
            prev = seen.get(name)
            changed = now if prev is None or prev[0] != sig else prev[1]
            seen[name] = (sig, changed)
            if _stale(holder, now - changed):
                _unlink(path)
                who = holder.describe() if holder is not None else "a holder that wrote no record"
                log.warning("removed the stale shared hold on %s (%s) of %s", lock.what, path, who)
                continue
            live.append((sig, holder if beats else None))
        if not live:
            return
        if now >= w.next_check:
            # Any holder leaving or arriving (or beating) is a sign of life; a beating holder's record
            # stretches the timeout to its stall limit, a non-beating one's (milliseconds) does not.
            beating = [h for _, h in live if h is not None]
            w.saw((len(live), hash(tuple(sorted(sig for sig, _ in live)))), beating[0] if beating else None, now)
        w.pause(now)


def _taken_over(lock: FileLock, lease: Path) -> None:
    log.warning("the lease on %s (%s) was taken over while this process held it (it was presumed dead: "
                "stopped longer than the lease expiry?); work done under it may have overlapped another "
                "process's", lock.what, lease)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_Sig = Tuple[int, int, int, bytes]


def _look(lease: Path) -> Tuple[Optional[_Sig], Optional[Holder], bool]:
    """The lease's identity (inode, mtime_ns, size, record bytes), its holder and whether that holder beats.

    The record (pid, host, start time to the microsecond) is part of the identity: an inode
    number is reused once a lease is removed, and a coarse mtime can repeat within a tick.
    """
    try:
        fd = os.open(lease, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None, None, False
    try:
        st = os.fstat(fd)
        data = os.pread(fd, _RECORD_SIZE, 0) if st.st_size else b""
    except OSError:
        return None, None, False
    finally:
        os.close(fd)
    return (st.st_ino, st.st_mtime_ns, st.st_size, data), _parse_holder(data, st.st_mtime_ns / 1e9), _beats(data)


def _claim(lease: Path, ino: int) -> Optional[List[Path]]:
    """Win the right to end the lease with inode ``ino``: the claim files to remove afterwards, or None."""
    made: List[Path] = []
    for n in range(_MAX_CLAIMS):
        c = Path(f"{lease}.end.{ino}.{n}")
        made.append(c)
        try:
            # Published with its record already in it (as a lease is, LeaseStrategy._publish): a claimant
            # SIGKILLed between an O_EXCL create and its write cost the next one the 2 s no-record expiry
            # (CI: edit after a crash on the ENOSYS FUSE mount waited 2.00 s, limit 1 s).
            fd = _publish_record(c, _record("lease claim", 1.0, False), 0o644)
        except FileExistsError:
            try:
                rfd = os.open(c, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    st = os.fstat(rfd)
                    owner = _parse_holder(os.pread(rfd, _RECORD_SIZE, 0), st.st_mtime)
                finally:
                    os.close(rfd)
            except OSError:
                return None
            # A claim lives for a few syscalls: one naming a dead local pid, one without a record (its
            # creator died before writing it) older than a few seconds, or any one much older than the
            # expiry (the file system's clock, compared generously) was left by a claimant that died.
            age = time.time() - st.st_mtime
            if (owner is not None and owner.alive() is False) or age > 2 * LEASE_EXPIRY \
                    or (owner is None and age > _NO_RECORD_EXPIRY):
                continue
            return None
        except OSError:
            return None
        os.close(fd)
        return made
    return None


def _publish_record(path: Path, record: bytes, mode: int) -> int:
    """Create ``path`` exclusively with ``record`` already in it (private file, then ``link()``: atomic,
    EEXIST if taken); where hard links are missing, ``O_EXCL`` then write.  Returns its descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    tmp = path.with_name(f"{path.name}.new.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, flags, mode)
    try:
        os.pwrite(fd, record, 0)
        os.link(tmp, path)
    except FileExistsError:
        os.close(fd)
        raise
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS, errno.EXDEV):
            raise
        fd = os.open(path, flags, mode)
        try:
            os.pwrite(fd, record, 0)
        except BaseException:
            os.close(fd)
            raise
    finally:
        _unlink(tmp)
    return fd


class _Wait:
    """A waiter's clock: when the holder last showed life, the timeout, progress logs and back-off."""

    __slots__ = ("lock", "start", "next_log", "delay", "last_life", "seen", "holder", "next_check")

    def __init__(self, lock: FileLock) -> None:
        self.lock = lock
        self.start = time.monotonic()
        self.next_log = self.start + lock.log_every
        self.delay = 0.0002
        self.last_life = self.start  # when the holder last showed life, as this waiter saw it
        self.seen: Optional[Tuple[int, int]] = None
        self.holder: Optional[Holder] = None
        self.next_check = self.start

    def saw(self, sig: Tuple[int, int], holder: Optional[Holder], now: float) -> None:
        """Note what the lock's record looks like now (a change is a sign of life)."""
        if self.seen is not None and sig != self.seen:
            self.last_life = now  # a beat, or the lock changed hands
        self.seen = sig
        self.holder = holder
        self.next_check = now + CHECK_EVERY

    def pause(self, now: float) -> None:
        """Raise LockTimeout if the holder showed no life for too long; else log if due and sleep."""
        lock = self.lock
        if lock._cycle:  # the holder is this very thread (FileLock.acquire): it would wait forever
            raise lock._cycle_error()
        limit = lock._limit(self.holder)
        if limit is not None and now - self.last_life >= limit:
            raise lock._timed_out(self.holder, now - self.start)
        if now >= self.next_log:
            log.warning("still waiting for the lock on %s (%s) after %.0fs%s", lock.what, lock.path,
                        now - self.start, lock._holder_note(self.holder))
            self.next_log = now + lock.log_every
        import random  # (on use: only a waiter needs it)

        sleep = self.delay * (0.5 + random.random())
        if limit is not None:
            sleep = min(sleep, max(0.0, self.last_life + limit - now))
        time.sleep(sleep)
        # 5 ms keeps short waits (edits) fair; after a second the holder is doing real work
        # (a fetch, a derive) and 7 waiting ranks polling 200 times a second each would take
        # CPU from it on a small machine: 25 ms (40 polls/s) costs at most 25 ms at hand-over.
        self.delay = min(self.delay * 2, 0.005 if now - self.start < 1.0 else 0.025)


STRATEGIES: Dict[str, LockStrategy] = {"flock": FlockStrategy(), "posix": PosixStrategy(),
                                       "lease": LeaseStrategy()}
"""``lock_mode`` -> the strategy object (``none`` in the setting means ``lease``)."""

# Which strategy guards which directory.  Every process that shares a store must pick the same kind
# (a flock holder and a lease holder do not exclude each other): the probe gives every process on a
# host the same answer, the setting is the same for a job, and a runtime ENOSYS hits all of them.
_roots: Dict[str, str] = {}  # store root -> mode (configure(), degrade())
_devs: Dict[int, str] = {}  # st_dev -> mode, for lock files outside any configured store
_dirs: Dict[str, Tuple[str, str]] = {}  # lock file's directory -> (mode, key), memo of the walk below
_warned: Set[str] = set()
_guard = threading.Lock()


def _warn(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", text)


def configure(root: Path, setting: str = "auto") -> str:
    """Choose the lock kind for the store at ``root`` (``setting``: ``auto``, ``flock``, ``posix``,
    ``lease`` or ``none``) and return it; ``auto`` probes ``root/locks`` once per mount.  Warns once
    per store when locks are missing or not enforced and leases are used instead."""
    mode = "lease" if setting == "none" else setting
    if mode not in STRATEGIES and mode != "auto":
        raise ValueError(f"lock_mode must be auto, flock, posix, lease or none, not {setting!r}")
    key = str(root)
    with _guard:
        known = _roots.get(key)
        if known == "lease" and setting == "auto":
            return known  # degraded at runtime already: never go back within this process
    if mode == "auto":
        where = root / "locks"
        info = probe(where if where.is_dir() else root)
        mode = info.lock_mode
        if mode == "lease":
            _warn(key, f"casstore: locks on {info.fstype} at {root} are not usable ({info.reason()}); "
                       "using lease files instead (slower, see docs/filesystems.md; `casstore doctor` explains)")
    with _guard:
        _roots[key] = mode
        _dirs.clear()
    return mode


def _walk(parent: Path) -> Tuple[str, str]:
    for p in (parent, *parent.parents):
        mode = _roots.get(str(p))
        if mode is not None:
            return mode, str(p)
    existing = parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        dev = os.stat(existing).st_dev
    except OSError:
        return "flock", "?"
    mode = _devs.get(dev)
    if mode is None:
        info = probe(existing)
        mode = _setting() or info.lock_mode
        _devs[dev] = mode
        if mode == "lease":
            _warn(f"dev {dev}", f"casstore: locks on {info.fstype} ({info.mount}) are not usable "
                                f"({info.reason()}); using lease files instead (docs/filesystems.md)")
    return mode, f"dev {dev}"


def _setting() -> Optional[str]:
    """A forced ``lock_mode`` from this process's settings, for a store this process did not open
    through ``casstore.open`` (a Store unpickled in a spawned worker): it must lock as its parent."""
    from .errors import CasstoreError
    from .settings import current

    try:
        mode = current().lock_mode
    except CasstoreError:  # a bad settings file is reported by casstore.open, not by a lock
        return None
    return None if mode == "auto" else mode


@dataclass(frozen=True, slots=True)
class Filesystem:
    """What casstore knows about a store's filesystem and what it does about it (``casstore doctor``)."""

    root: str
    """The store directory."""
    fstype: str
    """Filesystem type (``ext4``, ``nfs4``, ``fuse.sshfs``...) or ``?``."""
    mount: str
    """Mount point or ``?``."""
    flock: str
    """``enforced``, ``not enforced``, ``missing`` or ``unknown``."""
    posix: str
    """Open-file-description fcntl locks: ``enforced``, ``not enforced``, ``missing`` or ``unknown``."""
    hardlinks: str
    """``ok``, ``wrong link count``, ``missing`` or ``unknown``."""
    reflink: str
    """``yes``, ``no`` or ``unknown``."""
    setting: str
    """The ``lock_mode`` setting (``auto`` unless forced)."""
    lock_mode: str
    """What this process uses for the store's locks: ``flock``, ``posix`` or ``lease``."""
    actions: Tuple[str, ...]
    """One sentence per finding: what casstore does about it."""

    def as_dict(self) -> Dict[str, object]:
        """JSON-able form (``casstore doctor --json``, ``stats --json``)."""
        return {"root": self.root, "fstype": self.fstype, "mount": self.mount, "flock": self.flock,
                "posix": self.posix, "hardlinks": self.hardlinks, "reflink": self.reflink,
                "setting": self.setting, "lock_mode": self.lock_mode, "actions": list(self.actions)}


def filesystem(root: Path, setting: str = "auto") -> Filesystem:
    """Probe (again) the filesystem of the store at ``root`` and say what casstore does there."""
    where = root / "locks"
    info = probe(where if where.is_dir() else root, fresh=True)
    mode = _roots.get(str(root)) or configure(root, setting)
    acts: List[str] = []
    if mode == "flock":
        acts.append("locks: flock (enforced between processes: the fast path)" if info.flock == "enforced"
                    else f"locks: flock (forced or unprobed; the probe says flock is {info.flock})")
    elif mode == "posix":
        acts.append(f"locks: fcntl OFD locks (flock is {info.flock} here)")
    else:
        acts.append(f"locks: lease files beside each lock (flock {info.flock}, fcntl {info.posix}): exclusive "
                    f"create, heartbeat, takeover of a dead holder's lease after at most {LEASE_EXPIRY:g}s")
    if setting == "auto" and mode != "lease":
        acts.append("locks enforced only within one host (NFS local_lock, Lustre localflock) pass this probe: "
                    "if processes on several hosts share this store there, set lock_mode = \"lease\"")
    if info.hardlinks != "ok":
        acts.append(f"hard links: {info.hardlinks} -- link counts are not trusted; objects are published by rename")
    acts.append("reflink: yes -- checkout link=reflink clones objects without copying" if info.reflink == "yes"
                else f"reflink: {info.reflink} -- checkout copies (link=reflink raises here)")
    acts.append("syncfs: trusted -- batches (put_many, pull, folder add) sync once per batch" if info.syncfs_trusted
                else f"syncfs: not trusted on {info.fstype} (FUSE/network: it may never reach the daemon or "
                     "server) -- batches fsync each object and its directory")
    return Filesystem(str(root), info.fstype, info.mount, info.flock, info.posix, info.hardlinks, info.reflink,
                      setting, mode, tuple(acts))


def strategy_for(path: Path) -> Tuple[LockStrategy, str]:
    """The strategy guarding the lock file ``path``, and the key (store root or device) it was chosen for."""
    d = str(path.parent)
    hit = _dirs.get(d)
    if hit is None:
        with _guard:
            hit = _walk(path.parent)
            _dirs[d] = hit
    return STRATEGIES[hit[0]], hit[1]


def degrade(key: str, path: Path, err: BaseException) -> None:
    """A kernel lock failed as unsupported under ``key``: switch that store (or device) to leases, warn once."""
    with _guard:
        if key.startswith("dev "):
            try:
                _devs[int(key[4:])] = "lease"
            except ValueError:  # "?": the directory could not be looked at
                pass
        else:
            _roots[key] = "lease"
        _dirs.clear()
        _dirs[str(path.parent)] = ("lease", key)
    _warn(key, f"casstore: locking {path} failed ({err}); the filesystem has no such locks -- using lease "
               "files for this store from now on (see docs/filesystems.md; set lock_mode to choose)")


class FileLock:
    """An exclusive (or shared) lock on ``path``, usable as a context manager.

    The kind of lock (flock, OFD fcntl, or a lease file) is the store's
    strategy (:func:`strategy_for`; module docstring).  ``timeout=None`` waits
    forever; ``0`` tries once.  Otherwise a waiter gives up after ``timeout``
    seconds *without a sign of life from the holder*: a holder that beats
    (``heartbeat``) is waited for as long as it beats (see the module
    docstring).  ``what`` describes the purpose in log lines and errors
    ("manifest 'exp-42'").  ``heartbeat``: seconds between this holder's beats
    while it holds the lock (exclusive locks only; ``None``: no heartbeat, for
    locks held for milliseconds).
    """

    __slots__ = ("path", "timeout", "what", "shared", "log_every", "heartbeat", "_fd", "mode", "_pid", "_beat",
                 "_record", "_strategy", "_lease_ino", "_lease_born", "_shared_file", "_mine", "_cycle",
                 "__weakref__")

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
        self._strategy: Optional[LockStrategy] = None
        self._lease_ino = 0
        self._lease_born = (0.0, 0.0)  # lease mode: _now() when our lease was created
        self._shared_file: Optional[Path] = None  # lease mode, shared: this holder's file
        self._mine: Optional[Dict[str, List[int]]] = None  # the acquiring thread's holds (_thread_holds)
        self._cycle = False  # acquiring a lock this thread holds: refused once it would have to wait

    @property
    def held(self) -> bool:
        """Whether this object currently holds the lock."""
        return self._strategy is not None

    @property
    def kind(self) -> str:
        """``flock``, ``posix`` or ``lease`` while held; ``""`` otherwise."""
        return self._strategy.name if self._strategy is not None else ""

    def _open(self) -> int:
        # Hazard (found by a bug hunt): locks/ of a shared store is group-writable, and a member planted
        # a link at locks/gc.gate: every other member's commit or gc opened its target with O_CREAT (a
        # file created outside the store) and share_new_file chmod-ed the victim's own file there (e.g.
        # ~/.ssh/authorized_keys) to 0664; a directory there failed every commit with a raw
        # IsADirectoryError, a FIFO could block the open.  So: never follow (O_NOFOLLOW), never wait
        # (O_NONBLOCK), and only a regular file is a lock file (_checked_lock).
        try:
            try:
                fd = os.open(self.path, _LOCK_FLAGS, self.mode)
            except FileNotFoundError:
                makedirs(self.path.parent)  # new dirs copy a shared (setgid) parent's mode
                fd = os.open(self.path, _LOCK_FLAGS, self.mode)
        except OSError as e:
            if e.errno in _PLANTED_ERRNOS:
                raise _not_a_lock_file(self.path) from None
            # EACCES/EPERM (another user's store) or EROFS (a read-only mount).
            if not isinstance(e, PermissionError) and e.errno != errno.EROFS:
                raise
            if self.shared:
                # Readers of a read-only store may still take shared locks.
                try:
                    rfd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                except FileNotFoundError:
                    pass
                except OSError as e2:
                    if e2.errno in _PLANTED_ERRNOS:
                        raise _not_a_lock_file(self.path) from None
                    raise
                else:
                    _checked_lock(rfd, self.path)
                    return rfd
            raise ReadOnlyError(
                f"cannot open lock file {self.path}: {e.strerror}; the store is read-only for this process"
            ) from None
        st = _checked_lock(fd, self.path)
        share_new_file(fd, self.path.parent, st=st)  # group-writable in a shared store, whatever the umask
        return fd

    def acquire(self) -> FileLock:
        """Take the lock or raise :class:`LockTimeout` once the holder showed no life for ``timeout`` s.

        :class:`LockCycleError` at once if this very thread holds it already (exclusively, or shared
        when exclusive is asked): it would wait for itself forever.
        """
        if self._strategy is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        mine = _thread_holds()
        name = str(self.path)
        have = mine.get(name)
        # Checked when the first try fails (_Wait.pause): a lock that grants it anyway (a lying
        # network filesystem, a test's stand-in for another holder) is not refused.
        self._cycle = have is not None and (not self.shared or have[1] > 0)
        strategy, key = strategy_for(self.path)
        try:
            strategy.acquire(self)
        except LocksUnsupported as e:
            degrade(key, self.path, e)
            STRATEGIES["lease"].acquire(self)
        self._cycle = False
        counts = mine.setdefault(name, [0, 0])
        counts[0] += 1
        counts[1] += 0 if self.shared else 1
        self._mine = mine
        return self

    def _cycle_error(self) -> LockCycleError:
        # Hazard (found by a bug hunt): a derive fn that derived or edited its own name (or a cycle
        # A -> B -> A) waited forever: the holder's heartbeat is this very process, alive and beating.
        return LockCycleError(
            f"this thread already holds the lock on {self.what} (lock file {self.path}) and asks for it "
            "again: it would wait for itself forever. A derive fn must not derive or edit its own name, "
            "nor start a chain of derives that comes back to it; a nested edit of one name is the same"
        )

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
                f"(e.g. `fuser {self.path}`, or the pid in {lease_path(self.path)} in lease mode)"
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
        """Write (heartbeat) or clear (no heartbeat) the holder record in the lock file, and start beating."""
        try:
            if self.heartbeat is None:
                if os.fstat(fd).st_size:  # a dead heartbeat holder's record must not describe us
                    os.ftruncate(fd, 0)
                return
            every = min(max(float(self.heartbeat), 0.01), _MAX_EVERY)
            os.pwrite(fd, _record(self.what, every, True), 0)
            os.ftruncate(fd, _RECORD_SIZE)
            self._record = True
            self._beat = _Beat(fd, every)
        except OSError as e:  # a read-only lock file (shared store of another user): no record, no beats
            log.debug("no heartbeat record for %s: %s", self.path, e)

    def _end_beat(self) -> int:
        """Stop beating and forget the descriptor (returned, for the strategy to release and close)."""
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.stop()  # before the close: it must never touch a reused descriptor
        fd, self._fd = self._fd, -1
        self._strategy = None
        _held.discard(self)
        mine, self._mine = self._mine, None
        if mine is not None:
            counts = mine.get(str(self.path))
            if counts is not None:
                counts[0] -= 1
                counts[1] -= 0 if self.shared else 1
                if counts[0] <= 0:
                    del mine[str(self.path)]
        return fd

    def release(self) -> None:
        """Release the lock.  Kernel locks unlock explicitly, then close: closing alone is not enough,
        a child forked while the lock was held shares the open file description.  Leases remove
        their file (see the module docstring)."""
        strategy = self._strategy
        if strategy is not None:
            strategy.release(self)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.release()
