"""numpy adapter: arrays as .npy objects, read-only memory maps, bundles."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Iterator

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from _corrupt import flip_byte
from _fetch_helpers import assert_objects_valid, b3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casstore
from casstore.digest import Digest
from casstore.errors import IntegrityError, InvalidInputError, InvalidTypeError, ObjectNotFoundError, StoreFormatError


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


@pytest.fixture(scope="module")
def shared_store() -> Iterator[casstore.Store]:
    """One store for the property tests (function-scoped fixtures do not mix with @given)."""
    with tempfile.TemporaryDirectory(prefix="casstore-arrays-") as d:
        yield casstore.open(Path(d) / "store", durable=False)


def same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> None:
    """Same dtype (byte order included), shape, bits and memory order."""
    assert b.dtype == a.dtype and b.dtype.str == a.dtype.str and b.dtype.descr == a.dtype.descr
    assert b.shape == a.shape
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()  # bitwise: NaNs included
    if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
        assert b.flags.f_contiguous  # Fortran order kept


STRUCT = np.dtype([("id", "<i4"), ("pos", ">f8", (3,)), ("name", "S5"), ("flag", "?"),
                   ("inner", [("a", "<u2"), ("t", "<M8[s]")])])
_base = np.arange(60, dtype=np.float64).reshape(3, 4, 5)

CASES = {
    "f64": np.linspace(0, 1, 101),
    "f32-nan-inf": np.array([np.nan, np.inf, -np.inf, -0.0, 1.5], dtype=np.float32),
    "f16": np.arange(7, dtype=np.float16),
    "i8": np.arange(-5, 5, dtype=np.int8),
    "u64-max": np.array([0, 2**64 - 1], dtype=np.uint64),
    "bool": np.array([[True, False], [False, True]]),
    "c128": np.arange(6).astype(np.complex128) * (1 + 2j),
    "c64-big-endian": np.arange(6).astype(">c8"),
    "i4-big-endian": np.arange(12, dtype=">i4").reshape(3, 4),
    "f8-big-endian-fortran": np.asfortranarray(np.arange(12, dtype=">f8").reshape(3, 4)),
    "fortran-3d": np.asfortranarray(_base),
    "non-contiguous": _base[::2, 1::2, ::-1],
    "reversed": np.arange(10)[::-1],
    "transposed": _base.transpose(1, 0, 2),
    "0-d": np.array(3.25),
    "0-d-bytes": np.array(b"xyz"),
    "empty": np.zeros((0, 3)),
    "empty-fortran": np.zeros((3, 0), order="F"),
    "empty-1d-i2": np.zeros(0, dtype=np.int16),
    "unicode": np.array(["a", "bc", "déf"]),
    "bytes": np.array([b"a", b"bc\x00d"]),
    "datetime64": np.arange(5).astype("datetime64[ns]"),
    "timedelta64-fortran": np.asfortranarray(np.arange(6).reshape(2, 3).astype("m8[s]")),
    "void": np.frombuffer(b"abcdefgh", dtype="V4"),
    "structured": np.array([(1, (1.0, 2.0, 3.0), b"ab", True, (7, 5)),
                            (2, (4.0, 5.0, 6.0), b"cdefg", False, (8, 6))], dtype=STRUCT),
    "structured-empty": np.zeros(0, dtype=STRUCT),
    "subarray-dtype": np.zeros(4, dtype=[("m", "<i2", (2, 3))]),
    "large-4d": np.random.default_rng(0).random((4, 5, 6, 7)).astype(np.float32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_roundtrip(store: casstore.Store, name: str) -> None:
    a = CASES[name]
    d = store.put_array(a)
    same(a, store.get_array(d))
    same(a, store.get_array(d, verify=False))
    m = store.get_array(d, mmap=True)
    same(a, m)
    # The object is a valid .npy: np.load reads it, and it is byte for byte what np.save writes.
    same(a, np.load(store.path(d), allow_pickle=False))
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    assert str(d) == b3(buf.getvalue())
    # Compressed: same digest, same array, and mmap materializes a raw copy.
    dc = store.put_array(a, compress=True)
    assert dc == d
    same(a, store.get_array(dc))


def _np_save_bytes(a: np.ndarray[Any, Any]) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Stored array in format 2.0/3.0"
        np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", [
    np.dtype([("Ā", "?")]),  # not latin-1: needs .npy format 3.0 (utf-8 header)
    np.dtype([("température", "<f4"), ("名前", "U3")]),
    np.dtype([(f"field_{i}", "<f4") for i in range(600)]),  # a 13 kB header: above numpy's default limit
    np.dtype([(f"f{i}_" + "x" * 40, "<i2") for i in range(1000)]),  # a 58 kB header
], ids=["non-latin-1", "unicode-names", "600-fields", "1000-fields"])
def test_big_and_unicode_headers(store: casstore.Store, dtype: np.dtype[Any]) -> None:
    a = np.zeros(3, dtype=dtype)
    a[dtype.names[0]] = 1
    d = store.put_array(a)
    assert str(d) == b3(_np_save_bytes(a))  # exactly what np.save writes (format 1.0 or 3.0)
    same(a, store.get_array(d))
    same(a, store.get_array(d, mmap=True))
    same(a, store.get_array(store.put_array(a, compress=True)))


def test_header_too_big_to_read_back_is_refused(store: casstore.Store) -> None:
    a = np.zeros(2, dtype=[(f"f{i}_" + "x" * 40, "<i2") for i in range(1200)])  # a 70 kB header
    with pytest.raises(InvalidInputError, match="header") as ei:
        store.put_array(a)
    assert len(str(ei.value)) < 300  # says what is wrong without printing 1200 field names
    assert list(store.iter_objects()) == []


def test_data_is_64_byte_aligned(store: casstore.Store) -> None:
    for a in (np.arange(10.0), CASES["structured"], np.zeros((7, 3), dtype="S13")):
        d = store.put_array(a)
        with open(store.path(d), "rb") as f:
            np.lib.format.read_magic(f)
            np.lib.format.read_array_header_1_0(f)
            assert f.tell() % 64 == 0


def test_compressed_array(store: casstore.Store) -> None:
    a = np.zeros((512, 512), dtype=np.float32)
    a[::7] = 1.0
    d = store.put_array(a, compress=True)
    assert store.stat(d).codec == "zstd" and store.stat(d).stored_size < a.nbytes // 10
    same(a, store.get_array(d))
    m = store.get_array(d, mmap=True)  # materializes the raw object once
    same(a, m)
    assert isinstance(m, np.memmap) and store.path(d).exists()
    assert_objects_valid(store)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    a=hnp.arrays(
        dtype=st.one_of(hnp.scalar_dtypes(), hnp.byte_string_dtypes(max_len=6), hnp.unicode_string_dtypes(max_len=4),
                        hnp.array_dtypes(subtype_strategy=hnp.scalar_dtypes(), max_size=3)),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
    ),
    layout=st.sampled_from(["C", "F", "slice", "byteswap"]),
)
def test_roundtrip_property(shared_store: casstore.Store, a: np.ndarray[Any, Any], layout: str) -> None:
    if layout == "F":
        a = np.asfortranarray(a)
    elif layout == "slice" and a.ndim:
        a = a[(slice(None, None, -2),) + (slice(None),) * (a.ndim - 1)]
    elif layout == "byteswap" and a.dtype.names is None:
        a = a.astype(a.dtype.newbyteorder())
    d = shared_store.put_array(a)
    same(a, shared_store.get_array(d))
    same(a, shared_store.get_array(d, mmap=True))
    same(a, np.load(shared_store.path(d), allow_pickle=False))


@pytest.mark.parametrize("a", [
    np.array([1, "a", None], dtype=object),
    np.zeros(2, dtype=[("x", "<i4"), ("o", "O")]),
    np.empty((0,), dtype=object),
], ids=["object", "structured-with-object", "empty-object"])
def test_object_arrays_refused(store: casstore.Store, a: np.ndarray[Any, Any]) -> None:
    with pytest.raises(InvalidTypeError, match="object"):
        store.put_array(a)
    assert list(store.iter_objects()) == []


@pytest.mark.parametrize("x", [[1, 2, 3], b"bytes", 3.0, None])
def test_non_arrays_refused(store: casstore.Store, x: Any) -> None:
    with pytest.raises(InvalidTypeError):
        store.put_array(x)


def test_pickled_npy_object_is_not_unpickled(store: casstore.Store) -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    d = store.put(buf.getvalue())
    with pytest.raises(StoreFormatError):
        store.get_array(d)
    with pytest.raises(StoreFormatError):
        store.get_array(d, mmap=True)


def test_not_an_npy_object(store: casstore.Store) -> None:
    d = store.put(b"definitely not numpy" * 10)
    with pytest.raises(StoreFormatError, match="npy"):
        store.get_array(d)
    with pytest.raises(StoreFormatError, match="npy"):
        store.get_array(d, mmap=True)
    with pytest.raises(ObjectNotFoundError):
        store.get_array("blake3:" + "1" * 64)


def test_mmap_is_read_only_memmap_of_the_object(store: casstore.Store) -> None:
    a = np.arange(1000, dtype=np.int64).reshape(10, 100)
    d = store.put_array(a)
    m = store.get_array(d, mmap=True)
    assert isinstance(m, np.memmap)
    assert not m.flags.writeable
    with pytest.raises(ValueError):
        m[0, 0] = 5
    assert Path(m.filename) == store.path(d)  # a map of the object itself, not of a copy
    np.testing.assert_array_equal(m, a)
    f = store.get_array(store.put_array(np.asfortranarray(a)), mmap=True)
    assert f.flags.f_contiguous and not f.flags.writeable
    # a plain get is a fresh, writable copy
    g = store.get_array(d)
    assert g.flags.writeable and not isinstance(g, np.memmap)


def test_corrupt_data_raises_integrity_error(store: casstore.Store) -> None:
    a = np.arange(100_000, dtype=np.float64)
    d = store.put_array(a)
    size = store.stat(d).size
    flip_byte(store.path(d), size - 1000)  # a byte of the data part
    with pytest.raises(IntegrityError, match=str(d)[:20]):
        store.get_array(d)
    # verify=False (and mmap, which never hashes) return the damaged data without complaint:
    assert not np.array_equal(store.get_array(d, verify=False), a)


def test_corrupt_large_array_raises_integrity_error(store: casstore.Store) -> None:
    """Large arrays are read in blocks hashed by a helper thread as they arrive: same contract."""
    a = np.arange(5 << 20, dtype=np.float32)  # 20 MiB
    d = store.put_array(a)
    same(a, store.get_array(d))
    flip_byte(store.path(d), store.stat(d).size // 2)
    with pytest.raises(IntegrityError, match=str(d)[:20]):
        store.get_array(d)


def test_appended_bytes_raise_integrity_error(store: casstore.Store) -> None:
    for n in (1000, 5 << 20):  # the read-then-hash path and the helper-thread path
        a = np.ones(n, dtype=np.float32)
        d = store.put_array(a)
        p = store.path(d)
        os.chmod(p, 0o644)
        with open(p, "ab") as f:
            f.write(b"trailing garbage")
        with pytest.raises(IntegrityError):
            store.get_array(d)


def test_truncated_object_raises_integrity_error(store: casstore.Store) -> None:
    a = np.arange(10_000, dtype=np.int32)
    d = store.put_array(a)
    p = store.path(d)
    os.chmod(p, 0o644)
    os.truncate(p, store.stat(d).size - 100)
    with pytest.raises(IntegrityError):
        store.get_array(d)
    with pytest.raises(IntegrityError):
        store.get_array(d, verify=False)


def test_corrupt_compressed_array_raises_integrity_error(store: casstore.Store) -> None:
    a = np.tile(np.arange(1000, dtype=np.float64), 50)
    d = store.put_array(a, compress=True)
    info = store.stat(d)
    assert info.codec == "zstd"
    p = store.root / "objects" / d.hex[:2] / (d.hex[2:] + ".zst")
    flip_byte(p, info.stored_size // 2)
    with pytest.raises(IntegrityError):
        store.get_array(d)


# -- bundles -------------------------------------------------------------------------


def test_put_arrays_get_arrays_roundtrip(store: casstore.Store) -> None:
    arrays = {k: CASES[k] for k in ("f64", "fortran-3d", "structured", "0-d", "empty", "i4-big-endian")}
    arrays["nested/name"] = np.arange(3)
    b = store.put_arrays(arrays)
    got = store.get_arrays(b)
    assert list(got) == sorted(arrays) or set(got) == set(arrays)
    for k, a in arrays.items():
        same(a, got[k])
    mm = store.get_arrays(b, mmap=True)
    for k, a in arrays.items():
        assert isinstance(mm[k], np.memmap)
        same(a, mm[k])
    m = store.manifest(b)
    assert m.meta["kind"] == "casstore.arrays"
    assert m["f64"].meta["shape"] == [101] and m["f64"].meta["dtype"] == "float64"
    assert m["f64"].digest == store.put_array(arrays["f64"])  # each array is its own .npy object
    assert store.put_arrays(dict(reversed(list(arrays.items())))) == b  # order-independent, deterministic
    # Pinned, it survives by name.
    store.pin("my-bundle", b)
    same(arrays["f64"], store.get_arrays(store.pins()["my-bundle"])["f64"])


def test_put_arrays_errors(store: casstore.Store) -> None:
    with pytest.raises(InvalidTypeError):
        store.put_arrays([np.arange(3)])
    with pytest.raises(InvalidTypeError):
        store.put_arrays({"ok": np.arange(3), "bad": np.array([None], dtype=object)})
    with pytest.raises((InvalidInputError, InvalidTypeError)):
        store.put_arrays({"": np.arange(3)})
    with pytest.raises((InvalidInputError, InvalidTypeError)):
        store.put_arrays({"../escape": np.arange(3)})


def test_get_arrays_of_a_non_bundle(store: casstore.Store) -> None:
    with store.edit("plain") as ed:
        ed["x"] = casstore.Entry(store.put_array(np.arange(3)))
    with pytest.raises(StoreFormatError, match="bundle"):
        store.get_arrays(store.manifest("plain").digest)
    with pytest.raises(StoreFormatError):
        store.get_arrays(store.put_array(np.arange(3)))  # an array, not a manifest
    with pytest.raises(StoreFormatError):
        store.get_arrays(store.put(b"random bytes"))


# -- the 1 GiB memory map ------------------------------------------------------------------

MMAP_CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import psutil
    import casstore

    store = casstore.open(sys.argv[1])
    proc = psutil.Process()
    store.get_array(sys.argv[3], mmap=True)  # warm-up: imports, first calls (a small array)
    rss0 = proc.memory_info().rss
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a = store.get_array(sys.argv[2], mmap=True)
        times.append(time.perf_counter() - t0)
    rss1 = proc.memory_info().rss
    assert isinstance(a, np.memmap) and a.shape == (1 << 28,) and not a.flags.writeable
    # Touch two elements: only their pages (or the kernel's fault-around / large folios) come in.
    s = float(a[0] + a[-1])
    rss2 = proc.memory_info().rss
    # Touch everything: now the mapping is resident (so the RSS probe does see mapped pages).
    s += float(a.sum(dtype=np.float64))
    rss3 = proc.memory_info().rss
    print(json.dumps({"times": times, "rss0": rss0, "rss1": rss1, "rss2": rss2, "rss3": rss3, "sum": s}))
""")


