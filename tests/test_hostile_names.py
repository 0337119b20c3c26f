"""Hostile names, keys and metadata (issue 11, class 7).

Names and keys with lone surrogates, control characters, thousands of
segments or thousands of bytes, and metadata that is cyclic, 10,000 levels
deep or holds values msgpack cannot carry, must give a typed error
(:class:`InvalidInputError` / :class:`InvalidTypeError`, which are also
``ValueError`` / ``TypeError``) at the call that introduced them -- never a
``RecursionError``, a ``UnicodeEncodeError`` from deep inside msgpack, or a
half-made ref or lock file.  And odd files planted by hand under ``refs/``
(names no casstore call could create, FIFOs, links, damaged contents,
directory trees deeper than PATH_MAX) never break listing or reading the
other names, in the API or the CLI.
"""

from __future__ import annotations

import decimal
import math
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
from _manifest_helpers import raw_manifest_bytes

import casstore
from casstore import (
    CasstoreError,
    Digest,
    Entry,
    InvalidInputError,
    InvalidTypeError,
    StoreFormatError,
)
from casstore.manifests import canonical_meta, encode_manifest

BAD_TEXT: Dict[str, str] = {
    "lone-surrogate": "exp-\udcff",
    "lone-high-surrogate": "\ud800x",
    "newline": "a\nb",
    "tab": "a\tb",
    "escape-sequence": "\x1b[31mred",
    "del": "a\x7f",
    "c1-control": "a\x85b",
    "nul": "a\x00",
    "300-segments": "a/" * 300 + "b",
    "3000-segments": "a/" * 3000 + "b",
    "very-long": "n" * 5000,
    "long-multibyte": "é" * 2049,
    "long-segment": "ok/" + "s" * 256,
}


