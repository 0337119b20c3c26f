"""Hostile input, class 5: full disks, read-only media, a store owned by another user.

ENOSPC anywhere in a write is one typed error (``DiskFullError``: a
``CasstoreError`` that is also an ``OSError`` with ``errno == ENOSPC``, naming
the store and its free space); nothing is half-published and the store is
fully usable once space is freed.  On a read-only mount (EROFS) every write is
``ReadOnlyError`` and every read still works, which proves reads write
nothing (no lock files, no sweeping, no store.toml rewrite).

The small filesystems are real tmpfs mounts (this needs root, which the test
machines and CI have).
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from conftest import assert_all_objects_valid, compressible, run_as_nobody, tmp_files

import casstore
from casstore.errors import CasstoreError, DiskFullError, ReadOnlyError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def _mount(size: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="casstore-small-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d)], check=True)
    return d


def _umount(d: Path) -> None:
    subprocess.run(["umount", "-l", str(d)], check=False)
    os.rmdir(d)


@pytest.fixture
def small_fs() -> Iterator[Path]:
    d = _mount("8m")
    try:
        yield d
    finally:
        _umount(d)


def _fill(fs: Path, leave: int) -> Path:
    """Fill ``fs`` until about ``leave`` bytes remain; returns the filler file (delete it to free space)."""
    filler = fs / "filler"
    st = os.statvfs(fs)
    n = max(0, st.f_bavail * st.f_frsize - leave)
    with open(filler, "wb") as f:
        f.write(b"\0" * n)
    return filler


def _assert_disk_full(e: BaseException, root: Path) -> None:
    assert isinstance(e, DiskFullError) and isinstance(e, OSError) and isinstance(e, CasstoreError)
    assert e.errno == errno.ENOSPC
    msg = str(e)
    assert str(root) in msg and "free" in msg, msg


PUTS = {
    "put": lambda s, src, big: s.put(big),
    "put-zstd": lambda s, src, big: s.put(compressible(len(big), 3), compress=True),
    "put_path": lambda s, src, big: s.put_path(src),
    "put_path-zstd": lambda s, src, big: s.put_path(src, compress=True),
    "put_stream": lambda s, src, big: s.put_stream(io.BytesIO(big)),
    "put_stream-zstd": lambda s, src, big: s.put_stream(io.BytesIO(compressible(len(big), 5)), compress=True),
    "put_many": lambda s, src, big: s.put_many([big[: len(big) // 2], big[len(big) // 2 :]]),
    "put_parts": lambda s, src, big: s.put_parts([big[:1000], big[1000:]]),
}


@pytest.mark.parametrize("method", sorted(PUTS))
def test_full_disk_is_one_typed_error_and_nothing_half_published(method: str, small_fs: Path,
                                                                   tmp_path: Path) -> None:
    root = small_fs / "store"
    s = casstore.open(root)
    kept = s.put(b"kept before the disk filled")
    big = os.urandom(3 << 20)
    src = tmp_path / "src.bin"  # outside the small filesystem: only the store's side is full
    src.write_bytes(compressible(len(big), 7) if method.endswith("zstd") else big)
    filler = _fill(small_fs, 0)
    with pytest.raises(OSError) as ei:
        PUTS[method](s, src, big)
    _assert_disk_full(ei.value, root)
    assert tmp_files(root) == []  # the staging file went with the error
    assert_all_objects_valid(root)  # nothing half-written is visible
    assert s.get(kept) == b"kept before the disk filled"
    # space freed: the same call succeeds and the store verifies clean
    filler.unlink()
    PUTS[method](s, src, big)
    assert s.verify().ok


def test_a_full_disk_still_serves_every_read_from_a_new_process(small_fs: Path) -> None:
    """Hazard (found by a bug hunt): the filesystem probe a new process runs when it opens a store
    wrote a line unguarded, so on a full disk every command failed, reads included ("ls failed
    unexpectedly: No space left on device")."""
    root = small_fs / "store"
    s = casstore.open(root)
    d = s.put(b"kept bytes")
    with s.edit("exp") as m:
        m["k"] = d
    _fill(small_fs, 0)
    with pytest.raises(OSError) as full:
        with open(small_fs / "more", "wb") as f:
            f.write(b"\0" * (1 << 20))
    assert full.value.errno == errno.ENOSPC

    def cli(*args: str, data: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "casstore", "--store", str(root), *args], input=data,
                              capture_output=True, timeout=120)

    got = cli("get", str(d))
    assert got.returncode == 0 and got.stdout == b"kept bytes", got.stderr
    got = cli("ls")
    assert got.returncode == 0 and b"exp" in got.stdout, got.stderr
    got = cli("verify")
    assert got.returncode == 0, got.stdout + got.stderr
    got = cli("put", "-", data=os.urandom(1 << 20))  # a write: the typed error, not "failed unexpectedly"
    assert got.returncode == 1 and b"DiskFullError" in got.stderr and b"unexpectedly" not in got.stderr, got.stderr


