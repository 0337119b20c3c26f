"""Staging entries of other hosts are judged by the newest change anywhere inside them."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

import casstore
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


# -- entries that cannot be removed (found by a bug hunt) ----------------------------------------
# Only ENOENT was tolerated: one stale staging file that could not be unlinked (EPERM: an immutable
# file, another user's file in a sticky tmp/) made `gc --yes` exit 1 "failed unexpectedly" after it
# had deleted the garbage, and `verify --repair` too; a stale directory rmtree could not remove
# (ignore_errors=True) was reported as removed.  Root ignores permissions, so the refusal is injected.

_PINNED = ".pinned"  # a file whose name ends so cannot be unlinked (as `chattr +i` would make it)


def _pin_files(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path).endswith(_PINNED):
            raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def test_an_entry_that_cannot_be_removed_is_left_reported_and_the_sweep_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    first = tmp / f"0.9.otherhost.00fa{_PINNED}"  # swept first: the sweep must go on past it
    gone = tmp / "9.9.otherhost.00fb.obj"
    stuck_dir = tmp / "9.9.otherhost.00fc.icache"
    stuck_dir.mkdir()
    (stuck_dir / f"data{_PINNED}").write_bytes(b"x")
    (stuck_dir / "other.data").write_bytes(b"y")
    free_dir = tmp / "9.9.otherhost.00fd.icache"
    free_dir.mkdir()
    (free_dir / "data").write_bytes(b"z")
    first.write_bytes(b"a")
    gone.write_bytes(b"b")
    for p in (first, gone, stuck_dir / f"data{_PINNED}", stuck_dir / "other.data", stuck_dir, free_dir / "data",
              free_dir):
        _age(p, STALE_AGE + 60)
    _pin_files(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="casstore.fs"):
        removed = sweep_stale(tmp)
    assert removed == [gone, free_dir]  # only what is really gone
    assert first.exists() and stuck_dir.exists() and not gone.exists() and not free_dir.exists()
    text = caplog.text
    assert str(first) in text and str(stuck_dir) in text and "Operation not permitted" in text, text


def test_gc_and_verify_repair_finish_despite_an_unremovable_stale_file(
        store: casstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    garbage = store.put(b"garbage" * 100)
    keep = store.put(b"kept")
    with store.edit("exp") as m:
        m["k"] = keep
    stuck = store.root / "tmp" / f"9.9.otherhost.00fa{_PINNED}"
    stuck.write_bytes(b"partial")
    _age(stuck, STALE_AGE + 60)
    _pin_files(monkeypatch)
    result = store.plan_gc(keep_history=0, grace=0).execute()  # raised PermissionError in its final sweep
    assert garbage in result.deleted and garbage not in store and keep in store
    rep = store.verify(repair=True)  # raised PermissionError too
    assert rep.stale_tmp == (stuck,) and rep.removed_tmp == () and rep.ok
    assert stuck.exists()
