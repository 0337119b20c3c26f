"""Durability that reaches the disk (issue 17).

``put_many`` publishes a batch with one ``syncfs`` where that is trusted; on
FUSE ``syncfs`` never reaches the daemon (0 fsyncs for 50 objects), so there
each object and its directory are fsynced.  casfs logs every FSYNC/FSYNCDIR it
receives (tests/_fusefs.py ``fsync_counts``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List

import pytest
from _fusefs import fsync_counts

import casstore
import casstore._fs
import casstore._lock
import casstore.objects.local as local_mod
from casstore._fsprobe import syncfs_trusted


def test_rule() -> None:
    """FUSE and network filesystems are not trusted; local kernel filesystems are."""
    assert not syncfs_trusted("fuse")
    assert not syncfs_trusted("fuse.sshfs")
    assert not syncfs_trusted("nfs4")
    assert syncfs_trusted("ext4") and syncfs_trusted("tmpfs") and syncfs_trusted("?")


def test_put_many_on_fuse_fsyncs_each_object(fuse_dir: Callable[[str], Path]) -> None:
    """50 objects put_many'd on casfs (local mode): at least 50 file fsyncs reach the daemon."""
    d = fuse_dir("local")
    s = casstore.open(d / "store")
    assert s.objects.durable
    assert not s.objects.syncfs_trusted
    before = fsync_counts(d)
    digests = s.put_many([os.urandom(1000) + bytes([i]) for i in range(50)])
    after = fsync_counts(d)
    assert len(set(digests)) == 50
    assert after[0] - before[0] >= 50, f"only {after[0] - before[0]} file fsyncs reached the daemon"
    assert after[1] - before[1] >= 1
    assert "syncfs: not trusted" in " ".join(casstore._lock.filesystem(d / "store").actions)


def test_put_many_on_local_disk_uses_syncfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the tmp filesystem (ext4/tmpfs/overlay) the fast path stays: two syncfs per batch, no per-file path."""
    s = casstore.open(tmp_path / "store")
    assert s.objects.durable and s.objects.syncfs_trusted
    calls: List[str] = []
    real = casstore._fs.syncfs

    def counting(p: os.PathLike[str] | str) -> None:
        calls.append(str(p))
        real(p)

    monkeypatch.setattr(local_mod, "syncfs", counting)
    s.put_many([os.urandom(1000) + bytes([i]) for i in range(50)])
    assert len(calls) == 2
