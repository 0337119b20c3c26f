"""Read-only lower layers stay read-only (issue 17).

A store baked into an image is the lower layer of a real overlayfs mount; a
put of content it already holds must not refresh the object's mtime, because
that copies the whole object into the upper layer.  Needs root (mount -t
overlay); skips without it, fails instead under ``CASSTORE_REQUIRE_FUSE=1`` (CI).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator, Tuple

import pytest

import casstore

BIG = 64 << 20


def _skip(reason: str) -> None:
    if os.environ.get("CASSTORE_REQUIRE_FUSE") == "1":
        pytest.fail(f"{reason} (CASSTORE_REQUIRE_FUSE=1: overlay tests must run here)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[Path, Path, bytes]]:
    """(mount, upperdir, big content) with a store holding ``big`` in the lower layer."""
    if os.geteuid() != 0:
        _skip("mounting overlayfs needs root")
    base = tmp_path_factory.mktemp("overlay")
    lower, upper, work, mnt = (base / n for n in ("lower", "upper", "work", "mnt"))
    for d in (lower, upper, work, mnt):
        d.mkdir()
    big = os.urandom(1 << 20) * (BIG >> 20)
    s = casstore.open(lower / "store")
    s.put(big)
    r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={upper},workdir={work}", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        _skip(f"mount -t overlay failed: {r.stderr.strip()}")
    try:
        yield mnt, upper, big
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _upper_bytes(upper: Path) -> int:
    return sum(p.stat().st_size for p in upper.rglob("*") if p.is_file() and not p.is_symlink())


def test_reput_does_not_copy_up(overlay: Tuple[Path, Path, bytes]) -> None:
    """Opening the store and putting the lower object again copies nothing up; get and verify work."""
    mnt, upper, big = overlay
    s = casstore.open(mnt / "store")
    d = s.put(big)
    assert not [p for p in upper.rglob("*") if p.is_file() and str(d) in p.name], "object file copied up"
    assert _upper_bytes(upper) < (1 << 20), "the 64 MiB object was copied into the upper layer"
    assert s.get(d) == big
    s.verify()
    assert _upper_bytes(upper) < (1 << 20)
    # a new object goes to the upper layer
    new = os.urandom(4096)
    d2 = s.put(new)
    assert s.get(d2) == new
    assert _upper_bytes(upper) >= 4096
