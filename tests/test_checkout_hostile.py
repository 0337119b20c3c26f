"""``checkout`` against hostile manifests and folders, and keys that change kind between versions.

Found by a bug hunt: a checkout wrote into the store itself (the store as the target, a folder inside
it, or keys such as ``.casstore/refs/pins/x`` with the store inside the target); ``sync`` could not
follow a key from a file to a directory or back (and then reported the file "kept" forever); and the
CLI's errors and warnings named Python keywords (``link='copy'``, ``force=True``) instead of flags.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

import casstore
from casstore import InvalidInputError


def _version(s: casstore.Store, name: str, files: Dict[str, bytes]) -> None:
    with s.edit(name) as m:
        for k in list(m):
            del m[k]
        for k, data in files.items():
            m[k] = s.put(data)


def _files(root: Path) -> Dict[str, bytes]:
    """Every file under ``root`` by relative path, read through a link at the key (symlink checkouts)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".casstore-")}


def _snapshot(root: Path) -> List[Tuple[str, int, int, int]]:
    """What is in a store: every path with its inode, size and mtime (lstat), to prove nothing changed
    (but its own bookkeeping: lock files, caches and staging, which any command may touch)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel.split("/")[0] in ("locks", "cache", "tmp"):
                continue
            st = os.lstat(os.path.join(dirpath, n))
            out.append((rel, st.st_ino, st.st_size, 0 if n in dirnames else st.st_mtime_ns))
    return sorted(out)


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=60)


# -- 1. a checkout never writes into the store --------------------------------------------------------


def test_a_target_that_is_the_store_or_inside_it_is_refused_before_anything_is_written(
        store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "objects" / "ab").mkdir(parents=True)
    (src / "objects" / "ab" / ("c" * 62)).write_bytes(b"not the object")
    (src / "store.toml").write_text("[store]\nversion = 1\n")
    store.add("evil", src)
    link = tmp_path / "link"
    link.symlink_to(store.root)
    before = _snapshot(store.root)
    for target in (store.root, store.root / "objects", store.root / "refs" / "new" / "deeper", link,
                   link / "objects"):
        for kw in ({}, {"overwrite": True}, {"sync": True, "overwrite": True}):
            with pytest.raises(InvalidInputError, match="is the casstore store .* or a folder inside it"):
                store.checkout("evil", target, **kw)  # type: ignore[arg-type]
    assert _snapshot(store.root) == before
    assert casstore.open(store.root, create=False).manifest("evil")  # the store still opens
    r = _cli(store.root, "checkout", "evil", str(store.root), "--overwrite")
    assert r.returncode == 1 and "is the casstore store" in r.stderr and _snapshot(store.root) == before


@pytest.fixture
def proj(tmp_path: Path) -> Iterator[Tuple[casstore.Store, Path]]:
    """A project folder holding its store (proj/.casstore), the layout docs/folders.md describes."""
    p = tmp_path / "proj"
    p.mkdir()
    yield casstore.open(p / ".casstore"), p


FAKE = "ab" + "c" * 62


@pytest.mark.parametrize("key", [".casstore/refs/pins/forged", f".casstore/objects/ab/{FAKE[2:]}",
                                 ".casstore/store.toml", ".casstore"])
@pytest.mark.parametrize("kw", [{}, {"overwrite": True}, {"sync": True, "overwrite": True, "force": True}])
def test_keys_inside_a_store_inside_the_target_are_refused_naming_the_key_before_anything_is_written(
        proj: Tuple[casstore.Store, Path], key: str, kw: Dict[str, bool]) -> None:
    s, p = proj
    with s.edit("good") as m:
        m["x"] = s.put(b"good data")
    with s.edit("crafted") as m:  # e.g. pulled from a shared remote
        m["a.txt"] = s.put(b"an ordinary file, checked before the bad key")
        m[key] = s.put(s.manifest("good").digest.hex.encode())
    s.checkout("crafted", p / "elsewhere")  # (not the store's folder: fine, and a record exists)
    before = _snapshot(s.root)
    with pytest.raises(InvalidInputError, match=f"manifest key '{key}' lies inside the casstore store.*nothing "
                                                "was checked out"):
        s.checkout("crafted", p, **kw)
    assert _snapshot(s.root) == before and not (p / "a.txt").exists()  # no pin, no object file, no a.txt
    assert casstore.Digest.parse(f"blake3:{FAKE}") not in s


def test_sync_never_removes_anything_inside_the_store(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A record that names files inside the store: written before checkout refused such keys, or the
    # store was made (here: moved) inside the folder since.  The file is casstore's, as it left it.
    p = tmp_path / "proj"
    s = casstore.open(tmp_path / "s")
    _version(s, "n", {"keep": b"k", "zz/planted": b"p"})
    s.checkout("n", p)
    for entry in os.listdir(s.root):  # the store moves into the folder, at zz/
        os.rename(s.root / entry, p / "zz" / entry)
    os.rmdir(s.root)
    s = casstore.open(p / "zz", create=False)
    _version(s, "n", {"keep": b"k"})
    before = _snapshot(s.root)
    with caplog.at_level(logging.WARNING):
        done = s.checkout("n", p, sync=True, force=True)
    assert (p / "zz" / "planted").read_bytes() == b"p" and _snapshot(s.root) == before
    assert done.removed == () and done.kept == ()
    assert "inside the casstore store" in caplog.text and "zz/planted" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # forgotten: not said again
        assert s.checkout("n", p, sync=True).removed == ()
    assert "zz/planted" not in caplog.text and (p / "zz" / "planted").exists()


# -- 2. keys that switch between file and directory ---------------------------------------------------

V1 = {"model": b"m1", "other": b"o"}
V2 = {"model/weights.bin": b"m2", "model/sub/x": b"x", "other": b"o"}


@pytest.mark.parametrize("link", ["copy", "hardlink", "symlink"])
def test_sync_follows_a_key_from_file_to_directory_and_back(store: casstore.Store, tmp_path: Path,
                                                            link: str) -> None:
    out = tmp_path / "out"
    _version(store, "fd", V1)
    _version(store, "fd", V2)
    (out / "mine").mkdir(parents=True)
    (out / "mine" / "notes").write_bytes(b"the user's")
    store.checkout("fd~1", out, link=link)
    done = store.checkout("fd", out, sync=True, link=link)
    assert _files(out) == {**V2, "mine/notes": b"the user's"}
    assert done.removed == ("model",) and done.kept == ()
    again = store.checkout("fd", out, sync=True, force=True, link=link)
    assert list(again) == [] and again.removed == () and again.kept == ()  # nothing "kept" forever
    back = store.checkout("fd~1", out, sync=True, link=link)
    assert _files(out) == {**V1, "mine/notes": b"the user's"}
    assert back.removed == ("model/sub/x", "model/weights.bin") and back.kept == ()
    assert store.checkout("fd~1", out, sync=True, link=link).kept == ()
    forth = store.checkout("fd", out, sync=True, link=link)  # and forth again: the record followed
    assert _files(out) == {**V2, "mine/notes": b"the user's"} and forth.removed == ("model",)


def test_a_file_replaced_by_overwrite_is_not_kept_forever(store: casstore.Store, tmp_path: Path) -> None:
    # The bug hunt's sequence: --sync --overwrite, then every --sync --force said it "kept" model.
    out = tmp_path / "out"
    _version(store, "fd", V1)
    _version(store, "fd", V2)
    store.checkout("fd~1", out)
    assert store.checkout("fd", out, sync=True, overwrite=True).kept == ()
    assert store.checkout("fd", out, sync=True, force=True).kept == ()
    assert _files(out) == V2


def test_a_recorded_file_that_became_the_users_directory_is_forgotten_not_kept(
        store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _version(store, "fd", V1)
    store.checkout("fd", out)
    (out / "model").unlink()
    (out / "model").mkdir()
    (out / "model" / "mine").write_bytes(b"the user's")
    _version(store, "fd", {"other": b"o"})
    for _ in range(2):
        done = store.checkout("fd", out, sync=True, force=True)
        assert done.kept == () and done.removed == ()
    assert _files(out) == {"other": b"o", "model/mine": b"the user's"}


def test_sync_never_removes_a_users_file_to_switch_a_key(store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _version(store, "fd", V1)
    _version(store, "fd", V2)
    store.checkout("fd", out)
    (out / "model" / "sub" / "user.txt").write_bytes(b"the user's")
    for force in (False, True):  # force removes changed files casstore wrote, never a user's
        with pytest.raises(InvalidInputError, match=r"out/model is a directory where the manifest has a file.*"
                                                    r"model/sub/user.txt is not a file it wrote"):
            store.checkout("fd~1", out, sync=True, force=force)
        assert _files(out) == {**V2, "model/sub/user.txt": b"the user's"}
    with pytest.raises(InvalidInputError, match="with sync=True it removes one an earlier checkout"):
        store.checkout("fd~1", out, overwrite=True)  # without sync, a directory is never removed


def test_a_changed_file_in_the_way_needs_force(store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _version(store, "fd", V1)
    _version(store, "fd", V2)
    store.checkout("fd~1", out)
    os.chmod(out / "model", 0o644)
    (out / "model").write_bytes(b"edited")  # file -> directory, the file changed since
    with pytest.raises(InvalidInputError, match="wrote it, but it changed since: pass force=True to replace it"):
        store.checkout("fd", out, sync=True)
    assert _files(out) == {**V1, "model": b"edited"}
    assert store.checkout("fd", out, sync=True, force=True).removed == ("model",)
    assert _files(out) == V2
    os.chmod(out / "model" / "sub" / "x", 0o644)
    (out / "model" / "sub" / "x").write_bytes(b"edited")  # directory -> file, a file in it changed since
    with pytest.raises(InvalidInputError, match=r"model/sub/x changed since it was written \(pass force=True"):
        store.checkout("fd~1", out, sync=True)
    assert _files(out) == {**V2, "model/sub/x": b"edited"}
    assert store.checkout("fd~1", out, sync=True, force=True).removed == ("model/sub/x", "model/weights.bin")
    assert _files(out) == V1


# -- 3. messages: Python names for the API, flags for the CLI -----------------------------------------


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


def test_a_reflink_error_names_link_modes_in_python_and_flags_in_the_cli(store: casstore.Store,
                                                                         tmp_path: Path) -> None:
    if _can_reflink(tmp_path):
        pytest.skip("this filesystem clones: no reflink error to word")
    _version(store, "n", {"a": b"a"})
    with pytest.raises(InvalidInputError) as e:
        store.checkout("n", tmp_path / "o", link="reflink")
    msg = str(e.value)
    assert "link='copy'" in msg and "link='hardlink' or link='symlink'" in msg
    assert "sync removed" not in msg  # no sync was asked for
    with pytest.raises(InvalidInputError, match="sync removed nothing"):
        store.checkout("n", tmp_path / "o", link="reflink", sync=True)
    r = _cli(store.root, "checkout", "n", str(tmp_path / "o"), "--link", "reflink")
    assert r.returncode == 1
    assert "--link copy" in r.stderr and "--link hardlink or --link symlink" in r.stderr, r.stderr
    assert "link=" not in r.stderr and "sync removed" not in r.stderr


def test_a_cross_device_hardlink_error_names_flags_in_the_cli(store: casstore.Store) -> None:
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(store.root).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm)")
    _version(store, "n", {"a": b"a"})
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        with pytest.raises(InvalidInputError, match="Use link='symlink' or link='copy'"):
            store.checkout("n", Path(d) / "o", link="hardlink")
        r = _cli(store.root, "checkout", "n", str(Path(d) / "o"), "--link", "hardlink")
    assert r.returncode == 1 and "Use --link symlink or --link copy" in r.stderr, r.stderr
    assert "link=" not in r.stderr


def test_cli_checkout_hints_name_flags(store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _version(store, "n", {"a": b"a", "b": b"b"})
    store.checkout("n", out)
    os.chmod(out / "b", 0o644)
    (out / "b").write_bytes(b"edited")
    _version(store, "n", {"a": b"a"})
    r = _cli(store.root, "checkout", "n", str(out), "--sync")  # the warning: what sync kept, and how to remove it
    assert r.returncode == 0 and "pass --force to remove them" in r.stderr, r.stderr
    assert "force=True" not in r.stderr
    _version(store, "n", {"a": b"a", "b/c": b"c"})
    r = _cli(store.root, "checkout", "n", str(out), "--sync")  # an error
    assert r.returncode == 1 and "pass --force to replace it" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert "=True" not in r.stderr
    _version(store, "n", {"x/y": b"y"})
    store.checkout("n", out)
    _version(store, "n", {"x": b"x"})
    r = _cli(store.root, "checkout", "n", str(out), "--overwrite")
    assert r.returncode == 1 and "with --sync it removes one" in r.stderr and "=True" not in r.stderr, r.stderr


# -- 4. targets: a path that is not UTF-8, an empty one, one no folder can be -------------------------


def _cli_raw(store: Path, *args: str, cwd: Optional[Path] = None) -> subprocess.CompletedProcess[str]:
    """:func:`_cli` for paths that are not UTF-8 (its output names them: decoded with surrogateescape)."""
    return subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store), *args], cwd=cwd,
                          capture_output=True, text=True, errors="surrogateescape", timeout=60)


def test_a_target_whose_path_is_not_utf8_is_recorded_so_sync_works_there(store: casstore.Store,
                                                                         tmp_path: Path) -> None:
    # Hazard (found by a bug hunt): the checkout record's save crashed (msgpack, a surrogate) after the
    # files were written: every checkout there "failed unexpectedly", and --sync never removed a file.
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    _version(store, "n", {"a": b"a", "b": b"b"})
    store.checkout("n", out)
    assert _files(out) == {"a": b"a", "b": b"b"}
    _version(store, "n", {"a": b"a2"})
    got = store.checkout("n", out, sync=True)
    assert _files(out) == {"a": b"a2"} and got.removed == ("b",)  # the record named b: sync removed it
    _version(store, "n", {"a": b"a2", "c": b"c"})
    r = _cli_raw(store.root, "checkout", "n", str(out))
    assert r.returncode == 0 and "unexpectedly" not in r.stderr, r.stderr
    _version(store, "n", {"a": b"a2"})
    r = _cli_raw(store.root, "checkout", "n", str(out), "--sync")
    assert r.returncode == 0 and "unexpectedly" not in r.stderr, r.stderr
    assert _files(out) == {"a": b"a2"}


def test_an_empty_target_is_refused_before_anything_is_written(store: casstore.Store, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Hazard (found by a bug hunt): `checkout NAME "$OUT"` with $OUT unset checked out into the current
    # directory, and --overwrite replaced the user's a.txt there (add and status refuse '').
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_bytes(b"my own notes")
    monkeypatch.chdir(work)
    _version(store, "n", {"a.txt": b"release", "new": b"new"})
    for target in ("", "a\x00b", "\ud800x"):  # (Path("") is ".": the current directory, named)
        for kw in ({}, {"overwrite": True}, {"sync": True, "overwrite": True}):
            with pytest.raises(InvalidInputError, match="invalid folder .*nothing was checked out"):
                store.checkout("n", target, **kw)  # type: ignore[arg-type]
    r = _cli_raw(store.root, "checkout", "n", "", "--overwrite", cwd=work)
    assert r.returncode == 1 and "invalid folder ''" in r.stderr and "unexpectedly" not in r.stderr, r.stderr
    assert sorted(os.listdir(work)) == ["a.txt"] and (work / "a.txt").read_bytes() == b"my own notes"


def test_a_target_no_folder_can_be_is_a_typed_error_naming_it(store: casstore.Store, tmp_path: Path) -> None:
    # Hazard (found by a bug hunt): under a dangling link, through a loop of links, or with a name over
    # 255 bytes, checkout "failed unexpectedly" (FileNotFoundError, ELOOP, ENAMETOOLONG).
    _version(store, "n", {"a": b"a"})
    (tmp_path / "dangling").symlink_to("/nonexistent/dir")
    (tmp_path / "l1").symlink_to(tmp_path / "l2")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    (tmp_path / "file").write_bytes(b"a file")
    cases = [(tmp_path / "dangling" / "sub", "symbolic link to nothing"),
             (tmp_path / "l1" / "x", "loop of links"),
             (tmp_path / "l1", "loop of links"),
             (tmp_path / ("x" * 300), "too long"),
             (tmp_path / ("x" * 300) / "sub", "too long"),
             (tmp_path / "file" / "sub", "not a directory"),
             (tmp_path / "dangling", "not a directory")]
    before = sorted(os.listdir(tmp_path))
    for target, why in cases:
        for kw in ({}, {"overwrite": True}, {"sync": True}):
            with pytest.raises(InvalidInputError) as ei:
                store.checkout("n", target, **kw)  # type: ignore[arg-type]
            assert why in str(ei.value) and repr(str(target)[:200])[:-1] in str(ei.value), str(ei.value)
        r = _cli_raw(store.root, "checkout", "n", str(target))
        assert r.returncode == 1 and why in r.stderr and "unexpectedly" not in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == before and not os.path.exists("/nonexistent/dir")


def test_a_record_that_cannot_be_packed_is_a_warning_not_a_failed_checkout(
        store: casstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The files are written by then: a record msgpack cannot pack (the path as a surrogate str, as
    # before the fix) only means a later sync removes less, as a read-only store's does.
    # (the module: ``casstore.manifests.checkout`` the attribute is the function it exports)
    monkeypatch.setattr(importlib.import_module("casstore.manifests.checkout"), "_root_field", lambda real: real)
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    _version(store, "n", {"a": b"a"})
    with caplog.at_level(logging.WARNING, logger="casstore.manifests.checkout"):
        got = store.checkout("n", out)
    assert [p.name for p in got] == ["a"] and _files(out) == {"a": b"a"}
    assert "not written (UnicodeEncodeError" in caplog.text
