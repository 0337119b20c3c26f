"""Bad input, damaged objects, non-stores, read-only stores: the right error, and nothing left behind."""

from __future__ import annotations

import io
import os
import random
import stat
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import (
    assert_all_objects_valid,
    b3,
    compressible,
    name_of,
    object_files,
    run_as_nobody,
    tmp_files,
)

import casstore
from casstore import Digest
from casstore.errors import (
    AmbiguousDigestError,
    CasstoreError,
    IntegrityError,
    InvalidDigestError,
    InvalidTypeError,
    ObjectNotFoundError,
    StoreFormatError,
)

TRAILER = 20  # bytes of the size trailer (a zstd skippable frame) at the end of .zst objects


def _file_of(store: casstore.Store, d: Digest) -> Path:
    (p,) = [f for f in object_files(store.root) if name_of(f) == str(d)]
    return p


def _flip(path: Path, pos: int) -> None:
    # as root we can write a 0o444 file; do it in place like bit rot would
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def _read_all(store: casstore.Store, d: Digest, **kw: Any) -> bytes:
    with store.open(d, **kw) as f:
        return f.read()


def _nothing_left(store: casstore.Store) -> None:
    assert tmp_files(store.root) == []
    assert_all_objects_valid(store.root)


# -- bad arguments ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["text", 42, [1, 2, 3], None, {"a": 1}, 3.5])
def test_put_non_bytes_is_invalid_type(store: casstore.Store, bad: object) -> None:
    for call in (lambda: store.put(bad), lambda: store.put_many([b"ok", bad])):  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError) as ei:
            call()
        assert isinstance(ei.value, TypeError) and isinstance(ei.value, CasstoreError)
        assert type(bad).__name__ in str(ei.value)
    assert object_files(store.root) == []
    assert tmp_files(store.root) == []


def test_put_stream_needs_a_binary_stream(store: casstore.Store) -> None:
    with pytest.raises(InvalidTypeError):
        store.put_stream(b"bytes are not a stream")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        store.put_stream(io.StringIO("text stream"))  # type: ignore[arg-type]
    _nothing_left(store)
    assert object_files(store.root) == []


def test_put_path_missing_file_or_directory(store: casstore.Store, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFoundError) as ei:
        store.put_path(tmp_path / "no-such-file")
    assert "no-such-file" in str(ei.value)
    with pytest.raises(InvalidTypeError):
        store.put_path(tmp_path)
    _nothing_left(store)
    assert object_files(store.root) == []


def test_missing_digest_is_object_not_found(store: casstore.Store) -> None:
    store.put(b"something else")
    d = Digest.of(b"never stored")
    calls: list[Callable[[], object]] = [
        lambda: store.get(d), lambda: store.get(str(d)), lambda: store.open(d), lambda: store.stat(d),
        lambda: store.path(d), lambda: store.resolve(d), lambda: store.resolve(d.hex),
    ]
    for call in calls:
        with pytest.raises(ObjectNotFoundError) as ei:
            call()
        assert isinstance(ei.value, LookupError) and isinstance(ei.value, CasstoreError)
    with pytest.raises(ObjectNotFoundError) as ei:
        store.get(d)
    assert str(d) in str(ei.value)


@pytest.mark.parametrize("text", [
    "", "blake3:", "blake3:xyz", "blake3:" + "a" * 63, "blake3:" + "a" * 65, "blake3:" + "A" * 64,
    "sha256:" + "a" * 64, "a" * 63, "g" * 64, " " + "a" * 64,
])
def test_malformed_digest(store: casstore.Store, text: str) -> None:
    for call in (lambda: Digest.parse(text), lambda: store.get(text), lambda: store.stat(text),
                 lambda: store.open(text), lambda: store.contains(text)):
        with pytest.raises(InvalidDigestError) as ei:
            call()
        assert isinstance(ei.value, ValueError) and isinstance(ei.value, CasstoreError)


