"""Hostile input for maintenance (issue 11, classes 2 and 3): bombs and planted entries vs verify, gc and usage.

Attack style: the hostile state is built by hand under ``objects/`` (a zstd
frame that decodes to 200 MB behind a trailer that records 1000 bytes; a FIFO,
a symlink or a directory where an object file should be; a fan-out directory
swapped for a symlink between a gc plan and its execution), then the public
API and the CLI are run in a fresh interpreter with a timeout, so a hang fails
the test instead of freezing the suite, and peak memory (``VmHWM``) is
measured where a bomb could inflate it.

What must hold:

* verify reports a bomb corrupt without inflating it (peak RSS far below the
  bomb) whether or not its file name is the digest of what it decodes to;
  ``verify --repair`` moves it to ``bad/`` byte for byte;
* a planted FIFO, symlink or directory is reported (stray, and missing/lost
  when a pin needed the object), never opened, never followed, never hangs
  verify, gc or usage; ``--repair`` moves the entry itself, not its target;
* gc never deletes through a symlink: not at an object path, not through a
  fan-out directory swapped for a link after the plan, and an entry planted
  over a planned file after the plan is put back, not deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import blake3
import msgpack
import pytest
import zstandard
from conftest import REPO, run_py

import casstore
from casstore.errors import IntegrityError

BOMB = 200 << 20  # what the bomb decodes to
RECORDED = 1000  # what its trailer claims
GREW_MAX = 64 << 20  # allowed peak-RSS growth while verifying: far below the bomb
TIMEOUT = 60  # seconds; a hang on a FIFO fails the test here


def _trailer(size: int) -> bytes:
    # docs/format.md: a skippable frame (magic 0x184D2A5E, 12 bytes: "CSZ1" + u64 uncompressed size)
    return (0x184D2A5E).to_bytes(4, "little") + (12).to_bytes(4, "little") + b"CSZ1" + size.to_bytes(8, "little")


def _zeros_frame_and_digest(n: int) -> tuple[bytes, str]:
    """One zstd frame of ``n`` zero bytes (content size in its header) and their blake3 hex, built in chunks."""
    comp = zstandard.ZstdCompressor(level=3, write_content_size=True).compressobj(size=n)
    h = blake3.blake3()
    chunk = bytes(16 << 20)
    out = []
    left = n
    while left:
        k = min(left, len(chunk))
        out.append(comp.compress(chunk[:k]))
        h.update(chunk[:k])
        left -= k
    out.append(comp.flush())
    return b"".join(out), h.hexdigest()


@pytest.fixture(scope="module")
def bomb() -> tuple[bytes, str]:
    """``(file bytes, hex of the 200 MB it decodes to)``: a frame of zeros plus a trailer recording 1000 bytes."""
    frame, hexd = _zeros_frame_and_digest(BOMB)
    assert len(frame) < 1 << 20  # tiny on disk
    return frame + _trailer(RECORDED), hexd


def _obj_path(root: Path, hexd: str, suffix: str = "") -> Path:
    return root / "objects" / hexd[:2] / (hexd[2:] + suffix)


def _plant_file(root: Path, hexd: str, data: bytes, suffix: str) -> Path:
    p = _obj_path(root, hexd, suffix)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


CHILD = r"""
import json, sys, time
import casstore

def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")

s = casstore.open(sys.argv[1], create=False)
what = sys.argv[2]
base = hwm()
out = {}
try:
    if what in ("verify", "verify-repair", "verify-fast"):
        r = s.verify(repair=what == "verify-repair", fast=what == "verify-fast")
        out = {"corrupt": [str(d) for d in r.corrupt], "missing": [str(d) for d in r.missing],
               "orphaned": [str(p) for p in r.orphaned], "lost": [str(d) for d in r.lost],
               "quarantined": [str(p) for p in r.quarantined], "details": {str(k): v for k, v in r.details.items()},
               "ok": r.ok}
    elif what == "gc":
        res = s.plan_gc(keep_history=0, grace=0).execute(timeout=10)
        out = {"deleted": [str(d) for d in res.deleted], "skipped": {str(k): v for k, v in res.skipped.items()}}
    elif what == "usage":
        u = s.usage()
        out = {"objects": u.objects, "files": u.files}
    else:
        raise SystemExit("unknown action " + what)
