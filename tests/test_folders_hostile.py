"""store.add / store.status on hostile folders: unreadable paths, names that cannot take a version,
file names and exclude patterns that are not UTF-8, shared stores, the store itself (docs/folders.md).

File modes bind only a process without the DAC capabilities, and CI runs the suite as root: a
permission test runs its casstore calls in a child started by util-linux's ``setpriv`` with
``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH`` and ``CAP_FOWNER`` dropped (as another user it could
not read root's interpreter).  Run as another user, the child is simply started.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import PRELOAD, PYTHON, REPO, b3, run_py

import casstore
from casstore import folders
from casstore._shared import DIR_MODE
from casstore.cli.app import main

SETPRIV = shutil.which("setpriv")
_NO_DAC = "-dac_override,-dac_read_search,-fowner"


def make_tree(root: Path, files: Dict[str, bytes]) -> None:
    for key, data in files.items():
        p = root / key
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def _unprivileged_prefix() -> List[str]:
    """The command prefix that makes file modes bind a child (nothing when we are not root)."""
    if os.geteuid() != 0:
        return []
    if SETPRIV is None:
        pytest.skip("running as root without util-linux's setpriv: no way to make file modes bind a child")
    cmd = [SETPRIV, f"--bounding-set={_NO_DAC}", f"--inh-caps={_NO_DAC}"]
    probe = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:  # (a container's root without CAP_SETPCAP cannot shrink its bounding set)
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr.strip()}")
    return cmd


# The child's casstore calls: each returns what happened as JSON (the error's type and message).
CHILD = """
import contextlib, io, json, sys
import casstore
from casstore.cli.app import main

store = casstore.open(sys.argv[1])
folder = sys.argv[2]
out = {}

def attempt(label, fn):
    try:
        fn()
        out[label] = {"ok": True}
    except Exception as e:
        out[label] = {"ok": False, "type": type(e).__name__, "msg": str(e),
                      "typed": isinstance(e, casstore.CasstoreError)}

