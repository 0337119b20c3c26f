"""Garbage collection and size limits.

``plan = store.plan_gc(keep_history=5, grace="1h")`` computes, without
deleting or reading any data object, a frozen :class:`GCPlan`: which object
files would go, how many bytes that frees, and why every other object stays.
``plan.execute()`` deletes.  ``store.limit(max_bytes=...)`` is the same
machinery ordered least-recently-used first and stopped once the store fits.

What GC keeps (the *roots* and their closure, :mod:`casstore.manifests.graph`):

* every pin's version, and every entry of it;
* every head's current version and its last ``keep_history`` versions
  (following parent links), and every entry of those;
* the derive inputs a pin or a head's *current* version records in its
  metadata (``meta["casstore.inputs"]``), transitively through manifest
  inputs (derive provenance; a malformed record keeps nothing extra and
  becomes a plan warning, never an error);
* every object written (or re-put) within ``grace`` of now: a write in
  progress may still be about to reference it.

Safety argument (docs/maintenance.md has the long form):

1. Objects are written before anything refers to them, and a commit checks
   that its objects exist while it holds ``locks/gc.lock`` shared
   (:mod:`casstore._gclock`).  ``execute`` holds that lock exclusive while it
   re-reads every root and deletes, so a reference can never land between
   the root scan and a delete: the commit either finished before (its ref is
   seen, the object is live) or runs after (it finds the object gone and
   fails instead of referencing it).
2. The grace period keeps that failure away from live writers: ``put`` of an
   object that already exists refreshes its mtime, so anything a writer has
   just put or re-put is fresh.  ``execute`` moves each doomed file into
   ``tmp/`` first and checks its mtime *there*: a re-put that refreshed it
   before the move is seen and the file is moved back; one that comes after
   the move finds no file and writes a new copy.
3. GC removes no refs and deletes only unreachable objects, so being killed
   at any point leaves a consistent store; expired manifest versions go
   before the objects only they referenced ("a reference is removed before
   its object"), so no surviving version ever names a missing object.  A
   file killed mid-move stays in ``tmp/`` and is swept as a dead writer's;
   a rerun plans again and finishes the job.
4. GC never deletes through a link (issue 11): the scan lists regular files
   only (``lstat``), and ``execute`` moves each file out of its fan-out
   directory opened with ``O_NOFOLLOW`` (a fan-out directory swapped for a
   symlink after the plan is refused, not followed) and deletes it only if the
   moved entry is still a regular file; anything planted meanwhile (symlink,
   FIFO, directory) is put back untouched for ``verify`` to report.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat as stat_mod
import time
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple, Union

from .._faults import fault
from .._fs import process_token, sweep_stale
from .._gclock import gc_lock
from .._layout import OBJECTS
from .._progress import Progress, human_age, human_bytes
from ..codecs import Codec
from ..digest import Digest
from ..errors import IntegrityError, StoreFormatError
from ..manifests.graph import Live, compute_live, entry_refs
from ..objects.chunking import ChunkIndex
from ..objects.local import ObjFile
from .durations import Duration, Size, parse_duration, parse_size
from .files import ObjectDirs

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "GCPlan",
    "GCResult",
    "LimitResult",
    "PlannedFile",
    "plan_gc",
    "plan_limit",
    "limit",
    "DEFAULT_GRACE",
    "DEFAULT_KEEP_HISTORY",
]

log = logging.getLogger("casstore.gc")

DEFAULT_GRACE = 3600.0
"""Seconds within which a written or re-put object is kept whatever references it."""
DEFAULT_KEEP_HISTORY = 5
"""Versions kept behind each head's current one."""


# -- plans ------------------------------------------------------------------------------------


class PlannedFile(NamedTuple):
    """One object file a plan would delete."""

    hex: str
    codec: Codec
    path: str
    size: int
    """Bytes on disk."""
    mtime: float
    kind: str
    """``"version"`` (an expired manifest version, deleted first) or ``"object"``."""

    @property
    def digest(self) -> Digest:
        """The object's digest."""
        return Digest(self.hex)


