"""Manifests: bad input, hostile and malformed manifest objects, missing objects (issue 3)."""

from __future__ import annotations

import os
import random
import resource
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import msgpack
import pytest
from _corrupt import flip_byte
from _manifest_helpers import lock_file, raw_manifest_bytes

import casstore
from casstore import (
    CasstoreError,
    Digest,
    Entry,
    FrozenError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ObjectNotFoundError,
    StoreFormatError,
)


@pytest.fixture
def mstore(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "mstore")


@pytest.fixture
def fast_store(tmp_path: Path) -> casstore.Store:
    """No fsync: for tests that put hundreds of small objects."""
    return casstore.open(tmp_path / "fast", durable=False)


@pytest.fixture
def obj(mstore: casstore.Store) -> Digest:
    return mstore.put(b"payload")


BAD_KEYS = [
    "",
    "/abs",
    "/",
    "/etc/passwd",
    "..",
    "../x",
    "a/../b",
    "a/..",
    ".",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "a\\b",
    "..\\x",
    "a\x00b",
    "\x00",
    "x" * 4097,
    "a/" + "s" * 256,
]
GOOD_KEYS = ["top", "a/b/c.h5", ".hidden", "a..b/...", "with space", "ü/ключ", "s" * 255, "x:y", "-dash"]


