"""Garbage collection, size limits and usage reports.

``plan = store.plan_gc(keep_history=5, grace="1h")`` computes, without
deleting or reading any data object, a frozen :class:`GCPlan`: which object
files would go, how many bytes that frees, and why every other object stays.
``plan.execute()`` deletes.  ``store.limit(max_bytes=...)`` is the same
machinery ordered least-recently-used first and stopped once the store fits.

What GC keeps (the *roots* and their closure):

* every pin's version, and every entry of it;
* every head's current version and its last ``keep_history`` versions
  (following parent links), and every entry of those;
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
"""

from __future__ import annotations

import os
import re
import secrets
import stat as stat_mod
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Set,
    Tuple,
    Union,
)

import msgpack

from ._fs import fsync_dir, process_token, sweep_stale
from ._gclock import gc_lock
from ._layout import OBJECTS, TMP

RAW, ZSTD = "raw", "zstd"  # TRANSITIONAL
from ._progress import Progress, human_bytes
from .digest import Digest
from .errors import IntegrityError, InvalidInputError, InvalidTypeError, ObjectNotFoundError, StoreFormatError
from .manifest import decode_manifest
from .refs import list_refs

if TYPE_CHECKING:
    from .store import Store

__all__ = [
    "GCPlan",
    "GCResult",
    "LimitResult",
    "Usage",
    "NameUsage",
    "plan_gc",
    "plan_limit",
    "limit",
    "usage",
    "parse_duration",
    "parse_size",
    "DEFAULT_GRACE",
    "DEFAULT_KEEP_HISTORY",
]

DEFAULT_GRACE = 3600.0
DEFAULT_KEEP_HISTORY = 5

Duration = Union[int, float, str, timedelta]

# Test-only fault injection (like casstore.manifest._fault_hook): called with a
# point name during execute; tests SIGKILL the process there.
_fault_hook: Optional[Callable[[str], None]] = None


def _fault(point: str) -> None:
    if _fault_hook is not None:
        _fault_hook(point)


# -- parsing ----------------------------------------------------------------------------------

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DUR_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(min|[smhdw]?)")