def _files(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    s = casstore.open(tmp_path / "store")
    with s.edit("good") as m:
        m["k"] = s.put(b"payload")
    return s


@pytest.mark.parametrize("what", sorted(BAD_TEXT))
def test_bad_names_are_refused_by_every_call_before_anything_is_created(store: casstore.Store, tmp_path: Path,
                                                                       what: str) -> None:
    name = BAD_TEXT[what]
    good = store.heads()["good"]
    before = _files(store.root)
    calls: Dict[str, Callable[[], Any]] = {
        "edit": lambda: store.edit(name).__enter__(),
        "pin": lambda: store.pin(name, good),
        "freeze": lambda: store.freeze(name),
        "unpin": lambda: store.unpin(name),
        "manifest": lambda: store.manifest(name),
        "history": lambda: store.history(name),
        "diff": lambda: store.diff(name, "good"),
        "checkout": lambda: store.checkout(name, tmp_path / "out"),
        "pin-target": lambda: store.pin("p", name),
    }
    for call, fn in calls.items():
        with pytest.raises(InvalidInputError) as ei:
            fn()
        assert isinstance(ei.value, ValueError), call
        assert "invalid name" in str(ei.value), (call, str(ei.value))
        assert len(str(ei.value)) < 1000  # the name is shortened in the message
    assert _files(store.root) == before  # no ref, no lock file, nothing
    assert store.heads() == {"good": good} and store.pins() == {}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", [123, None, b"exp", ["exp"], 1.5], ids=repr)
def test_names_of_the_wrong_type_are_type_errors(store: casstore.Store, name: Any) -> None:
    good = store.heads()["good"]
    for fn in (lambda: store.edit(name), lambda: store.pin(name, good), lambda: store.freeze(name),
               lambda: store.unpin(name), lambda: store.manifest(name), lambda: store.history(name)):
        with pytest.raises(InvalidTypeError) as ei:
            fn()
        assert isinstance(ei.value, TypeError)


@pytest.mark.parametrize("what", sorted(BAD_TEXT))
def test_bad_keys_are_refused_when_set(store: casstore.Store, what: str) -> None:
    key = BAD_TEXT[what]
    d = store.put(b"payload")
    before = store.heads()["good"]
    with pytest.raises(InvalidInputError, match="invalid key"):
        with store.edit("good") as m:
            m["fine"] = d
            m[key] = d  # refused here, at the call that introduced it
    assert store.heads()["good"] == before
    with pytest.raises(InvalidInputError, match="invalid key"):
        encode_manifest({key: Entry(d, 7)}, {}, None)
    with store.edit("good", timeout=0) as m:  # the lock was released
        m["fine"] = d
    assert sorted(store.manifest("good")) == ["fine", "k"]


# -- metadata ----------------------------------------------------------------------------------------


def _nested(levels: int, kind: str) -> Any:
    v: Any = "leaf"
    for _ in range(levels):
        v = {"x": v} if kind == "dict" else [v]
    return v


def _cyclic_dict() -> Any:
    d: Dict[str, Any] = {"a": 1}
    d["self"] = d
    return d


def _cyclic_list() -> Any:
    x: List[Any] = [1]
    x.append(x)
    return x


def _cyclic_indirect() -> Any:
    a: Dict[str, Any] = {}
    b = [1, {"c": a}]
    a["b"] = b
    return {"top": a}


class _Obj:
    pass


BAD_META: Dict[str, Callable[[], Any]] = {
    "cyclic-dict": _cyclic_dict,
    "cyclic-list": _cyclic_list,
    "cyclic-indirect": _cyclic_indirect,
    "10000-deep-dicts": lambda: _nested(10_000, "dict"),
    "10000-deep-lists": lambda: _nested(10_000, "list"),
    "65-deep": lambda: _nested(65, "list"),
    "set": lambda: {1, 2},
    "frozenset": lambda: frozenset({1}),
    "object": _Obj,
    "complex": lambda: 1 + 2j,
    "decimal": lambda: decimal.Decimal("1.5"),
    "datetime": lambda: datetime(2024, 1, 1),
    "bytearray": lambda: bytearray(b"x"),
    "memoryview": lambda: memoryview(b"x"),
    "int-key": lambda: {1: "x"},
    "tuple-key": lambda: {("a",): "x"},
    "too-big-int": lambda: 2**64,
    "too-small-int": lambda: -(2**63) - 1,
    "lone-surrogate-value": lambda: "bad \udcff text",
    "lone-surrogate-key": lambda: {"\udcff": 1},
    "nested-object": lambda: {"a": [1, {"b": _Obj()}]},
}


@pytest.mark.parametrize("what", sorted(BAD_META))
def test_bad_metadata_is_a_typed_error_where_it_is_introduced(store: casstore.Store, what: str) -> None:
    d = store.put(b"payload")
    before = store.heads()["good"]
    n_objects = len(list(store.iter_objects()))
    # In an entry: refused when the Entry is made.
    with pytest.raises(InvalidInputError):
        Entry(d, meta={"bad": BAD_META[what]()})
    # In the manifest's metadata (a plain dict the caller fills): refused at commit, before anything is written.
    with pytest.raises(InvalidInputError) as ei:
        with store.edit("good") as m:
            m["new"] = d
            m.meta["bad"] = BAD_META[what]()
    assert isinstance(ei.value, ValueError) and len(str(ei.value)) < 1000
    if what.startswith("cyclic"):
        assert "contains itself" in str(ei.value)  # named as a cycle, not as "too deep"
    assert store.heads()["good"] == before and len(list(store.iter_objects())) == n_objects
    with pytest.raises(InvalidInputError):
        canonical_meta(BAD_META[what]())
    with pytest.raises(InvalidInputError):
        encode_manifest({}, {"bad": BAD_META[what]()}, None)
    with store.edit("good", timeout=0) as m:  # the lock was released
        m.meta["fine"] = 1
    assert store.manifest("good").meta["fine"] == 1


def test_deep_metadata_never_recurses_into_a_recursion_error(store: casstore.Store) -> None:
    """Even called deep inside the caller's own recursion (close to the interpreter's limit)."""
    deep = _nested(100_000, "dict")
    limit = sys.getrecursionlimit()

    def at_depth(n: int) -> None:
        if n:
            return at_depth(n - 1)
        with pytest.raises(InvalidInputError):
            canonical_meta(deep)

    at_depth(limit - 200)


def test_floats_are_carried_exactly_nan_and_infinities_included(store: casstore.Store) -> None:
    d = store.put(b"payload")
    with store.edit("good") as m:
        m["f"] = Entry(d, meta={"nan": math.nan, "inf": math.inf})
        m.meta["nan"] = math.nan
        m.meta["ninf"] = -math.inf
        m.meta["tiny"] = 5e-324
    man = store.manifest("good")
    assert math.isnan(man.meta["nan"]) and man.meta["ninf"] == -math.inf and man.meta["tiny"] == 5e-324
    assert math.isnan(man["f"].meta["nan"]) and man["f"].meta["inf"] == math.inf
    # NaN != NaN in Python, but an edit that changes nothing still writes no version.
    with store.edit("good") as m:
        m.meta["nan"] = math.nan
    assert store.heads()["good"] == man.digest


def test_subclasses_of_plain_types_are_stored_as_their_base_type(store: casstore.Store) -> None:
    import enum

    class Color(enum.IntEnum):
        RED = 1

    class Text(str):
        def __str__(self) -> str:
            return "lies"

    with store.edit("good") as m:
        m.meta["c"] = Color.RED
        m.meta["t"] = Text("truth")
        m.meta["tup"] = (1, (2, 3))
    meta = store.manifest("good").meta
    assert type(meta["c"]) is int and meta["c"] == 1
    assert type(meta["t"]) is str and meta["t"] == "truth"
    assert meta["tup"] == [1, [2, 3]]


def test_a_stored_version_with_too_deep_metadata_is_refused(store: casstore.Store) -> None:
    d = store.put(raw_manifest_bytes({}, {"x": _nested(200, "list")}))
    with pytest.raises(StoreFormatError, match="deep"):
        store.pin("deep", d, allow_missing=True)
    assert store.pins() == {}


# -- odd files planted under refs/ ---------------------------------------------------------------------


def _plant_deep(base: Path, text: bytes, levels: int = 2100) -> None:
    """A directory tree deeper than PATH_MAX under ``base``, a ref file at its bottom (made through directory fds)."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(levels):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    wfd = os.open("deep-ref", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(wfd, text)
    os.close(wfd)
    os.close(fd)


def _remove_deep(top: Path) -> None:
    """Remove a tree of any depth without recursion (shutil.rmtree, and so pytest's cleanup, recurse per level)."""
    stack = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    names: List[str] = [""]
    while stack:
        fd = stack[-1]
        child = None
        for e in os.scandir(fd):
            if e.is_dir(follow_symlinks=False):
                child = e.name
                break
            os.unlink(e.name, dir_fd=fd)
        if child is not None:
            stack.append(os.open(child, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd))
            names.append(child)
            continue
        os.close(stack.pop())
        name = names.pop()
        if stack:
            os.rmdir(name, dir_fd=stack[-1])
    os.rmdir(top)


def _plant(root: Path, d: Digest, outside: Path) -> List[str]:
    """Plant odd ref files (as any member of a shared store could); returns names they would have."""
    heads = root / "refs" / "heads"
    pins = root / "refs" / "pins"
    text = f"{d}\n".encode()
    for base in (heads, pins):
        (base / "odd").mkdir(parents=True, exist_ok=True)
        for name in ("bad:colon", "a\nb", "esc\x1b[2J", "odd/damaged", "odd/empty"):
            (base / name).write_bytes(b"garbage" if "damaged" in name else b"" if "empty" in name else text)
        fd = os.open(os.fsencode(base) + b"/\xff\xfe-not-utf8", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, text)
        os.close(fd)
        os.mkfifo(base / "fifo")
        (outside / "ref").write_bytes(text)
        os.symlink(outside / "ref", base / "link")
        os.symlink(outside, base / "linkdir")
        _plant_deep(base, text, levels=300)  # deeper than any valid name, within PATH_MAX
    return ["bad:colon", "a\nb", "esc\x1b[2J", "\udcff\udcfe-not-utf8", "d/" * 300 + "deep-ref"]


def test_odd_ref_files_never_break_listing_or_the_other_names(store: casstore.Store, tmp_path: Path) -> None:
    d = store.put(b"other")
    with store.edit("team/exp") as m:
        m["k"] = d
    good = store.heads()
    store.pin("release", good["good"])
    outside = tmp_path / "outside"
    outside.mkdir()
    unnamable = _plant(store.root, good["good"], outside)

    # Only the real names: never a FIFO, a link, a damaged file, or a name no casstore call could make.
    assert store.heads() == good
    assert store.pins() == {"release": good["good"]}
    for name in unnamable:
        with pytest.raises(CasstoreError):
            store.manifest(name)
    # The other names work as usual.
    assert [v.digest for v in store.history("good")] == [good["good"]]
    assert store.manifest("team/exp")["k"].digest == d
    with store.edit("team/exp") as m:
        m["k2"] = d
    assert store.freeze("team/exp") == store.pins()["team/exp"]
    assert store.pin("another", "release") == good["good"]
    store.checkout("good", tmp_path / "out")
    assert (tmp_path / "out" / "k").read_bytes() == b"payload"
    assert (outside / "ref").read_bytes() == f"{good['good']}\n".encode()  # never written through the link
    # The CLI lists them too, in one piece.
    for args in (["pins"], ["pins", "--heads"], ["log", "good"]):
        r = subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store.root), *args],
                           capture_output=True, timeout=120)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, (args, r.stderr)


