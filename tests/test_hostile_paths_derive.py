"""derive never writes outside its work directory (issue 11, class 1), whatever its inputs or work dir hold.

Attack style: the hostile state is built by hand -- manifest bytes packed with
msgpack and stored with ``store.put``, a head file written next to them, a
symbolic link planted in the work directory while derive prepares it (through
the ``casstore._faults`` hook, which runs at the exact step) -- and then the
public API is called.  Every refusal is a typed error, ``fn`` never runs, and
nothing appears outside the work directory.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import msgpack
import pytest
from _fetch_helpers import clean_settings_env, tmp_names

import casstore
import casstore._faults
from casstore.digest import Digest
from casstore.errors import InvalidInputError, StoreFormatError
from casstore.manifests import Manifest


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


@pytest.fixture
def points(monkeypatch: pytest.MonkeyPatch) -> Iterator[List[str]]:
    """Fault points reached, in order (derive.materialize is reached only once the work dir exists)."""
    seen: List[str] = []
    monkeypatch.setattr(casstore._faults, "hook", seen.append)
    yield seen


def tree(root: Path) -> List[str]:
    """Every path under ``root`` (links not followed), relative, sorted."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return sorted(out)


def hand_made_manifest(store: casstore.Store, entries: Dict[object, object], name: str = "evil") -> Digest:
    """Pack a manifest version by hand (no casstore encoder), store it, point head ``name`` at it by hand."""
    doc = {"casstore": "manifest", "entries": entries, "meta": {}, "parent": None, "v": 1}
    d = store.put(msgpack.packb(doc, use_bin_type=True, strict_types=False), compress=False)
    head = store.root / "refs" / "heads" / name
    head.parent.mkdir(parents=True, exist_ok=True)
    head.write_text(f"{d}\n")
    return d


def claimed(store: casstore.Store, d: Digest) -> Manifest:
    """A Manifest object that names version ``d`` but holds harmless entries (it came from elsewhere).

    derive must read ``d`` itself through the decoder, not trust the object it was handed.
    """
    benign = store.put(b"benign")
    with store.edit("benign-two") as ed:
        ed["a"] = casstore.Entry(benign)
        ed["b"] = casstore.Entry(benign)
    m = store.manifest("benign-two")
    return Manifest(d, m.doc)


def never(inputs: Dict[str, Path], out: Path) -> None:
    raise AssertionError("fn must not run")


BAD_KEYS = ["../escape.txt", "../../../../../../tmp/escape.txt", "/abs/escape.txt", "a/../../escape.txt",
            "a//b", "./a", "a/./b", "a/", "", "nul\x00byte", "back\\slash", "new\nline"]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_hostile_manifest_input_is_refused_before_anything_is_created(
        store: casstore.Store, tmp_path: Path, points: List[str], bad: str) -> None:
    payload = store.put(b"payload")
    d = hand_made_manifest(store, {"fine.txt": [payload.raw, 7], bad: [payload.raw, 7]})
    escaped = Path("/tmp/escape.txt")
    existed = escaped.exists()
    # Every reader refuses it ...
    with pytest.raises(StoreFormatError):
        store.manifest("evil")
    # ... and so does derive, handed an object that claims to be that version.
    with pytest.raises(StoreFormatError, match="key"):
        store.derive("out", inputs={"data": claimed(store, d)}, fn=never)
    assert "derive.materialize" not in points  # refused before the work directory was made
    assert not any("escape" in p for p in tree(tmp_path))
    assert existed or not escaped.exists()
    assert tmp_names(store.root) == []
    assert "out" not in store.heads()


@pytest.mark.parametrize("key", [3, b"bytes-key"])
def test_non_string_keys_are_refused(store: casstore.Store, points: List[str], key: object) -> None:
    payload = store.put(b"payload")
    d = hand_made_manifest(store, {"fine.txt": [payload.raw, 7], key: [payload.raw, 7]})
    with pytest.raises(StoreFormatError):
        store.derive("out", inputs={"data": claimed(store, d)}, fn=never)
    assert "derive.materialize" not in points and tmp_names(store.root) == []


