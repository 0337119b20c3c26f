"""open(): seeking to where the hash has got to keeps verification on; elsewhere turns it off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import casstore
from casstore.errors import IntegrityError


def _corrupt(store: casstore.Store, data: bytes) -> casstore.Digest:
    d = store.put(data)
    p = store.path(d)
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:
        f.seek(len(data) // 2)
        f.write(b"\0" * 8)
    return d


def test_seek_to_start_before_reading_still_verifies(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    d = _corrupt(store, os.urandom(4 << 20))
    with store.open(d) as f:
        f.seek(0)
        with pytest.raises(IntegrityError, match=str(d)):
            f.read()
    with store.open(d) as f:  # a seek back inside what was read, then on: np.load's pattern
        f.read(100)
        f.seek(100)
        with pytest.raises(IntegrityError):
            f.read()


def test_seek_elsewhere_turns_verification_off(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    data = os.urandom(1 << 20)
    d = _corrupt(store, data)
    with store.open(d) as f:
        f.seek(10)
        out = f.read()  # documented: no longer a full in-order read, so not verified
    assert len(out) == len(data) - 10
