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

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, NoReturn, Optional, Set, Tuple, Union

import msgpack

from .._paths import BAD_CHAR, MAX_KEY_BYTES, MAX_SEGMENT_BYTES, MAX_SEGMENTS, key_problem, validate_key
from ..digest import Digest
from ..errors import InvalidInputError, InvalidTypeError, StoreFormatError

if TYPE_CHECKING:
    from ..objects.base import ObjectStore
    from ..objects.local import LocalObjects

__all__ = [
    "MANIFEST_FORMAT",
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
"""The manifest format (``"v"``); readers refuse versions they do not know."""
MAX_META_DEPTH = 64
"""Deepest nesting of lists and maps in metadata (the metadata map itself is level 1)."""

_KIND = "manifest"
_FIELDS = frozenset({"casstore", "entries", "meta", "parent", "v"})
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
    object.__setattr__(e, "digest", Digest(raw[0].hex()))
    object.__setattr__(e, "size", raw[1])
    object.__setattr__(e, "meta", MappingProxyType(raw[2]) if len(raw) > 2 else _EMPTY)
    return e


def _encode_entry(e: Entry) -> List[Any]:
    # Entry.meta is already canonical (checked and copied in __post_init__).
    return [e.digest.raw, e.size, dict(e.meta)] if e.meta else [e.digest.raw, e.size]


class EntryMap(Mapping[str, Entry]):
    """The entries of a manifest version: ``Mapping[str, Entry]``, keys valid and sorted, immutable.

    Entries are kept in their (validated, canonical) encoded form and become
    :class:`Entry` objects when read, so opening a 100,000-entry version costs
    little more than unpacking it.  Build one with :meth:`from_entries`; a
    decoded version's entries come from :func:`decode_manifest`.
    """

    __slots__ = ("_raw",)

    def __init__(self) -> None:
        self._raw: Dict[str, List[Any]] = {}

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
        """A new map: each key of ``changes`` set to its Entry, or removed where it maps to ``None``."""
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
        a, b = self._raw[key], other._raw[key]
        if a != b:
            return False
        return len(a) < 3 or _pack(a[2]) == _pack(b[2])

    def hex_items(self) -> Iterator[Tuple[str, str, Optional[int]]]:
        """``(key, digest hex, size)`` of every entry, in key order, without making Entry objects.

        For passes over whole stores (gc, verify, usage): making an Entry and a
        Digest per entry doubles their time on 100,000-entry versions.
        """
        for k, v in self._raw.items():
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
        """The canonical msgpack bytes of this version (docs/format.md)."""
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


def decode_manifest(data: Union[bytes, bytearray, memoryview], digest: Optional[Digest] = None) -> ManifestDoc:
    """Decode and validate a manifest version's bytes; :class:`~casstore.errors.StoreFormatError` on anything wrong.

    THE decoder (see the module docstring): every key, entry and metadata
    value is checked before this returns.  ``digest`` names the version in
    error messages.
    """
    return _decode(bytes(data), digest, trusted=False)[0]


def _decode(data: bytes, digest: Optional[Digest], *, trusted: bool) -> Tuple[ManifestDoc, bool]:
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
    if type(v) is int and v > MANIFEST_FORMAT:
        raise StoreFormatError(f"{what} has format {v!r}, newer than this casstore; upgrade it")
    if type(v) is not int or v != MANIFEST_FORMAT:  # format.md: readers refuse versions they do not know
        raise StoreFormatError(f"{what} has unknown format {v!r:.40} (expected {MANIFEST_FORMAT})")
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
    data = objects.read(d, verify=True)
    trusted = d in _VALIDATED  # the bytes hash to d, and d's bytes were validated (and canonical) before
    doc, canonical = _decode(data, d, trusted=trusted)
    if canonical and not trusted:
        _remember(d)
    return doc


def put_version(objects: LocalObjects, doc: ManifestDoc) -> Digest:
    """Store a version as a raw object (docs/format.md: manifest versions are never compressed); its digest.

    The bytes are ``doc.encode()``; a version made by :meth:`ManifestDoc.build`
    or :func:`decode_manifest` is valid, so reading it back skips validation.
    """
    d = objects.put(doc.encode(), compress=False)
    _remember(d)
    return d
