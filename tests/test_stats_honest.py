"""Honest usage figures: dedupe counts live names only; history is reported apart; du shows sharing.

A worked example with exact byte counts asserts every figure of ``store.usage()``, the
regression from issue 12 (history versions counted as dedupe savings: 1.3 MiB "saved" when
550 KB was ever put), and the ``du NAME`` / ``du --shared`` / ``stats --json`` commands.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Tuple

import pytest

import casstore
from casstore.cli import main
from casstore.digest import Digest
from casstore.errors import InvalidTypeError, ManifestNotFoundError

TEXT = b"compressible text, many times over. " * 3000  # 108,000 bytes


def worked_example(store: casstore.Store) -> Tuple[Dict[str, Digest], Dict[str, int]]:
    """Head 'a' (two versions), pin 'p'; object A under both names, T compressed, H only in history."""
    d = {
        "A": store.put(os.urandom(10_000)),
        "B": store.put(os.urandom(3_000)),
        "H": store.put(os.urandom(5_000)),
        "T": store.put(TEXT, compress=True),
    }
    assert store.stat(d["T"]).codec == "zstd"
    with store.edit("a") as m:
        m["data"] = d["A"]
        m["old"] = d["H"]
    d["va1"] = store.manifest("a").digest
    with store.edit("a") as m:
        del m["old"]
        m["b"] = d["B"]
    d["va2"] = store.manifest("a").digest
    with store.edit("p") as m:
        m["data"] = d["A"]
        m["t"] = d["T"]
        m["t2"] = d["T"]  # the same object twice in one name: two references
    d["vp"] = store.freeze("p")
    d["L"] = store.put(os.urandom(700))  # loose: referenced by nothing
    sizes = {k: store.stat(v).stored_size for k, v in d.items()}
    assert sizes["T"] < len(TEXT) // 10
    return d, sizes


def test_worked_example_every_figure(store: casstore.Store) -> None:
    d, s = worked_example(store)
    u = store.usage(shares=["a"])
    t = len(TEXT)
    # Whole store.
    assert u.objects == 8 and u.files == 8 and dict(u.codecs) == {"raw": 7, "zstd": 1}
    logical_manifests = sum(store.stat(d[k]).size for k in ("va1", "va2", "vp"))
    assert u.logical_bytes == 10_000 + 3_000 + 5_000 + t + 700 + logical_manifests
    assert u.stored_bytes == sum(s.values())
    assert u.compression_ratio == u.logical_bytes / u.stored_bytes
    assert u.versions == 3
    assert u.referenced_bytes == (10_000 + 5_000) + (10_000 + 3_000) + (10_000 + 2 * t)
    assert u.unreferenced_objects == 1 and u.unreferenced_bytes == 700
    # Live names: a's current version {data: A, b: B} and pin p {data: A, t: T, t2: T}.
    assert u.live_logical_bytes == (10_000 + 3_000) + (10_000 + 2 * t)
    assert u.live_objects == 3
    assert u.live_unique_bytes == 10_000 + 3_000 + t
    assert u.live_stored_bytes == 10_000 + 3_000 + s["T"]
    assert u.live_missing == 0
    assert u.live_manifest_bytes == s["va2"] + s["vp"]
    assert u.dedupe_savings == 10_000 + t  # A once more (two names), T once more (two keys)
    assert u.dedupe_ratio == u.live_logical_bytes / u.live_unique_bytes
    assert u.reduction_ratio == u.live_logical_bytes / u.live_stored_bytes
    assert u.reduction_ratio > u.dedupe_ratio  # compression on top
    # History: a's first version {data: A, old: H}; only H and that version are history's alone.
    assert u.history_versions == 1
    assert u.history_logical_bytes == 10_000 + 5_000
    assert u.history_objects == 2 and u.history_stored_bytes == 5_000 + s["va1"]
    # Per name.
    by = {n.name: n for n in u.by_name}
    a, p = by["a"], by["p"]
    assert (a.kind, a.version, a.entries, a.logical_bytes, a.objects, a.missing) == ("head", d["va2"], 2, 13_000, 3, 0)
    assert a.stored_bytes == 10_000 + 3_000 + s["va2"]
    assert a.exclusive_bytes == 3_000 + s["va2"] and a.shared_bytes == 10_000
    assert [x.to_dict() for x in a.shared_with] == [{"name": "p", "kind": "pin", "objects": 1,
                                                    "stored_bytes": 10_000}]
    assert (p.kind, p.version, p.entries, p.logical_bytes, p.objects) == ("pin", d["vp"], 3, 10_000 + 2 * t, 3)
    assert p.stored_bytes == 10_000 + s["T"] + s["vp"]
    assert p.exclusive_bytes == s["T"] + s["vp"] and p.shared_bytes == 10_000
    assert p.shared_with == ()  # not asked for
    # The JSON document carries the same figures.
    doc = json.loads(json.dumps(u.to_dict()))
    assert doc["live"] == {"logical_bytes": u.live_logical_bytes, "objects": 3, "unique_bytes": u.live_unique_bytes,
                           "stored_bytes": u.live_stored_bytes, "missing": 0, "manifest_bytes": u.live_manifest_bytes,
                           "dedupe_savings": u.dedupe_savings, "dedupe_ratio": u.dedupe_ratio,
                           "reduction_ratio": u.reduction_ratio}
    assert doc["history"] == {"versions": 1, "logical_bytes": 15_000, "objects": 2,
                              "stored_bytes": 5_000 + s["va1"]}
    assert doc["dedupe_savings"] == u.dedupe_savings


def test_history_is_not_counted_as_dedupe_savings(store: casstore.Store) -> None:
    """Regression (issue 12): every older version's references used to count as savings."""
    put = 0
    big = os.urandom(500_000)
    put += len(big)
    with store.edit("run") as m:
        m["weights"] = store.put(big)
    for i in range(10):  # ten more versions, each adding a 5,000-byte file: 550,000 bytes ever put
        blob = os.urandom(5_000)
        put += len(blob)
        with store.edit("run") as m:
            m[f"log{i}"] = store.put(blob)
    u = store.usage()
    assert put == 550_000
    # Before the fix: referenced_bytes (every version) minus the distinct objects = 5,000,000+ "saved".
    assert u.referenced_bytes > 10 * 500_000
    assert u.dedupe_savings == 0 and u.dedupe_ratio == 1.0  # the live version lists each object once
    assert u.dedupe_savings <= put
    assert u.live_logical_bytes == u.live_unique_bytes == put
    assert u.history_versions == 10
    assert u.history_logical_bytes == sum(500_000 + 5_000 * k for k in range(10))
    assert u.history_objects == 10  # the ten older versions; every data object is still live
    assert u.by_name[0].exclusive_bytes == u.by_name[0].stored_bytes and u.by_name[0].shared_bytes == 0


