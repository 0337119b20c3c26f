"""The stat cache's patch file: a save that changed a few rows writes only them (issue 12).

Hazards: a patch applied to a base it was not written against (another process rewrote the base
meanwhile) would pair rows and digests that never went together; a damaged one must not be half
used; and the base must still be rewritten once the patch outgrows its share, or every load pays
for an ever longer patch.  The contract: whatever the patch, status and add answer exactly, and a
file is read again rather than trusted wrongly.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import msgpack
import pytest
from test_folders import (
    _cache_entries,
    _cache_file,
    _mark,
    count_reads,
    folder_content,
    make_tree,
    status_without_hanging,
)

import casstore
import casstore.folders as folders
from casstore import Digest

FILES = {f"d{i % 7}/f{i:03d}": os.urandom(100 + i) for i in range(300)}


@pytest.fixture(autouse=True)
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every file is settled once written: the tests are about which rows are saved where, not the racy rule.
    monkeypatch.setattr(folders, "fine_local_stamps", lambda st_dev, ctime_ns: False)
    monkeypatch.setattr(folders, "RACY_SECONDS", 0.0)


def _patch(store: casstore.Store) -> Path:
    return _cache_file(store).with_suffix(".patch")


def _doc(path: Path) -> Dict[str, Any]:
    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    assert isinstance(doc, dict)
    return doc


def _patched_keys(store: casstore.Store) -> List[str]:
    """The keys whose rows the patch holds (by index in its base)."""
    keys = _doc(_cache_file(store))["keys"]
    return [keys[i] for (i,) in struct.iter_unpack("<I", _doc(_patch(store))["at"])]


def _rewrite(f: Path, keys: List[str]) -> None:
    time.sleep(0.01)
    for k in keys:
        (f / k).write_bytes(b"new " + k.encode())


def _patched(tmp_path: Path, store: casstore.Store) -> Tuple[Path, Digest]:
    """A folder added as ``exp``, then two of its files rewritten and added again (a patch beside the
    base); the folder and the first version."""
    f = tmp_path / "f"
    make_tree(f, FILES)
    v1 = store.add("exp", f).digest
    _rewrite(f, sorted(FILES)[:2])
    store.add("exp", f)
    return f, v1


def _lying(patch: Dict[str, Any], v1: Digest) -> bytes:
    """``patch`` made to lie: zero digests for files whose stat it has exactly, and a claim of the first
    version (so status compares with the head in full, and a believed lie shows)."""
    patch["digests"] = bytes(8 * len(patch["at"]))  # (32 bytes per row, whose index takes 4)
    patch["version"] = v1.hex
    return msgpack.packb(patch, use_bin_type=True)  # type: ignore[no-any-return]


def _entries_match_the_folder(store: casstore.Store, f: Path) -> None:
    """Every cached row is the file's stat now and its digest the file's bytes."""
    got = _cache_entries(store)
    assert sorted(got) == sorted(str(p.relative_to(f)) for p in f.rglob("*") if p.is_file())
    for k, (dev, ino, size, mtime, ctime, digest) in got.items():
        s = os.stat(f / k)
        assert (dev, ino, size, mtime, ctime) == (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns), k
        assert digest == Digest.of((f / k).read_bytes()).hex, k


def test_a_small_change_writes_a_patch_and_leaves_the_base(store: casstore.Store, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    store.add("exp", f)
    base = _cache_file(store)
    before, was = base.read_bytes(), os.stat(base)
    changed = sorted(FILES)[10:13]
    _rewrite(f, changed)
    v2 = store.add("exp", f).digest
    assert base.read_bytes() == before and os.stat(base).st_ino == was.st_ino  # the base is not rewritten
    patch = _doc(_patch(store))
    assert patch["base"] == _doc(base)["id"] and _patched_keys(store) == changed
    assert patch["version"] == v2.hex  # the claim moved with the rows
    _entries_match_the_folder(store, f)
    # Base and patch together vouch for the new head: nothing is read (the mark is gone, so the
    # stat cache answers; without the patch's rows the three files would be read again).
    _mark(store).unlink()
    reads = count_reads(monkeypatch)
    st = store.status("exp", f)
    assert not st and st.hashed == 0 and reads == []
    assert not store.add("exp", f).created and reads == []


def test_the_base_is_rewritten_once_the_patch_outgrows_its_share(store: casstore.Store, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    store.add("exp", f)
    share = max(folders._PATCH_MIN, len(FILES) // folders._PATCH_SHARE)
    keys = sorted(FILES)
    first, second = keys[:share - 4], keys[share - 4:share + 4]
    _rewrite(f, first)
    store.add("exp", f)
    old_id = _doc(_cache_file(store))["id"]
    assert _patched_keys(store) == first
    _rewrite(f, second)  # the patch would hold share + 4 rows: the base is rewritten instead
    v3 = store.add("exp", f).digest
    base = _doc(_cache_file(store))
    assert base["id"] != old_id and base["version"] == v3.hex and not _patch(store).exists()
    _entries_match_the_folder(store, f)
    _mark(store).unlink()
    reads = count_reads(monkeypatch)
    assert not store.status("exp", f) and reads == []


@pytest.mark.parametrize("names", ["the current base", "an older base"])
def test_a_patch_is_used_only_with_the_base_it_names(store: casstore.Store, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, names: str) -> None:
    # Another process rewrote the base (a new id) after this patch was written against the old one:
    # the patch's rows must not be paired with the new base.  The patch here is made to lie (zero
    # digests for files whose stat it has exactly, and a claim of the first version, so status
    # compares with the head in full), so using it would show: the control case, naming the
    # current base, is believed (a cache of this user's own is trusted, as ever).
    f, v1 = _patched(tmp_path, store)
    stale = _doc(_patch(store))
    old_id = _doc(_cache_file(store))["id"]
    # A new key (sorting after the others: their rows keep their indexes): the next save rewrites the base.
    (f / "zz-added").write_bytes(b"new")
    store.add("exp", f)
    assert _doc(_cache_file(store))["id"] != old_id and not _patch(store).exists()
    if names == "the current base":
        stale["base"] = _doc(_cache_file(store))["id"]
        # The base has the same rows for these keys (rewritten with them): the lying digests are the only change.
    _patch(store).write_bytes(_lying(stale, v1))
    _mark(store).unlink()
    reads = count_reads(monkeypatch)
    st = store.status("exp", f)
    if names == "an older base":
        assert not st and reads == []  # the patch ignored: the new base alone, which holds every row
    else:
        assert sorted(st.modified) == sorted(FILES)[:2] and reads == []  # believed: the test can fail


@pytest.mark.parametrize("damage", ["garbage", "a row past the base", "a row twice", "rows out of order",
                                    "rows one byte short", "digests one byte long", "indexes not bytes",
                                    "an index cut short", "keys, not indexes", "no base id", "format 1",
                                    "another folder's", "a directory"])
def test_a_damaged_patch_is_ignored_and_the_base_answers(store: casstore.Store, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    store.add("exp", f)
    changed = sorted(FILES)[20:23]
    _rewrite(f, changed)
    store.add("exp", f)
    path = _patch(store)
    doc = _doc(path)
    data: bytes = b""
    if damage == "garbage":
        data = b"\xff\x00garbage"
    elif damage == "a row past the base":
        doc["at"] = doc["at"][:-4] + struct.pack("<I", len(FILES))
    elif damage == "a row twice":
        doc["at"] = doc["at"][:4] + doc["at"][:4] + doc["at"][8:]
    elif damage == "rows out of order":
        doc["at"] = doc["at"][4:8] + doc["at"][:4] + doc["at"][8:]
    elif damage == "indexes not bytes":
        doc["at"] = list(struct.unpack("<3I", doc["at"]))
    elif damage == "an index cut short":
        doc["at"] = doc["at"][:-1]
    elif damage == "keys, not indexes":  # (the patch of the casstore before: ignored, never misread)
        doc["keys"] = [sorted(FILES)[i] for (i,) in struct.iter_unpack("<I", doc.pop("at"))]
    elif damage == "rows one byte short":
        doc["rows"] = doc["rows"][:-1]
    elif damage == "digests one byte long":
        doc["digests"] += b"\0"
    elif damage == "no base id":
        del doc["base"]
    elif damage == "format 1":
        doc["v"] = 1
    elif damage == "another folder's":
        doc["root"] = "/somewhere/else"
    path.unlink()
    if damage == "a directory":
        path.mkdir()
    else:
        path.write_bytes(data or msgpack.packb(doc, use_bin_type=True))
    _mark(store).unlink()
    reads = count_reads(monkeypatch)
    st = store.status("exp", f)
    # The base alone: older (it vouches for the first version), never wrong.  The changed files'
    # rows there are of their old stats, so exactly they are read, and found as the head has them.
    assert not st and sorted(reads) == changed
    reads.clear()
    assert not store.add("exp", f).created
    assert folder_content(store, "exp") == dict(FILES, **{k: b"new " + k.encode() for k in changed})


def test_a_base_from_before_patches_gets_an_id_at_its_next_save(store: casstore.Store, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A base written by an older casstore has no id: no patch applies to it (a patch left beside it
    # is stale), and its first save rewrites it whole, with an id, and removes the stale patch.
    f = tmp_path / "f"
    make_tree(f, FILES)
    store.add("exp", f)
    _rewrite(f, sorted(FILES)[:2])
    store.add("exp", f)
    assert _patch(store).exists()
    base = _doc(_cache_file(store))
    del base["id"]
    _cache_file(store).write_bytes(msgpack.packb(base, use_bin_type=True))  # (the patch now names no base)
    _mark(store).unlink()
    reads = count_reads(monkeypatch)
    assert not store.status("exp", f) and sorted(reads) == sorted(FILES)[:2]  # the base alone: older rows
    assert "id" in _doc(_cache_file(store)) and not _patch(store).exists()
    _entries_match_the_folder(store, f)


@pytest.mark.parametrize("plant", ["fifo", "symlink to a lying patch"])
def test_a_planted_patch_is_never_followed_or_waited_on(store: casstore.Store, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, plant: str) -> None:
    # Any member of a shared store can plant files under cache/stat.  A FIFO at the patch's path must
    # not block a status; a symlink to a patch that would be believed (it names the base, and lies)
    # must not be followed.
    f, v1 = _patched(tmp_path, store)
    path = _patch(store)
    elsewhere = tmp_path / "lying.patch"
    elsewhere.write_bytes(_lying(_doc(path), v1))
    path.unlink()
    if plant == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(elsewhere)
    _mark(store).unlink()
    st = status_without_hanging(store, f, "a planted patch")
    # Not believed: the base alone (older rows: the two files changed since it are read, found as the head has them).
    assert not st


def test_a_file_gone_while_a_small_add_reads_it_leaves_the_cache(store: casstore.Store, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The walk found exactly the cached keys, but one changed file went away before the add read it:
    # it is not in the version, so the cache must not keep its old row (nor claim the version).
    f = tmp_path / "f"
    make_tree(f, FILES)
    store.add("exp", f)
    changed = sorted(FILES)[20:23]
    _rewrite(f, changed)
    real = folders._read_one

    def vanishing(s: casstore.Store, root_fd: int, key: str, keep: bool, hint: bool = True) -> object:
        if key == changed[1]:
            (f / key).unlink()  # (between the walk and the read)
        return real(s, root_fd, key, keep, hint)

    monkeypatch.setattr(folders, "_read_one", vanishing)
    r = store.add("exp", f)
    monkeypatch.undo()
    assert r.created and r.deleted == (changed[1],) and r.modified == (changed[0], changed[2])
    assert changed[1] not in store.manifest("exp").entries
    _entries_match_the_folder(store, f)  # (the gone file's row went with it)
    for p in (_cache_file(store), _patch(store)):
        assert not p.exists() or "version" not in _doc(p)  # a snapshot of a moving folder vouches for nothing
    assert not store.status("exp", f)
