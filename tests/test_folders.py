"""store.add / store.status: folders as snapshots (docs/folders.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import b3
from hypothesis import given, settings
from hypothesis import strategies as st

import casstore
from casstore import folders
from casstore.cli.app import main


def make_tree(root: Path, files: Dict[str, bytes]) -> None:
    for key, data in files.items():
        p = root / key
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def folder_content(store: casstore.Store, name: str) -> Dict[str, bytes]:
    m = store.manifest(name)
    return {k: store.get(e.digest) for k, e in m.items()}


FILES = {"a.txt": b"alpha", "sub/b.bin": os.urandom(3000), "sub/deep/c": b"", "d e f.txt": b"spaces"}


@pytest.fixture(autouse=True)
def two_second_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests here were written for the racy rule of FUSE and network filesystems: a file
    # modified within RACY_SECONDS is racy.  On a local filesystem a file is racy only if stamped
    # in the clock tick in which the add or status began (tests/test_folders_racy.py), which a
    # test that writes and then adds hits only sometimes: here the folder's filesystem counts as
    # one this kernel does not stamp, so every test sees one rule, deterministically.
    monkeypatch.setattr(folders, "fine_local_stamps", lambda st_dev, ctime_ns: False)


@pytest.fixture
def no_racy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Files a test has just written are "racy" (modified < 2 s ago) and never cached; tests
    # about the cache itself treat them as settled, one test below checks the racy rule.
    monkeypatch.setattr(folders, "RACY_SECONDS", 0.0)


def count_reads(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """A probe: every file whose contents add/status read (stored or hashed)."""
    seen: List[str] = []
    real = folders._read_one

    def probe(store: casstore.Store, root_fd: int, key: str, keep: bool, hint: bool = True) -> object:
        seen.append(key)
        return real(store, root_fd, key, keep, hint)

    monkeypatch.setattr(folders, "_read_one", probe)
    return seen


def count_copies(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """A probe: every file add copied into the store (read with keep=True), whether published or not."""
    seen: List[str] = []
    real = folders._read_one

    def probe(store: casstore.Store, root_fd: int, key: str, keep: bool, hint: bool = True) -> object:
        if keep:
            seen.append(key)
        return real(store, root_fd, key, keep, hint)

    monkeypatch.setattr(folders, "_read_one", probe)
    return seen


def status_without_hanging(store: casstore.Store, f: Path, what: str) -> folders.FolderStatus:
    """``store.status("exp", f)``, failing the test if it does not return within 30 s (blocked on ``what``)."""
    done: List[object] = []
    t = threading.Thread(target=lambda: done.append(store.status("exp", f)), daemon=True)
    t.start()
    t.join(30)
    assert done, f"status hung on {what}"
    assert isinstance(done[0], folders.FolderStatus)
    return done[0]


def added_folder(store: casstore.Store, tmp_path: Path, files: Dict[str, bytes] = FILES) -> Path:
    """``tmp_path/f`` holding ``files``, added as ``exp``."""
    f = tmp_path / "f"
    make_tree(f, files)
    store.add("exp", f)
    return f


def test_add_snapshots_folder(store: casstore.Store, tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    r = store.add("exp", f, message="first", meta={"lr": 0.1})
    assert r.created and r.added == tuple(sorted(FILES)) and not r.modified and not r.deleted
    assert folder_content(store, "exp") == FILES
    m = store.manifest("exp")
    assert m.meta == {"lr": 0.1, "message": "first"} and m.digest == r.digest
    assert r.hashed == len(FILES) and r.hashed_bytes == sum(map(len, FILES.values()))


def test_add_is_one_version_with_deletions(store: casstore.Store, tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    first = store.add("exp", f).digest
    (f / "a.txt").unlink()
    (f / "sub/b.bin").write_bytes(b"changed")
    (f / "new").write_bytes(b"n")
    r = store.add("exp", f)
    assert (r.added, r.modified, r.deleted) == (("new",), ("sub/b.bin",), ("a.txt",))
    assert r.manifest.parent == first and len(store.history("exp")) == 2
    assert folder_content(store, "exp") == {**{k: v for k, v in FILES.items() if k != "a.txt"},
                                            "sub/b.bin": b"changed", "new": b"n"}


def test_readd_unchanged_makes_no_version_and_reads_nothing(store: casstore.Store, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, no_racy: None) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    first = store.add("exp", f, message="one")
    reads = count_reads(monkeypatch)
    again = store.add("exp", f, message="a message alone is no change")
    assert not again.created and again.digest == first.digest and again.hashed == 0
    st = store.status("exp", f)
    assert not st and st.unchanged == tuple(sorted(FILES)) and st.hashed == 0
    assert reads == []  # neither add nor status opened a file's contents
    assert len(store.history("exp")) == 1
    # new metadata is a change
    assert store.add("exp", f, meta={"k": 1}).created


def test_cache_is_keyed_on_ctime_not_just_mtime(store: casstore.Store, tmp_path: Path, no_racy: None) -> None:
    f = tmp_path / "f"
    make_tree(f, {"x": b"AAAA"})
    store.add("exp", f)
    st0 = os.stat(f / "x")
    time.sleep(0.01)
    (f / "x").write_bytes(b"BBBB")  # same size, mtime put back: only ctime tells
    os.utime(f / "x", ns=(st0.st_atime_ns, st0.st_mtime_ns))
    assert os.stat(f / "x").st_mtime_ns == st0.st_mtime_ns
    st = store.status("exp", f)
    assert st.modified == ("x",) and st.hashed == 1
    assert store.add("exp", f).modified == ("x",)
    assert folder_content(store, "exp") == {"x": b"BBBB"}


def test_recent_files_are_not_cached(store: casstore.Store, tmp_path: Path) -> None:
    # Racy clean: a file written within RACY_SECONDS could be written again in the same
    # timestamp tick without its stat changing, so it is read again until it settles.
    f = tmp_path / "f"
    make_tree(f, {"fresh": b"1"})
    store.add("exp", f)
    assert store.status("exp", f).hashed == 1
    (f / "fresh").write_bytes(b"2")  # same size, probably the same mtime tick
    assert store.status("exp", f).modified == ("fresh",)


def test_corrupt_cache_is_ignored(store: casstore.Store, tmp_path: Path, no_racy: None) -> None:
    f = added_folder(store, tmp_path)
    caches = list((store.root / "cache" / "stat").glob("*.msgpack"))
    assert len(caches) == 1
    mark = caches[0].with_suffix(".clean")
    assert mark.exists()
    for junk in (b"\xff\x00garbage", b"", b"\x81\xa1v\x01"):  # garbage, empty, a map of the wrong shape
        mark.unlink()  # the clean mark would vouch for the whole folder; this test is about the stat cache
        caches[0].write_bytes(junk)
        st = store.status("exp", f)
        assert st.unchanged == tuple(sorted(FILES)) and st.hashed == len(FILES)
    (f / "a.txt").write_bytes(b"ALPHA")
    caches[0].write_bytes(b"\x93")
    assert store.status("exp", f).modified == ("a.txt",)


def _mark(store: casstore.Store) -> Path:
    marks = list((store.root / "cache" / "stat").glob("*.clean"))
    assert len(marks) == 1, marks
    return marks[0]


def _drop_stat_cache(store: casstore.Store) -> None:
    # Without the stat cache, a status that did not go through the clean mark hashes every file.
    for p in (store.root / "cache" / "stat").glob("*.msgpack"):
        p.unlink()


def test_clean_mark_vouches_for_an_unchanged_folder(store: casstore.Store, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, no_racy: None) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    first = store.add("exp", f)
    _mark(store)
    _drop_stat_cache(store)
    reads = count_reads(monkeypatch)
    nodes: List[object] = []
    real_manifest = casstore.Store.manifest

    def counting_manifest(self: casstore.Store, target: object) -> casstore.Manifest:
        m = real_manifest(self, target)  # type: ignore[arg-type]
        real_items = m.entries.items
        monkeypatch.setattr(type(m.entries), "items", lambda e: nodes.append(1) or real_items())
        return m

    st = store.status("exp", f)
    assert not st and st.unchanged == tuple(sorted(FILES)) and st.hashed == 0 and st.version == first.digest
    again = store.add("exp", f)
    assert not again.created and again.digest == first.digest and again.hashed == 0
    assert reads == []  # the mark, not the (deleted) stat cache, answered: no file was read
    monkeypatch.setattr(casstore.Store, "manifest", counting_manifest)
    assert not store.status("exp", f)
    assert nodes == []  # nor was the version's list of entries
    # with a message alone, still no version; with metadata, one
    assert not store.add("exp", f, message="nothing changed").created
    assert store.add("exp", f, meta={"k": 1}).created


@pytest.mark.parametrize("change", ["content_same_size_mtime_put_back", "new_file", "removed_file", "renamed_file",
                                    "file_replaced_by_symlink", "truncated"])
def test_clean_mark_never_hides_a_change(store: casstore.Store, tmp_path: Path, no_racy: None,
                                         change: str) -> None:
    f = added_folder(store, tmp_path)
    mark = _mark(store)
    time.sleep(0.01)  # a later timestamp tick than the files' own
    p = f / "a.txt"
    if change == "content_same_size_mtime_put_back":
        st0 = os.stat(p)
        p.write_bytes(b"ALPHA")
        os.utime(p, ns=(st0.st_atime_ns, st0.st_mtime_ns))  # only ctime tells
        want = {"modified": ("a.txt",)}
    elif change == "new_file":
        (f / "sub" / "new").write_bytes(b"n")
        want = {"added": ("sub/new",)}
    elif change == "removed_file":
        p.unlink()
        want = {"deleted": ("a.txt",)}
    elif change == "renamed_file":  # same inode, same stat, another key
        p.rename(f / "a2.txt")
        want = {"added": ("a2.txt",), "deleted": ("a.txt",)}
    elif change == "file_replaced_by_symlink":
        p.unlink()
        p.symlink_to(f / "d e f.txt")
        want = {"deleted": ("a.txt",)}
    else:
        p.write_bytes(b"")
        want = {"modified": ("a.txt",)}
    st = store.status("exp", f)
    got = {k: getattr(st, k) for k in ("added", "modified", "deleted") if getattr(st, k)}
    assert got == want
    r = store.add("exp", f)
    assert r.created and {k: getattr(r, k) for k in want} == want
    assert mark.exists() and not store.status("exp", f)  # the new version is vouched for again


def test_clean_mark_is_per_version_and_per_exclude(store: casstore.Store, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, no_racy: None) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    v1 = store.add("exp", f).digest
    (f / "a.txt").write_bytes(b"ALPHA")
    store.add("exp", f)
    _drop_stat_cache(store)
    reads = count_reads(monkeypatch)
    old = store.status("exp", f, version=str(v1))  # the mark is for the head, not for v1
    assert old.modified == ("a.txt",) and reads
    reads.clear()
    _drop_stat_cache(store)
    excl = store.status("exp", f, exclude=["*.bin"])  # another walk: the mark does not apply
    assert excl.deleted == ("sub/b.bin",) and len(reads) == len(FILES) - 1


def _no_listing(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """A probe: every time a version's whole list of entries is read (items/iteration of its map)."""
    from casstore.manifests import model

    seen: List[str] = []
    for cls in (model.EntryMap, model.TreeEntryMap):
        for meth in ("raw_items",):
            real = getattr(cls, meth)

            def probe(self: object, _real: object = real, _name: str = f"{cls.__name__}.{meth}") -> object:
                seen.append(_name)
                return _real(self)  # type: ignore[operator]

            monkeypatch.setattr(cls, meth, probe)
    return seen


