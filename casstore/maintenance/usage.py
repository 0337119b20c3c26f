"""Usage reports: objects, logical and stored bytes, compression, dedupe, per head and pin.

Reads no data object: sizes come from the directory scan (``lstat``) and, for
objects whose codec does not store them byte for byte, from the size the
codec records (:meth:`casstore.codecs.Codec.size_of`, the zstd trailer).
Manifest versions are read (verified) and decoded by THE manifest decoder.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from ..codecs import CODECS
from ..digest import Digest
from ..errors import (
    IntegrityError,
    InvalidTypeError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    StoreFormatError,
)
from ..manifests.graph import Graph, entry_refs, version_refs
from ..manifests.model import ManifestDoc, SeenNodes
from ..objects.local import ObjFile
from ..objects.reader import open_object_file

_DAMAGE = (IntegrityError, StoreFormatError, ObjectNotFoundError)  # a tree node missing or damaged

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["Usage", "NameUsage", "Share", "usage"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Share:
    """What one live name shares with another (see :attr:`NameUsage.shared_with`)."""

    name: str
    kind: str
    """``"pin"`` or ``"head"``."""
    objects: int
    """Distinct objects both names' current versions reference."""
    stored_bytes: int
    """Bytes on disk of those objects."""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"name": self.name, "kind": self.kind, "objects": self.objects, "stored_bytes": self.stored_bytes}


@dataclass(frozen=True, slots=True)
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
    """Stored bytes referenced by no other head's or pin's current version: what removing this name frees."""
    missing: int
    """Entries whose object is not in the store."""
    shared_bytes: int = 0
    """``stored_bytes - exclusive_bytes``: stored bytes another live name references too."""
    shared_with: Tuple[Share, ...] = ()
    """Per other live name, what both reference; filled only for names asked for (``usage(shares=...)``)."""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"name": self.name, "kind": self.kind, "version": str(self.version), "entries": self.entries,
                "logical_bytes": self.logical_bytes, "objects": self.objects, "stored_bytes": self.stored_bytes,
                "exclusive_bytes": self.exclusive_bytes, "shared_bytes": self.shared_bytes,
                "missing": self.missing, "shared_with": [s.to_dict() for s in self.shared_with]}


@dataclass(frozen=True, slots=True)
class Usage:
    """What :func:`usage` reports about a store (docs/maintenance.md, "Usage")."""

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
    """Sum of entry sizes over every stored manifest version reachable from a ref (current and history,
    each version once). Not the dedupe baseline: history is not a copy you would otherwise store."""
    dedupe_savings: int
    """``live_logical_bytes - live_unique_bytes``: what dedupe saves for the live names. (Earlier releases
    used ``referenced_bytes``, so every history version counted as savings.)"""
    unreferenced_objects: int
    """Objects not referenced by any head or pin version (current or history): what gc may collect."""
    unreferenced_bytes: int
    versions: int
    """Manifest versions reachable from heads and pins (with history)."""
    codecs: Mapping[str, int]
    """Object files per codec name (``"raw"``, ``"zstd"``)."""
    by_name: Tuple[NameUsage, ...]
    live_logical_bytes: int = 0
    """Entry sizes summed over every live name (each head's current version and each pin), counted once
    per reference: what the live names would take as plain files."""
    live_objects: int = 0
    """Distinct data objects the live names reference (manifest versions not included)."""
    live_unique_bytes: int = 0
    """Uncompressed size of those distinct objects, each once."""
    live_stored_bytes: int = 0
    """Bytes on disk of those distinct objects (every file of a digest)."""
    live_missing: int = 0
    """Distinct objects live names reference that are not stored (counted in logical, not stored, bytes)."""
    live_manifest_bytes: int = 0
    """Bytes on disk of the live names' current versions (the manifests themselves: version objects, and
    the tree nodes or node bundles of tree-shaped ones)."""
    dedupe_ratio: float = 1.0
    """``live_logical_bytes / live_unique_bytes``: dedupe alone (1.0 when nothing is live)."""
    reduction_ratio: float = 1.0
    """``live_logical_bytes / live_stored_bytes``: dedupe and compression together."""
    history_versions: int = 0
    """Stored versions behind the live ones (reachable by parent links, not any name's current version)."""
    history_logical_bytes: int = 0
    """Entry sizes summed over those history versions."""
    history_objects: int = 0
    """Objects (history versions included) that only history references."""
    history_stored_bytes: int = 0
    """Bytes on disk of those objects: what dropping all history would free."""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        doc: Dict[str, Any] = {k: getattr(self, k) for k in (
            "objects", "files", "logical_bytes", "stored_bytes", "compression_ratio", "referenced_bytes",
            "dedupe_savings", "unreferenced_objects", "unreferenced_bytes", "versions")}
        doc["live"] = {"logical_bytes": self.live_logical_bytes, "objects": self.live_objects,
                       "unique_bytes": self.live_unique_bytes, "stored_bytes": self.live_stored_bytes,
                       "missing": self.live_missing, "manifest_bytes": self.live_manifest_bytes,
                       "dedupe_savings": self.dedupe_savings, "dedupe_ratio": self.dedupe_ratio,
                       "reduction_ratio": self.reduction_ratio}
        doc["history"] = {"versions": self.history_versions, "logical_bytes": self.history_logical_bytes,
                          "objects": self.history_objects, "stored_bytes": self.history_stored_bytes}
        doc["codecs"] = dict(self.codecs)
        doc["by_name"] = [n.to_dict() for n in self.by_name]
        return doc


