"""Staging entries of other hosts are judged by the newest change anywhere inside them."""

from __future__ import annotations

import os
import time
from pathlib import Path

from casstore._fs import STALE_AGE, stale_entries, sweep_stale


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_other_hosts_live_directory_is_kept_while_files_in_it_change(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    live = tmp / "123.456.otherhost.0123abcd.icache"  # a live index cache on another node
    live.mkdir()
    data = live / "data.0"
    data.write_bytes(b"appended a moment ago")
    old = tmp / "124.456.otherhost.0123abce.icache"  # abandoned: nothing changed for > STALE_AGE
    old.mkdir()
    (old / "data.0").write_bytes(b"x")
    _age(old / "data.0", STALE_AGE + 60)
    for d in (live, old):
        _age(d, STALE_AGE + 3600)  # directory mtimes do not move when files are appended to
    assert stale_entries(tmp) == [old]
    assert sweep_stale(tmp) == [old]
    assert live.exists() and data.read_bytes() == b"appended a moment ago"
    assert not old.exists()


def test_other_hosts_old_file_is_swept_and_fresh_one_kept(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    fresh = tmp / "9.9.otherhost.00ff.obj"
    stale = tmp / "9.9.otherhost.00fe.obj"
    fresh.write_bytes(b"a")
    stale.write_bytes(b"b")
    _age(stale, STALE_AGE + 1)
    assert sweep_stale(tmp) == [stale]
    assert fresh.exists()