def parse_duration(value: Duration, what: str = "grace") -> float:
    """Seconds from ``90``, ``90.5``, ``timedelta(...)``, ``"90s"``, ``"10m"``, ``"1h"``, ``"2d"``, ``"1h30m"``."""
    if isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be seconds, a timedelta or a string like '1h', not a bool")
    if isinstance(value, timedelta):
        secs = value.total_seconds()
    elif isinstance(value, (int, float)):
        secs = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        pos = 0
        secs = 0.0
        for m in _DUR_RE.finditer(text):
            if m.start() != pos or (not m.group(2) and m.end() != len(text)):
                break
            secs += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if not text or pos != len(text):
            raise InvalidInputError(
                f"invalid {what} {value!r}: use seconds or a duration like '90s', '10m', '1h', '2d' or '1h30m'"
            )
    else:
        raise InvalidTypeError(f"{what} must be seconds, a timedelta or a string like '1h', not {type(value).__name__}")
    if secs != secs or secs < 0:
        raise InvalidInputError(f"invalid {what} {value!r}: it must not be negative")
    return secs


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value: Union[int, float, str], what: str = "max_bytes") -> int:
    """Bytes from ``1000``, ``"500M"``, ``"10G"``, ``"1.5GiB"`` (K/M/G/T are powers of 1024)."""
    if isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be a number of bytes or a string like '10G', not a bool")
    if isinstance(value, (int, float)):
        n = float(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise InvalidInputError(f"invalid {what} {value!r}: use bytes or a size like '500M', '10G', '1.5TiB'")
        n = float(m.group(1)) * 1024 ** " kmgtp".index(m.group(2).lower() or " ")
    else:
        raise InvalidTypeError(f"{what} must be a number of bytes or a string like '10G', not {type(value).__name__}")
    if n != n or n < 0:
        raise InvalidInputError(f"invalid {what} {value!r}: it must not be negative")
    return int(n)


# -- scanning the object directory (no object is opened) ---------------------------------------


class ObjFile(NamedTuple):
    """One object file as seen by a directory scan (``lstat`` only)."""

    hex: str
    codec: str
    path: str
    size: int
    """Bytes on disk."""
    mtime: float
    atime: float
    mtime_ns: int
    ino: int


_NAME_RE = re.compile(r"([0-9a-f]{62})(\.zst)?")


def scan_objects(root: Path) -> Tuple[List[ObjFile], List[Path]]:
    """Every object file under ``<root>/objects`` and every stray entry (wrong name or type).

    Uses ``scandir`` + ``lstat``: it never opens an object.
    """
    files: List[ObjFile] = []
    strays: List[Path] = []
    objdir = root / OBJECTS
    try:
        fans = sorted(os.scandir(objdir), key=lambda e: e.name)
    except FileNotFoundError:
        return files, strays
    for fan in fans:
        if not fan.is_dir(follow_symlinks=False) or len(fan.name) != 2 \
                or not all(c in "0123456789abcdef" for c in fan.name):
            strays.append(Path(fan.path))
            continue
        try:
            ents = sorted(os.scandir(fan.path), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for ent in ents:
            m = _NAME_RE.fullmatch(ent.name)  # what _layout.parse_object_name accepts, without a Digest each
            try:
                st = ent.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted while we looked (GC)
            if m is None or not stat_mod.S_ISREG(st.st_mode):
                strays.append(Path(ent.path))
                continue
            files.append(ObjFile(fan.name + m.group(1), ZSTD if m.group(2) else RAW, ent.path, st.st_size,
                                 st.st_mtime, st.st_atime, st.st_mtime_ns, st.st_ino))
    return files, strays


# -- reading manifest versions -------------------------------------------------------------------


def _parent_only(data: bytes) -> Optional[str]:
    """The ``parent`` field of a manifest version's bytes, skipping (not building) its entries."""
    try:
        up = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1024))
        up.feed(data)
        n = up.read_map_header()
        for _ in range(n):
            key = up.unpack()
            if key == "parent":
                val = up.unpack()
                return val.hex() if isinstance(val, bytes) and len(val) == 32 else None
            up.skip()
    except Exception:  # a damaged expired version: the walk just stops there
        return None
    return None


class Graph:
    """Manifest versions reachable from refs, each loaded once."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._docs: Dict[str, Dict[str, Any]] = {}

    def doc(self, hexd: str, where: str, *, required: bool) -> Optional[Dict[str, Any]]:
        """The decoded, hash-verified version ``hexd``; ``None`` if missing and not ``required``.

        A missing required version, or a corrupt or malformed one, raises:
        what it references is unknown, so nothing can be judged unreferenced.
        """
        doc = self._docs.get(hexd)
        if doc is not None:
            return doc
        d = Digest(hexd)
        try:
            data = self.store.get(d)
        except ObjectNotFoundError:
            if not required:
                return None
            raise ObjectNotFoundError(
                f"{where} points to manifest version {d}, which is missing from the store, so what it "
                "references is unknown and nothing can be collected safely; restore the version (fetch it "
                "from a remote), or re-point or remove that ref, then run gc again"
            ) from None
        except IntegrityError:
            raise IntegrityError(
                f"manifest version {d} ({where}) is corrupt, so what it references is unknown and nothing can "
                "be collected safely; run `casstore verify --repair` (it moves the damaged version to bad/), "
                "then gc again"
            ) from None
        try:
            doc = decode_manifest(data, d)
        except StoreFormatError as e:
            raise StoreFormatError(f"{e} ({where}); gc cannot tell what it references, so it stops") from None
        self._docs[hexd] = doc
        return doc

    def parent_of(self, hexd: str) -> Optional[str]:
        """Parent link of a version that may be expired, damaged or missing (never raises)."""
        doc = self._docs.get(hexd)
        if doc is not None:
            p = doc.get("parent")
            return p.hex() if isinstance(p, bytes) else None
        try:
            data = self.store.get(Digest(hexd), verify=False)
        except (ObjectNotFoundError, IntegrityError, OSError):
            return None
        return _parent_only(data)


def entry_items(doc: Mapping[str, Any], where: str) -> Iterable[Tuple[str, str, Optional[int]]]:
    """``(key, digest hex, size)`` of each entry of a decoded version; malformed entries raise."""
    for key, raw in doc["entries"].items():
        try:
            dig = raw[0]
            size = raw[1]
            if not isinstance(dig, bytes) or len(dig) != 32 or not (size is None or isinstance(size, int)):
                raise TypeError
        except (TypeError, IndexError, KeyError):
            raise StoreFormatError(f"{where}: entry {key!r} is malformed; gc cannot tell what it references") from None
        yield key, dig.hex(), size


@dataclass
class Live:
    """The roots' closure: which object hexes are live and why."""

    wheres: List[str] = field(default_factory=list)
    live: Dict[str, Tuple[int, str]] = field(default_factory=dict)
    """hex -> (index into ``wheres``, entry key or "" for the version object itself)."""
    expired: List[str] = field(default_factory=list)
    """Expired versions (reachable by parent links, outside every root), newest first per chain."""
    roots: Dict[str, Digest] = field(default_factory=dict)
    graph: Optional[Graph] = None

    def describe(self, hexd: str) -> str:
        """Why ``hexd`` is live, in words."""
        w, key = self.live[hexd]
        return f"entry {key!r} of {self.wheres[w]}" if key else f"manifest version of {self.wheres[w]}"