attempt("add", lambda: store.add("exp", folder))
attempt("status", lambda: store.status("exp", folder))
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = main(["--store", sys.argv[1], "add", "exp", folder])
out["cli"] = {"rc": rc, "err": err.getvalue()}
print("RESULT " + json.dumps(out))
"""


def run_unprivileged(store: casstore.Store, folder: Path) -> Dict[str, Any]:
    r = subprocess.run([*_unprivileged_prefix(), PYTHON, "-c", CHILD, str(store.root), str(folder)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout + r.stderr
    result: Dict[str, Any] = json.loads(line[-1][len("RESULT "):])
    return result


def _refused(got: Dict[str, Any], *needles: str, excludable: bool = True) -> None:
    """``add`` and ``status`` raised a typed InvalidInputError naming ``needles`` and what to do (fix the
    permissions, or ``exclude`` the path when it is under the folder); the CLI said so plainly."""
    for op in ("add", "status"):
        r = got[op]
        assert not r["ok"] and r["typed"] and r["type"] == "InvalidInputError", (op, r)
        for n in needles:
            assert n in r["msg"], (op, n, r["msg"])
        assert "permission denied" in r["msg"] and "chmod" in r["msg"], (op, r["msg"])
        assert ("exclude=[...]" in r["msg"]) == excludable, (op, r["msg"])
    cli = got["cli"]
    assert cli["rc"] == 1 and "failed unexpectedly" not in cli["err"] and "permission denied" in cli["err"], cli
    assert ("--exclude GLOB" in cli["err"]) == excludable, cli


@pytest.mark.parametrize("mode", [0o000, 0o400, 0o100], ids=["no-access", "list-only", "enter-only"])
def test_unreadable_subfolder_is_refused_not_deleted(store: casstore.Store, tmp_path: Path, mode: int) -> None:
    # Hazard: the walk took EACCES on a subfolder for "replaced by a non-directory during the
    # walk", skipped it, and the new version deleted every file under it.
    f = tmp_path / "f"
    make_tree(f, {"a": b"a", "locked/c": b"c", "locked/deeper/d": b"d"})
    first = store.add("exp", f).digest
    (f / "new").write_bytes(b"new bytes, never to be stored")
    os.chmod(f / "locked", mode)
    try:
        got = run_unprivileged(store, f)
    finally:
        os.chmod(f / "locked", 0o755)
    _refused(got, repr(str(f / "locked")), "'locked'")
    assert store.heads()["exp"] == first  # no version without locked/c
    assert not store.objects.has(casstore.Digest.coerce(b3(b"new bytes, never to be stored")))
    # Left out on purpose, it is a deletion the user asked for.
    os.chmod(f / "locked", mode)
    try:
        r = store.add("exp", f, exclude=["locked"])
    finally:
        os.chmod(f / "locked", 0o755)
    assert r.deleted == ("locked/c", "locked/deeper/d")


def test_unreadable_folder_itself_is_refused(store: casstore.Store, tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(f, {"a": b"a"})
    os.chmod(f, 0o000)
    try:
        got = run_unprivileged(store, f)
    finally:
        os.chmod(f, 0o755)
    _refused(got, repr(str(f)), excludable=False)
    assert "exp" not in store.heads()


def test_unreadable_file_is_a_typed_error_naming_it(store: casstore.Store, tmp_path: Path) -> None:
    f = tmp_path / "f"
    make_tree(f, {"a": b"a", "sub/secret": b"s"})
    first = store.add("exp", f).digest
    (f / "sub/secret").write_bytes(b"t")  # (the same size: status must read it to compare)
    os.chmod(f / "sub/secret", 0o000)
    (f / "new").write_bytes(b"new, readable")
    got = run_unprivileged(store, f)
    _refused(got, "'sub/secret'", str(f / "sub" / "secret"))
    assert store.heads()["exp"] == first


def test_add_to_a_name_that_cannot_take_a_version_stores_nothing(store: casstore.Store, tmp_path: Path) -> None:
    # Hazard: add copied the whole folder into the store durably, then the edit refused the name.
    f = tmp_path / "f"
    make_tree(f, {"a": b"a"})
    store.add("frozen", f)
    store.freeze("frozen")
    big = os.urandom(1 << 20)
    (f / "big").write_bytes(big)
    digest = casstore.Digest.coerce(b3(big))
    for name, err in (("bad~1", casstore.InvalidInputError), ("y@ab", casstore.InvalidInputError),
                      ("", casstore.InvalidInputError), ("a//b", casstore.InvalidInputError),
                      ("c:d", casstore.InvalidInputError), ("frozen", casstore.FrozenError)):
        with pytest.raises(err) as ei:
            store.add(name, f)
        assert repr(name) in str(ei.value)
        assert not store.objects.has(digest), name
    assert set(store.heads()) == set()  # (the frozen name is a pin)
    with pytest.raises(casstore.InvalidTypeError):
        store.add(3, f)  # type: ignore[arg-type]


def test_status_refuses_names_that_are_not_utf8_as_add_does(store: casstore.Store, tmp_path: Path) -> None:
    # Hazard: status crashed writing its stat cache (UnicodeEncodeError from msgpack).
    f = tmp_path / "f"
    make_tree(f, {"ok": b"ok"})
    store.add("exp", f)
    make_tree(f, {"ok2": b"ok2"})
    store.add("exp", f)  # (a cache vouching for the head: the delta path; exp~1 is compared in full)
    with open(os.fsencode(f) + b"/bad\xff", "wb") as fh:
        fh.write(b"x")
    (f / "sub").mkdir()
    with open(os.fsencode(f) + b"/sub/also\xfe", "wb") as fh:
        fh.write(b"y")
    for ver in (None, "exp~1"):  # against the head (delta) and against another version (in full)
        with pytest.raises(casstore.InvalidInputError) as ei:
            store.status("exp", f, version=ver)
        assert "2 file name(s)" in str(ei.value) and "'bad\\udcff'" in str(ei.value) and "exclude" in str(ei.value)
    with pytest.raises(casstore.InvalidInputError) as ei2:
        store.status("new", f)  # no version yet
    assert "'sub/also\\udcfe'" in str(ei2.value)
    with pytest.raises(casstore.InvalidInputError):
        store.add("exp", f)
    st = store.status("exp", f, exclude=["bad?", "also*"])
    assert not st and st.unchanged == ("ok", "ok2")
    assert not store.add("exp", f, exclude=["bad?", "also*"]).created


def test_exclude_pattern_that_is_not_utf8_is_a_typed_error(store: casstore.Store, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "f"
    make_tree(f, {"ok": b"ok"})
    store.add("exp", f)
    bad = os.fsdecode(b"bad\xff")  # what the command line gives for those bytes
    for op in (lambda: store.add("exp", f, exclude=[bad]), lambda: store.status("exp", f, exclude=[bad])):
        with pytest.raises(casstore.InvalidInputError) as ei:
            op()
        assert repr(bad) in str(ei.value) and "UTF-8" in str(ei.value)
    for cmd in ("add", "status"):
        assert main(["--store", str(store.root), cmd, "exp", str(f), "--exclude", bad]) == 1
        err = capsys.readouterr().err
        assert "failed unexpectedly" not in err and "UTF-8" in err


GID, UID = 4321, 4322

SECOND_MEMBER = PRELOAD + """
import json, os, sys, time
os.setgroups([{gid}])
os.setgid({gid})
os.setuid({uid})
os.umask(0o022)
store = casstore.open(sys.argv[1])
f = sys.argv[2]
from casstore._fsprobe import RACY_SECONDS, fine_local_stamps
for k in ("a", "b"):
    with open(os.path.join(f, k), "w") as fh:
        fh.write(k + " of the second member")
