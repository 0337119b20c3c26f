"""Hostile input, class 6: races with eviction.

``stat``, ``open``, ``path``, ``get``, ``get_array`` and ``IndexCache.open`` on
an object that ``limit()`` or gc (or any member of a shared store) removes at
that very moment give :class:`~casstore.ObjectNotFoundError`, never a raw
``FileNotFoundError`` (nor a wrong or partial result).

Three ways to meet the window: the object is removed after a first
successful call (the next call must not rely on anything the first one
left behind); it is removed exactly between locating its file and opening it
(the removal is done by wrapping ``store.objects.locate``, the one step that
finds the file: the removal itself is real); and for real, with ``limit()`` on
a thread and a plain remover in another process evicting and re-putting it
while the reader loops.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

import casstore
from casstore.cache import IndexCache
from casstore.digest import Digest
from casstore.objects import Located

A = np.arange(20_000, dtype=np.float64)
RECORDS = [b"record-%d" % i * 50 for i in range(8)]


def _read_all(store: casstore.Store, d: Digest) -> bytes:
    with store.open(d) as f:
        return f.read()


def _cache_open(store: casstore.Store, d: Digest) -> int:
    c = IndexCache.open(store, d)
    try:
        got = [c.get(i) for i in range(len(RECORDS))]
        assert got == RECORDS
        return len(got)
    finally:
        c.close()


CALLS: Dict[str, Callable[[casstore.Store, Digest], object]] = {
    "stat": lambda s, d: s.stat(d).size,
    "get": lambda s, d: s.get(d),
    "open": _read_all,
    "path": lambda s, d: s.path(d),
    "path-verify": lambda s, d: s.path(d, verify=True),
    "raw_path": lambda s, d: s.raw_path(d),
    "get_array": lambda s, d: s.get_array(d),
    "get_array-mmap": lambda s, d: s.get_array(d, mmap=True),
    "IndexCache.open": _cache_open,
}


def _setup(store: casstore.Store, call: str, compress: bool = False) -> Digest:
    """The object the call reads (unreferenced, so limit/gc may take it)."""
    if call == "IndexCache.open":
        c = IndexCache(store, len(RECORDS))
        for i, r in enumerate(RECORDS):
            c.put(i, r)
        d = c.preserve("c")
        c.close()
        store.unpin("c")
        return d
    return store.put_array(A if not compress else np.zeros(200_000), compress=compress)


def _bytes_of(store: casstore.Store, d: Digest) -> bytes:
    return store.get(d)


@pytest.mark.parametrize("call", list(CALLS))
def test_removed_after_a_first_call(store: casstore.Store, call: str) -> None:
    d = _setup(store, call)
    CALLS[call](store, d)
    assert store.objects.delete(d)
    with pytest.raises(casstore.ObjectNotFoundError):
        CALLS[call](store, d)


# A compressed object has no path, and a cache object is always raw.
WINDOW_CASES = [(call, False) for call in CALLS] + [
    (call, True) for call in CALLS if call not in ("path", "path-verify", "IndexCache.open")]


@pytest.mark.parametrize("call,compress", WINDOW_CASES,
                         ids=[f"{c}-{'zstd' if z else 'raw'}" for c, z in WINDOW_CASES])
def test_removed_between_locate_and_open(store: casstore.Store, call: str, compress: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    d = _setup(store, call, compress)
    real = store.objects.locate
    removed: List[str] = []

    def locate_then_evict(x: Digest) -> Located:
        loc = real(x)
        if x == d and not removed:
            os.unlink(loc.path)  # what gc/limit do, at the worst moment
            removed.append(loc.path)
        return loc

    monkeypatch.setattr(store.objects, "locate", locate_then_evict)
    with pytest.raises(casstore.ObjectNotFoundError):
        CALLS[call](store, d)
    assert removed


# -- for real: a reader loop against limit() on a thread, or a remover process ------------


def _remover(root: str, digest: str, data: bytes, stop: Any, started: Any) -> None:
    store = casstore.open(root)
    d = Digest.parse(digest)
    started.set()
    while not stop.is_set():
        store.objects.delete(d)
        time.sleep(0.0002)
        store.put(data, compress=False)


def _limit_thread(store: casstore.Store, d: Digest, data: bytes, stop: threading.Event,
                  errors: List[BaseException]) -> None:
    try:
        while not stop.is_set():
            store.limit(0, grace=0)
            store.put(data, compress=False)
    except BaseException as e:  # reported by the test
        errors.append(e)


@pytest.mark.slow
@pytest.mark.parametrize("evictor", ["limit-thread", "remover-process"])
@pytest.mark.parametrize("call", list(CALLS))
def test_reader_racing_eviction_sees_the_object_or_object_not_found(tmp_path: Path, call: str,
                                                                    evictor: str) -> None:
    store = casstore.open(tmp_path / "store", durable=False)
    d = _setup(store, call)
    data = _bytes_of(store, d)
    expected = CALLS[call](store, d)
    stop_t = threading.Event()
    errors: List[BaseException] = []
    ctx = mp.get_context("fork")
    stop_p, started = ctx.Event(), ctx.Event()
    if evictor == "limit-thread":
        worker: Any = threading.Thread(target=_limit_thread, args=(store, d, data, stop_t, errors))
        worker.start()
    else:
        worker = ctx.Process(target=_remover, args=(str(store.root), str(d), data, stop_p, started))
        worker.start()
        assert started.wait(30)
    outcomes = {"ok": 0, "missing": 0}
    deadline = time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline or not (outcomes["ok"] and outcomes["missing"]):
            if time.monotonic() > deadline + 20:
                break
            try:
                got = CALLS[call](store, d)
            except casstore.ObjectNotFoundError:
                outcomes["missing"] += 1
                continue
            if isinstance(got, np.ndarray):
                np.testing.assert_array_equal(got, A)
            elif not isinstance(got, Path):  # a path may be gone by the time we look
                assert got == expected
            outcomes["ok"] += 1
    finally:
        stop_t.set()
        stop_p.set()
        worker.join(30)
    assert not errors, errors
    # Both sides of the race were seen (else the test proved nothing).
    assert outcomes["ok"] and outcomes["missing"], outcomes
