"""Version history walks and the three-way merge of two manifest versions (what a pull does to a diverged head).

Every version is read through THE manifest decoder
(:func:`casstore.manifests.model.load_manifest`: a verified read, every key
and entry validated), so a merge never sees a hostile key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Set, TypeVar

import msgpack

from ..digest import Digest
from ..errors import InvalidInputError, RemoteConflictError
from ..manifests.model import Entry, ManifestDoc, load_manifest, put_version
from ..objects.base import ObjectStore

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["local_chain", "is_ancestor", "merge_versions"]

V = TypeVar("V")


def local_chain(objects: ObjectStore, d: Digest) -> List[Digest]:
    """``d`` and its ancestors, newest first, as far as they are in ``objects``."""
    out: List[Digest] = []
    seen: Set[Digest] = set()
    cur: Optional[Digest] = d
    while cur is not None and cur not in seen and objects.has(cur):
        out.append(cur)
        seen.add(cur)
        cur = load_manifest(objects, cur).parent
    return out


def is_ancestor(objects: ObjectStore, a: Digest, *, of: Digest) -> bool:
    """Whether version ``a`` is ``of`` or one of its ancestors present in ``objects``."""
    return a in local_chain(objects, of)


def _packed(v: object) -> bytes:
    # Compared packed, not with ==: 1, 1.0 and True are equal in Python but different values in a manifest.
    out: bytes = msgpack.packb(v, use_bin_type=True)
    return out


def _entry_form(e: Entry) -> bytes:
    return _packed([e.digest.raw, e.size, dict(e.meta)])


def merge_versions(store: Store, ours: Digest, theirs: Digest, *, prefer: Optional[str] = None) -> Digest:
    """Three-way merge of two manifest versions; returns the new version's digest (no ref moves).

    The base is the newest version in ``ours``'s history that is also in
    ``theirs``'s.  A key (entry or metadata) changed on one side only takes
    that side's value; changed on both sides to different values is a
    conflict: :class:`RemoteConflictError` listing the keys, unless
    ``prefer="ours"`` or ``"theirs"`` picks a side.  The merged version's
    parent is ``theirs``, so pushing it afterwards is a fast-forward
    (rebase-style: the local versions after the base drop out of history).
    """
    if prefer not in (None, "ours", "theirs"):
        raise InvalidInputError(f"prefer must be None, 'ours' or 'theirs', not {prefer!r}")
    objects = store.objects
    tset = set(local_chain(objects, theirs))
    base: Optional[Digest] = next((v for v in local_chain(objects, ours) if v in tset), None)
    o, t = load_manifest(objects, ours), load_manifest(objects, theirs)
    b = load_manifest(objects, base) if base is not None else None
    conflicts: List[str] = []

    def merge_map(bm: Mapping[str, V], om: Mapping[str, V], tm: Mapping[str, V], what: str,
                  form: Callable[[V], bytes]) -> Dict[str, V]:
        out: Dict[str, V] = {}
        for k in sorted(set(bm) | set(om) | set(tm)):
            bp, op, tp = (form(m[k]) if k in m else None for m in (bm, om, tm))
            if op == tp or tp == bp:
                src = om
            elif op == bp:
                src = tm
            elif prefer is not None:
                src = om if prefer == "ours" else tm
            else:
                conflicts.append(f"{what}{k!r}")
                continue
            if k in src:
                out[k] = src[k]
        return out

    empty_entries: Mapping[str, Entry] = {}
    empty_meta: Mapping[str, Any] = {}
    entries = merge_map(b.entries if b else empty_entries, o.entries, t.entries, "", _entry_form)
    meta = merge_map(b.meta if b else empty_meta, o.meta, t.meta, "meta ", _packed)
    if conflicts:
        shown = ", ".join(conflicts[:10]) + (", ..." if len(conflicts) > 10 else "")
        raise RemoteConflictError(
            f"cannot merge {ours} (local) with {theirs} (remote): both changed {len(conflicts)} key(s) "
            f"differently since {base or 'the empty manifest'}: {shown}; pull with merge='ours' or "
            "merge='theirs' to pick a side, or edit the local head to agree and pull again"
        )
    return put_version(store.objects, ManifestDoc.build(entries, meta, theirs))
