"""The maintenance CLI: gc (dry run by default), verify, du, stats, init --shared; --json for scripts."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

import casstore
from casstore.cli import main


@pytest.fixture
def cli_store(store: casstore.Store) -> casstore.Store:
    for i in range(3):
        with store.edit("exp") as m:
            m["data"] = store.put(b"version %d " % i * 100)
    with store.edit("paper") as m:
        m["w"] = store.put(os.urandom(4000))
    store.freeze("paper")
    t = time.time() - 7200
    for i in range(4):
        d = store.put(b"junk %d" % i * 50)
        os.utime(store.path(d), (t, t))
    return store


def run(store: casstore.Store, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["--store", str(store.root), *argv])
    return rc, capsys.readouterr().out


def n_objects(store: casstore.Store) -> int:
    return sum(1 for _ in store.iter_objects())


def test_gc_is_a_dry_run_unless_yes(cli_store: casstore.Store, capsys: pytest.CaptureFixture[str]) -> None:
    before = n_objects(cli_store)
    rc, out = run(cli_store, capsys, "gc")
    assert rc == 0 and "4 objects" in out and "dry run" in out and "--yes" in out
    assert n_objects(cli_store) == before
    rc, out = run(cli_store, capsys, "gc", "--json", "--verbose")
    doc = json.loads(out)
    assert doc["dry_run"] and doc["objects"] == 4 and len(doc["delete"]) == 4 and doc["freed_bytes"] > 0
    assert any("pin 'paper'" in why for why in doc["kept"].values())
    rc, out = run(cli_store, capsys, "gc", "--yes", "--keep-history", "0", "--grace", "0")
    assert rc == 0 and "deleted 8 objects" in out  # 4 junk + 2 expired versions of exp + their data
    assert "2 expired manifest versions" in out
    assert n_objects(cli_store) == before - 8
    assert cli_store.verify().ok
    rc, out = run(cli_store, capsys, "gc", "--yes", "--keep-history", "0", "--grace", "0")
    assert rc == 0 and out.rstrip().endswith("nothing to delete")  # not a "would be deleted" line alone


def test_gc_max_size_says_when_the_limit_cannot_be_met(cli_store: casstore.Store,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(cli_store, capsys, "gc", "--max-size", "1K", "--yes", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["met"] is False and "cannot be met" in doc["message"]
    assert cli_store.manifest("paper") and cli_store.verify().ok
    rc, out = run(cli_store, capsys, "gc", "--max-size", "1G")
    assert rc == 0 and "met" in out


def test_verify_du_stats(cli_store: casstore.Store, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(cli_store, capsys, "verify")
    assert rc == 0 and "healthy" in out
    rc, out = run(cli_store, capsys, "verify", "--fast", "--json")
    assert rc == 0 and json.loads(out)["fast"] is True
    rc, out = run(cli_store, capsys, "du", "--by", "pin")
    assert rc == 0 and "paper" in out and "exp" not in out.split("total:")[0]
    rc, out = run(cli_store, capsys, "du", "--json")
    names = {r["name"]: r for r in json.loads(out)}
    assert names["paper"]["kind"] == "pin" and names["exp"]["kind"] == "head"
    assert names["paper"]["logical_bytes"] == 4000
    rc, out = run(cli_store, capsys, "stats", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["objects"] == n_objects(cli_store) and doc["unreferenced_objects"] == 4
    rc, out = run(cli_store, capsys, "stats")
    assert "compression" in out and "dedupe savings" in out


def test_init_shared(world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = world_dir / "team"
    rc = main(["init", str(root), "--shared"])
    assert rc == 0
    s = casstore.open(root, create=False)
    assert s.config.shared
    for d in (root, root / "objects" / "7f", root / "tmp", root / "locks"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o2775, d


def test_gc_max_size_evicts_least_recently_used_junk(cli_store: casstore.Store,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = n_objects(cli_store)
    total = cli_store.usage().stored_bytes
    rc, out = run(cli_store, capsys, "gc", "--max-size", str(total - 1), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["met"] and doc["dry_run"] and 1 <= doc["objects"] <= 4
    assert n_objects(cli_store) == before  # a plan only
    rc, out = run(cli_store, capsys, "gc", "--max-size", str(total - 1), "--yes")
    assert rc == 0 and "deleted" in out
    assert before - 4 <= n_objects(cli_store) < before
    assert cli_store.manifest("paper") and cli_store.verify().ok


def test_maintenance_option_values_are_checked_by_the_parser(cli_store: casstore.Store,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["gc", "--keep-history", "-1"], ["gc", "--keep-history", "x"], ["gc", "--timeout", "-2"],
                 ["gc", "--dry-run", "--yes"], ["du", "--by", "everything"]):
        with pytest.raises(SystemExit) as ei:
            run(cli_store, capsys, *argv)
        assert ei.value.code == 2
        assert "usage: casstore" in capsys.readouterr().err
    assert main(["--store", str(cli_store.root), "gc", "--grace", "whenever"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("casstore: error: invalid grace") and err.rstrip().endswith("[InvalidInputError]")


def test_gc_shows_provenance_warnings_and_keeps_inputs(store: casstore.Store,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    raw = store.put(b"raw input")
    with store.edit("proc") as m:
        m["out"] = store.put(b"out")
        m.meta["casstore.inputs"] = {"raw": str(raw), "bad": "blake3:nope\x1b[2J"}
    store.freeze("proc")
    rc, out = run(store, capsys, "gc", "--yes", "--grace", "0s", "--keep-history", "0")
    assert rc == 0 and "warning: pinned 'proc': provenance input 'bad' is malformed" in out
    assert "\x1b" not in out and raw in store
    rc, out = run(store, capsys, "gc", "--json", "--grace", "0s")
    doc = json.loads(out)
    assert len(doc["warnings"]) == 1 and "nothing extra is kept" in doc["warnings"][0]


def test_gc_why_names_the_reason(store: casstore.Store, capsys: pytest.CaptureFixture[str]) -> None:
    raw = store.put(b"raw input for why")
    with store.edit("proc") as m:
        m["out"] = store.put(b"out")
        m.meta["casstore.inputs"] = {"raw": str(raw)}
    store.freeze("proc")
    rc, out = run(store, capsys, "gc", "--grace", "0s", "--why", str(raw)[:20])
    assert rc == 0 and f"{raw}  kept: input 'raw' of pinned 'proc' (derive provenance)" in out
    rc, out = run(store, capsys, "gc", "--json", "--grace", "0s", "--why", str(raw))
    assert json.loads(out)["why"] == {str(raw): "kept: input 'raw' of pinned 'proc' (derive provenance)"}
