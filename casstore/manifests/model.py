"""The manifest model, and THE manifest decoder every reader goes through.

A manifest *version* is an ordinary object (docs/format.md, "Manifest versions"):
canonical msgpack of ``{"casstore": "manifest", "entries": {key: [digest,
size, meta?]}, "meta": {...}, "parent": digest | nil, "v": 1}``.  Same
entries, metadata and parent -> same bytes -> same digest, in any process.

Hazards this module is built around (issues 10 and 11):

* Manifest bytes come from anywhere: a shared store any member can write, a
  remote that can lie, a hand-made object.  :func:`decode_manifest` is the only
  place manifest msgpack is unpacked, and it validates *everything* before a
  caller sees a key: every key with :func:`validate_key` (a key becomes a path
  under a checkout or a derive work directory, so ``..``, absolute paths, empty
  or ``.`` segments, NUL, backslashes and control characters would write
  outside the target or forge terminal output), every entry (a 32-byte
  digest, a size that is ``None`` or a non-negative int and never a bool, a
  str-keyed metadata map) and all metadata (only msgpack's own types, nested at
  most :data:`MAX_META_DEPTH` deep).  Anything else is a
  :class:`~casstore.errors.StoreFormatError` naming the version and the key.
* Hostile sizes: msgpack length headers are bounded by the input's length, so
  a 10-byte object claiming a 2 GiB array allocates nothing, and memory stays
  within a constant factor of the input's length (msgpack's worst case is one
  empty map, a Python dict, per input byte; about 150x here, metadata being
  copied once in canonical form).  Nesting is bounded by msgpack's stack and
  then by :data:`MAX_META_DEPTH`; nothing here recurses deeper than that (no
  ``RecursionError`` from any input).
* Metadata given by callers (edits, entries, derive params) goes through
  :func:`canonical_meta`: cyclic, too deep, non-msgpack values (sets, objects)
  and strings that are not valid Unicode (lone surrogates) are refused with
  :class:`~casstore.errors.InvalidInputError` at the call that introduced them.
  Floats are carried exactly, NaN and infinities included.
* Speed: a 100,000-entry version must open about as fast as ``msgpack.unpackb``
  of its bytes.  Keys are checked in bulk with C-level string operations (a
  prefilter that only ever passes keys :func:`validate_key` accepts; anything
  it cannot vouch for is checked one by one, and the exact check has the last
  word); entries stay in their encoded form and become :class:`Entry` objects
  on access; and a version already validated in this process (same digest,
  bytes re-hashed by the verified read) is not validated again.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    ItemsView,
    Iterable,
    Iterator,
    List,
    Mapping,
    NoReturn,
    Optional,
    Protocol,
    Sequence,
    Set,
    Tuple,
    TypeVar,
    Union,
    ValuesView,
)

import msgpack

from .._paths import BAD_CHAR, MAX_KEY_BYTES, MAX_SEGMENT_BYTES, MAX_SEGMENTS, key_problem, validate_key
from ..digest import Digest, hash_bytes, hash_raw
from ..errors import InvalidInputError, InvalidTypeError, MissingNodeError, ObjectNotFoundError, StoreFormatError

if TYPE_CHECKING:
    from ..objects.base import ObjectStore
    from ..objects.local import LocalObjects, StagedObject

try:  # CPython's own BLAKE2: hashlib would also load OpenSSL's bindings (2.5 ms of every CLI start)
    from _blake2 import blake2b as _blake2b
except ImportError:  # pragma: no cover - another Python
    from hashlib import blake2b as _blake2b

__all__ = [
    "MANIFEST_FORMAT",
    "TREE_FORMAT",
    "BUNDLED_FORMAT",
    "NodeSource",
    "check_entries",
    "refuse_big_non_manifest",
    "looks_like_version",
    "unpack_bounded",
    "pack",
    "UNPACK_ERRORS",
    "same_raw",
    "merge_diff",
    "entry_from_raw",
    "entry_to_raw",
    "TREE_THRESHOLD",
    "LEAF_TARGET",
    "FANOUT",
    "MAX_LEVEL",
    "NODE_KIND",
    "BUNDLE_KIND",
    "BUNDLE_NODES",
    "BUNDLE_BYTES",
    "MAX_BUNDLE_NODES",
    "TreeEntryMap",
    "open_tree",
    "build_tree",
    "shape_for_store",
    "walk_tree",
    "SeenNodes",
    "seen_objects",
    "file_dir_clash",
    "clear_node_cache",
    "MAX_KEY_BYTES",
    "MAX_SEGMENT_BYTES",
    "MAX_SEGMENTS",
    "MAX_META_DEPTH",
    "Entry",
    "EntryMap",
    "ManifestDoc",
    "validate_key",
    "canonical_meta",
    "canonical_map",
    "encode_manifest",
    "decode_manifest",
    "read_parent",
    "load_manifest",
    "put_version",
]

MANIFEST_FORMAT = 1
"""The flat manifest format (``"v": 1``): every entry in the version object."""
TREE_FORMAT = 2
"""The tree-shaped format (``"v": 2``): entries in node objects, each an object of its own
("tree-shaped versions" below)."""
BUNDLED_FORMAT = 3
"""The tree-shaped format with nodes stored in bundles (``"v": 3``): the nodes of format 2, written
a commit's worth to an object (docs/format.md, "Node bundles").  Readers refuse versions newer than this."""
MAX_META_DEPTH = 64
"""Deepest nesting of lists and maps in metadata (the metadata map itself is level 1)."""

_KIND = "manifest"
_FIELDS = frozenset({"casstore", "entries", "meta", "parent", "v"})
_TREE_FIELDS = frozenset({"casstore", "meta", "parent", "tree", "v"})
_INT_MIN, _INT_MAX = -(2**63), 2**64  # what msgpack can carry: int64 and uint64
_EMPTY: Mapping[str, Any] = MappingProxyType({})

