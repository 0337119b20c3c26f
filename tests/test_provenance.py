"""Derive provenance survives gc: the inputs a pin (or a head's current version) records are kept.

Real stores, real files, real derive and fetch (file:// URLs); nothing is mocked.  Hand-made
records (``m.meta["casstore.inputs"] = ...``) test the rules and hostile metadata; the derive tests
check the record derive writes end to end.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List

import pytest

import casstore
from casstore.manifests.provenance import INPUTS_KEY, read_provenance

GC = {"keep_history": 0, "grace": 0}


def hexes(root: Path) -> set[str]:
    """Digest hexes of every object file (any codec), read from the directory."""
    return {p.parent.name + p.name.removesuffix(".zst") for p in (root / "objects").rglob("*") if p.is_file()}


def collect(store: casstore.Store) -> casstore.GCPlan:
    """Plan and execute a gc with no history and no grace; return the plan."""
    plan = store.plan_gc(**GC)  # type: ignore[arg-type]
    plan.execute()
    return plan


def made_from(store: casstore.Store, name: str, inputs: Dict[str, object], data: bytes = b"out") -> casstore.Manifest:
    """A head ``name`` with one output whose provenance record is ``inputs``."""
    with store.edit(name) as m:
        m["out.bin"] = store.put(data + name.encode())
        m.meta[INPUTS_KEY] = inputs
    assert m.result is not None
    return m.result


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "s")


# -- the rules, on hand-made records ------------------------------------------------------------


def test_pinned_object_input_kept_until_unpinned(store: casstore.Store) -> None:
    raw = store.put(b"raw download")
    other = store.put(b"never referenced")
    out = made_from(store, "proc", {"raw": str(raw)})
    store.freeze("proc")
    plan = collect(store)
    assert plan.why(raw) == "kept: input 'raw' of pinned 'proc' (derive provenance)"
    assert raw.hex in hexes(store.root) and other.hex not in hexes(store.root)
    assert plan.warnings == ()
    store.unpin("proc")
    plan = collect(store)
    assert plan.why(raw).startswith("deleted: unreferenced")
    assert raw.hex not in hexes(store.root) and out.digest.hex not in hexes(store.root)


def test_manifest_inputs_kept_transitively(store: casstore.Store) -> None:
    """raw (object) -> 'unzip' (manifest) -> 'proc' (pinned): removing every head but the pin keeps all."""
    raw = store.put(b"gzipped bytes")
    unz = made_from(store, "unzip", {"raw": str(raw)})
    unz_out = unz["out.bin"].digest
    made_from(store, "proc", {"data": {"manifest": str(unz.digest)}, "cfg": str(store.put(b"config"))})
    store.freeze("proc")
    store.refs.remove("heads", "unzip")
    plan = collect(store)
    have = hexes(store.root)
    assert {raw.hex, unz.digest.hex, unz_out.hex} <= have
    assert plan.why(unz.digest) == "kept: manifest version of input 'data' of pinned 'proc' (derive provenance)"
    assert plan.why(unz_out) == "kept: entry 'out.bin' of input 'data' of pinned 'proc' (derive provenance)"
    assert plan.why(raw) == "kept: input 'raw' of input 'data' of pinned 'proc' (derive provenance)"
    store.unpin("proc")
    collect(store)
    assert not {raw.hex, unz.digest.hex, unz_out.hex} & hexes(store.root)


def test_direct_reference_wins_the_description(store: casstore.Store) -> None:
    raw = store.put(b"shared")
    with store.edit("data") as m:
        m["raw.bin"] = raw
    made_from(store, "proc", {"raw": str(raw)})
    store.freeze("proc")
    assert store.plan_gc(**GC).why(raw) == "kept: entry 'raw.bin' of head 'data'"  # type: ignore[arg-type]


def test_head_current_version_keeps_inputs_history_does_not(store: casstore.Store) -> None:
    a, b = store.put(b"input A"), store.put(b"input B")
    made_from(store, "proc", {"x": str(a)}, b"v1")
    made_from(store, "proc", {"x": str(b)}, b"v2")
    plan = store.plan_gc(keep_history=1, grace=0)
    assert plan.why(b) == "kept: input 'x' of head 'proc' (derive provenance)"
    assert plan.why(a).startswith("deleted:")  # the previous version is kept, its inputs are not
    plan.execute()
    assert b.hex in hexes(store.root) and a.hex not in hexes(store.root)


def test_older_versions_of_an_input_expire_first(store: casstore.Store) -> None:
    """An input manifest's parents are history: deleted as expired versions, before their objects."""
    made_from(store, "unzip", {}, b"old")
    unz = made_from(store, "unzip", {}, b"new")
    assert unz.parent is not None
    made_from(store, "proc", {"data": {"manifest": str(unz.digest)}})
    store.freeze("proc")
    store.refs.remove("heads", "unzip")
    plan = store.plan_gc(**GC)  # type: ignore[arg-type]
    kinds = {f.hex: f.kind for f in plan.files}
    assert kinds[unz.parent.hex] == "version"
    plan.execute()
    assert unz.digest.hex in hexes(store.root) and unz.parent.hex not in hexes(store.root)