def compute_live(store: Store, keep_history: int) -> Live:
    """Read every ref and return the closure of the roots (see the module docstring)."""
    if isinstance(keep_history, bool) or not isinstance(keep_history, int) or keep_history < 0:
        raise InvalidInputError(f"keep_history must be a non-negative int, not {keep_history!r}")
    g = Graph(store)
    out = Live(graph=g)
    # Heads before pins: freeze writes the pin before removing the head, so a
    # name being frozen right now is seen at least once.
    heads = list_refs(store.root, "heads")
    pins = list_refs(store.root, "pins")
    frontier: List[Optional[str]] = []

    def add_version(hexd: str, where: str, required: bool) -> Optional[Dict[str, Any]]:
        doc = g.doc(hexd, where, required=required)
        if doc is None:
            return None
        w = len(out.wheres)
        out.wheres.append(where)
        live = out.live
        live.setdefault(hexd, (w, ""))
        for key, h, _size in entry_items(doc, f"manifest version {hexd[:12]} ({where})"):
            if h not in live:
                live[h] = (w, key)
        return doc

    for name, d in pins.items():
        out.roots[f"pin:{name}"] = d
        doc = add_version(d.hex, f"pin {name!r}", True)
        frontier.append(g.parent_of(d.hex))
    for name, d in heads.items():
        out.roots[f"head:{name}"] = d
        cur: Optional[str] = d.hex
        for i in range(keep_history + 1):
            assert cur is not None
            where = f"head {name!r}" if i == 0 else f"head {name!r}, {i} version{'s' if i > 1 else ''} back"
            doc = add_version(cur, where, i == 0)
            if doc is None:
                cur = None  # collected earlier (keep_history was lower then)
                break
            cur = g.parent_of(cur)
            if cur is None:
                break
        frontier.append(cur)
    # Expired history: every version reachable through parent links beyond the
    # kept windows.  They are deleted first, newest first, so the chain is cut
    # before any object only they reference disappears.
    seen: Set[str] = set()
    for start in frontier:
        cur = start
        while cur is not None and cur not in seen:
            seen.add(cur)
            if cur not in out.live:
                out.expired.append(cur)
            cur = g.parent_of(cur)
    return out


# -- plans ------------------------------------------------------------------------------------


class PlannedFile(NamedTuple):
    """One object file a plan would delete."""

    hex: str
    codec: str
    path: str
    size: int
    mtime: float
    kind: str
    """``"version"`` (an expired manifest version, deleted first) or ``"object"``."""


