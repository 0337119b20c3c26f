"""Core object-store contracts: addressing, dedup, codecs, reading, listing, bounded memory."""

from __future__ import annotations

import array
import io
import os
import random
import re
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import blake3
import pytest
from conftest import (
    assert_all_objects_valid,
    b3,
    compressible,
    decode_object_file,
    name_of,
    object_files,
    run_py,
    tmp_files,
)

import casstore
from casstore import Digest
from casstore.digest import hash_bytes, hash_fd, hash_raw
from casstore.errors import CompressedObjectError, InvalidInputError, ObjectNotFoundError

RANDOM = os.urandom(300_000)
TEXT = compressible(300_000)


# -- addressing -------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"x", b"hello world", RANDOM, TEXT, bytes(1 << 20)],
                         ids=["empty", "1B", "small", "random", "text", "zeros-1MiB"])
@pytest.mark.parametrize("compress", [False, True, 1, 19, "zstd", "raw"])
def test_address_is_blake3_of_uncompressed_bytes(store: casstore.Store, data: bytes, compress: object) -> None:
    d = store.put(data, compress=compress)
    assert str(d) == b3(data)
    assert d.hex == blake3.blake3(data).hexdigest()
    assert d.raw == blake3.blake3(data).digest()
    assert store.get(d) == data
    # the file on disk, decoded without casstore, is the data
    (f,) = [p for p in object_files(store.root) if name_of(p) == str(d)]
    assert decode_object_file(f) == data


def test_digest_string_form_and_parse_roundtrip(store: casstore.Store) -> None:
    d = store.put(b"round trip")
    s = str(d)
    assert re.fullmatch(r"blake3:[0-9a-f]{64}", s)
    assert Digest.parse(s) == d
    assert Digest.parse(d.hex) == d  # bare hex accepted
    assert Digest.parse(d) is d
    assert hash(Digest.parse(s)) == hash(d)
    assert Digest.of(b"round trip") == d
    assert Digest.from_bytes(d.raw) == d
    for data in (b"", b"round trip", bytearray(b"x" * 5000), memoryview(b"y" * 70_000)[1:]):
        assert hash_raw(data) == hash_bytes(data).raw == blake3.blake3(bytes(data)).digest()  # (a tree's nodes)
    assert d.algorithm == "blake3"
    assert d.short(8) == s[: len("blake3:") + 8]
    assert eval(repr(d), {"Digest": Digest.parse}) == d
    assert Digest.parse(s) != store.put(b"round trip!")


def test_same_bytes_twice_one_object_same_digest(store: casstore.Store) -> None:
    data = os.urandom(10_000)
    d1 = store.put(data)
    d2 = store.put(bytes(data))
    d3 = store.put(bytearray(data))
    d4 = store.put(memoryview(data))
    assert d1 == d2 == d3 == d4
    assert len(object_files(store.root)) == 1
    assert list(store.iter_objects()) == [d1]
    assert tmp_files(store.root) == []


def test_same_bytes_with_other_codec_keeps_first_copy(store: casstore.Store) -> None:
    d_raw = store.put(TEXT, compress=False)
    d_z = store.put(TEXT, compress=True)
    assert d_raw == d_z
    files = object_files(store.root)
    assert len(files) == 1 and not files[0].name.endswith(".zst")
    assert store.stat(d_raw).codec == "raw"
    # and the other way round, through every write path
    t2 = compressible(200_000, seed=5)
    dz = store.put(t2, compress=True)
    assert store.put(t2, compress=False) == dz
    assert store.put_stream(io.BytesIO(t2), compress=False) == dz
    assert store.put_many([t2, t2], compress=False) == [dz, dz]
    assert [p.name.endswith(".zst") for p in object_files(store.root) if name_of(p) == str(dz)] == [True]


def test_memoryview_of_other_formats_hashes_the_bytes(store: casstore.Store) -> None:
    arr = array.array("i", range(1000))
    d = store.put(memoryview(arr))
    assert d == Digest.of(arr.tobytes())
    assert store.get(d) == arr.tobytes()


