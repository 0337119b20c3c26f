"""Checkout never writes outside its target and never hangs (issue 11, classes 1 and 2).

Attack style: the target directory is prepared by hand the way anyone who can
write to it could -- symbolic links (to a directory outside, to a file
outside, dangling, looping) at a parent of a key or at the key itself, hard
links to outside files, FIFOs and plain files where directories must be --
then ``Store.checkout`` (and the CLI) is called.  The directory *outside* the
target is snapshotted before and compared after every call: not one byte may
change there.  Races are staged with the fault hook between checkout's check
pass and its writes, and children are SIGKILLed midway to show that no key
ever holds a half-written file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import pytest

import casstore
import casstore._faults
from casstore import Digest, IntegrityError, InvalidInputError

FILES = {
    "a/b.txt": b"AB\n",
    "a/c.txt": b"AC\n",
    "f.txt": b"F\n",
    "x/y/z/w.txt": b"XYZW\n",
    "zz/big.bin": os.urandom(300_000),
}


def _tree(root: Path) -> Dict[str, object]:
    """Everything under ``root`` without following links: path -> content, ('link', target), 'dir' or 'fifo'."""
    out: Dict[str, object] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = "dir"
            elif not os.path.isfile(p):
                out[rel] = "special"
            else:
                with open(p, "rb") as f:
                    out[rel] = (f.read(), os.fstat(f.fileno()).st_ino)
    return out


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    s = casstore.open(tmp_path / "store")
    with s.edit("exp") as m:
        for k, data in FILES.items():
            m[k] = s.put(data)
    return s


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the target, with things an attacker would like overwritten."""
    o = tmp_path / "outside"
    (o / "sub").mkdir(parents=True)
    (o / "victim").write_bytes(b"VICTIM\n")
    (o / "same").write_bytes(FILES["f.txt"])  # even identical content is never read through a link
    (o / "sub" / "b.txt").write_bytes(b"NOT YOURS\n")
    return o


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[None]:
    yield
    casstore._faults.hook = None


def _assert_checked_out(out: Path) -> None:
    for k, data in FILES.items():
        p = out / k
        assert not any(q.is_symlink() for q in [p, *p.parents] if q.is_relative_to(out)), p
        assert p.read_bytes() == data, k
    leftovers = [p for p in out.rglob(".casstore-*")]
    assert leftovers == []


LINK_TARGETS = {
    "dir-outside": lambda o: str(o / "sub"),
    "dir-outside-relative": lambda o: os.path.relpath(o / "sub", o.parent / "out"),
    "file-outside": lambda o: str(o / "victim"),
    "dangling-outside": lambda o: str(o / "new-dir"),
    "loop": lambda o: "loop-link",
}


@pytest.mark.parametrize("where", ["a", "x", "x/y", "x/y/z"])
@pytest.mark.parametrize("to", sorted(LINK_TARGETS))
def test_a_link_at_a_parent_of_a_key_is_never_followed(store: casstore.Store, tmp_path: Path, outside: Path,
                                                       where: str, to: str) -> None:
    out = tmp_path / "out"
    link = out / where
    link.parent.mkdir(parents=True, exist_ok=True)
    target = LINK_TARGETS[to](outside)
    os.symlink(target if to != "loop" else str(link), link)
    before_out, before_outside = _tree(out), _tree(outside)

    with pytest.raises(InvalidInputError, match="symbolic link") as ei:
        store.checkout("exp", out)
    assert str(link) in str(ei.value) and "overwrite=True" in str(ei.value)
    assert _tree(out) == before_out  # refused as a whole: nothing written inside either
    assert _tree(outside) == before_outside

    written = store.checkout("exp", out, overwrite=True)  # replaces the link itself, inside the target
    assert sorted(written) == sorted(out / k for k in FILES)
    assert link.is_dir() and not link.is_symlink()
    _assert_checked_out(out)
    assert _tree(outside) == before_outside
    assert store.checkout("exp", out) == []  # now in place: nothing to do


@pytest.mark.parametrize("to", ["victim", "same", "missing"])
def test_a_link_at_the_key_itself_is_never_written_through(store: casstore.Store, tmp_path: Path, outside: Path,
                                                           to: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside / to, out / "f.txt")
    before_outside = _tree(outside)
    with pytest.raises(InvalidInputError, match="symbolic link"):
        store.checkout("exp", out)
    assert _tree(outside) == before_outside
    assert sorted(os.listdir(out)) == ["f.txt"]
    store.checkout("exp", out, overwrite=True)
    assert not (out / "f.txt").is_symlink()
    _assert_checked_out(out)
    assert _tree(outside) == before_outside
    assert not (outside / "missing").exists()