def _tree(root: Path) -> Dict[str, bytes]:
    """Every file under ``root`` (path -> content); directories as b'<dir>'."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.join(dirpath, d)] = b"<dir>"
        for f in files:
            p = os.path.join(dirpath, f)
            out[p] = b"<link>" if os.path.islink(p) else Path(p).read_bytes()
    return out


# -- keys and names -----------------------------------------------------------------


def test_error_classes() -> None:
    assert issubclass(InvalidInputError, ValueError) and issubclass(InvalidInputError, CasstoreError)
    assert issubclass(InvalidTypeError, TypeError) and issubclass(InvalidTypeError, CasstoreError)
    assert issubclass(LockTimeout, TimeoutError) and issubclass(LockTimeout, CasstoreError)
    assert issubclass(ObjectNotFoundError, LookupError)
    for cls in (FrozenError, IntegrityError, StoreFormatError):
        assert issubclass(cls, CasstoreError)


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys_are_refused_when_set(mstore: casstore.Store, obj: Digest, key: str) -> None:
    with mstore.edit("exp") as m:
        m["ok"] = obj
    before = mstore.heads()["exp"]
    with pytest.raises(InvalidInputError, match="invalid key") as ei:
        with mstore.edit("exp") as m:
            m[key] = obj
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, CasstoreError)
    assert mstore.heads()["exp"] == before and list(mstore.manifest("exp")) == ["ok"]


@pytest.mark.parametrize("key", [1, None, b"bytes", ("a",)], ids=repr)
def test_non_str_keys_are_refused(mstore: casstore.Store, obj: Digest, key: Any) -> None:
    with pytest.raises(InvalidTypeError):
        with mstore.edit("exp") as m:
            m[key] = obj
    assert mstore.heads() == {}


def test_good_keys_are_accepted_and_check_out_inside_the_target(mstore: casstore.Store, obj: Digest,
                                                               tmp_path: Path) -> None:
    with mstore.edit("exp") as m:
        for k in GOOD_KEYS:
            m[k] = obj
    assert sorted(mstore.manifest("exp")) == sorted(GOOD_KEYS)
    out = tmp_path / "out"
    written = mstore.checkout("exp", out)
    assert len(written) == len(GOOD_KEYS)
    for p in written:
        assert Path(os.path.realpath(p)).is_relative_to(os.path.realpath(out))
        assert p.read_bytes() == b"payload"


def test_checkout_refuses_keys_that_are_both_file_and_directory(mstore: casstore.Store, obj: Digest,
                                                                 tmp_path: Path) -> None:
    # Refused when edited, whichever key comes first ...
    for first, second in (("a", "a/b/c.h5"), ("a/b/c.h5", "a")):
        with pytest.raises(InvalidInputError, match="directory"):
            with mstore.edit("exp") as m:
                m["0-first"] = obj
                m[first] = obj
                m[second] = obj
        assert "exp" not in mstore.heads()
    # ... and a manifest built by other means is refused as a whole by checkout.
    size = mstore.stat(obj).size
    data = raw_manifest_bytes({"0-first": [obj.raw, size], "a": [obj.raw, size], "a/b/c.h5": [obj.raw, size]})
    mstore.pin("exp", mstore.put(data))
    out = tmp_path / "out"
    with pytest.raises(InvalidInputError, match="conflict"):
        mstore.checkout("exp", out)
    assert not out.exists() or not any(out.iterdir())  # refused as a whole: nothing written


@pytest.mark.parametrize("name", BAD_KEYS + ["a:b", "blake3:x", ":", "exp:1"], ids=repr)
def test_bad_names_are_refused_everywhere(mstore: casstore.Store, obj: Digest, name: str) -> None:
    with mstore.edit("good") as m:
        m["k"] = obj
    good = mstore.heads()["good"]
    before = _tree(mstore.root)
    with pytest.raises(InvalidInputError):
        with mstore.edit(name) as m:
            m["k"] = obj
    with pytest.raises(InvalidInputError):
        mstore.pin(name, good)
    with pytest.raises(InvalidInputError):
        mstore.freeze(name)
    with pytest.raises(InvalidInputError):
        mstore.unpin(name)
    # As a read target, "blake3:..." means a digest: a malformed one is an InvalidDigestError (a ValueError too).
    with pytest.raises(InvalidDigestError if name.startswith("blake3:") else InvalidInputError):
        mstore.manifest(name)
    assert _tree(mstore.root) == before  # no ref or lock file was created anywhere
    assert mstore.heads() == {"good": good} and mstore.pins() == {}


# -- hostile manifests ------------------------------------------------------------------

HOSTILE_KEYS: List[Any] = [
    "../escape",
    "sub/../../escape2",
    "a/../../../escape3",
    "/ABSOLUTE",  # replaced below by an absolute path inside tmp_path
    b"../escape4",
    "..\\escape5",
    "nul\x00/../../escape6",
    "",
    ".",
]


@pytest.mark.parametrize("i", range(len(HOSTILE_KEYS)))
def test_checkout_refuses_a_hostile_manifest_object(mstore: casstore.Store, obj: Digest, tmp_path: Path,
                                                    i: int) -> None:
    key = HOSTILE_KEYS[i]
    if key == "/ABSOLUTE":
        key = str(tmp_path / "abs-escape")
    # A valid key that sorts (and is encoded) before the hostile one.
    data = raw_manifest_bytes({"-good": [obj.raw, 7], key: [obj.raw, 7]})
    d = mstore.put(data)
    # THE decoder refuses it wherever it is read: it can never be pinned ...
    with pytest.raises(StoreFormatError, match="key"):
        mstore.pin("hostile", d)
    assert mstore.pins() == {}
    # ... and a pin planted by hand (as any member of a shared store could) does not help.
    mstore.refs.write("pins", "hostile", d)
    with pytest.raises(StoreFormatError):
        mstore.manifest("hostile")
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    before = _tree(tmp_path)
    with pytest.raises(CasstoreError) as ei:
        mstore.checkout("hostile", out)
    assert isinstance(ei.value, StoreFormatError)
    assert _tree(tmp_path) == before  # nothing written anywhere, inside the target or outside it
    assert not (tmp_path / "abs-escape").exists() and not (tmp_path / "work" / "escape").exists()
    with pytest.raises(CasstoreError):
        mstore.checkout(d, out, overwrite=True)
    assert _tree(tmp_path) == before


# -- malformed manifest objects -------------------------------------------------------


def _valid_manifest_bytes(obj: Digest) -> bytes:
    return raw_manifest_bytes({"data/a.bin": [obj.raw, 7], "b": [obj.raw, 7, {"epoch": 3}]},
                              {"git": "abc", "lr": 0.5})


def _p(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)  # type: ignore[no-any-return]


HUGE_HEADERS = {
    "array32 at top": b"\xdd\x80\x00\x00\x00" + b"\xc0" * 8,
    "map32 at top": b"\xdf\x80\x00\x00\x00" + b"\xc0" * 8,
    "str32 at top": b"\xdb\x80\x00\x00\x00abc",
    "bin32 at top": b"\xc6\x80\x00\x00\x00abc",
    "ext32 at top": b"\xc9\x80\x00\x00\x00\x01abc",
    "entries map32": b"\x85" + _p("casstore") + _p("manifest") + _p("entries") + b"\xdf\x80\x00\x00\x00" + b"\xc0" * 4,
    "entry array32": b"\x85" + _p("casstore") + _p("manifest") + _p("entries") + b"\x81" + _p("k")
    + b"\xdd\xff\xff\xff\xff" + b"\xc0" * 4,
    "meta str32": b"\x85" + _p("casstore") + _p("manifest") + _p("meta") + b"\x81" + _p("k")
    + b"\xdb\xff\xff\xff\xf0" + b"x" * 6,
}


def _assert_refused(store: casstore.Store, data: bytes) -> None:
    d = store.put(data)
    with pytest.raises((StoreFormatError, IntegrityError)):
        store.manifest(d)
    with pytest.raises((StoreFormatError, IntegrityError)):
        store.pin("p", d)
    assert "p" not in store.pins()


@pytest.mark.parametrize("what", sorted(HUGE_HEADERS))
def test_huge_length_headers_in_tiny_objects(mstore: casstore.Store, what: str) -> None:
    data = HUGE_HEADERS[what]
    assert len(data) < 64
    _assert_refused(mstore, data)


def test_random_bytes_are_not_a_manifest(fast_store: casstore.Store) -> None:
    rng = random.Random(1234)
    for n in [0, 1, 2, 3, 5, 8, 13, 40, 200, 5000] + [rng.randrange(1, 600) for _ in range(40)]:
        _assert_refused(fast_store, bytes(rng.randrange(256) for _ in range(n)))


def test_every_truncation_of_a_valid_manifest_is_refused(fast_store: casstore.Store) -> None:
    obj = fast_store.put(b"payload")
    data = _valid_manifest_bytes(obj)
    whole = fast_store.manifest(fast_store.put(data))
    assert sorted(whole) == ["b", "data/a.bin"] and whole["b"].meta["epoch"] == 3
    for n in range(len(data)):
        _assert_refused(fast_store, data[:n])


BAD_DOCS: Dict[str, Callable[[Digest], bytes]] = {
    "a list": lambda o: _p([1, 2, 3]),
    "a str": lambda o: _p("manifest"),
    "no casstore field": lambda o: _p({"entries": {}, "meta": {}, "parent": None, "v": 1}),
    "other kind": lambda o: raw_manifest_bytes({}, casstore="cache"),
    "newer format": lambda o: raw_manifest_bytes({}, v=4),  # 2 and 3 are the tree-shaped formats
    "format 0": lambda o: raw_manifest_bytes({}, v=0),
    "negative format": lambda o: raw_manifest_bytes({}, v=-1),
    "format as str": lambda o: raw_manifest_bytes({}, v="1"),
    "no format": lambda o: _p({"casstore": "manifest", "entries": {}, "meta": {}, "parent": None}),
    "entries a list": lambda o: raw_manifest_bytes([["k", [o.raw, 7]]]),  # type: ignore[arg-type]
    "meta a list": lambda o: _p({"casstore": "manifest", "entries": {}, "meta": [], "parent": None, "v": 1}),
    "parent too short": lambda o: raw_manifest_bytes({}, parent=b"\x00" * 31),
    "parent a str": lambda o: _p({"casstore": "manifest", "entries": {}, "meta": {}, "parent": "x" * 32, "v": 1}),
    "int map key": lambda o: _p({"casstore": "manifest", "entries": {1: [o.raw, 7]}, "meta": {}, "parent": None,
                                 "v": 1}),
    "trailing data": lambda o: raw_manifest_bytes({"k": [o.raw, 7]}) + b"\xc0",
    "two docs": lambda o: raw_manifest_bytes({}) * 2,
    "ext type": lambda o: raw_manifest_bytes({}, meta={"t": msgpack.ExtType(5, b"x")}),
    "deep nesting": lambda o: b"\x91" * 5000 + b"\xc0",
    "bad utf-8": lambda o: b"\x81\xa2\xff\xfe\x01",
}


@pytest.mark.parametrize("what", sorted(BAD_DOCS))
def test_malformed_documents_are_refused(mstore: casstore.Store, obj: Digest, what: str) -> None:
    data = BAD_DOCS[what](obj)
    d = mstore.put(data)
    with pytest.raises(StoreFormatError) as ei:
        mstore.manifest(d)
    assert str(d) in str(ei.value) or what in ("bad utf-8", "deep nesting")
    if what == "newer format":
        assert "upgrade" in str(ei.value)


BAD_ENTRIES: Dict[str, Callable[[Digest], Any]] = {
    "digest as int list": lambda o: [list(o.raw), 7],
    "digest as 32-char str": lambda o: ["a" * 32, 7],
    "digest too short": lambda o: [o.raw[:31], 7],
    "digest too long": lambda o: [o.raw + b"\x00", 7],
    "digest as map": lambda o: [{str(i): i for i in range(32)}, 7],
    "an int": lambda o: 5,
    "nil": lambda o: None,
    "a bin": lambda o: o.raw,
    "a str": lambda o: "x" * 40,
    "empty array": lambda o: [],
    "no size": lambda o: [o.raw],
    "size as str": lambda o: [o.raw, "7"],
    "negative size": lambda o: [o.raw, -1],
    "size as bool": lambda o: [o.raw, True],
    "size as float": lambda o: [o.raw, 7.0],
    "meta as str": lambda o: [o.raw, 7, "meta"],
    "meta as list": lambda o: [o.raw, 7, [1, 2]],
    "a map": lambda o: {"digest": o.raw, "size": 7},
}


@pytest.mark.parametrize("what", sorted(BAD_ENTRIES))
def test_malformed_entries_raise_store_format_error(mstore: casstore.Store, obj: Digest, tmp_path: Path,
                                                    what: str) -> None:
    d = mstore.put(raw_manifest_bytes({"k": BAD_ENTRIES[what](obj)}))
    good = mstore.put(raw_manifest_bytes({"k": [obj.raw, 7]}))
    assert mstore.manifest(good)["k"] == Entry(obj, 7)

    def use(action: Callable[[], Any]) -> None:
        with pytest.raises(StoreFormatError, match="malformed|not a valid|lacks"):
            action()

    use(lambda: mstore.manifest(d)["k"])
    use(lambda: list(mstore.manifest(d).values()))
    empty = mstore.put(raw_manifest_bytes({}))
    use(lambda: mstore.diff(empty, d))
    use(lambda: mstore.diff(d, empty))
    use(lambda: mstore.checkout(d, tmp_path / "out"))
    assert not any((tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else True
    use(lambda: mstore.pin("bad", d))  # pin reads every entry (they must exist), so it refuses them
    use(lambda: mstore.pin("bad", d, allow_missing=True))  # THE decoder checks every entry of every read
    assert "bad" not in mstore.pins()
    mstore.refs.write("heads", "bad", d)  # planted by hand: an edit of it is refused before it starts
    with pytest.raises(StoreFormatError):
        with mstore.edit("bad") as m:
            m["k2"] = obj
    assert mstore.heads() == {"bad": d}


def test_flipped_byte_in_a_manifest_object_is_an_integrity_error(mstore: casstore.Store, obj: Digest,
                                                                 tmp_path: Path) -> None:
    with mstore.edit("exp") as m:
        m["k"] = obj
        m.meta["note"] = "x" * 100
    v1 = mstore.heads()["exp"]
    with mstore.edit("exp") as m:
        m["k2"] = obj
    v2 = mstore.heads()["exp"]
    mstore.pin("pinned", v2)
    flip_byte(mstore.path(v1), len(mstore.get(v1)) - 20)  # inside meta: still decodable msgpack
    with pytest.raises(IntegrityError, match=v1.hex):
        mstore.manifest(v1)
    with pytest.raises(IntegrityError):
        mstore.history("exp")  # v2 is fine, its parent is not
    assert mstore.manifest("exp").digest == v2
    flip_byte(mstore.path(v2), 3)
    for target in ("exp", "pinned", v2, str(v2)):
        with pytest.raises(IntegrityError):
            mstore.manifest(target)
    with pytest.raises(IntegrityError):
        mstore.checkout("pinned", tmp_path / "out")
    with pytest.raises(IntegrityError):
        with mstore.edit("exp") as m:
            m["k3"] = obj
    # The failed edit released its lock (a second attempt fails the same way, not by timeout).
    with pytest.raises(IntegrityError):
        with mstore.edit("exp", timeout=0) as m:
            m["k3"] = obj
    assert mstore.heads()["exp"] == v2


@pytest.mark.parametrize("compress", [False, True])
def test_checkout_of_a_corrupt_data_object_leaves_no_file(mstore: casstore.Store, tmp_path: Path,
                                                          compress: bool) -> None:
    data = (b"line of compressible text %d\n" * 20000) if compress else os.urandom(100_000)
    d = mstore.put(data, compress=compress)
    info = mstore.stat(d)
    assert info.codec == ("zstd" if compress else "raw")
    with mstore.edit("exp") as m:
        m["f.bin"] = d
    obj_file = next(p for p in (mstore.root / "objects").rglob("*") if p.is_file() and d.hex[2:] in p.name)
    flip_byte(obj_file, info.stored_size // 2)
    out = tmp_path / "out"
    with pytest.raises(IntegrityError):
        mstore.checkout("exp", out)
    assert not (out / "f.bin").exists()
    assert [p.name for p in out.rglob("*")] == []  # no temp file left either


# -- missing objects, sizes, metadata ---------------------------------------------------


def test_entries_must_refer_to_existing_objects(mstore: casstore.Store, obj: Digest) -> None:
    missing = Digest.of(b"never put")
    with mstore.edit("exp") as m:
        m["have"] = obj
    before = mstore.heads()["exp"]
    n_objects = len(list(mstore.iter_objects()))
    for value in (missing, str(missing), Entry(missing), Entry(missing, 9, {"a": 1})):
        with pytest.raises(ObjectNotFoundError) as ei:
            with mstore.edit("exp") as m:
                m["ok"] = obj
                m["gone"] = value
        assert "'gone'" in str(ei.value) and missing.hex in str(ei.value)
        assert mstore.heads()["exp"] == before
        assert len(list(mstore.iter_objects())) == n_objects
    with pytest.raises(ObjectNotFoundError):
        with mstore.edit("new-name") as m:
            m["gone"] = missing
    assert "new-name" not in mstore.heads()

    with mstore.edit("exp", allow_missing=True) as m:
        m["remote"] = missing
        m["remote-sized"] = Entry(missing, 9)
        m["local"] = obj
    man = mstore.manifest("exp")
    assert man["remote"] == Entry(missing, None) and man["remote-sized"] == Entry(missing, 9)
    assert man["local"].size == 7 and man.parent == before
    # Later edits need not re-check entries they did not touch.
    with mstore.edit("exp") as m:
        m["another"] = obj
    assert "remote" in mstore.manifest("exp")


def test_entry_size_must_match_the_object(mstore: casstore.Store, obj: Digest) -> None:
    with pytest.raises(InvalidInputError, match="size"):
        with mstore.edit("exp") as m:
            m["k"] = Entry(obj, 8)
    assert mstore.heads() == {}
    # allow_missing allows missing objects, not wrong sizes of present ones.
    with pytest.raises(InvalidInputError, match="size"):
        with mstore.edit("exp", allow_missing=True) as m:
            m["k"] = Entry(obj, 8)
    assert mstore.heads() == {}
    with mstore.edit("exp") as m:
        m["k"] = Entry(obj, 7)
    assert mstore.manifest("exp")["k"].size == 7


@pytest.mark.parametrize("value", [object(), {1, 2}, 1 + 2j, bytearray(b"x"), {1: "int key"}, 2**64, -(2**63) - 1,
                                   [object()], {"a": {"b": object()}}], ids=repr)
def test_metadata_must_be_msgpackable(mstore: casstore.Store, obj: Digest, value: Any) -> None:
    with mstore.edit("exp") as m:
        m["k"] = obj
    before = mstore.heads()["exp"]
    with pytest.raises(InvalidInputError):
        with mstore.edit("exp") as m:
            m["k2"] = obj
            m.meta["bad"] = value
    with pytest.raises(InvalidInputError):
        with mstore.edit("exp") as m:
            m["k2"] = Entry(obj, meta={"bad": value})
    with pytest.raises(InvalidInputError):
        Entry(obj, meta={"bad": value})  # refused where it is introduced
    assert mstore.heads()["exp"] == before
    assert list(mstore.manifest("exp")) == ["k"]


def test_entry_and_value_types(mstore: casstore.Store, obj: Digest) -> None:
    with pytest.raises(InvalidDigestError):
        Entry("not a digest")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        Entry(123)  # type: ignore[arg-type]
    for size in (-1, True, 1.5, "7"):
        with pytest.raises(InvalidInputError):
            Entry(obj, size)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        Entry(obj, 7, "meta")  # type: ignore[arg-type]
    for value in (5, b"bytes", None, ["list"]):
        with pytest.raises(InvalidTypeError):
            with mstore.edit("exp") as m:
                m["k"] = value  # type: ignore[assignment]
    with pytest.raises(InvalidDigestError):
        with mstore.edit("exp") as m:
            m["k"] = "blake3:nothex"
    assert mstore.heads() == {}


def test_nested_edit_of_the_same_name_is_refused_at_once_naming_the_lock(mstore: casstore.Store,
                                                                        obj: Digest) -> None:
    """The holder is this very thread: waiting (600 s by default, then a LockTimeout) could never end."""
    from casstore.errors import LockCycleError

    with mstore.edit("exp") as m:
        m["k"] = obj
        t = time.monotonic()
        with pytest.raises(LockCycleError) as ei:  # (a LockTimeout)
            with mstore.edit("exp", timeout=30):
                pass
        assert time.monotonic() - t < 1.5 and isinstance(ei.value, LockTimeout)
        assert str(lock_file(mstore.root, "exp")) in str(ei.value)
        # Another name is not blocked.
        with mstore.edit("other", timeout=0) as m2:
            m2["k"] = obj
    assert sorted(mstore.heads()) == ["exp", "other"]


def test_pin_refuses_a_version_whose_objects_are_missing(mstore: casstore.Store) -> None:
    """Invariant 2: no ref may name a version whose entries are not in the store."""
    ghost = casstore.Digest("ab" * 32)  # never stored
    d = mstore.put(raw_manifest_bytes({"w.npy": [ghost.raw, 10]}))
    with pytest.raises(casstore.ObjectNotFoundError, match="w.npy"):
        mstore.pin("model", d)
    assert "model" not in mstore.pins()
    assert mstore.pin("model", d, allow_missing=True) == d  # remote-only objects, explicitly
    assert mstore.pins()["model"] == d


def test_a_big_object_that_is_no_version_is_refused_from_its_first_bytes(tmp_path: Path) -> None:
    """Found by a bug hunt: naming a data object where a version is expected read it whole to decode it
    (400 MiB of zeros stored compressed in 13 KB took the process to 850 MB)."""
    s = casstore.open(tmp_path / "s")
    d = s.put(bytes(300 << 20), compress=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(casstore.StoreFormatError, match="is not a manifest version"):
        s.manifest(str(d))
    assert time.monotonic() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: nothing read whole
    with s.edit("big") as m:  # a real version past the peek size still reads
        m["k"] = s.put(b"x")
        m.meta["blob"] = "y" * (20 << 20)
    assert len(casstore.open(s.root).manifest("big").meta["blob"]) == 20 << 20
