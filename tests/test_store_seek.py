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


@pytest.mark.parametrize("size", [100_000, 4 << 20])  # (below and above the size hashed on a helper)
def test_a_seek_back_to_the_start_verifies_again(tmp_path: Path, size: int) -> None:
    """Found by a bug hunt: sizing a file by seek(0, 2), then seek(0) and a full read (a common pattern,
    also fsspec's and text mode's) returned corrupt bytes without an error."""
    store = casstore.open(tmp_path / "s")
    d = _corrupt(store, os.urandom(size))
    with store.open(d) as f:
        assert f.seek(0, os.SEEK_END) == size
        f.seek(0)
        with pytest.raises(IntegrityError, match=str(d)):
            f.read()
    with store.open(d) as f:  # also after reading part of it elsewhere
        f.seek(size // 4)
        f.read(10)
        f.seek(0)
        with pytest.raises(IntegrityError):
            f.read()
    good = store.put(os.urandom(size))
    with store.open(good) as f:
        f.seek(0, os.SEEK_END)
        f.seek(0)
        assert len(f.read()) == size and f.seek(0) == 0 and len(f.read()) == size  # twice, verified


def test_seek_elsewhere_turns_verification_off(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    data = os.urandom(1 << 20)
    d = _corrupt(store, data)
    with store.open(d) as f:
        f.seek(10)
        out = f.read()  # documented: no longer a full in-order read, so not verified
    assert len(out) == len(data) - 10


def test_read_to_end_is_one_verified_copy(tmp_path: Path) -> None:
    """open().read() builds its result in place (no chunk list joined into a second copy), verified."""
    store = casstore.open(tmp_path / "s")
    for size in (0, 10, 5 << 20, 40 << 20):  # inline hash, and the helper above 16 MiB
        data = os.urandom(size)
        d = store.put(data)
        with store.open(d) as f:
            assert f.read() == data
        with store.open(d) as f:
            f.read(3)
            assert f.read() == data[3:]
    big = os.urandom(40 << 20)
    d = _corrupt(store, big)
    with store.open(d) as f:
        with pytest.raises(IntegrityError):
            f.read()
    with store.open(d, verify=False) as f:
        assert len(f.read()) == len(big)
    d2 = store.put(os.urandom(20 << 20))
    p2 = store.path(d2)
    os.chmod(p2, 0o644)
    with store.open(d2) as f:
        with open(p2, "ab") as g:  # grows after open: more than recorded, refused when verifying
            g.write(b"tail")
        with pytest.raises(IntegrityError, match="longer"):
            f.read()
