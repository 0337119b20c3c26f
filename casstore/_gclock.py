"""The store-wide GC lock: commits share it, garbage collection holds it alone.

Two sidecar files in ``<root>/locks``:

``gc.lock``
    Every operation that makes a ref point at objects (an edit's commit, ``pin``,
    ``freeze``) holds it *shared* while it checks that its objects exist and
    writes the version and the ref.  ``gc`` holds it *exclusive* while it
    re-reads the roots and deletes.  So no reference can land between GC's
    root scan and its deletes: a commit either finished before (GC sees the
    new ref) or starts after (it finds any object GC removed missing, and
    fails instead of referencing it).

``gc.gate``
    Makes the lock writer-preferring.  flock has no queue, so a stream of
    overlapping shared holders (busy committers) could starve GC forever.
    Committers hold the gate shared only while *acquiring* ``gc.lock``; GC
    takes the gate exclusive first, which stops new committers at the gate,
    then waits for the current ones to drain from ``gc.lock``.

Lock order: a name lock (``locks/names/...``) before these; GC takes no name
lock, so the two can never deadlock.  Like every casstore lock these only
serialize; correctness of objects never depends on them.

On the lease path (``_lock.py``: locks missing or not enforced) a committer's
shared hold of ``gc.lock`` is a holder file of its own, and GC's exclusive
lease waits for those files to go; the lease stops new committers the moment
GC creates it (``LockStrategy.writer_first``), so committers skip the gate
there: on FUSE or NFS each lease operation is a round trip, and the gate was
a third of a commit's.  Nothing here nests a lock of the same file (a lease
would wait for itself until the timeout).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from ._layout import LOCKS
from ._lock import FileLock, strategy_for

__all__ = ["commit_lock", "gc_lock", "GC_LOCK", "GC_GATE"]

GC_LOCK = "gc.lock"
GC_GATE = "gc.gate"


def _root(store_or_root: object) -> Path:
    # A Path has a ``.root`` attribute too ("/"): test for a Path first.
    root = store_or_root if isinstance(store_or_root, Path) else getattr(store_or_root, "root", None)
    if not isinstance(root, Path):
        raise TypeError(f"commit_lock/gc_lock take a Store or its root Path, not {type(store_or_root).__name__}")
    return root


@contextmanager
def commit_lock(store_or_root: object, *, timeout: Optional[float] = 600.0) -> Iterator[None]:
    """Hold the GC lock shared (for landing references to objects)."""
    locks = _root(store_or_root) / LOCKS
    lock = FileLock(locks / GC_LOCK, timeout=timeout, shared=True, what="the store's GC lock (a gc is deleting)")
    if strategy_for(lock.path)[0].writer_first:
        lock.acquire()
    else:
        with FileLock(locks / GC_GATE, timeout=timeout, shared=True, what="the store's GC gate (a gc is starting)"):
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def gc_lock(store_or_root: object, *, timeout: Optional[float] = 600.0) -> Iterator[None]:
    """Hold the GC lock exclusive: no commit, pin or freeze runs meanwhile."""
    locks = _root(store_or_root) / LOCKS
    with FileLock(locks / GC_GATE, timeout=timeout, what="the store's GC gate (another gc is running)"):
        with FileLock(locks / GC_LOCK, timeout=timeout,
                      what="the store's GC lock (commits in progress hold it shared)"):
            yield
