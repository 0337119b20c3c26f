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

import math
from typing import TYPE_CHECKING, Mapping, Optional

from .._gclock import commit_lock
from ..errors import FrozenError, InvalidInputError, InvalidTypeError, ObjectNotFoundError
from ..manifests import Entry, Manifest, ManifestDoc, put_version

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["check_seconds", "check_flag", "check_count", "lock_seconds", "write_head", "refuse_pinned"]


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