def _planned(f: ObjFile, kind: str) -> PlannedFile:
    return PlannedFile(f.hex, f.codec, f.path, f.size, f.mtime, kind)


@dataclass(frozen=True, slots=True)
class GCResult:
    """What :meth:`GCPlan.execute` did."""

    deleted: Tuple[Digest, ...]
    """Digests whose planned files were deleted, in deletion order (each once)."""
    freed_bytes: int
    skipped: Mapping[Digest, str]
    """Planned objects kept after all, and why (referenced or re-put since the plan, or planted over)."""
    already_gone: int
    """Planned files that had disappeared before execute reached them."""
    seconds: float

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"deleted": len(self.deleted), "freed_bytes": self.freed_bytes,
                "skipped": {str(k): v for k, v in self.skipped.items()}, "already_gone": self.already_gone,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class GCPlan:
    """A frozen garbage-collection (or size-limit) plan; nothing is deleted until :meth:`execute`.

    ``objects`` are the digests that would go (expired manifest versions
    first), ``freed_bytes`` what deleting them frees on disk, ``kept`` why
    every other object stays (:meth:`why` for one digest).

    Not slotted: ``objects`` and ``kept`` are computed once, on first use
    (``cached_property`` needs an instance dict), because ``kept`` names every
    object of the store and most callers never ask.
    """

    store: Store = field(repr=False, compare=False)
    keep_history: int
    grace: float
    created: float
    files: Tuple[PlannedFile, ...] = field(repr=False)
    freed_bytes: int
    total_files: int
    total_bytes: int
    """Stored bytes of every object file when planned."""
    roots: Mapping[str, Digest] = field(repr=False)
    _live: Live = field(repr=False, compare=False)
    """The roots' closure when planned (what is kept, and why)."""
    _fresh: Mapping[str, float] = field(repr=False, compare=False)
    """hex -> newest mtime of objects kept because they are within the grace period."""
    _spared: Mapping[str, str] = field(repr=False, compare=False, default_factory=dict)
    """hex -> why, for unreferenced objects a limit plan does not need to evict."""
    max_bytes: Optional[int] = None
    """For a :func:`plan_limit` plan: the size limit; ``None`` for gc."""

    @cached_property
    def objects(self) -> Tuple[Digest, ...]:
        """Digests that would be deleted, in deletion order (each once)."""
        seen: Set[str] = set()
        out: List[Digest] = []
        for f in self.files:
            if f.hex not in seen:
                seen.add(f.hex)
                out.append(Digest(f.hex))
        return tuple(out)

    @cached_property
    def kept(self) -> Mapping[Digest, str]:
        """Every object that stays, with the reason (root closure, fresh, or not needed for the limit)."""
        out: Dict[Digest, str] = {}
        for h in self._live.live:
            out[Digest(h)] = self._live.describe(h)
        for h in self._fresh:
            out[Digest(h)] = self._fresh_reason(h)
        for h, why in self._spared.items():
            out[Digest(h)] = why
        return MappingProxyType(out)

    @property
    def warnings(self) -> Tuple[str, ...]:
        """Provenance records that were malformed or unreadable when planned (each kept nothing extra)."""
        return tuple(self._live.warnings)

    @property
    def stored_bytes_after(self) -> int:
        """Stored bytes left if every planned file is deleted."""
        return self.total_bytes - self.freed_bytes

    @property
    def met(self) -> bool:
        """For a limit plan: whether deleting the plan gets the store under ``max_bytes``."""
        return self.max_bytes is None or self.stored_bytes_after <= self.max_bytes

    def _fresh_reason(self, h: str) -> str:
        return (f"fresh: written {human_age(self.created - self._fresh[h])} ago, within the grace period "
                f"({human_age(self.grace)}); a write in progress may still reference it")

    def why(self, digest: Union[Digest, str]) -> str:
        """Why ``digest`` stays or goes, in words."""
        h = Digest.coerce(digest).hex
        if h in self._live.live:
            return "kept: " + self._live.describe(h)
        if h in self._fresh:
            return "kept: " + self._fresh_reason(h)
        if h in self._spared:
            return "kept: " + self._spared[h]
        for f in self.files:
            if f.hex == h:
                what = "an expired manifest version" if f.kind == "version" else "unreferenced"
                return (f"deleted: {what}, last written {human_age(self.created - f.mtime)} ago "
                        f"({human_bytes(f.size)} on disk)")
        return "not in the store when planned"

    def summary(self) -> str:
        """A few lines for humans."""
        n_versions = len({f.hex for f in self.files if f.kind == "version"})
        lines = [
            f"{len(self.objects)} objects ({n_versions} expired manifest versions) would be deleted, "
            f"freeing {human_bytes(self.freed_bytes)} of {human_bytes(self.total_bytes)}",
            f"kept: {len(self._live.live)} referenced by {len(self.roots)} roots "
            f"(pins, heads and their last {self.keep_history} versions), {len(self._fresh)} fresh "
            f"(grace {human_age(self.grace)})"
            + (f", {len(self._spared)} not needed for the limit" if self._spared else ""),
        ]
        warnings = self._live.warnings
        lines += [f"warning: {w}" for w in warnings[:10]]
        if len(warnings) > 10:
            lines.append(f"warning: ... and {len(warnings) - 10} more (plan.warnings lists them all)")
        if self.max_bytes is not None:
            if self.met:
                lines.append(f"limit {human_bytes(self.max_bytes)}: met ({human_bytes(self.stored_bytes_after)} "
                             "after eviction)")
            else:
                lines.append(self.shortfall_message())
        return "\n".join(lines)

    def shortfall_message(self) -> str:
        """Why a limit cannot be met (empty when it can)."""
        if self.met or self.max_bytes is None:
            return ""
        return (f"limit {human_bytes(self.max_bytes)} cannot be met: {human_bytes(self.stored_bytes_after)} stay "
                f"because they are pinned, referenced by heads (current or last {self.keep_history} versions), "
                f"inputs those pins and current heads were derived from, or fresh (written within "
                f"{human_age(self.grace)}); pinned and head-referenced data is never evicted "
                "-- unpin or remove names, lower keep_history, or raise the limit")

    def to_dict(self, *, objects: bool = False) -> Dict[str, Any]:
        """JSON-able form; ``objects=True`` lists every digest with its reason."""
        doc: Dict[str, Any] = {
            "objects": len(self.objects),
            "files": len(self.files),
            "expired_versions": len({f.hex for f in self.files if f.kind == "version"}),
            "freed_bytes": self.freed_bytes,
            "total_files": self.total_files,
            "total_bytes": self.total_bytes,
            "kept_referenced": len(self._live.live),
            "kept_fresh": len(self._fresh),
            "keep_history": self.keep_history,
            "grace_seconds": self.grace,
            "roots": {k: str(v) for k, v in self.roots.items()},
            "warnings": list(self._live.warnings),
        }
        if self.max_bytes is not None:
            doc.update(max_bytes=self.max_bytes, stored_bytes_after=self.stored_bytes_after, met=self.met)
            if not self.met:
                doc["message"] = self.shortfall_message()
        if objects:
            doc["delete"] = [{"digest": f"blake3:{f.hex}", "codec": f.codec.name, "bytes": f.size, "kind": f.kind}
                             for f in self.files]
            doc["kept"] = {str(k): v for k, v in self.kept.items()}
        return doc

    def execute(self, *, timeout: Optional[float] = 600.0, progress: Optional[bool] = None) -> GCResult:
        """Delete the planned files that are still garbage; return what was done.

        Holds the store's GC lock exclusive (waiting up to ``timeout`` seconds
        for commits in progress), re-reads every root, and skips any planned
        object that has become referenced or was written again since the plan.
        """
        return _execute(self, timeout=timeout, progress=progress)