def test_a_hard_link_to_an_outside_file_is_replaced_not_written_through(store: casstore.Store, tmp_path: Path,
                                                                        outside: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.link(outside / "victim", out / "f.txt")
    before_outside = _tree(outside)
    with pytest.raises(InvalidInputError, match="other content"):
        store.checkout("exp", out)
    store.checkout("exp", out, overwrite=True)
    _assert_checked_out(out)
    assert _tree(outside) == before_outside  # same content, same inode


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_file_or_fifo_where_a_directory_is_needed(store: casstore.Store, tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    (out / "x").mkdir(parents=True)
    p = out / "x" / "y"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.write_bytes(b"in the way")
    before = _tree(out)
    r = _run_checkout(store, out, overwrite=False)
    assert r["error"] == "InvalidInputError" and "directory" in r["message"]
    assert _tree(out) == before
    r = _run_checkout(store, out, overwrite=True)
    assert r["error"] is None, r
    assert p.is_dir()
    _assert_checked_out(out)


def test_a_fifo_at_a_key_never_hangs_checkout(store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "f.txt")  # nobody will ever open its other end
    r = _run_checkout(store, out, overwrite=False)
    assert r["error"] == "InvalidInputError" and "FIFO" in r["message"], r
    assert r["seconds"] < 20
    r = _run_checkout(store, out, overwrite=True)
    assert r["error"] is None, r
    _assert_checked_out(out)


def test_a_directory_at_a_key_is_never_deleted(store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "f.txt").mkdir(parents=True)
    (out / "f.txt" / "precious").write_bytes(b"mine")
    for overwrite in (False, True):
        with pytest.raises(InvalidInputError, match="directory"):
            store.checkout("exp", out, overwrite=overwrite)
        assert (out / "f.txt" / "precious").read_bytes() == b"mine"
    assert sorted(os.listdir(out)) == ["f.txt"]  # refused before anything was written


def test_the_target_must_be_a_directory(store: casstore.Store, tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(InvalidInputError, match="not a directory"):
            store.checkout("exp", bad)
    assert (tmp_path / "file").read_bytes() == b"x"
    with pytest.raises(casstore.InvalidTypeError):
        store.checkout("exp", 123)  # type: ignore[arg-type]


# -- races: the tree changes between the check and the writes ------------------------------------------------


def _at(point: str, action: Callable[[], None]) -> None:
    done: List[bool] = []

    def hook(p: str) -> None:
        if p == point and not done:
            done.append(True)
            action()

    casstore._faults.hook = hook


def test_a_parent_swapped_for_a_link_after_the_check_is_not_followed(store: casstore.Store, tmp_path: Path,
                                                                     outside: Path) -> None:
    out = tmp_path / "out"
    (out / "a").mkdir(parents=True)
    before_outside = _tree(outside)

    def swap() -> None:
        os.rmdir(out / "a")
        os.symlink(outside / "sub", out / "a")

    _at("manifest.checkout_checked", swap)
    with pytest.raises(InvalidInputError, match="symbolic link"):
        store.checkout("exp", out)
    assert _tree(outside) == before_outside
    assert (out / "a").is_symlink()
    assert not list(out.rglob(".casstore-*"))


def test_a_parent_moved_away_while_a_file_is_written_keeps_the_file_inside(store: casstore.Store, tmp_path: Path,
                                                                           outside: Path) -> None:
    """The file lands through the directory's fd: into the moved directory (inside), never through the new link."""
    out = tmp_path / "out"
    before_outside = _tree(outside)

    def swap() -> None:
        os.rename(out / "a", out / "moved")
        os.symlink(outside / "sub", out / "a")

    _at("manifest.checkout_before_rename", swap)
    store.checkout("exp", out)  # the directory's fd is still the directory: "a/c.txt" follows it too
    assert _tree(outside) == before_outside
    assert (out / "moved" / "b.txt").read_bytes() == FILES["a/b.txt"]
    assert (out / "moved" / "c.txt").read_bytes() == FILES["a/c.txt"]
    assert (out / "a").is_symlink()  # the planted link is left alone, and nothing went through it
    assert not list(out.rglob(".casstore-*"))


# -- failures midway ---------------------------------------------------------------------------------------


def test_an_error_midway_leaves_no_half_written_file(store: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    calls: List[str] = []

    def hook(p: str) -> None:
        if p == "manifest.checkout_before_rename":
            calls.append(p)
            if len(calls) == 2:
                raise RuntimeError("disk on fire")

    casstore._faults.hook = hook
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.checkout("exp", out)
    casstore._faults.hook = None
    assert (out / "a" / "b.txt").read_bytes() == FILES["a/b.txt"]  # the first file, complete
    assert not (out / "a" / "c.txt").exists()
    assert not list(out.rglob(".casstore-*"))
    store.checkout("exp", out)
    _assert_checked_out(out)


@pytest.mark.parametrize("compress", [False, True])
def test_a_corrupt_object_midway_leaves_no_file_at_its_key(tmp_path: Path, compress: bool) -> None:
    s = casstore.open(tmp_path / "store")
    good = s.put(b"good\n")
    data = b"line of compressible text\n" * 20000 if compress else os.urandom(200_000)
    d = s.put(data, compress=compress)
    with s.edit("exp") as m:
        m["1-good"] = good
        m["2-bad"] = d
    loc = s.objects.locate(d)
    os.chmod(loc.path, 0o644)
    with open(loc.path, "r+b") as f:
        f.seek(os.path.getsize(loc.path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    out = tmp_path / "out"
    with pytest.raises(IntegrityError):
        s.checkout("exp", out)
    assert (out / "1-good").read_bytes() == b"good\n"
    assert sorted(os.listdir(out)) == ["1-good"]


_KILL_CHILD = """
import os, signal, sys
import casstore, casstore._faults
store = casstore.open(sys.argv[1])
seen = []
def hook(p):
    if p == "manifest.checkout_before_rename":
        seen.append(p)
        if len(seen) == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
casstore._faults.hook = hook
store.checkout("exp", sys.argv[2])
sys.exit(3)
"""


@pytest.mark.parametrize("nth", [1, 3, 5])
def test_sigkill_midway_never_leaves_a_partial_file_under_a_key(store: casstore.Store, tmp_path: Path,
                                                                nth: int) -> None:
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", _KILL_CHILD, str(store.root), str(out), str(nth)],
                       capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    present = {k for k in FILES if (out / k).exists()}
    assert len(present) == nth - 1
    for k in present:
        assert (out / k).read_bytes() == FILES[k]  # whole and right, or absent
    temps = list(out.rglob(".casstore-*.part"))
    assert len(temps) == 1  # the killed writer's temp file, never under a key's name
    store.checkout("exp", out)
    assert all((out / k).read_bytes() == data for k, data in FILES.items())


# -- the CLI ------------------------------------------------------------------------------------------------


def test_the_cli_refuses_a_planted_link_in_one_line(store: casstore.Store, tmp_path: Path, outside: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside / "sub", out / "a")
    before_outside = _tree(outside)
    r = subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store.root), "checkout", "exp", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "symbolic link" in r.stderr, r.stderr
    assert _tree(outside) == before_outside


# -- helpers -----------------------------------------------------------------------------------------------


_CHECKOUT_CHILD = """
import json, sys, time
import casstore
store = casstore.open(sys.argv[1])
t = time.monotonic()
try:
    store.checkout("exp", sys.argv[2], overwrite=sys.argv[3] == "1")
    err, msg = None, ""
except casstore.CasstoreError as e:
    err, msg = type(e).__name__, str(e)
print(json.dumps({"error": err, "message": msg, "seconds": time.monotonic() - t}))
"""


def _run_checkout(store: casstore.Store, out: Path, *, overwrite: bool) -> Dict[str, object]:
    """Checkout in a child process, so that a hang fails this test instead of stopping the suite."""
    import json

    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHECKOUT_CHILD), str(store.root), str(out),
                        "1" if overwrite else "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    res: Dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    assert time.monotonic() - t < 60
    return res


def test_digest_targets_work_the_same(store: casstore.Store, tmp_path: Path, outside: Path) -> None:
    d: Digest = store.manifest("exp").digest
    out = tmp_path / "out"
    (out / "x").mkdir(parents=True)
    os.symlink(outside, out / "x" / "y")
    with pytest.raises(InvalidInputError):
        store.checkout(d, out)
    store.checkout(str(d), out, overwrite=True)
    _assert_checked_out(out)
