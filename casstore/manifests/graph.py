"""The reference graph: manifest versions reachable from heads and pins, and what they keep alive.

In the manifests layer because two features judge reachability with it: local
maintenance (gc, usage, verify over ``store.objects``/``store.refs``) and remote
gc (:mod:`casstore.sync.remote_gc`, over a remote's ``objects``/``refs``); it
needs only the ObjectStore and RefStore protocols.

Every manifest version is read through the object layer (verified) and decoded
by THE manifest decoder (:func:`casstore.manifests.model.load_manifest`), so
gc, usage and verify judge exactly the entries every other reader sees.  The
only exception is the parent link of an *expired* version (outside every
kept window): :func:`casstore.manifests.model.read_parent` reads it without
verifying or decoding the rest, because a damaged expired version must end
the history walk, not stop gc (it references nothing gc keeps).

Hazard: a version a root needs that is missing, corrupt or undecodable means
what it references is unknown, so nothing can be judged unreferenced; the
loader raises (typed, saying what to do) instead of guessing.

Provenance (docs/maintenance.md, "Provenance"): the inputs a pin or a head's
current version records in ``meta["casstore.inputs"]`` are kept too,
transitively through manifest inputs.  That metadata is hostile: a malformed
record, or an input "manifest" that is missing, damaged, huge or not a
manifest, keeps nothing extra and adds a warning; it never raises, and it
never makes anything a root references collectable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set, Tuple

from ..digest import Digest
from ..errors import (
    CasstoreError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    MissingNodeError,
    ObjectNotFoundError,
    StoreFormatError,
)
from ..objects.base import ObjectStore
from ..refs.base import RefStore
from .model import ManifestDoc, SeenNodes, load_manifest, read_parent, refuse_big_non_manifest, walk_tree
from .provenance import read_provenance

__all__ = ["Graph", "Live", "compute_live", "entry_refs", "version_refs", "MAX_INPUT_VERSION_BYTES"]

MAX_INPUT_VERSION_BYTES = 256 << 20
"""A provenance "manifest" input larger than this is not read (hostile metadata may name a 100 GB data
object as a manifest; a real 1,000,000-entry version is ~80 MB)."""


def entry_refs(doc: ManifestDoc) -> Iterator[Tuple[str, str, Optional[int]]]:
    """``(key, digest hex, size)`` of every entry of a decoded version: all a maintenance pass needs.

    The one place maintenance iterates entries; no Entry or Digest is made per
    entry (that doubled a plan's time on 100,000-entry versions).
    """
    return doc.entries.hex_items()


def version_refs(doc: ManifestDoc, seen: SeenNodes) -> Iterator[Tuple[str, str, Optional[int]]]:
    """Everything version ``doc`` keeps alive besides itself: ``(key, hex, size)`` of its entries and
    ``("", hex, None)`` of each node object of a tree-shaped version.

    Nodes in ``seen`` are skipped with their whole subtree, and visited ones are
    added: 100 versions sharing 99% of their nodes cost about one version plus
    the changed paths, not 100 full walks.  A flat version yields its entries.
    """
    return walk_tree(doc.entries, seen)


class Graph:
    """Manifest versions of one object store, each read and decoded at most once."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        """Where the versions are read from."""
        self._docs: Dict[Digest, ManifestDoc] = {}
        self.seen_nodes: SeenNodes = {}
        """Tree nodes already walked (:func:`version_refs`): each shared node is visited once."""
        self.missing_trees: Dict[Digest, str] = {}
        """Versions read here whose object is present but whose tree's root node (or bundle) is not:
        version -> that object's hex (``verify`` reports it missing)."""

    def doc(self, d: Digest, where: str, *, required: bool) -> Optional[ManifestDoc]:
        """The decoded, hash-verified version ``d``; ``None`` if it is missing and not ``required``.

        A missing required version, or a corrupt or undecodable one, raises
        (:class:`ObjectNotFoundError`, :class:`IntegrityError`,
        :class:`StoreFormatError`): what it references is unknown, so nothing
        can be judged unreferenced.  ``where`` names who needs it (for messages).
        """
        doc = self._docs.get(d)
        if doc is not None:
            return doc
        try:
            doc = load_manifest(self.objects, d)  # verified read, then THE decoder
        except MissingNodeError as e:
            # The version is here, an object of its tree is not (the root's node or bundle is read when
            # the version is opened): not "the version is missing".  History behind a root ends there
            # (verify reports it); a root's own version stops gc, as a damaged one does.
            self.missing_trees[d] = e.digest
            if not required:
                return None
            raise MissingNodeError(f"{where}: {e}; gc cannot tell what the version references, so it stops",
                                   e.digest) from None
        except ObjectNotFoundError:
            if not required:
                return None
            raise ObjectNotFoundError(
                f"{where} points to manifest version {d}, which is missing from the store, so what it "
                "references is unknown and nothing can be collected safely; restore the version (fetch it "
                "from a remote), or re-point or remove that ref, then run gc again"
            ) from None
        except IntegrityError:
            # Also a planted FIFO, directory or symlink at the version's path (never opened).
            raise IntegrityError(
                f"manifest version {d} ({where}) is corrupt, so what it references is unknown and nothing can "
                "be collected safely; run `casstore verify --repair` (it moves the damaged version to bad/), "
                "then gc again"
            ) from None
        except StoreFormatError as e:
            # (Only a root's own version stops gc: history behind a root ends at an unreadable version,
            # as at a missing one; saying "it stops" there was wrong, found by a bug hunt.)
            stops = "; gc cannot tell what it references, so it stops" if required else ""
            raise StoreFormatError(f"{e} ({where}){stops}") from None
        self._docs[d] = doc
        return doc

    def parent_of(self, d: Digest) -> Optional[Digest]:
        """Parent link of a version that may be expired, damaged or missing (never raises)."""
        doc = self._docs.get(d)
        if doc is not None:
            return doc.parent
        try:
            # A parent link names anything its writer chose.  Hazard (found by a bug hunt): a pinned
            # version whose parent is 400 MiB of zeros stored compressed took gc's plan and verify to
            # 850 MB; a big object that does not begin as a version has no parent link.
            refuse_big_non_manifest(self.objects, d)
            # Unverified on purpose: an expired version is only walked through, never trusted
            # for what it keeps; its bytes are hashed when a root needs it (doc()).
            data = self.objects.read(d, verify=False)
        except (ObjectNotFoundError, IntegrityError, StoreFormatError, OSError):
            return None
        return read_parent(data)


@dataclass
class Live:
    """The roots' closure: which objects are live and why (built by :func:`compute_live`)."""

    wheres: List[str] = field(default_factory=list)
    """Who holds something: ``"pin 'paper'"``, ``"head 'exp', 2 versions back"``..."""
    live: Dict[str, Tuple[int, Optional[str]]] = field(default_factory=dict)
    """hex -> (index into ``wheres``, entry key, "" for the version object itself, or ``None`` when
    the where names the object directly: an object input of a derive result)."""
    expired: List[Digest] = field(default_factory=list)
    """Expired versions (reachable by parent links, outside every root), newest first per chain."""
    roots: Dict[str, Digest] = field(default_factory=dict)
    """``"pin:<name>"`` / ``"head:<name>"`` -> version digest."""
    graph: Optional[Graph] = None
    """The loader that read the versions (reused to read expired history)."""
    warnings: List[str] = field(default_factory=list)
    """Malformed or unreadable provenance records (each kept nothing extra)."""

    def describe(self, hexd: str) -> str:
        """Why ``hexd`` is live, in words."""
        w, key = self.live[hexd]
        if key is None:
            return self.wheres[w]
        return f"entry {key!r} of {self.wheres[w]}" if key else f"manifest version of {self.wheres[w]}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _input_version(g: Graph, d: Digest, where: str, warnings: List[str]) -> Optional[ManifestDoc]:
    """The decoded input version ``d``, or ``None`` (missing, or unreadable: then a warning)."""
    try:
        size = g.objects.stat(d).size
    except ObjectNotFoundError:
        return None  # collected before it was recorded, or a result pulled without its inputs
    except (CasstoreError, OSError) as e:
        warnings.append(f"{where} names {d}, which cannot be read ({type(e).__name__}); nothing it "
                        "references is kept for it -- `casstore verify` reports damage")
        return None
    if size > MAX_INPUT_VERSION_BYTES:
        warnings.append(f"{where} names {d} as a manifest version, but it is {size} bytes (more than "
                        f"{MAX_INPUT_VERSION_BYTES}); not read, and nothing it references is kept for it")
        return None
    try:
        return g.doc(d, where, required=False)
    except (CasstoreError, OSError) as e:
        warnings.append(f"{where} names {d} as a manifest version, but it is corrupt or not a manifest "
                        f"({type(e).__name__}); it is kept as it is, nothing it references is kept for it "
                        "-- `casstore verify` reports damage")
        return None


def _keep_inputs(g: Graph, out: Live, todo: List[Tuple[Digest, ManifestDoc, str]],
                 frontier: List[Optional[Digest]]) -> None:
    """Keep the provenance inputs of ``todo`` (version, doc, who) alive, transitively through manifest inputs.

    Runs after every root's own entries are in ``out.live``, so an object a
    root names directly is described as that root's entry.  Each version's
    record is expanded once (a hostile record may name a cycle).
    """
    live = out.live
    expanded: Set[Digest] = set()
    i = 0
    while i < len(todo):
        d, doc, origin = todo[i]
        i += 1
        if d in expanded:
            continue
        expanded.add(d)
        prov = read_provenance(doc.meta)
        for problem in prov.problems:
            out.warnings.append(f"{origin}: {problem}; nothing extra is kept for it")
        for inp in prov.inputs:
            label = f"input {_short(inp.name)} of {origin}"
            w = len(out.wheres)
            out.wheres.append(f"{label} (derive provenance)")
            if not inp.manifest:
                live.setdefault(inp.digest.hex, (w, None))
                continue
            live.setdefault(inp.digest.hex, (w, ""))
            sub = _input_version(g, inp.digest, out.wheres[w], out.warnings)
            if sub is None:
                continue
            try:
                for key, h, _size in version_refs(sub, g.seen_nodes):
                    if h not in live:
                        live[h] = (w, key)
            except (CasstoreError, OSError) as e:  # a tree node of the input is missing or damaged
                out.warnings.append(f"{out.wheres[w]}: a tree node of {inp.digest} cannot be read "
                                    f"({type(e).__name__}); what it references is not kept for it "
                                    "-- `casstore verify` reports damage")
                continue
            todo.append((inp.digest, sub, label))
            # Its older versions are history like any head's: deleted as expired versions, first.
            frontier.append(g.parent_of(inp.digest))


def compute_live(objects: ObjectStore, refs: RefStore, keep_history: int) -> Live:
    """Read every ref and return the closure of the roots (see :mod:`casstore.maintenance.gc`)."""
    if isinstance(keep_history, bool) or not isinstance(keep_history, int):
        raise InvalidTypeError(f"keep_history must be an int (versions kept behind each head), "
                               f"not {type(keep_history).__name__}")
    if keep_history < 0:
        raise InvalidInputError(f"keep_history must not be negative, not {keep_history!r}")
    g = Graph(objects)
    out = Live(graph=g)
    # Heads before pins: freeze writes the pin before removing the head, so a
    # name being frozen right now is seen at least once.
    heads = refs.list("heads")
    pins = refs.list("pins")
    frontier: List[Optional[Digest]] = []
    provenance: List[Tuple[Digest, ManifestDoc, str]] = []  # pins and heads' current versions

    def add_version(d: Digest, where: str, required: bool) -> Optional[ManifestDoc]:
        doc = g.doc(d, where, required=required)
        if doc is None:
            return None
        w = len(out.wheres)
        out.wheres.append(where)
        live = out.live
        live.setdefault(d.hex, (w, ""))
        # Entries and tree nodes; a node another version already walked is skipped with its subtree
        # (what it keeps is live already), so history sharing most nodes costs only the changed paths.
        for key, h, _size in version_refs(doc, g.seen_nodes):
            if h not in live:
                live[h] = (w, key)
        return doc

    for name, d in pins.items():
        out.roots[f"pin:{name}"] = d
        doc = add_version(d, f"pin {name!r}", True)
        if doc is not None:
            provenance.append((d, doc, f"pinned {name!r}"))
        frontier.append(g.parent_of(d))
    for name, d in heads.items():
        out.roots[f"head:{name}"] = d
        cur: Optional[Digest] = d
        for i in range(keep_history + 1):
            assert cur is not None
            where = f"head {name!r}" if i == 0 else f"head {name!r}, {i} version{'s' if i > 1 else ''} back"
            doc = add_version(cur, where, i == 0)
            if doc is None:
                cur = None  # collected earlier (keep_history was lower then)
                break
            if i == 0:  # the current version's inputs only: history keeps its entries, not its inputs
                provenance.append((cur, doc, f"head {name!r}"))
            cur = g.parent_of(cur)
            if cur is None:
                break
        frontier.append(cur)
    _keep_inputs(g, out, provenance, frontier)
    # Expired history: every version reachable through parent links beyond the
    # kept windows.  They are deleted first, newest first, so the chain is cut
    # before any object only they reference disappears.
    seen: Set[Digest] = set()
    for start in frontier:
        c = start
        while c is not None and c not in seen:
            seen.add(c)
            if c.hex not in out.live:
                out.expired.append(c)
            c = g.parent_of(c)
    return out
