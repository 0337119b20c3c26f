"""Links planted inside a store never send a write outside it (docs/security.md: members of a shared
store can plant files, links and FIFOs).

Attack style: a directory of the store is replaced by hand with a symbolic link to a directory
outside, then the public API and the CLI are called.  The outside directory must stay empty, and
the call must fail with the typed error naming the link (found by a bug hunt: a link at
``objects/8e`` made ``put`` publish the object outside and still print its digest; links at
``locks``, ``bad`` or ``refs/heads`` sent lock files, quarantined objects and refs outside).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import casstore
from casstore.errors import StoreFormatError


def _plant(link: Path, outside: Path) -> None:
    if link.is_dir():
        link.rename(link.with_name(link.name + ".moved"))
    link.symlink_to(outside, target_is_directory=True)


def test_a_link_at_a_fan_out_directory_stops_the_put(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    s = casstore.open(tmp_path / "store", shared=True)
    d = casstore.Digest.of(b"payload")
    _plant(s.root / "objects" / d.hex[:2], outside)
    with pytest.raises(StoreFormatError, match=rf"objects/{d.hex[:2]} is a symbolic link"):
        s.put(b"payload")
    got = subprocess.run([sys.executable, "-m", "casstore", "--store", str(s.root), "put", "-"], input=b"payload",
                         capture_output=True, timeout=60)
    assert got.returncode == 1 and b"is a symbolic link" in got.stderr, got.stderr
    assert not list(outside.iterdir())  # nothing written outside
    assert d not in s


@pytest.mark.parametrize("where", ["locks", "bad", "tmp", "refs/heads", "cache/stat"])
def test_a_link_at_a_fixed_directory_refuses_to_open_the_store(tmp_path: Path, where: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    s = casstore.open(tmp_path / "store")
    (s.root / where).parent.mkdir(parents=True, exist_ok=True)
    _plant(s.root / where, outside)
    with pytest.raises(StoreFormatError, match=f"{where} is a symbolic link"):
        casstore.open(s.root)
    assert not list(outside.iterdir())


def test_a_link_at_a_prefix_of_a_name_stops_the_commit(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    s = casstore.open(tmp_path / "store")
    (s.root / "refs" / "heads" / "team").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreFormatError, match="heads/team is a symbolic link"):
        with s.edit("team/exp") as m:
            m["k"] = s.put(b"x")
    assert not list(outside.iterdir())
    assert s.refs.get("heads", "team/exp") is None