MANY = {f"d{i % 7}/f{i:03d}": os.urandom(100 + i) for i in range(300)}


@pytest.mark.parametrize("size", [300, 5000])  # a flat version, and a tree-shaped one (> 4,096 entries)
def test_changed_folder_costs_what_changed(store: casstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           no_racy: None, size: int) -> None:
    f = tmp_path / "f"
    files = {f"d{i % 7}/f{i:05d}": (b"%d" % i) * 3 for i in range(size)}
    make_tree(f, files)
    v1 = store.add("exp", f).digest
    time.sleep(0.01)
    (f / "d1/f00001").write_bytes(b"changed")      # modified
    (f / "d2/f00002").write_bytes(b"222")           # same bytes written again: a new stat, same content
    (f / "d3/f00003").unlink()                      # deleted
    (f / "d4/new").write_bytes(b"new")              # added
    reads = count_reads(monkeypatch)
    listed = _no_listing(monkeypatch)
    st = store.status("exp", f)
    assert (st.added, st.modified, st.deleted) == (("d4/new",), ("d1/f00001",), ("d3/f00003",))
    assert len(st.unchanged) == size - 2 and st.version == v1
    # Only a file whose stat changed and whose size did not is read (another size is modified unread;
    # an added file needs no hash).
    assert reads == ["d2/f00002"]
    assert listed == []  # and the version's entries were not listed
    reads.clear()
    copied = count_copies(monkeypatch)
    prints: List[int] = []
    fingerprint = folders._fingerprint
    monkeypatch.setattr(folders, "_fingerprint", lambda ks, rows: prints.append(len(ks)) or fingerprint(ks, rows))
    packed: List[int] = []
    walk_rows = folders._walk_rows
    monkeypatch.setattr(folders, "_walk_rows", lambda fs: packed.append(len(fs)) or walk_rows(fs))
    r = store.add("exp", f)
    assert r.created and (r.added, r.modified, r.deleted) == (("d4/new",), ("d1/f00001",), ("d3/f00003",))
    assert len(prints) == 1  # the walk is fingerprinted once: the mark's check and its update share it
    assert packed.count(size) == 1  # and its stats packed once (all of them), for the mark and the cache
    assert sorted(copied) == ["d1/f00001", "d2/f00002", "d4/new"]  # (d2's copy is dropped: same bytes)
    assert listed == []
    monkeypatch.undo()
    want = {k: v for k, v in files.items() if k != "d3/f00003"}
    want.update({"d1/f00001": b"changed", "d4/new": b"new"})
    assert folder_content(store, "exp") == want
    assert not store.status("exp", f)