def _logical_size(f: ObjFile) -> int:
    """The uncompressed size one object file records (0 if it records none: verify reports it)."""
    if f.codec.byte_exact:
        return f.size
    try:
        # Opened without following links or blocking: the file may have been swapped since the scan.
        fd, st = open_object_file(f.path, f.digest, noatime=True)
    except (IntegrityError, ObjectNotFoundError, OSError):
        return 0  # planted over or removed meanwhile
    try:
        return f.codec.size_of(fd, st.st_size) or 0  # the recorded size; nothing is decoded
    except OSError:
        return 0
    finally:
        os.close(fd)


def usage(store: Store, *, shares: Iterable[str] = ()) -> Usage:
    """Objects, logical and stored bytes, compression, honest dedupe, history, and per head/pin figures.

    Live names are the heads' current versions and the pins; history is the
    stored versions behind them.  ``shares``: names (pin or head) whose
    :attr:`NameUsage.shared_with` is filled; an unknown one raises
    :class:`ManifestNotFoundError`.  Reads no data object (sizes come from
    ``stat`` and, for compressed objects, their recorded size); manifest
    versions are read.
    """
    if isinstance(shares, str):
        raise InvalidTypeError("shares must be a list of names, not one string: shares=[name]")
    wanted = list(shares)
    for w in wanted:
        if not isinstance(w, str):
            raise InvalidTypeError(f"shares must list names (str), got {type(w).__name__}")
    objects = store.objects
    files, _strays = objects.scan()  # strays (planted links, FIFOs, foreign names) are not objects
    stored: Dict[str, int] = {}
    logical: Dict[str, int] = {}
    codecs = {c.name: 0 for c in CODECS}
    for f in files:
        stored[f.hex] = stored.get(f.hex, 0) + f.size
        codecs[f.codec.name] += 1
        if f.hex not in logical or f.codec.byte_exact:
            logical[f.hex] = _logical_size(f)
    heads = store.refs.readable("heads", "counted")  # (verify reports a damaged one)
    pins = store.refs.readable("pins", "counted")
    unknown = [w for w in wanted if w not in heads and w not in pins]
    if unknown:
        raise ManifestNotFoundError(f"no head or pin named {unknown[0]!r}; `casstore ls` lists the names")
    g = Graph(objects)

    unreadable: Set[Digest] = set()

    def read(d: Digest, where: str) -> Optional[ManifestDoc]:
        try:
            return g.doc(d, where, required=False)
        except (IntegrityError, StoreFormatError) as e:
            if d in unreadable:
                return None
            unreadable.add(d)
            # Hazard (found by a bug hunt): a pin whose version was corrupt showed 0 entries, and its
            # data "unreferenced (see `casstore gc`)", without a word.  Counted as it is, and said.
            log.warning("%s: its version %s cannot be read (%s); what it holds is counted as unreferenced "
                        "here -- run `casstore verify` (gc refuses to run until it is fixed)", where, d,
                        str(e).split(";")[0])
            return None

    # Live names: each head's current version and each pin, once per name (a reference).
    per: List[Tuple[str, str, Digest, Dict[str, int], int, int, int]] = []
    counts: Dict[str, int] = {}
    live_versions: Set[Digest] = set()
    live_entry: Dict[str, int] = {}  # hex -> the size an entry records (for a missing object)
    live_nodes: Set[str] = set()  # tree node objects and bundles of the live versions
    live_logical = 0
    for kind, refs in (("pin", pins), ("head", heads)):
        for name, d in refs.items():
            live_versions.add(d)
            objs: Dict[str, int] = {}
            n_entries = lbytes = missing = 0
            doc = read(d, f"{kind} {name!r}")
            if doc is not None:
                objs[d.hex] = 1
                try:
                    for key, h, size in version_refs(doc, {}):
                        objs[h] = 1
                        if not key:  # a tree node: stored bytes of this name, no entry, no logical bytes
                            live_nodes.add(h)
                            continue
                        n_entries += 1
                        sz = size if size is not None else logical.get(h, 0)
                        lbytes += sz
                        live_entry.setdefault(h, sz)
                        if h not in stored:
                            missing += 1
                except _DAMAGE as e:  # a missing or damaged tree node: verify reports it; usage counts what it read
                    log.warning("%s %r: part of version %s cannot be read (%s); its counts here are partial "
                                "-- run `casstore verify`", kind, name, d, str(e).split(";")[0])
            live_logical += lbytes
            for h in objs:
                counts[h] = counts.get(h, 0) + 1
            per.append((name, kind, d, objs, n_entries, lbytes, missing))
    # Every reachable version (the full history that is still stored).
    referenced_bytes = 0
    referenced: Set[str] = set()
    seen_versions: Set[Digest] = set()
    hist_nodes: SeenNodes = {}
    history_logical = 0
    for name, d in [*(("pin " + k, v) for k, v in pins.items()), *(("head " + k, v) for k, v in heads.items())]:
        cur: Optional[Digest] = d
        while cur is not None and cur not in seen_versions:
            doc = read(cur, name)
            if doc is None:
                break
            seen_versions.add(cur)
            referenced.add(cur.hex)
            vbytes = 0
            head = doc.entries.tree_header()
            if head is not None:
                # Tree-shaped: nodes shared with versions already counted are skipped with their
                # subtrees (100 versions of a 1M-entry tree must not cost 100 full walks); the
                # version's logical bytes come from its recorded total (entries of unknown size count 0).
                try:
                    for _key, h, _size in version_refs(doc, hist_nodes):
                        referenced.add(h)
                except _DAMAGE:
                    pass  # verify reports it; usage counts what it can read
                vbytes = head[3]
            else:
                for _key, h, size in entry_refs(doc):
                    referenced.add(h)
                    vbytes += size if size is not None else logical.get(h, 0)
            referenced_bytes += vbytes
            if cur not in live_versions:
                history_logical += vbytes
            cur = doc.parent
    share_rows = _shares(per, counts, stored, set(wanted))
    rows: List[NameUsage] = []
    for i, (name, kind, d, objs, n_entries, lbytes, missing) in enumerate(per):
        sbytes = sum(stored.get(h, 0) for h in objs)
        excl = sum(stored.get(h, 0) for h in objs if counts.get(h) == 1)
        rows.append(NameUsage(name, kind, d, n_entries, lbytes, len(objs), sbytes, excl, missing,
                              sbytes - excl, share_rows.get(i, ())))
    by_name = tuple(rows)
    live_hexes = set(live_entry)
    live_unique = sum(logical[h] if h in logical else live_entry[h] for h in live_hexes)
    live_stored = sum(stored.get(h, 0) for h in live_hexes)
    # (A live version's tree nodes are its manifest too.  Found when nodes moved into bundles: they were
    # counted as kept "only by history", 413 KiB of a 6,000-file folder's two versions, all of it live.)
    live_manifests = {d.hex for d in live_versions} | live_nodes
    history_only = [h for h in referenced if h not in live_hexes and h not in live_manifests and h in stored]
    total_logical = sum(logical.values())
    total_stored = sum(stored.values())
    unref = [h for h in stored if h not in referenced]
    return Usage(
        objects=len(stored), files=len(files), logical_bytes=total_logical, stored_bytes=total_stored,
        compression_ratio=(total_logical / total_stored) if total_stored else 1.0,
        referenced_bytes=referenced_bytes, dedupe_savings=max(0, live_logical - live_unique),
        unreferenced_objects=len(unref), unreferenced_bytes=sum(stored[h] for h in unref),
        versions=len(seen_versions), codecs=MappingProxyType(codecs), by_name=by_name,
        live_logical_bytes=live_logical, live_objects=len(live_hexes), live_unique_bytes=live_unique,
        live_stored_bytes=live_stored, live_missing=sum(1 for h in live_hexes if h not in stored),
        live_manifest_bytes=sum(stored.get(h, 0) for h in live_manifests),
        dedupe_ratio=(live_logical / live_unique) if live_unique else 1.0,
        reduction_ratio=(live_logical / live_stored) if live_stored else 1.0,
        history_versions=len(seen_versions - live_versions), history_logical_bytes=history_logical,
        history_objects=len(history_only), history_stored_bytes=sum(stored[h] for h in history_only),
    )


