"""What fetch and derive share: checking their arguments, and recording a result as a head version.

Both hold the result name's lock (``store.refs.lock(name)``) for the whole
job -- the download, or the run of ``fn`` -- so exactly one process does the
work and the others wait; then :func:`write_head` lands the new version while
the lock is still held.  Lock order (docs/design.md, ``_gclock.py``): the
name lock first, then the store's GC lock, shared, around the existence
checks and the ref move, so gc can never delete an output between the check
and the ref landing.
"""

from __future__ import annotations

import fnmatch
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, Tuple, Union

from .._fs import process_token
from .._gclock import commit_lock
from .._lock import BEAT_EVERY
from ..errors import FrozenError, InvalidInputError, InvalidTypeError, ObjectNotFoundError
from ..manifests import Entry, Manifest, ManifestDoc, put_version

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["check_seconds", "check_flag", "check_count", "lock_seconds", "write_head", "refuse_pinned",
           "Scope", "check_scope", "in_scope", "process_started", "fresh_for_job", "producer", "HEARTBEAT",
           "beat_every", "TreeFlusher"]

HEARTBEAT = BEAT_EVERY
"""Longest interval between the heartbeats of a fetch/derive holding its name's lock (``_lock.py``)."""


def beat_every(lock_timeout: Optional[float]) -> float:
    """Heartbeat interval of a holder whose own ``lock_timeout`` is given: a quarter of it, 0.05-1 s.

    A waiter allows at least three intervals without a beat, so with the same
    ``lock_timeout`` everywhere (one job, one setting) a stall is declared
    after ``lock_timeout`` seconds exactly, even for a short one.
    """
    if lock_timeout is None:
        return HEARTBEAT
    return min(HEARTBEAT, max(0.05, lock_timeout / 4))

Scope = Union[bool, Sequence[str]]
"""``force_download`` / ``regenerate``: everything (True), nothing (False), or the names (patterns) listed."""