# Printable ASCII except backslash: ``bytes.translate(None, _PLAIN_ASCII)`` leaves what is not.
_PLAIN_ASCII = bytes(c for c in range(0x20, 0x7F) if c != ord("\\"))
# Keys up to this many characters cannot break a length or depth limit, so the bulk check
# need not measure them: k ASCII characters are k bytes, k characters of any kind at most 4k
# UTF-8 bytes, and k characters without empty segments hold at most (k + 1) // 2 segments.
# (255 and 63 with the limits of casstore._paths; computed, so a change there keeps this sound.)
_SHORT_ASCII = min(MAX_SEGMENT_BYTES, MAX_KEY_BYTES, 2 * MAX_SEGMENTS - 1)
_SHORT_ANY = min(min(MAX_SEGMENT_BYTES, MAX_KEY_BYTES) // 4, 2 * MAX_SEGMENTS - 1)

# Digests of versions this process decoded and validated after a verified read (or
# encoded itself): the same digest means the same bytes, so the same verdict.
_VALIDATED: Dict[Digest, None] = {}
_VALIDATED_MAX = 4096


# -- keys -------------------------------------------------------------------------------


def _keys_plainly_valid(keys: List[str]) -> bool:
    """Bulk prefilter: True only if every key is valid (False: check them one by one).

    Joined with ``/`` between and around them, the keys' segments are exactly
    the pieces between slashes, so ``//`` finds every empty key, empty segment,
    leading or trailing slash, and ``/./`` and ``/../`` every dot segment.
    Characters are checked with one C-level pass; lengths and depth cannot be
    exceeded by keys of at most ``_SHORT_*`` characters, and longer keys get
    the exact check.
    """
    try:
        joined = "/" + "/".join(keys) + "/"
    except TypeError:  # a non-str key
        return False
    if "//" in joined or "/./" in joined or "/../" in joined:
        return False
    if joined.isascii():
        if joined.encode("ascii").translate(None, _PLAIN_ASCII):
            return False
        short = _SHORT_ASCII
    else:
        if BAD_CHAR.search(joined) is not None:
            return False
        short = _SHORT_ANY
    if keys and max(map(len, keys)) > short:
        return all(key_problem(k) is None for k in keys if len(k) > short)
    return True


# -- metadata -----------------------------------------------------------------------------


def _canon(value: object, where: str, depth: int, active: Set[int]) -> object:
    """Canonical copy of one metadata value (maps key-sorted); InvalidInputError otherwise.

    Recursion is bounded by MAX_META_DEPTH, and ``active`` (ids of the
    containers being copied) names a cycle as such instead of letting it run
    into the depth limit.
    """
    t = type(value)
    if value is None or t is bool or t is float or t is bytes:
        return value
    if t is int:
        if not _INT_MIN <= value < _INT_MAX:  # type: ignore[operator]
            raise InvalidInputError(f"{where}: integer {value} does not fit in 64 bits")
        return value
    if t is str:
        assert isinstance(value, str)
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidInputError(
                    f"{where}: string {value!r:.80} is not valid Unicode (a lone surrogate); "
                    "store such text as bytes"
                ) from None
        return value
    if isinstance(value, bool):  # pragma: no cover - bool cannot be subclassed
        return bool(value)
    if isinstance(value, int):  # IntEnum and other int subclasses: their int value
        return _canon(int(value), where, depth, active)
    if isinstance(value, float):  # numpy.float64 and other float subclasses
        return float(value)
    if isinstance(value, str):
        return _canon(str.__str__(value), where, depth, active)
    if isinstance(value, bytes):
        return bytes(value)
    # dict before Mapping: isinstance stops at the first match, and the first isinstance(x, Mapping) of
    # a type in a process walks every Mapping subclass loaded (~1 ms per type in a freshly forked rank).
    if isinstance(value, (list, tuple, dict, Mapping)):
        if depth >= MAX_META_DEPTH:
            raise InvalidInputError(
                f"{where}: nested more than {MAX_META_DEPTH} levels deep; flatten it (or store it as bytes)"
            )
        ident = id(value)
        if ident in active:
            raise InvalidInputError(f"{where}: it contains itself (a cyclic list or map); metadata must be a tree")
        active.add(ident)
        try:
            if isinstance(value, (dict, Mapping)):
                for k in value:
                    if type(k) is not str:
                        raise InvalidInputError(f"{where}: metadata keys must be str, got {k!r:.80}")
                out: Dict[str, object] = {}
                for k in sorted(value):
                    _canon(k, where, depth, active)  # a key must be valid Unicode too
                    out[k] = _canon(value[k], where, depth + 1, active)
                return out
            return [_canon(v, where, depth + 1, active) for v in value]
        finally:
            active.discard(ident)
    raise InvalidInputError(
        f"{where}: {type(value).__name__} is not msgpack-able; use None, bool, int, float, str, bytes, "
        "lists and str-keyed dicts"
    )


def canonical_meta(value: object, where: str = "metadata") -> object:
    """A canonical copy of a metadata value: maps key-sorted, tuples as lists, subclasses as their base type.

    Refuses (:class:`~casstore.errors.InvalidInputError`, ``where`` naming the
    value) anything msgpack cannot carry exactly: sets, arbitrary objects,
    bytearray, non-str map keys, integers outside 64 bits, strings that are
    not valid Unicode, cyclic values and nesting deeper than
    :data:`MAX_META_DEPTH`.  Packed with msgpack, the result is the same
    bytes in any process.
    """
    return _canon(value, where, 0, set())


def canonical_map(value: Mapping[str, Any], where: str = "metadata") -> Dict[str, Any]:
    """:func:`canonical_meta` of a str-keyed map (a new dict); InvalidTypeError if ``value`` is not a mapping."""
    if not isinstance(value, (dict, Mapping)):
        raise InvalidTypeError(f"{where} must be a mapping (a dict), not {type(value).__name__}")
    out = _canon(value, where, 0, set())
    assert isinstance(out, dict)
    return out


def _pack(value: object) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


# -- entries ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One manifest entry: an object's digest, its size, and free-form metadata.

    ``digest`` may be given as a ``"blake3:..."`` string.  ``meta`` is checked
    and copied in canonical form when the entry is made
    (:func:`canonical_meta`), so bad metadata fails here, not at commit.
    """

    digest: Digest
    size: Optional[int] = None
    meta: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        if isinstance(self.digest, str):
            object.__setattr__(self, "digest", Digest.parse(self.digest))
        elif not isinstance(self.digest, Digest):
            raise InvalidTypeError(f"Entry.digest must be a Digest, not {type(self.digest).__name__}")
        if self.size is not None and (type(self.size) is not int or self.size < 0 or self.size >= _INT_MAX):
            raise InvalidInputError(f"Entry.size must be a non-negative int or None, not {self.size!r:.80}")
        if not isinstance(self.meta, Mapping):
            raise InvalidTypeError(f"Entry.meta must be a mapping, not {type(self.meta).__name__}")
        if self.meta is not _EMPTY:
            meta = canonical_map(self.meta, "entry metadata")
            object.__setattr__(self, "meta", MappingProxyType(meta) if meta else _EMPTY)


def _trusted_entry(raw: List[Any]) -> Entry:
    """An Entry from a validated, canonical encoded entry (no checks repeated)."""
    e = object.__new__(Entry)
    object.__setattr__(e, "digest", Digest.from_bytes(raw[0]))
    object.__setattr__(e, "size", raw[1])
    object.__setattr__(e, "meta", MappingProxyType(raw[2]) if len(raw) > 2 else _EMPTY)
    return e


def _encode_entry(e: Entry) -> List[Any]:
    # Entry.meta is already canonical (checked and copied in __post_init__).
    return [e.digest.raw, e.size, dict(e.meta)] if e.meta else [e.digest.raw, e.size]


def same_raw(a: List[Any], b: List[Any]) -> bool:
    """Whether two encoded entries are the same as stored (metadata ``1``, ``1.0``, ``True`` differ)."""
    if a != b:
        # NaN != NaN: an entry whose metadata holds one compared unequal to itself, so diff listed it
        # as changed in every version (found by a bug hunt).  The stored bytes decide.
        return len(a) == len(b) == 3 and a[0] == b[0] and a[1] == b[1] and _pack(a[2]) == _pack(b[2])
    return len(a) < 3 or _pack(a[2]) == _pack(b[2])


def merge_diff(a: Iterator[Tuple[str, List[Any]]], b: Iterator[Tuple[str, List[Any]]]
               ) -> Iterator[Tuple[str, Optional[List[Any]], Optional[List[Any]]]]:
    """Merge-join two sorted ``(key, encoded entry)`` streams; yield the keys whose entries differ."""
    x = next(a, None)
    y = next(b, None)
    while x is not None or y is not None:
        if y is None or (x is not None and x[0] < y[0]):
            assert x is not None
            yield x[0], x[1], None
            x = next(a, None)
        elif x is None or y[0] < x[0]:
            yield y[0], None, y[1]
            y = next(b, None)
        else:
            if not same_raw(x[1], y[1]):
                yield x[0], x[1], y[1]
            x = next(a, None)
            y = next(b, None)


def entry_from_raw(raw: List[Any]) -> Entry:
    """An :class:`Entry` from a validated encoded entry (what :meth:`EntryMap.raw` returns)."""
    return _trusted_entry(raw)


def entry_to_raw(e: Entry) -> List[Any]:
    """The encoded form of an Entry (``[digest bytes, size]`` plus metadata if any)."""
    return _encode_entry(e)


class _EntryItems(ItemsView[str, Entry]):
    """``entries.items()`` streamed from the encoded entries (a tree's leaves), not one lookup per key."""

    _mapping: EntryMap

    def __iter__(self) -> Iterator[Tuple[str, Entry]]:
        for k, raw in self._mapping.raw_items():
            yield k, _trusted_entry(raw)


class _EntryValues(ValuesView[Entry]):
    """``entries.values()`` streamed like :class:`_EntryItems`."""

    _mapping: EntryMap

    def __iter__(self) -> Iterator[Entry]:
        for _k, raw in self._mapping.raw_items():
            yield _trusted_entry(raw)


class EntryMap(Mapping[str, Entry]):
    """The entries of a manifest version: ``Mapping[str, Entry]``, keys valid and sorted, immutable.

    Entries are kept in their (validated, canonical) encoded form and become
    :class:`Entry` objects when read, so opening a 100,000-entry version costs
    little more than unpacking it.  Build one with :meth:`from_entries`; a
    decoded version's entries come from :func:`decode_manifest`.
    """

    __slots__ = ("_raw", "_keys")

    def __init__(self) -> None:
        self._raw: Dict[str, List[Any]] = {}
        self._keys: Optional[List[str]] = None

    @classmethod
    def from_entries(cls, entries: Mapping[str, Entry]) -> EntryMap:
        """Check every key (:func:`validate_key`) and value (an :class:`Entry`); keys sorted."""
        if isinstance(entries, EntryMap):
            return entries
        if not isinstance(entries, Mapping):
            raise InvalidTypeError(f"manifest entries must be a mapping of key -> Entry, not {type(entries).__name__}")
        raw: Dict[str, List[Any]] = {}
        for k in entries:
            validate_key(k)
        for k in sorted(entries):
            e = entries[k]
            if not isinstance(e, Entry):
                raise InvalidTypeError(f"manifest entry {k!r:.200} must be an Entry, not {type(e).__name__}")
            raw[k] = _encode_entry(e)
        return cls._of(raw)

    @classmethod
    def _of(cls, raw: Dict[str, List[Any]]) -> EntryMap:
        m = cls()
        m._raw = raw
        return m

    def with_changes(self, changes: Mapping[str, Optional[Entry]]) -> EntryMap:
        """A new map: each key of ``changes`` set to its Entry, or removed where it maps to ``None``.

        A tree-shaped map rebuilds only the nodes on the paths to the changed
        keys ("tree-shaped versions" below); the rest is shared by digest.
        """
        raw = dict(self._raw)
        added = False
        for k, e in changes.items():
            validate_key(k)
            if e is None:
                raw.pop(k, None)
                continue
            if not isinstance(e, Entry):
                raise InvalidTypeError(f"manifest entry {k!r:.200} must be an Entry, not {type(e).__name__}")
            added = added or k not in raw
            raw[k] = _encode_entry(e)
        if added:  # new keys went to the end; sorting str keys that are nearly in order is about linear
            raw = {k: raw[k] for k in sorted(raw)}
        return EntryMap._of(raw)

    def same(self, key: str, other: EntryMap) -> bool:
        """Whether ``key`` has the same encoded entry here and in ``other`` (both must hold it).

        Compared as encoded, not with ``==``: metadata ``1``, ``1.0`` and
        ``True`` are equal in Python but different values in a manifest.
        """
        a, b = self.raw(key), other.raw(key)
        if a is None or b is None:
            raise KeyError(key)
        return same_raw(a, b)

    def items(self) -> ItemsView[str, Entry]:
        """Entries in key order, streamed (a tree reads each leaf once, not one lookup per key)."""
        return _EntryItems(self)

    def values(self) -> ValuesView[Entry]:
        """Entries in key order, streamed like :meth:`items`."""
        return _EntryValues(self)

    def raw(self, key: str) -> Optional[List[Any]]:
        """The encoded entry ``[digest bytes, size, meta?]`` of ``key``, or ``None`` (do not modify it)."""
        return self._raw.get(key)

    def raw_items(self) -> Iterator[Tuple[str, List[Any]]]:
        """``(key, encoded entry)`` in key order (streamed from the leaves for a tree-shaped version)."""
        return iter(self._raw.items())

    def ceiling(self, key: str) -> Optional[str]:
        """The first key ``>= key`` in sort order, or ``None``: a range lookup ("is anything under ``a/``?")."""
        if self._keys is None:
            self._keys = list(self._raw)
        i = bisect.bisect_left(self._keys, key)
        return self._keys[i] if i < len(self._keys) else None

    def diff_raw(self, other: EntryMap) -> Iterator[Tuple[str, Optional[List[Any]], Optional[List[Any]]]]:
        """``(key, entry here or None, entry in other or None)`` for every key whose encoded entry differs.

        A merge of the two sorted key streams; tree-shaped maps skip the
        subtrees both share (same node digest) without reading them.
        """
        return merge_diff(self.raw_items(), other.raw_items())

    def tree_header(self) -> Optional[List[Any]]:
        """``[root digest bytes, root level, entry count, byte total]`` of a tree-shaped map, ``None`` if flat."""
        return None

    @property
    def is_tree(self) -> bool:
        """Whether this map is stored as a tree of node objects (format 2)."""
        return False

    def hex_items(self) -> Iterator[Tuple[str, str, Optional[int]]]:
        """``(key, digest hex, size)`` of every entry, in key order, without making Entry objects.

        For passes over whole stores (gc, verify, usage): making an Entry and a
        Digest per entry doubles their time on 100,000-entry versions.
        """
        for k, v in self.raw_items():
            yield k, v[0].hex(), v[1]

    def __getitem__(self, key: str) -> Entry:
        return _trusted_entry(self._raw[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def __repr__(self) -> str:
        return f"<EntryMap {len(self._raw)} entries>"


# -- versions -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManifestDoc:
    """A decoded, fully validated manifest version (or one about to be encoded).

    Make one with :meth:`build` (checks and canonicalizes what a caller gives)
    or :func:`decode_manifest` (validates what was stored);
    :meth:`encode` gives its canonical bytes.
    """

    entries: EntryMap
    """key -> :class:`Entry`, keys valid and sorted."""
    meta: Mapping[str, Any]
    """Manifest-level metadata (read-only, canonical)."""
    parent: Optional[Digest]
    """The previous version's digest, ``None`` for a first version."""

    @classmethod
    def build(cls, entries: Mapping[str, Entry], meta: Mapping[str, Any], parent: Optional[Digest]) -> ManifestDoc:
        """Check keys, entries and metadata (InvalidInputError/InvalidTypeError) and make a version."""
        if parent is not None and not isinstance(parent, Digest):
            raise InvalidTypeError(f"a manifest's parent must be a Digest or None, not {type(parent).__name__}")
        return cls(EntryMap.from_entries(entries), MappingProxyType(canonical_map(meta, "manifest metadata")), parent)

    def encode(self) -> bytes:
        """The canonical msgpack bytes of this version (docs/format.md).

        A tree-shaped version (format 2, or 3 when its root is in a bundle) encodes its root and
        totals, not its entries; its nodes are written by :func:`put_version`.
        """
        head = self.entries.tree_header()
        if head is not None:
            return _pack({
                "casstore": _KIND,
                "meta": canonical_map(self.meta, "manifest metadata"),
                "parent": self.parent.raw if self.parent is not None else None,
                "tree": head,
                "v": BUNDLED_FORMAT if len(head) == 6 else TREE_FORMAT,
            })
        return _pack({
            "casstore": _KIND,
            "entries": self.entries._raw,
            "meta": canonical_map(self.meta, "manifest metadata"),
            "parent": self.parent.raw if self.parent is not None else None,
            "v": MANIFEST_FORMAT,
        })


def encode_manifest(entries: Mapping[str, Entry], meta: Mapping[str, Any], parent: Optional[Digest]) -> bytes:
    """Canonical msgpack bytes of a manifest version (``ManifestDoc.build(...).encode()``)."""
    return ManifestDoc.build(entries, meta, parent).encode()


def _unpack(data: bytes) -> object:
    """msgpack.unpackb with every length bounded by the input's (a tiny object cannot allocate much)."""
    n = len(data)
    return msgpack.unpackb(
        data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext,
        max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=n,
    )


def _refuse_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not part of the manifest format")


_UNPACK_ERRORS = (ValueError, TypeError, OverflowError, msgpack.UnpackException)
UNPACK_ERRORS = _UNPACK_ERRORS
"""What :func:`unpack_bounded` raises on malformed bytes."""


def decode_manifest(data: Union[bytes, bytearray, memoryview], digest: Optional[Digest] = None,
                    objects: Optional[NodeSource] = None) -> ManifestDoc:
    """Decode and validate a manifest version's bytes; :class:`~casstore.errors.StoreFormatError` on anything wrong.

    THE decoder (see the module docstring): every key, entry and metadata
    value is checked before this returns.  ``digest`` names the version in
    error messages.  A tree-shaped version (format 2) reads its node objects
    from ``objects`` when its entries are used, each one a verified read
    validated against its parent ("tree-shaped versions" below); without
    ``objects`` using its entries is a StoreFormatError.
    """
    return _decode(bytes(data), digest, trusted=False, objects=objects)[0]


class NodeSource(Protocol):
    """Where a tree-shaped version's node objects are read from (an ObjectStore, or a pull's remote view)."""

    def read(self, digest: Digest, *, verify: bool = True) -> bytes:
        """The object's bytes, verified (re-hashed) unless ``verify=False``."""

    def prefetch(self, digests: Iterable[Digest]) -> None:
        """A hint that these objects will be read soon, one by one; it may do nothing."""


def _decode(data: bytes, digest: Optional[Digest], *, trusted: bool,
            objects: Optional[NodeSource] = None) -> Tuple[ManifestDoc, bool]:
    """``(doc, canonical)``: canonical if the bytes are exactly what :meth:`ManifestDoc.encode` writes
    for their entries (only then may their digest skip validation next time).  ``trusted``: the bytes
    are known to be a valid, canonical version (skip the per-entry checks)."""
    what = f"manifest {digest}" if digest is not None else "manifest"
    try:
        doc = _unpack(data)
    except _UNPACK_ERRORS as e:
        raise StoreFormatError(
            f"object {digest} is not a valid manifest ({type(e).__name__}: {str(e):.200})"
        ) from None
    if not isinstance(doc, dict) or doc.get("casstore") != _KIND:
        raise StoreFormatError(f"object {digest} is not a casstore manifest")
    v = doc.get("v")
    if type(v) is int and v > BUNDLED_FORMAT:
        raise StoreFormatError(f"{what} has format {v!r}, newer than this casstore; upgrade it")
    if type(v) is not int or v not in (MANIFEST_FORMAT, TREE_FORMAT, BUNDLED_FORMAT):  # format.md: refuse unknown
        raise StoreFormatError(f"{what} has unknown format {v!r:.40} (expected {MANIFEST_FORMAT}, {TREE_FORMAT} "
                               f"or {BUNDLED_FORMAT})")
    if v != MANIFEST_FORMAT:
        return _decode_tree(doc, digest, what, objects, bundled=v == BUNDLED_FORMAT), True
    if doc.keys() != _FIELDS:
        extra = sorted(repr(k) for k in doc if k not in _FIELDS) or ["(none)"]
        missing = sorted(_FIELDS - doc.keys()) or ["(none)"]
        raise StoreFormatError(
            f"{what} lacks its entries or meta map, or has other fields (missing {', '.join(missing)}; "
            f"unexpected {', '.join(extra):.200}); it was not written by casstore"
        )
    raw = doc["entries"]
    meta = doc["meta"]
    if not isinstance(raw, dict) or not isinstance(meta, dict):
        raise StoreFormatError(f"{what} lacks its entries or meta map")
    parent = doc["parent"]
    if parent is not None and not (type(parent) is bytes and len(parent) == 32):
        raise StoreFormatError(f"{what} has a malformed parent link ({parent!r:.80})")
    canonical = True
    if not trusted:  # trusted bytes were canonical: keys already sorted
        canonical = _check_entries(raw, what)
        keys = list(raw)
        if keys != sorted(keys):  # hand-made, not canonical: entries are always iterated in key order
            raw = {k: raw[k] for k in sorted(keys)}
            canonical = False
    try:
        meta = canonical_map(meta, "metadata")
    except InvalidInputError as e:
        raise StoreFormatError(f"{what}: {e}") from None
    return ManifestDoc(EntryMap._of(raw), MappingProxyType(meta),
                       Digest(parent.hex()) if parent is not None else None), canonical


def _decode_tree(doc: Dict[str, Any], digest: Optional[Digest], what: str,
                 objects: Optional[NodeSource], *, bundled: bool) -> ManifestDoc:
    """A format-2 or -3 version: meta, parent and the tree header; nodes are validated as they are read."""
    if doc.keys() != _TREE_FIELDS:
        extra = sorted(repr(k) for k in doc if k not in _TREE_FIELDS) or ["(none)"]
        missing = sorted(_TREE_FIELDS - doc.keys()) or ["(none)"]
        raise StoreFormatError(
            f"{what} lacks its tree or meta map, or has other fields (missing {', '.join(missing)}; "
            f"unexpected {', '.join(extra):.200}); it was not written by casstore"
        )
    meta = doc["meta"]
    if not isinstance(meta, dict):
        raise StoreFormatError(f"{what} lacks its meta map")
    parent = doc["parent"]
    if parent is not None and not (type(parent) is bytes and len(parent) == 32):
        raise StoreFormatError(f"{what} has a malformed parent link ({parent!r:.80})")
    try:
        meta = canonical_map(meta, "metadata")
    except InvalidInputError as e:
        raise StoreFormatError(f"{what}: {e}") from None
    entries = open_tree(doc["tree"], objects, what, bundled=bundled)
    return ManifestDoc(entries, MappingProxyType(meta), Digest(parent.hex()) if parent is not None else None)


def check_entries(raw: Dict[Any, Any], what: str) -> bool:
    """Validate every key and encoded entry of ``raw`` (StoreFormatError naming ``what``); False if
    any entry was rewritten into canonical form.  Used for flat versions and tree leaves alike."""
    return _check_entries(raw, what)


def unpack_bounded(data: bytes) -> object:
    """msgpack-unpack ``data`` with every length bounded by its own (hostile input allocates little);
    raises ``UNPACK_ERRORS``."""
    return _unpack(data)


def pack(value: object) -> bytes:
    """msgpack bytes of ``value`` as manifests store them (``use_bin_type``)."""
    return _pack(value)


def _check_entries(raw: Dict[Any, Any], what: str) -> bool:
    """Validate every key and entry; StoreFormatError otherwise.

    Non-canonical entries (empty or unsorted metadata) are rewritten in place
    into canonical form; returns False if any was.
    """
    keys = list(raw)
    if not _keys_plainly_valid(keys):
        for k in sorted(keys, key=lambda k: (type(k) is not str, k if type(k) is str else "")):
            try:
                validate_key(k)
            except (InvalidInputError, InvalidTypeError) as e:
                raise StoreFormatError(
                    f"{what}: key {k!r:.200} is invalid ({str(e).partition(': ')[2] or e}); a checkout could "
                    "write outside its target, so nothing of this manifest is used. It was not written by "
                    "casstore: remove the ref that names it"
                ) from None
    canonical = True
    for k, v in raw.items():
        if type(v) is not list:
            _bad_entry(what, k, v)
        n = len(v)
        if n == 2:
            d, size = v
        elif n == 3:
            d, size, m = v
            if type(m) is not dict:
                _bad_entry(what, k, v)
            if not m:
                raw[k] = [d, size]  # empty metadata: the encoder omits it
                canonical = False
            else:
                try:
                    c = canonical_map(m, f"metadata of entry {k!r:.200}")
                except InvalidInputError as e:
                    raise StoreFormatError(f"{what}: entry {k!r:.200} is malformed: {e}") from None
                if _pack(c) != _pack(m):
                    canonical = False
                v[2] = c
        else:
            _bad_entry(what, k, v)
        if type(d) is not bytes or len(d) != 32 or (size is not None and (type(size) is not int or size < 0)):
            _bad_entry(what, k, v)
    return canonical


def _bad_entry(what: str, key: str, value: object) -> NoReturn:
    raise StoreFormatError(
        f"{what}: entry {key!r:.200} is malformed ({value!r:.80}); an entry is "
        "[32-byte digest, size (a non-negative int or nil), metadata map (optional)]"
    )


def read_parent(data: Union[bytes, bytearray, memoryview]) -> Optional[Digest]:
    """The parent link of a version's bytes, or ``None`` if there is none or the bytes are damaged.

    Never raises: garbage collection walks expired history through versions
    it does not otherwise trust.  Nothing else of the document is validated.
    """
    try:
        doc = _unpack(bytes(data))
    except _UNPACK_ERRORS:
        return None
    if isinstance(doc, dict):
        p = doc.get("parent")
        if type(p) is bytes and len(p) == 32:
            return Digest(p.hex())
    return None


def _remember(d: Digest) -> None:
    if d not in _VALIDATED:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            try:  # best effort, no lock: another thread may be trimming too (a lock could be held across fork)
                _VALIDATED.pop(next(iter(_VALIDATED)), None)
            except (StopIteration, RuntimeError):
                pass
        _VALIDATED[d] = None


def load_manifest(objects: ObjectStore, d: Digest) -> ManifestDoc:
    """Read version ``d`` from ``objects`` (verified: re-hashed) and decode it.

    :class:`~casstore.errors.ObjectNotFoundError` if it is not there,
    :class:`~casstore.errors.IntegrityError` if its bytes are damaged,
    :class:`~casstore.errors.StoreFormatError` if it is not a valid manifest.
    """
    if not isinstance(d, Digest):
        raise InvalidTypeError(f"a manifest version is named by a Digest, not {type(d).__name__}")
    if d not in _VALIDATED:
        refuse_big_non_manifest(objects, d)
    data = objects.read(d, verify=True)
    trusted = d in _VALIDATED  # the bytes hash to d, and d's bytes were validated (and canonical) before
    doc, canonical = _decode(data, d, trusted=trusted, objects=objects)
    if canonical and not trusted:
        _remember(d)
    return doc


_COMPRESSED_VERSION_MAX = 1 << 20
"""A manifest version stored compressed (not by casstore: it stores them raw) is read only up to this size."""
_PEEK_ABOVE = 16 << 20
"""Objects larger than this are peeked at before they are read whole as a manifest version."""
_VERSION_HEAD = b"\xa8casstore\xa8manifest"  # canonical: the sorted keys start with "casstore": "manifest"


def looks_like_version(head: Union[bytes, bytearray, memoryview]) -> bool:
    """Whether bytes beginning with ``head`` (at least their first 32) can be a manifest version: canonical
    msgpack whose first key is ``"casstore": "manifest"``.  No more than that is checked (a cheap first
    look before anything is decoded or read whole)."""
    b = bytes(head[:32])
    skip = 1 if b[:1] and 0x80 <= b[0] <= 0x8F else 3 if b[:1] == b"\xde" else 5 if b[:1] == b"\xdf" else -1
    return skip >= 0 and b[skip:skip + len(_VERSION_HEAD)] == _VERSION_HEAD


def refuse_big_non_manifest(objects: ObjectStore, d: Digest) -> None:
    """:class:`StoreFormatError` for a large object that does not begin as a manifest version does.

    Hazard (found by a bug hunt): naming any object where a version is expected (``casstore manifest
    show blake3:<prefix>``, an fsspec path ``blake3:<prefix>/x``) read it whole to decode it: 400 MiB
    of zeros stored compressed in 13 KB took the process to 850 MB.  A version is canonical msgpack
    whose first key is ``"casstore": "manifest"``; anything big that is not gets no further than its
    first bytes.
    """
    try:
        info = objects.stat(d)
    except ObjectNotFoundError:
        return  # the read says so
    size = info.size
    if info.codec != "raw" and size > _COMPRESSED_VERSION_MAX:
        # Hazard (found by a bug hunt): 4,000,000 empty maps as a version's metadata, 4 MB of msgpack
        # stored as 223 bytes of zstd, cost 600-900 MB in every ls, log, gc and verify (decoding
        # amplifies ~150x).  casstore stores versions raw (put_version), so a compressed one was put by
        # hand: only a small one is read.
        raise StoreFormatError(
            f"object {d} is stored compressed ({info.stored_size:,} bytes for {size:,}), so it is not a manifest "
            f"version casstore made (they are stored raw); a compressed version above "
            f"{_COMPRESSED_VERSION_MAX:,} bytes is not read (a decompression bomb is cheap); put the version "
            "again uncompressed (compress=False) if it is a real one")
    if size <= _PEEK_ABOVE:
        return
    with objects.open(d, verify=False) as f:
        head = f.read(32)
    if not looks_like_version(head):
        raise StoreFormatError(f"object {d} ({size:,} bytes) is not a manifest version (a data object?); "
                               "name a version (NAME, NAME~N, NAME@HEX or a version's digest)")


def put_version(objects: LocalObjects, doc: ManifestDoc, first: Sequence[StagedObject] = ()) -> Digest:
    """Store a version as a raw object (docs/format.md: manifest versions are never compressed); its digest.

    The bytes are ``doc.encode()``; a version made by :meth:`ManifestDoc.build`
    or :func:`decode_manifest` is valid, so reading it back skips validation.
    ``first``: staged objects its entries name, published (durably) before it: with a tree's
    nodes in their batch, else in a batch of their own.
    """
    # Flat up to TREE_THRESHOLD entries, a tree above (docs/format.md); a tree's new nodes are
    # published in one durable batch (put_many: one syncfs before the renames and one after),
    # children first, and the version object last in the same batch: its own fsyncs cost a
    # tenth of a 1% re-add's commit, and nothing names it before the caller moves a ref, which
    # happens after the batch's last syncfs.
    entries, nodes = shape_for_store(doc.entries, objects)
    version = ManifestDoc(entries, doc.meta, doc.parent).encode()
    if nodes:
        d = objects.put_many([*nodes, version], compress=False, first=first)[-1]
    else:
        objects.publish_batch(first)
        d = objects.put(version, compress=False)
    _remember(d)
    return d


# -- tree-shaped versions (format 2) ------------------------------------------------------
#
# Tree-shaped manifest versions (format 2): a content-defined B-tree of node objects over the sorted keys.
#
# A version with more than :data:`TREE_THRESHOLD` entries is stored as a small
# version object (meta, parent, ``"tree": [root digest, root level, entry
# count, byte total]``, ``"v": 2``) plus node objects (docs/format.md,
# "Tree-shaped versions"):
#
# * a *leaf* (level 0) holds a run of entries, ``{key: [digest, size, meta?]}``
#   exactly as a flat version does;
# * an *internal* node (level L >= 1) holds its children as
#   ``[last key, child digest, entry count, byte total]``.
#
# Boundaries depend on keys only (a prolly tree): a node of level L ends after
# key ``k`` when ``rank(k) > L``, where ``rank`` comes from a 64-bit hash of the
# key (a leaf ends with probability 1/:data:`LEAF_TARGET`, each level above with
# 1/:data:`FANOUT` more).  So the tree is a function of the key set, whatever
# the edit history (same entries, same root digest); changing an entry's digest
# never moves a boundary; inserting or deleting a key moves at most the
# boundary at that key.  A version that changes k keys writes O(k * depth) nodes
# of a few hundred bytes each, and shares every other node with its parent.
#
# Hazards this module is built around:
#
# * Node bytes are hostile like any stored data.  Every node read is a verified
#   read (the bytes hash to the digest its parent names) and is validated before
#   use: its tag and level, every key and entry (the same checks as a flat
#   version, :func:`~casstore.manifests.model.check_entries`), keys strictly
#   sorted and inside the parent's key range (after the previous sibling's last
#   key, ending exactly at the last key the parent records), and counts and
#   byte totals equal to what the parent records.  Levels strictly decrease, so
#   depth is bounded by :data:`MAX_LEVEL`.  Anything else is a
#   :class:`~casstore.errors.StoreFormatError` naming the version.
# * Cost grows with what changed: lookups read one node per level (a small
#   in-process cache keeps the upper levels), iteration streams the leaves
#   (memory is one node per level), :meth:`TreeEntryMap.with_changes` rebuilds
#   only the touched paths, and diffs skip subtrees both sides share.
# * Nodes are written in one batch with the version (``put_many``: one
#   filesystem sync), children before parents, before the version object.
# * Where a node is stored is not part of it (format 3, "Node bundles" in
#   docs/format.md).  A commit's new nodes go into a few *bundle* objects instead
#   of one object each: every node file cost a create and a rename, 214 of them
#   for a 1% add of 10,000 files (11-30 ms of its commit here, depending on the
#   host's file-creation latency).  Node bytes and digests are format 2's, so the
#   tree stays a function of its entries (same root digest) and diffs still skip
#   shared subtrees; a node's location travels beside its digest (``Ref[4]``),
#   from the version header (the root's) and the bundle that holds its parent
#   (every child's).  A bundle is hostile like a node: read verified, its shape
#   validated, and a node taken from it must hash to the digest its parent names,
#   so a location can only point to the right bytes or fail.

TREE_THRESHOLD = 4096
"""Versions with more entries than this are stored as trees; smaller ones stay flat (format 1)."""
LEAF_TARGET = 8
"""Mean entries per leaf.  Small on purpose: a one-key commit rewrites one leaf and one node per level,
and 100 one-key versions must add <= 1% of a 1,000,000-entry version's bytes (docs/format.md, measured)."""
FANOUT = 8
"""Mean children per internal node (same reasoning as :data:`LEAF_TARGET`)."""
MAX_LEVEL = 40
"""Deepest root level accepted from stored data (a real tree of 2**64 entries has about 21)."""
NODE_KIND = "manifest-node"
BUNDLE_KIND = "manifest-bundle"
BUNDLE_NODES = 512
"""Most nodes a commit writes to one bundle."""
BUNDLE_BYTES = 128 << 10
"""About the most node bytes a commit writes to one bundle: a lookup reads one bundle per level, so a
bundle stays small enough that reading and hashing it whole costs little (128 KiB: ~50 us here)."""
MAX_BUNDLE_NODES = 4096
"""Most nodes accepted in a bundle from stored data (casstore writes at most :data:`BUNDLE_NODES`)."""

_LEAF_CUT = (1 << 64) // LEAF_TARGET
_CACHE_MAX = 4096  # decoded nodes kept per source (upper levels stay hot for lookups)
_BUNDLE_CACHE_BYTES = 32 << 20
"""Bundle bytes kept decoded per source (~256 of casstore's, 128 KiB at most each), the oldest dropped first.

Hazard (measured): a version's nodes end up spread over the bundles of the commits that last touched
them (130 bundles for a 10,000-file folder after ~130 adds).  With 32 bundles kept, a walk in key order
went through them in turn and decoded each about three times: iterating 10,000 entries took 102 ms,
against 36 ms with them all kept (+12 MB)."""

Raw = List[Any]
"""An encoded entry: ``[digest bytes, size, meta?]``."""
Loc = Optional[Tuple[bytes, int]]
"""Where a node is stored: ``None`` for an object of its own (format 2), else (bundle digest, index)."""
Ref = Tuple[str, bytes, int, int, Loc]
"""A child as its parent records it: (last key, digest bytes, entry count, byte total), and where it is
stored (not part of the parent's bytes: see "Node bundles")."""
Node = Union[Dict[str, Raw], Tuple[List[str], List[Ref]]]
"""A decoded node: a leaf's entries, or an internal node's (last keys, children)."""

# Decoded nodes, per source (per ObjectStore instance): a digest names one content forever, but a
# node cached from one store must not stand in for a node another store lacks (pin and pull check
# that every node is present by reading it).
_Stats = Tuple[str, str, int, int]
"""What a parent records of a node: (first key, last key, entry count, byte total)."""
_Cached = Tuple[int, Node, _Stats]
"""A decoded node as cached: (level, node, its stats)."""
_CACHES: weakref.WeakKeyDictionary[NodeSource, Dict[bytes, _Cached]] = weakref.WeakKeyDictionary()
_Bundle = Tuple[List[bytes], List[Any], List[bytes]]
"""A bundle as read (its shape checked; each node's locations are checked when the node is used):
(node bytes, per node ``None`` or its children's locations, the table of other bundles they name)."""


class _BundleCache:
    """Decoded bundles of one source, bounded by the bytes they were decoded from
    (:data:`_BUNDLE_CACHE_BYTES`; best effort, no lock, as the node cache)."""

    __slots__ = ("items", "nbytes")

    def __init__(self) -> None:
        self.items: Dict[bytes, Tuple[_Bundle, int]] = {}
        self.nbytes = 0

    def get(self, b: bytes) -> Optional[_Bundle]:
        got = self.items.get(b)
        return None if got is None else got[0]

    def __contains__(self, b: bytes) -> bool:
        return b in self.items

    def put(self, b: bytes, bundle: _Bundle, size: int) -> None:
        while self.items and self.nbytes + size > _BUNDLE_CACHE_BYTES:
            try:
                _old, n = self.items.pop(next(iter(self.items)))
            except (StopIteration, KeyError, RuntimeError):  # (another thread took it)
                break
            self.nbytes -= n
        if size <= _BUNDLE_CACHE_BYTES and b not in self.items:
            self.items[b] = (bundle, size)
            self.nbytes += size

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0


_BUNDLES: weakref.WeakKeyDictionary[NodeSource, _BundleCache] = weakref.WeakKeyDictionary()

_T = TypeVar("_T")


def _per_source(caches: weakref.WeakKeyDictionary[NodeSource, _T], source: Optional[NodeSource],
                make: Callable[[], _T]) -> _T:
    if source is None:
        return make()
    try:
        got = caches.get(source)
        if got is None:
            got = caches[source] = make()
        return got
    except TypeError:  # a source that cannot be weakly referenced: no cache
        return make()


def _cache_for(source: Optional[NodeSource]) -> Dict[bytes, _Cached]:
    return _per_source(_CACHES, source, dict)


def _bundles_for(source: Optional[NodeSource]) -> _BundleCache:
    return _per_source(_BUNDLES, source, _BundleCache)


def clear_node_cache() -> None:
    """Forget every decoded tree node and bundle (tests measuring reads; nothing else needs it)."""
    for cache in list(_CACHES.values()):
        cache.clear()
    for bundles in list(_BUNDLES.values()):
        bundles.clear()


def _rank_hash(key: str) -> int:
    return int.from_bytes(_blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _ends(key: str, level: int) -> bool:
    """Whether a node of ``level`` ends after ``key`` (boundaries are nested: a level-L end is one below too)."""
    return _rank_hash(key) < _LEAF_CUT // (FANOUT ** level)  # type: ignore[no-any-return]


def _size_of(raw: Raw) -> int:
    s = raw[1]
    return s if type(s) is int else 0


# -- encoding ---------------------------------------------------------------------------


def _total(n: int) -> int:
    """A node's byte total, which its parent records as a uint64.

    Hazard (found by a bug hunt): entry sizes up to 2**64 - 1 each summed past what msgpack can carry,
    and a commit (even ``casstore manifest set``) failed with a raw ``OverflowError``.
    """
    if n >= _INT_MAX:
        raise InvalidInputError(f"the entries' sizes sum to {n:,} bytes, more than a version can record "
                                "(2**64 - 1; no store holds that much): some recorded sizes are wrong; "
                                "set those entries again (their sizes come from the objects)")
    return n


class _Writer:
    """Encodes new nodes; keeps their bytes (children first) and decoded form until they are stored."""

    def __init__(self, pending: Optional[Dict[bytes, Tuple[bytes, int, Node]]] = None) -> None:
        self.new: Dict[bytes, Tuple[bytes, int, Node]] = dict(pending) if pending else {}

    def leaf(self, items: List[Tuple[str, Raw]]) -> Ref:
        entries = dict(items)
        data = pack({"casstore": NODE_KIND, "entries": entries, "level": 0})
        d = hash_raw(data)
        self.new.setdefault(d, (data, 0, entries))
        return items[-1][0], d, len(items), _total(sum(_size_of(r) for _k, r in items)), None

    def internal(self, level: int, refs: List[Ref]) -> Ref:
        # (A child's location is kept in the decoded node, for the bundle's table, not in its bytes.)
        data = pack({"casstore": NODE_KIND, "children": [[r[0], r[1], r[2], r[3]] for r in refs], "level": level})
        d = hash_raw(data)
        self.new.setdefault(d, (data, level, ([r[0] for r in refs], list(refs))))
        return refs[-1][0], d, sum(r[2] for r in refs), _total(sum(r[3] for r in refs)), None


_CLEAN = 1 << 30  # (_Builder.low when no level has items waiting)


class _Builder:
    """Chunkers, one per level: entries in key order in, nodes out at key-defined boundaries.

    An unchanged old node may be handed to the level above whole (:meth:`add_ref`)
    when every level at and below its own holds nothing pending: it then starts a
    node of its level exactly as a rebuild from scratch would.
    """

    def __init__(self, writer: _Writer) -> None:
        self.w = writer
        self.pend: List[List[Any]] = [[]]
        # The lowest level with items waiting (_CLEAN: none): clean_upto is asked once per node a commit
        # walks past (~1,000 for a 1% folder add), and scanning the levels each time cost ~0.5 ms of it.
        self.low = _CLEAN
        self.recv: List[int] = [0]
        # key -> the highest level it ends a node at, as learnt from an old tree's inner nodes (see
        # :meth:`learn`): the rank hash of those keys is not computed again.
        self.ranks: Dict[str, int] = {}

    def learn(self, level: int, keys: List[str]) -> None:
        """An old inner node of ``level`` with children ending at ``keys``: every key but the last
        ends a node of ``level - 1`` and not of ``level`` (in a tree built by these rules; an old
        tree that was not only keeps its shape, still a valid tree).  With the whole-leaf rebuild
        (:meth:`add_leaf`), a commit of 100 modified keys of 10,000 hashed 2,707 keys, now 5."""
        ranks, below = self.ranks, level - 1
        for k in keys[:-1]:
            ranks[k] = below

    def _ends(self, key: str, level: int) -> bool:
        r = self.ranks.get(key)
        return _ends(key, level) if r is None else r >= level

    def _level(self, level: int) -> None:
        while len(self.pend) <= level:
            self.pend.append([])
            self.recv.append(0)

    def clean_upto(self, level: int) -> bool:
        """Whether no level <= ``level`` has items waiting."""
        return self.low > level

    def add_entry(self, key: str, raw: Raw) -> None:
        self.pend[0].append((key, raw))
        self.low = 0
        self.recv[0] += 1
        if self._ends(key, 0):
            self._flush(0)

    def add_leaf(self, items: List[Tuple[str, Raw]]) -> None:
        """A whole leaf with an old leaf's keys (same boundaries), while level 0 holds nothing."""
        self.recv[0] += len(items)
        self.add_ref(1, self.w.leaf(items))

    def add_ref(self, level: int, ref: Ref) -> None:
        """``ref`` is a node of level ``level - 1``, an item for the chunker of ``level``."""
        self._level(level)
        self.pend[level].append(ref)
        if level < self.low:
            self.low = level
        self.recv[level] += 1
        if self._ends(ref[0], level):
            self._flush(level)

    def _flush(self, level: int) -> None:
        items = self.pend[level]
        self.pend[level] = []
        if self.low == level:  # (levels below it were clean: the next one waiting is above)
            self.low = next((i for i in range(level + 1, len(self.pend)) if self.pend[i]), _CLEAN)
        ref = self.w.leaf(items) if level == 0 else self.w.internal(level, items)
        self.add_ref(level + 1, ref)

    def finish(self, reader: Optional[_Reader] = None) -> Optional[Tuple[Ref, int]]:
        """(root, root level), or ``None`` for no entries.  The root is the lowest level with one node."""
        level = 0
        while level < len(self.pend):
            above = any(self.recv[m] for m in range(level + 1, len(self.recv)))
            if level >= 1 and self.recv[level] == 1 and not above:
                return self._collapse(self.pend[level][0], level - 1, reader)
            if self.pend[level]:
                self._flush(level)
            level += 1
        return None

    def _collapse(self, ref: Ref, level: int, reader: Optional[_Reader]) -> Tuple[Ref, int]:
        # A last key that ends nodes of several levels leaves a chain of one-child nodes on top;
        # the canonical root is the lowest level with one node (what a rebuild from scratch gives).
        while level >= 1:
            got = self.w.new.get(ref[1])
            if got is not None:
                node = got[2]
            elif reader is not None:  # a reused old node (one child is canonical inside a tree, not on top)
                node = reader.node(ref, level, None, True)
            else:
                break
            assert isinstance(node, tuple)
            if len(node[1]) != 1:
                break
            if got is not None:
                del self.w.new[ref[1]]
            ref, level = node[1][0], level - 1
        return ref, level


# -- reading ----------------------------------------------------------------------------


def _bad(what: str, d: bytes, problem: str) -> StoreFormatError:
    return StoreFormatError(
        f"{what}: tree node blake3:{d.hex()} {problem}; the version is damaged or was not written by casstore, "
        "so nothing of it is used (remove or re-point the ref that names it)"
    )


def _tagged(data: bytes, kind: str, bad: Callable[[str], StoreFormatError]) -> Dict[Any, Any]:
    """``data`` unpacked (lengths bounded) as a map tagged ``"casstore": kind``; ``bad(problem)`` otherwise."""
    try:
        doc = unpack_bounded(data)
    except UNPACK_ERRORS as e:
        raise bad(f"is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("casstore") != kind:
        raise bad("is not a manifest tree node" if kind == NODE_KIND else "is not a tree node bundle")
    return doc


def _decode_node(data: bytes, d: bytes, level: int, what: str) -> Node:
    """Validate what a node holds by itself (tag, level, keys, entries, order); StoreFormatError otherwise."""
    doc = _tagged(data, NODE_KIND, lambda problem: _bad(what, d, problem))
    if doc.get("level") != level or type(doc.get("level")) is not int:
        raise _bad(what, d, f"has level {doc.get('level')!r:.40}, where its parent needs level {level}")
    body = "entries" if level == 0 else "children"
    if doc.keys() != {"casstore", "level", body}:
        raise _bad(what, d, f"has fields {sorted(map(repr, doc))!s:.200}, expected casstore, level, {body}")
    items = doc[body]
    if level == 0:
        if not isinstance(items, dict) or not items:
            raise _bad(what, d, "has no entries map (or an empty one)")
        check_entries(items, f"{what} (tree node blake3:{d.hex()})")
        keys = list(items)
        if any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
            raise _bad(what, d, "has keys out of order")
        return items
    if not isinstance(items, list) or not items:
        raise _bad(what, d, "has no children list (or an empty one)")
    refs: List[Ref] = []
    for c in items:
        if not (type(c) is list and len(c) == 4 and type(c[0]) is str and type(c[1]) is bytes and len(c[1]) == 32
                and type(c[2]) is int and c[2] > 0 and type(c[3]) is int and c[3] >= 0):
            raise _bad(what, d, f"has a malformed child {c!r:.100} (expected [last key, 32-byte digest, "
                                "entry count > 0, byte total >= 0])")
        refs.append((c[0], c[1], c[2], c[3], None))  # (located by the caller: see _Reader.node)
    keys = [r[0] for r in refs]
    if not _keys_plainly_valid(keys):  # (one bulk check; each key alone only when it fails)
        for k in keys:
            try:
                validate_key(k)
            except Exception:  # noqa: BLE001 - any refusal of a key is a damaged node
                raise _bad(what, d, f"has an invalid key {k!r:.200}") from None
    if any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
        raise _bad(what, d, "has children out of order")
    return keys, refs


def _stats(node: Node) -> _Stats:
    """What a parent records of ``node``: its first and last key, entry count and byte total.

    Computed once per decode and cached with the node: a commit checks each cached node against its
    parent's ref again (a sum over the node each time was a tenth of a 1% folder add's commit).
    """
    if isinstance(node, dict):
        return next(iter(node)), next(reversed(node)), len(node), sum(_size_of(r) for r in node.values())
    return node[0][0], node[0][-1], sum(r[2] for r in node[1]), sum(r[3] for r in node[1])


def _at(ref: Ref) -> bytes:
    """A node *at its location*, as the node cache and walks key it: its digest, and its bundle and index.

    Hazard: the same node can be stored twice (two names adding the same folder write the same nodes to
    their own bundles).  Keyed by digest alone, a gc walk that met a node through name A skipped it when
    met again through name B, so B's bundles were never marked and were deleted under it; and a node
    cached with its children's locations in one bundle answered for another copy's.
    """
    loc = ref[4]
    return ref[1] if loc is None else ref[1] + loc[0] + loc[1].to_bytes(2, "big")


def _bad_bundle(what: str, b: bytes, problem: str) -> StoreFormatError:
    return StoreFormatError(
        f"{what}: tree node bundle blake3:{b.hex()} {problem}; the version is damaged or was not written by "
        "casstore, so nothing of it is used (remove or re-point the ref that names it)"
    )


def _decode_bundle(data: bytes, b: bytes, what: str) -> _Bundle:
    """Check a bundle's shape (StoreFormatError otherwise); its nodes are checked as they are used."""
    doc = _tagged(data, BUNDLE_KIND, lambda problem: _bad_bundle(what, b, problem))
    if doc.keys() != {"casstore", "bundles", "locs", "nodes"}:
        raise _bad_bundle(what, b, f"has fields {sorted(map(repr, doc))!s:.200}, expected bundles, casstore, "
                                   "locs, nodes")
    nodes, locs, table = doc["nodes"], doc["locs"], doc["bundles"]
    if not (type(nodes) is list and 0 < len(nodes) <= MAX_BUNDLE_NODES and all(type(n) is bytes for n in nodes)):
        raise _bad_bundle(what, b, f"has no list of 1..{MAX_BUNDLE_NODES} encoded nodes")
    if not (type(locs) is list and len(locs) == len(nodes) and all(x is None or type(x) is list for x in locs)):
        raise _bad_bundle(what, b, "has no list of child locations, one (or nil) per node")
    if not (type(table) is list and all(type(t) is bytes and len(t) == 32 for t in table)):
        raise _bad_bundle(what, b, "has no table of 32-byte bundle digests")
    return nodes, locs, table


def _placed(node: Node, locs: Optional[List[Loc]], d: bytes, what: str) -> Node:
    """``node`` (read from a bundle) with its children's locations; a leaf has none."""
    if isinstance(node, dict):
        if locs is not None:
            raise _bad(what, d, "is a leaf, but its bundle lists child locations for it")
        return node
    keys, refs = node
    if locs is None or len(locs) != len(refs):
        raise _bad(what, d, f"has {len(refs)} children, but its bundle lists "
                            f"{'no' if locs is None else len(locs)} locations for them")
    return keys, [(r[0], r[1], r[2], r[3], x) for r, x in zip(refs, locs, strict=True)]


class _Reader:
    """Reads and validates the nodes of one version (from its store, and from nodes not yet stored)."""

    __slots__ = ("source", "pending", "what", "cache", "bundles")

    def __init__(self, source: Optional[NodeSource], pending: Dict[bytes, Tuple[bytes, int, Node]],
                 what: str) -> None:
        self.source = source
        self.pending = pending
        self.what = what
        self.cache = _cache_for(source)
        self.bundles = _bundles_for(source)

    def node(self, ref: Ref, level: int, lo: Optional[str], root: bool, *, cache: bool = True) -> Node:
        """Node ``ref`` of ``level``: verified, validated, and checked against what its parent says
        (keys after ``lo`` and ending at ``ref``'s last key, its count and byte total)."""
        d = ref[1]
        got = self.pending.get(d)
        if got is not None:
            return got[2]
        at = _at(ref)
        hit = self.cache.get(at)
        if hit is not None and hit[0] == level:
            node, stats = hit[1], hit[2]
        else:
            if self.source is None:
                raise StoreFormatError(f"{self.what} is tree-shaped; its nodes can only be read from a store")
            loc = ref[4]
            if loc is None:
                data = self._object(d, "tree node")
                node = _decode_node(data, d, level, self.what)
            else:
                data, locs = self._bundled(loc, d)
                node = _placed(_decode_node(data, d, level, self.what), locs, d, self.what)
            stats = _stats(node)
            if cache:
                if len(self.cache) >= _CACHE_MAX:
                    try:  # best effort, no lock (see _remember)
                        self.cache.pop(next(iter(self.cache)), None)
                    except (StopIteration, RuntimeError):
                        pass
                self.cache[at] = (level, node, stats)
        self._check(stats, ref, lo, root)
        return node

    def _object(self, d: bytes, kind: str) -> bytes:
        assert self.source is not None
        try:
            return self.source.read(Digest.from_bytes(d), verify=True)
        except ObjectNotFoundError:
            raise MissingNodeError(
                f"{self.what}: {kind} blake3:{d.hex()} is missing from the store; pull the version "
                "again from a remote that has it", d.hex()
            ) from None

    def _bundled(self, loc: Tuple[bytes, int], d: bytes) -> Tuple[bytes, Optional[List[Loc]]]:
        """Node ``d``'s bytes from the bundle at ``loc``, and where its children are stored."""
        b, i = loc
        got = self.bundles.get(b)
        if got is None:
            data = self._object(b, "tree node bundle")
            got = _decode_bundle(data, b, self.what)
            self.bundles.put(b, got, len(data))
        nodes, locs, table = got
        if i >= len(nodes):
            raise _bad_bundle(self.what, b, f"has {len(nodes)} nodes; node {i} is named (blake3:{d.hex()})")
        data = nodes[i]
        if hash_raw(data) != d:
            raise _bad_bundle(self.what, b, f"holds at {i} a node hashing to {hash_bytes(data)}, where a parent "
                                            f"names blake3:{d.hex()} there")
        raw = locs[i]
        if raw is None:
            return data, None
        out: List[Loc] = []
        for x in raw:
            if x is None:
                out.append(None)
            elif type(x) is int and 0 <= x < i:  # (an earlier node: no node is its own descendant)
                out.append((b, x))
            elif (type(x) is list and len(x) == 2 and type(x[0]) is int and 0 <= x[0] < len(table)
                  and type(x[1]) is int and 0 <= x[1] < MAX_BUNDLE_NODES):
                out.append((table[x[0]], x[1]))
            else:
                raise _bad_bundle(self.what, b, f"has a malformed location {x!r:.80} for a child of node {i} "
                                                "(expected nil, an earlier index, or [table index, index])")
        return data, out

    def prefetch(self, refs: Iterable[Ref]) -> None:
        """Hint the source to start reading nodes about to be read (those neither pending nor cached)."""
        if self.source is None:
            return
        want: Dict[bytes, None] = {}
        for r in refs:
            if r[1] in self.pending or _at(r) in self.cache:
                continue
            loc = r[4]
            if loc is None:
                want[r[1]] = None
            elif loc[0] not in self.bundles:
                want[loc[0]] = None
        if len(want) > 1:  # one object gains nothing from the hint
            self.source.prefetch([Digest.from_bytes(d) for d in want])

    def _check(self, stats: _Stats, ref: Ref, lo: Optional[str], root: bool) -> None:
        first, last, count, total = stats
        d = ref[1]
        if lo is not None and first <= lo:
            raise _bad(self.what, d, f"starts at {first!r:.200}, outside its parent's range (after {lo!r:.200})")
        if not root and last != ref[0]:
            raise _bad(self.what, d, f"ends at {last!r:.200}, but its parent says {ref[0]!r:.200}")
        if count != ref[2] or total != ref[3]:
            raise _bad(self.what, d, f"holds {count} entries of {total} bytes, but its parent says "
                                     f"{ref[2]} entries of {ref[3]} bytes")


# -- the map ----------------------------------------------------------------------------


class TreeEntryMap(EntryMap):
    """The entries of a tree-shaped version: the :class:`EntryMap` API, reading nodes as needed.

    ``len()`` comes from the root's count; a lookup reads one node per level;
    iteration streams the leaves; :meth:`with_changes` returns a map whose new
    nodes are kept in memory until :func:`shape_for_store` hands them to
    ``put_version``.
    """

    __slots__ = ("_root", "_level", "_reader")

    def __init__(self) -> None:
        super().__init__()
        self._root: Ref = ("", b"", 0, 0, None)
        self._level = 0
        self._reader = _Reader(None, {}, "manifest")

    @classmethod
    def _make(cls, root: Ref, level: int, reader: _Reader) -> TreeEntryMap:
        m = cls()
        m._root, m._level, m._reader = root, level, reader
        return m

    @property
    def is_tree(self) -> bool:
        """Always True here."""
        return True

    @property
    def root(self) -> Digest:
        """Digest of the root node."""
        return Digest(self._root[1].hex())

    @property
    def depth(self) -> int:
        """Levels of nodes (1: the root is a leaf)."""
        return self._level + 1

    @property
    def total_bytes(self) -> int:
        """Sum of the entries' recorded sizes (entries without a size count 0)."""
        return self._root[3]

    def tree_header(self) -> Optional[List[Any]]:
        """``[root digest bytes, root level, entry count, byte total]`` (the version object's ``"tree"``),
        and ``[bundle digest bytes, index]`` after them where the root is in a bundle (format 3)."""
        r = self._root
        head: List[Any] = [r[1], self._level, r[2], r[3]]
        if r[4] is not None:
            head += [r[4][0], r[4][1]]
        return head

    # Mapping
    def __len__(self) -> int:
        return self._root[2]

    def _leaf(self, key: str) -> Optional[Dict[str, Raw]]:
        """The leaf whose key range holds ``key`` (one node read per level), or ``None`` past the last key."""
        r = self._reader
        ref, level, lo, root = self._root, self._level, None, True
        while level > 0:
            node = r.node(ref, level, lo, root)
            assert isinstance(node, tuple)
            keys, refs = node
            i = bisect.bisect_left(keys, key)
            if i == len(keys):
                return None
            lo = keys[i - 1] if i else lo
            ref, level, root = refs[i], level - 1, False
        leaf = r.node(ref, 0, lo, root)
        assert isinstance(leaf, dict)
        return leaf

    def raw(self, key: str) -> Optional[Raw]:
        """The encoded entry of ``key`` (one node read per level), or ``None``."""
        if type(key) is not str:
            return None
        leaf = self._leaf(key)
        return None if leaf is None else leaf.get(key)

    def __getitem__(self, key: str) -> Entry:
        raw = self.raw(key)
        if raw is None:
            raise KeyError(key)
        return entry_from_raw(raw)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.raw(key) is not None

    def __iter__(self) -> Iterator[str]:
        for k, _raw in self.raw_items():
            yield k

    def raw_items(self) -> Iterator[Tuple[str, Raw]]:
        """``(key, encoded entry)`` in key order, streamed leaf by leaf (memory: one node per level)."""
        r = self._reader
        # A large tree's leaves stay out of the node cache (they would evict the upper levels).
        small = self._level < 2
        stack: List[Tuple[Ref, int, Optional[str], bool]] = [(self._root, self._level, None, True)]
        # One thread reads, verifies and decodes each node in turn.  Reading leaves ahead on a pool
        # (what this did until 2026-12-02) cost 3x on a warm page cache (10,000 entries: 105 ms
        # against 35 ms; every node a future and a GIL hand-off) and gained nothing cold (178
        # against 185 ms after drop_caches).
        while stack:
            ref, level, lo, root = stack.pop()
            node = r.node(ref, level, lo, root, cache=small or level > 0)
            if isinstance(node, dict):
                yield from node.items()
                continue
            keys, refs = node
            for i in range(len(refs) - 1, -1, -1):
                stack.append((refs[i], level - 1, keys[i - 1] if i else lo, False))

    def ceiling(self, key: str) -> Optional[str]:
        """The first key ``>= key``, or ``None`` (one node read per level)."""
        leaf = self._leaf(key)
        if leaf is None:
            return None
        ks = list(leaf)
        i = bisect.bisect_left(ks, key)
        return ks[i] if i < len(ks) else None

    def same(self, key: str, other: EntryMap) -> bool:
        """See :meth:`EntryMap.same`."""
        a, b = self.raw(key), other.raw(key)
        if a is None or b is None:
            raise KeyError(key)
        return same_raw(a, b)

    def diff_raw(self, other: EntryMap) -> Iterator[Tuple[str, Optional[Raw], Optional[Raw]]]:
        """See :meth:`EntryMap.diff_raw`; subtrees both trees share are skipped unread."""
        if not isinstance(other, TreeEntryMap):
            return merge_diff(self.raw_items(), other.raw_items())
        return merge_diff(*_aligned_streams(self, other))

    def with_changes(self, changes: Mapping[str, Optional[Entry]]) -> EntryMap:
        """A new map with ``changes`` applied; only nodes on the paths to changed keys are rebuilt."""
        todo: List[Tuple[str, Optional[Raw]]] = []
        plain = _keys_plainly_valid(list(changes))  # (one bulk check; each key alone only when it fails)
        for k, e in changes.items():
            if not plain:
                validate_key(k)
            if e is not None and not isinstance(e, Entry):
                raise InvalidTypeError(f"manifest entry {k!r:.200} must be an Entry, not {type(e).__name__}")
            todo.append((k, entry_to_raw(e) if e is not None else None))
        if not todo:
            return self
        todo.sort(key=lambda t: t[0])
        w = _Writer(self._reader.pending)
        b = _Builder(w)
        _update(self._reader, self._root, self._level, todo, b)
        got = b.finish(self._reader)
        reader = _Reader(self._reader.source, w.new, self._reader.what)
        if got is None:
            return EntryMap()
        return TreeEntryMap._make(got[0], got[1], reader)

    def __repr__(self) -> str:
        return f"<TreeEntryMap {len(self)} entries, depth {self.depth}, root {self.root.short()}>"


def _update(r: _Reader, root: Ref, root_level: int, changes: List[Tuple[str, Optional[Raw]]], b: _Builder) -> None:
    """Feed the old tree with ``changes`` (sorted) merged in to ``b``, reusing untouched nodes whole."""
    keys = [c[0] for c in changes]
    ci = 0

    def walk(ref: Ref, level: int, lo: Optional[str], last: bool, root: bool) -> None:
        nonlocal ci
        hi = ref[0]
        touched = ci < len(changes) and (last or keys[ci] <= hi)
        if not touched and not root and b.clean_upto(level):
            b.add_ref(level + 1, ref)  # shared with the old version, unread
            return
        node = r.node(ref, level, lo, root)
        if isinstance(node, dict):
            end = len(changes) if last else bisect.bisect_right(keys, hi, ci)
            if ci == end:
                for k, v in node.items():
                    b.add_entry(k, v)
                return
            merged = dict(node)
            added = removed = False
            for k, nv in changes[ci:end]:
                if nv is None:
                    removed = merged.pop(k, None) is not None or removed
                else:
                    added = added or k not in merged
                    merged[k] = nv
            ci = end
            if not added and not removed and b.clean_upto(0):
                # The same keys with new values (a folder's modified files): boundaries depend on
                # keys only, so the leaf ends where it did and is rebuilt whole, without ranking
                # each of its keys again (see _Builder.learn for the levels above).
                b.add_leaf(list(merged.items()))
                return
            for k in (sorted(merged) if added else list(merged)):
                b.add_entry(k, merged[k])
            return
        ks, refs = node
        b.learn(level, ks)
        n = len(refs)
        for i in range(n):
            walk(refs[i], level - 1, ks[i - 1] if i else lo, last and i == n - 1, False)  # noqa: F821 (see below)

    _announce(r, root, root_level, keys)
    try:
        walk(root, root_level, None, True, True)
    finally:
        # A recursive closure refers to itself (through its own cell): left so, it kept the commit's
        # changes and the nodes it read alive until a pass of the cyclic collector (~1,200 objects a
        # 1% folder add), which then had them to traverse.
        del walk


def _announce(r: _Reader, root: Ref, root_level: int, keys: List[str]) -> None:
    """Name to the store, level by level, the nodes the commit of changes to ``keys`` will read.

    Hazard (issue 12): these are small files the page cache may have let go of (this VM pages out
    what was idle for a minute); read one by one after a miss, a 1% add of 10,000 files waited on
    ~36 disk reads of 2-3 ms each.  Here the touched inner nodes of each level are read (they name
    the next level; the walk then finds them decoded in the node cache) after the whole level was
    announced (:meth:`NodeSource.prefetch`), so the disk serves a level's misses together.
    """
    level: List[Tuple[Ref, Optional[str], bool]] = [(root, None, True)]  # (ref, lo, last)
    lv = root_level
    while level and lv > 0:
        below: List[Tuple[Ref, Optional[str], bool]] = []
        for ref, lo, last in level:
            node = r.node(ref, lv, lo, ref is root)
            if isinstance(node, dict):  # pragma: no cover - an inner level holds inner nodes (validated)
                continue
            ks, refs = node
            ci = bisect.bisect_right(keys, lo) if lo is not None else 0
            n = len(refs)
            below.extend((refs[i], ks[i - 1] if i else lo, last and i == n - 1)
                          for i in _touched(refs, keys, ci, last))
        r.prefetch(b[0] for b in below)
        level = below
        lv -= 1


def _touched(refs: Sequence[Ref], keys: Sequence[str], ci: int, last: bool) -> List[int]:
    """Indexes of the children of an inner node whose key range holds a change (from ``keys[ci:]``)."""
    touched: List[int] = []
    n = len(refs)
    j = ci
    for i in range(n):
        if j >= len(keys):
            break
        if (last and i == n - 1) or keys[j] <= refs[i][0]:
            touched.append(i)
            j = bisect.bisect_right(keys, refs[i][0], j)
    return touched


def _aligned_streams(a: TreeEntryMap, b: TreeEntryMap) -> Tuple[Iterator[Tuple[str, Raw]], Iterator[Tuple[str, Raw]]]:
    """Two entry streams that skip, in both at once, every subtree both trees share (same digest).

    Each side is a cursor over a stack of unexpanded nodes; a shared node is
    skipped only when it heads both stacks, i.e. everything before it has been
    consumed on both sides: its entries are the same run in both sorted
    streams, so the merge of what remains is unchanged.  Canonical trees
    re-align at node boundaries right after a change.
    """
    State = List[Tuple[Ref, int, Optional[str], bool]]
    sa: State = [(a._root, a._level, None, True)]
    sb: State = [(b._root, b._level, None, True)]
    buf_a: List[Tuple[str, Raw]] = []
    buf_b: List[Tuple[str, Raw]] = []

    def expand(st: State, r: _Reader, buf: List[Tuple[str, Raw]]) -> None:
        ref, level, lo, root = st.pop()
        node = r.node(ref, level, lo, root, cache=False)
        if isinstance(node, dict):
            buf.extend(reversed(list(node.items())))
            return
        ks, refs = node
        for i in range(len(refs) - 1, -1, -1):
            st.append((refs[i], level - 1, ks[i - 1] if i else lo, False))

    def fill(own: State, r: _Reader, buf: List[Tuple[str, Raw]], other: State, r_other: _Reader) -> None:
        # Called when ``own``'s buffer is empty.  The sides descend in step: the head of the higher
        # level is expanded first (the other side's only if it is internal: its children go on its
        # stack, whatever its buffer holds), so equal subtrees meet as heads and are skipped.
        while own:
            # The whole record, not only the digest (found by a bug hunt: a hostile version whose record
            # of a shared node lies about its count diffed as "the same" against the honest one): a
            # different record of the same node is expanded on both sides, and the liar fails its check.
            if other and own[-1][0] == other[-1][0] and own[-1][1] == other[-1][1]:
                # Buffers need not be empty: a stack head is the next unexpanded run of its side, and
                # dropping the same run from both sides leaves the merge's output as it is.
                own.pop()
                other.pop()
                continue
            if other and other[-1][1] > own[-1][1]:
                expand(other, r_other, [])  # internal (level > own's >= 0): pushes children only
                continue
            level = own[-1][1]
            expand(own, r, buf)
            if level == 0:
                return

    def gen(own: State, r: _Reader, buf: List[Tuple[str, Raw]], other: State,
            r_other: _Reader) -> Iterator[Tuple[str, Raw]]:
        while True:
            if not buf:
                fill(own, r, buf, other, r_other)
                if not buf:
                    return
            yield buf.pop()

    return gen(sa, a._reader, buf_a, sb, b._reader), gen(sb, b._reader, buf_b, sa, a._reader)


def open_tree(header: object, objects: Optional[NodeSource], what: str, *, bundled: bool = False) -> TreeEntryMap:
    """The entries of a format-2 version (``bundled``: format 3) from its ``"tree"`` header;
    StoreFormatError if it is malformed."""
    n = 6 if bundled else 4
    if not (type(header) is list and len(header) == n and type(header[0]) is bytes and len(header[0]) == 32
            and type(header[1]) is int and 0 <= header[1] <= MAX_LEVEL and type(header[2]) is int
            and header[2] > 0 and type(header[3]) is int and header[3] >= 0
            and (not bundled or (type(header[4]) is bytes and len(header[4]) == 32 and type(header[5]) is int
                                 and 0 <= header[5] < MAX_BUNDLE_NODES))):
        where = f", 32-byte bundle digest, index 0..{MAX_BUNDLE_NODES - 1}" if bundled else ""
        raise StoreFormatError(
            f"{what} has a malformed tree header ({header!r:.120}); expected [32-byte root digest, "
            f"level 0..{MAX_LEVEL}, entry count > 0, byte total >= 0{where}]"
        )
    assert isinstance(header, list)
    loc: Loc = (header[4], header[5]) if bundled else None
    m = TreeEntryMap._make(("", header[0], header[2], header[3], loc), header[1], _Reader(objects, {}, what))
    if objects is not None:
        # The root is read (verified, validated against the header's level, count and byte total)
        # now: len() answers from the header, which must not be a hostile number.
        m._reader.node(m._root, m._level, None, True)
    return m


def build_tree(items: Iterator[Tuple[str, Raw]], objects: Optional[NodeSource], what: str = "manifest") -> EntryMap:
    """A tree of sorted, validated ``(key, encoded entry)`` items, nodes kept in memory until stored."""
    w = _Writer()
    b = _Builder(w)
    for k, v in items:
        b.add_entry(k, v)
    got = b.finish()
    if got is None:
        return EntryMap()
    return TreeEntryMap._make(got[0], got[1], _Reader(objects, w.new, what))


def shape_for_store(entries: EntryMap, objects: NodeSource) -> Tuple[EntryMap, List[bytes]]:
    """The form ``entries`` are stored in (flat up to :data:`TREE_THRESHOLD`, a tree above) and the
    objects to write first: the new nodes in bundles (:func:`_bundle_nodes`), children before parents."""
    n = len(entries)
    if n <= TREE_THRESHOLD:
        if not entries.is_tree:
            return entries, []
        flat = EntryMap.from_entries({})
        return flat.with_changes({k: entry_from_raw(v) for k, v in entries.raw_items()}), []
    if not isinstance(entries, TreeEntryMap):
        entries = build_tree(entries.raw_items(), objects)
        assert isinstance(entries, TreeEntryMap)
    bundles, placed = _bundle_nodes(entries._reader.pending)
    r = entries._root
    root: Ref = (r[0], r[1], r[2], r[3], placed.get(r[1], r[4]))
    # Stored from now on: readers of this map read them from the store (and pending can be dropped).
    return TreeEntryMap._make(root, entries._level, _Reader(objects, {}, entries._reader.what)), bundles


def _bundle_nodes(new: Dict[bytes, Tuple[bytes, int, Node]]) -> Tuple[List[bytes], Dict[bytes, Tuple[bytes, int]]]:
    """Encode new nodes (children before parents) into bundles; returns them and where each node went.

    A bundle: ``{"casstore": "manifest-bundle", "nodes": [node bytes...], "locs": [per node: nil for a
    leaf, else one location per child], "bundles": [bundle digests the locations name]}``; a child's
    location is nil (an object of its own), an int (an earlier node of this bundle) or ``[t, i]``
    (node ``i`` of bundle ``bundles[t]``).  Children come first, so a bundle is closed (its digest
    known) before any later one names it.
    """
    out: List[bytes] = []
    placed: Dict[bytes, Tuple[bytes, int]] = {}
    here: Dict[bytes, int] = {}  # node -> index, in the bundle being filled
    nodes: List[bytes] = []
    locs: List[Optional[List[Any]]] = []
    table: Dict[bytes, int] = {}
    size = 0

    def close() -> None:
        nonlocal size
        data = pack({"casstore": BUNDLE_KIND, "bundles": list(table), "locs": locs, "nodes": nodes})
        b = hash_raw(data)
        out.append(data)
        for d, i in here.items():
            placed[d] = (b, i)
        here.clear()
        del nodes[:], locs[:]
        table.clear()
        size = 0

    for d, (data, level, node) in new.items():
        if nodes and (len(nodes) >= BUNDLE_NODES or size + len(data) > BUNDLE_BYTES):
            close()
        mine: Optional[List[Any]] = None
        if level > 0:
            assert isinstance(node, tuple)
            mine = []
            for r in node[1]:
                i = here.get(r[1])
                if i is not None:
                    mine.append(i)
                    continue
                loc = placed.get(r[1], r[4])
                assert loc is not None or r[1] not in new, "a new node before its children"
                if loc is None:
                    mine.append(None)
                else:
                    t = table.get(loc[0])
                    if t is None:
                        t = table[loc[0]] = len(table)
                    mine.append([t, loc[1]])
        here[d] = len(nodes)
        nodes.append(data)
        locs.append(mine)
        size += len(data)
    if nodes:
        close()
    return out, placed


def file_dir_clash(keys: Iterable[str]) -> Optional[Tuple[str, str]]:
    """The first ``(key, key under it)`` pair among ``keys`` where one key is also the directory of another
    (``"a"`` and ``"a/b"``: such a version can never be checked out), or ``None``.

    ``edit`` refuses the pair when a key is added; a version from elsewhere (a pull) is checked whole with
    this: one set of the keys and a lookup per directory level of each key.
    """
    have: Set[str] = set()
    nested: List[str] = []
    for k in keys:
        have.add(k)
        if "/" in k:
            nested.append(k)
    for k in nested:
        at = k.find("/")
        while at >= 0:
            if k[:at] in have:
                return k[:at], k
            at = k.find("/", at + 1)
    return None


SeenNodes = Dict[bytes, Tuple[int, _Stats]]
"""Tree nodes a walk has read and checked whole (its subtree too): node at its location (:func:`_at`) ->
(level, what a parent records of it).  :func:`walk_tree` skips them, after checking the parent's record of
them here.  Bundles already yielded are in it too, as their digest -> :data:`_BUNDLE_MARK`."""
_BUNDLE_MARK: Tuple[int, _Stats] = (-1, ("", "", 0, 0))


def seen_objects(seen: SeenNodes) -> Set[Digest]:
    """The objects holding the nodes in ``seen`` (node objects and bundles): what a pull must have."""
    return {Digest.from_bytes(at[32:64] if len(at) > 32 else at) for at in seen}


def walk_tree(entries: EntryMap, seen: SeenNodes) -> Iterator[Tuple[str, str, Optional[int]]]:
    """``(key, digest hex, size)`` of entries, and ``("", hex, None)`` of the objects holding nodes (a
    node object of its own, or a bundle, once), skipping every node in ``seen`` (and adding those
    visited, once the whole walk succeeded): gc and push visit each shared node once.

    Hazards (found by a bug hunt): a node was added to ``seen`` before it was read, so a walk that failed
    on it (a hostile version whose record of a shared node lies) left that node "seen", and the next
    version sharing it was not walked below it: gc deleted 4,763 of a valid input's 5,000 objects.  And a
    node reached again through another parent was skipped without checking that parent's record of it, so
    verify passed a head every reader refuses, depending on which name was walked first.  Now the walk
    keeps its own set, merged into ``seen`` only when it ends without an error, and a skipped node is
    checked against each record that names it (level, key range, count, total: no read).
    """
    if not isinstance(entries, TreeEntryMap):
        yield from entries.hex_items()
        return
    r = entries._reader
    mine: SeenNodes = {}
    stack: List[Tuple[Ref, int, Optional[str], bool]] = [(entries._root, entries._level, None, True)]
    done = False
    try:
        while stack:
            ref, level, lo, root = stack.pop()
            d, loc, at = ref[1], ref[4], _at(ref)
            known = seen.get(at) or mine.get(at)
            if known is not None and known[0] >= 0:  # (not a bundle's mark: a hostile ref naming one as a node)
                if known[0] != level:
                    raise _bad(r.what, d, f"is a level-{known[0]} node, but its parent places it at level {level}")
                r._check(known[1], ref, lo, root)
                continue
            if loc is None:
                yield "", d.hex(), None
            elif loc[0] not in mine and loc[0] not in seen:
                yield "", loc[0].hex(), None  # the bundle, once (yielded before it is read, as a node)
                mine[loc[0]] = _BUNDLE_MARK
            node = r.node(ref, level, lo, root, cache=False)
            mine[at] = (level, _stats(node))
            if isinstance(node, dict):
                for k, v in node.items():
                    yield k, v[0].hex(), v[1]
                continue
            ks, refs = node
            for i in range(len(refs) - 1, -1, -1):
                stack.append((refs[i], level - 1, ks[i - 1] if i else lo, False))
        done = True
    finally:
        if done:
            seen.update(mine)