def test_status_against_another_version_keeps_the_head_vouched(store: casstore.Store, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               no_racy: None) -> None:
    f = tmp_path / "f"
    make_tree(f, MANY)
    v1 = store.add("exp", f).digest
    (f / "d0/f000").write_bytes(b"x")
    store.add("exp", f)
    assert store.status("exp", f, version=str(v1)).modified == ("d0/f000",)
    (f / "d1/f001").write_bytes(b"y")
    listed = _no_listing(monkeypatch)
    assert store.status("exp", f).modified == ("d1/f001",)
    assert listed == []  # the status against v1 did not take the head's vouch away


def test_add_after_the_head_moved_elsewhere_snapshots_the_folder_exactly(store: casstore.Store, tmp_path: Path,
                                                                         no_racy: None) -> None:
    f = tmp_path / "f"
    make_tree(f, MANY)
    store.add("exp", f)
    with store.edit("exp") as m:  # another writer: the cache now vouches for a version that is not the head
        m["elsewhere"] = store.put(b"theirs")
        m["d0/f000"] = store.put(b"their edit")
    (f / "d1/f001").write_bytes(b"ours")
    r = store.add("exp", f)
    assert r.created and "elsewhere" in r.deleted and "d0/f000" in r.modified and "d1/f001" in r.modified
    want = dict(MANY, **{"d1/f001": b"ours"})
    assert folder_content(store, "exp") == want


