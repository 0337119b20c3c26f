"""verify: flipped bytes, truncation, missing and stray files, stale staging files, repair, incremental, progress.

Damage is done to real files on disk, the way a bad disk or a careless user would.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, compressible

import casstore
from casstore._fs import _HOST, process_token
from casstore._progress import Progress


def obj_file(store: casstore.Store, d: casstore.Digest) -> Path:
    for suffix in ("", ".zst"):
        p = store.root / "objects" / d.hex[:2] / (d.hex[2:] + suffix)
        if p.exists():
            return p
    raise AssertionError(f"no file for {d}")


def damage(path: Path, *, flip_at: float | None = None, truncate_to: int | None = None) -> bytes:
    """Flip one byte (at a fraction of the length) or truncate; keep the mode. Returns the new bytes."""
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    if flip_at is not None:
        data[int(len(data) * flip_at)] ^= 0x40
    if truncate_to is not None:
        del data[truncate_to:]
    path.write_bytes(bytes(data))
    os.chmod(path, 0o444)
    return bytes(data)


@pytest.fixture
def populated(store: casstore.Store) -> casstore.Store:
    """Raw and zstd objects, an empty object, a head with history and a pin."""
    with store.edit("exp") as m:
        m["raw"] = store.put(os.urandom(300_000))
        m["zst"] = store.put(compressible(200_000), compress=True)
        m["empty"] = store.put(b"")
    with store.edit("exp") as m:
        m["more"] = store.put(os.urandom(5000))
    with store.edit("paper") as m:
        m["w"] = store.put(os.urandom(7000))
    store.freeze("paper")
    store.put(b"unreferenced, fine")
    return store


def test_clean_store_is_ok(populated: casstore.Store) -> None:
    rep = populated.verify()
    n = len([p for p in (populated.root / "objects").rglob("*") if p.is_file()])
    assert rep.ok and rep.checked == n and not rep.corrupt and not rep.missing and not rep.orphaned
    assert rep.bytes_checked > 300_000 and not rep.lost  # stored (compressed) bytes
    assert "healthy" in rep.summary()
    assert populated.verify(fast=True).ok


@pytest.mark.parametrize("key", ["raw", "zst", "more"])
def test_flipped_byte_is_corrupt(populated: casstore.Store, key: str) -> None:
    d = populated.manifest("exp")[key].digest
    p = obj_file(populated, d)
    damage(p, flip_at=0.5)
    rep = populated.verify()
    assert rep.corrupt == (d,) and not rep.ok
    assert str(p) in rep.details[d]
    assert "exp" in " ".join(rep.lost[d])  # the head needs it and it has no good copy


def test_truncated_objects(populated: casstore.Store) -> None:
    raw = populated.manifest("exp")["raw"].digest
    zst = populated.manifest("exp")["zst"].digest
    damage(obj_file(populated, raw), truncate_to=1000)
    damage(obj_file(populated, zst), truncate_to=100)
    for fast in (True, False):  # sizes (manifest) and the zstd trailer catch both without hashing
        rep = populated.verify(fast=fast)
        assert set(rep.corrupt) == {raw, zst}, (fast, rep.summary())
        assert "manifest says 300000" in rep.details[raw]
        assert "trailer" in rep.details[zst]


def test_empty_file_after_a_crash_is_corrupt_even_unreferenced(store: casstore.Store) -> None:
    d = store.put(b"will be emptied by a crash")
    damage(obj_file(store, d), truncate_to=0)
    assert store.verify(fast=True).corrupt == (d,)
    assert store.verify().corrupt == (d,)
    e = store.put(b"")
    assert e not in store.verify().corrupt  # the empty object itself is fine


def test_missing_object_referenced_by_a_manifest(populated: casstore.Store) -> None:
    d = populated.manifest("paper")["w"].digest
    obj_file(populated, d).unlink()
    old = populated.history("exp")[1]["raw"].digest  # also referenced by the older version
    rep = populated.verify()
    assert rep.missing == (d,) and not rep.corrupt
    assert "pin 'paper'" in rep.details[d] and "'w'" in rep.details[d]
    assert rep.lost[d] == ("pin 'paper' entry 'w'",)
    assert old not in rep.missing


def test_missing_manifest_version_of_a_ref(populated: casstore.Store) -> None:
    v = populated.manifest("paper").digest
    obj_file(populated, v).unlink()
    rep = populated.verify()
    assert v in rep.missing and "pin 'paper'" in rep.details[v]


def test_a_pin_to_something_that_is_not_a_manifest_is_reported(store: casstore.Store) -> None:
    with store.edit("h") as m:
        m["x"] = store.put(b"data")
    bogus = store.put(b"not msgpack at all")
    (store.root / "refs" / "pins" / "broken").write_text(f"{bogus}\n")  # hand-edited ref
    rep = store.verify()
    assert rep.unreadable == (bogus,) and not rep.ok and not rep.corrupt
    assert "pin 'broken'" in rep.details[bogus] and "manifest" in rep.details[bogus]
    assert "BADMANIF" in rep.summary()


def test_stray_files_are_orphaned_and_repair_moves_them(populated: casstore.Store) -> None:
    objdir = populated.root / "objects"
    some_fan = next(p for p in objdir.iterdir() if p.is_dir())
    strays = [some_fan / "notes.txt", objdir / "README", some_fan / ("ab" * 31 + ".tmp")]
    for p in strays:
        p.write_text("not an object")
    (objdir / "zz").mkdir()
    (objdir / "zz" / "x").write_text("x")
    rep = populated.verify()
    assert set(rep.orphaned) == set(strays) | {objdir / "zz"} and not rep.ok
    assert not rep.corrupt
    fixed = populated.verify(repair=True)
    assert len(fixed.quarantined) == 4
    assert all(p.parent == populated.root / "bad" and p.exists() for p in fixed.quarantined)
    assert not any(p.exists() for p in strays) and not (objdir / "zz").exists()
    assert populated.verify().ok


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_tmp_files(populated: casstore.Store) -> None:
    tmp = populated.root / "tmp"
    dead = tmp / f"{_dead_pid()}.12345.{_HOST}.00ff00ff00ff00ff.obj"
    live = tmp / f"{process_token()}.00ff00ff00ff00ff.obj"
    far_old = tmp / "999.1.otherhost.0123456789abcdef.obj"
    far_new = tmp / "998.1.otherhost.0123456789abcdef.obj"
    for p in (dead, live, far_old, far_new):
        p.write_bytes(b"partial")
    old = time.time() - 2 * 86400
    os.utime(far_old, (old, old))
    rep = populated.verify()
    assert set(rep.stale_tmp) == {dead, far_old}
    assert rep.ok  # stale staging files are housekeeping, not damage
    fixed = populated.verify(repair=True)
    assert set(fixed.removed_tmp) == {dead, far_old}
    assert not dead.exists() and not far_old.exists() and live.exists() and far_new.exists()
    assert not populated.verify().stale_tmp


def test_repair_quarantines_and_never_silently_drops_a_pinned_only_copy(populated: casstore.Store) -> None:
    original = populated.get(populated.manifest("paper")["w"].digest)
    d = populated.manifest("paper")["w"].digest
    p = obj_file(populated, d)
    damaged = damage(p, flip_at=0.1)
    rep = populated.verify(repair=True)
    assert rep.corrupt == (d,) and rep.repaired
    # moved, not deleted: the damaged bytes are kept under bad/
    assert len(rep.quarantined) == 1 and rep.quarantined[0].parent.name == "bad"
    assert rep.quarantined[0].read_bytes() == damaged and not p.exists()
    # and reported: the pin needs it, no good copy is left
    assert rep.lost == {d: ("pin 'paper' entry 'w'",)}
    assert "LOST" in rep.summary() and "put the original data again" in rep.summary()
    # now it is missing; putting the original again repairs the store
    assert populated.verify().missing == (d,)
    assert populated.put(original) == d
    assert populated.verify().ok and populated.get(d) == original


def test_repair_keeps_the_good_copy_when_one_codec_is_damaged(store: casstore.Store) -> None:
    data = compressible(100_000)
    d = store.put(data, compress=False)
    zpath = store.root / "objects" / d.hex[:2] / (d.hex[2:] + ".zst")
    with casstore.open(store.root / ".." / "other", compress=True) as other:  # make a .zst copy elsewhere
        od = other.put(data)
        os.link(other.root / "objects" / od.hex[:2] / (od.hex[2:] + ".zst"), zpath)
    with store.edit("h") as m:
        m["x"] = d
    damage(obj_file(store, d), flip_at=0.3)  # the raw copy (preferred by readers)
    rep = store.verify(repair=True)
    assert rep.corrupt == (d,) and not rep.lost  # a good copy remains
    assert zpath.exists() and store.get(d) == data
    assert store.verify().ok


def test_incremental_remembers_what_was_verified(populated: casstore.Store) -> None:
    n = len([p for p in (populated.root / "objects").rglob("*") if p.is_file()])
    assert populated.verify(incremental=True).checked == n  # nothing remembered yet
    assert (populated.root / "state" / "verify.msgpack").exists()
    rep = populated.verify(incremental=True)
    assert rep.skipped == n and rep.checked == 0 and rep.ok
    new = populated.put(os.urandom(1234))
    rep = populated.verify(incremental=True)
    assert rep.checked == 1 and rep.skipped == n
    # a file that changed since (new mtime) is checked again, and the damage found
    damage(obj_file(populated, new), flip_at=0.5)
    rep = populated.verify(incremental=True)
    assert rep.corrupt == (new,) and rep.checked == 1
    # a full run checks everything regardless
    assert populated.verify().checked == n + 1


def test_incremental_rechecks_old_verifications(populated: casstore.Store) -> None:
    populated.verify()
    d = populated.manifest("exp")["more"].digest
    p = obj_file(populated, d)
    st = p.stat()
    damage(p, flip_at=0.5)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot: same size and mtime
    from casstore.maintenance import verify

    assert verify(populated, incremental=True).ok  # skipped: verified recently, unchanged on the surface
    assert verify(populated, incremental=True, recheck_after=0).corrupt == (d,)


def test_fast_verify_reads_no_raw_data(populated: casstore.Store) -> None:
    week = time.time() - 7 * 86400
    paths = [p for p in (populated.root / "objects").rglob("*") if p.is_file() and not p.name.endswith(".zst")]
    manifests = {populated.manifest(n).digest for n in ("exp", "paper")} | {m.digest for m in
                                                                           populated.history("exp")}
    data_paths = [p for p in paths if p.parent.name + p.name not in {v.hex for v in manifests}]
    for p in data_paths:
        os.utime(p, (week, time.time() - 3600))
    assert populated.verify(fast=True).ok
    for p in data_paths:
        assert p.stat().st_atime == pytest.approx(week, abs=1), p


def test_progress_bar_on_a_terminal_quiet_otherwise(populated: casstore.Store, capfd: pytest.CaptureFixture[str]) \
        -> None:
    buf = io.StringIO()
    with Progress(1000, desc="verify", stream=buf, enabled=True, interval=0) as bar:
        for _ in range(10):
            bar.update(100)
    out = buf.getvalue()
    assert "\r" in out and "verify:" in out and "100.0%" in out and out.endswith("\n")
    silent = io.StringIO()
    with Progress(10, desc="x", stream=silent) as bar:  # StringIO is not a tty: auto = off
        bar.update(10)
    assert silent.getvalue() == ""
    populated.verify()  # stderr is captured (not a tty): nothing printed
    assert capfd.readouterr().err == ""
    populated.verify(progress=True)
    assert "verify:" in capfd.readouterr().err


def test_cli_verify_is_quiet_when_piped_and_exits_1_on_damage(populated: casstore.Store) -> None:
    env = dict(os.environ, CASSTORE_DIR=str(populated.root))
    r = subprocess.run([sys.executable, "-m", "casstore.cli", "verify"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stderr == "" and "healthy" in r.stdout
    d = populated.manifest("exp")["more"].digest
    damage(obj_file(populated, d), flip_at=0.5)
    r = subprocess.run([sys.executable, "-m", "casstore.cli", "verify", "--json"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=60)
    assert r.returncode == 1 and r.stderr == ""
    import json

    doc = json.loads(r.stdout)
    assert doc["corrupt"] == [str(d)] and doc["ok"] is False


def test_a_wrong_size_in_a_manifest_never_quarantines_good_bytes(store: casstore.Store) -> None:
    """The hash decides: a manifest's size can be wrong (allow_missing, pulled manifests)."""
    import msgpack

    d = store.put(b"twenty-three bytes long")
    doc = {"casstore": "manifest", "entries": {"k": [d.raw, 5]}, "meta": {}, "parent": None, "v": 1}
    store.pin("wrong-size", store.put(msgpack.packb(doc, use_bin_type=True)))
    rep = store.verify(repair=True)
    assert d not in rep.corrupt
    assert store.get(d) == b"twenty-three bytes long"  # still there, not moved to bad/
    # The fast check hashes the one file whose size disagrees (found by a bug hunt: `verify --fast
    # --repair` moved the good object to bad/ on one manifest's word).
    rep = store.verify(fast=True, repair=True)
    assert d not in rep.corrupt and not rep.quarantined and rep.checked == 2
    assert store.get(d) == b"twenty-three bytes long"
    # ... and the entry that misstates it is what verify reports (not ok: status and checkout trust it).
    for rep in (store.verify(), store.verify(fast=True)):
        assert not rep.ok and not rep.corrupt and not rep.lost
        assert rep.wrong_sizes == (f"pin 'wrong-size' entry 'k' records 5 bytes, but blake3:{d.hex} holds 23",)
        assert "SIZE     pin 'wrong-size' entry 'k'" in rep.summary()
        assert rep.to_dict()["wrong_sizes"] == list(rep.wrong_sizes)