def test_a_ref_tree_deeper_than_path_max_never_breaks_listing(store: casstore.Store) -> None:
    good = store.heads()
    _plant_deep(store.root / "refs" / "heads", f"{good['good']}\n".encode())
    try:
        assert store.heads() == good
    finally:
        _remove_deep(store.root / "refs" / "heads" / "d")


def test_a_name_cannot_be_the_folder_of_a_name_of_the_other_kind(store: casstore.Store) -> None:
    """Found by a bug hunt: head 'team' and pin 'team/best' could both be made (two ref trees), and then
    `freeze team` failed for good ("is a prefix of other names; choose another")."""
    from casstore.errors import InvalidInputError

    with store.edit("team") as m:
        m["a"] = store.put(b"1")
    with pytest.raises(InvalidInputError, match="clashes with the head 'team'"):
        store.pin("team/best", "team")
    with store.edit("rel") as m:
        m["a"] = store.put(b"1")
    store.freeze("rel")
    with pytest.raises(InvalidInputError, match="clashes with the pin 'rel'"):
        with store.edit("rel/wip") as m:
            m["a"] = store.put(b"2")
    with store.edit("deep/x") as m:
        m["a"] = store.put(b"3")
    with pytest.raises(InvalidInputError, match=r"clashes with the head 'deep/\.\.\.'"):
        store.pin("deep", "team")
    assert store.freeze("team") and store.freeze("deep/x")  # the same name in the other kind is fine