def test_execute_rereads_provenance_under_the_lock(store: casstore.Store) -> None:
    raw = store.put(b"raw")
    made_from(store, "proc", {"raw": str(raw)})
    store.refs.remove("heads", "proc")
    plan = store.plan_gc(**GC)  # type: ignore[arg-type]
    assert raw in plan.objects
    made_from(store, "proc2", {"raw": str(raw)})  # lands between plan and execute
    res = plan.execute()
    assert res.skipped[raw] == "now referenced: input 'raw' of head 'proc2' (derive provenance)"
    assert raw.hex in hexes(store.root)


def test_limit_never_evicts_inputs(store: casstore.Store) -> None:
    raw = store.put(b"r" * 10_000)
    made_from(store, "proc", {"raw": str(raw)})
    store.freeze("proc")
    res = store.limit(1, keep_history=0, grace=0)
    assert not res.met and raw not in res.evicted and "derived from" in res.message
    assert raw.hex in hexes(store.root)


def test_diamond_inputs_expanded_once(store: casstore.Store) -> None:
    raw = store.put(b"raw")
    base = made_from(store, "base", {"raw": str(raw)})
    ref = {"manifest": str(base.digest)}
    made_from(store, "left", {"b": ref})
    made_from(store, "right", {"b": ref})
    made_from(store, "top", {"l": {"manifest": str(store.manifest("left").digest)},
                             "r": {"manifest": str(store.manifest("right").digest)}})
    store.freeze("top")
    for n in ("base", "left", "right"):
        store.refs.remove("heads", n)
    plan = collect(store)
    assert raw.hex in hexes(store.root) and base.digest.hex in hexes(store.root)
    assert plan.why(raw) == "kept: input 'raw' of input 'b' of input 'l' of pinned 'top' (derive provenance)"


# -- hostile records ----------------------------------------------------------------------------

BAD_RECORDS: List[object] = [
    ["blake3:" + "a" * 64],
    "blake3:" + "a" * 64,
    17,
    None,
    {"x": "blake3:" + "A" * 64},
    {"x": "blake3:abc"},
    {"x": "sha256:" + "a" * 64},
    {"x": 5},
    {"x": None},
    {"x": {"manifest": "nope"}},
    {"x": {"manifest": "blake3:" + "a" * 64, "extra": 1}},
    {"x": {"object": "blake3:" + "a" * 64}},
    {"x": ["blake3:" + "a" * 64]},
    {"x": b"\x00" * 32},
    {"x": {"manifest": {"manifest": "blake3:" + "a" * 64}}},
    {"x" * 5000: 1},
    {str(i): i for i in range(500)},
]