def test_shares_argument_is_checked(store: casstore.Store) -> None:
    with store.edit("a") as m:
        m["x"] = store.put(b"x")
    with pytest.raises(ManifestNotFoundError, match="casstore ls"):
        store.usage(shares=["nope"])
    with pytest.raises(InvalidTypeError):
        store.usage(shares="a")
    with pytest.raises(InvalidTypeError):
        store.usage(shares=[1])  # type: ignore[list-item]


def run(store: casstore.Store, capsys: pytest.CaptureFixture[str], *argv: str) -> Tuple[int, str, str]:
    rc = main(["--store", str(store.root), *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_du_name_and_shared_and_stats(store: casstore.Store, capsys: pytest.CaptureFixture[str]) -> None:
    d, s = worked_example(store)
    rc, out, _ = run(store, capsys, "du", "a")
    assert rc == 0
    table = out.split("total:")[0]
    assert " a" in table and "shares" in table and "with pin p" in table and "pin " not in table.split("shares")[0]
    rc, out, _ = run(store, capsys, "du", "a", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["name"] for r in rows] == ["a"]
    assert rows[0]["shared_bytes"] == 10_000 and rows[0]["exclusive_bytes"] == 3_000 + s["va2"]
    assert rows[0]["shared_with"] == [{"name": "p", "kind": "pin", "objects": 1, "stored_bytes": 10_000}]
    rc, out, _ = run(store, capsys, "du", "--shared", "--json")
    rows = json.loads(out)
    assert {r["name"]: [x["name"] for x in r["shared_with"]] for r in rows} == {"a": ["p"], "p": ["a"]}
    rc, out, _ = run(store, capsys, "du")
    assert rc == 0 and "shares" not in out  # plain du stays one line per name
    rc, out, err = run(store, capsys, "du", "nope")
    assert rc != 0 and "nope" in err and "Traceback" not in err
    rc, out, _ = run(store, capsys, "stats", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["dedupe_savings"] == 10_000 + len(TEXT) and doc["history"]["versions"] == 1
    assert doc["live"]["logical_bytes"] == 23_000 + 2 * len(TEXT)
    # issue 17: stats --json says what the filesystem does with locks (casstore doctor's probe)
    assert doc["filesystem"]["lock_mode"] in ("flock", "posix", "lease") and doc["filesystem"]["flock"]
    rc, out, _ = run(store, capsys, "stats")
    assert "locks: " in out
    assert rc == 0 and "live names" in out and "history" in out and "dedupe savings" in out


def test_a_missing_object_counts_in_logical_not_stored(store: casstore.Store) -> None:
    gone = store.put(os.urandom(2_000))
    kept = store.put(os.urandom(1_000))
    with store.edit("a") as m:
        m["gone"] = gone
        m["kept"] = kept
    os.remove(store.path(gone))
    u = store.usage()
    assert u.live_missing == 1 and u.live_objects == 2
    assert u.live_logical_bytes == u.live_unique_bytes == 3_000  # the size the entry records
    assert u.live_stored_bytes == 1_000 and u.by_name[0].missing == 1


def test_a_pin_whose_version_is_corrupt_is_said_not_silently_unreferenced(
        store: casstore.Store, caplog: pytest.LogCaptureFixture) -> None:
    """Found by a bug hunt: du showed the pin with 0 entries and its data as "unreferenced (see `casstore gc`)"
    without a word; gc (rightly) refuses, so the listing must say why."""
    with store.edit("paper") as m:
        m["w"] = store.put(os.urandom(100_000))
    v = store.freeze("paper")
    p = store.path(v)
    os.chmod(p, 0o644)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        u = store.usage()
    assert [n.entries for n in u.by_name] == [0]  # counted as it is ...
    said = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(said) == 1 and "pin 'paper'" in said[0] and "casstore verify" in said[0]  # ... and said, once


def test_a_tree_shaped_heads_nodes_are_live_not_history(store: casstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live version's tree nodes (bundles) are its manifest: not "only history keeps" (they were, all of
    them, once nodes moved into bundles), and counted in ``live_manifest_bytes``."""
    from casstore.manifests import model

    monkeypatch.setattr(model, "TREE_THRESHOLD", 16)
    ds = [store.put(os.urandom(100 + i)) for i in range(300)]
    with store.edit("t") as m:
        for i, dd in enumerate(ds):
            m[f"k{i:04d}"] = dd
    v1 = store.manifest("t")
    new = store.put(b"new content")
    with store.edit("t") as m:
        m["k0007"] = new
    v2 = store.manifest("t")
    nodes1 = {h for k, h, _s in model.walk_tree(v1.entries, {}) if not k}
    nodes2 = {h for k, h, _s in model.walk_tree(v2.entries, {}) if not k}
    assert nodes1 & nodes2  # the head shares the first version's bundle
    u = store.usage()
    history = {v1.digest.hex, ds[7].hex} | (nodes1 - nodes2)
    assert u.history_objects == len(history)
    assert u.history_stored_bytes == sum(store.stat(Digest(h)).stored_size for h in history)
    assert u.live_manifest_bytes == sum(store.stat(Digest(h)).stored_size for h in nodes2 | {v2.digest.hex})
