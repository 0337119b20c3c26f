"""Links planted inside a store never send a write outside it (docs/security.md: members of a shared
store can plant files, links and FIFOs).

Attack style: a directory of the store is replaced by hand with a symbolic link to a directory
outside, then the public API and the CLI are called.  The outside directory must stay empty, and
the call must fail with the typed error naming the link (found by a bug hunt: a link at
``objects/8e`` made ``put`` publish the object outside and still print its digest; links at
``locks``, ``bad`` or ``refs/heads`` sent lock files, quarantined objects and refs outside).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import casstore
from casstore.errors import IntegrityError, StoreFormatError


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


# -- things planted at a lock file's name (found by a bug hunt) -----------------------------------
# locks/ of a shared store is group-writable.  A symlink planted at locks/gc.gate made another member's
# commit or gc open its target with O_CREAT: a dangling link created a file outside the store, and a
# link to the member's own file got it chmod-ed to 0664 (~/.ssh/authorized_keys); a directory there
# failed every commit and gc with a raw IsADirectoryError.


def _commit(s: casstore.Store) -> None:
    with s.edit("exp") as m:
        m["k"] = s.put(b"x")


def _name_lock(s: casstore.Store) -> Path:
    _commit(s)  # creates the name's lock file
    (lock,) = (s.root / "locks" / "names").iterdir()
    return lock


@pytest.mark.parametrize("where", ["gc.gate", "gc.lock", "names"])
def test_a_link_at_a_lock_file_is_refused_never_followed(tmp_path: Path, where: str) -> None:
    s = casstore.open(tmp_path / "store", shared=True)
    victim = tmp_path / "home" / "authorized_keys"
    victim.parent.mkdir()
    victim.write_bytes(b"ssh-ed25519 AAAA me\n")
    victim.chmod(0o600)
    created = tmp_path / "home" / "created_by_casstore"
    lock = _name_lock(s) if where == "names" else s.root / "locks" / where
    for target in (victim, created):  # a link to a file of ours, a dangling link
        lock.unlink()
        lock.symlink_to(target)
        with pytest.raises(StoreFormatError, match=rf"lock file {lock} is a symbolic link.*`rm {lock}`"):
            _commit(s)
        if where != "names":
            with pytest.raises(StoreFormatError, match="is a symbolic link"):
                s.plan_gc(grace=0).execute()
        assert oct(victim.stat().st_mode & 0o777) == oct(0o600)  # was 0o664
        assert victim.read_bytes() == b"ssh-ed25519 AAAA me\n"
        assert not created.exists()  # was created (0o664) outside the store
    lock.unlink()
    _commit(s)  # removing it, as the message says, is the whole fix
    assert lock.is_file() and not lock.is_symlink()


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_a_directory_or_fifo_at_the_gc_gate_is_a_typed_error(tmp_path: Path, kind: str) -> None:
    s = casstore.open(tmp_path / "store")
    gate = s.root / "locks" / "gc.gate"
    gate.unlink(missing_ok=True)  # (a private store creates it on first use)
    if kind == "directory":
        gate.mkdir()
    else:
        os.mkfifo(gate)
    with pytest.raises(StoreFormatError, match=f"lock file {gate} is a {kind}, not a regular file"):
        _commit(s)  # a directory: raw IsADirectoryError ("failed unexpectedly" in the CLI)
    s.put(b"garbage")
    got = subprocess.run([sys.executable, "-m", "casstore", "--store", str(s.root), "gc", "--yes", "--grace", "0s"],
                         capture_output=True, timeout=60)
    assert got.returncode == 1 and b"unexpectedly" not in got.stderr and b"not a regular file" in got.stderr, \
        got.stderr


def test_a_hard_link_at_a_lock_file_is_never_chmod_ed(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "store", shared=True)
    mine = tmp_path / "mine"
    mine.write_bytes(b"")
    mine.chmod(0o600)
    gate = s.root / "locks" / "gc.gate"
    gate.unlink()
    os.link(mine, gate)  # another name of a file of ours (fs.protected_hardlinks=0 lets anyone do this)
    _commit(s)
    assert mine.stat().st_mode & 0o777 == 0o600  # was made group-writable


def test_a_link_swapped_in_for_bad_after_open_receives_nothing(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    s = casstore.open(tmp_path / "store")
    d = s.put(b"x" * 5000)
    obj = s.root / "objects" / d.hex[:2] / d.hex[2:]
    obj.chmod(0o644)
    obj.write_bytes(b"Y" + b"x" * 4999)
    stray = s.root / "objects" / "ab" / "payload"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"* * * * * root echo pwned\n")
    _plant(s.root / "bad", outside)  # after the open-time check (a member, or during a long verify)
    with pytest.raises(StoreFormatError, match=f"{s.root / 'bad'} is a symbolic link"):
        s.verify(repair=True)
    assert not list(outside.iterdir())  # received the corrupt object and the planted file
    assert obj.exists() and stray.exists()
    # A read-through copy set aside for a fresh fetch goes the same way (LocalObjects._set_aside).
    with pytest.raises(StoreFormatError, match="is a symbolic link"):
        s.objects._set_aside(d, IntegrityError("damaged"))
    assert not list(outside.iterdir()) and obj.exists()
    (s.root / "bad").unlink()
    rep = s.verify(repair=True)
    assert {p.parent for p in rep.quarantined} == {s.root / "bad"} and len(rep.quarantined) == 2
    assert not obj.exists() and not stray.exists()