def _cache_file(store: casstore.Store) -> Path:
    caches = list((store.root / "cache" / "stat").glob("*.msgpack"))
    assert len(caches) == 1, caches
    return caches[0]


def _cache_entries(store: casstore.Store) -> Dict[str, tuple]:
    """The stat cache decoded: key -> (dev, ino, size, mtime_ns, ctime_ns, digest hex)."""
    import struct

    import msgpack

    base = _cache_file(store)
    doc = msgpack.unpackb(base.read_bytes(), raw=False)
    keys, rows, digests = doc["keys"], doc["rows"], doc["digests"]
    assert keys == sorted(keys) and len(rows) == 40 * len(keys) and len(digests) == 32 * len(keys)
    out = {k: (*struct.unpack_from("<QQQqq", rows, 40 * i), digests[32 * i:32 * i + 32].hex())
           for i, k in enumerate(keys)}
    patch = base.with_suffix(".patch")
    if patch.exists():  # rows saved since the base, if it names this base (docs/folders.md, "The stat cache")
        p = msgpack.unpackb(patch.read_bytes(), raw=False)
        if p["base"] == doc["id"]:  # (rows given by their index in the base, 4 bytes each)
            at = [i for (i,) in struct.iter_unpack("<I", p["at"])]
            assert at == sorted(set(at)) and all(i < len(keys) for i in at)
            out.update((keys[i], (*struct.unpack_from("<QQQqq", p["rows"], 40 * j),
                                  p["digests"][32 * j:32 * j + 32].hex()))
                       for j, i in enumerate(at))
    return out


@pytest.mark.parametrize("damage", ["digests one byte short", "rows one byte long", "a key twice",
                                    "a key not a string", "rows not bytes", "format 1"])