def check_scope(value: object, what: str) -> Optional[Union[bool, Tuple[str, ...]]]:
    """``None``, a bool, or a list/tuple of non-empty str names (a bare str is refused: it is not a list)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise InvalidTypeError(
        f"{what} must be True, False, None or a list of names (e.g. [\"qm9/processed\"]), "
        f"not {type(value).__name__} {value!r:.60}"
    )


def in_scope(scope: Union[bool, Tuple[str, ...]], *names: str) -> bool:
    """Does ``scope`` cover any of ``names``?  Items are exact names or shell-style patterns (``qm9/*``)."""
    if isinstance(scope, bool):
        return scope
    return any(n == pat or fnmatch.fnmatchcase(n, pat) for pat in scope for n in names)


_started: Tuple[int, float] = (0, 0.0)


def process_started() -> float:
    """When this process started (``time.time()`` scale): the start of its "job".

    From ``/proc/self/stat`` (clock ticks since boot, rounded up to the next
    tick, so never early: a result recorded just before this process started
    is never taken for a fresh one) against ``CLOCK_BOOTTIME``; where that is
    unreadable, when casstore was first asked.
    """
    global _started
    pid = os.getpid()
    if _started[0] == pid:
        return _started[1]
    t = time.time()
    try:
        with open("/proc/self/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        hz = os.sysconf("SC_CLK_TCK")
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - (int(rest[19]) + 1) / hz  # field 22
        t = min(t, time.time() - max(0.0, since_start))
    except (OSError, IndexError, ValueError, AttributeError):
        pass
    _started = (pid, t)
    return t


def producer() -> str:
    """Who records a result: this process's token (``pid.start.host``), stored in the record."""
    return process_token()


def fresh_for_job(recorded: object, by: object) -> bool:
    """Was a result recorded by *another* process after this one started (so: already redone for this job)?

    This is what makes ``force_download`` / ``regenerate`` once per job, not
    once per process: the ranks of a job that wait while one of them redoes a
    step take its result.  The same process asking again redoes it (an
    explicit request in one process is honoured every time).
    """
    if isinstance(recorded, bool) or not isinstance(recorded, (int, float)) or not isinstance(by, str):
        return False  # a record from before this rule, or damaged: not evidence of freshness
    return by != producer() and recorded >= process_started()


def check_seconds(value: object, what: str, *, positive: bool = False) -> float:
    """A number of seconds (int or float, not bool); ``inf`` allowed, NaN and negatives refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{what} must be a number of seconds, not {type(value).__name__} {value!r:.40}")
    v = float(value)
    if math.isnan(v) or v < 0 or (positive and v == 0):
        raise InvalidInputError(f"{what} must be a {'positive' if positive else 'non-negative'} number of seconds, "
                                f"not {value!r}")
    return v


def lock_seconds(value: object, default: float, what: str) -> Optional[float]:
    """A lock timeout for ``FileLock``: ``None`` -> ``default``; ``inf`` -> ``None`` (wait forever)."""
    v = default if value is None else check_seconds(value, what)
    return None if math.isinf(v) else v


def check_flag(value: object, what: str) -> Optional[bool]:
    """``None`` or a bool (``1``/``"yes"`` are refused: a typo must not silently mean True)."""
    if value is not None and not isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be True, False or None, not {type(value).__name__} {value!r:.40}")
    return value


def check_count(value: object, what: str) -> int:
    """A non-negative int (not bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{what} must be an int, not {type(value).__name__} {value!r:.40}")
    if value < 0:
        raise InvalidInputError(f"{what} must be >= 0, not {value}")
    return value


def refuse_pinned(store: Store, name: str, what: str) -> None:
    """FrozenError if ``name`` is a pin: a pinned result can never be replaced (check before the work)."""
    if store.refs.get("pins", name) is not None:
        raise FrozenError(
            f"{name!r} is frozen (a pin), so {what} cannot record a new result under it; "
            f"use another name, e.g. {name + '-v2'!r}"
        )


def write_head(store: Store, name: str, entries: Mapping[str, Entry], meta: Mapping[str, object], *,
               timeout: Optional[float]) -> Manifest:
    """Record a new version of head ``name`` (the caller holds ``store.refs.lock(name)``) and return it.

    The version's parent is the current head, so history is kept.  Every
    entry's object must exist; the check and the ref move happen under the
    store's GC lock (shared), so gc cannot remove an object in between.
    """
    with commit_lock(store, timeout=timeout):
        for key, e in entries.items():
            if not store.objects.has(e.digest):
                raise ObjectNotFoundError(
                    f"{name!r}: output {key!r} ({e.digest}) vanished before it was recorded (gc or limit?); run again"
                )
        parent = store.refs.get("heads", name)
        doc = ManifestDoc.build(entries, meta, parent)
        d = put_version(store.objects, doc)
        store.refs.write("heads", name, d)
    return Manifest(d, doc, name=name)


class TreeFlusher:
    """While ``fn`` writes its outputs, start their write-back early: a durable store fsyncs each output
    before it is named, and an fsync of 170 MB that starts only when ``fn`` returns costs ~0.3 s here.

    A daemon thread looks at the regular files under ``root`` every ``every``
    seconds and calls ``fdatasync`` on each one that grew by ``step`` bytes since its
    last flush, so the disk writes while ``fn`` computes and the final fsync
    finds little left.  Best effort: any error (a file renamed or removed
    meanwhile, a symbolic link) is ignored; correctness never depends on it.
    """

    def __init__(self, root: Path, *, every: float = 0.1, step: int = 8 << 20, max_files: int = 256) -> None:
        self.root = root
        self._every = every
        self._step = step
        self._max_files = max_files
        self._flushed: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="casstore-derive-flush", daemon=True)
        self._thread.start()

    def _files(self) -> list[os.DirEntry[str]]:
        out: list[os.DirEntry[str]] = []
        stack = [str(self.root)]
        while stack and len(out) < self._max_files:
            try:
                with os.scandir(stack.pop()) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            out.append(e)
            except OSError:
                continue
        return out

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for e in self._files():
                try:
                    size = e.stat(follow_symlinks=False).st_size
                    if size - self._flushed.get(e.path, 0) < self._step:
                        continue
                    fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                    try:
                        os.fdatasync(fd)
                    finally:
                        os.close(fd)
                    self._flushed[e.path] = size
                except OSError:
                    continue

    def stop(self) -> None:
        """Stop looking (returns once the thread is done)."""
        self._stop.set()
        self._thread.join()
