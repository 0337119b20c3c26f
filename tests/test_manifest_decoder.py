"""THE manifest decoder (issues 10, 11): a hostile version is refused wherever it is read, before anything is written.

Attack style: each hostile version is msgpack built by hand (not by casstore's
encoder), stored as an ordinary object with ``store.put``, and a head is
pointed at it by hand (``store.refs.write``, or a ref file written with plain
``open``), as any member of a shared store could.  Then every public way of
reading it is called: ``Store.manifest`` (by name and by digest),
``history`` (of it, and of a good version whose parent it is), ``checkout``
(API and CLI), ``pin`` (with and without ``allow_missing``), ``freeze``,
``edit``, ``diff`` both ways.  Each must raise :class:`StoreFormatError`
naming the version, and leave refs, objects and the checkout target exactly
as they were.

Then the decoder alone, fuzzed with hypothesis: arbitrary bytes and arbitrary
msgpack-shaped documents give a validated ``ManifestDoc`` or a
``CasstoreError``, never another exception; fast, and with memory bounded by
a constant factor of the input's length.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import msgpack
import pytest
from _manifest_helpers import raw_manifest_bytes, ref_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casstore
from casstore import CasstoreError, Digest, Entry, StoreFormatError
from casstore.manifests import (
    EntryMap,
    ManifestDoc,
    decode_manifest,
    encode_manifest,
    read_parent,
    validate_key,
)

PAYLOAD = b"payload"
D = Digest.of(PAYLOAD)
R = D.raw


def _deep(levels: int) -> Any:
    v: Any = 1
    for _ in range(levels):
        v = [v]
    return v


# name -> (entries, meta, extra top-level fields, what the message must name)
HOSTILE: Dict[str, Tuple[Dict[Any, Any], Dict[str, Any], Dict[str, Any], str]] = {
    # keys
    "dotdot": ({"-good": [R, 7], "../escape": [R, 7]}, {}, {}, "'../escape'"),
    "dotdot-deep": ({"a/../../../escape": [R, 7]}, {}, {}, "a/../../../escape"),
    "absolute": ({"/tmp/abs-escape": [R, 7]}, {}, {}, "/tmp/abs-escape"),
    "empty-key": ({"": [R, 7]}, {}, {}, "''"),
    "empty-segment": ({"a//b": [R, 7]}, {}, {}, "a//b"),
    "trailing-slash": ({"a/": [R, 7]}, {}, {}, "'a/'"),
    "dot": ({"./a": [R, 7]}, {}, {}, "./a"),
    "nul": ({"a\x00b": [R, 7]}, {}, {}, "NUL"),
    "backslash": ({"..\\escape": [R, 7]}, {}, {}, "backslash"),
    "newline": ({"a\nb": [R, 7]}, {}, {}, "U+000A"),
    "escape-sequence": ({"\x1b[2Jx": [R, 7]}, {}, {}, "U+001B"),
    "c1-control": ({"a\x85b": [R, 7]}, {}, {}, "U+0085"),
    "bytes-key": ({b"k": [R, 7]}, {}, {}, "b'k'"),
    "too-long": ({"k" * 5000: [R, 7]}, {}, {}, "bytes long"),
    "too-deep": ({"a/" * 300 + "b": [R, 7]}, {}, {}, "segments"),
    "long-segment": ({"a/" + "s" * 256: [R, 7]}, {}, {}, "255 bytes"),
    # entries
    "digest-31": ({"k": [R[:31], 7]}, {}, {}, "malformed"),
    "digest-33": ({"k": [R + b"\x00", 7]}, {}, {}, "malformed"),
    "digest-str": ({"k": [D.hex, 7]}, {}, {}, "malformed"),
    "size-bool": ({"k": [R, True]}, {}, {}, "malformed"),
    "size-negative": ({"k": [R, -7]}, {}, {}, "malformed"),
    "size-float": ({"k": [R, 7.0]}, {}, {}, "malformed"),
    "size-str": ({"k": [R, "7"]}, {}, {}, "malformed"),
    "meta-list": ({"k": [R, 7, [1]]}, {}, {}, "malformed"),
    "meta-str": ({"k": [R, 7, "m"]}, {}, {}, "malformed"),
    "entry-extra-field": ({"k": [R, 7, {}, "extra"]}, {}, {}, "malformed"),
    "entry-a-map": ({"k": {"digest": R, "size": 7}}, {}, {}, "malformed"),
    "entry-meta-too-deep": ({"k": [R, 7, {"x": _deep(100)}]}, {}, {}, "deep"),
    "entry-meta-ext": ({"k": [R, 7, {"x": msgpack.ExtType(1, b"")}]}, {}, {}, "extension"),
    # the document
    "meta-too-deep": ({"k": [R, 7]}, {"x": _deep(100)}, {}, "deep"),
    "meta-bytes-key": ({"k": [R, 7]}, {b"x": 1}, {}, "str"),  # type: ignore[dict-item]
    "extra-field": ({"k": [R, 7]}, {}, {"owner": "mallory"}, "'owner'"),
}


def _hostile_bytes(case: str) -> bytes:
    entries, meta, extra, _ = HOSTILE[case]
    return raw_manifest_bytes(entries, meta, **extra)


def _tree(root: Path) -> Dict[str, bytes]:
    """Every path under ``root`` with its content (directories and links marked), without following links."""
    out: Dict[str, bytes] = {}
    if not root.exists():
        return out
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.join(dirpath, d)] = b"<dir>"
        for f in files:
            p = os.path.join(dirpath, f)
            out[p] = b"<link>" if os.path.islink(p) else Path(p).read_bytes()
    return out


def _state(store: casstore.Store) -> Dict[str, bytes]:
    """What a read must never change: refs, objects and staging files (lock files may be created)."""
    out: Dict[str, bytes] = {}
    for sub in ("refs", "objects", "tmp"):
        out.update(_tree(store.root / sub))
    return out


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    s = casstore.open(tmp_path / "store")
    assert s.put(PAYLOAD) == D
    return s


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_version_is_refused_wherever_it_is_read(store: casstore.Store, tmp_path: Path, case: str) -> None:
    data = _hostile_bytes(case)
    d = store.put(data)
    must_name = HOSTILE[case][3]
    with store.edit("good") as m:
        m["k"] = D
    good = store.heads()["good"]
    child = store.put(encode_manifest({"k": Entry(D, 7)}, {}, d))  # a good version whose parent is hostile
    store.refs.write("heads", "bad", d)
    store.refs.write("heads", "child", child)
    if case == "dotdot":  # also a ref file written without casstore at all
        ref_file(store.root, "heads", "bad2").write_text(f"{d}\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    out = tmp_path / "out"
    before, before_outside = _state(store), _tree(tmp_path / "outside")

    def refused(action: Callable[[], Any]) -> StoreFormatError:
        with pytest.raises(StoreFormatError) as ei:
            action()
        assert isinstance(ei.value, CasstoreError)
        return ei.value

    e = refused(lambda: store.manifest("bad"))
    assert str(d) in str(e) and must_name in str(e), str(e)
    if case == "dotdot":
        refused(lambda: store.manifest("bad2"))
    refused(lambda: store.manifest(d))
    refused(lambda: store.manifest(str(d)[:20]))
    refused(lambda: store.history("bad"))
    refused(lambda: store.history("child"))
    refused(lambda: store.history(child, limit=2))
    assert [v.digest for v in store.history("child", limit=1)] == [child]  # the child itself is fine
    refused(lambda: store.checkout("bad", out))
    refused(lambda: store.checkout(d, out, overwrite=True))
    refused(lambda: store.pin("p", d))
    refused(lambda: store.pin("p", d, allow_missing=True))
    refused(lambda: store.pin("p", "bad", allow_missing=True, force=True))
    refused(lambda: store.freeze("bad"))
    refused(lambda: store.diff(good, d))
    refused(lambda: store.diff("bad", "good"))
    for _attempt in range(2):  # the failed edit released its lock: a second one fails the same way at once
        with pytest.raises(StoreFormatError):
            with store.edit("bad", timeout=0) as m:
                m["new"] = D
    assert _state(store) == before  # no ref moved, no object or staging file written
    assert store.heads() == {"bad": d, "child": child, "good": good} | ({"bad2": d} if case == "dotdot" else {})
    assert store.pins() == {}
    assert not out.exists()  # a refused checkout creates nothing, not even its target
    assert _tree(tmp_path / "outside") == before_outside


def test_the_cli_refuses_a_hostile_version_in_one_line(store: casstore.Store, tmp_path: Path) -> None:
    d = store.put(_hostile_bytes("dotdot"))
    store.refs.write("heads", "bad", d)
    out = tmp_path / "out"
    for args in (["checkout", "bad", str(out)], ["checkout", str(d), str(out), "--overwrite"]):
        r = subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store.root), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, r
        assert "Traceback" not in r.stderr and str(d) in r.stderr, r.stderr
        assert not out.exists()
    assert not (tmp_path / "escape").exists()


def test_a_valid_version_round_trips_and_normalizes_what_it_may(store: casstore.Store) -> None:
    """Hand-made but valid: unsorted keys and metadata, empty entry metadata. Read, canonical on re-encode."""
    data = msgpack.packb({"v": 1, "parent": None, "meta": {"z": 1, "a": [1, {"y": 2, "b": 3}]},
                          "entries": {"z": [R, 7, {}], "a/b": [R, None, {"q": 1, "c": 2}]}, "casstore": "manifest"},
                         use_bin_type=True)
    doc = decode_manifest(data, Digest.of(data))
    assert list(doc.entries) == ["a/b", "z"] and list(doc.meta) == ["a", "z"]
    assert doc.entries["z"] == Entry(D, 7) and list(doc.entries["a/b"].meta) == ["c", "q"]
    again = decode_manifest(doc.encode())
    assert again == doc and again.encode() == doc.encode()
    assert doc.encode() == encode_manifest(dict(doc.entries), dict(doc.meta), None)
    d = store.put(data)
    assert store.pin("hand-made", d) == d and sorted(store.manifest("hand-made")) == ["a/b", "z"]


def test_read_parent_never_raises_and_reads_only_the_link() -> None:
    parent = Digest.of(b"parent")
    assert read_parent(encode_manifest({}, {}, parent)) == parent
    assert read_parent(encode_manifest({}, {}, None)) is None
    assert read_parent(raw_manifest_bytes({"../x": [R, 7]}, parent=parent.raw)) == parent  # gc walks expired history
    for junk in (b"", b"\xc1", b"\x91" * 5000 + b"\xc0", b"\xdd\x80\x00\x00\x00", raw_manifest_bytes({}, parent=b"x")):
        assert read_parent(junk) is None


# -- hostile sizes: bounded time and memory ------------------------------------------------------------


def _measure(data: bytes) -> Tuple[int, float]:
    """Peak bytes allocated (tracemalloc) and seconds taken by decode_manifest + read_parent of ``data``."""
    tracemalloc.start()
    t = time.perf_counter()
    try:
        try:
            decode_manifest(data)
        except CasstoreError:
            pass
        read_parent(data)
        return tracemalloc.get_traced_memory()[1], time.perf_counter() - t
    finally:
        tracemalloc.stop()


# A version expands in memory by a bounded factor of its length: the worst msgpack can do is one
# byte per empty map (a Python dict), and metadata is copied once in canonical form.
FACTOR = 256
SLACK = 1 << 20


@pytest.mark.parametrize("data", [
    b"\xdd\x80\x00\x00\x00" + b"\xc0" * 8,  # an array claiming 2**31 elements, in 13 bytes
    b"\xdf\xff\xff\xff\xff" + b"\xc0" * 8,  # a map claiming 2**32-1 pairs
    b"\xc6\x7f\xff\xff\xff" + b"x" * 8,  # a 2 GiB bin
    b"\xdb\x7f\xff\xff\xff" + b"x" * 8,  # a 2 GiB str
    b"\x91" * 100_000 + b"\xc0",  # nesting far past msgpack's stack
    b"\xdd" + struct.pack(">I", 50_000) + b"\x80" * 50_000,  # 50,000 empty maps
    raw_manifest_bytes({}, {"k": [{} for _ in range(50_000)]}),
    raw_manifest_bytes({f"k{i}": [R, i] for i in range(20_000)}),
], ids=["array32", "map32", "bin32", "str32", "nesting", "empty-maps", "meta-empty-maps", "20k-entries"])
def test_hostile_sizes_are_bounded_in_time_and_memory(data: bytes) -> None:
    peak, seconds = _measure(data)
    assert peak <= FACTOR * len(data) + SLACK, (peak, len(data))
    assert seconds < 10


# -- fuzzing ---------------------------------------------------------------------------------------


def _check_doc(doc: ManifestDoc) -> None:
    """What a returned version guarantees: valid keys, well-formed entries, re-encodable to the same version."""
    assert isinstance(doc, ManifestDoc) and isinstance(doc.entries, EntryMap)
    assert list(doc.entries) == sorted(doc.entries)
    for k, e in doc.entries.items():
        assert validate_key(k) == k
        assert isinstance(e.digest, Digest) and (e.size is None or (type(e.size) is int and e.size >= 0))
        assert all(type(mk) is str for mk in e.meta)
    assert doc.parent is None or isinstance(doc.parent, Digest)
    assert list(doc.entries.hex_items()) == [(k, e.digest.hex, e.size) for k, e in doc.entries.items()]
    assert decode_manifest(doc.encode()) == doc


def _decode_or_refuse(data: bytes) -> None:
    try:
        doc = decode_manifest(data)
    except CasstoreError as e:
        assert isinstance(e, StoreFormatError), repr(e)
        return
    _check_doc(doc)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_give_a_manifest_or_a_casstore_error(data: bytes) -> None:
    _decode_or_refuse(data)
    read_parent(data)


KEY_PARTS = ["a", "b.h5", ".", "..", "", "/", "\\", "\x00", "\n", "\x1b", "\x7f", "\x9f", "é", "🙂", ":", " ",
             "s" * 250, "\u202e"]
keys = st.lists(st.sampled_from(KEY_PARTS), max_size=6).map("".join) | st.text(max_size=12)
leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
          | st.binary(max_size=40) | st.just(R) | st.just(R[:31]))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=4) | st.binary(max_size=2), inner, max_size=4),
                      max_leaves=12)
entries = st.one_of(
    st.tuples(st.just(R) | st.binary(min_size=31, max_size=33), st.none() | st.integers(-3, 2**64 - 1)
              | st.booleans() | st.floats(), st.dictionaries(st.text(max_size=4), values, max_size=3)).map(list),
    st.tuples(st.just(R), st.none() | st.integers(0, 9)).map(list),
    values,
)
docs = st.fixed_dictionaries(
    {"casstore": st.just("manifest") | st.text(max_size=3),
     "entries": st.dictionaries(keys, entries, max_size=6) | values,
     "meta": st.dictionaries(st.text(max_size=5), values, max_size=4) | values,
     "parent": st.none() | st.just(R) | st.binary(max_size=40),
     "v": st.just(1) | st.integers(-2, 3) | st.booleans() | st.text(max_size=2)},
    optional={"extra": values},
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs)
def test_arbitrary_msgpack_documents_give_a_manifest_or_a_casstore_error(doc: Dict[str, Any]) -> None:
    _decode_or_refuse(msgpack.packb(doc, use_bin_type=True))


@settings(max_examples=500, deadline=None)
@given(st.lists(keys, max_size=20))
def test_the_bulk_key_check_agrees_with_validate_key(ks: List[str]) -> None:
    """Big versions check keys in bulk; the verdict must be exactly validate_key's on each key."""
    data = raw_manifest_bytes({k: [R, 7] for k in ks})
    try:
        for k in ks:
            validate_key(k)
        ok = True
    except CasstoreError:
        ok = False
    try:
        doc = decode_manifest(data)
        assert sorted(doc.entries) == sorted(set(ks))
        decoded = True
    except StoreFormatError:
        decoded = False
    assert decoded == ok, ks