def test_a_misstated_size_is_reported_whichever_entry_is_walked_first(store: casstore.Store) -> None:
    """Two names share one object; the one walked first is right, the other misstates the size."""
    import msgpack

    d = store.put(b"x" * 1000, compress=True)  # a compressed object: its size comes from the trailer
    with store.edit("a-good") as m:
        m["k"] = d
    doc = {"casstore": "manifest", "entries": {"j": [d.raw, 999]}, "meta": {}, "parent": None, "v": 1}
    store.pin("z-liar", store.put(msgpack.packb(doc, use_bin_type=True)))
    for kw in ({}, {"fast": True}, {"incremental": True}, {"incremental": True}):  # (the second skips files)
        rep = store.verify(**kw)  # type: ignore[arg-type]
        assert rep.wrong_sizes == (f"pin 'z-liar' entry 'j' records 999 bytes, but blake3:{d.hex} holds 1000",), kw
    assert rep.skipped  # the last incremental run read the size from the trailer without re-hashing
    # Fixed by setting the entry again; history is not reported (gc drops it).
    with store.edit("fixed") as m:
        m["j"] = d
    store.pin("z-liar", store.manifest("fixed").digest, force=True)
    assert store.verify().ok


def test_wrong_types_and_values_are_typed_errors(populated: casstore.Store) -> None:
    from casstore.errors import InvalidInputError, InvalidTypeError

    for bad, err in [(0, InvalidInputError), (-2, InvalidInputError), ("2", InvalidTypeError),
                     (True, InvalidTypeError)]:
        with pytest.raises(err, match="workers"):
            populated.verify(workers=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="recheck_after"):
        populated.verify(incremental=True, recheck_after="soon")
    assert not (populated.root / "state" / "verify.msgpack").exists()  # refused before doing anything


