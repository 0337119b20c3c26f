"""Property tests for manifests (issue 3): edits against a dict model, canonical encoding, fuzzed input."""

from __future__ import annotations

import atexit
import copy
import os
import posixpath
import random
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import msgpack
from _manifest_helpers import canonical_packb, raw_manifest_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casstore
from casstore import Digest, Entry, InvalidInputError, StoreFormatError
from casstore.manifests import Manifest, decode_manifest, encode_manifest, validate_key

BLOBS = [b"", b"one", b"two two", b"three " * 50]
KEYS = ["a", "b/c", "b/d", "z.bin", "ü/x", "deep/er/key"]
META_KEYS = ["lr", "git", "cfg", "tags"]

meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8)
    | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)

meta_op = st.one_of(
    st.tuples(st.just("mset"), st.sampled_from(META_KEYS),
              meta_values | st.dictionaries(st.sampled_from(["x", "y"]), meta_values, max_size=2)),
    st.tuples(st.just("mdel"), st.sampled_from(META_KEYS)),
    st.tuples(st.just("mnest"), st.sampled_from(META_KEYS), st.sampled_from(["x", "y"]), meta_values),
)
op = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), st.integers(0, len(BLOBS) - 1),
              st.none() | st.dictionaries(st.sampled_from(["epoch", "note"]), meta_values, max_size=2)),
    st.tuples(st.just("del"), st.sampled_from(KEYS)),
    meta_op,
)
# (ops, abort?); some transactions touch only the manifest metadata.
transaction = st.tuples(st.lists(op, max_size=6) | st.lists(meta_op, max_size=4), st.booleans())


class Abort(Exception):
    pass


Snapshot = Tuple[Dict[str, Tuple[int, Dict[str, Any]]], Dict[str, Any]]


def _check_version(man: Manifest, snap: Snapshot, digests: List[Digest]) -> None:
    entries, meta = snap
    assert sorted(man) == sorted(entries)
    for k, (blob, emeta) in entries.items():
        e = man[k]
        assert e.digest == digests[blob] and e.size == len(BLOBS[blob])
        assert dict(e.meta) == emeta
    assert dict(man.meta) == meta
    # Bit-for-bit: the stored bytes are the canonical encoding of the model.
    enc = {k: [digests[b].raw, len(BLOBS[b])] + ([em] if em else []) for k, (b, em) in entries.items()}
    doc = {"casstore": "manifest", "entries": enc, "meta": meta,
           "parent": man.parent.raw if man.parent else None, "v": 1}
    assert man.digest == Digest.of(canonical_packb(doc))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(transaction, min_size=1, max_size=8))
def test_edits_match_a_dict_model(txns: List[Tuple[List[Any], bool]]) -> None:
    with tempfile.TemporaryDirectory(prefix="casstore-props-") as tmp:
        store = casstore.open(os.path.join(tmp, "s"), durable=False)
        digests = [store.put(b) for b in BLOBS]
        entries: Dict[str, Tuple[int, Dict[str, Any]]] = {}
        meta: Dict[str, Any] = {}
        snapshots: List[Snapshot] = []
        for ops, abort in txns:
            new_entries = dict(entries)
            new_meta = copy.deepcopy(meta)
            touched = False
            try:
                with store.edit("m") as m:
                    for o in ops:
                        if o[0] == "set":
                            _, k, b, em = o
                            m[k] = Entry(digests[b], meta=em) if em is not None else digests[b]
                            new_entries[k] = (b, em or {})
                            touched = True
                        elif o[0] == "del":
                            if o[1] in new_entries:
                                del m[o[1]]
                                del new_entries[o[1]]
                                touched = True
                            else:
                                assert o[1] not in m
                        elif o[0] == "mset":
                            m.meta[o[1]] = copy.deepcopy(o[2])
                            new_meta[o[1]] = copy.deepcopy(o[2])
                        elif o[0] == "mnest":  # change a value inside a nested map in place
                            if isinstance(new_meta.get(o[1]), dict):
                                m.meta[o[1]][o[2]] = copy.deepcopy(o[3])
                                new_meta[o[1]][o[2]] = copy.deepcopy(o[3])
                        elif o[1] in new_meta:
                            del m.meta[o[1]]
                            del new_meta[o[1]]
                    assert dict(m.meta) == new_meta and sorted(m) == sorted(new_entries)
                    if abort:
                        raise Abort()
            except Abort:
                continue
            if touched or canonical_packb(new_meta) != canonical_packb(meta):
                snapshots.append((new_entries, new_meta))  # every change commits exactly one version
            entries, meta = new_entries, new_meta

        if not snapshots:
            assert store.heads() == {}
            return
        man = store.manifest("m")
        _check_version(man, snapshots[-1], digests)
        h = store.history("m")
        assert len(h) == len(snapshots)
        for version, snap in zip(h, reversed(snapshots), strict=True):
            _check_version(version, snap, digests)
        assert h[-1].parent is None
        assert all(a.parent == b.digest for a, b in zip(h, h[1:], strict=False))


# -- canonical encoding ------------------------------------------------------------------

digests_st = st.binary(min_size=32, max_size=32).map(Digest.from_bytes)
entries_st = st.dictionaries(
    st.text(min_size=1, max_size=6).filter(lambda k: _key_ok_model(k)),  # encode_manifest checks keys too
    st.tuples(digests_st, st.none() | st.integers(0, 2**40),
              st.dictionaries(st.text(max_size=4), meta_values, max_size=3)),
    max_size=6,
)


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same value with every dict rebuilt in a random insertion order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@settings(max_examples=150, deadline=None)
@given(entries_st, st.dictionaries(st.text(max_size=5), meta_values, max_size=5), st.none() | digests_st,
       st.integers(0, 2**32))