def test_digest_of_wrong_type(store: casstore.Store) -> None:
    with pytest.raises(InvalidTypeError):
        store.get(12345)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        store.resolve(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidDigestError):
        Digest(b"\x00" * 32)  # type: ignore[arg-type]


def test_resolve_ambiguous_prefix(store: casstore.Store) -> None:
    ds = [store.put(os.urandom(16)) for _ in range(40)]  # 40 > 16: some first hex digit repeats
    first = [d.hex[0] for d in ds]
    c = next(c for c in "0123456789abcdef" if first.count(c) >= 2)
    for prefix in (c, "blake3:" + c):
        with pytest.raises(AmbiguousDigestError) as ei:
            store.resolve(prefix)
        assert isinstance(ei.value, InvalidDigestError) and isinstance(ei.value, ValueError)
        assert f"matches {first.count(c)} objects" in str(ei.value)
    with pytest.raises(InvalidDigestError):
        store.resolve("xyz")


# -- not a store ------------------------------------------------------------


def test_non_empty_directory_without_settings_is_not_a_store(tmp_path: Path) -> None:
    d = tmp_path / "notastore"
    d.mkdir()
    (d / "precious.txt").write_text("user data")
    for create in (True, False):
        with pytest.raises(StoreFormatError) as ei:
            casstore.open(d, create=create)
        assert isinstance(ei.value, CasstoreError)
    assert sorted(os.listdir(d)) == ["precious.txt"]  # nothing was created in it