def _plan(store: Store, keep_history: int, grace: Duration, *, max_bytes: Optional[int] = None) -> GCPlan:
    g = parse_duration(grace)
    now = time.time()
    # Scan objects *before* reading refs: an object that appears after the scan
    # is not in the plan, and one referenced by a ref written after it is, at
    # worst, planned and then spared by execute's re-read under the lock.
    # Strays (planted links, FIFOs, directories, foreign names) are never planned.
    files, _strays = store.objects.scan()
    live = compute_live(store.objects, store.refs, keep_history)
    for w in live.warnings:
        log.warning("gc: %s", w)
    cutoff = now - g
    versions: Dict[str, List[ObjFile]] = {}
    expired_set = {d.hex for d in live.expired}
    garbage: List[ObjFile] = []
    fresh: Dict[str, float] = {}
    total = 0
    for f in files:
        total += f.size
        if f.hex in live.live:
            continue
        if f.mtime > cutoff:
            fresh[f.hex] = max(f.mtime, fresh.get(f.hex, 0.0))
        elif f.hex in expired_set:
            versions.setdefault(f.hex, []).append(f)
        else:
            garbage.append(f)
    # An object with one fresh copy and one old copy keeps both (it is in use).
    garbage = [f for f in garbage if f.hex not in fresh]
    planned: List[PlannedFile] = []
    for d in live.expired:
        if d.hex in fresh:
            continue
        for f in versions.get(d.hex, ()):
            planned.append(_planned(f, "version"))
    spared: Dict[str, str] = {}
    if max_bytes is None:
        planned += [_planned(f, "object") for f in garbage]
    else:
        over = total - max_bytes
        if over > 0:
            # Expired versions go first whenever anything goes (they are small and
            # cut the history chain before the objects only they reference).
            over -= sum(p.size for p in planned)
            # Least recently used first: atime (reads, at relatime resolution) or mtime (writes, re-puts).
            by_hex: Dict[str, List[ObjFile]] = {}
            for f in garbage:
                by_hex.setdefault(f.hex, []).append(f)
            order = sorted(by_hex.values(), key=lambda fs: max(max(x.atime, x.mtime) for x in fs))
            for group in order:
                if over <= 0:
                    for x in group:
                        spared[x.hex] = ("unreferenced, but not needed to meet the limit (used "
                                         f"{human_age(now - max(x.atime, x.mtime))} ago)")
                    continue
                for x in group:
                    planned.append(_planned(x, "object"))
                    over -= x.size
        else:
            planned = []
            for f in garbage:
                spared[f.hex] = "unreferenced, but the store is already under the limit"
            for d in live.expired:
                spared.setdefault(d.hex, "expired manifest version, but the store is already under the limit")
    return GCPlan(
        store=store, keep_history=keep_history, grace=g, created=now, files=tuple(planned),
        freed_bytes=sum(p.size for p in planned), total_files=len(files), total_bytes=total,
        roots=MappingProxyType(dict(live.roots)), _live=live, _fresh=MappingProxyType(fresh),
        _spared=MappingProxyType(spared), max_bytes=max_bytes,
    )