# -- a hostile state/verify.msgpack (found by a bug hunt) --------------------------------------------
# It was read with Path.read_bytes(): a FIFO planted there (state/ is group-writable in a shared store)
# hung every full verify forever, and a link to /dev/zero exhausted memory.  Anything but a regular file
# of bounded size is now an empty record (everything re-hashed) with a warning, never an error.


def test_a_fifo_at_the_verify_record_never_hangs_verify(populated: casstore.Store) -> None:
    record = populated.root / "state" / "verify.msgpack"
    record.parent.mkdir(exist_ok=True)
    record.unlink(missing_ok=True)
    os.mkfifo(record)
    code = ("import casstore, sys\nrep = casstore.open(sys.argv[1]).verify(incremental=True)\n"
            "print(rep.ok, rep.skipped, rep.checked)")
    got = subprocess.run([sys.executable, "-c", code, str(populated.root)], capture_output=True, text=True,
                         timeout=30)  # hung forever
    assert got.returncode == 0, got.stderr
    ok, skipped, checked = got.stdout.split()
    assert ok == "True" and skipped == "0" and int(checked) > 0
    assert f"ignoring {record}" in got.stderr and "hashed again" in got.stderr
    assert record.is_file()  # replaced by a real record


def test_a_linked_or_oversized_verify_record_is_ignored(populated: casstore.Store, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    import importlib

    vmod = importlib.import_module("casstore.maintenance.verify")
    n = populated.verify().checked
    record = populated.root / "state" / "verify.msgpack"
    elsewhere = tmp_path / "record"
    elsewhere.write_bytes(record.read_bytes())  # a record that would vouch for every file
    record.unlink()
    record.symlink_to(elsewhere)  # (to /dev/zero it exhausted memory)
    with caplog.at_level("WARNING", logger="casstore.verify"):
        rep = populated.verify(incremental=True)
    assert rep.skipped == 0 and rep.checked == n and rep.ok  # the link was followed: all skipped
    assert f"ignoring {record}" in caplog.text
    assert record.is_file() and not record.is_symlink()
    assert populated.verify(incremental=True).skipped == n  # a regular record of ours is used
    monkeypatch.setattr(vmod, "STATE_MAX_BYTES", 16)
    caplog.clear()
    with caplog.at_level("WARNING", logger="casstore.verify"):
        rep = populated.verify(incremental=True)
    assert rep.skipped == 0 and rep.checked == n and "larger than 16 bytes" in caplog.text


def test_a_gc_running_during_verify_is_not_reported_as_loss(store: casstore.Store,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a bug hunt: history a concurrent gc collected between verify's walk and its hashing pass
    was reported "LOST ... put the original data again", followed by "store is healthy"."""
    import importlib

    V = importlib.import_module("casstore.maintenance.verify")  # (the package exports the function by that name)
    for i in range(4):
        with store.edit("exp") as m:
            m["w"] = store.put(f"weights v{i}".encode() * 100)
    current = store.manifest("exp")["w"].digest
    check_all = V._check_all
    removed: list[str] = []

    def gc_meanwhile(*a: object, **k: object) -> object:
        if not removed:
            removed.append("gc")
            store.plan_gc(keep_history=0, grace=0).execute()  # history collected, legitimately
        else:  # ... and an object a head still needs, removed behind verify's back
            os.chmod(obj_file(store, current).parent, 0o755)
            obj_file(store, current).unlink()
        return check_all(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(V, "_check_all", gc_meanwhile)
    rep = store.verify()
    assert rep.ok and not rep.lost and "LOST" not in rep.summary(), rep.summary()
    rep = store.verify()  # the second hook removes what head 'exp' needs: that is loss
    assert not rep.ok and current in rep.missing and current in rep.lost
    assert "removed while verify ran" in rep.details[current] or "referenced by" in rep.details[current]


def test_verify_and_usage_are_not_uses_for_the_lru_limit(store: casstore.Store) -> None:
    """Found by a bug hunt: verify (and stats' reads of zstd trailers) refreshed every object's atime,
    so the size limit's least-recently-used order evicted the one object the user had just read."""
    objs = [store.put(f"obj{i}".encode() * 2000, compress=(i % 2 == 0)) for i in range(20)]
    old = time.time() - 3 * 86400
    for d in objs:
        os.utime(obj_file(store, d), (old, old))
    used = objs[0]
    assert store.get(used)
    if os.stat(obj_file(store, used)).st_atime < old + 60:
        pytest.skip("this filesystem does not update access times on read (noatime mount): nothing to keep")
    assert store.verify().ok
    store.usage()
    for d in objs[1:]:
        assert os.stat(obj_file(store, d)).st_atime == pytest.approx(old, abs=1), d
    plan = store.plan_limit(max_bytes=sum(obj_file(store, d).stat().st_size for d in objs) - 1, grace=0)
    assert used not in {f.digest for f in plan.files}