except casstore.errors.CasstoreError as e:
    out = {"error": type(e).__name__, "message": str(e)}
out["grew"] = hwm() - base
print("RESULT " + json.dumps(out))
"""


def child(root: Path, what: str) -> Dict[str, Any]:
    """Run a maintenance call on ``root`` in a fresh interpreter (a hang fails after TIMEOUT seconds)."""
    r = run_py(CHILD, str(root), what, timeout=TIMEOUT)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout + r.stderr
    out: Dict[str, Any] = json.loads(line[-1][len("RESULT "):])
    return out


def cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CASSTORE_DIR=str(root))
    return subprocess.run([sys.executable, "-m", "casstore.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=TIMEOUT)


# -- decompression bombs ----------------------------------------------------------------------------


@pytest.mark.parametrize("named", [True, False], ids=["named-for-its-content", "misnamed"])
def test_verify_reports_a_bomb_corrupt_without_inflating_it(store: casstore.Store, bomb: tuple[bytes, str],
                                                            named: bool) -> None:
    data, content_hex = bomb
    hexd = content_hex if named else blake3.blake3(b"anything else").hexdigest()
    _plant_file(store.root, hexd, data, ".zst")
    d = f"blake3:{hexd}"
    assert store.stat(d).size == RECORDED  # the trailer is all stat() reads
    out = child(store.root, "verify")
    assert out["corrupt"] == [d] and not out["ok"], out
    assert "more than its recorded 1000 bytes" in out["details"][d], out
    assert out["grew"] < GREW_MAX, out  # nowhere near the 200 MB the frame decodes to


def test_verify_repair_moves_a_pinned_bomb_to_bad_and_reports_it_lost(store: casstore.Store,
                                                                     bomb: tuple[bytes, str]) -> None:
    data, hexd = bomb
    p = _plant_file(store.root, hexd, data, ".zst")
    d = casstore.Digest(hexd)
    with store.edit("h") as m:
        m["bomb"] = d
    store.freeze("h")
    out = child(store.root, "verify-repair")
    assert out["corrupt"] == [str(d)] and out["lost"] == [str(d)], out
    assert out["grew"] < GREW_MAX, out
    assert not p.exists()
    (moved,) = [Path(q) for q in out["quarantined"]]
    assert moved.parent == store.root / "bad" and moved.read_bytes() == data  # moved whole, never inflated
    rep = store.verify()
    assert rep.missing == (d,) and not rep.corrupt and "pin 'h'" in rep.details[d]


def test_cli_verify_repair_moves_a_bomb_to_bad(store: casstore.Store, bomb: tuple[bytes, str]) -> None:
    data, hexd = bomb
    p = _plant_file(store.root, hexd, data, ".zst")
    r = cli(store.root, "verify", "--json")
    assert r.returncode == 1 and r.stderr == "", r.stderr
    assert json.loads(r.stdout)["corrupt"] == [f"blake3:{hexd}"]
    assert p.exists()  # reporting moves nothing
    r = cli(store.root, "verify", "--repair")
    assert r.returncode == 1 and "CORRUPT" in r.stdout and "MOVED" in r.stdout, r.stdout + r.stderr
    assert not p.exists() and [q.read_bytes() for q in (store.root / "bad").iterdir()] == [data]
    r = cli(store.root, "verify")
    assert r.returncode == 0 and "healthy" in r.stdout, r.stdout + r.stderr


def test_fast_verify_of_a_bomb_reads_only_its_header_and_trailer(store: casstore.Store,
                                                                 bomb: tuple[bytes, str]) -> None:
    """Fast mode cannot see inside the frame; a manifest recording the true size exposes the lie."""
    data, hexd = bomb
    _plant_file(store.root, hexd, data, ".zst")
    d = casstore.Digest(hexd)
    # A hand-made manifest recording the true size (edit() would take the trailer's word).
    doc = {"casstore": "manifest", "entries": {"bomb": [d.raw, BOMB]}, "meta": {}, "parent": None, "v": 1}
    store.pin("p", store.put(msgpack.packb(doc, use_bin_type=True)))
    out = child(store.root, "verify-fast")
    assert out["corrupt"] == [str(d)] and "manifest says 209715200" in out["details"][str(d)], out
    assert out["grew"] < GREW_MAX, out


# -- planted FIFOs, symlinks and directories ----------------------------------------------------------


def _plant(path: Path, kind: str, target: Path) -> None:
    """Put a FIFO, a symlink to ``target`` or a directory at ``path`` (whatever was there goes)."""
    if path.exists() or path.is_symlink():
        os.chmod(path, 0o644)
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(target, path)
    else:
        path.mkdir()
        (path / "inside").write_bytes(b"x")


KINDS = ["fifo", "symlink", "dir"]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the store whose bytes are a valid object: following a link to it would look 'ok'."""
    p = tmp_path / "outside" / "victim"
    p.parent.mkdir()
    p.write_bytes(b"bytes outside the store that a planted link points to")
    return p


