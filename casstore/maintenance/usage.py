"""Usage reports: objects, logical and stored bytes, compression, dedupe, per head and pin.

Reads no data object: sizes come from the directory scan (``lstat``) and, for
objects whose codec does not store them byte for byte, from the size the
codec records (:meth:`casstore.codecs.Codec.size_of`, the zstd trailer).
Manifest versions are read (verified) and decoded by THE manifest decoder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Set, Tuple

from ..codecs import CODECS
from ..digest import Digest
from ..errors import IntegrityError, ObjectNotFoundError, StoreFormatError
from ..objects.local import ObjFile
from ..objects.reader import open_object_file
from .graph import Graph, entry_refs

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["Usage", "NameUsage", "usage"]


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
    """Stored bytes referenced by no other head's or pin's current version."""
    missing: int
    """Entries whose object is not in the store."""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"name": self.name, "kind": self.kind, "version": str(self.version), "entries": self.entries,
                "logical_bytes": self.logical_bytes, "objects": self.objects, "stored_bytes": self.stored_bytes,
                "exclusive_bytes": self.exclusive_bytes, "missing": self.missing}


@dataclass(frozen=True, slots=True)
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
    """Object files per codec name (``"raw"``, ``"zstd"``)."""
    by_name: Tuple[NameUsage, ...]

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        doc: Dict[str, Any] = {k: getattr(self, k) for k in (
            "objects", "files", "logical_bytes", "stored_bytes", "compression_ratio", "referenced_bytes",
            "dedupe_savings", "unreferenced_objects", "unreferenced_bytes", "versions")}
        doc["codecs"] = dict(self.codecs)
        doc["by_name"] = [n.to_dict() for n in self.by_name]
        return doc


def _logical_size(f: ObjFile) -> int:
    """The uncompressed size one object file records (0 if it records none: verify reports it)."""
    if f.codec.byte_exact:
        return f.size
    try:
        # Opened without following links or blocking: the file may have been swapped since the scan.
        fd, st = open_object_file(f.path, f.digest)
    except (IntegrityError, ObjectNotFoundError, OSError):
        return 0  # planted over or removed meanwhile
    try:
        return f.codec.size_of(fd, st.st_size) or 0  # the recorded size; nothing is decoded
    except OSError:
        return 0
    finally:
        os.close(fd)


def usage(store: Store) -> Usage:
    """Objects, logical and stored bytes, compression ratio, dedupe savings, and per head/pin figures.

    Reads no data object (sizes come from ``stat`` and, for compressed
    objects, their recorded size); manifest versions are read.
    """
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
    heads = store.refs.list("heads")
    pins = store.refs.list("pins")
    g = Graph(objects)
    # Every reachable version (full history that is still stored).
    referenced_bytes = 0
    referenced: Set[str] = set()
    entry_hexes: Set[str] = set()
    seen_versions: Set[Digest] = set()
    for name, d in [*(("pin " + k, v) for k, v in pins.items()), *(("head " + k, v) for k, v in heads.items())]:
        cur: Optional[Digest] = d
        while cur is not None and cur not in seen_versions:
            try:
                doc = g.doc(cur, name, required=False)
            except (IntegrityError, StoreFormatError):
                doc = None  # verify reports it; usage counts what it can read
            if doc is None:
                break
            seen_versions.add(cur)
            referenced.add(cur.hex)
            for _key, h, size in entry_refs(doc):
                referenced.add(h)
                entry_hexes.add(h)
                referenced_bytes += size if size is not None else logical.get(h, 0)
            cur = doc.parent
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
                doc = g.doc(d, f"{kind} {name!r}", required=False)
            except (IntegrityError, StoreFormatError):
                doc = None
            if doc is not None:
                objs[d.hex] = 1
                for _key, h, size in entry_refs(doc):
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