def plan_gc(store: Store, *, keep_history: int = DEFAULT_KEEP_HISTORY, grace: Duration = DEFAULT_GRACE) -> GCPlan:
    """Plan a garbage collection (nothing is deleted; no data object is read).

    ``keep_history``: versions kept behind each head's current one.
    ``grace``: objects written or re-put within this long are kept (seconds,
    a ``timedelta``, or ``"90s"``/``"10m"``/``"1h"``).
    """
    return _plan(store, keep_history, grace)


def plan_limit(store: Store, max_bytes: Size, *, keep_history: int = DEFAULT_KEEP_HISTORY,
               grace: Duration = DEFAULT_GRACE) -> GCPlan:
    """Plan evicting least-recently-used *unreferenced* objects until the store fits ``max_bytes``.

    Pinned and head-referenced objects (current and last ``keep_history``
    versions) and fresh ones are never planned; if the limit cannot be met
    without them, the plan says so (``plan.met`` is False).
    """
    return _plan(store, keep_history, grace, max_bytes=parse_size(max_bytes))


# -- execute ------------------------------------------------------------------------------------


def _surviving_history(live: Live, deleted: Set[str]) -> Dict[str, str]:
    """Entries of expired versions that are still stored (hex -> why), so no object they name goes.

    Versions that expired *after* the plan was made are not in it and so
    survive this run; the objects only they reference may be in the plan
    (they were unreferenced then).  Deleting those would leave a stored
    history version naming a missing object, so they stay until a later run
    removes the version first.
    """
    out: Dict[str, str] = {}
    g = live.graph
    if g is None:
        return out
    for d in live.expired:
        if d.hex in deleted:
            continue
        try:
            doc = g.doc(d, "expired history", required=False)
        except (IntegrityError, StoreFormatError):
            continue  # a damaged expired version: verify reports it
        if doc is None:
            continue
        for key, eh, _size in entry_refs(doc):
            if eh not in live.live:
                out.setdefault(eh, f"still named by stored history version blake3:{d.hex[:12]} (entry {key!r}), "
                                   "which this run keeps (too fresh, or expired after the plan); a later "
                                   "gc removes the version first")
    return out