@pytest.mark.slow
def test_mmap_of_1gib_array_is_instant_and_lazy(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "store", durable=False)
    n = 1 << 28  # float32: 1 GiB
    big = np.ones(n, dtype=np.float32)
    d = store.put_array(big)
    del big
    assert store.stat(d).size > 1 << 30 and store.stat(d).codec == "raw"
    small = store.put_array(np.arange(10))
    r = subprocess.run([sys.executable, "-c", MMAP_CHILD, str(store.root), str(d), str(small)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    times = sorted(out["times"])
    assert times[len(times) // 2] < 0.010, f"get_array(mmap=True) took {times} s"
    assert out["rss1"] - out["rss0"] < 8 << 20, "mapping must not read the array"
    assert out["sum"] == 2.0 + n
    assert out["rss2"] - out["rss1"] < 64 << 20  # only the touched pages
    assert out["rss3"] - out["rss1"] > 512 << 20  # touched all: resident


@pytest.mark.parametrize("shape", ["(10**12,)", "(-5,)", "(3, 'a')"])
def test_hostile_npy_header_is_refused_before_allocating(store: casstore.Store, shape: str) -> None:
    header = ("{'descr': '<f8', 'fortran_order': False, 'shape': " + shape + ", }").encode()
    header += b" " * (118 - len(header)) + b"\n"
    d = store.put(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 16)
    with pytest.raises((StoreFormatError, IntegrityError)):
        store.get_array(d)


def test_bundle_read_back_through_its_pin_name(store: casstore.Store) -> None:
    d = store.put_arrays({"x": np.arange(5)})
    store.pin("bundle-v1", d)
    assert store.get_arrays("bundle-v1")["x"].tolist() == [0, 1, 2, 3, 4]


# -- hostile objects: lying headers, bombs, fuzz (issue 11) ----------------------------------


def _npy(header: str, data: bytes, version: int = 1) -> bytes:
    """A hand-made .npy file: any header text, any data (np.save would never write a lie)."""
    h = header.encode("utf-8")
    pre = 10 if version == 1 else 12
    h += b" " * ((-(pre + len(h) + 1)) % 64) + b"\n"
    size = len(h).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + size + h + data


LIES = {
    "shape-too-big": "{'descr': '<f8', 'fortran_order': False, 'shape': (11,), }",
    "shape-too-small": "{'descr': '<f8', 'fortran_order': False, 'shape': (9,), }",
    "itemsize-lies": "{'descr': '<f4', 'fortran_order': False, 'shape': (10,), }",
    "absurd-shape": "{'descr': '<f8', 'fortran_order': False, 'shape': (2**62, 2**62), }",
    "zero-dim-absurd": "{'descr': '<f8', 'fortran_order': False, 'shape': (0, 2**63), }",
    "negative": "{'descr': '<f8', 'fortran_order': False, 'shape': (-10,), }",
    "too-many-dims": "{'descr': '<f8', 'fortran_order': False, 'shape': (1,) * 80, }",
    "not-a-tuple": "{'descr': '<f8', 'fortran_order': False, 'shape': [10], }",
    "bool-dim": "{'descr': '<f8', 'fortran_order': False, 'shape': (True, 10), }",
    "fortran-junk": "{'descr': '<f8', 'fortran_order': 'yes', 'shape': (10,), }",
    "fortran-int": "{'descr': '<f8', 'fortran_order': 1, 'shape': (10,), }",
    "object-dtype": "{'descr': '|O', 'fortran_order': False, 'shape': (10,), }",
    "object-field": "{'descr': [('a', '<f8'), ('b', '|O')], 'fortran_order': False, 'shape': (5,), }",
    "bad-descr": "{'descr': 'nonsense', 'fortran_order': False, 'shape': (10,), }",
    "missing-key": "{'descr': '<f8', 'shape': (10,), }",
    "extra-key": "{'descr': '<f8', 'fortran_order': False, 'shape': (10,), 'x': 1, }",
    "not-a-dict": "[1, 2, 3]",
    "deep-nesting": "{'descr': '<f8', 'fortran_order': False, 'shape': " + "(" * 150 + ")" * 150 + "}",
    "unary-chain": "{'descr': '<f8', 'fortran_order': False, 'shape': (" + "-" * 5000 + "1,), }",
    "huge-int-literal": "{'descr': '<f8', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }",
    "code": "{'descr': __import__('os').system('false'), 'fortran_order': False, 'shape': (10,), }",
}


@pytest.mark.parametrize("mmap", [False, True], ids=["copy", "mmap"])
@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_npy_header_in_an_intact_object_is_store_format_error(store: casstore.Store, lie: str,
                                                                    mmap: bool) -> None:
    """The object hashes right (it was stored that way): its header is a format problem, refused
    before anything is allocated."""
    d = store.put(_npy(LIES[lie], np.arange(10, dtype="<f8").tobytes()), compress=False)
    for verify in (True, False):
        with pytest.raises(StoreFormatError, match=str(d)[:20]):
            store.get_array(d, mmap=mmap, verify=verify)


def test_lying_header_in_a_compressed_object(store: casstore.Store) -> None:
    d = store.put(_npy(LIES["shape-too-big"], bytes(80_000)), compress=True)
    assert store.stat(d).codec == "zstd"
    for mmap in (False, True):
        with pytest.raises(StoreFormatError):
            store.get_array(d, mmap=mmap)


def test_damaged_header_is_integrity_error_not_format_error(store: casstore.Store) -> None:
    """The same refusal, but the object no longer hashes to its name: that is damage."""
    a = np.arange(1000, dtype=np.float64)
    d = store.put_array(a)
    text = store.path(d).read_bytes()
    flip_byte(store.path(d), text.index(b"(1000,)") + 1)  # shape (1000,) -> (0000,)
    for mmap in (False, True):
        with pytest.raises(IntegrityError, match="no longer hashes"):
            store.get_array(d, mmap=mmap, verify=False)


def _plant_zstd_object(store: casstore.Store, claimed: bytes, frame_chunks: Iterator[bytes]) -> Digest:
    """Store a hand-made zstd object named after ``claimed`` whose frame decodes to ``frame_chunks``
    and whose size trailer records ``len(claimed)``."""
    import zstandard

    from casstore.codecs import ZSTD

    d = Digest.of(claimed)
    p = store.root / "objects" / d.hex[:2] / (d.hex[2:] + ".zst")
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        w = zstandard.ZstdCompressor(level=1).stream_writer(f, closefd=False)
        for chunk in frame_chunks:
            w.write(chunk)
        w.flush(zstandard.FLUSH_FRAME)
        f.write(ZSTD.trailer(len(claimed)))
    os.chmod(p, 0o444)
    return d


BOMB_CHILD = textwrap.dedent("""
    import json, sys
    import casstore
    store = casstore.open(sys.argv[1])
    out = {}
    for name, kw in [("copy", {}), ("copy-no-verify", {"verify": False}), ("mmap", {"mmap": True})]:
        try:
            store.get_array(sys.argv[2], **kw)
            out[name] = None
        except casstore.CasstoreError as e:
            out[name] = type(e).__name__
    # VmHWM: this process image's peak RSS (ru_maxrss would include the parent's, kept across exec)
    out["maxrss_kib"] = int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM")))
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_zstd_npy_bomb_is_integrity_error_with_bounded_memory(store: casstore.Store) -> None:
    """Trailer and header claim a 1 MiB array; the frame decodes to those bytes and then 2 GiB more."""
    legit = _npy("{'descr': '|u1', 'fortran_order': False, 'shape': (1048576,), }", bytes(1 << 20))
    zeros = bytes(1 << 20)
    d = _plant_zstd_object(store, legit, iter([legit] + [zeros] * 2048))
    r = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(store.root), str(d)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["copy"] == out["copy-no-verify"] == out["mmap"] == "IntegrityError", out
    assert out["maxrss_kib"] < 300 << 10, out  # far below the 2 GiB the frame holds
    assert not (store.root / "objects" / d.hex[:2] / d.hex[2:]).exists()  # mmap published no raw copy


def test_zstd_npy_with_different_bytes_behind_a_true_trailer(store: casstore.Store) -> None:
    """Same size, other bytes: the hash decides (verify), and the size still bounds everything."""
    legit = _npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1000,), }", np.arange(1000).tobytes())
    evil = legit[:-8] + b"\xff" * 8
    d = _plant_zstd_object(store, legit, iter([evil]))
    with pytest.raises(IntegrityError):
        store.get_array(d)
    with pytest.raises(IntegrityError):
        store.get_array(d, mmap=True)  # materializing verifies


_DESCRS = ["<f8", "|u1", "<U3", "|S0", "|V0", "<M8[s]", "|O", ">c16", "[('a', '<i4'), ('b', '|S2')]",
           "[('a', '<i4', (2, 3))]", "('<f8', (1000000000,))", "nonsense", "", "{}", "[]"]
# Small dimensions (some headers tell the truth), dimensions whose product allocates far more than
# the 4 MiB the test allows (a header believed would show), and ones numpy cannot even represent.
_SHAPE_ITEMS = st.one_of(st.integers(-3, 20), st.integers(1000, 5000), st.integers(0, 2**70),
                         st.sampled_from(["0", "True", "'a'", "None"]))


@st.composite
def npy_like(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "dict", "dict", "dict"]))
    if kind == "random":
        return b"\x93NUMPY" * draw(st.booleans()) + draw(st.binary(max_size=300))
    dims = draw(st.lists(_SHAPE_ITEMS, max_size=4))
    shape = "(" + ", ".join(str(x) for x in dims) + ("," if len(dims) == 1 else "") + ")"
    if draw(st.booleans()):
        shape = draw(st.text(max_size=20))
    fortran = draw(st.sampled_from(["False", "True", "0", "'x'", "None"]))
    descr = repr(draw(st.sampled_from(_DESCRS))) if draw(st.booleans()) else draw(st.sampled_from(_DESCRS))
    header = "{'descr': " + descr + ", 'fortran_order': " + fortran + ", 'shape': " + shape + ", }"
    if draw(st.booleans()):
        header = header[: draw(st.integers(0, len(header)))]
    ndata = draw(st.sampled_from([0, 1, 8, 24, 80, 1000]))
    blob = _npy(header, bytes(ndata), version=draw(st.sampled_from([1, 2])))
    if draw(st.booleans()):  # damage the framing too: version, length field, padding
        pos = draw(st.integers(0, len(blob) - 1))
        blob = blob[:pos] + draw(st.binary(min_size=1, max_size=3)) + blob[pos + 1:]
    return blob


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=npy_like(), mmap=st.booleans(), compress=st.booleans())
def test_fuzz_npy_header_parser(shared_store: casstore.Store, blob: bytes, mmap: bool, compress: bool) -> None:
    """Arbitrary bytes: an array or a CasstoreError, never another exception, never memory beyond the input."""
    store = shared_store
    d = store.put(blob + (bytes(4096) if compress else b""), compress=compress)
    tracemalloc.start()
    try:
        try:
            a = store.get_array(d, mmap=mmap)
        except casstore.CasstoreError:
            a = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if a is not None:
        assert a.nbytes <= len(blob) + 4096
    assert peak < (4 << 20) + 4 * len(blob), peak  # fixed buffers (1 MiB chunks) plus the input


@pytest.mark.parametrize("order", ["C", "F"])
def test_durable_large_put_written_in_flushed_windows(tmp_path: Path, order: str) -> None:
    """A durable put of several writeback windows (8 MiB each, started while writing) stores
    exactly np.save's bytes, once; a second put of the same array finds it; no staging file remains."""
    store = casstore.open(tmp_path / "store", durable=True, compress=False)
    a = np.asarray(np.random.default_rng(7).random((2_700, 1_000), dtype=np.float64), order=order)  # ~21.6 MB
    buf = io.BytesIO()
    np.save(buf, a)
    d = store.put_array(a)
    assert str(d) == b3(buf.getvalue())
    assert store.path(d).read_bytes() == buf.getvalue()
    assert store.put_array(a) == d
    np.testing.assert_array_equal(store.get_array(d), a)
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


def test_start_writeback_is_only_a_hint(tmp_path: Path) -> None:
    """Staging.start_writeback never raises (empty range, range past the end) and changes no byte."""
    from casstore._fs import Staging

    with Staging(tmp_path) as st:
        st.write(b"x" * 10_000)
        st.start_writeback(0, 0)
        st.start_writeback(0, 8192)
        st.start_writeback(1 << 30, 1 << 20)
        assert os.pread(st.fd, 20_000, 0) == b"x" * 10_000
        st.abort()


@pytest.mark.parametrize("mmap", [False, True])
def test_a_parsed_header_is_reused_only_for_the_same_bytes_and_size(store: casstore.Store, mmap: bool) -> None:
    # Headers are memoized by their exact bytes and the object's size: the same header on an
    # object of another size is checked again (and refused), never taken from the memo.
    a = np.arange(1000, dtype=np.float64)
    good = store.put_array(a, compress=False)
    assert np.array_equal(store.get_array(good, mmap=mmap), a)  # parsed and memoized
    raw = store.get(good)
    for bad in (raw + b"\0" * 8, raw[:-8]):
        d = store.put(bad, compress=False)
        with pytest.raises(casstore.StoreFormatError, match="describing 8000 data bytes"):
            store.get_array(d, mmap=mmap)
    assert np.array_equal(store.get_array(good, mmap=mmap), a)


def _subclasses(tmp: Path) -> dict[str, np.ndarray[Any, Any]]:
    mm = np.memmap(tmp / "mm.bin", dtype="<f4", mode="w+", shape=(3, 4))
    mm[:] = np.arange(12).reshape(3, 4)
    return {
        "matrix": np.matrix(np.arange(6.0).reshape(2, 3)),
        "matrix-fortran": np.asmatrix(np.asfortranarray(np.arange(6.0).reshape(2, 3))),
        "matrix-row": np.matrix([[1, 2, 3, 4]], dtype=np.int16),
        "recarray": np.rec.fromarrays([np.arange(3), np.arange(3.0)], names="a,b"),
        "memmap": mm,
        "chararray": np.char.array([b"ab", b"cde"]),
    }


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_ndarray_subclasses_are_stored_as_their_base_array_with_their_true_size(store: casstore.Store,
                                                                                  tmp_path: Path) -> None:
    # Bug: np.matrix's reshape(-1) stays 2-D, so the size put_arrays recorded was
    # len(memoryview) = rows (129 bytes recorded for a 176-byte object).
    subs = _subclasses(tmp_path)
    b = store.put_arrays(subs)
    man = store.manifest(b)
    for name, a in subs.items():
        base = np.asarray(a)
        d = store.put_array(a)
        assert d == store.put_array(base) == man[name].digest, name  # exactly the base array's .npy
        assert man[name].size == store.objects.stat(d).size == os.path.getsize(store.path(d)), name
        got = store.get_array(d)
        assert type(got) is np.ndarray
        same(base, got)
        same(base, np.load(store.path(d)))  # np.save's bytes for the same array
    assert man["matrix"].size == 176


def test_masked_arrays_are_refused(store: casstore.Store) -> None:
    # Bug: a raw ValueError from numpy.ma; storing a masked array's data would drop its mask.
    ok = store.put_array(np.arange(3))
    for a in (np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]), np.ma.masked_array(np.arange(4.0)),
              np.ma.masked_array(np.zeros((2, 3)), mask=True)):
        with pytest.raises(InvalidTypeError, match=r"masked arrays.*mask.*filled"):
            store.put_array(a)
        with pytest.raises(InvalidTypeError, match="masked"):
            store.put_arrays({"ok": np.arange(3), "m": a})
    assert list(store.iter_objects()) == [ok]  # nothing of a masked array was stored
    m = np.ma.masked_array([1, 2, 3], mask=[0, 1, 0])  # the ways the message names
    b = store.put_arrays({"data": m.data, "mask": np.ma.getmaskarray(m)})
    got = store.get_arrays(b)
    assert np.ma.masked_array(got["data"], mask=got["mask"]).tolist() == [1, None, 3]
    assert store.get_array(store.put_array(m.filled(0))).tolist() == [1, 0, 3]


@pytest.mark.parametrize("bad", ["no", "", 1, 0, None, np.True_])
def test_mmap_must_be_a_bool(store: casstore.Store, bad: Any) -> None:
    # Bug: mmap= was not checked (verify= was): a truthy "no" handed out an unverified map.
    d = store.put_array(np.arange(3))
    b = store.put_arrays({"x": np.arange(3)})
    with pytest.raises(InvalidTypeError, match=r"get_array\(mmap=\) takes True or False"):
        store.get_array(d, mmap=bad)
    with pytest.raises(InvalidTypeError, match=r"get_arrays\(mmap=\) takes True or False"):
        store.get_arrays(b, mmap=bad)
    with pytest.raises(InvalidTypeError, match=r"verify="):
        store.get_array(d, verify="yes")  # type: ignore[arg-type]