st = os.stat(os.path.join(f, "b"))
time.sleep(0.1 if fine_local_stamps(st.st_dev, st.st_ctime_ns) else RACY_SECONDS + 0.1)  # (settled: not racy)
out = {{"first": store.add("mine", f).hashed}}
out["again"] = store.add("mine", f).hashed
out["status"] = store.status("mine", f).hashed
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_stat_cache_of_another_user_is_never_trusted(tmp_path: Path) -> None:
    # Hazard (shared stores, any member can write cache/stat): a cache vouches for digests without
    # reading a byte, so a planted one named the bytes of another user's snapshot.
    s = casstore.open(tmp_path / "store")
    folder = tmp_path / "f"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.bin").write_bytes(b"%d" % i)
    time.sleep(0.1)  # past the clock tick of the writes, so the cache may vouch (folders._racy)
    s.add("n", folder)
    assert s.status("n", folder).hashed == 0  # this user's own cache and mark vouch
    planted = list((s.root / "cache" / "stat").iterdir())
    assert planted and all(f".{os.geteuid()}." in p.name for p in planted)  # per user
    for p in planted:
        os.chown(p, 4321, -1)  # as if another member had written them
    assert s.status("n", folder).hashed == 3  # ignored: every file read (and this user's own written)
    for p in (s.root / "cache" / "stat").iterdir():
        os.chown(p, 4321, -1)
    r = s.add("n", folder)
    assert not r.created and r.hashed == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second member of the store's group")
def test_shared_store_stat_cache_works_for_every_member(world_dir: Path) -> None:
    # Hazard: cache/stat was made by Path.mkdir (0o2755, the first user's): the other members'
    # caches and clean marks were never written, and every status read every file.
    root = world_dir / "team"
    root.mkdir()
    os.chown(root, -1, GID)
    old = os.umask(0o022)
    try:
        store = casstore.open(root, shared=True)
        f = world_dir / "root-folder"
        make_tree(f, {"x": b"x"})
        store.add("theirs", f)
    finally:
        os.umask(old)
    st = os.stat(root / folders.CACHE_DIR)
    assert stat.S_IMODE(st.st_mode) == DIR_MODE and st.st_gid == GID
    member = world_dir / "member"  # the second member's own folder
    member.mkdir()
    os.chown(member, UID, GID)
    r = run_py(textwrap.dedent(SECOND_MEMBER.format(gid=GID, uid=UID)), str(root), str(member))
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout + r.stderr
    got = json.loads(line[-1][len("RESULT "):])
    assert got == {"first": 2, "again": 0, "status": 0}


def test_shared_stat_cache_dir_after_a_checkout_made_cache(world_dir: Path) -> None:
    # A checkout's record made <store>/cache first: makedirs copies that parent's mode.
    root = world_dir / "team"
    root.mkdir()
    old = os.umask(0o022)
    try:
        store = casstore.open(root, shared=True)
        with store.edit("n") as m:
            m["k"] = store.put(b"k")
        store.checkout("n", world_dir / "out")
        f = world_dir / "f"
        make_tree(f, {"x": b"x"})
        store.add("x", f)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(root / folders.CACHE_DIR).st_mode) == DIR_MODE


def test_the_store_itself_or_a_folder_inside_it_is_refused(store: casstore.Store, tmp_path: Path) -> None:
    # Hazard: add('x', store.root) snapshotted the store into itself (objects/..., store.toml).
    store.put(b"an object")
    for folder in (store.root, store.root / "objects", store.root / "refs"):
        for op in (store.add, store.status):
            with pytest.raises(casstore.InvalidInputError) as ei:
                op("x", folder)
            assert "store" in str(ei.value) and str(store.root) in str(ei.value)
    link = tmp_path / "link-to-store"
    os.symlink(store.root, link)
    with pytest.raises(casstore.InvalidInputError):
        store.add("x", link)
    assert "x" not in store.heads()
    # A store inside the folder is still left out (docs/folders.md), not refused.
    f = tmp_path / "f"
    make_tree(f, {"data": b"d"})
    inner = casstore.open(f / ".casstore")
    assert [s.path for s in inner.add("self", f).skipped] == [".casstore"]


# -- a folder whose own path is not UTF-8 --------------------------------------------------------------


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    # Files a test has just written may be racy (never cached): here they count as settled, so a
    # re-add or status that reads a file is one the stat cache or clean mark failed to vouch for.
    monkeypatch.setattr(folders, "fine_local_stamps", lambda st_dev, ctime_ns: False)
    monkeypatch.setattr(folders, "RACY_SECONDS", 0.0)


