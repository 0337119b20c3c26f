"""Provenance survives gc, end to end: real fetch (file:// URLs) and real derive, then gc.

The rules and hostile records are in tests/test_provenance.py; this checks the record derive writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
from test_provenance import collect, hexes

import casstore


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "s")


def _gunzip_like(inputs: Dict[str, Path], out: Path) -> None:
    (out / "data.bin").write_bytes(inputs["raw"].read_bytes()[::-1])


def _process(inputs: Dict[str, Path], out: Path) -> None:
    (out / "processed.bin").write_bytes(inputs["data"].read_bytes().upper())


def test_pinned_derive_keeps_its_fetch_after_the_fetch_moves_on(store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "qm9.bin"
    src.write_bytes(b"first download")
    raw = store.fetch(src.as_uri())
    unz = store.derive("qm9/unpacked", inputs={"raw": raw}, fn=_gunzip_like)
    proc = store.derive("qm9/processed", inputs={"data": unz}, fn=_process, params={"cutoff": 5.0})
    store.freeze("qm9/processed")
    # The fetch moves on (new content upstream) and the intermediate step is dropped:
    # only the pin's provenance still names the first download.
    src.write_bytes(b"second download")
    raw2 = store.fetch(src.as_uri(), force=True)
    assert raw2 != raw
    store.refs.remove("heads", "qm9/unpacked")
    plan = collect(store)
    have = hexes(store.root)
    assert {raw.hex, unz.digest.hex, unz["data.bin"].digest.hex, proc.digest.hex} <= have
    assert plan.why(raw) == ("kept: input 'raw' of input 'data' of pinned 'qm9/processed' "
                             "(derive provenance)")
    assert plan.why(unz.digest) == ("kept: manifest version of input 'data' of pinned 'qm9/processed' "
                                    "(derive provenance)")
    assert plan.warnings == ()
    store.unpin("qm9/processed")
    collect(store)
    have = hexes(store.root)
    assert not {raw.hex, unz.digest.hex, unz["data.bin"].digest.hex, proc.digest.hex} & have
    assert raw2.hex in have  # the fetch head's current download


def test_derive_head_keeps_its_current_inputs(store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "raw.bin"
    src.write_bytes(b"one")
    raw = store.fetch(src.as_uri())
    store.derive("proc", inputs={"raw": raw}, fn=_gunzip_like)
    src.write_bytes(b"two")
    store.fetch(src.as_uri(), force=True)
    plan = collect(store)
    assert plan.why(raw) == "kept: input 'raw' of head 'proc' (derive provenance)"
    assert raw.hex in hexes(store.root)


def test_diff_of_two_real_derive_results_shows_params_and_inputs(store: casstore.Store) -> None:
    a, b = store.put(b"input a"), store.put(b"input b")
    r1 = store.derive("proc", inputs={"raw": a}, fn=_gunzip_like, params={"cutoff": 5.0, "mode": "x"})
    r2 = store.derive("proc", inputs={"raw": b}, fn=_gunzip_like, params={"cutoff": 6.0, "mode": "x"})
    d = store.diff(r1, r2)
    assert list(d.changed) == ["data.bin"]
    assert dict(d.params.changed) == {"cutoff": (5.0, 6.0)} and not d.params.added and not d.params.removed
    assert dict(d.inputs.changed) == {"raw": (str(a), str(b))}
    assert "derive" in d.meta.changed and "casstore.inputs" in d.meta.changed


def test_cli_diff_of_two_derive_results_shows_each_change_once(store: casstore.Store,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a bug hunt: a changed input showed as `input ~ x` and again as `meta ~ derive.inputs.x`."""
    from casstore.cli import main

    a, b = store.put(b"input a"), store.put(b"input b")
    store.derive("proc", inputs={"raw": a}, fn=_gunzip_like, params={"cutoff": 5.0})
    store.derive("proc", inputs={"raw": b}, fn=_gunzip_like, params={"cutoff": 6.0})
    assert main(["--store", str(store.root), "diff", "proc~1", "proc"]) == 0
    out = capsys.readouterr().out
    assert out.count("raw") == 1 and out.count("cutoff") == 1, out