def test_same_bytes_from_another_process_same_digest(store: casstore.Store) -> None:
    data = os.urandom(50_000)
    src = store.root.parent / "src.bin"
    src.write_bytes(data)
    d = store.put(data)
    r = run_py("""
        import sys, casstore
        s = casstore.open(sys.argv[1])
        print(s.put(open(sys.argv[2], 'rb').read()))
        print(s.put_path(sys.argv[2], compress=True))
    """, str(store.root), str(src))
    assert r.stdout.split() == [str(d), str(d)]
    assert len(object_files(store.root)) == 1


# -- compression ------------------------------------------------------------


def test_random_bytes_skip_compression(store: casstore.Store) -> None:
    data = os.urandom(2 << 20)
    d = store.put(data, compress=True)
    info = store.stat(d)
    assert info.codec == "raw"
    assert info.size == info.stored_size == len(data)
    assert store.path(d).read_bytes() == data
    assert not any(p.name.endswith(".zst") for p in object_files(store.root))


def test_compressible_data_stored_zstd_smaller(store: casstore.Store) -> None:
    d = store.put(TEXT, compress=True)
    info = store.stat(d)
    assert info.codec == "zstd"
    assert info.size == len(TEXT)
    assert info.stored_size < len(TEXT) // 4
    (f,) = object_files(store.root)
    assert f.name.endswith(".zst") and f.stat().st_size == info.stored_size
    with pytest.raises(CompressedObjectError) as ei:
        store.path(d)
    assert str(d) in str(ei.value)


def test_tiny_data_stays_raw_even_with_compress(store: casstore.Store) -> None:
    d = store.put(b"a" * 100, compress=True)
    assert store.stat(d).codec == "raw"


def test_uncompressed_by_default(store: casstore.Store) -> None:
    d = store.put(TEXT)
    assert store.stat(d).codec == "raw"


def test_store_default_compress_and_per_call_override(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "z", compress=True)
    d1 = s.put(TEXT)
    assert s.stat(d1).codec == "zstd"
    t2 = compressible(100_000, seed=1)
    d2 = s.put(t2, compress=False)
    assert s.stat(d2).codec == "raw"
    # the default is a store setting: it survives reopening without arguments
    s2 = casstore.open(tmp_path / "z")
    assert s2.config.compression == "zstd"
    d3 = s2.put(compressible(100_000, seed=2))
    assert s2.stat(d3).codec == "zstd"
    # a raw store can be opened with a compressing default for this session
    r = casstore.open(tmp_path / "r")
    assert r.config.compression == "raw"
    r2 = casstore.open(tmp_path / "r", compress=True)
    assert r2.stat(r2.put(TEXT)).codec == "zstd"
    assert casstore.open(tmp_path / "r").stat(r2.put(compressible(50_000, 9))).codec == "zstd"


def test_compression_level_is_configurable_and_never_changes_digest(tmp_path: Path) -> None:
    rnd = random.Random(1)  # random words: higher levels find a better entropy coding
    words = [bytes(rnd.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9))) for _ in range(2000)]
    data = b" ".join(rnd.choice(words) for _ in range(200_000))
    sizes = {}
    digests = set()
    for level in (1, 19):
        s = casstore.open(tmp_path / f"l{level}", compress=level)
        assert s.config.level == level
        d = s.put(data)
        digests.add(d)
        sizes[("store", level)] = s.stat(d).stored_size
        assert s.get(d) == data
        p = casstore.open(tmp_path / f"c{level}")
        d = p.put(data, compress=level)
        digests.add(d)
        sizes[("call", level)] = p.stat(d).stored_size
    assert digests == {Digest.of(data)}
    assert sizes[("store", 1)] == sizes[("call", 1)]
    assert sizes[("store", 19)] == sizes[("call", 19)]
    assert sizes[("store", 19)] < sizes[("store", 1)] * 0.95


@pytest.mark.parametrize("bad", [0, 23, -1, "lz4", 2.5])
def test_invalid_compress_argument(store: casstore.Store, bad: object) -> None:
    with pytest.raises(InvalidInputError):
        store.put(TEXT, compress=bad)
    with pytest.raises(ValueError):
        store.put(TEXT, compress=bad)
    assert object_files(store.root) == []