@pytest.mark.parametrize("kind", KINDS)
def test_planted_entry_at_an_unreferenced_object_path(store: casstore.Store, outside: Path, kind: str) -> None:
    hexd = blake3.blake3(outside.read_bytes()).hexdigest()  # the name the outside bytes would verify under
    p = _obj_path(store.root, hexd)
    _plant(p, kind, outside)
    keep = store.put(b"a real object")
    out = child(store.root, "verify")
    assert out["orphaned"] == [str(p)] and not out["corrupt"] and not out["ok"], out
    assert child(store.root, "usage")["objects"] == 1  # the planted entry is no object
    out = child(store.root, "gc")
    assert str(keep) in out["deleted"] and f"blake3:{hexd}" not in out["deleted"], out
    assert os.path.lexists(p) and outside.exists()  # gc leaves what it did not write alone
    out = child(store.root, "verify-repair")
    (moved,) = [Path(q) for q in out["quarantined"]]
    assert not os.path.lexists(p) and os.path.lexists(moved) and moved.parent == store.root / "bad"
    if kind == "symlink":
        assert moved.is_symlink() and os.readlink(moved) == str(outside)  # the link moved, not its target
    assert outside.read_bytes() == b"bytes outside the store that a planted link points to"
    assert store.verify().ok


@pytest.mark.parametrize("kind", KINDS)
def test_planted_entry_in_place_of_a_pinned_object(store: casstore.Store, outside: Path, kind: str) -> None:
    d = store.put(outside.read_bytes())
    with store.edit("p") as m:
        m["x"] = d
    store.freeze("p")
    p = store.path(d)
    _plant(p, kind, outside)
    out = child(store.root, "verify")
    assert out["orphaned"] == [str(p)] and out["missing"] == [str(d)] and out["lost"] == [str(d)], out
    with pytest.raises(IntegrityError):
        store.get(d)  # and readers refuse it at once (objects layer)
    out = child(store.root, "gc")
    assert "error" not in out and not out["deleted"], out
    assert os.path.lexists(p) and outside.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_planted_entry_in_place_of_a_head_version_stops_gc_at_once(store: casstore.Store, outside: Path,
                                                                   kind: str) -> None:
    with store.edit("h") as m:
        m["x"] = store.put(b"payload")
    v = store.manifest("h").digest
    garbage = store.put(b"garbage")
    p = store.path(v)
    _plant(p, kind, outside)
    out = child(store.root, "gc")  # what the head references is unknown: collect nothing
    assert out["error"] == "IntegrityError" and "verify --repair" in out["message"], out
    assert store.contains(garbage) and outside.exists()
    out = child(store.root, "verify")
    assert str(p) in out["orphaned"] and str(v) in out["lost"], out
    assert child(store.root, "usage")["objects"] == 2