def test_encoding_is_canonical_and_independent_of_insertion_order(
        raw: Dict[str, Tuple[Digest, Optional[int], Dict[str, Any]]], meta: Dict[str, Any], parent: Optional[Digest],
        seed: int) -> None:
    rng = random.Random(seed)
    entries = {k: Entry(d, size, m) for k, (d, size, m) in raw.items()}
    data = encode_manifest(entries, meta, parent)
    shuffled = _shuffled({k: (d, size, m) for k, (d, size, m) in raw.items()}, rng)
    entries2 = {k: Entry(d, size, _shuffled(m, rng)) for k, (d, size, m) in shuffled.items()}
    assert encode_manifest(entries2, _shuffled(meta, rng), parent) == data
    # Equal to an independent encoder of the format.md layout.
    enc = {k: [d.raw, size] + ([m] if m else []) for k, (d, size, m) in raw.items()}
    assert data == canonical_packb({"casstore": "manifest", "entries": enc, "meta": meta,
                                    "parent": parent.raw if parent else None, "v": 1})
    # And it decodes back to the same thing.
    man = Manifest(Digest.of(data), decode_manifest(data))
    assert {k: man[k] for k in man} == {k: Entry(d, size, m) for k, (d, size, m) in raw.items()}
    assert dict(man.meta) == meta and man.parent == parent


# -- fuzzed manifest bytes --------------------------------------------------------------


def _decode_all(data: bytes) -> None:
    """Decode like store.manifest does and touch every entry; only StoreFormatError may escape."""
    try:
        doc = decode_manifest(data, Digest.of(data))
    except StoreFormatError:
        return
    man = Manifest(Digest.of(data), doc)
    for k in man:
        try:
            e = man[k]
        except StoreFormatError:
            continue
        assert isinstance(e.digest, Digest) and (e.size is None or e.size >= 0)
    assert isinstance(dict(man.meta), dict)
    assert man.parent is None or isinstance(man.parent, Digest)


_VALID = raw_manifest_bytes({"data/a.bin": [b"\x01" * 32, 7], "b": [b"\x02" * 32, None, {"epoch": 3}]},
                            {"git": "abc", "lr": 0.5, "tags": ["x", "y"]}, parent=b"\x03" * 32)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_store_format_error(data: bytes) -> None:
    _decode_all(data)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, len(_VALID)))
def test_mutated_manifests_only_ever_raise_store_format_error(edits: List[Tuple[int, int]], cut: int) -> None:
    data = bytearray(_VALID)
    for pos, byte in edits:
        data[pos] = byte
    _decode_all(bytes(data[:cut] if cut < len(data) else data))


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.integers(-5, 5) | st.binary(max_size=34) | st.text(max_size=3) | st.booleans()
    | st.text(min_size=32, max_size=32) | st.lists(st.integers(0, 255), min_size=32, max_size=32)
    | st.dictionaries(st.text(max_size=2), st.none(), min_size=32, max_size=32),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
))
def test_arbitrary_entry_values_only_ever_raise_store_format_error(value: Any) -> None:
    _decode_all(raw_manifest_bytes({"k": value}))
    _decode_all(msgpack.packb({"casstore": "manifest", "entries": value, "meta": value, "parent": None, "v": 1}))


# -- key validation --------------------------------------------------------------------


def _key_ok_model(key: str) -> bool:
    """The key rules of docs/format.md, written independently of casstore's code."""
    try:
        n = len(key.encode("utf-8"))  # lone surrogates are not valid Unicode
    except UnicodeEncodeError:
        return False
    if not key or n > 4096 or "\\" in key or key.startswith("/"):
        return False
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in key):  # NUL and every other control character
        return False
    segs = key.split("/")
    return len(segs) <= 256 and all(s not in ("", ".", "..") and len(s.encode("utf-8")) <= 255 for s in segs)


key_st = st.lists(st.sampled_from(["a", "b", ".", "..", "", "/", "\\", "\x00", ":", "é", "x" * 200, "\n", "\x1b",
                                   "\x7f", "\x85", "\udcff", "🙂" * 40, "a/" * 40]),
                  max_size=8).map("".join) | st.text(max_size=20)

_NAMES_STORE: List[casstore.Store] = []


def _names_store() -> casstore.Store:
    if not _NAMES_STORE:
        root = tempfile.mkdtemp(prefix="casstore-names-")
        atexit.register(shutil.rmtree, root, True)
        _NAMES_STORE.append(casstore.open(root, durable=False))
    return _NAMES_STORE[0]


@settings(max_examples=500, deadline=None)
@given(key_st)
def test_key_validation_matches_the_model_and_never_escapes(key: str) -> None:
    try:
        validate_key(key)
        ok = True
    except InvalidInputError:
        ok = False
    assert ok == _key_ok_model(key)
    if ok:
        # Joined to a target directory, an accepted key stays inside it.
        joined = posixpath.normpath(posixpath.join("/target", key))
        assert joined.startswith("/target/") and joined == "/target/" + key
    # Names follow the same rules, and may not contain ':' (reserved for digests), wherever they are used.
    if key.startswith("blake3:"):
        return  # a read target starting with "blake3:" is a digest, not a name
    try:
        _names_store().manifest(key)
        raise AssertionError(f"no manifest can be named {key!r} here")
    except casstore.ObjectNotFoundError:
        name_ok = True
    except (InvalidInputError, casstore.InvalidDigestError):
        name_ok = False
    assert name_ok == (ok and ":" not in key)
