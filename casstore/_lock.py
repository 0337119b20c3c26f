"""fcntl locks on sidecar files in ``<root>/locks``, with timeouts and progress logs.

Why not ``filelock.FileLock`` directly: its default 50 ms poll made contended
waits unfair here (p99 ~100 ms) and its errors do not name what we waited
for.  We take ``flock(LOCK_EX | LOCK_NB)`` and poll with a short, jittered
back-off (0.2 ms doubling to 5 ms), log a line every ``log_every`` seconds while
waiting, and raise :class:`LockTimeout` naming the lock file.

Hazards these locks are built around:

* The kernel releases an ``flock`` when its holder dies (even by SIGKILL), so a
  crashed writer never leaves a name locked.  A *live* holder that never lets
  go is met with a timeout, not a hang.
* A lock file is never the file being replaced (refs are replaced by rename;
  renaming over a locked file would silently split the lock), and lock files
  are never deleted (deleting one lets two processes lock different inodes).
* Locks only serialize updates and avoid duplicate work; correctness of
  objects never depends on them (NFS/Lustre locks can silently succeed).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Optional, Type

from ._shared import makedirs, share_new_file
from .errors import LockTimeout, ReadOnlyError

__all__ = ["FileLock", "DEFAULT_TIMEOUT"]

log = logging.getLogger("casstore.lock")

DEFAULT_TIMEOUT = 600.0

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


class FileLock:
    """An exclusive (or shared) fcntl lock on ``path``, usable as a context manager.

    ``timeout=None`` waits forever; ``0`` tries once.  ``what`` describes the
    purpose in log lines and errors ("manifest 'exp-42'").
    """

    __slots__ = ("path", "timeout", "what", "shared", "log_every", "_fd", "mode", "_pid", "__weakref__")

    def __init__(self, path: Path, *, timeout: Optional[float] = DEFAULT_TIMEOUT, what: str = "",
                 shared: bool = False, log_every: float = 10.0, mode: int = 0o666) -> None:
        self.path = path
        self.timeout = timeout
        self.what = what or str(path)
        self.shared = shared
        self.log_every = log_every
        self.mode = mode
        self._fd = -1
        self._pid = 0

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
        """Take the lock or raise :class:`LockTimeout` after ``timeout`` seconds."""
        if self._fd >= 0:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        fd = self._open()
        op = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        start = time.monotonic()
        next_log = start + self.log_every
        delay = 0.0002
        try:
            while True:
                try:
                    fcntl.flock(fd, op)
                    self._fd = fd
                    self._pid = os.getpid()
                    _held.add(self)
                    return self
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                now = time.monotonic()
                if self.timeout is not None and now - start >= self.timeout:
                    raise LockTimeout(
                        f"timed out after {self.timeout:g}s waiting for the lock on {self.what} "
                        f"(lock file {self.path}); another process holds it -- wait, or find and stop it "
                        f"(e.g. `fuser {self.path}`)"
                    )
                if now >= next_log:
                    log.warning("still waiting for the lock on %s (%s) after %.0fs",
                                self.what, self.path, now - start)
                    next_log = now + self.log_every
                sleep = delay * (0.5 + random.random())
                if self.timeout is not None:
                    sleep = min(sleep, max(0.0, start + self.timeout - now))
                time.sleep(sleep)
                delay = min(delay * 2, 0.005)
        except BaseException:
            if self._fd < 0:
                os.close(fd)
            raise

    def release(self) -> None:
        """Release the lock: unlock explicitly, then close.

        Closing alone is not enough: a child forked while the lock was held
        shares the open file description, and the flock would live on in it.
        """
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _held.discard(self)
            try:
                if os.getpid() == self._pid:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.release()