def test_damaged_vouching_cache_is_no_cache(store: casstore.Store, tmp_path: Path, no_racy: None,
                                            monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    # A vouching cache whose columns do not line up must not be half-used (a row read as
    # another key's, a digest shifted by one): the whole file is ignored and every file is read.
    import msgpack

    f = tmp_path / "f"
    make_tree(f, MANY)
    v = store.add("exp", f).digest
    cache = _cache_file(store)
    doc = msgpack.unpackb(cache.read_bytes(), raw=False)
    assert doc["version"] == v.hex and doc["v"] == 2
    if damage == "digests one byte short":
        doc["digests"] = doc["digests"][:-1]
    elif damage == "rows one byte long":
        doc["rows"] += b"\0"
    elif damage == "a key twice":
        doc["keys"][1] = doc["keys"][0]
    elif damage == "a key not a string":
        doc["keys"][0] = 7
    elif damage == "rows not bytes":
        doc["rows"] = list(doc["rows"])
    else:
        doc = {"v": 1, "root": doc["root"], "version": doc["version"], "patterns": doc["patterns"],
               "entries": {k: [0, 0, 0, 0, 0, "0" * 64] for k in doc["keys"]}}
    cache.write_bytes(msgpack.packb(doc))
    _mark(store).unlink()
    (f / "d1/f001").write_bytes(b"ours")
    reads = count_reads(monkeypatch)
    st = store.status("exp", f)
    assert st.modified == ("d1/f001",) and len(st.unchanged) == len(MANY) - 1
    assert sorted(reads) == sorted(k for k in MANY if k != "d1/f001")  # no row trusted (that one: a new size)
    with store.edit("exp") as m:  # the head moves too: add compares with it in full
        m["other"] = store.put(b"o")
    store.add("exp", f)
    assert folder_content(store, "exp") == dict(MANY, **{"d1/f001": b"ours"})


def test_far_future_timestamps_are_never_cached(store: casstore.Store, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, no_racy: None) -> None:
    # A timestamp past 2262 does not fit a cache row: such a file is read every time (never a
    # crash, never a match), and the others are cached as usual.
    f = tmp_path / "f"
    make_tree(f, FILES)
    far = (2 ** 63 + 10 ** 12, 2 ** 63 + 10 ** 12)
    os.utime(f / "a.txt", ns=far)
    if os.stat(f / "a.txt").st_mtime_ns < 2 ** 63:
        pytest.skip("this filesystem cannot hold a timestamp past 2262")
    store.add("exp", f)
    reads = count_reads(monkeypatch)
    assert not store.status("exp", f) and reads == ["a.txt"]
    reads.clear()
    (f / "a.txt").write_bytes(b"ALPHA")
    os.utime(f / "a.txt", ns=far)
    assert store.status("exp", f).modified == ("a.txt",) and reads == ["a.txt"]
    r = store.add("exp", f)
    assert r.modified == ("a.txt",) and folder_content(store, "exp")["a.txt"] == b"ALPHA"


def test_recent_files_are_vouched_for_but_always_read_again(store: casstore.Store, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Files written just before the add are racy: the cache still vouches for the version (so the
    # next status need not list it), but records them with a stat no walk matches, so each is read
    # and compared until it settles -- a second write in the same tick cannot go unseen.
    import msgpack

    f = tmp_path / "f"
    make_tree(f, FILES)
    v = store.add("exp", f).digest
    doc = msgpack.unpackb(_cache_file(store).read_bytes(), raw=False)
    entries = _cache_entries(store)
    assert doc["version"] == v.hex and sorted(entries) == sorted(FILES)
    assert all(e[3] == -1 and e[4] == -1 for e in entries.values())
    assert {k: e[5] for k, e in entries.items()} == {k: b3(c).removeprefix("blake3:") for k, c in FILES.items()}
    reads = count_reads(monkeypatch)
    listed = _no_listing(monkeypatch)
    assert not store.status("exp", f)
    assert sorted(reads) == sorted(FILES) and listed == []
    # A re-add hashes such files before copying any: the unchanged ones are not copied again.
    copied = count_copies(monkeypatch)
    (f / "a.txt").write_bytes(b"ALPHA")  # same size, likely the same tick as its first write
    assert store.status("exp", f).modified == ("a.txt",)
    r = store.add("exp", f)
    assert r.modified == ("a.txt",) and copied == ["a.txt"] and listed == []


def test_status_records_files_that_settled(store: casstore.Store, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Files racy at the add are read by each status until one finds them settled (and the folder
    # clean): that status records them, and the next one is a walk again.
    f = added_folder(store, tmp_path)
    monkeypatch.setattr(folders, "RACY_SECONDS", 0.0)  # as if two seconds had passed
    reads = count_reads(monkeypatch)
    assert not store.status("exp", f) and sorted(reads) == sorted(FILES)
    reads.clear()
    _drop_stat_cache(store)  # (so only the clean mark can answer)
    assert not store.status("exp", f) and reads == []


def test_clean_mark_not_written_for_racy_files(store: casstore.Store, tmp_path: Path) -> None:
    # A file modified within RACY_SECONDS could change again in the same timestamp tick without
    # its stat changing: the mark would then vouch for bytes the folder no longer has.
    f = added_folder(store, tmp_path)
    assert not list((store.root / "cache" / "stat").glob("*.clean"))
    assert not store.status("exp", f)
    assert not list((store.root / "cache" / "stat").glob("*.clean"))


def test_clean_mark_not_written_when_a_file_changed_while_read(store: casstore.Store, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               no_racy: None) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    real = folders._read_one

    def touch_then_read(store_: casstore.Store, root_fd: int, key: str, keep: bool, hint: bool = True) -> object:
        if key == "a.txt":  # changed after the walk, before its read: the walk's stat is stale
            os.utime(f / key, ns=(1, 1))
        return real(store_, root_fd, key, keep, hint)

    monkeypatch.setattr(folders, "_read_one", touch_then_read)
    store.add("exp", f)
    assert not list((store.root / "cache" / "stat").glob("*.clean"))


@pytest.mark.parametrize("junk", [b"", b"\xff\x00garbage", b"\x81\xa1v\x01", b"\x80", b"\x91\x01",
                                  b"\x86\xa1v\x01\xa4root\x00\xa7version\x00\xa8patterns\x00\xa5files\x00\xa2fp\x00"])
def test_damaged_clean_mark_is_no_mark(store: casstore.Store, tmp_path: Path, no_racy: None,
                                       junk: bytes) -> None:
    f = added_folder(store, tmp_path)
    mark = _mark(store)
    _drop_stat_cache(store)
    mark.write_bytes(junk)
    st = store.status("exp", f)
    assert not st and st.hashed == len(FILES)  # compared the long way, and right
    (f / "a.txt").write_bytes(b"ALPHA")
    mark.write_bytes(junk)
    assert store.status("exp", f).modified == ("a.txt",)


def test_a_stale_mark_of_another_folder_state_is_not_trusted(store: casstore.Store, tmp_path: Path,
                                                             no_racy: None) -> None:
    # The mark of the folder as it was, copied back after the folder changed (as a restored
    # backup of the store would): its fingerprint no longer matches the walk.
    f = added_folder(store, tmp_path)
    saved = _mark(store).read_bytes()
    (f / "sub" / "b.bin").write_bytes(os.urandom(3000))
    assert store.status("exp", f).modified == ("sub/b.bin",)
    _mark(store).write_bytes(saved)
    assert store.status("exp", f).modified == ("sub/b.bin",)


def test_add_to_a_pin_is_refused_even_when_the_folder_is_unchanged(store: casstore.Store, tmp_path: Path,
                                                                   no_racy: None) -> None:
    f = added_folder(store, tmp_path)
    store.freeze("exp")
    with pytest.raises(casstore.FrozenError):
        store.add("exp", f)


def test_status_added_modified_deleted_and_versions(store: casstore.Store, tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(tmp_path / "other", {"loose": b"l"})
    st = store.status("exp", tmp_path / "other")
    assert st.added == ("loose",)
    assert st.version is None and not st.modified  # a name never added: everything is new
    make_tree(f, {"keep": b"k", "change": b"c1", "gone": b"g"})
    v1 = store.add("exp", f).digest
    (f / "change").write_bytes(b"c2-longer")
    (f / "gone").unlink()
    (f / "new").write_bytes(b"n")
    st = store.status("exp", f)
    assert (st.added, st.modified, st.deleted, st.unchanged) == (("new",), ("change",), ("gone",), ("keep",))
    assert st and st.version == v1
    store.add("exp", f)
    assert not store.status("exp", f)
    old = store.status("exp", f, version="exp~1")
    assert old.version == v1 and old.modified == ("change",) and old.deleted == ("gone",)
    with pytest.raises(casstore.ManifestNotFoundError):
        store.status("exp", f, version="exp~5")


def test_symlinks_are_never_followed(store: casstore.Store, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    make_tree(outside, {"secret": b"do not take me"})
    f = tmp_path / "f"
    make_tree(f, {"real": b"r"})
    os.symlink(outside / "secret", f / "to_file")
    os.symlink(outside, f / "to_dir")
    os.symlink("../outside/secret", f / "relative")
    os.symlink("real", f / "inside")
    r = store.add("exp", f)
    assert list(store.manifest("exp")) == ["real"]
    assert {s.path for s in r.skipped} == {"to_file", "to_dir", "relative", "inside"}
    assert all("symlink" in s.reason for s in r.skipped)
    assert not store.objects.has(casstore.Digest.coerce(b3(b"do not take me")))
    st = store.status("exp", f)
    assert not st and {s.path for s in st.skipped} == {"to_file", "to_dir", "relative", "inside"}


def test_special_files_are_skipped_without_hanging(store: casstore.Store, tmp_path: Path) -> None:
    import socket

    f = tmp_path / "f"
    make_tree(f, {"ok": b"1"})
    os.mkfifo(f / "pipe")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(f / "sock"))
    out: Dict[str, object] = {}
    t = threading.Thread(target=lambda: out.update(r=store.add("exp", f)), daemon=True)
    t.start()
    t.join(30)
    s.close()
    assert not t.is_alive(), "add hung on a FIFO"
    r = out["r"]
    assert isinstance(r, casstore.AddResult)
    assert list(r.manifest) == ["ok"]
    assert {(x.path, x.reason) for x in r.skipped} == {("pipe", "a FIFO (named pipe)"), ("sock", "a socket")}


def test_exclude_globs(store: casstore.Store, tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(f, {"keep.py": b"1", "x.tmp": b"2", "__pycache__/m.pyc": b"3", "sub/keep.txt": b"4",
                  "sub/run.log": b"5", "sub/deep/__pycache__/n.pyc": b"6", "top.log": b"7"})
    r = store.add("exp", f, exclude=["*.tmp", "__pycache__", "sub/*.log"])
    assert sorted(r.manifest) == ["keep.py", "sub/keep.txt", "top.log"]
    assert not store.status("exp", f, exclude=["*.tmp", "__pycache__", "sub/*.log"])
    assert store.status("exp", f).added == ("__pycache__/m.pyc", "sub/deep/__pycache__/n.pyc", "sub/run.log",
                                            "x.tmp")
    with pytest.raises(casstore.InvalidTypeError):
        store.add("exp", f, exclude=[3])  # type: ignore[list-item]


def test_hostile_names_are_refused_before_anything_is_stored(store: casstore.Store, tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(f, {"fine": b"fine bytes"})
    for bad in ("new\nline", "back\\slash", "esc\x1b"):
        (f / bad).write_bytes(b"x")
    os.close(os.open(os.fsencode(f) + b"/latin1-\xe9", os.O_CREAT | os.O_WRONLY))
    with pytest.raises(casstore.InvalidInputError) as ei:
        store.add("exp", f)
    msg = str(ei.value)
    assert "4 file name(s)" in msg and "'new\\nline'" in msg and "exclude" in msg
    assert "exp" not in store.heads()
    assert not store.objects.has(casstore.Digest.coerce(b3(b"fine bytes")))  # nothing stored
    r = store.add("exp", f, exclude=["*\n*", "*\\*", "*\x1b*", "latin1-*"])
    assert list(r.manifest) == ["fine"]


def test_empty_folder_and_bad_arguments(store: casstore.Store, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = store.add("e", tmp_path / "empty")
    assert r.created and len(r.manifest) == 0 and store.heads()["e"] == r.digest
    assert not store.add("e", tmp_path / "empty").created
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(casstore.InvalidInputError, match="not a directory"):
        store.add("e", tmp_path / "file")
    with pytest.raises(casstore.InvalidInputError, match="no such folder"):
        store.add("e", tmp_path / "nope")
    with pytest.raises(casstore.InvalidTypeError):
        store.add("e", 3)  # type: ignore[arg-type]


WRITER = r"""
import os, sys, time
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY)
i = 0
while not os.path.exists(path + ".stop"):
    i += 1
    block = bytes([i % 251]) * (256 * 1024)
    for off in range(0, size, len(block)):  # in place, a block at a time: a reader can see a mix
        os.pwrite(fd, block, off)
    time.sleep(0.05)
"""


@pytest.mark.parametrize("rule", ["two-second", "floor"])
def test_writer_during_add_never_yields_mixed_bytes(store: casstore.Store, tmp_path: Path, rule: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if rule == "floor":  # the rule of a local filesystem (tests/test_folders_racy.py), not this module's
        from casstore._fsprobe import fine_local_stamps
        monkeypatch.setattr(folders, "fine_local_stamps", fine_local_stamps)
    f = tmp_path / "f"
    size = 4 << 20
    make_tree(f, {"hot.bin": b"\x00" * size, "cold": b"c"})
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(f / "hot.bin"), str(size)])
    ok = changed = 0
    try:
        time.sleep(0.1)
        for _ in range(8):
            try:
                r = store.add("exp", f)
            except casstore.FileChangedError as e:
                assert "hot.bin" in str(e)
                changed += 1
                continue
            ok += 1
            data = store.get(r.manifest["hot.bin"].digest)
            assert len(data) == size and data == data[:1] * size, "stored a mix of two writes"
    finally:
        (f / "hot.bin.stop").touch()
        w.wait(10)
    print(f"writer test: {ok} consistent snapshots, {changed} reported FileChangedError")
    assert ok >= 1, f"every add saw the file change ({changed} times)"
    for m in store.history("exp"):
        data = store.get(m["hot.bin"].digest)
        assert data == data[:1] * size


def test_cli_add_and_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = str(tmp_path / "st")
    casstore.open(s)  # an explicit --store must exist (issue 12)
    f = tmp_path / "f"
    make_tree(f, {"a": b"1", "b/c": b"2"})
    assert main(["--store", s, "add", "exp", str(f), "-m", "hello", "--meta", "k=v", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["created"] and doc["added"] == ["a", "b/c"] and doc["files"] == 2
    assert casstore.open(s).manifest("exp").meta == {"k": "v", "message": "hello"}
    (f / "a").write_bytes(b"changed")
    assert main(["--store", s, "status", "exp", str(f), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["modified"] == ["a"] and doc["unchanged"] == 1
    assert main(["--store", s, "status", "exp", str(f)]) == 0
    assert "modified  a" in capsys.readouterr().out
    assert main(["--store", s, "add", "exp", str(f), "--exclude", "a"]) == 0
    assert "1 deleted" in capsys.readouterr().out
    (f / "bad\nname").write_bytes(b"x")
    assert main(["--store", s, "add", "exp", str(f)]) == 1
    err = capsys.readouterr().err
    assert "--exclude GLOB" in err and "exclude=" not in err
    with pytest.raises(SystemExit):
        main(["--store", s, "add", "exp", str(f), "--meta", "novalue"])


def test_path_swapped_for_a_symlink_after_the_walk_is_not_followed(store: casstore.Store, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The race, made deterministic: the walk saw directory "d" with file "d/x"; before the file
    # is read, "d" becomes a symlink to a directory outside holding an "x" of its own.
    outside = tmp_path / "outside"
    make_tree(outside, {"x": b"outside secret"})
    f = tmp_path / "f"
    make_tree(f, {"d/x": b"inside", "keep": b"k"})
    real_walk = folders._walk

    def walk_then_swap(*a: object) -> object:
        out = real_walk(*a)  # type: ignore[arg-type]
        (f / "d" / "x").unlink()
        (f / "d").rmdir()
        os.symlink(outside, f / "d")
        return out

    monkeypatch.setattr(folders, "_walk", walk_then_swap)
    r = store.add("exp", f)
    assert list(r.manifest) == ["keep"]
    assert not store.objects.has(casstore.Digest.coerce(b3(b"outside secret")))


def test_store_inside_the_folder_is_left_out(tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(f, {"data": b"d"})
    store = casstore.open(f / ".casstore")
    r = store.add("self", f)
    assert list(r.manifest) == ["data"]
    assert [(s.path, s.reason) for s in r.skipped] == [(".casstore", "the casstore store itself")]


def test_progress_bar_when_asked(store: casstore.Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "f"
    make_tree(f, FILES)
    store.add("exp", f, progress=True)
    err = capsys.readouterr().err
    assert "add: 100.0%" in err
    (f / "a.txt").write_bytes(b"x")
    store.add("exp", f)  # default: only on a terminal, and pytest's stderr is not one
    assert capsys.readouterr().err == ""


def test_cli_add_to_a_pin_names_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = str(tmp_path / "st")
    casstore.open(s)  # an explicit --store must exist (issue 12)
    f = tmp_path / "f"
    make_tree(f, {"a": b"1"})
    assert main(["--store", s, "add", "exp", str(f)]) == 0
    assert main(["--store", s, "freeze", "exp"]) == 0
    capsys.readouterr()
    (f / "a").write_bytes(b"2")
    assert main(["--store", s, "add", "exp", str(f)]) == 1
    err = capsys.readouterr().err
    assert "casstore add exp-v2" in err and "store.edit" not in err


@pytest.mark.parametrize("what", ["mark", "stat cache"])
@pytest.mark.parametrize("plant", ["fifo", "symlink to another folder's cache", "directory"])
def test_planted_cache_files_are_never_followed_or_waited_on(store: casstore.Store, tmp_path: Path,
                                                              no_racy: None, what: str, plant: str) -> None:
    # Any member of a shared store can plant files under cache/stat: a FIFO must not block a status
    # (open would wait for a writer), a symlink must not be followed (to a cache vouching for
    # another folder's state), and neither may be trusted.
    f = added_folder(store, tmp_path)
    cache = next((store.root / "cache" / "stat").glob("*.msgpack"))
    target = _mark(store) if what == "mark" else cache
    other = tmp_path / "elsewhere"
    other.write_bytes(target.read_bytes())
    (f / "a.txt").write_bytes(b"ALPHA")  # the planted copy vouches for the folder as it was
    target.unlink()
    if plant == "fifo":
        os.mkfifo(target)
    elif plant == "directory":
        target.mkdir()
    else:
        target.symlink_to(other)
    st = status_without_hanging(store, f, "a planted cache file")
    assert st.modified == ("a.txt",)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 70), st.data())
def test_differing_rows_agrees_with_comparing_each_row(n: int, data: st.DataObject) -> None:
    # The stat cache compares runs of rows whole before single rows (a 1% add of 10,000 files: well under
    # 1 ms instead of 8 of key lookups); it must say exactly what a row-by-row comparison says.
    size = 40
    a = data.draw(st.binary(min_size=n * size, max_size=n * size))
    flips = data.draw(st.sets(st.integers(0, max(0, n * size - 1)), max_size=6)) if n else set()
    b = bytearray(a)
    for i in flips:
        b[i] ^= 0x01
    want = [i for i in range(n) if a[i * size:(i + 1) * size] != bytes(b[i * size:(i + 1) * size])]
    assert folders._differing_rows(a, bytes(b), size) == want


def test_rewriting_scattered_files_is_seen_across_runs_of_rows(store: casstore.Store, tmp_path: Path,
                                                               no_racy: None) -> None:
    # 50 files (runs of 16 rows: three whole and a partial one); rewrite files in several runs,
    # at run edges, with the same sizes: exactly those are modified, in status and in add.
    src = tmp_path / "src"
    src.mkdir()
    for i in range(50):
        (src / f"f{i:02d}").write_bytes(b"%03d" % i)
    store.add("d", src)
    picked = [0, 15, 16, 31, 33, 49]
    time.sleep(0.01)
    for i in picked:
        (src / f"f{i:02d}").write_bytes(b"x%02d" % i)
    st_ = store.status("d", src)
    assert list(st_.modified) == [f"f{i:02d}" for i in picked] and not st_.added and not st_.deleted
    res = store.add("d", src)
    assert sorted(res.modified) == [f"f{i:02d}" for i in picked]
    assert store.get(store.manifest("d")["f33"].digest) == b"x33"


def test_add_and_status_pause_the_cyclic_collector_and_restore_it(store: casstore.Store, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # (casstore._fs.collector_paused: ~5 ms of a 1% add were the collector's passes over garbage that
    # reference counting frees anyway.)  On while the caller had it on, off while the caller had it off,
    # and restored when the add fails too.
    import gc

    from casstore import _faults

    seen: List[bool] = []
    monkeypatch.setattr(_faults, "hook", lambda point: seen.append(gc.isenabled())
                        if point == "folders.before_commit" else None)
    walked: List[bool] = []
    real_walk = folders._walk

    def walk(*a: object) -> object:
        walked.append(gc.isenabled())
        return real_walk(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(folders, "_walk", walk)
    f = tmp_path / "f"
    make_tree(f, FILES)
    assert gc.isenabled()
    store.add("exp", f)
    store.status("exp", f)
    assert seen == [False] and walked == [False, False] and gc.isenabled()
    gc.disable()
    try:
        (f / "a.txt").write_bytes(b"changed")
        store.add("exp", f)
        assert not gc.isenabled()
    finally:
        gc.enable()
    monkeypatch.setattr(folders, "_walk", lambda *a: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(OSError):
        store.add("exp", f)
    assert gc.isenabled()