@pytest.mark.parametrize("record", BAD_RECORDS, ids=lambda r: repr(r)[:40])
def test_malformed_record_warns_and_keeps_nothing_extra(store: casstore.Store, record: object,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    garbage = store.put(b"garbage")
    with store.edit("proc") as m:
        m["out.bin"] = store.put(b"out")
        m.meta[INPUTS_KEY] = record
    store.freeze("proc")
    with caplog.at_level(logging.WARNING, logger="casstore.gc"):
        plan = store.plan_gc(**GC)  # type: ignore[arg-type]
    assert plan.warnings and all("pinned 'proc'" in w for w in plan.warnings)
    assert len(plan.warnings) <= 11  # a flood of bad entries is summarized
    assert "warning:" in plan.summary() and plan.to_dict()["warnings"] == list(plan.warnings)
    assert any("provenance" in r.getMessage() for r in caplog.records)
    assert garbage in plan.objects
    plan.execute()
    assert garbage.hex not in hexes(store.root)


def test_good_entries_beside_bad_ones_still_count(store: casstore.Store) -> None:
    raw = store.put(b"raw")
    made_from(store, "proc", {"good": str(raw), "bad": "blake3:zz", "worse": {"manifest": 3}})
    store.freeze("proc")
    plan = collect(store)
    assert raw.hex in hexes(store.root) and len(plan.warnings) == 2
    assert all("nothing extra is kept" in w for w in plan.warnings)


def test_record_parser_never_raises() -> None:
    for rec in BAD_RECORDS:
        p = read_provenance({INPUTS_KEY: rec})
        assert p.problems
    assert read_provenance({}) == read_provenance({"other": 1})
    assert read_provenance({}).inputs == () and read_provenance({}).problems == ()


def test_missing_input_version_is_not_an_error(store: casstore.Store) -> None:
    made_from(store, "proc", {"gone": {"manifest": "blake3:" + "ab" * 32}, "obj": "blake3:" + "cd" * 32})
    store.freeze("proc")
    plan = collect(store)
    assert plan.warnings == ()


def test_data_object_named_as_manifest_is_kept_but_not_followed(store: casstore.Store) -> None:
    data = store.put(b"\x85 not a manifest at all" * 100)
    made_from(store, "proc", {"x": {"manifest": str(data)}})
    store.freeze("proc")
    plan = collect(store)
    assert data.hex in hexes(store.root)
    assert len(plan.warnings) == 1 and "corrupt or not a manifest" in plan.warnings[0]


def test_huge_object_named_as_manifest_is_not_read(store: casstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from casstore.manifests import graph

    monkeypatch.setattr(graph, "MAX_INPUT_VERSION_BYTES", 1000)
    big = store.put(b"x" * 5000)
    made_from(store, "proc", {"x": {"manifest": str(big)}})
    store.freeze("proc")
    atime_before = store.path(big).stat().st_atime
    plan = collect(store)
    assert len(plan.warnings) == 1 and "5000 bytes" in plan.warnings[0]
    assert big.hex in hexes(store.root)
    assert store.path(big).stat().st_atime == atime_before


def test_corrupt_input_version_warns_instead_of_stopping_gc(store: casstore.Store) -> None:
    raw = store.put(b"raw")
    unz = made_from(store, "unzip", {"raw": str(raw)})
    made_from(store, "proc", {"data": {"manifest": str(unz.digest)}})
    store.freeze("proc")
    store.refs.remove("heads", "unzip")
    garbage = store.put(b"garbage")
    p = store.path(unz.digest)
    p.chmod(0o644)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    plan = collect(store)  # the pin itself is fine: gc runs, and says what it could not follow
    assert len(plan.warnings) == 1 and "IntegrityError" in plan.warnings[0]
    assert unz.digest.hex in hexes(store.root)  # left for verify --repair
    assert garbage.hex not in hexes(store.root)
    report = store.verify()
    assert not report.ok and unz.digest in report.corrupt
    assert len(report.provenance) == 1 and "IntegrityError" in report.provenance[0]
    assert "PROVENANCE" in report.summary()


def test_verify_reports_malformed_records_without_failing(store: casstore.Store) -> None:
    made_from(store, "proc", {"bad": "blake3:zz"})
    store.freeze("proc")
    made_from(store, "fine", {"raw": str(store.put(b"raw"))})
    report = store.verify()
    assert report.ok and len(report.provenance) == 1 and "pinned 'proc'" in report.provenance[0]
    assert report.to_dict()["provenance"] == list(report.provenance)
    assert "PROVENANCE" in report.summary() and report.provenance == store.plan_gc().warnings
