"""Manifests under concurrency: no lost update, lock-free readers, one lock per name (issue 3).

Real processes ('spawn': fresh interpreters) on a real store.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import pytest
from _manifest_helpers import (
    SPAWN,
    freeze_race_editor_worker,
    freeze_race_reader_worker,
    get_report,
    history_chain,
    lock_everything_worker,
    lock_file,
    reader_worker,
    stop_process,
    timed_read_worker,
    wait_event,
    writer_worker,
)

import casstore
from casstore import Entry, LockTimeout

WRITERS = 8
EDITS = 200
READERS = 2


@pytest.mark.slow
def test_no_lost_update_8_writers_x_200_edits_with_lock_free_readers(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    store = casstore.open(root)
    shared = store.put(b"shared")  # the objects referenced go in first
    q = SPAWN.Queue()
    stop = SPAWN.Event()
    readers = [SPAWN.Process(target=reader_worker, args=(root, "exp", str(shared), stop, q)) for _ in range(READERS)]
    writers = [SPAWN.Process(target=writer_worker, args=(root, "exp", p, EDITS, str(shared), q))
               for p in range(WRITERS)]
    t0 = time.monotonic()
    try:
        for p in readers + writers:
            p.start()
        writer_reports = [get_report(q, 300, readers + writers) for _ in writers]
        elapsed = time.monotonic() - t0
        time.sleep(0.05)
        stop.set()
        reader_reports = [get_report(q, 60, readers) for _ in readers]
        for p in readers + writers:
            p.join(30)
            assert p.exitcode == 0
    finally:
        stop.set()
        for p in readers + writers:
            stop_process(p)
    errors = [r for r in writer_reports if r[0] != "ok"]
    assert not errors, errors[0][1]
    print(f"\n{WRITERS}x{EDITS} edits with {READERS} readers: {elapsed:.1f}s; "
          f"reads per reader: {[r[1] for r in reader_reports]}")
    for _tag, reads, n_errors, samples in reader_reports:
        assert n_errors == 0, "\n".join(samples)
        assert reads > 0

    man = store.manifest("exp")
    expected = {f"p{p}/k{i}" for p in range(WRITERS) for i in range(EDITS)}
    assert set(man) == expected and len(man) == WRITERS * EDITS
    assert all(man[k] == Entry(shared, 6) for k in man)

    t = time.monotonic()
    h, digests = history_chain(store, "exp")
    assert len(h) == WRITERS * EDITS
    assert len(set(digests)) == len(digests)
    # Each version adds exactly one key to its parent, and each writer's keys appear in its own order.
    added_at: Dict[int, List[int]] = defaultdict(list)
    prev: set[str] = set()
    for version in reversed(h):
        keys = set(version)
        new = keys - prev
        assert prev <= keys and len(new) == 1
        (key,) = new
        p, i = key[1:].split("/k")
        added_at[int(p)].append(int(i))
        prev = keys
    assert all(added_at[p] == list(range(EDITS)) for p in range(WRITERS))
    print(f"history of {len(h)} versions checked in {time.monotonic() - t:.1f}s")


def test_frozen_reads_take_no_lock_even_when_every_lock_is_held(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    a, b = store.put(b"aaa"), store.put(b"bbb")
    with store.edit("frozen") as m:
        m["a"] = a
        m.meta["k"] = "v"
    frozen = store.freeze("frozen")
    with store.edit("live") as m:  # a head: its lock file exists too
        m["b"] = b
    live = store.heads()["live"]
    ready, release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=lock_everything_worker, args=(str(root), "frozen", ready, release))
    holder.start()
    try:
        wait_event(ready, holder, 60)
        locks_before = sorted(str(p) for p in (root / "locks").rglob("*"))
        lock_files = [p for p in (root / "locks").rglob("*.lock")]
        assert {lock_file(root, "frozen"), lock_file(root, "live")} <= set(lock_files)
        # The locks really are held (otherwise this test would prove nothing).
        for p in lock_files:
            fd = os.open(p, os.O_RDONLY)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            finally:
                os.close(fd)

        # Another process reads the frozen manifest at once.
        q = SPAWN.Queue()
        reader = SPAWN.Process(target=timed_read_worker, args=(str(root), "frozen", q))
        reader.start()
        rep = get_report(q, 60, [reader])
        reader.join(30)
        assert rep[0] == "ok", rep[1]
        _tag, elapsed, entries, meta, is_frozen = rep
        assert entries == {"a": str(a)} and meta == {"k": "v"} and is_frozen
        assert elapsed < 0.5, f"reading a frozen manifest took {elapsed:.2f}s while locks were held"
        # So does this process, for the pin and for a head.
        t = time.monotonic()
        assert store.manifest("frozen").digest == frozen
        assert store.manifest(frozen).digest == frozen
        assert store.manifest("live").digest == live
        assert [v.digest for v in store.history("frozen")] == [frozen]
        assert time.monotonic() - t < 0.5

        # An edit of the head times out, naming the lock file.
        t = time.monotonic()
        with pytest.raises(LockTimeout) as ei:
            with store.edit("live", timeout=0.5) as m:
                m["x"] = a
        waited = time.monotonic() - t
        assert 0.5 <= waited < 1.5, waited
        assert str(lock_file(root, "live")) in str(ei.value)
        assert "manifest 'live'" in str(ei.value)
        t = time.monotonic()
        with pytest.raises(LockTimeout, match=str(lock_file(root, "frozen"))):
            store.freeze("frozen", timeout=0.3)
        assert 0.3 <= time.monotonic() - t < 1.3
        assert store.heads()["live"] == live
        assert sorted(str(p) for p in (root / "locks").rglob("*")) == locks_before  # readers made no lock files
    finally:
        release.set()
        holder.join(30)
        stop_process(holder)
    assert holder.exitcode == 0
    # Once released, the edit goes through.
    with store.edit("live", timeout=5) as m:
        m["x"] = a
    assert sorted(store.manifest("live")) == ["b", "x"]


def test_edit_locks_only_its_own_name(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    d = store.put(b"x")
    for name in ("a", "b", "team/a"):
        with store.edit(name) as m:
            m["k"] = d
    ready, release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=lock_everything_worker, args=(str(root), "a", ready, release, False))
    holder.start()
    try:
        wait_event(ready, holder, 60)
        for name in ("b", "team/a", "c", "ab/c"):  # would raise LockTimeout if "a"'s lock blocked them
            with store.edit(name, timeout=0.5) as m:
                m["k2"] = d
        t = time.monotonic()
        with pytest.raises(LockTimeout):
            with store.edit("a", timeout=0.2) as m:
                m["k2"] = d
        assert time.monotonic() - t >= 0.2
    finally:
        release.set()
        holder.join(30)
        stop_process(holder)
    assert sorted(store.heads()) == ["a", "ab/c", "b", "c", "team/a"]
    assert "k2" not in store.manifest("a") and all("k2" in store.manifest(n) for n in ("b", "team/a", "c", "ab/c"))


def test_freeze_racing_with_an_editor_loses_no_commit(tmp_path: Path) -> None:
    """Freeze and edit take the same lock: every commit the editor saw succeed is in the pin's history."""
    root = tmp_path / "store"
    store = casstore.open(root, durable=False)
    d = store.put(b"x")
    with store.edit("exp") as m:
        m["start"] = d
    q = SPAWN.Queue()
    editor = SPAWN.Process(target=freeze_race_editor_worker, args=(str(root), "exp", str(d), q))
    editor.start()
    try:
        deadline = time.monotonic() + 60
        while len(store.manifest("exp")) < 20:  # let it commit for a while
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pinned = store.freeze("exp")
        rep = get_report(q, 60, [editor])
        editor.join(30)
    finally:
        stop_process(editor)
    assert rep[0] == "frozen", rep
    committed = [casstore.Digest.parse(s) for s in rep[1]]
    assert len(committed) >= 19
    assert committed[-1] == pinned  # the last successful commit is exactly what was frozen
    assert [v.digest for v in store.history("exp")][: len(committed)] == committed[::-1]
    assert store.heads() == {} and store.pins() == {"exp": pinned}


def test_readers_never_miss_a_name_while_it_is_frozen(tmp_path: Path) -> None:
    """Freeze writes the pin, then removes the head: a reader must see one or the other, always."""
    root = tmp_path / "store"
    store = casstore.open(root, durable=False)
    d = store.put(b"x")
    names = [f"n{i:03d}" for i in range(300)]
    for n in names:
        with store.edit(n) as m:
            m["k"] = d
    q = SPAWN.Queue()
    stop = SPAWN.Event()
    current = SPAWN.Value("i", 0)
    readers = [SPAWN.Process(target=freeze_race_reader_worker, args=(str(root), names, current, stop, q))
               for _ in range(2)]
    for r in readers:
        r.start()
    try:
        time.sleep(0.5)  # let the readers start reading
        for i, n in enumerate(names):
            current.value = i
            time.sleep(0.0005)
            store.freeze(n)
        stop.set()
        reports = [get_report(q, 60, readers) for _ in readers]
    finally:
        stop.set()
        for r in readers:
            r.join(30)
            stop_process(r)
    assert store.pins().keys() == set(names) and store.heads() == {}
    for reads, samples, n_errors in reports:
        assert reads > 0
        assert n_errors == 0, samples
