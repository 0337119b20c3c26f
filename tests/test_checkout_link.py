"""Link-mode checkouts and the hash record (docs/folders.md, "Checkout speed: what a link trusts").

A hard or symbolic link is made only to an object file that is hashed now, or that casstore hashed
within ``TRUST_SECONDS`` and whose exact stat (ctime included) is unchanged since.  These tests count
the hashes a checkout makes (``hash_fd`` of the objects layer) and damage objects in ways a user or a
bad disk would, to show that what the record vouches for is exactly what was hashed.
"""

from __future__ import annotations

import errno
import importlib
import io
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import msgpack
import pytest
from _corrupt import flip_byte
from conftest import counting_hash_fd

import casstore
from casstore import IntegrityError
from casstore.objects import local as objlocal
from casstore.objects.local import HASHED_DIR, TRUST_SECONDS

FILES = {f"d{i % 3}/f{i:02d}.bin": os.urandom(1000 + 997 * i) for i in range(24)}


@pytest.fixture
def added(store: casstore.Store, tmp_path: Path) -> casstore.Store:
    src = tmp_path / "src"
    for k, data in FILES.items():
        (src / k).parent.mkdir(parents=True, exist_ok=True)
        (src / k).write_bytes(data)
    store.add("exp", src)
    return store


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Sizes of the object files the objects layer hashes (its verify_fd), counted; the per-process memo
    is emptied so only the persistent record can spare a hash."""
    seen = counting_hash_fd(monkeypatch)
    monkeypatch.setattr(objlocal, "_VERIFIED", {})
    return seen


def _tree(root: Path) -> Dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("link", ["hardlink", "symlink"])
def test_objects_add_just_hashed_are_linked_without_hashing_again(added: casstore.Store, hashes: List[int],
                                                                   tmp_path: Path, link: str) -> None:
    added.checkout("exp", tmp_path / "a", link=link)
    assert hashes == []
    assert _tree(tmp_path / "a") == FILES
    # The first hard link moved each object inode's ctime (link + rename); the record followed it.
    added.checkout("exp", tmp_path / "b", link=link)
    assert hashes == []
    # rehash=True hashes every object whatever the record says.
    added.checkout("exp", tmp_path / "c", link=link, rehash=True)
    assert len(hashes) == len(FILES)


def test_copy_always_hashes_what_it_wrote(added: casstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    co = importlib.import_module("casstore.manifests.checkout")  # the module (the package exports the function)
    seen: List[int] = []
    real = co.hash_fd
    monkeypatch.setattr(co, "hash_fd", lambda fd, size, **kw: seen.append(size) or real(fd, size))
    added.checkout("exp", tmp_path / "a", link="copy")
    assert sorted(seen) == sorted(len(v) for v in FILES.values())


def test_a_rewritten_object_is_hashed_and_refused(added: casstore.Store, hashes: List[int], tmp_path: Path
                                                  ) -> None:
    d = added.manifest("exp").entries["d1/f07.bin"].digest
    time.sleep(0.01)  # a later mtime/ctime tick than the add's
    flip_byte(added.objects.path(d), 100)  # chmod + write + chmod: its stat is no longer what was hashed
    with pytest.raises(IntegrityError, match=r"corrupt.*stopped at 'd1/f07.bin'"):
        added.checkout("exp", tmp_path / "out", link="hardlink")
    assert hashes  # the changed file was hashed, not trusted
    out = tmp_path / "out"
    assert not (out / "d1" / "f07.bin").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".part")]
    # The directory's other keys were linked on the pool meanwhile: each is whole (the object itself).
    for k in FILES:
        if (out / k).exists():
            assert (out / k).read_bytes() == FILES[k] and (out / k).stat().st_nlink >= 2
    added.objects.delete(d)  # a later run with the object put again completes
    added.put(FILES["d1/f07.bin"])
    added.checkout("exp", out, link="hardlink")
    assert _tree(out) == FILES


def test_a_mtime_put_back_does_not_fool_the_record(added: casstore.Store, hashes: List[int], tmp_path: Path) -> None:
    d = added.manifest("exp").entries["d0/f03.bin"].digest
    p = added.objects.path(d)
    st = os.stat(p)
    time.sleep(0.01)
    flip_byte(p, 7)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime as hashed; ctime moved on
    with pytest.raises(IntegrityError):
        added.checkout("exp", tmp_path / "out", link="hardlink")


def test_an_old_entry_is_not_trusted(added: casstore.Store, hashes: List[int], tmp_path: Path) -> None:
    rec = added.objects.hash_record()
    old = time.time_ns() - int((TRUST_SECONDS + 60) * 1e9)
    for e in added.manifest("exp").entries.values():
        rec.note(e.digest, os.stat(added.objects.path(e.digest)), at_ns=old)
    path = added.root / HASHED_DIR / f"{os.geteuid()}.msgpack"
    path.unlink()
    path.write_bytes(msgpack.packb({"v": 1, "e": {k: list(v) for k, v in rec.entries.items()}}))
    added.checkout("exp", tmp_path / "out", link="hardlink")
    assert len(hashes) == len(FILES)


@pytest.mark.parametrize("damage", [b"", b"\xc1garbage", b"\x93\x01\x02\x03"])
def test_a_damaged_record_is_no_record(added: casstore.Store, hashes: List[int], tmp_path: Path, damage: bytes
                                       ) -> None:
    path = added.root / HASHED_DIR / f"{os.geteuid()}.msgpack"
    path.write_bytes(damage)
    added.checkout("exp", tmp_path / "out", link="hardlink")
    assert len(hashes) == len(FILES)
    assert _tree(tmp_path / "out") == FILES


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the record file to another user")
def test_a_record_this_user_does_not_own_is_ignored(added: casstore.Store, hashes: List[int], tmp_path: Path
                                                    ) -> None:
    # In a shared store another member could replace an object file and vouch for it in a record.
    path = added.root / HASHED_DIR / f"{os.geteuid()}.msgpack"
    os.chown(path, 65534, 65534)
    added.checkout("exp", tmp_path / "out", link="hardlink")
    assert len(hashes) == len(FILES)


def test_checkout_progress_only_when_asked_or_on_a_terminal(added: casstore.Store, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    added.checkout("exp", tmp_path / "quiet")  # stderr is not a terminal: no bar
    assert err.getvalue() == ""
    added.checkout("exp", tmp_path / "loud", progress=True)
    line = err.getvalue().strip().splitlines()[-1]
    total = sum(len(v) for v in FILES.values())
    assert line.startswith("checkout:") and "100.0%" in line, line
    assert f"{total / 1024:.1f} KiB" in line, line
    err.truncate(0)
    added.checkout("exp", tmp_path / "off", progress=False)
    assert err.getvalue() == ""


def _record_docs(store: casstore.Store) -> List[object]:
    raw = (store.root / HASHED_DIR / f"{os.geteuid()}.msgpack").read_bytes()
    u = msgpack.Unpacker(raw=False)
    u.feed(raw)
    return list(u)


def _more_files(store: casstore.Store, tmp_path: Path) -> Dict[str, bytes]:
    src = tmp_path / "src"
    more = {f"e/g{i:02d}.bin": os.urandom(500 + i) for i in range(5)}
    for k, data in more.items():
        (src / k).parent.mkdir(parents=True, exist_ok=True)
        (src / k).write_bytes(data)
    store.add("exp", src)
    return more


def test_later_adds_append_to_the_record_and_it_still_vouches(added: casstore.Store, hashes: List[int],
                                                                tmp_path: Path) -> None:
    # Rewriting the whole record after each add of a few files cost more than those files: an add
    # appends one document; readers merge them (the newest entry per object wins).
    assert len(_record_docs(added)) == 1
    _more_files(added, tmp_path)
    docs = _record_docs(added)
    assert len(docs) == 2 and len(docs[1]["e"]) == 5  # type: ignore[index]
    added.checkout("exp", tmp_path / "out", link="hardlink")
    assert hashes == []  # objects of both adds were vouched for


def test_a_record_cut_off_mid_append_is_read_up_to_the_cut_and_then_rewritten(
        added: casstore.Store, hashes: List[int], tmp_path: Path) -> None:
    path = added.root / HASHED_DIR / f"{os.geteuid()}.msgpack"
    with open(path, "ab") as f:
        f.write(b"\x81\xa1e\x82")  # an append a crash cut short
    more = _more_files(added, tmp_path)  # appended after the damage: unreadable, so re-hashed below
    added.checkout("exp", tmp_path / "out", link="hardlink")
    assert len(hashes) == len(more)  # what preceded the cut still vouched
    docs = _record_docs(added)  # the checkout's save rewrote the record whole: it parses to the end
    assert len(docs) == 1 and len(docs[0]["e"]) == len(FILES) + len(more)  # type: ignore[index]
    hashes.clear()
    added.checkout("exp", tmp_path / "out2", link="hardlink")
    assert hashes == []


def test_a_large_record_is_merged_and_rewritten(added: casstore.Store, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objlocal, "_HASHED_APPEND_MAX", 1)  # every save is over the limit
    _more_files(added, tmp_path)
    docs = _record_docs(added)
    assert len(docs) == 1 and len(docs[0]["e"]) == len(FILES) + 5  # type: ignore[index]


@pytest.mark.parametrize("slice_max", [None, 16])
def test_a_large_directory_is_linked_in_a_few_jobs_and_errors_come_in_key_order(
        store: casstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slice_max: Optional[int]) -> None:
    # Issue 12's hard-link checkout: a job per key handed the GIL between the link workers and the
    # caller ~24 times per link (10,000 links: 2.3 CPU-s, 1.5 with slices of 64 keys per job).  The
    # slices must keep what separate jobs gave: every other key of the directory is still linked,
    # and the first failing key in key order is the one named.  (``slice_max``: a directory larger
    # than LINK_SLICE_MAX x LINK_WORKERS keys goes in more, capped slices, whose results, and so the
    # progress bar, come one slice at a time.)
    import importlib

    co_mod = importlib.import_module("casstore.manifests.checkout")
    if slice_max is not None:
        monkeypatch.setattr(co_mod, "LINK_SLICE_MAX", slice_max)
    files = {f"big/f{i:03d}.bin": os.urandom(200 + i) for i in range(200)}
    src = tmp_path / "src"
    (src / "big").mkdir(parents=True)
    for k, data in files.items():
        (src / k).write_bytes(data)
    store.add("many", src)
    jobs: List[int] = []

    class Counting(co_mod.ThreadPoolExecutor):  # type: ignore[name-defined,misc]
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            jobs.append(len(args[4]) if fn is co_mod._write_slice else 1)
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(co_mod, "ThreadPoolExecutor", Counting)
    entries = store.manifest("many").entries
    time.sleep(0.01)  # a later mtime/ctime tick than the add's
    for k in ("big/f150.bin", "big/f060.bin"):
        flip_byte(store.objects.path(entries[k].digest), 10)
    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match=r"corrupt.*stopped at 'big/f060.bin'"):
        store.checkout("many", out, link="hardlink")
    assert sum(jobs) == 200, jobs
    if slice_max is None:
        assert len(jobs) <= co_mod.LINK_WORKERS, jobs
    else:
        assert max(jobs) == slice_max and len(jobs) == -(-200 // slice_max), jobs
    linked = {p.relative_to(out).as_posix() for p in (out / "big").iterdir()}
    assert linked == set(files) - {"big/f150.bin", "big/f060.bin"}  # every other key, whole
    assert all((out / k).read_bytes() == files[k] and (out / k).stat().st_nlink >= 2 for k in linked)


def _version(store: casstore.Store, name: str, files: Dict[str, bytes]) -> None:
    with store.edit(name) as m:
        for k in list(m):
            del m[k]
        for k, data in files.items():
            m[k] = store.put(data)


@pytest.mark.parametrize("link", ["hardlink", "symlink"])
def test_a_linked_file_stays_casstores_when_its_object_is_put_again(store: casstore.Store, tmp_path: Path,
                                                                    link: str) -> None:
    # A hard link IS the object's inode: a re-put of the same bytes (touch: utime for gc's grace period)
    # moves its mtime and ctime.  Whether it is still casstore's is its identity with the object.
    out = tmp_path / "out"
    _version(store, "n", {"a": b"a1", "b": b"b1", "same": b"s"})
    store.checkout("n", out, link=link)
    time.sleep(0.02)  # a later timestamp tick than the checkout's
    for data in (b"a1", b"b1", b"s"):
        store.put(data)  # touches the object file
    assert store.checkout("n", out, link=link, sync=True) == []  # all in place, and still recorded
    _version(store, "n", {"a": b"a2", "same": b"s"})
    done = store.checkout("n", out, link=link, sync=True)  # no "exists with other content" for 'a'
    assert done.removed == ("b",) and done.kept == ()
    assert (out / "a").read_bytes() == b"a2" and not (out / "b").exists()
    time.sleep(0.02)
    store.put(b"s")
    _version(store, "n", {"a": b"a2"})
    assert store.checkout("n", out, link=link, sync=True).removed == ("same",)


def test_a_hard_link_is_never_casstores_once_it_is_not_the_object(store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _version(store, "n", {"a": b"a1", "b": b"b1"})
    store.checkout("n", out, link="hardlink")
    (out / "b").unlink()
    (out / "b").write_bytes(b"b1")  # the same bytes, but the user's own file now
    os.chmod(out / "b", 0o444)
    _version(store, "n", {"a": b"a1"})
    done = store.checkout("n", out, link="hardlink", sync=True)
    assert done.removed == () and done.kept == ("b",)


def _fill_links(obj: Path, where: Path) -> int:
    """Hard-link ``obj`` into ``where`` until the filesystem refuses (EMLINK); remove one; the limit,
    or 0 if there is none below 70,000 here (XFS, btrfs, tmpfs)."""
    where.mkdir()
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(70_000):
            try:
                os.link(obj, str(i), dst_dir_fd=fd)
            except OSError as e:
                if e.errno != errno.EMLINK:
                    raise
                os.unlink("0", dir_fd=fd)
                return i + 1
    finally:
        os.close(fd)
    return 0


def test_an_object_with_the_most_links_the_filesystem_allows_is_copied(store: casstore.Store, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # ext4 allows 65,000 links to one inode: a folder of 65,001 empty files (one object) ended in
    # "must be on one filesystem that allows links", and so did every later hard-link checkout of it.
    d = store.put(b"linked too often")
    links = tmp_path / "links"
    try:
        if not _fill_links(store.objects.path(d), links):
            pytest.skip("no link limit below 70,000 on this filesystem")
        files = {"a": b"linked too often", "b": b"linked too often", "c": b"linked too often", "x": b"other"}
        _version(store, "n", files)
        out = tmp_path / "out"
        with caplog.at_level(logging.WARNING):
            written = store.checkout("n", out, link="hardlink")
        assert len(written) == 4 and _tree(out) == files
        assert "copied" in caplog.text and "too many links" in caplog.text.lower()
        obj = os.stat(store.objects.path(d))
        got = {k: os.stat(out / k) for k in files}
        assert (got["a"].st_dev, got["a"].st_ino) == (obj.st_dev, obj.st_ino)  # the last link there was
        for k in ("b", "c"):  # copies, whole and independent of the store
            assert got[k].st_ino != obj.st_ino and not (out / k).is_symlink()
        assert got["x"].st_nlink >= 2
        assert store.checkout("n", tmp_path / "again", link="hardlink") and _tree(tmp_path / "again") == files
        # Recorded as what they are: a sync removes the copies and the link alike.
        _version(store, "n", {"x": b"other"})
        assert sorted(store.checkout("n", out, link="hardlink", sync=True).removed) == ["a", "b", "c"]
        assert _tree(out) == {"x": b"other"}
    finally:
        shutil.rmtree(links, ignore_errors=True)