def test_a_file_is_not_a_store(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    for create in (True, False):
        with pytest.raises(StoreFormatError):
            casstore.open(f, create=create)
        with pytest.raises(StoreFormatError):
            casstore.Store(f, create=create)
    assert f.read_text() == "x"


def test_missing_directory_with_create_false(tmp_path: Path) -> None:
    with pytest.raises(StoreFormatError) as ei:
        casstore.open(tmp_path / "missing", create=False)
    assert "missing" in str(ei.value)
    assert not (tmp_path / "missing").exists()


def test_empty_directory_becomes_a_store(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    s = casstore.open(tmp_path / "empty")
    assert (tmp_path / "empty" / "store.toml").exists()
    assert s.get(s.put(b"x")) == b"x"


@pytest.mark.parametrize("edit", [
    ("format = 1", "format = 99"),
    ('hash = "blake3"', 'hash = "sha256"'),
    ("format = 1", "format = 'one'"),
    ("[store]", "[store"),
])
def test_newer_or_damaged_settings(store: casstore.Store, edit: tuple[str, str]) -> None:
    cfg = store.root / "store.toml"
    text = cfg.read_text()
    assert edit[0] in text
    cfg.write_text(text.replace(edit[0], edit[1]))  # root may write the 0o444 file
    for create in (True, False):
        with pytest.raises(StoreFormatError) as ei:
            casstore.open(store.root, create=create)
        assert isinstance(ei.value, CasstoreError)
    if edit[1] == "format = 99":
        assert "99" in str(ei.value) and "upgrade" in str(ei.value)


# -- integrity --------------------------------------------------------------


@pytest.mark.parametrize("size", [5000, 3 << 20], ids=["small", "3MiB"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_raw_object(store: casstore.Store, size: int, where: str) -> None:
    data = os.urandom(size)
    d = store.put(data)
    pos = {"first": 0, "middle": size // 2, "last": size - 1}[where]
    _flip(_file_of(store, d), pos)
    for call in (lambda: store.get(d), lambda: _read_all(store, d), lambda: store.get(str(d))):
        with pytest.raises(IntegrityError) as ei:
            call()
        assert str(d) in str(ei.value) and isinstance(ei.value, CasstoreError)
    # reading exactly `size` bytes must already raise: the last chunk is never handed out unverified
    with store.open(d) as f, pytest.raises(IntegrityError):
        f.read(size)
    # chunked reads raise too, at the latest on the chunk holding the last byte
    with store.open(d) as f, pytest.raises(IntegrityError):
        while f.read(4096):
            pass
    # verify=False is what skips the check: the damaged bytes come back
    expect = bytearray(data)
    expect[pos] ^= 0xFF
    assert store.get(d, verify=False) == bytes(expect)
    assert _read_all(store, d, verify=False) == bytes(expect)


@pytest.mark.parametrize("compress", [False, True])
def test_truncated_object(store: casstore.Store, compress: bool) -> None:
    data = compressible(200_000) if compress else os.urandom(200_000)
    d = store.put(data, compress=compress)
    p = _file_of(store, d)
    os.truncate(p, p.stat().st_size // 2)
    for call in (lambda: store.get(d), lambda: _read_all(store, d)):
        with pytest.raises(IntegrityError) as ei:
            call()
        assert str(d) in str(ei.value)
    if compress:
        with pytest.raises(IntegrityError):
            store.stat(d)
    os.truncate(p, 0)
    for call in (lambda: store.get(d), lambda: _read_all(store, d)):
        with pytest.raises(IntegrityError):
            call()


def test_extra_bytes_appended_to_raw_object(store: casstore.Store) -> None:
    data = os.urandom(10_000)
    d = store.put(data)
    with open(_file_of(store, d), "ab") as f:
        f.write(b"garbage")
    for call in (lambda: store.get(d), lambda: _read_all(store, d)):
        with pytest.raises(IntegrityError):
            call()


@pytest.mark.parametrize("n", [5000, 300_000])
def test_flipped_byte_anywhere_in_zstd_object(store: casstore.Store, n: int) -> None:
    data = compressible(n, seed=7)
    d = store.put(data, compress=True)
    p = _file_of(store, d)
    assert p.name.endswith(".zst")
    good = p.read_bytes()
    positions = range(len(good))
    if len(good) > 1000:  # every trailer byte, and a random sample of the frame
        frame = len(good) - TRAILER
        positions = sorted(random.sample(range(frame), 300)) + list(range(frame, len(good)))
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 0xFF
        p.write_bytes(bytes(bad))
        in_frame = pos < len(good) - TRAILER
        # get: never wrong bytes, never a zstandard.ZstdError; the frame is always checked
        try:
            out = store.get(d)
        except IntegrityError as e:
            assert str(d) in str(e)
        else:
            assert not in_frame, f"get returned for a damaged frame byte {pos}"
            assert out == data, f"get returned wrong bytes (flipped byte {pos})"
        with pytest.raises(IntegrityError) as ei:
            _read_all(store, d)
        assert str(d) in str(ei.value), pos
    p.write_bytes(good)
    assert store.get(d) == data


def test_corruption_is_reported_not_repaired(store: casstore.Store) -> None:
    data = os.urandom(1000)
    d = store.put(data)
    _flip(_file_of(store, d), 10)
    with pytest.raises(IntegrityError):
        store.get(d)
    # putting the data again does not hide the damage silently (the object already "exists")
    assert store.put(data) == d
    with pytest.raises(IntegrityError):
        store.get(d)


# -- failed puts leave nothing behind ----------------------------------------


class _Boom(Exception):
    pass


class _FailingStream(io.RawIOBase):
    """Yields a few chunks of data, then fails like a broken network stream."""

    def __init__(self, chunk: bytes, chunks: int) -> None:
        self.chunk, self.left = chunk, chunks

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.left == 0:
            raise _Boom("connection reset")
        self.left -= 1
        return self.chunk


@pytest.mark.parametrize("compress", [False, True])
def test_failing_stream_leaves_no_object_and_no_tmp(store: casstore.Store, compress: bool) -> None:
    chunk = compressible(1 << 20) if compress else os.urandom(1 << 20)
    with pytest.raises(_Boom):
        store.put_stream(_FailingStream(chunk, 3), compress=compress)
    assert object_files(store.root) == []
    assert tmp_files(store.root) == []


def test_failing_put_many_leaves_no_tmp(store: casstore.Store) -> None:
    good = [os.urandom(100) for _ in range(5)]

    def items() -> Any:
        yield from good
        raise _Boom("producer failed")

    with pytest.raises(_Boom):
        store.put_many(items())
    assert tmp_files(store.root) == []
    assert_all_objects_valid(store.root)
    with pytest.raises(InvalidTypeError):
        store.put_many([*good, "text"])  # type: ignore[list-item]
    assert tmp_files(store.root) == []
    assert_all_objects_valid(store.root)


# -- permissions (checked as an unprivileged user: root ignores mode bits) ------


def test_objects_read_only_for_other_users(world_dir: Path) -> None:
    s = casstore.open(world_dir / "store")
    raw = s.put(os.urandom(5000))
    z = s.put(compressible(100_000), compress=True)
    paths = [str(s.path(raw)), str(_file_of(s, z)), str(s.root / "store.toml")]
    for p in paths:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o444, p
    out = run_as_nobody("""
        out = {}
        for p in sys.argv[1:]:
            for mode in ("r+b", "wb", "ab"):
                try:
                    open(p, mode).close()
                    out[p + mode] = "opened"
                except PermissionError:
                    out[p + mode] = "PermissionError"
            out[p + "read"] = len(open(p, "rb").read())
    """, *paths)
    for p in paths:
        for mode in ("r+b", "wb", "ab"):
            assert out[p + mode] == "PermissionError", (p, mode)
        assert out[p + "read"] == os.path.getsize(p)
    assert s.get(raw) and s.get(z)  # untouched


def test_read_only_store_put_fails_get_works(world_dir: Path) -> None:
    s = casstore.open(world_dir / "store")
    text = compressible(100_000)
    d_raw = s.put(b"readable")
    d_z = s.put(text, compress=True)
    src = world_dir / "src.bin"
    src.write_bytes(b"from a file")
    os.chmod(src, 0o644)
    for dirpath, _, _ in os.walk(s.root):
        os.chmod(dirpath, 0o755)  # owned by root: not writable for uid 65534
    before = [str(p) for p in object_files(s.root)]
    out = run_as_nobody("""
        import io
        root, d_raw, d_z, src = sys.argv[1:]
        out = {}
        s = casstore.open(root)
        out["writable"] = s.writable
        out["get"] = s.get(d_raw).decode()
        out["get_z"] = len(s.get(d_z))
        with s.open(d_z) as f:
            out["open_z"] = len(f.read())
        out["contains"] = d_raw in s
        out["list"] = [str(d) for d in s.iter_objects()]
        for name, call in [
            ("put", lambda: s.put(b"new bytes")),
            ("put_z", lambda: s.put(b"new compressible " * 1000, compress=True)),
            ("put_many", lambda: s.put_many([b"x", b"y"])),
            ("put_path", lambda: s.put_path(src)),
            ("put_stream", lambda: s.put_stream(io.BytesIO(b"stream"))),
        ]:
            try:
                call()
                out[name] = "no error"
            except casstore.errors.ReadOnlyError as e:
                out[name] = ["ReadOnlyError", isinstance(e, PermissionError),
                             isinstance(e, casstore.errors.CasstoreError), str(e)]
        # putting something already present needs no write: it just returns the digest
        out["put_existing"] = str(s.put(b"readable"))
        try:
            casstore.open(root + "/../newstore")
            out["create"] = "no error"
        except casstore.errors.CasstoreError as e:
            out["create"] = type(e).__name__
    """, str(s.root), str(d_raw), str(d_z), str(src))
    assert out["writable"] is False
    assert out["get"] == "readable"
    assert out["get_z"] == out["open_z"] == len(text)
    assert out["contains"] is True
    assert sorted(out["list"]) == sorted([str(d_raw), str(d_z)])
    for name in ("put", "put_z", "put_many", "put_path", "put_stream"):
        kind, is_perm, is_cas, msg = out[name]
        assert (kind, is_perm, is_cas) == ("ReadOnlyError", True, True), name
        assert str(s.root) in msg
    assert out["put_existing"] == b3(b"readable")
    assert out["create"] == "ReadOnlyError"
    assert [str(p) for p in object_files(s.root)] == before
    assert tmp_files(s.root) == []