def test_key_that_is_both_file_and_directory(store: casstore.Store, tmp_path: Path) -> None:
    """'a' and 'a/b' are each valid keys, but not together: refused where the path is made, nothing followed."""
    payload = store.put(b"payload")
    d = hand_made_manifest(store, {"a": [payload.raw, 7], "a/b": [payload.raw, 7]})
    with pytest.raises(StoreFormatError):
        store.derive("out", inputs={"data": claimed(store, d)}, fn=never)
    assert tmp_names(store.root) == [] and "out" not in store.heads()


# -- links planted in the work directory -----------------------------------------------------------------


def plant(store: casstore.Store, make: Callable[[Path], None]) -> Callable[[str], None]:
    """A fault hook that runs ``make(work_dir)`` when derive reaches the materialize step."""

    def hook(point: str) -> None:
        if point == "derive.materialize":
            (work,) = [p for p in (store.root / "tmp").iterdir() if p.name.endswith(".derive")]
            assert stat.S_IMODE(work.stat().st_mode) == 0o700  # nobody else can plant anything in it
            make(work)

    return hook


@pytest.fixture
def two_files(store: casstore.Store) -> Manifest:
    with store.edit("two") as ed:
        ed["x/one.txt"] = casstore.Entry(store.put(b"one"))
        ed["two.txt"] = casstore.Entry(store.put(b"two"))
    return store.manifest("two")


@pytest.mark.parametrize("where", ["in/data", "in/data/x", "in/data/two.txt"])
def test_planted_symlink_is_never_followed(store: casstore.Store, tmp_path: Path, two_files: Manifest,
                                           monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"do not touch")

    def make(work: Path) -> None:
        link = work / where
        link.parent.mkdir(parents=True, exist_ok=True)
        target = outside / "keep.txt" if where.endswith(".txt") else outside
        link.symlink_to(target)

    monkeypatch.setattr(casstore._faults, "hook", plant(store, make))
    with pytest.raises(StoreFormatError, match="nothing was followed"):
        store.derive("out", inputs={"data": two_files}, fn=never)
    assert tree(outside) == ["keep.txt"] and (outside / "keep.txt").read_bytes() == b"do not touch"
    assert tmp_names(store.root) == [] and "out" not in store.heads()
    # Without the planted link the same derive works, and lays out both files.
    monkeypatch.setattr(casstore._faults, "hook", None)
    seen: List[str] = []

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        seen.extend(tree(inputs["data"]))

    store.derive("out", inputs={"data": two_files}, fn=fn)
    assert seen == ["two.txt", "x", "x/one.txt"]


# -- hostile outputs ---------------------------------------------------------------------------------------


def test_fifo_output_is_refused_without_hanging(store: casstore.Store) -> None:
    src = store.put(b"s")

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        os.mkfifo(out / "pipe")

    t0 = time.monotonic()
    with pytest.raises(InvalidInputError, match="pipe"):
        store.derive("fifo", inputs={"src": src}, fn=fn)
    assert time.monotonic() - t0 < 5
    assert "fifo" not in store.heads() and tmp_names(store.root) == []


def test_symlinked_output_directory_is_refused(store: casstore.Store, tmp_path: Path) -> None:
    src = store.put(b"s")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "id_rsa").write_bytes(b"PRIVATE")

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        (out / "dir").symlink_to(secret)

    with pytest.raises(InvalidInputError, match="dir"):
        store.derive("linkdir", inputs={"src": src}, fn=fn)
    assert "linkdir" not in store.heads()
    assert casstore.Digest.of(b"PRIVATE") not in store  # the link was not read through


@pytest.mark.parametrize("fname", ["back\\slash", "new\nline", "esc\x1b[2J"])
def test_output_names_that_are_not_keys(store: casstore.Store, fname: str) -> None:
    src = store.put(b"s")

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        (out / fname).write_bytes(b"x")

    with pytest.raises(InvalidInputError, match="output path"):
        store.derive("names", inputs={"src": src}, fn=fn)
    assert "names" not in store.heads() and tmp_names(store.root) == []