def _lexists_at(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _restore(grave: str, name: str, dir_fd: int) -> None:
    """Put a moved-out entry back as ``name`` in ``dir_fd``, unless a writer has meanwhile published a new copy.

    Never follows a link: a planted symlink goes back as the link itself.  If
    it cannot go back (a fresh copy is in place), a regular file is dropped
    and anything else stays in ``tmp/`` under its grave name, swept later as
    a dead writer's staging entry.
    """
    try:
        os.link(grave, name, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        pass  # a fresh copy is in place: keep it
    except OSError:  # no hard link allowed (a directory, fs.protected_hardlinks on another user's file)
        if not _lexists_at(name, dir_fd):
            os.rename(grave, name, dst_dir_fd=dir_fd)
            return
    if stat_mod.S_ISDIR(os.lstat(grave).st_mode):
        return  # swept with tmp/ (rmtree never follows links)
    os.unlink(grave)


def _execute(plan: GCPlan, *, timeout: Optional[float], progress: Optional[bool]) -> GCResult:
    store = plan.store
    t0 = time.monotonic()
    tmp = store.objects.tmp
    # <pid>.<start>.<host>.<hex>.gc: swept like any dead writer's staging file if we are killed
    grave_prefix = f"{tmp}{os.sep}{process_token()}.{secrets.token_hex(4)}"
    seq = 0
    deleted: Dict[Digest, None] = {}
    skipped: Dict[Digest, str] = {}
    freed = 0
    gone = 0
    durable = store.durable
    # Hazard (found by a bug hunt): in a store whose tmp/ was made sticky, another member's object moved
    # into tmp/ can be neither unlinked nor moved back there: gc failed "unexpectedly" and left it in
    # tmp/.  Such an object is left in place (its owner's gc collects it); one lstat each, only then.
    me = os.geteuid()
    try:
        tst = os.stat(tmp)
        sticky = bool(tst.st_mode & stat_mod.S_ISVTX) and me != 0 and tst.st_uid != me
    except OSError:
        sticky = False
    with gc_lock(store, timeout=timeout), \
            Progress(len(plan.files), desc="gc", unit="files", enabled=progress) as bar:
        live = compute_live(store.objects, store.refs, plan.keep_history)  # re-read every root under the lock
        cutoff = time.time() - plan.grace
        phase = "version"
        version_fans: Set[str] = set()
        protected: Dict[str, str] = {}
        with ObjectDirs(store.root / OBJECTS) as dirs:
            for f in plan.files:
                bar.update()
                if f.kind != phase:
                    phase = f.kind
                    if durable:  # expired versions are gone for good before any object they named
                        for fan in sorted(version_fans):
                            fd = dirs.fan(fan)
                            if fd is not None:
                                os.fsync(fd)
                    protected = _surviving_history(live, {d.hex for d in deleted})
                d = f.digest
                if f.hex in live.live:
                    skipped[d] = "now referenced: " + live.describe(f.hex)
                    continue
                if f.hex in protected:
                    skipped[d] = protected[f.hex]
                    continue
                dir_fd, name = dirs.locate(f.path)
                if dir_fd is None:  # its fan-out directory is gone or was swapped for a link: never followed
                    gone += 1
                    continue
                if sticky:
                    try:
                        owner = os.lstat(name, dir_fd=dir_fd).st_uid
                    except FileNotFoundError:
                        gone += 1
                        continue
                    if owner != me:
                        skipped[d] = ("another user's file, and tmp/ is sticky: this user cannot delete it "
                                      "there; left alone (its owner's gc collects it, or `chmod -t` tmp/)")
                        continue
                seq += 1
                grave = f"{grave_prefix}{seq:08x}.gc"
                try:
                    os.rename(name, grave, src_dir_fd=dir_fd)
                except FileNotFoundError:
                    gone += 1
                    continue
                fault("gc.moved")
                try:
                    st = os.lstat(grave)
                except FileNotFoundError:  # pragma: no cover - nobody sweeps a live process's files
                    continue
                if not stat_mod.S_ISREG(st.st_mode):
                    # Planted after the plan (a symlink, FIFO or directory in place of the
                    # object file): not ours to delete, and never followed.  Back it goes.
                    _restore(grave, name, dir_fd)
                    skipped[d] = ("something that is not an object file (a link, FIFO or directory) took "
                                  "its place since the plan; left alone: `casstore verify --repair` moves it aside")
                    continue
                if st.st_mtime > cutoff:
                    # Re-put since the plan (its mtime was refreshed before our move): put it back.
                    _restore(grave, name, dir_fd)
                    skipped[d] = "written again since the plan (fresh)"
                    continue
                os.unlink(grave)
                freed += st.st_size
                deleted[d] = None
                if f.kind == "version":
                    version_fans.add(os.path.basename(os.path.dirname(f.path)))
                fault("gc.deleted")
        # No sync at the end: a deletion a power loss undoes only leaves garbage behind.
        sweep_stale(tmp)  # files a killed gc left mid-move
        ChunkIndex(store.root).forget(deleted)  # (hints naming deleted objects: see ChunkIndex.forget)
    return GCResult(tuple(deleted), freed, MappingProxyType(skipped), gone, time.monotonic() - t0)


# -- limits -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitResult:
    """What :func:`limit` planned and did."""

    plan: GCPlan
    result: Optional[GCResult]
    """``None`` for a dry run."""
    max_bytes: int
    stored_bytes_before: int
    stored_bytes_after: int
    met: bool
    message: str
    """Empty when met; else why the limit could not be met and what to do."""

    @property
    def evicted(self) -> Tuple[Digest, ...]:
        """Digests deleted (or, in a dry run, that would be)."""
        return self.result.deleted if self.result is not None else self.plan.objects

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"max_bytes": self.max_bytes, "stored_bytes_before": self.stored_bytes_before,
                "stored_bytes_after": self.stored_bytes_after, "met": self.met, "evicted": len(self.evicted),
                "dry_run": self.result is None, "message": self.message}


def limit(store: Store, max_bytes: Size, *, keep_history: int = DEFAULT_KEEP_HISTORY,
          grace: Duration = DEFAULT_GRACE, dry_run: bool = False, timeout: Optional[float] = 600.0,
          progress: Optional[bool] = None) -> LimitResult:
    """Evict least-recently-used unreferenced objects until the store's objects fit ``max_bytes``.

    Never evicts pinned or head-referenced objects; when the limit cannot be
    met the result says so (``met`` False, ``message``).  ``dry_run`` only plans.
    """
    cap = parse_size(max_bytes)
    plan = plan_limit(store, cap, keep_history=keep_history, grace=grace)
    res = None if dry_run else plan.execute(timeout=timeout, progress=progress)
    freed = plan.freed_bytes if res is None else res.freed_bytes
    after = plan.total_bytes - freed
    met = after <= cap
    msg = ""
    if not met:
        msg = plan.shortfall_message() or (
            f"limit {human_bytes(cap)} not met: {human_bytes(after)} remain because planned objects were "
            "referenced or written again while gc ran; run it again")
    return LimitResult(plan, res, cap, plan.total_bytes, after, met, msg)
