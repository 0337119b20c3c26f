"""Hostile input, class 5 for IndexCache: a full disk never kills the process.

A live IndexCache memory-maps its index.  Storing into a page of a *sparse*
shared mapping allocates the block at that moment, and on a full disk the
kernel can only answer with SIGBUS: the training job dies without a word.
The index is therefore reserved with ``posix_fallocate`` when the cache is
made, so a full disk is a :class:`~casstore.errors.DiskFullError` (a
``CasstoreError`` that is also an ``OSError`` with ``errno == ENOSPC``) from
the constructor, ``put``, ``freeze`` or ``preserve``, and the cache and the
store work on once space is freed.

The small filesystems are real tmpfs mounts (root is needed to mount them;
the test machines and CI run as root, elsewhere these tests are skipped).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

import casstore
from casstore.cache import IndexCache
from casstore.errors import CasstoreError, DiskFullError


def _mount(size: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="casstore-cache-fs-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()})")
    return d


@pytest.fixture
def small_fs() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = _mount("8m")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        os.rmdir(d)


def _fill(fs: Path, leave: int) -> Path:
    """Fill ``fs`` until about ``leave`` bytes remain; returns the filler (delete it to free space)."""
    filler = fs / "filler"
    st = os.statvfs(fs)
    n = max(0, st.f_bavail * st.f_frsize - leave)
    with open(filler, "ab") as f:
        f.write(b"\0" * n)
    return filler


def _assert_disk_full(e: BaseException) -> None:
    assert isinstance(e, DiskFullError) and isinstance(e, OSError) and isinstance(e, CasstoreError), repr(e)
    assert e.errno == errno.ENOSPC
    assert "free" in str(e), str(e)


def _icache_dirs(root: Path) -> list[str]:
    return [n for n in os.listdir(root / "tmp") if n.endswith(".icache")]


SIGBUS_CHILD = textwrap.dedent("""
    import sys
    import casstore
    from casstore.cache import IndexCache
    from casstore.errors import DiskFullError

    store = casstore.open(sys.argv[1], durable=False)
    length = int(sys.argv[2])
    try:
        c = IndexCache(store, length)
    except DiskFullError as e:
        print("DiskFullError", e.errno)
        sys.exit(0)
    # Reserved: every slot's page is real, so these stores cannot fault.
    for i in range(0, length, 4096 // 32):
        c.put(i, b"")
    print("created")
""")


def test_a_full_disk_never_kills_the_process_by_sigbus(small_fs: Path) -> None:
    root = small_fs / "store"
    casstore.open(root, durable=False)
    filler = _fill(small_fs, 256 << 10)
    # A 4 MiB index on a filesystem with 256 KiB left.  Left sparse, the constructor
    # would succeed and the puts below would touch unallocated pages: SIGBUS (-7).
    r = subprocess.run([sys.executable, "-c", SIGBUS_CHILD, str(root), str(1 << 17)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stdout}{r.stderr}"
    assert r.stdout.split() == ["DiskFullError", str(errno.ENOSPC)], r.stdout + r.stderr
    store = casstore.open(root, durable=False)
    assert _icache_dirs(root) == []  # the failed constructor removed its directory
    # Space freed: the same cache is made and works.
    filler.unlink()
    c = IndexCache(store, 1 << 17)
    assert c.put((1 << 17) - 1, b"last") and c.get((1 << 17) - 1) == b"last"
    c.close()


def test_constructor_on_a_full_disk_is_one_typed_error(small_fs: Path) -> None:
    store = casstore.open(small_fs / "store", durable=False)
    filler = _fill(small_fs, 0)
    with pytest.raises(OSError) as ei:
        IndexCache(store, 1000)
    _assert_disk_full(ei.value)
    assert _icache_dirs(store.root) == []
    filler.unlink()
    with IndexCache(store, 1000) as c:
        assert c.put(999, b"x")


def test_puts_freeze_and_preserve_on_a_full_disk_then_space_freed(small_fs: Path) -> None:
    store = casstore.open(small_fs / "store", durable=False)
    n = 64
    rec = [os.urandom(20_000 + i) for i in range(n)]
    c = IndexCache(store, n)
    # Written in reverse: freeze must compact into a new file (the copying path).
    for i in range(n - 1, n // 2 - 1, -1):
        assert c.put(i, rec[i])
    filler = _fill(small_fs, 0)
    with pytest.raises(OSError) as ei:
        for i in range(n // 2 - 1, -1, -1):
            c.put(i, rec[i])
    _assert_disk_full(ei.value)
    stored = {i for i in range(n) if i in c}
    assert stored and all(c.get(i) == rec[i] for i in stored)  # what was stored is intact
    # freeze needs room for the compacted copy: refused, and the cache stays live.
    with pytest.raises(OSError) as ei:
        c.freeze()
    _assert_disk_full(ei.value)
    assert not c.frozen
    filler.unlink()
    for i in range(n):
        if i not in stored:
            assert c.put(i, rec[i])
    assert c.count == n
    c.freeze()
    # preserve: the frozen file is linked (no space needed), but the manifest must be stored.
    filler = _fill(small_fs, 0)
    with pytest.raises(OSError) as ei:
        c.preserve("kept")
    _assert_disk_full(ei.value)
    assert "kept" not in store.pins()
    filler.unlink()
    d = c.preserve("kept")
    c.close()
    o = IndexCache.open(store, "kept")
    assert o.digest == d and [o.get(i) for i in range(n)] == rec
    o.close()
    assert store.verify().ok
