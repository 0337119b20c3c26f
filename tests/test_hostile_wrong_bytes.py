"""Hostile input, class 4: never silent wrong bytes.

* ``put_path`` of a file whose ``st_size`` lies (procfs says 0, sysfs says
  4096 for a few bytes, a file growing or shrinking while it is read) reads to
  the end and stores exactly what it read; it never stores bytes that differ
  from the file.
* ``path()`` hands out unverified bytes (documented); ``path(d, verify=True)``
  hashes the file first, memoized per (device, inode, size, mtime, ctime).
* ``open_hdf5`` verifies before h5py sees the file (tests/test_hostile_special_files.py
  and tests/test_h5.py hold the HDF5 side).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from conftest import compressible, counting_hash_fd

import casstore
import casstore._faults as faults
from casstore.errors import IntegrityError


def _sysfs_liar() -> Path:
    for p in ("/sys/devices/system/cpu/online", "/sys/kernel/mm/transparent_hugepage/enabled",
              "/sys/devices/system/cpu/possible"):
        path = Path(p)
        if path.exists() and os.stat(path).st_size != len(path.read_bytes()):
            return path
    pytest.skip("no sysfs file whose st_size differs from its content on this machine")


@pytest.mark.parametrize("compress", [False, True])
def test_procfs_file_reporting_size_zero_is_stored_whole(store: casstore.Store, compress: bool) -> None:
    assert os.stat("/proc/version").st_size == 0
    d = store.put_path("/proc/version", compress=compress)
    assert store.get(d) == Path("/proc/version").read_bytes() != b""
    d2 = store.put_path("/proc/self/status", compress=compress)
    assert store.get(d2).startswith(b"Name:")


@pytest.mark.parametrize("compress", [False, True])
def test_sysfs_file_with_a_lying_size_is_stored_as_read(store: casstore.Store, compress: bool) -> None:
    p = _sysfs_liar()
    d = store.put_path(p, compress=compress)
    assert store.get(d) == p.read_bytes()
    assert store.stat(d).size == len(p.read_bytes())


@pytest.mark.parametrize("compress", [False, True])
def test_file_shrinking_after_its_size_was_read_is_stored_as_it_is(store: casstore.Store, tmp_path: Path,
                                                                   compress: bool) -> None:
    src = tmp_path / "shrinks.bin"
    data = compressible(4 << 20) if compress else os.urandom(4 << 20)
    src.write_bytes(data)

    def shrink(point: str) -> None:
        if point == "objects.put_path.sized":
            os.truncate(src, 1 << 20)  # after put_path read st_size, before it copied

    faults.hook = shrink
    try:
        d = store.put_path(src, compress=compress)
    finally:
        faults.hook = None
    assert store.get(d) == data[: 1 << 20] == src.read_bytes()


@pytest.mark.parametrize("compress", [False, True])
def test_file_growing_while_it_is_stored_gives_a_prefix_never_other_bytes(store: casstore.Store, tmp_path: Path,
                                                                          compress: bool) -> None:
    src = tmp_path / "grows.bin"
    block = compressible(1 << 20) if compress else os.urandom(1 << 20)
    src.write_bytes(block * 8)
    stop = threading.Event()

    def grow() -> None:
        with open(src, "ab") as f:
            for _ in range(56):  # bounded (64 MiB in all): an endless writer would be an endless file
                if stop.is_set():
                    return
                f.write(block)
                f.flush()
                time.sleep(0.001)

    t = threading.Thread(target=grow)
    t.start()
    try:
        ds = [store.put_path(src, compress=compress) for _ in range(5)]
    finally:
        stop.set()
        t.join()
    final = src.read_bytes()
    for d in ds:
        got = store.get(d)
        assert len(got) >= 8 << 20 and final[: len(got)] == got


def test_path_hands_out_unverified_bytes_and_verify_true_checks_them(store: casstore.Store) -> None:
    d = store.put(os.urandom(1 << 20))
    p = store.path(d)
    assert store.path(d, verify=True) == p
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:
        f.seek(12345)
        f.write(b"\xff")
    os.chmod(p, 0o444)
    assert store.path(d) == p  # unverified by default (documented: docs/security.md)
    with pytest.raises(IntegrityError):
        store.path(d, verify=True)
    with pytest.raises(IntegrityError):
        store.raw_path(d, verify=True)


def test_verified_once_memo_notices_a_rewrite(store: casstore.Store) -> None:
    d = store.put(b"a" * 100_000)
    p = store.path(d, verify=True)
    store.path(d, verify=True)  # memoized: same file, unchanged
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:
        f.write(b"b")  # same size; mtime and ctime change
    with pytest.raises(IntegrityError):
        store.path(d, verify=True)


def test_verified_memo_spares_the_hash_of_a_settled_file(store: casstore.Store,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    seen = counting_hash_fd(monkeypatch)
    d = store.put(os.urandom(100_000))
    time.sleep(0.05)  # past the clock tick of the put: see tests/test_coarse_timestamps.py
    for _ in range(3):
        store.path(d, verify=True)
    assert seen == [100_000]


def test_put_path_of_an_endless_device_is_refused_at_once(store: casstore.Store) -> None:
    # A pipe is streamed (tests/test_store_basic.py); a character device like
    # /dev/zero never ends and would fill the disk.
    for p in (Path("/dev/zero"), Path("/dev/urandom")):
        with pytest.raises(casstore.InvalidInputError, match="character device"):
            store.put_path(p)
    assert list(store.iter_objects()) == []