def test_get_onto_a_full_disk_is_the_typed_error_and_leaves_no_part_file(small_fs: Path, tmp_path: Path) -> None:
    """Found by a bug hunt: ``get -o`` onto a full disk or ``/dev/full`` said "get failed unexpectedly"."""
    s = casstore.open(tmp_path / "store")
    d = s.put(os.urandom(3 << 20))
    _fill(small_fs, 0)
    for out in (str(small_fs / "out.bin"), "/dev/full"):
        got = subprocess.run([sys.executable, "-m", "casstore", "--store", str(s.root), "get", str(d), "-o", out],
                             capture_output=True, timeout=120)
        assert got.returncode == 1, got.stderr
        assert b"DiskFullError" in got.stderr and f"-o {out}".encode() in got.stderr, got.stderr
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # no output, no .part file


def test_full_disk_during_a_manifest_commit_leaves_the_head_unchanged(small_fs: Path) -> None:
    root = small_fs / "store"
    s = casstore.open(root)
    d = s.put(b"x")
    with s.edit("exp") as m:
        m["a"] = d
    before = s.heads()["exp"]
    filler = _fill(small_fs, 0)
    with pytest.raises(OSError) as ei:
        with s.edit("exp") as m:
            m["b"] = d
            m.meta["note"] = "y" * 20000
    assert isinstance(ei.value, CasstoreError) and ei.value.errno == errno.ENOSPC
    assert s.heads()["exp"] == before
    assert tmp_files(root) == []
    filler.unlink()
    with s.edit("exp") as m:
        m["b"] = d
    assert set(s.manifest("exp")) == {"a", "b"}


def test_read_only_mount_refuses_writes_and_serves_every_read(small_fs: Path, tmp_path: Path) -> None:
    root = small_fs / "store"
    s = casstore.open(root)
    raw = s.put(os.urandom(100_000))
    packed = s.put(compressible(200_000), compress=True)
    with s.edit("exp") as m:
        m["data/raw.bin"] = raw
        m["data/packed.txt"] = packed
    s.freeze("exp")
    toml_before = (root / "store.toml").read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    ro = casstore.open(root)
    assert not ro.writable
    assert ro.get(raw) == s.get(raw) and ro.get(packed) == s.get(packed)
    with ro.open(packed) as f:
        assert len(f.read()) == 200_000
    assert ro.stat(packed).codec == "zstd"
    assert ro.path(raw).is_file()
    assert set(ro.manifest("exp")) == {"data/raw.bin", "data/packed.txt"}
    assert ro.pins() == {"exp": s.pins()["exp"]} and ro.history("exp")
    out = tmp_path / "out"
    ro.checkout("exp", out)
    assert (out / "data/packed.txt").read_bytes() == compressible(200_000)
    assert ro.verify().ok
    for write in (lambda: ro.put(b"new"), lambda: ro.put_path(out / "data/raw.bin"),
                  lambda: ro.pin("other", "exp"), lambda: ro.verify(repair=True)):
        with pytest.raises(ReadOnlyError):
            write()
    with pytest.raises(ReadOnlyError):
        with ro.edit("new-name") as m:
            m["k"] = raw
    assert (root / "store.toml").read_bytes() == toml_before


def test_store_of_another_user_reads_everything_and_refuses_writes(world_dir: Path) -> None:
    root = world_dir / "store"
    s = casstore.open(root)
    d = s.put(b"owned by root")
    z = s.put(compressible(50_000), compress=True)
    with s.edit("exp") as m:
        m["k"] = d
        m["z"] = z
    out = run_as_nobody("""
root = sys.argv[1]
s = casstore.open(root)
out = {"get": s.get(sys.argv[2]).decode(), "z": len(s.get(sys.argv[3])), "keys": sorted(s.manifest("exp")),
       "heads": sorted(s.heads()), "ok": s.verify().ok}
for name, fn in [("put", lambda: s.put(b"mine")), ("edit", lambda: s.edit("exp").__enter__())]:
    try:
        fn()
        out[name] = "no error"
    except casstore.errors.ReadOnlyError:
        out[name] = "ReadOnlyError"
""", str(root), str(d), str(z))
    assert out == {"get": "owned by root", "z": 50_000, "keys": ["k", "z"], "heads": ["exp"], "ok": True,
                   "put": "ReadOnlyError", "edit": "ReadOnlyError"}