def _shares(per: List[Tuple[str, str, Digest, Dict[str, int], int, int, int]], counts: Dict[str, int],
            stored: Dict[str, int], wanted: Set[str]) -> Dict[int, Tuple[Share, ...]]:
    """Per row of a wanted name: what it shares with each other live name.

    Only objects of wanted names that another name also references are indexed
    (an index of every object's owners costs names x objects on big stores).
    """
    rows = [i for i, p in enumerate(per) if p[0] in wanted]
    if not rows:
        return {}
    shared = {h for i in rows for h in per[i][3] if counts.get(h, 0) > 1}
    owners: Dict[str, List[int]] = {}
    for j, p in enumerate(per):
        for h in p[3]:
            if h in shared:
                owners.setdefault(h, []).append(j)
    out: Dict[int, Tuple[Share, ...]] = {}
    for i in rows:
        acc: Dict[int, List[int]] = {}  # other row -> [objects, stored bytes]
        for h in per[i][3]:
            for j in owners.get(h, ()):
                if j != i:
                    a = acc.setdefault(j, [0, 0])
                    a[0] += 1
                    a[1] += stored.get(h, 0)
        out[i] = tuple(sorted((Share(per[j][0], per[j][1], n, b) for j, (n, b) in acc.items()),
                              key=lambda s: (-s.stored_bytes, s.kind, s.name)))
    return out