def _ago(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


@dataclass(frozen=True)
class GCResult:
    """What :meth:`GCPlan.execute` did."""

    deleted_hex: Tuple[str, ...] = field(repr=False)
    """Hex digests whose planned files were deleted (``deleted`` as :class:`Digest`)."""
    freed_bytes: int
    skipped: Mapping[Digest, str]
    """Planned objects kept after all, and why (referenced or re-put since the plan)."""
    already_gone: int
    """Planned files that had disappeared before execute reached them."""
    seconds: float

    @cached_property
    def deleted(self) -> Tuple[Digest, ...]:
        """Digests whose planned files were deleted, in deletion order."""
        return tuple(Digest(h) for h in self.deleted_hex)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"deleted": len(self.deleted_hex), "freed_bytes": self.freed_bytes,
                "skipped": {str(k): v for k, v in self.skipped.items()}, "already_gone": self.already_gone,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class GCPlan:
    """A frozen garbage-collection (or size-limit) plan; nothing is deleted until :meth:`execute`.

    ``objects`` are the digests that would go (expired manifest versions
    first), ``freed_bytes`` what deleting them frees on disk, ``kept`` why
    every other object stays (:meth:`why` for one digest).
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
    _fresh: Mapping[str, float] = field(repr=False, compare=False)
    _spared: Mapping[str, str] = field(repr=False, compare=False, default_factory=dict)
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
    def stored_bytes_after(self) -> int:
        """Stored bytes left if every planned file is deleted."""
        return self.total_bytes - self.freed_bytes

    @property
    def met(self) -> bool:
        """For a limit plan: whether deleting the plan gets the store under ``max_bytes``."""
        return self.max_bytes is None or self.stored_bytes_after <= self.max_bytes

    def _fresh_reason(self, h: str) -> str:
        return (f"fresh: written {_ago(self.created - self._fresh[h])} ago, within the grace period "
                f"({_ago(self.grace)}); a write in progress may still reference it")

    def why(self, digest: Union[Digest, str]) -> str:
        """Why ``digest`` stays or goes, in words."""
        d = Digest.parse(digest) if isinstance(digest, str) else digest
        h = d.hex
        if h in self._live.live:
            return "kept: " + self._live.describe(h)
        if h in self._fresh:
            return "kept: " + self._fresh_reason(h)
        if h in self._spared:
            return "kept: " + self._spared[h]
        for f in self.files:
            if f.hex == h:
                what = "an expired manifest version" if f.kind == "version" else "unreferenced"
                return (f"deleted: {what}, last written {_ago(self.created - f.mtime)} ago "
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
            f"(grace {_ago(self.grace)})" + (f", {len(self._spared)} not needed for the limit" if self._spared else ""),
        ]
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
                f"because they are pinned, referenced by heads (current or last {self.keep_history} versions) "
                f"or fresh (written within {_ago(self.grace)}); pinned and head-referenced data is never evicted "
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
        }
        if self.max_bytes is not None:
            doc.update(max_bytes=self.max_bytes, stored_bytes_after=self.stored_bytes_after, met=self.met)
            if not self.met:
                doc["message"] = self.shortfall_message()
        if objects:
            doc["delete"] = [{"digest": f"blake3:{f.hex}", "codec": f.codec, "bytes": f.size, "kind": f.kind}
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
    files, _strays = scan_objects(store.root)
    live = compute_live(store, keep_history)
    cutoff = now - g
    versions: Dict[str, List[ObjFile]] = {}
    expired_set = set(live.expired)
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
    for h in live.expired:
        if h in fresh:
            continue
        for f in versions.get(h, ()):
            planned.append(PlannedFile(f.hex, f.codec, f.path, f.size, f.mtime, "version"))
    spared: Dict[str, str] = {}
    if max_bytes is None:
        planned += [PlannedFile(f.hex, f.codec, f.path, f.size, f.mtime, "object") for f in garbage]
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
                                         f"{_ago(now - max(x.atime, x.mtime))} ago)")
                    continue
                for x in group:
                    planned.append(PlannedFile(x.hex, x.codec, x.path, x.size, x.mtime, "object"))
                    over -= x.size
        else:
            planned = []
            for f in garbage:
                spared[f.hex] = "unreferenced, but the store is already under the limit"
            for h in live.expired:
                spared.setdefault(h, "expired manifest version, but the store is already under the limit")
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


def plan_limit(store: Store, max_bytes: Union[int, str], *, keep_history: int = DEFAULT_KEEP_HISTORY,
               grace: Duration = DEFAULT_GRACE) -> GCPlan:
    """Plan evicting least-recently-used *unreferenced* objects until the store fits ``max_bytes``.

    Pinned and head-referenced objects (current and last ``keep_history``
    versions) and fresh ones are never planned; if the limit cannot be met
    without them, the plan says so (``plan.met`` is False).
    """
    return _plan(store, keep_history, grace, max_bytes=parse_size(max_bytes))


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
    for h in live.expired:
        if h in deleted:
            continue
        try:
            doc = g.doc(h, "expired history", required=False)
            if doc is None:
                continue
            for key, eh, _size in entry_items(doc, f"manifest version {h[:12]}"):
                if eh not in live.live:
                    out.setdefault(eh, f"still named by stored history version blake3:{h[:12]} (entry {key!r}), "
                                       "which this run keeps (too fresh, or expired after the plan); a later "
                                       "gc removes the version first")
        except (IntegrityError, StoreFormatError):
            continue  # a damaged expired version: verify reports it
    return out


def _restore(grave: str, path: str) -> None:
    """Put a moved-out object file back, unless a writer has meanwhile published a new copy."""
    try:
        os.link(grave, path)
    except FileExistsError:
        pass  # a fresh copy is in place: keep it
    except OSError:  # no hard link allowed (e.g. fs.protected_hardlinks on another user's file)
        if not os.path.exists(path):
            os.rename(grave, path)
            return
    os.unlink(grave)


def _execute(plan: GCPlan, *, timeout: Optional[float], progress: Optional[bool]) -> GCResult:
    store = plan.store
    t0 = time.monotonic()
    tmp = store.root / TMP
    # <pid>.<start>.<host>.<hex>.gc: swept like any dead writer's staging file if we are killed
    grave_prefix = f"{tmp}{os.sep}{process_token()}.{secrets.token_hex(4)}"
    seq = 0
    deleted: List[str] = []
    skipped: Dict[Digest, str] = {}
    freed = 0
    gone = 0
    durable = store.durable
    with gc_lock(store, timeout=timeout), \
            Progress(len(plan.files), desc="gc", unit="files", enabled=progress) as bar:
        live = compute_live(store, plan.keep_history)  # re-read every root under the lock
        cutoff = time.time() - plan.grace
        phase = "version"
        version_dirs: Set[str] = set()
        protected: Dict[str, str] = {}
        for f in plan.files:
            bar.update()
            if f.kind != phase:
                phase = f.kind
                if durable:  # expired versions are gone for good before any object they named
                    for dpath in sorted(version_dirs):
                        fsync_dir(dpath)
                protected = _surviving_history(live, set(deleted))
            if f.hex in live.live:
                skipped[Digest(f.hex)] = "now referenced: " + live.describe(f.hex)
                continue
            if f.hex in protected:
                skipped[Digest(f.hex)] = protected[f.hex]
                continue
            seq += 1
            grave = f"{grave_prefix}{seq:08x}.gc"
            try:
                os.rename(f.path, grave)
            except FileNotFoundError:
                gone += 1
                continue
            _fault("moved")
            try:
                st = os.lstat(grave)
            except FileNotFoundError:  # pragma: no cover - nobody sweeps a live process's files
                continue
            if st.st_mtime > cutoff:
                # Re-put since the plan (its mtime was refreshed before our move): put it back.
                _restore(grave, f.path)
                skipped[Digest(f.hex)] = "written again since the plan (fresh)"
                continue
            os.unlink(grave)
            freed += st.st_size
            deleted.append(f.hex)
            if f.kind == "version":
                version_dirs.add(os.path.dirname(f.path))
            _fault("deleted")
        # No sync at the end: a deletion a power loss undoes only leaves garbage behind.
        sweep_stale(tmp)  # files a killed gc left mid-move
    return GCResult(tuple(dict.fromkeys(deleted)), freed, MappingProxyType(skipped), gone, time.monotonic() - t0)


@dataclass(frozen=True)
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


def limit(store: Store, max_bytes: Union[int, str], *, keep_history: int = DEFAULT_KEEP_HISTORY,
          grace: Duration = DEFAULT_GRACE, dry_run: bool = False, timeout: Optional[float] = 600.0,
          progress: Optional[bool] = None) -> LimitResult:
    """Evict least-recently-used unreferenced objects until the store's objects fit ``max_bytes``.

    Never evicts pinned or head-referenced objects; when the limit cannot be
    met the result says so (``met`` False, ``message``).  ``dry_run`` only plans.
    """
    plan = plan_limit(store, max_bytes, keep_history=keep_history, grace=grace)
    res = None if dry_run else plan.execute(timeout=timeout, progress=progress)
    freed = plan.freed_bytes if res is None else res.freed_bytes
    after = plan.total_bytes - freed
    cap = parse_size(max_bytes)
    met = after <= cap
    msg = ""
    if not met:
        msg = plan.shortfall_message() or (
            f"limit {human_bytes(cap)} not met: {human_bytes(after)} remain because planned objects were "
            "referenced or written again while gc ran; run it again")
    return LimitResult(plan, res, cap, plan.total_bytes, after, met, msg)


# -- usage ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NameUsage:
    """Usage of one head or pin (its current version)."""

    name: str
    kind: str
    """``"pin"`` or ``"head"``."""
    version: Digest
    entries: int
    logical_bytes: int
    """Sum of the entries' sizes (a file listed twice counts twice)."""
    objects: int
    """Distinct objects, including the version itself."""
    stored_bytes: int
    """Bytes on disk of those distinct objects."""
    exclusive_bytes: int
    """Stored bytes referenced by no other head's or pin's current version."""
    missing: int
    """Entries whose object is not in the store."""


@dataclass(frozen=True)
class Usage:
    """What :func:`usage` reports about a store."""

    objects: int
    """Distinct digests stored."""
    files: int
    """Object files (a digest may be stored both raw and compressed)."""
    logical_bytes: int
    """Uncompressed bytes of the distinct objects."""
    stored_bytes: int
    """Bytes of the object files on disk."""
    compression_ratio: float
    """``logical_bytes / stored_bytes`` (1.0 for an empty store)."""
    referenced_bytes: int
    """Sum of entry sizes over every manifest version in the store reachable from a ref."""
    dedupe_savings: int
    """Bytes you would store without dedupe: ``referenced_bytes`` minus the distinct referenced objects' size."""
    unreferenced_objects: int
    """Objects not referenced by any head or pin version (current or history): what gc may collect."""
    unreferenced_bytes: int
    versions: int
    """Manifest versions reachable from heads and pins (with history)."""
    codecs: Mapping[str, int]
    by_name: Tuple[NameUsage, ...]

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        doc = {k: getattr(self, k) for k in (
            "objects", "files", "logical_bytes", "stored_bytes", "compression_ratio", "referenced_bytes",
            "dedupe_savings", "unreferenced_objects", "unreferenced_bytes", "versions")}
        doc["codecs"] = dict(self.codecs)
        doc["by_name"] = [{"name": n.name, "kind": n.kind, "version": str(n.version), "entries": n.entries,
                           "logical_bytes": n.logical_bytes, "objects": n.objects, "stored_bytes": n.stored_bytes,
                           "exclusive_bytes": n.exclusive_bytes, "missing": n.missing} for n in self.by_name]
        return doc


def _logical_size(store: Store, f: ObjFile) -> int:
    if f.codec == RAW:
        return f.size
    try:
        return store.stat(Digest(f.hex)).size
    except (IntegrityError, OSError):
        return 0  # damaged; verify reports it


def usage(store: Store) -> Usage:
    """Objects, logical and stored bytes, compression ratio, dedupe savings, and per head/pin figures.

    Reads no data object (sizes come from ``stat`` and, for compressed
    objects, their 20-byte size trailer); manifest versions are read.
    """
    files, _strays = scan_objects(store.root)
    stored: Dict[str, int] = {}
    logical: Dict[str, int] = {}
    codecs = {RAW: 0, ZSTD: 0}
    for f in files:
        stored[f.hex] = stored.get(f.hex, 0) + f.size
        codecs[f.codec] += 1
        if f.hex not in logical or f.codec == RAW:
            logical[f.hex] = _logical_size(store, f)
    heads = list_refs(store.root, "heads")
    pins = list_refs(store.root, "pins")
    g = Graph(store)
    # Every reachable version (full history that is still stored).
    referenced_bytes = 0
    referenced: Set[str] = set()
    entry_hexes: Set[str] = set()
    seen_versions: Set[str] = set()
    for name, d in [*(("pin " + k, v) for k, v in pins.items()), *(("head " + k, v) for k, v in heads.items())]:
        cur: Optional[str] = d.hex
        while cur is not None and cur not in seen_versions:
            try:
                doc = g.doc(cur, name, required=False)
            except (IntegrityError, StoreFormatError):
                doc = None
            if doc is None:
                break
            seen_versions.add(cur)
            referenced.add(cur)
            for _key, h, size in entry_items(doc, f"manifest version {cur[:12]}"):
                referenced.add(h)
                entry_hexes.add(h)
                referenced_bytes += size if size is not None else logical.get(h, 0)
            p = doc.get("parent")
            cur = p.hex() if isinstance(p, bytes) else None
    # Per name: the current version.
    per: List[Tuple[str, str, Digest, Dict[str, int], int, int, int]] = []
    counts: Dict[str, int] = {}
    for kind, refs in (("pin", pins), ("head", heads)):
        for name, d in refs.items():
            objs: Dict[str, int] = {}
            n_entries = 0
            lbytes = 0
            missing = 0
            try:
                doc = g.doc(d.hex, f"{kind} {name!r}", required=False)
            except (IntegrityError, StoreFormatError):
                doc = None
            if doc is not None:
                objs[d.hex] = 1
                for _key, h, size in entry_items(doc, f"{kind} {name!r}"):
                    n_entries += 1
                    lbytes += size if size is not None else logical.get(h, 0)
                    objs[h] = 1
                    if h not in stored:
                        missing += 1
            for h in objs:
                counts[h] = counts.get(h, 0) + 1
            per.append((name, kind, d, objs, n_entries, lbytes, missing))
    by_name = tuple(
        NameUsage(name, kind, d, n_entries, lbytes, len(objs), sum(stored.get(h, 0) for h in objs),
                  sum(stored.get(h, 0) for h in objs if counts.get(h) == 1), missing)
        for name, kind, d, objs, n_entries, lbytes, missing in per
    )
    total_logical = sum(logical.values())
    total_stored = sum(stored.values())
    entry_bytes_unique = sum(logical.get(h, 0) for h in entry_hexes)
    unref = [h for h in stored if h not in referenced]
    return Usage(
        objects=len(stored), files=len(files), logical_bytes=total_logical, stored_bytes=total_stored,
        compression_ratio=(total_logical / total_stored) if total_stored else 1.0,
        referenced_bytes=referenced_bytes, dedupe_savings=max(0, referenced_bytes - entry_bytes_unique),
        unreferenced_objects=len(unref), unreferenced_bytes=sum(stored[h] for h in unref),
        versions=len(seen_versions), codecs=MappingProxyType(codecs), by_name=by_name,
    )