def test_cli_verify_and_gc_with_a_planted_fifo(store: casstore.Store, outside: Path) -> None:
    hexd = "ab" * 32
    p = _obj_path(store.root, hexd, ".zst")
    _plant(p, "fifo", outside)
    r = cli(store.root, "verify")
    assert r.returncode == 1 and "STRAY" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    r = cli(store.root, "gc", "--yes", "--grace", "0")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert os.path.lexists(p)
    r = cli(store.root, "du")
    assert r.returncode == 0, r.stdout + r.stderr


# -- gc never deletes through a symlink ---------------------------------------------------------------


def test_gc_never_follows_a_fan_directory_swapped_for_a_symlink_after_the_plan(store: casstore.Store,
                                                                              tmp_path: Path) -> None:
    g = store.put(b"garbage to collect")
    plan = store.plan_gc(grace=0)
    assert plan.objects == (g,)
    fan = store.root / "objects" / g.hex[:2]
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / g.hex[2:]  # the very name gc is about to delete
    victim.write_bytes(b"someone else's file")
    shutil.move(str(fan), str(tmp_path / "fan-moved-away"))
    os.symlink(victim_dir, fan)
    res = plan.execute()
    assert victim.read_bytes() == b"someone else's file"  # not deleted through the link
    assert res.deleted == () and res.already_gone == 1
    assert fan.is_symlink()  # and the link itself is not gc's to remove either


@pytest.mark.parametrize("kind", KINDS)
def test_gc_puts_back_what_was_planted_over_a_planned_file(store: casstore.Store, outside: Path,
                                                           kind: str) -> None:
    g = store.put(b"garbage to collect")
    other = store.put(b"other garbage")
    plan = store.plan_gc(grace=0)
    assert set(plan.objects) == {g, other}
    p = store.path(g)
    _plant(p, kind, outside)  # after the plan, before execute
    res = plan.execute()
    assert res.deleted == (other,) and "not an object file" in res.skipped[g], res
    assert os.path.lexists(p) and (p.is_symlink() if kind == "symlink" else True)
    assert (kind == "dir") == p.is_dir() and (kind == "fifo") == (os.path.exists(p) and not p.is_dir()
                                                                     and not p.is_symlink())
    assert outside.read_bytes() == b"bytes outside the store that a planted link points to"
    assert not [n for n in os.listdir(store.root / "tmp") if n.endswith(".gc")]  # nothing left mid-move
    rep = store.verify()
    assert rep.orphaned == (p,)


def test_a_fan_directory_that_is_a_symlink_is_one_stray_and_never_entered(store: casstore.Store,
                                                                          tmp_path: Path) -> None:
    """objects/<fan> -> a directory elsewhere holding files named like objects: none is read, listed or deleted."""
    victim_dir = tmp_path / "elsewhere"
    victim_dir.mkdir()
    content = b"a file elsewhere that hashes to its name"
    hexd = blake3.blake3(content).hexdigest()
    victim = victim_dir / hexd[2:]
    victim.write_bytes(content)
    fan = store.root / "objects" / hexd[:2]
    if fan.exists():
        shutil.rmtree(fan)
    os.symlink(victim_dir, fan)
    out = child(store.root, "verify")
    assert out["orphaned"] == [str(fan)] and not out["corrupt"], out
    assert child(store.root, "usage")["files"] == 0
    assert child(store.root, "gc")["deleted"] == []
    assert victim.read_bytes() == content
    out = child(store.root, "verify-repair")
    (moved,) = [Path(q) for q in out["quarantined"]]
    assert moved.is_symlink() and not os.path.lexists(fan) and victim.read_bytes() == content
    assert store.verify().ok
