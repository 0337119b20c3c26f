"""Hostile input, class 10: wrong types and values at the public API.

Every public function turns wrong types and values into a ``CasstoreError``
subclass that also inherits the matching builtin (``InvalidTypeError`` is a
``TypeError``, ``InvalidInputError`` a ``ValueError`` ...), at the call that
introduced them, and stores nothing.  The CLI side is in tests/test_cli.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, List, Tuple, Type

import numpy as np
import pytest

import casstore
from casstore.errors import CasstoreError, InvalidDigestError, InvalidInputError, InvalidTypeError

D = "blake3:" + "ab" * 32

BAD_CALLS: List[Tuple[str, Callable[[casstore.Store], object], Type[Exception]]] = [
    ("open(123)", lambda s: casstore.open(123), InvalidTypeError),  # type: ignore[arg-type]
    ("open(b'path')", lambda s: casstore.open(b"/tmp/x"), InvalidTypeError),  # type: ignore[arg-type]
    ("put(str)", lambda s: s.put("text"), InvalidTypeError),  # type: ignore[arg-type]
    ("put(None)", lambda s: s.put(None), InvalidTypeError),  # type: ignore[arg-type]
    ("put(compress=99)", lambda s: s.put(b"x" * 1000, compress=99), InvalidInputError),
    ("put(compress='lz4')", lambda s: s.put(b"x" * 1000, compress="lz4"), InvalidInputError),
    ("put_path(None)", lambda s: s.put_path(None), InvalidTypeError),  # type: ignore[arg-type]
    ("put_path(123)", lambda s: s.put_path(123), InvalidTypeError),  # type: ignore[arg-type]
    ("put_stream(b'')", lambda s: s.put_stream(b"bytes"), InvalidTypeError),  # type: ignore[arg-type]
    ("get(123)", lambda s: s.get(123), InvalidTypeError),  # type: ignore[arg-type]
    ("get(None)", lambda s: s.get(None), InvalidTypeError),  # type: ignore[arg-type]
    ("get('nope')", lambda s: s.get("nope"), InvalidDigestError),
    ("stat(1.5)", lambda s: s.stat(1.5), InvalidTypeError),  # type: ignore[arg-type]
    ("resolve('zz')", lambda s: s.resolve("zz"), InvalidDigestError),
    ("edit(123)", lambda s: s.edit(123).__enter__(), InvalidTypeError),  # type: ignore[arg-type]
    ("manifest(None)", lambda s: s.manifest(None), InvalidTypeError),  # type: ignore[arg-type]
    ("history(limit='3')", lambda s: s.history("exp", limit="3"), InvalidTypeError),  # type: ignore[arg-type]
    ("history(limit=-1)", lambda s: s.history("exp", limit=-1), InvalidInputError),
    ("pin(name=5)", lambda s: s.pin(5, D), InvalidTypeError),  # type: ignore[arg-type]
    ("checkout(outdir=5)", lambda s: s.checkout("exp", 5), InvalidTypeError),  # type: ignore[arg-type]
    ("limit(inf)", lambda s: s.limit(math.inf), InvalidInputError),  # type: ignore[arg-type]
    ("limit(-1)", lambda s: s.limit(-1), InvalidInputError),
    ("limit('lots')", lambda s: s.limit("lots"), InvalidInputError),
    ("plan_gc(keep_history=-1)", lambda s: s.plan_gc(keep_history=-1), InvalidInputError),
    ("plan_gc(keep_history='5')", lambda s: s.plan_gc(keep_history="5"), InvalidTypeError),  # type: ignore[arg-type]
    ("plan_gc(grace='soon')", lambda s: s.plan_gc(grace="soon"), InvalidInputError),
    ("verify(workers=0)", lambda s: s.verify(workers=0), InvalidInputError),
    ("fetch(sha256=5)", lambda s: s.fetch("https://example.invalid/x", sha256=5), InvalidTypeError),  # type: ignore[arg-type]
    ("fetch('not a url')", lambda s: s.fetch("not a url"), InvalidInputError),
    ("fetch(timeout='10')", lambda s: s.fetch("https://example.invalid/x", timeout="10"),  # type: ignore[arg-type]
     InvalidTypeError),
    ("put_array(list)", lambda s: s.put_array([1, 2, 3]), InvalidTypeError),  # type: ignore[arg-type]
    ("put_array(object dtype)", lambda s: s.put_array(np.array([object()])), InvalidTypeError),
    ("IndexCache(length=True)", lambda s: casstore.IndexCache(s, length=True), InvalidTypeError),
    ("IndexCache(length=-1)", lambda s: casstore.IndexCache(s, length=-1), InvalidInputError),
]


@pytest.mark.parametrize("what,call,expected", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_a_typed_error_that_is_also_the_builtin(what: str, call: Callable[[casstore.Store], object],
                                                              expected: Type[Exception], store: casstore.Store) -> None:
    with store.edit("exp") as m:
        m["k"] = store.put(b"existing")
    before = sorted(os.listdir(store.root / "objects"))
    with pytest.raises(expected) as ei:
        call(store)
    e = ei.value
    assert isinstance(e, CasstoreError), f"{what}: {type(e).__name__} is not a CasstoreError"
    builtin = TypeError if issubclass(expected, TypeError) else ValueError
    assert isinstance(e, builtin)
    assert sorted(os.listdir(store.root / "objects")) == before  # nothing stored


def test_bool_is_not_an_index(store: casstore.Store) -> None:
    cache = casstore.IndexCache(store, length=4)
    cache.put(1, b"one")
    for c in (cache, None):
        if c is None:  # the same on a frozen cache (its own fast read path)
            cache.freeze()
        with pytest.raises(InvalidTypeError):
            cache.get(True)  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError):
            cache.get(False)  # type: ignore[arg-type]
        assert True not in cache
    with pytest.raises(InvalidTypeError):
        casstore.IndexCache(store, length=4).put(True, b"x")  # type: ignore[arg-type]


def test_non_contiguous_memoryview_is_copied_not_refused(store: casstore.Store) -> None:
    base = bytes(range(256)) * 100
    strided = memoryview(base)[::3]
    d = store.put(strided)
    assert store.get(d) == bytes(strided)
    arr = np.arange(1000, dtype=np.float64)[::2]
    assert not arr.flags.c_contiguous
    d2 = store.put(memoryview(arr))
    assert store.get(d2) == arr.tobytes()


def test_path_like_objects_are_accepted(store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "f.bin"
    src.write_bytes(b"data")
    assert store.get(store.put_path(src)) == b"data"
    assert casstore.open(tmp_path / "other").root == tmp_path / "other"
