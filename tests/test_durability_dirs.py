"""New directories on the way to an object or a ref are fsynced in their parents (durable stores)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

import casstore
from casstore import _fs


@pytest.mark.parametrize("durable", [True, False])
def test_new_ref_directories_are_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool) -> None:
    store = casstore.open(tmp_path / "s", durable=durable)
    d = store.put(b"x")
    synced: List[Path] = []
    real = _fs.fsync_dir

    def spy(p: object) -> None:  # instrumentation only: the real fsync still runs
        synced.append(Path(str(p)))
        real(p)  # type: ignore[arg-type]

    monkeypatch.setattr(_fs, "fsync_dir", spy)
    with store.edit("team/exp/run1") as m:
        m["k"] = d
    heads = store.root / "refs" / "heads"
    want = {heads, heads / "team", heads / "team" / "exp"}  # each new directory's entry, and the ref's own
    if durable:
        assert want <= set(synced), synced
    else:
        assert not (want & set(synced)), synced
    assert store.manifest("team/exp/run1")["k"].digest == d