# -- every write and read path, both codecs ----------------------------------


@pytest.mark.parametrize("kind", ["random", "text"])
def test_all_write_and_read_paths_both_codecs(store: casstore.Store, tmp_path: Path, kind: str) -> None:
    data = (os.urandom(3 << 20) if kind == "random" else compressible(3 << 20))
    expect_codec = "raw" if kind == "random" else "zstd"
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    ref = Digest.parse(b3(data))

    for how in ("put", "put_path", "put_stream", "put_many"):
        s = casstore.open(tmp_path / how)
        if how == "put":
            d = s.put(data, compress=True)
        elif how == "put_path":
            d = s.put_path(src, compress=True)
        elif how == "put_stream":
            with open(src, "rb") as f:
                d = s.put_stream(f, compress=True)
        else:
            (d,) = s.put_many([data], compress=True)
        assert d == ref, how
        info = s.stat(d)
        assert (info.codec, info.size) == (expect_codec, len(data)), how
        assert info.stored_size == sum(p.stat().st_size for p in object_files(s.root))
        if expect_codec == "zstd":
            assert info.stored_size < len(data) // 4
        assert s.get(d) == data
        with s.open(d) as f:
            assert f.read() == data
        with s.open(d) as f:  # small sequential chunks
            parts = []
            while chunk := f.read(100_003):
                parts.append(chunk)
            assert b"".join(parts) == data
        assert tmp_files(s.root) == []
        assert assert_all_objects_valid(s.root) == [str(d)]

    # and raw stores of the same content, via put_path/put_stream without compression
    s = casstore.open(tmp_path / "raw")
    assert s.put_path(src, compress=False) == ref
    assert s.stat(ref).codec == "raw"
    assert s.path(ref).read_bytes() == data


def test_open_raw_is_seekable_zstd_is_sequential(store: casstore.Store) -> None:
    d_raw = store.put(RANDOM)
    with store.open(d_raw) as f:
        assert f.seekable()
        f.seek(1000)
        assert f.read(10) == RANDOM[1000:1010]
    d_z = store.put(TEXT, compress=True)
    with store.open(d_z) as f:
        assert not f.seekable()
        assert f.read(10) == TEXT[:10]
        with pytest.raises(io.UnsupportedOperation):
            f.seek(0)


def test_put_stream_empty_and_text_stream(store: casstore.Store) -> None:
    assert store.put_stream(io.BytesIO(b"")) == Digest.of(b"")
    assert store.get(Digest.of(b"")) == b""
    with store.open(Digest.of(b"")) as f:
        assert f.read() == b""


def test_put_path_empty_file(store: casstore.Store, tmp_path: Path) -> None:
    p = tmp_path / "empty"
    p.write_bytes(b"")
    for compress in (False, True):
        d = store.put_path(p, compress=compress)
        assert str(d) == b3(b"")
    assert store.get(d) == b""


