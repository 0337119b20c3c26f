"""Memos keyed by a file's stat on a filesystem that keeps whole seconds only (loop-mounted ext4, 128-byte inodes).

The folder stat cache keeps the two-second racy rule there (tests/test_folders_racy.py has the others).

On ``$TMPDIR`` (ext4 or tmpfs on a recent kernel) a change right after a ``stat`` gets a new, finer
ctime, so a memo keyed by (device, inode, size, mtime, ctime) sees it.  Where timestamps are coarse
(whole seconds here; one 4-10 ms clock tick on older kernels, where CI once missed a rewrite) a file
changed twice within one stamp keeps its key.  ``path(d, verify=True)`` and
``get_array(mmap=True, verify=True)`` must not vouch for bytes rewritten within the stamp they hashed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from _loopmount import loop_mount

import casstore
from casstore.errors import IntegrityError


@pytest.fixture(scope="module")
def seconds_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """ext4 with 128-byte inodes: no room for nanoseconds, so every timestamp is a whole second."""
    with loop_mount(tmp_path_factory.mktemp("ext4s"), ["mkfs.ext4", "-q", "-F", "-I", "128"], 64 << 20) as mnt:
        yield mnt


def _rewrite(p: Path, at: int, data: bytes) -> None:
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:
        f.seek(at)
        f.write(data)
    os.chmod(p, 0o444)


def test_the_filesystem_keeps_whole_seconds(seconds_fs: Path) -> None:
    p = seconds_fs / "probe"
    p.write_bytes(b"x")
    assert os.stat(p).st_ctime_ns % 1_000_000_000 == 0  # else the tests below would prove nothing


def test_path_verify_is_not_fooled_by_a_rewrite_within_one_stamp(seconds_fs: Path) -> None:
    store = casstore.open(seconds_fs / "store1")
    for _ in range(10):
        d = store.put(os.urandom(4096), compress=False)
        p = store.path(d, verify=True)
        _rewrite(p, 100, b"\x00" * 64)  # same size, and (nearly always) the same second
        with pytest.raises(IntegrityError):
            store.path(d, verify=True)


def test_mmap_verify_is_not_fooled_by_a_rewrite_within_one_stamp(seconds_fs: Path) -> None:
    store = casstore.open(seconds_fs / "store2")
    a = np.arange(256 * 1024, dtype=np.float32)
    for _ in range(5):
        d = store.put_array(a + np.float32(_), compress=False)
        store.get_array(d, mmap=True, verify=True)
        _rewrite(store.path(d), store.stat(d).size - 8, b"\xff" * 8)
        with pytest.raises(IntegrityError):
            store.get_array(d, mmap=True, verify=True)


def test_folder_files_with_whole_second_stamps_stay_racy_for_two_seconds(seconds_fs: Path, tmp_path: Path) -> None:
    from test_folders import make_tree
    from test_folders_racy import FILES, smudged

    store = casstore.open(tmp_path / "store")
    f = seconds_fs / "folder"
    make_tree(f, FILES)
    time.sleep(0.05)  # past this kernel's tick: settled by the floor rule, not by the stamps' second
    store.add("exp", f)
    assert smudged(store) == set(FILES)
