"""Garbage collection semantics: roots, history, grace, re-put refresh, plan/execute, limits, usage.

Real stores on the real filesystem; nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Set

import pytest

import casstore
from casstore.errors import (
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
    StoreFormatError,
)
from casstore.maintenance import parse_duration, parse_size

HOUR = 3600.0


def object_hexes(root: Path) -> Set[str]:
    """Digest hexes of every object file (any codec), read from the directory."""
    out = set()
    for p in (root / "objects").rglob("*"):
        if p.is_file():
            out.add(p.parent.name + p.name.removesuffix(".zst"))
    return out


def age(store: casstore.Store, d: casstore.Digest, seconds: float = 2 * HOUR) -> None:
    """Make an object look written ``seconds`` ago (both atime and mtime)."""
    for suffix in ("", ".zst"):
        p = store.root / "objects" / d.hex[:2] / (d.hex[2:] + suffix)
        if p.exists():
            t = time.time() - seconds
            os.utime(p, (t, t))


def age_all(store: casstore.Store, seconds: float = 2 * HOUR) -> None:
    t = time.time() - seconds
    for p in (store.root / "objects").rglob("*"):
        if p.is_file():
            os.utime(p, (t, t))


def build(store: casstore.Store, versions: int = 8) -> Dict[str, object]:
    """A head 'exp' with ``versions`` versions (version i adds key k<i> = obj i and drops k<i-1>),
    a pin 'paper' of version 2, and 5 never-referenced objects."""
    objs = [store.put(f"object {i} ".encode() * 50) for i in range(versions)]
    vers = []
    for i in range(versions):
        with store.edit("exp") as m:
            m[f"k{i}"] = objs[i]
            if i:
                del m[f"k{i - 1}"]
        assert m.result is not None
        vers.append(m.result.digest)
    store.pin("paper", vers[2])
    loose = [store.put(f"loose {i}".encode() * 30) for i in range(5)]
    return {"objs": objs, "vers": vers, "loose": loose}


def test_roots_are_pins_heads_and_their_last_versions(store: casstore.Store) -> None:
    b = build(store)
    objs: List[casstore.Digest] = b["objs"]  # type: ignore[assignment]
    vers: List[casstore.Digest] = b["vers"]  # type: ignore[assignment]
    loose: List[casstore.Digest] = b["loose"]  # type: ignore[assignment]
    age_all(store)
    plan = store.plan_gc(keep_history=3, grace="1h")
    # Live: versions 7,6,5,4 (current + 3 back) and their entries 4..7; the pin's version 2 and obj 2.
    live = {vers[i].hex for i in (7, 6, 5, 4, 2)} | {objs[i].hex for i in (7, 6, 5, 4, 2)}
    assert {d.hex for d in plan.objects} == object_hexes(store.root) - live
    assert {d.hex for d in plan.objects} == {vers[i].hex for i in (3, 1, 0)} | {objs[i].hex for i in (3, 1, 0)} \
        | {d.hex for d in loose}
    assert plan.freed_bytes == sum(f.size for f in plan.files) > 0
    # why each kept object stays
    assert "head 'exp'" in plan.kept[objs[7]] and "k7" in plan.kept[objs[7]]
    assert "3 versions back" in plan.kept[vers[4]]
    assert "pin 'paper'" in plan.kept[objs[2]]
    assert plan.why(loose[0]).startswith("deleted: unreferenced")
    assert plan.why(vers[1]).startswith("deleted: an expired manifest version")
    # expired versions are deleted before any object
    kinds = [f.kind for f in plan.files]
    assert kinds == sorted(kinds, key=lambda k: k != "version") and kinds[0] == "version"
    # nothing was deleted by planning
    assert all(store.contains(d) for d in plan.objects)
    res = plan.execute()
    assert set(res.deleted) == set(plan.objects) and res.freed_bytes == plan.freed_bytes
    assert object_hexes(store.root) == live
    assert [m.digest for m in store.history("exp")] == [vers[7], vers[6], vers[5], vers[4]]
    assert store.manifest("paper").digest == vers[2]
    for name in ("exp", "paper"):
        for k, e in store.manifest(name).items():
            assert store.get(e.digest), k
    assert store.verify().ok


def test_keep_history_zero_keeps_only_current(store: casstore.Store) -> None:
    b = build(store, versions=4)
    age_all(store)
    store.plan_gc(keep_history=0, grace=0).execute()
    vers: List[casstore.Digest] = b["vers"]  # type: ignore[assignment]
    # history stops at the first collected version: v2 stays only because the pin holds it
    assert [m.digest for m in store.history("exp")] == [vers[3], vers[2]]
    assert not store.contains(vers[1]) and not store.contains(vers[0])
    rep = store.verify()
    assert rep.ok and not rep.missing


def test_plan_is_frozen(store: casstore.Store) -> None:
    build(store, versions=3)
    plan = store.plan_gc(grace=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.freed_bytes = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.kept[plan.objects[0]] = "x"  # type: ignore[index]
    assert isinstance(plan.objects, tuple) and isinstance(plan.files, tuple)


def test_grace_keeps_fresh_objects_and_says_why(store: casstore.Store) -> None:
    old = store.put(b"old garbage" * 10)
    new = store.put(b"new garbage" * 10)
    age(store, old)
    plan = store.plan_gc(grace="1h")
    assert old in plan.objects and new not in plan.objects
    assert "fresh" in plan.kept[new] and "grace" in plan.kept[new]
    assert new in store.plan_gc(grace=0).objects
    assert new not in store.plan_gc(grace=timedelta(minutes=5)).objects


PUTTERS = {
    "put": lambda s, data, tmp: s.put(data),
    "put_compressed": lambda s, data, tmp: s.put(data, compress=True),
    "put_many": lambda s, data, tmp: s.put_many([data])[0],
    "put_stream": lambda s, data, tmp: s.put_stream(io.BytesIO(data)),
    "put_path": lambda s, data, tmp: (tmp.write_bytes(data), s.put_path(tmp))[1],
}


@pytest.mark.parametrize("how", sorted(PUTTERS))
def test_reput_refreshes_mtime_so_grace_protects_it(store: casstore.Store, tmp_path: Path, how: str) -> None:
    data = b"a value a writer puts again " * 100
    d = PUTTERS[how](store, data, tmp_path / "src")
    age(store, d)
    assert d in store.plan_gc(grace="1h").objects  # old and unreferenced: garbage
    assert PUTTERS[how](store, data, tmp_path / "src") == d  # dedupe hit
    plan = store.plan_gc(grace="1h")
    assert d not in plan.objects and "fresh" in plan.kept[d]


def test_execute_spares_objects_reput_since_the_plan(store: casstore.Store) -> None:
    data = b"comes back" * 100
    d = store.put(data)
    age(store, d)
    plan = store.plan_gc(grace="1h")
    assert d in plan.objects
    store.put(data)  # a writer re-puts it between plan and execute
    res = plan.execute()
    assert store.contains(d) and d not in res.deleted
    assert "again" in res.skipped[d]
    assert not [n for n in os.listdir(store.root / "tmp") if n.endswith(".gc")]


def test_execute_rereads_roots_under_the_lock(store: casstore.Store) -> None:
    d = store.put(b"referenced later" * 10)
    plan = store.plan_gc(grace=0)
    assert d in plan.objects
    with store.edit("late") as m:  # lands a reference after the plan
        m["x"] = d
    assert m.result is not None
    res = plan.execute()
    assert store.get(d) and d not in res.deleted and "now referenced" in res.skipped[d]
    assert m.result.digest not in res.deleted  # the new version was never planned
    assert store.verify().ok


def test_objects_of_a_surviving_expired_version_stay(store: casstore.Store) -> None:
    """An expired version that this run keeps (here: too fresh) keeps its objects, even old ones:
    a stored version must never name a missing object."""
    a, b, x = (store.put(c * 100) for c in (b"a", b"b", b"x"))
    with store.edit("h") as m:
        m["a"], m["b"] = a, b
    v0 = m.result.digest if m.result else None
    age_all(store)  # v0, a, b, x are old
    with store.edit("h") as m:  # v1: fresh, still names b
        m["x"] = x
    v1 = m.result.digest if m.result else None
    with store.edit("h") as m:  # v2 (current) drops b and x
        del m["b"], m["x"]
    plan = store.plan_gc(keep_history=0, grace="1h")
    assert v0 in plan.objects and b in plan.objects and x in plan.objects and v1 not in plan.objects
    res = plan.execute()
    assert v0 in res.deleted and store.contains(v1)
    assert store.contains(b) and store.contains(x) and "history version" in res.skipped[b]
    assert store.verify().ok and [m.digest for m in store.history("h")][1] == v1


def test_gc_refuses_when_a_root_is_unreadable(store: casstore.Store) -> None:
    b = build(store, versions=4)
    vers: List[casstore.Digest] = b["vers"]  # type: ignore[assignment]
    before = object_hexes(store.root)
    p = store.path(vers[3])
    # corrupt the head's current version: what it references is unknown
    os.chmod(p, 0o644)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="verify --repair"):
        store.plan_gc(grace=0)
    # missing: the same
    p.unlink()
    with pytest.raises(ObjectNotFoundError, match="head 'exp'"):
        store.plan_gc(grace=0)
    assert object_hexes(store.root) == before - {vers[3].hex}


def test_a_damaged_ref_stops_gc_shows_in_verify_and_leaves_the_listing(
        store: casstore.Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Hazard (found by a bug hunt): a head whose newest claim was damaged and whose ref file was gone
    vanished from the listing, so ``ls`` and ``verify`` said nothing and gc deleted all it held."""
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "x").write_bytes(b"one")
    store.add("exp", folder)
    (folder / "x").write_bytes(b"two")
    store.add("exp", folder)
    store.add("other", folder)
    before = object_hexes(store.root)
    logs = [p for p in (store.root / "refs" / "log" / "heads").iterdir() if (p / "name").read_text() == "exp"]
    newest = max((p for p in logs[0].iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    newest.unlink()
    newest.symlink_to("garbage")
    (store.root / "refs" / "heads" / "exp").unlink()

    with pytest.raises(StoreFormatError, match="head 'exp' cannot be read"):
        store.plan_gc(grace=0)
    with pytest.raises(StoreFormatError, match="head 'exp' cannot be read"):
        store.plan_limit(0, grace=0)
    assert object_hexes(store.root) == before  # nothing deleted
    report = store.verify()
    assert not report.ok and len(report.damaged_refs) == 1 and "head 'exp'" in report.damaged_refs[0]
    assert "BADREF" in report.summary()
    with caplog.at_level("WARNING"):
        assert [n.name for n in store.names()] == ["other"]  # the rest is listed ...
    assert "head 'exp' is not listed" in caplog.text  # ... and the damaged one is said


def test_expired_versions_beyond_a_missing_kept_version(store: casstore.Store) -> None:
    """A history version already collected (an earlier, smaller keep_history) just ends the walk."""
    b = build(store, versions=6)
    age_all(store)
    store.plan_gc(keep_history=1, grace=0).execute()
    vers: List[casstore.Digest] = b["vers"]  # type: ignore[assignment]
    assert [m.digest for m in store.history("exp")] == [vers[5], vers[4]]
    plan = store.plan_gc(keep_history=5, grace=0)  # asks for more history than is left
    assert not plan.objects
    assert store.verify().ok


def test_parse_duration_and_size() -> None:
    assert parse_duration("90s") == 90 and parse_duration("10m") == 600 and parse_duration("1h") == 3600
    assert parse_duration("1h30m") == 5400 and parse_duration("2d") == 172800 and parse_duration(5) == 5.0
    assert parse_duration(timedelta(minutes=2)) == 120 and parse_duration("0") == 0
    for bad in ("", "1x", "h", "-5", "1h-", "5 apples"):
        with pytest.raises(InvalidInputError, match="grace"):
            parse_duration(bad)
    with pytest.raises(InvalidInputError):
        parse_duration(-1)
    assert parse_size("10G") == 10 << 30 and parse_size("1.5KiB") == 1536 and parse_size(100) == 100
    assert parse_size("500M") == 500 << 20 and parse_size("7") == 7
    with pytest.raises(InvalidInputError):
        parse_size("ten gigs")


def test_plan_gc_reads_no_data_object(store: casstore.Store) -> None:
    """plan_gc must not read object contents: reading would advance atime (relatime)."""
    objs = [store.put(os.urandom(64 << 10)) for _ in range(20)]
    with store.edit("h") as m:
        for i, d in enumerate(objs[:10]):
            m[f"k{i}"] = d
    week = time.time() - 7 * 86400
    paths = [store.path(d) for d in objs]
    for p in paths:
        os.utime(p, (week, time.time() - HOUR))  # atime older than mtime: the next read updates it
    plan = store.plan_gc(grace=0)
    assert len(plan.objects) == 10
    store.usage()
    for p in paths:
        assert os.stat(p).st_atime == pytest.approx(week, abs=1), f"{p} was read"
    store.get(objs[0])  # the control: a read does move atime here
    assert os.stat(paths[0]).st_atime > week + 86400


# -- limits -------------------------------------------------------------------------------------


def test_limit_evicts_lru_unreferenced_first(store: casstore.Store) -> None:
    keep = store.put(os.urandom(4000))
    with store.edit("h") as m:
        m["keep"] = keep
    garbage = [store.put(os.urandom(1000 + i)) for i in range(6)]
    now = time.time()
    # last use: garbage[i] used i hours ago, so LRU order is garbage[5], [4], ...
    for i, d in enumerate(garbage):
        p = store.path(d)
        os.utime(p, (now - (i + 2) * HOUR + 1800, now - (i + 2) * HOUR))
    total = sum(os.path.getsize(p) for p in (store.root / "objects").rglob("*") if p.is_file())
    cap = total - 2500  # needs three of the garbage objects (~1000 B each)
    dry = store.limit(cap, dry_run=True)
    assert dry.result is None and all(store.contains(d) for d in garbage)
    assert list(dry.evicted) == [garbage[5], garbage[4], garbage[3]] and dry.met
    res = store.limit(cap)
    assert res.met and res.stored_bytes_after <= cap and set(res.evicted) == {garbage[5], garbage[4], garbage[3]}
    assert all(store.contains(d) for d in garbage[:3]) and store.contains(keep)
    assert "not needed" in res.plan.kept[garbage[0]]


def test_limit_never_evicts_pinned_or_head_referenced(store: casstore.Store) -> None:
    b = build(store, versions=4)
    age_all(store, 10 * HOUR)
    res = store.limit(0, keep_history=1, grace=0)
    assert not res.met and "cannot be met" in res.message and "pinned" in res.message
    # everything unreferenced went; everything pinned or head-referenced stayed
    vers: List[casstore.Digest] = b["vers"]  # type: ignore[assignment]
    objs: List[casstore.Digest] = b["objs"]  # type: ignore[assignment]
    assert object_hexes(store.root) == {vers[i].hex for i in (3, 2)} | {objs[i].hex for i in (3, 2)}
    assert res.stored_bytes_after > 0
    assert store.verify().ok


def test_limit_already_met_deletes_nothing(store: casstore.Store) -> None:
    d = store.put(b"x" * 100)
    age(store, d)
    res = store.limit("1G", grace=0)
    assert res.met and not res.evicted and store.contains(d) and res.message == ""


# -- usage ----------------------------------------------------------------------------------------


def test_usage_counts_bytes_compression_and_dedupe(store: casstore.Store) -> None:
    shared = store.put(os.urandom(10_000))
    text = b"compressible text, many times over. " * 3000
    z = store.put(text, compress=True)
    assert store.stat(z).codec == "zstd"
    only_a = store.put(os.urandom(3000))
    with store.edit("a") as m:
        m["shared"] = shared
        m["also-shared"] = shared  # the same object twice in one manifest
        m["only"] = only_a
    with store.edit("b") as m:
        m["shared"] = shared
        m["text"] = z
    store.freeze("b")
    loose = store.put(os.urandom(500))
    u = store.usage()
    va, vb = store.manifest("a").digest, store.manifest("b").digest
    sizes = {d: store.stat(d) for d in (shared, z, only_a, loose, va, vb)}
    assert u.objects == 6 and u.files == 6 and u.codecs["zstd"] == 1
    assert u.logical_bytes == sum(i.size for i in sizes.values())
    assert u.stored_bytes == sum(i.stored_size for i in sizes.values())
    assert u.compression_ratio == pytest.approx(u.logical_bytes / u.stored_bytes) and u.compression_ratio > 1.5
    # references: a -> 10000*2 + 3000, b -> 10000 + len(text); stored once each
    assert u.referenced_bytes == 10_000 * 3 + 3000 + len(text)
    assert u.dedupe_savings == 10_000 * 2
    assert u.unreferenced_objects == 1 and u.unreferenced_bytes == 500
    by = {n.name: n for n in u.by_name}
    assert by["b"].kind == "pin" and by["a"].kind == "head"
    assert by["a"].entries == 3 and by["a"].logical_bytes == 23_000
    assert by["a"].exclusive_bytes == 3000 + sizes[va].stored_size  # 'shared' is b's too
    assert by["b"].stored_bytes == 10_000 + sizes[z].stored_size + sizes[vb].stored_size


def test_wrong_types_and_values_are_typed_errors(store: casstore.Store) -> None:
    build(store, versions=3)
    for bad, err in [("5", InvalidTypeError), (True, InvalidTypeError), (1.5, InvalidTypeError),
                     (-1, InvalidInputError)]:
        with pytest.raises(err, match="keep_history"):
            store.plan_gc(keep_history=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="grace"):
        store.plan_gc(grace=[1])  # type: ignore[arg-type]
    for cap in (float("inf"), float("nan"), -1, "lots"):
        with pytest.raises(InvalidInputError, match="max_bytes"):
            store.limit(cap)  # type: ignore[arg-type]
    assert len(object_hexes(store.root)) == 3 + 3 + 5  # nothing was collected by a refused call


def test_gc_forgets_the_chunk_index_rows_of_the_objects_it_deletes(store: casstore.Store) -> None:
    """The chunk index (state/chunks.sqlite: where pushes and pulls saw each chunk) is a hint, but
    it would grow with every object ever moved: gc drops the rows of what it deletes, no others."""
    from casstore.objects.chunking import ChunkIndex, Chunking

    small = Chunking(min_object=1 << 20, avg_size=64 * 1024, min_size=16 * 1024, max_size=256 * 1024)
    kept_data, gone_data = os.urandom(2 << 20), os.urandom(2 << 20)
    with store.edit("kept") as m:
        m["a"] = kept = store.put(kept_data)
    with store.edit("gone") as m:
        m["b"] = gone = store.put(gone_data)
    index = ChunkIndex(store.root)
    r_kept = small.recipe(kept, memoryview(kept_data))
    r_gone = small.recipe(gone, memoryview(gone_data))
    index.add(r_kept)
    index.add(r_gone)
    every = [c.digest for c in r_kept.chunks + r_gone.chunks]
    assert len(index.find(every)) == len(set(every))
    store.remove("gone")
    result = store.plan_gc(keep_history=0, grace=0).execute()
    assert gone in result.deleted and kept not in result.deleted
    left = index.find(every)
    assert set(left) == {c.digest for c in r_kept.chunks}
    assert all(where[0] == kept for where in left.values())
    assert index.forget([kept]) == len(r_kept.chunks) and index.find(every) == {}


def test_a_parent_link_naming_a_big_data_object_is_never_read_whole(store: casstore.Store) -> None:
    """Found by a bug hunt: a pinned version whose parent link names 400 MiB of zeros stored compressed
    (13 KB on disk) took gc's plan and verify to 850 MB; the parent walk reads versions, not data."""
    import subprocess
    import sys

    import msgpack

    big = store.put(bytes(200 << 20), compress=True)
    with store.edit("exp") as m:
        m["a"] = store.put(b"hello")
    doc = msgpack.unpackb(store.get(store.manifest("exp").digest), raw=False)
    doc["parent"] = big.raw
    store.pin("paper", store.put(msgpack.packb(doc, use_bin_type=True)))
    child = (
        "import sys, casstore\n"
        "s = casstore.open(sys.argv[1])\n"
        "plan = s.plan_gc(grace=0)\n"
        "rep = s.verify()\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
        "print(plan.why(sys.argv[2]).split(':')[0], rep.ok, hwm)\n"
    )  # (VmHWM: this process's peak; exec starts it afresh, unlike ru_maxrss)
    r = subprocess.run([sys.executable, "-c", child, str(store.root), big.hex], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    why, ok, hwm_kib = r.stdout.split()
    assert ok == "False"  # the pin's history names something that is not a version (verify says so)
    assert int(hwm_kib) < 120 * 1024, r.stdout  # ~40 MB here; reading the object whole took > 200 MB
    assert why == "deleted", r.stdout  # not a version, referenced by no entry: garbage, collected


def test_version_addressing_and_ls_never_read_a_big_parent_whole(store: casstore.Store) -> None:
    """Found by a bug hunt: NAME~N, NAME@HEX and `casstore ls` read a parent link naming 400 MiB of zeros
    stored compressed whole (846 MB), and counted the data object as a version."""
    import subprocess
    import sys

    import msgpack

    big = store.put(bytes(200 << 20), compress=True)
    with store.edit("h") as m:
        m["a"] = store.put(b"hello")
    doc = msgpack.unpackb(store.get(store.manifest("h").digest), raw=False)
    doc["parent"] = big.raw
    store.refs.write("heads", "h", store.put(msgpack.packb(doc, use_bin_type=True)))
    child = (
        "import sys, json, casstore\n"
        "from casstore.cli import main\n"
        "s = casstore.open(sys.argv[1])\n"
        "out = []\n"
        "for t in ('h~1', 'h~3', 'h@0'):\n"
        "    try:\n"
        "        s.manifest(t); out.append('found')\n"
        "    except casstore.ManifestNotFoundError as e:\n"
        "        out.append(str(e))\n"
        "main(['--store', sys.argv[1], 'ls', '--json'])\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
        "print(json.dumps({'out': out, 'hwm': int(hwm)}))\n"
    )
    r = subprocess.run([sys.executable, "-c", child, str(store.root)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    rows = json.loads("\n".join(r.stdout.strip().splitlines()[:-1]))
    assert res["hwm"] < 120 * 1024, res  # ~40 MB; the whole object read took > 200 MB
    assert all("has 1 version(s)" in o for o in res["out"][:2]), res
    assert [row["versions"] for row in rows] == [1], rows