@pytest.mark.parametrize("compress", [False, True])
def test_put_path_of_a_pipe_streams_its_content(store: casstore.Store, tmp_path: Path, compress: bool) -> None:
    """A FIFO's st_size is 0: put_path must store what it yields, not an empty object."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    data = compressible(3 << 20) if compress else os.urandom(3 << 20)

    def feed() -> None:
        with open(fifo, "wb") as f:
            f.write(data)

    th = threading.Thread(target=feed)
    th.start()
    try:
        d = store.put_path(fifo, compress=compress)
    finally:
        th.join(30)
    assert str(d) == b3(data)
    assert store.get(d) == data
    assert store.stat(d).codec == ("zstd" if compress else "raw")
    assert tmp_files(store.root) == []


def test_put_many_order_duplicates_and_batches(store: casstore.Store) -> None:
    items = [os.urandom(64) for _ in range(600)]  # more than one internal batch
    items += items[:10] + [TEXT, TEXT]
    ds = store.put_many(items, compress=True)
    assert [str(d) for d in ds] == [b3(x) for x in items]
    uniq = {b3(x) for x in items}
    assert sorted(assert_all_objects_valid(store.root)) == sorted(uniq)
    assert store.stat(Digest.parse(b3(TEXT))).codec == "zstd"
    assert tmp_files(store.root) == []
    # put_many of things already present writes nothing new
    assert store.put_many(items[:5]) == ds[:5]
    assert len(object_files(store.root)) == len(uniq)


def test_put_many_accepts_a_generator(store: casstore.Store) -> None:
    ds = store.put_many(bytes([i]) * 10 for i in range(5))
    assert [store.get(d) for d in ds] == [bytes([i]) * 10 for i in range(5)]


# -- lookup, listing --------------------------------------------------------


def test_contains(store: casstore.Store) -> None:
    d = store.put(b"present")
    missing = Digest.of(b"absent")
    assert d in store and store.contains(d) and str(d) in store and d.hex in store
    assert missing not in store and not store.contains(missing) and str(missing) not in store
    assert 42 not in store and None not in store and b"present" not in store


def test_stat_matches_disk(store: casstore.Store) -> None:
    for data, compress in ((RANDOM, True), (TEXT, True), (TEXT[:1000], False)):
        d = store.put(data, compress=compress)
        info = store.stat(d)
        (f,) = [p for p in object_files(store.root) if name_of(p) == str(d)]
        assert info.digest == d
        assert info.size == len(data)
        assert info.stored_size == f.stat().st_size
        assert info.codec == ("zstd" if f.name.endswith(".zst") else "raw")


def test_iter_objects_sorted_each_once(store: casstore.Store) -> None:
    ds = {store.put(os.urandom(100)) for _ in range(30)} | {store.put(TEXT, compress=True)}
    listed = list(store.iter_objects())
    assert listed == sorted(ds)
    infos = list(store.iter_info())
    assert [i.digest for i in infos] == listed
    # stray files in objects/ are not objects
    (store.root / "objects" / "zz").mkdir()
    (store.root / "objects" / "zz" / "junk").write_bytes(b"x")
    assert list(store.iter_objects()) == listed


def test_resolve_prefixes(store: casstore.Store) -> None:
    ds = [store.put(os.urandom(32)) for _ in range(40)]
    for d in ds[:5]:
        assert store.resolve(str(d)) == d
        assert store.resolve(d.hex) == d
        assert store.resolve(d) == d
        # the shortest unique prefix resolves
        n = next(n for n in range(1, 65) if sum(x.hex.startswith(d.hex[:n]) for x in ds) == 1)
        assert store.resolve(d.hex[:n]) == d
        assert store.resolve("blake3:" + d.hex[:n]) == d
    missing = Digest.of(b"nope")
    with pytest.raises(ObjectNotFoundError):
        store.resolve(missing.hex)
    with pytest.raises(ObjectNotFoundError):
        store.resolve(missing)


def test_store_reopen_sees_objects(store: casstore.Store) -> None:
    d = store.put(b"persist")
    s2 = casstore.open(store.root, create=False)
    assert s2.get(d) == b"persist"
    assert repr(s2) == f"Store({str(store.root)!r})"
    with casstore.open(store.root) as s3:
        assert d in s3


def test_store_settings_file(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "s", compress=7, durable=False)
    toml = (tmp_path / "s" / "store.toml").read_text()
    assert "format = 1" in toml and 'compression = "zstd"' in toml and "level = 7" in toml
    assert "durable = false" in toml
    assert stat.S_IMODE((tmp_path / "s" / "store.toml").stat().st_mode) == 0o444
    assert s.durable is False
    assert casstore.open(tmp_path / "s").durable is False
    assert casstore.open(tmp_path / "s", durable=True).durable is True


def test_objects_are_mode_0444(store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(RANDOM[:5000])
    store.put(b"a" * 1000)
    store.put(TEXT, compress=True)
    store.put_path(src)
    store.put_stream(io.BytesIO(b"stream"))
    store.put_many([b"m1", b"m2"])
    files = object_files(store.root)
    assert len(files) == 6
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o444, p


# -- bounded memory for huge files ------------------------------------------

_MEASURE = r'''
import resource, sys, time
import blake3, casstore

def vm_hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

src, root, expect, compress = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
s = casstore.open(root)
t = time.time()
d = s.put_path(src, compress=compress)
put_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
assert str(d) == expect, (str(d), expect)
h = blake3.blake3(max_threads=blake3.blake3.AUTO)
n = 0
with s.open(d) as f:
    while True:
        b = f.read(1 << 20)
        if not b:
            break
        h.update(b)
        n += len(b)
read_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
assert "blake3:" + h.hexdigest() == expect
print(put_rss, read_rss, vm_hwm_mib(), n, s.stat(d).codec)
'''

# ru_maxrss survives execve on Linux: a child exec'd straight from this (big)
# pytest process would report pytest's RSS.  A small launcher in between gives
# the measuring process a clean high-water mark.
_LAUNCH = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, *sys.argv[1:]]).returncode)"


def _measure(src: Path, root: Path, expect: str, compress: bool) -> tuple[float, float, float, int, str]:
    r = run_py(_LAUNCH, "-c", _MEASURE, str(src), str(root), expect, "1" if compress else "0", timeout=600)
    put_rss, read_rss, hwm, n, codec = r.stdout.split()
    return float(put_rss), float(read_rss), float(hwm), int(n), codec


@pytest.mark.slow
def test_huge_file_put_path_and_streaming_read_bounded_memory() -> None:
    d = Path(tempfile.mkdtemp(prefix="casstore-huge-"))
    try:
        src = d / "huge.bin"
        block = os.urandom(64 << 20)
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with open(src, "wb") as f:
            for i in range(32):  # 2 GiB of real (non-sparse) data
                piece = i.to_bytes(8, "little") + block[8:]
                f.write(piece)
                h.update(piece)
        del block, piece
        expect = "blake3:" + h.hexdigest()
        assert src.stat().st_size == 2 << 30
        assert src.stat().st_blocks * 512 >= 2 << 30  # not sparse

        put_rss, read_rss, hwm, n, codec = _measure(src, d / "store", expect, compress=False)
        assert n == 2 << 30 and codec == "raw"
        assert put_rss < 100, f"put_path peak RSS {put_rss:.0f} MiB"
        assert read_rss < 100, f"open()+read peak RSS {read_rss:.0f} MiB"
        assert hwm < 100

        # get() of an object over 2 GiB (one read(2) returns at most ~2 GiB on Linux)
        r = run_py("""
            import sys, blake3, casstore
            data = casstore.open(sys.argv[1]).get(sys.argv[2])
            print(len(data), 'blake3:' + blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest())
        """, str(d / "store"), expect, timeout=600)
        assert r.stdout.split() == [str(2 << 30), expect]
        shutil.rmtree(d / "store")

        # compressed streaming path: 1 GiB of compressible data
        src.unlink()
        text = compressible(64 << 20)
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with open(src, "wb") as f:
            for i in range(16):
                piece = text[i:] + text[:i]
                f.write(piece)
                h.update(piece)
        del text, piece
        expect = "blake3:" + h.hexdigest()
        put_rss, read_rss, hwm, n, codec = _measure(src, d / "zstore", expect, compress=True)
        assert n == 1 << 30 and codec == "zstd"
        assert put_rss < 100 and read_rss < 100 and hwm < 100, (put_rss, read_rss, hwm)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_write_many_checks_every_digest_and_counts_what_it_created(store: casstore.Store) -> None:
    a, b = b"alpha" * 100, b"beta" * 100
    da, db = casstore.Digest.of(a), casstore.Digest.of(b)
    store.put(a)
    assert store.objects.write_many([(da, a), (db, b), (db, b)]) == 1  # a was there, b once
    assert store.get(db) == b
    c = b"gamma"
    with pytest.raises(casstore.IntegrityError):
        store.objects.write_many([(casstore.Digest.of(c), c), (da, b"not alpha")])
    assert casstore.Digest.of(c) not in store  # refused before anything of the batch was published


# -- stage_fd: the folder add's per-file staging (one reused read buffer per thread) -------------


def test_stage_fd_stores_each_file_exactly_though_one_buffer_is_reused(tmp_path: Path) -> None:
    # Files under 1 MiB are read through a buffer the thread keeps (no fresh pages per file): a short
    # file read after a long one must not carry the long one's tail, nor an empty one anything.
    s = casstore.open(tmp_path / "s", compress=False)
    sizes = [900 << 10, 10, 0, 500 << 10, (1 << 20) - 1, 1]
    for i, n in enumerate(sizes):
        data = random.Random(i).randbytes(n)
        src = tmp_path / f"f{i}"
        src.write_bytes(data)
        fd = os.open(src, os.O_RDONLY)
        try:
            staged = s.objects.stage_fd(fd, n)
        finally:
            os.close(fd)
        assert staged.digest == Digest.of(data), n
        s.objects.publish_batch([staged])
        assert s.get(staged.digest) == data


def test_a_published_staging_file_records_its_stat_as_published(tmp_path: Path) -> None:
    # The hash record notes this stat for each object a folder add publishes (link-mode checkouts trust
    # it): it must be the file's stat after the rename, which changed its ctime, not before it.
    from casstore._fs import Staging

    st = Staging(tmp_path)
    st.write(b"bytes")
    assert st.published_stat is None
    time.sleep(0.02)  # (so a ctime taken before the rename would differ from the one after)
    st.commit(tmp_path / "out", durable=False)
    after = os.stat(tmp_path / "out")
    got = st.published_stat
    assert got is not None and (got.st_ino, got.st_size, got.st_mode) == (after.st_ino, 5, after.st_mode)
    assert (got.st_mtime_ns, got.st_ctime_ns) == (after.st_mtime_ns, after.st_ctime_ns)
    failed = Staging(tmp_path)
    with pytest.raises(OSError):
        failed.commit(tmp_path / "out" / "x", durable=False)  # (a file where a directory must be)
    assert failed.published_stat is None


def test_the_reused_read_buffer_stays_one_piece_long_whatever_the_file_size(tmp_path: Path) -> None:
    # Issue 12: the buffer grew to the largest file read (up to 1 MiB, ~250 fresh pages per pool
    # thread in every add or status process).  Every file is read through one buffer of REUSED_CHUNK
    # (+1 byte to see growth), in pieces no longer than that, and the pieces are the file exactly.
    from casstore._fs import REUSED_CHUNK, read_reused

    buffers = set()
    for i, n in enumerate([900 << 10, 10, 0, REUSED_CHUNK, REUSED_CHUNK + 1, (1 << 20) - 1, 1]):
        data = random.Random(i).randbytes(n)
        src = tmp_path / f"f{i}"
        src.write_bytes(data)
        fd = os.open(src, os.O_RDONLY)
        try:
            got = b""
            for piece in read_reused(fd, n, "hashed"):
                assert len(piece) <= REUSED_CHUNK
                assert isinstance(piece.obj, bytearray) and len(piece.obj) == REUSED_CHUNK + 1
                buffers.add(id(piece.obj))
                got += piece
        finally:
            os.close(fd)
        assert got == data, n
    assert len(buffers) == 1  # one buffer, kept by this thread


@pytest.mark.parametrize(("size", "told"), [(1000, 999), (1000, 1001), (600 << 10, (600 << 10) - 1),
                                           (600 << 10, (600 << 10) + 1), (600 << 10, 300 << 10)])
def test_stage_fd_of_a_file_not_the_size_it_was_told_is_refused(tmp_path: Path, size: int, told: int) -> None:
    # Told less: the file has more bytes (it grew); told more: fewer (it shrank).  Either way it changed
    # since its stat, and the caller reads it again; nothing is staged.  (600 KiB: read in several pieces
    # of the reused buffer, the change seen in the last one.)
    s = casstore.open(tmp_path / "s", compress=False)
    src = tmp_path / "f"
    src.write_bytes(b"x" * size)
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(casstore.IntegrityError, match="changed size"):
            s.objects.stage_fd(fd, told)
        with pytest.raises(casstore.IntegrityError, match="changed size"):
            hash_fd(fd, told)
    finally:
        os.close(fd)
    assert os.listdir(s.root / "tmp") == []


@pytest.mark.parametrize("compress", [False, True])
def test_put_stream_of_a_non_blocking_source_waits_for_all_of_it(store: casstore.Store, compress: bool) -> None:
    """Found by a bug hunt: read() returning None ("no data yet") was taken for the end of the stream, and
    a truncated object was published under the digest of what had arrived."""
    import time

    part = compressible(100_000) if compress else os.urandom(100_000)
    r, w = os.pipe()
    os.set_blocking(r, False)

    def writer() -> None:
        time.sleep(0.3)  # (nothing there at the first read: once it returned None -> "not a binary stream")
        os.write(w, part)
        time.sleep(0.3)
        os.write(w, part)
        os.close(w)

    th = threading.Thread(target=writer)
    th.start()
    try:
        with io.FileIO(r, "rb") as f:
            d = store.put_stream(f, compress=compress)
    finally:
        th.join(30)
    assert store.get(d) == part + part
    assert store.stat(d).codec == ("zstd" if compress else "raw")


def test_put_stream_refuses_text_and_waits_only_where_it_can(store: casstore.Store) -> None:
    class Odd(io.RawIOBase):
        def __init__(self, answers: list[object]) -> None:
            super().__init__()
            self.answers = answers

        def read(self, n: int = -1) -> object:  # type: ignore[override]
            return self.answers.pop(0) if self.answers else b""

    with pytest.raises(casstore.InvalidTypeError, match="returned str"):  # (after a first good chunk: raw TypeError)
        store.put_stream(Odd([b"x" * 10, "abc"]))  # type: ignore[arg-type]
    with pytest.raises(casstore.InvalidTypeError, match="returned str"):
        store.put_stream(Odd([b"x" * 600, "abc"]), compress=True)  # type: ignore[arg-type]
    with pytest.raises(casstore.InvalidInputError, match="no file descriptor to wait on"):
        store.put_stream(Odd([b"x", None]))  # type: ignore[arg-type]
    assert os.listdir(store.root / "tmp") == []


def test_a_stream_whose_first_read_is_tiny_is_sampled_fairly_for_compression(store: casstore.Store) -> None:
    """Found by a bug hunt: a FIFO whose writer sent a 7-byte header first had its 51 MB of one repeated line
    stored raw under compress=True (the sample was the 7 bytes)."""
    body = b"the same line again\n" * 200_000
    r, w = os.pipe()

    def writer() -> None:
        os.write(w, b"header\n")
        import time

        time.sleep(0.2)
        with open(w, "wb", closefd=True) as f:
            f.write(body)

    th = threading.Thread(target=writer)
    th.start()
    try:
        with io.FileIO(r, "rb") as f:
            d = store.put_stream(f, compress=True)
    finally:
        th.join(30)
    info = store.stat(d)
    assert info.codec == "zstd" and info.stored_size < len(body) // 10 and store.get(d) == b"header\n" + body


def test_put_of_the_wrong_type_says_what_to_do_for_that_type(store: casstore.Store, tmp_path: Path) -> None:
    """Found by a bug hunt: put(mmap) advised "encode text first (s.encode())"."""
    import mmap

    import numpy as np

    p = tmp_path / "m"
    p.write_bytes(b"mapped bytes")
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        with pytest.raises(casstore.InvalidTypeError, match=r"pass memoryview\(x\) to store this mmap's bytes"):
            store.put(m)  # type: ignore[arg-type]
        mv = memoryview(m)
        assert store.get(store.put(mv)) == b"mapped bytes"
        mv.release()
    with pytest.raises(casstore.InvalidTypeError, match="put_array"):
        store.put(np.arange(3))  # type: ignore[arg-type]
    with pytest.raises(casstore.InvalidTypeError, match=r"s\.encode\(\)"):
        store.put("text")  # type: ignore[arg-type]
