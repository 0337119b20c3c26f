"""``checkout(sync=..., link=..., force=...)``: sync removes only what a previous checkout of that name
wrote (and the user left alone), never anything outside the folder; link modes make the right kind of file;
a failure midway leaves no temp file and says how much was done."""

from __future__ import annotations

import errno
import importlib
import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from conftest import run_as_nobody

import casstore
import casstore._faults
from casstore import IntegrityError, InvalidInputError
from casstore._fsprobe import fine_local_stamps
from casstore.manifests.checkout import RECORD_DIR


def _version(s: casstore.Store, name: str, files: Dict[str, bytes], *, compress: bool = False) -> None:
    with s.edit(name) as m:
        for k in list(m):
            del m[k]
        for k, data in files.items():
            m[k] = s.put(data, compress=compress or None)


def _tree(root: Path) -> Dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


V1 = {"a.txt": b"alpha", "sub/b.txt": b"beta", "sub/deep/c.txt": b"gamma", "keep.txt": b"same"}
V2 = {"a.txt": b"ALPHA v2", "keep.txt": b"same", "new.txt": b"new"}


@pytest.fixture
def s(store: casstore.Store) -> casstore.Store:
    _version(store, "exp", V1)
    return store


def test_sync_removes_only_what_the_previous_checkout_wrote_and_the_new_version_lacks(
        s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    s.checkout("exp", out)
    (out / "mine.txt").write_bytes(b"user file")          # never written by casstore
    (out / "sub" / "user.txt").write_bytes(b"user in a dir casstore made")
    _version(s, "exp", V2)
    written = s.checkout("exp", out, sync=True)
    assert sorted(p.relative_to(out).as_posix() for p in written) == ["a.txt", "new.txt"]
    assert sorted(written.removed) == ["sub/b.txt", "sub/deep/c.txt"] and written.kept == ()  # what sync did
    assert _tree(out) == {**V2, "mine.txt": b"user file", "sub/user.txt": b"user in a dir casstore made"}
    assert not (out / "sub" / "deep").exists()             # an empty directory casstore made goes
    assert (out / "sub").is_dir()                          # one holding a user's file stays
    # Back to v1 and forward again: the record follows each checkout.
    s.checkout("exp~1", out, sync=True)
    assert _tree(out) == {**V1, "mine.txt": b"user file", "sub/user.txt": b"user in a dir casstore made"}


def test_without_sync_nothing_is_removed_and_a_later_sync_still_knows(s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    s.checkout("exp", out)
    _version(s, "exp", {**V1, "sub/b.txt": b"beta", "x.txt": b"x"})
    s.checkout("exp", out)
    _version(s, "exp", {"x.txt": b"x"})
    s.checkout("exp", out, sync=True)
    assert _tree(out) == {"x.txt": b"x"}


def test_a_modified_recorded_file_stays_unless_force(s: casstore.Store, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    s.checkout("exp", out)
    (out / "sub" / "b.txt").write_bytes(b"edited by the user")
    _version(s, "exp", V2)
    with caplog.at_level(logging.WARNING):
        done = s.checkout("exp", out, sync=True)
    assert (out / "sub" / "b.txt").read_bytes() == b"edited by the user"
    assert done.removed == ("sub/deep/c.txt",) and done.kept == ("sub/b.txt",)
    assert "changed since casstore wrote them" in caplog.text and "sub/b.txt" in caplog.text


def test_force_removes_a_modified_recorded_file(s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    s.checkout("exp", out)
    (out / "sub" / "b.txt").write_bytes(b"edited by the user")
    _version(s, "exp", V2)
    s.checkout("exp", out, sync=True, force=True)
    assert _tree(out) == V2


def test_sync_updates_a_recorded_file_but_refuses_a_modified_one_without_force(
        s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    s.checkout("exp", out)
    (out / "a.txt").write_bytes(b"user edit")
    _version(s, "exp", V2)
    with pytest.raises(InvalidInputError, match="other content"):
        s.checkout("exp", out, sync=True)
    assert (out / "a.txt").read_bytes() == b"user edit" and (out / "sub" / "b.txt").exists()  # nothing removed
    s.checkout("exp", out, sync=True, force=True)
    assert _tree(out) == V2
    with pytest.raises(InvalidInputError, match="only applies with sync"):
        s.checkout("exp", out, force=True)


def test_a_planted_link_is_neither_followed_nor_deleted_through(s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    outside = tmp_path / "outside"
    s.checkout("exp", out)
    # The user moves the directory casstore wrote elsewhere and leaves a link: the files outside carry
    # exactly the recorded (dev, ino, size, mtime), so only refusing to follow the link protects them.
    os.rename(out / "sub", outside)
    os.symlink(outside, out / "sub")
    os.symlink(outside / "deep" / "c.txt", out / "a.txt.link")
    _version(s, "exp", V2)
    s.checkout("exp", out, sync=True, force=True)
    assert (outside / "b.txt").read_bytes() == b"beta"
    assert (outside / "deep" / "c.txt").read_bytes() == b"gamma"
    assert os.path.islink(out / "sub") and os.path.islink(out / "a.txt.link")


def test_a_planted_link_at_a_recorded_key_is_only_unlinked_never_followed(s: casstore.Store,
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    s.checkout("exp", out)
    os.unlink(out / "sub" / "b.txt")
    os.symlink(victim, out / "sub" / "b.txt")
    _version(s, "exp", V2)
    s.checkout("exp", out, sync=True)          # the link is not what casstore wrote: kept
    assert os.path.islink(out / "sub" / "b.txt") and victim.read_bytes() == b"precious"


@pytest.mark.parametrize("garbage", [b"", b"\xc1\xff not msgpack", b"\x81\xa1v\x01",
                                     b"\x85\xa1v\x01\xa4root\xa1/\xa4name\xa3exp\xa5files\x80\xa4dirs\x90"])
def test_a_damaged_record_means_sync_removes_nothing(s: casstore.Store, tmp_path: Path, garbage: bytes,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    s.checkout("exp", out)
    (rec,) = (s.root / RECORD_DIR).iterdir()
    rec.write_bytes(garbage)
    _version(s, "exp", V2)
    with caplog.at_level(logging.WARNING), pytest.raises(InvalidInputError, match="other content"):
        s.checkout("exp", out, sync=True)   # a.txt is no longer known to be casstore's
    assert "treated as empty" in caplog.text
    s.checkout("exp", out, sync=True, overwrite=True)
    assert _tree(out) == {**V1, **V2}   # nothing of v1 removed


def test_a_hostile_record_with_dotdot_keys_is_refused(s: casstore.Store, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    import msgpack
    out = tmp_path / "out"
    s.checkout("exp", out)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (rec,) = (s.root / RECORD_DIR).iterdir()
    st = victim.stat()
    doc = msgpack.unpackb(rec.read_bytes())
    doc["files"]["../victim.txt"] = [doc["files"]["a.txt"][0], st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    rec.write_bytes(msgpack.packb(doc))
    _version(s, "exp", V2)
    with caplog.at_level(logging.WARNING):
        s.checkout("exp", out, sync=True, overwrite=True)
    assert victim.read_bytes() == b"precious" and "treated as empty" in caplog.text


@pytest.mark.parametrize("compress", [False, True])
def test_link_modes_make_the_right_kind_of_file(store: casstore.Store, tmp_path: Path, compress: bool) -> None:
    _version(store, "exp", V1, compress=compress)
    man = store.manifest("exp")
    for mode in ("copy", "hardlink", "symlink"):
        out = tmp_path / mode
        store.checkout("exp", out, link=mode)
        assert _tree(out) == V1 if mode != "symlink" else all((out / k).read_bytes() == v for k, v in V1.items())
        for k in V1:
            obj = store.raw_path(man[k].digest)
            p = out / k
            if mode == "hardlink":
                assert (p.stat().st_dev, p.stat().st_ino) == (obj.stat().st_dev, obj.stat().st_ino)
            elif mode == "symlink":
                assert p.is_symlink() and os.readlink(p) == str(obj)
            else:
                assert not p.is_symlink() and p.stat().st_ino != obj.stat().st_ino
        # A second checkout finds everything in place and writes nothing; sync leaves it all.
        assert store.checkout("exp", out, link=mode, sync=True) == []
        _version(store, "exp", V2, compress=compress)
        store.checkout("exp", out, link=mode, sync=True)
        assert all((out / k).read_bytes() == v for k, v in V2.items()) and not (out / "sub").exists()
        _version(store, "exp", V1, compress=compress)


def _can_reflink(d: Path) -> bool:
    import fcntl
    a, b = d / "probe-a", d / "probe-b"
    a.write_bytes(b"x" * 4096)
    with open(a, "rb") as fa, open(b, "wb") as fb:
        try:
            fcntl.ioctl(fb.fileno(), 0x40049409, fa.fileno())
            return True
        except OSError:
            return False


def test_reflink_is_a_clone_or_an_error_and_copy_falls_back(s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    if _can_reflink(tmp_path):  # btrfs/XFS: a clone, bytes equal
        s.checkout("exp", out, link="reflink")
        assert _tree(out) == V1
    else:  # this machine's ext4/tmpfs: the documented policy is an error, with nothing left behind
        with pytest.raises(InvalidInputError, match="cannot reflink .*after writing 0 of 4 file"):
            s.checkout("exp", out, link="reflink")
        assert _tree(out) == {} and not list(out.rglob(".casstore-*"))
    s.checkout("exp", tmp_path / "copied", link="copy")  # copy reflinks where it can, else copies
    assert _tree(tmp_path / "copied") == V1


def test_bad_link_mode_is_a_typed_error(s: casstore.Store, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="not one of"):
        s.checkout("exp", tmp_path / "o", link="softlink")
    with pytest.raises(casstore.InvalidTypeError):
        s.checkout("exp", tmp_path / "o", sync="yes")  # type: ignore[arg-type]


def test_failure_midway_leaves_no_temp_file_and_counts_what_was_done(s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    seen: List[str] = []

    def hook(p: str) -> None:
        if p == "manifest.checkout_before_rename":
            seen.append(p)
            if len(seen) == 3:  # the 3rd key ("sub/b.txt") became a directory meanwhile
                (out / "sub" / "b.txt").mkdir()
    casstore._faults.hook = hook
    try:
        with pytest.raises(InvalidInputError, match=r"now a directory.*stopped at 'sub/b.txt' after writing "
                                                    r"2 of 4 file"):
            s.checkout("exp", out, link="copy")
    finally:
        casstore._faults.hook = None
    assert not [p for p in out.rglob("*") if p.name.startswith(".casstore-")]
    assert _tree(out) == {"a.txt": b"alpha", "keep.txt": b"same"}


def test_a_corrupt_object_midway_stops_a_sync_before_it_removes_anything(store: casstore.Store,
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    _version(store, "exp", V1)
    store.checkout("exp", out)
    _version(store, "exp", {"a.txt": b"A2", "z.txt": b"zz"})
    d = store.manifest("exp")["z.txt"].digest
    p = store.raw_path(d)
    os.chmod(p, 0o644)
    p.write_bytes(b"ZZ")
    for mode, done in (("copy", "1 of 2"), ("hardlink", "0 of 1")):  # a.txt is in place the second time
        with pytest.raises(IntegrityError, match=f"stopped at 'z.txt' after writing {done} file"):
            store.checkout("exp", out, sync=True, link=mode)
        assert (out / "sub" / "b.txt").exists() and not list(out.rglob(".casstore-*"))


def test_cli_checkout_sync_and_link(s: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "casstore.cli", "--store", str(s.root), "checkout", "exp", str(out)]
    r = subprocess.run([*cli, "--link", "hardlink"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (out / "a.txt").stat().st_nlink == 2
    _version(s, "exp", V2)
    r = subprocess.run([*cli, "--sync", "--link", "symlink"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (out / "new.txt").is_symlink() and not (out / "sub").exists()
    # The user is told what sync removed, not only what it wrote (a.txt and new.txt).
    assert "checked out 2 file(s)" in r.stdout and "sync removed 2 file(s)" in r.stdout, r.stdout
    _version(s, "exp", V1)
    r = subprocess.run([*cli, "--sync", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert sorted(doc["removed"]) == ["new.txt"] and doc["kept"] == []
    assert len(doc["written"]) == 3  # keep.txt was in place
    r = subprocess.run([*cli, "--force"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--sync" in r.stderr


def _restore_mtime_after_edit(p: Path, data: bytes) -> None:
    """A user edit of the same size whose mtime is then put back (rsync -t, tar, ``touch -r`` do this)."""
    st = p.stat()
    time.sleep(0.02)  # a later timestamp tick than the checkout's
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:
        f.write(data)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (p.stat().st_size, p.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_an_edit_with_its_mtime_put_back_is_not_casstores_file(store: casstore.Store, tmp_path: Path) -> None:
    # The record's stat key had no ctime: same size and mtime made the user's edit look like casstore's file.
    out = tmp_path / "out"
    _version(store, "n", {"y": b"casstore", "z": b"zz"})
    store.checkout("n", out)
    _restore_mtime_after_edit(out / "y", b"MY-EDIT!")
    _version(store, "n", {"z": b"zz"})
    done = store.checkout("n", out, sync=True)
    assert (out / "y").read_bytes() == b"MY-EDIT!"
    assert done.removed == () and done.kept == ("y",)
    # ... and the same for a key the new version changes: refused without force, like any user edit.
    _version(store, "n", {"z": b"zz"})
    store.checkout("n", out / "2")
    _restore_mtime_after_edit(out / "2" / "z", b"ZZ")
    _version(store, "n", {"z": b"zz v2"})
    with pytest.raises(InvalidInputError, match="other content"):
        store.checkout("n", out / "2", sync=True)
    assert (out / "2" / "z").read_bytes() == b"ZZ"


def _record(store: casstore.Store) -> Dict[str, Any]:
    import msgpack
    (rec,) = (store.root / RECORD_DIR).iterdir()
    doc: Dict[str, Any] = msgpack.unpackb(rec.read_bytes())
    return doc


def _write_record(store: casstore.Store, doc: Dict[str, Any]) -> None:
    import msgpack
    (rec,) = (store.root / RECORD_DIR).iterdir()
    rec.write_bytes(msgpack.packb(doc))


def test_a_racy_record_vouches_only_with_the_files_bytes(store: casstore.Store, tmp_path: Path) -> None:
    # A file changed in the timestamp tick its record entry was taken in keeps its whole stat: only
    # its bytes can tell.  (The edit below is made to look like one: its entry is given the file's stat.)
    out = tmp_path / "out"
    _version(store, "n", {"y": b"casstore", "z": b"zz"})
    store.checkout("n", out)
    _restore_mtime_after_edit(out / "y", b"MY-EDIT!")
    doc = _record(store)
    st = (out / "y").stat()
    doc["files"]["y"][2:] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    _write_record(store, doc)
    _version(store, "n", {"z": b"zz"})
    assert store.checkout("n", out, sync=True).kept == ("y",)
    assert (out / "y").read_bytes() == b"MY-EDIT!"


def test_a_file_is_hashed_once_after_it_was_written_then_its_record_is_settled(
        store: casstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    co = importlib.import_module("casstore.manifests.checkout")
    seen: List[int] = []
    real = co.hash_fd
    monkeypatch.setattr(co, "hash_fd", lambda fd, size, **kw: seen.append(size) or real(fd, size))
    out = tmp_path / "out"
    _version(store, "n", V1)
    store.checkout("n", out)
    st = (out / "a.txt").stat()
    if not fine_local_stamps(st.st_dev, st.st_ctime_ns):
        pytest.skip("this filesystem's timestamps settle only after RACY_SECONDS")
    seen.clear()
    time.sleep(0.02)  # the checkout's timestamp tick is over
    assert store.checkout("n", out, sync=True) == []
    assert len(seen) == len(V1)  # written in the tick their entries were taken in: each hashed once
    seen.clear()
    assert store.checkout("n", out, sync=True) == []
    assert seen == []  # settled: the stat (ctime included) now vouches for the bytes


def test_a_sync_that_failed_midway_keeps_what_casstore_wrote_so_a_retry_just_works(
        store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _version(store, "n", {"a": b"a1", "b": b"b1", "c": b"c1", "old": b"o"})
    store.checkout("n", out)
    _version(store, "n", {"a": b"a2", "b": b"b2", "c": b"c2"})
    db = store.manifest("n")["b"].digest
    p = store.raw_path(db)
    os.chmod(p, 0o644)
    p.write_bytes(b"XX")  # bit rot in the object the sync needs for 'b'
    with pytest.raises(IntegrityError, match="stopped at 'b' after writing 1 of 3"):
        store.checkout("n", out, sync=True)
    assert _tree(out) == {"a": b"a2", "b": b"b1", "c": b"c1", "old": b"o"}
    store.objects.delete(db)  # repaired: the object put again
    store.put(b"b2")
    done = store.checkout("n", out, sync=True)  # b and c are still casstore's: replaced without overwrite
    assert _tree(out) == {"a": b"a2", "b": b"b2", "c": b"c2"} and done.removed == ("old",)
    _version(store, "n", {})
    assert sorted(store.checkout("n", out, sync=True).removed) == ["a", "b", "c"]
    assert _tree(out) == {}


def test_a_kept_file_stays_recorded_so_force_removes_it_later(s: casstore.Store, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    s.checkout("exp", out)
    (out / "sub" / "b.txt").write_bytes(b"edited by the user")
    _version(s, "exp", V2)
    assert s.checkout("exp", out, sync=True).kept == ("sub/b.txt",)
    with caplog.at_level(logging.WARNING):
        again = s.checkout("exp", out, sync=True)  # still casstore's record, still changed: kept, said again
    assert again.kept == ("sub/b.txt",) and "pass force=True to remove them" in caplog.text  # Python words
    assert "--force" not in caplog.text  # (the CLI rewords it: test_cli_checkout_hints_name_flags)
    done = s.checkout("exp", out, sync=True, force=True)  # what the warning said to do
    assert done.removed == ("sub/b.txt",) and _tree(out) == V2


def test_a_read_only_folder_is_a_read_only_error_naming_the_keys_path(world_dir: Path) -> None:
    # The error named the temp file (.casstore-PID-....part) or the object path a link was made to.
    s = casstore.open(world_dir / "store")
    _version(s, "n", {"ok.txt": b"ok", "ro/x.txt": b"x"})
    for dirpath, _, _ in os.walk(s.root):
        os.chmod(dirpath, 0o755)  # readable for uid 65534, not writable
    out = world_dir / "out"
    (out / "ro").mkdir(parents=True)
    os.chmod(out, 0o777)
    os.chmod(out / "ro", 0o755)  # root's: uid 65534 cannot write the key's directory
    got = run_as_nobody("""
        root, out_dir = sys.argv[1:]
        out = {}
        s = casstore.open(root)
        for link in ("copy", "symlink"):
            try:
                s.checkout("n", out_dir, link=link)
                out[link] = "no error"
            except casstore.errors.ReadOnlyError as e:
                out[link] = [isinstance(e, PermissionError), str(e)]
    """, str(s.root), str(out))
    for link in ("copy", "symlink"):
        is_perm, msg = got[link]
        assert is_perm and f"{out}/ro/x.txt" in msg, msg
        assert ".casstore-" not in msg and "/proc/self" not in msg and str(s.root) not in msg, msg
        assert "stopped at 'ro/x.txt'" in msg, msg
    assert not list(out.rglob(".casstore-*"))


@pytest.fixture
def small_fs() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = Path(tempfile.mkdtemp(prefix="casstore-small-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        os.rmdir(d)


def test_a_full_disk_is_a_disk_full_error_naming_the_keys_path(store: casstore.Store, small_fs: Path) -> None:
    _version(store, "n", {"big.bin": os.urandom(2 << 20)})
    out = small_fs / "out"
    with pytest.raises(casstore.errors.DiskFullError) as ei:
        store.checkout("n", out)
    assert ei.value.errno == errno.ENOSPC
    msg = str(ei.value)
    assert f"{out}/big.bin" in msg and ".casstore-" not in msg and "stopped at 'big.bin'" in msg, msg
    assert not list(out.rglob(".casstore-*"))


def test_a_shared_stores_checkout_records_are_group_writable(tmp_path: Path) -> None:
    from casstore._shared import DIR_MODE
    old = os.umask(0o022)  # the umask that made the directory private to its first user
    try:
        s = casstore.open(tmp_path / "store", shared=True)
        _version(s, "n", {"a": b"a"})
        s.checkout("n", tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(s.root / RECORD_DIR).st_mode) == DIR_MODE
    assert stat.S_IMODE(os.stat(s.root / "cache").st_mode) == DIR_MODE


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the record to another user")
def test_a_record_another_user_wrote_is_not_trusted(s: casstore.Store, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # In a shared store any member may write into cache/checkout: a record planted there by another
    # member could name the victim's own files (at their exact stat) for sync to delete.
    out = tmp_path / "out"
    s.checkout("exp", out)
    (rec,) = (s.root / RECORD_DIR).iterdir()
    os.chown(rec, 65534, 65534)
    _version(s, "exp", V2)
    with caplog.at_level(logging.WARNING):
        done = s.checkout("exp", out, sync=True, overwrite=True)
    assert done.removed == () and "another user" in caplog.text
    assert (out / "sub" / "b.txt").exists()


def test_a_version_1_record_is_still_read_and_its_files_bytes_vouch_for_them(
        store: casstore.Store, tmp_path: Path) -> None:
    # Records written before ctime was recorded: [hex, dev, ino, size, mtime_ns] per key.
    out = tmp_path / "out"
    _version(store, "n", {"y": b"casstore", "z": b"zz", "k": b"k"})
    store.checkout("n", out)
    _restore_mtime_after_edit(out / "y", b"MY-EDIT!")
    doc = _record(store)
    doc["v"] = 1
    doc["files"] = {k: [v[0], *v[2:6]] for k, v in doc["files"].items()}
    _write_record(store, doc)
    _version(store, "n", {"k": b"k"})
    done = store.checkout("n", out, sync=True)
    assert done.removed == ("z",) and done.kept == ("y",)
    assert _record(store)["v"] == 2


# -- a checkout killed midway (found by a bug hunt) --------------------------------------------------------

_KILLED_SYNC = """
import os, signal, sys
import casstore, casstore._faults as F
n = [0]
def hook(point):
    if point == "manifest.checkout_before_rename":
        n[0] += 1
        if n[0] == int(sys.argv[4]):
            os.kill(os.getpid(), signal.SIGKILL)
F.hook = hook
casstore.open(sys.argv[1]).checkout(sys.argv[2], sys.argv[3], sync=True)
"""


def test_a_sync_killed_before_saving_its_record_leaves_no_file_refused_later(s: casstore.Store,
                                                                             tmp_path: Path) -> None:
    """The record is saved when a checkout ends: a SIGKILL after 20 of 50 files were replaced left it naming
    their old digests, and every later sync refused those files as changed (only --force got past)."""
    for v in (1, 2):
        with s.edit("a") as m:
            for i in range(50):
                m[f"f{i:02d}.txt"] = s.put(f"v{v} file {i}\n".encode())
    out = tmp_path / "co"
    s.checkout("a~1", out)
    r = subprocess.run([sys.executable, "-c", _KILLED_SYNC, str(s.root), "a", str(out), "21"], timeout=120)
    assert r.returncode == -9
    assert len(s.checkout("a", out, sync=True)) == 30  # the rest; the 20 replaced before the kill are kept
    s.checkout("a~1", out, sync=True)  # and they are casstore's again: no "exists with other content"
    assert _tree(out) == {f"f{i:02d}.txt": f"v1 file {i}\n".encode() for i in range(50)}


def test_a_killed_checkouts_temp_file_is_removed_by_the_next_one(s: casstore.Store, tmp_path: Path) -> None:
    """A checkout SIGKILLed while writing left ``.casstore-...part`` (part of an object) in the folder for good,
    and a later add stored it as content."""
    _version(s, "exp", {"sub/a.txt": b"a", "b.txt": b"b"})
    out = tmp_path / "out"
    s.checkout("exp", out)
    gone = subprocess.run([sys.executable, "-c", "from casstore._fs import process_token; print(process_token())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # a writer now dead
    from casstore._fs import process_token
    dead = out / "sub" / f".casstore-{gone}.0123456789ab.part"
    dead.write_bytes(b"half an object")
    live = out / "sub" / f".casstore-{process_token()}.0123456789ab.part"  # a writer still running
    live.write_bytes(b"being written")
    other = out / f".casstore-{gone.split('.')[0]}.1.otherhost.0123456789ab.part"  # another host's: unknowable
    other.write_bytes(b"x")
    s.checkout("exp", out)
    assert not dead.exists() and live.exists() and other.exists()
