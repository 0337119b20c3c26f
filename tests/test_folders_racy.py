"""Which files the stat cache may vouch for at once: the racy-clean rule, per filesystem (issue 12).

A file rewritten in the same timestamp as the stat a cache recorded keeps that stat, so the
cache must not vouch for a file that could still change unseen.  On a filesystem this kernel
stamps, with sub-second timestamps, that is a file stamped at or after the clock tick in which
the add or status began (its floor, ``_fs.stamp_floor_ns``); on FUSE and network filesystems
(another clock stamps them) and where timestamps are whole seconds, a file modified within
``RACY_SECONDS`` (tests/test_coarse_timestamps.py has the whole-second case).  A racy file is
recorded with a stat no walk matches (mtime and ctime -1), so the next add or status reads it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Set

import pytest
from test_folders import _cache_entries, count_reads, make_tree

import casstore
import casstore.folders as folders
from casstore._fsprobe import fine_local_stamps, mount_of

FILES = {"a": b"alpha", "sub/b": os.urandom(5000), "sub/c": b"gamma"}


def smudged(store: casstore.Store) -> Set[str]:
    """Keys the stat cache recorded racy (mtime and ctime -1)."""
    return {k for k, e in _cache_entries(store).items() if e[3] == -1 and e[4] == -1}


def _local_fine(path: Path) -> None:
    st = os.stat(path)
    if not fine_local_stamps(st.st_dev, st.st_ctime_ns):
        pytest.skip(f"$TMPDIR ({mount_of(st.st_dev)[0]}) is not stamped by this kernel in sub-second "
                    "timestamps: the floor rule does not apply there")


def test_files_written_before_the_add_began_are_settled_at_once(store: casstore.Store, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    _local_fine(f / "a")
    time.sleep(0.05)  # past the clock tick of the writes
    v = store.add("exp", f).digest
    assert smudged(store) == set()  # (under the 2-second rule all three would be)
    reads = count_reads(monkeypatch)
    st = store.status("exp", f)
    assert not st and st.hashed == 0 and reads == []
    assert list((store.root / "cache" / "stat").glob("*.clean"))  # and the folder is marked clean
    assert store.add("exp", f).digest == v and reads == []


def test_a_file_stamped_in_the_tick_the_add_began_is_racy(store: casstore.Store, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    _local_fine(f / "a")
    time.sleep(0.05)
    (f / "a").write_bytes(b"ALPHA")
    stamp = os.stat(f / "a").st_ctime_ns
    with monkeypatch.context() as mp:
        # As if the add began in the very tick that stamped "a" (a write and an add within a few ms):
        mp.setattr(folders, "stamp_floor_ns", lambda: stamp)
        store.add("exp", f)
    assert smudged(store) == {"a"}
    assert not list((store.root / "cache" / "stat").glob("*.clean"))
    time.sleep(0.05)  # (a status in that tick too would find "a" racy again)
    reads = count_reads(monkeypatch)
    assert not store.status("exp", f) and reads == ["a"]  # read again, found equal, now recorded
    assert smudged(store) == set()


def test_on_fuse_the_two_second_rule_applies(store: casstore.Store, fuse_dir: Callable[[str], Path]) -> None:
    f = fuse_dir("local") / "f"
    make_tree(f, FILES)
    time.sleep(0.05)  # settled by this kernel's clock, but the FUSE daemon's stamps are not its own
    store.add("exp", f)
    assert smudged(store) == set(FILES)