def _latin1_folder(tmp_path: Path) -> Path:
    f = Path(os.fsdecode(os.fsencode(tmp_path) + b"/r\xe9sultats"))  # (as a command line passes it)
    make_tree(f, {"a.txt": b"alpha", "sub/b.txt": b"beta"})
    return f


def test_a_folder_whose_path_is_not_utf8_adds_re_adds_from_the_cache_and_compares(
        store: casstore.Store, tmp_path: Path, settled: None, capsys: pytest.CaptureFixture[str]) -> None:
    # Hazard (found by a bug hunt): add committed the version and then failed "unexpectedly" saving the
    # stat cache (msgpack, a surrogate in the folder's path), every time; status always failed too.
    f = _latin1_folder(tmp_path)
    first = store.add("exp", f)
    assert first.created and first.hashed == 2
    again = store.add("exp", f)  # the clean mark
    assert not again.created and again.digest == first.digest and again.hashed == 0
    st = store.status("exp", f)
    assert not st and st.unchanged == ("a.txt", "sub/b.txt") and st.hashed == 0
    os.unlink(store.root / folders.CACHE_DIR / next(n for n in os.listdir(store.root / folders.CACHE_DIR)
                                                    if n.endswith(".clean")))
    st = store.status("exp", f)  # the stat cache alone (it vouches for the head)
    assert not st and st.hashed == 0
    (f / "c.txt").write_bytes(b"gamma")
    st = store.status("exp", f)
    assert st.added == ("c.txt",) and st.hashed == 0
    third = store.add("exp", f)
    assert third.created and third.added == ("c.txt",) and third.hashed == 1
    assert store.status("exp", f).hashed == 0 and store.add("exp", f).hashed == 0
    # A file renamed to a name that is not UTF-8 (the count unchanged) is refused by name: the clean
    # mark's fingerprint crashed on it.
    os.rename(os.fsencode(f) + b"/c.txt", os.fsencode(f) + b"/c\xff")
    for op in (lambda: store.status("exp", f), lambda: store.add("exp", f)):
        with pytest.raises(casstore.InvalidInputError, match="'c\\\\udcff'"):
            op()
    os.rename(os.fsencode(f) + b"/c\xff", os.fsencode(f) + b"/c.txt")
    for cmd in ("add", "status"):
        assert main(["--store", str(store.root), cmd, "exp", str(f)]) == 0
        assert "unexpectedly" not in capsys.readouterr().err
    assert [m.digest for m in store.history("exp")] == [third.digest, first.digest]


def test_a_stat_cache_that_cannot_be_saved_never_fails_a_committed_add(
        store: casstore.Store, tmp_path: Path, settled: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Hazard (found by a bug hunt): the stat cache is saved after the commit, and its failure reported
    # a committed add as failed.  A document msgpack cannot pack (the folder's path as a surrogate str,
    # as before the fix), and a save that fails any other way, are logged: add and status still answer.
    g = tmp_path / "plain"
    make_tree(g, {"a.txt": b"alpha"})
    store.add("plain", g)
    marks = store.root / folders.CACHE_DIR
    assert any(n.endswith(".clean") for n in os.listdir(marks))
    f = _latin1_folder(tmp_path)
    with monkeypatch.context() as mp:
        mp.setattr(folders, "_root_field", lambda real: real)
        r = store.add("exp", f)
        assert r.created and store.heads()["exp"] == r.digest
        assert not store.status("exp", f)
    assert "not written (UnicodeEncodeError" in caplog.text

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("cache/stat is broken")

    monkeypatch.setattr(folders._StatCache, "save", broken)
    for folder, name in ((f, "exp"), (g, "plain")):
        (folder / "c.txt").write_bytes(b"gamma")
        r2 = store.add(name, folder)
        assert r2.created and r2.added == ("c.txt",) and store.heads()[name] == r2.digest
    assert "cache/stat is broken" in caplog.text
    assert not any(n.endswith(".clean") for n in os.listdir(marks))  # (none vouches for what it did not see)


def test_a_folder_path_no_file_name_can_be_is_refused(store: casstore.Store, tmp_path: Path) -> None:
    # A lone surrogate that no bytes decode to (not surrogateescape's): no system call can take it,
    # and hashing the path for the stat cache's name crashed (UnicodeEncodeError).
    for op in (lambda: store.add("exp", str(tmp_path) + "/\ud800x"),
               lambda: store.status("exp", str(tmp_path) + "/\ud800x")):
        with pytest.raises(casstore.InvalidInputError, match="invalid folder .*not valid Unicode"):
            op()
