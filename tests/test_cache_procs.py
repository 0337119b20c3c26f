"""IndexCache across real processes: concurrent writers (fork and spawn), SIGKILL mid-put and
mid-preserve, sweeping dead writers' directories, and lock-free frozen reads.

Workers are module-level functions so that spawned children can import them.
Crash points are reached with ``casstore._faults.hook`` set *in the child*,
which then SIGKILLs itself; other tests kill a busy child at a random moment.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, List, Optional, Sequence

import blake3
import pytest

import casstore
import casstore._faults as faults
from casstore._lock import FileLock
from casstore.cache import IndexCache

METHODS = ["fork", "spawn"]
JOIN = 60.0


def payload(i: int) -> bytes:
    n = (i * 7919) % 2500 if i % 53 else 70_000 + i  # mostly CRC-32 records, some BLAKE3-64 ones
    return blake3.blake3(b"mp%d" % i).digest(length=n)


def _join(ps: Sequence[Any]) -> None:
    for p in ps:
        p.join(JOIN)
        assert not p.is_alive(), f"worker {p.pid} hung"


def _kill_self_at(point: str) -> None:
    def hook(p: str) -> None:
        if p == point:
            os.kill(os.getpid(), signal.SIGKILL)

    faults.hook = hook


def icache_dirs(root: Path) -> List[str]:
    return sorted(n for n in os.listdir(root / "tmp") if n.endswith(".icache"))


# -- workers -----------------------------------------------------------------


def _writer(cache: IndexCache, indices: List[int], barrier: Any, out: Any) -> None:
    barrier.wait(JOIN)
    won = [i for i in indices if cache.put(i, payload(i))]
    out.put(won)
    cache.close()  # a worker's close never removes the creator's directory


def _freezer(cache: IndexCache, out: Any) -> None:
    cache.freeze()
    out.put(cache.count)


def _put_and_die(cache: IndexCache, point: str, i: int) -> None:
    cache.put(i - 1, payload(i - 1))  # completes
    _kill_self_at(point)
    cache.put(i, payload(i))
    os._exit(3)  # not reached: the hook kills us


def _busy_writer(cache: IndexCache, started: Any) -> None:
    started.set()
    for i in range(cache.length):
        cache.put(i, payload(i))
    os._exit(0)


def _own_cache_then_die(root: str, out: Any) -> None:
    store = casstore.open(root)
    c = IndexCache(store, 10)
    c.put(1, b"one")
    out.put(str(c._dir))
    out.close()
    out.join_thread()  # flushed to the pipe before the kill
    os.kill(os.getpid(), signal.SIGKILL)


def _preserve_and_die(root: str, point: Optional[str], name: str, n: int, size: int, ready: Any) -> None:
    store = casstore.open(root)
    c = IndexCache(store, n)
    for i in reversed(range(n)):  # out of order (kept in order of arrival: freeze copies nothing)
        c.put(i, blake3.blake3(b"big%d" % i).digest(length=size))
    if point:
        _kill_self_at(point)
    ready.set()
    c.preserve(name)
    os._exit(0 if point is None else 3)


def _put_big(cache: IndexCache, i: int) -> None:
    cache.put(i, blake3.blake3(b"big%d" % i).digest(length=2 << 20))
    os._exit(0)


def _freeze_and_die(cache: IndexCache) -> None:
    _kill_self_at("cache.freeze_built")  # the table is appended to data.0, not yet renamed
    cache.freeze()
    os._exit(3)


def _disk_used(root: Path) -> int:
    """Bytes of disk under ``root``, each inode once (a hard-linked object is not counted twice)."""
    seen = set()
    used = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                used += st.st_blocks * 512
    return used


def _hold_locks(paths: List[str], ready: Any, stop: Any) -> None:
    fds = []
    for p in paths:
        fd = os.open(p, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
    ready.set()
    stop.wait(JOIN)


def _read_all(cache: Any, root: Optional[str], name: Optional[str], n: int, out: Any) -> None:
    c = IndexCache.open(casstore.open(root), name) if cache is None else cache  # type: ignore[arg-type]
    t0 = time.monotonic()
    ok = all(c.get(i) == payload(i) for i in range(n))
    out.put((ok, time.monotonic() - t0))


# -- tests -------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_four_workers_put_disjoint_and_overlapping(store: casstore.Store, method: str) -> None:
    ctx = mp.get_context(method)
    n = 3000
    c = IndexCache(store, n)
    plans = [list(range(0, 1200)), list(range(800, 2000)), list(range(2999, 1599, -1)),
             list(range(n - 1, -1, -3))]
    barrier = ctx.Barrier(len(plans))
    out = ctx.Queue()
    ps = [ctx.Process(target=_writer, args=(c, plan, barrier, out)) for plan in plans]
    for p in ps:
        p.start()
    wins = Counter(i for _ in ps for i in out.get(timeout=JOIN))
    _join(ps)
    assert [p.exitcode for p in ps] == [0, 0, 0, 0]
    assert wins == Counter(range(n))  # every index stored exactly once, by exactly one winner
    assert c._dir is not None and c._dir.exists()  # the workers did not delete the creator's files
    assert c.count == n
    assert all(c.get(i) == payload(i) for i in range(n))
    c.freeze()
    assert all(c.get(i) == payload(i) for i in range(n))
    c.preserve(f"mp-{method}")
    o = IndexCache.open(store, f"mp-{method}")
    assert all(o.get(i) == payload(i) for i in range(n))


def test_a_worker_can_freeze_for_everyone(store: casstore.Store) -> None:
    ctx = mp.get_context("spawn")
    c = IndexCache(store, 100)
    for i in range(0, 100, 3):
        c.put(i, payload(i))
    out = ctx.Queue()
    p = ctx.Process(target=_freezer, args=(c, out))
    p.start()
    assert out.get(timeout=JOIN) == 34
    _join([p])
    assert c.frozen
    with pytest.raises(casstore.FrozenError):
        c.put(1, b"late")
    assert [c.get(i) for i in range(100)] == [payload(i) if i % 3 == 0 else None for i in range(100)]
    assert c.path is not None and c.path.name == "frozen"
    c.preserve("frozen-by-worker")
    assert IndexCache.open(store, "frozen-by-worker").count == 34


@pytest.mark.parametrize("point,method", [("cache.put_after_data", "fork"), ("cache.put_torn_slot", "fork"),
                                          ("cache.put_torn_slot", "spawn"), ("cache.put_after_slot", "fork")])
def test_sigkill_mid_put_leaves_no_record_and_a_usable_cache(store: casstore.Store, point: str,
                                                              method: str) -> None:
    ctx = mp.get_context(method)
    c = IndexCache(store, 20, lock_timeout=5.0)
    c.put(0, payload(0))
    p = ctx.Process(target=_put_and_die, args=(c, point, 7))
    p.start()
    _join([p])
    assert p.exitcode == -signal.SIGKILL
    base = 64 + 32 * 7
    slot = c._imm[base:base + 32]
    if point == "cache.put_after_slot":  # killed after the slot was complete, before the counters
        assert 7 in c and c.get(7) == payload(7)  # the full record
        assert c.put(7, b"other") is False  # usable: the dead holder's lock was released by the kernel
        assert c.count == 3 and c.nbytes == sum(len(payload(i)) for i in (0, 6, 7))  # recounted
    else:
        if point == "cache.put_torn_slot":
            assert slot[:28] != bytes(28) and slot[28:] == bytes(4)  # really torn: fields written, no tag
        else:
            assert slot == bytes(32)
        assert 7 not in c and c.get(7) is None  # the index has no record, not a partial one
        assert c.put(7, payload(7)) is True  # usable: the dead holder's lock was released by the kernel
        assert c.count == 3 and c.nbytes == sum(len(payload(i)) for i in (0, 6, 7))
    assert c.get(6) == payload(6) and c.get(0) == payload(0)
    assert c.get(7) == payload(7)
    c.freeze()
    assert [c.get(i) for i in (0, 6, 7, 8)] == [payload(0), payload(6), payload(7), None]
    assert c.verify() == 3
    assert store.pins() == {}  # no named cache without a completed preserve


def test_sigkill_a_busy_writer_at_random_moments(store: casstore.Store) -> None:
    ctx = mp.get_context("fork")
    rng = random.Random(5)
    partial = 0
    for trial in range(5):
        c = IndexCache(store, 20_000, lock_timeout=5.0)
        started = ctx.Event()
        p = ctx.Process(target=_busy_writer, args=(c, started))
        p.start()
        assert started.wait(JOIN)
        time.sleep(rng.uniform(0.02, 0.12))
        os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
        _join([p])
        got = [c.get(i) for i in range(c.length)]
        assert all(g is None or g == payload(i) for i, g in enumerate(got)), f"trial {trial}: damaged record"
        present = sum(g is not None for g in got)
        assert c.count == present
        partial += 0 < present < c.length
        for i, g in enumerate(got):  # the cache stays usable: fill in what is missing
            if g is None:
                assert c.put(i, payload(i))
        c.freeze()
        assert c.verify() == c.length
        c.close()
    assert partial >= 3  # the kills really landed mid-run
    assert store.pins() == {}
    assert icache_dirs(store.root) == []


@pytest.mark.parametrize("method", METHODS)
def test_dead_owners_directory_is_swept(store: casstore.Store, method: str) -> None:
    ctx = mp.get_context(method)
    mine = IndexCache(store, 5)
    out = ctx.Queue()
    p = ctx.Process(target=_own_cache_then_die, args=(str(store.root), out))
    p.start()
    dead_dir = Path(out.get(timeout=JOIN))  # a child that failed early must not hang the suite
    _join([p])
    assert dead_dir.exists()
    assert mine._dir is not None
    removed = store.sweep_tmp()
    assert dead_dir in removed and not dead_dir.exists()
    assert mine._dir.exists() and mine.put(0, b"still mine")  # a live owner's cache is never swept
    casstore.open(store.root)  # opening a store sweeps too
    assert mine._dir.exists()


@pytest.mark.parametrize("point", ["cache.freeze_built", "cache.preserve_after_freeze", "cache.preserve_after_object",
                                   "cache.preserve_after_manifest"])
def test_sigkill_during_preserve_at_each_step(store: casstore.Store, point: str) -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_preserve_and_die, args=(str(store.root), point, "keep", 40, 3000, ready))
    p.start()
    _join([p])
    assert p.exitcode == -signal.SIGKILL
    assert "keep" not in store.pins()
    with pytest.raises(casstore.ObjectNotFoundError):
        IndexCache.open(store, "keep")
    assert store.sweep_tmp() and icache_dirs(store.root) == []  # the dead writer's files go
    # A new run preserves under the same name; leftovers (an unpinned object) do not get in the way.
    c = IndexCache(store, 40)
    for i in range(40):
        c.put(i, blake3.blake3(b"big%d" % i).digest(length=3000))
    d = c.preserve("keep")
    assert IndexCache.open(store, "keep").get(39) == blake3.blake3(b"big39").digest(length=3000)
    assert store.manifest("keep").meta["length"] == 40 and store.contains(d)


def test_sigkill_during_preserve_at_random_moments(store: casstore.Store) -> None:
    ctx = mp.get_context("fork")
    rng = random.Random(11)
    n, size = 48, 1 << 20
    outcomes = []
    took = 0.0
    for trial in range(12):  # at least 5; more only until a kill has landed inside preserve
        if trial >= 5 and "absent" in outcomes[1:]:
            break
        name = f"big-{trial}"
        ready = ctx.Event()
        p = ctx.Process(target=_preserve_and_die, args=(str(store.root), None, name, n, size, ready))
        p.start()
        assert ready.wait(JOIN)
        t0 = time.monotonic()
        if trial == 0:  # calibration: how long does preserve (compaction, hash, link, pin) take here?
            _join([p])
            took = time.monotonic() - t0
        else:
            # Later trials may run faster than the calibration (warm caches): aim early.
            time.sleep(rng.uniform(0.0, 0.8 if trial < 5 else 0.3) * took)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            _join([p])
        if name in store.pins():  # complete: opens, verifies, every record intact
            o = IndexCache.open(store, name)
            assert o.count == n
            assert all(o.get(i) == blake3.blake3(b"big%d" % i).digest(length=size) for i in range(n))
            outcomes.append("complete")
        else:
            with pytest.raises(casstore.ObjectNotFoundError):
                IndexCache.open(store, name)
            outcomes.append("absent")
        store.sweep_tmp()
        assert icache_dirs(store.root) == []
    assert outcomes[0] == "complete" and "absent" in outcomes[1:]  # kills landed inside preserve


@pytest.mark.parametrize("method", METHODS)
def test_frozen_reads_take_no_lock(store: casstore.Store, method: str) -> None:
    """Readers in other processes work while one process holds every lock casstore uses."""
    ctx = mp.get_context(method)
    n = 400
    frozen = IndexCache(store, n)
    for i in range(n):
        frozen.put(i, payload(i))
    frozen.freeze()
    kept = IndexCache(store, n)
    for i in range(n):
        kept.put(i, payload(i))
    kept.preserve("lock-free")
    live = IndexCache(store, 4, lock_timeout=0.3)  # the control: a live cache needs its lock to put
    with store.edit("other") as m:  # make the store's own lock files exist
        m["k"] = store.put(b"v")
    store.freeze("other")
    locks = [str(p) for p in (store.root / "locks").rglob("*") if p.is_file()]
    assert any(p.endswith("gc.lock") for p in locks) and any("names" in p for p in locks)
    for c in (frozen, kept, live):
        assert c._dir is not None
        locks.append(str(c._dir / "lock"))
    hctx = mp.get_context("fork")
    ready, stop = hctx.Event(), hctx.Event()
    holder = hctx.Process(target=_hold_locks, args=(locks, ready, stop))
    holder.start()
    try:
        assert ready.wait(JOIN)
        with pytest.raises(casstore.LockTimeout):  # the holder really holds the cache's lock ...
            live.put(0, b"x")
        with pytest.raises(casstore.LockTimeout):  # ... and the store's
            FileLock(store.root / "locks" / "gc.lock", timeout=0.2).acquire()
        out = ctx.Queue()
        readers = [ctx.Process(target=_read_all, args=(frozen, None, None, n, out)),
                   ctx.Process(target=_read_all, args=(None, str(store.root), "lock-free", n, out))]
        for r in readers:
            r.start()
        results = [out.get(timeout=JOIN) for _ in readers]
        _join(readers)
        assert [ok for ok, _ in results] == [True, True]
        assert all(r.exitcode == 0 for r in readers)
        assert all(frozen.get(i) == payload(i) for i in range(n))  # and in this process
    finally:
        stop.set()
        _join([holder])


def test_four_writers_out_of_order_then_preserve_adds_no_copy(store: casstore.Store) -> None:
    """The pfio-style job: 4 forked workers fill the cache in shuffled order; freeze and preserve
    then add only the table, footer and manifest (<= 10% of the cache; here ~0.2%), never a copy."""
    ctx = mp.get_context("fork")
    n = 600
    order = list(range(n))
    random.Random(5).shuffle(order)
    c = IndexCache(store, n)
    barrier = ctx.Barrier(4)
    q = ctx.Queue()
    ps = [ctx.Process(target=_writer, args=(c, order[w::4], barrier, q)) for w in range(4)]
    for p in ps:
        p.start()
    won = [i for _ in ps for i in q.get(timeout=JOIN)]
    _join(ps)
    assert sorted(won) == list(range(n))
    assert c._dir is not None
    data = c._dir / "data.0"
    inode, size = os.stat(data).st_ino, os.stat(data).st_size
    assert size == 64 + sum(len(payload(i)) for i in range(n))  # exactly the records, back to back
    before = _disk_used(store.root)
    d = c.preserve("four")
    grown = _disk_used(store.root) - before
    obj = store.path(d)
    assert os.stat(obj).st_ino == inode  # the data file itself became the object
    assert grown <= 0.1 * size, (grown, size)
    assert grown <= 32 * n + 64 + 2 * 4096 + 64 * 1024  # table, footer, manifest, pin: a few blocks
    o = IndexCache.open(store, "four")
    assert all(o.get(i) == payload(i) for i in range(n))


def test_sigkill_of_a_worker_freezing_in_place_leaves_a_cache_that_freezes_again(store: casstore.Store) -> None:
    ctx = mp.get_context("fork")
    n = 50
    c = IndexCache(store, n)
    for i in random.Random(3).sample(range(n), n):
        c.put(i, payload(i))
    p = ctx.Process(target=_freeze_and_die, args=(c,))
    p.start()
    _join([p])
    assert p.exitcode == -signal.SIGKILL
    assert c._dir is not None and (c._dir / "data.0").exists() and not (c._dir / "frozen").exists()
    assert os.path.getsize(c._dir / "data.0") > 64 + sum(len(payload(i)) for i in range(n))  # the dead tail
    assert c.get(7) == payload(7)  # live reads still work meanwhile
    with pytest.raises(casstore.FrozenError):
        c.put(0, b"x")  # the flag was set before the freezer died
    c.freeze()  # drops the dead freezer's tail, appends the table again
    assert all(c.get(i) == payload(i) for i in range(n)) and c.verify() == n
    c.preserve("after-a-dead-freezer")
    assert IndexCache.open(store, "after-a-dead-freezer", verify="full").count == n


def test_big_records_hashed_on_a_helper_thread_work_in_forked_children(store: casstore.Store) -> None:
    """Records of 1 MiB+ are hashed on a per-process helper thread; a child forked after the
    parent started its helper must get its own (work queued to the parent's would never run)."""
    ctx = mp.get_context("fork")
    c = IndexCache(store, 6)
    c.put(0, blake3.blake3(b"big0").digest(length=2 << 20))  # the parent's helper thread exists now
    ps = [ctx.Process(target=_put_big, args=(c, i)) for i in (1, 2, 3)]
    for p in ps:
        p.start()
    _join(ps)
    assert [p.exitcode for p in ps] == [0, 0, 0]
    c.put(4, blake3.blake3(b"big4").digest(length=2 << 20))
    assert all(c.get(i) == blake3.blake3(b"big%d" % i).digest(length=2 << 20) for i in range(5))
    c.freeze()
    assert c.verify() == 5


# -- preserve names the file with the BLAKE3 made while it was filled (issue 13: preserve time) --------

MIB = 1 << 20


def _big(i: int) -> bytes:
    return blake3.blake3(b"fill%d" % i).digest(length=MIB // 2 + i * 4099)


def _big_writer(cache: IndexCache, indices: List[int], die_after: int) -> None:
    for k, i in enumerate(indices):
        if k == die_after:
            _kill_self_at("cache.put_after_data")  # leaves bytes past the data end, then dies
        cache.put(i, _big(i))
    os._exit(0)


def _threads_named(name: str) -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name == name)


def test_preserve_uses_the_hash_made_while_four_writers_filled_it(store: casstore.Store) -> None:
    ctx = mp.get_context("fork")
    n = 96  # ~58 MiB: several of the follower's 8 MiB steps
    order = list(range(n))
    random.Random(13).shuffle(order)
    threads = _threads_named("casstore-cache-follow")
    c = IndexCache(store, n)
    assert _threads_named("casstore-cache-follow") == threads + 1
    # Worker 0 is SIGKILLed mid-put after its 5th record: its bytes past the data end are
    # overwritten by later puts and must never enter the hash.
    ps = [ctx.Process(target=_big_writer, args=(c, order[w::4], 5 if w == 0 else -1)) for w in range(4)]
    for p in ps:
        p.start()
    _join(ps)
    assert ps[0].exitcode == -signal.SIGKILL and [p.exitcode for p in ps[1:]] == [0, 0, 0]
    missing = [i for i in range(n) if i not in c]
    for i in missing:
        assert c.put(i, _big(i))
    f = c._follower
    assert f is not None
    deadline = time.monotonic() + 20
    while f.pos < 48 * MIB and time.monotonic() < deadline:  # it follows the data end in the background
        time.sleep(0.05)
    assert f.pos >= 48 * MIB
    d = c.preserve("followed")
    assert c.path is not None
    with open(c.path, "rb") as fh:
        assert str(d) == "blake3:" + blake3.blake3(fh.read()).hexdigest()  # the name is the bytes' hash
    assert _threads_named("casstore-cache-follow") == threads  # stopped once it was used
    o = IndexCache.open(store, "followed", verify="full")
    assert all(o.get(i) == _big(i) for i in range(n))
    o.close()
    c.close()


def test_the_follower_runs_at_the_lowest_priority(store: casstore.Store) -> None:
    # Background hashing must yield the cores to the puts and the loader (issue 15).
    c = IndexCache(store, 4)
    try:
        f = c._follower
        assert f is not None
        deadline = time.monotonic() + 10
        while f.thread.native_id is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # the thread nices itself first thing
        tid = f.thread.native_id
        assert tid is not None
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19
        assert os.getpriority(os.PRIO_PROCESS, 0) != 19  # only that thread, not the caller
    finally:
        c.close()


def test_the_follower_steps_aside_while_a_large_put_is_in_flight(store: casstore.Store) -> None:
    # A put of >= 1 MiB hashes on a helper thread while it writes: it needs both cores, and
    # a follower step beside it cost 4 MiB puts 0.77x of pfio against ~0.9x (issue 15).
    from casstore.cache import _Hasher

    c = IndexCache(store, 40)
    f = c._follower
    assert f is not None
    _Hasher.submit(b"in flight")  # what the follower sees of a large put between submit and done
    try:
        for i in range(24):  # ~13 MiB: past the follower's first 8 MiB step
            assert c.put(i, _big(i))
        time.sleep(0.5)  # ten of its polls
        assert f.pos == 0
    finally:
        _Hasher.done()
    deadline = time.monotonic() + 20
    while f.pos < 8 * MIB and time.monotonic() < deadline:
        time.sleep(0.02)
    assert f.pos >= 8 * MIB  # and follows again once the put is over
    c.close()


def test_a_put_that_cannot_start_its_hash_leaves_nothing_in_flight(store: casstore.Store) -> None:
    # A large put failing at submit (the helper pool refuses work at interpreter shutdown) must
    # not leave the follower waiting forever for a put that never began.
    from concurrent.futures import ThreadPoolExecutor

    from casstore.cache import _Hasher

    c = IndexCache(store, 4)
    dead = ThreadPoolExecutor(1)
    dead.shutdown()
    old = _Hasher.pool, _Hasher.pid
    _Hasher.pool, _Hasher.pid = dead, os.getpid()
    try:
        with pytest.raises(RuntimeError, match="shutdown"):
            c.put(0, bytes(2 * MIB))
        assert _Hasher.busy == 0
    finally:
        _Hasher.pool, _Hasher.pid = old
    assert c.put(0, bytes(2 * MIB)) and c.get(0) == bytes(2 * MIB)
    c.close()


def test_preserve_never_waits_for_a_put_in_flight_elsewhere(store: casstore.Store) -> None:
    # The follower, waiting for a large put to end, hands over to preserve at once.
    import threading

    from casstore.cache import _Hasher

    c = IndexCache(store, 40)
    _Hasher.submit(b"in flight")
    try:
        for i in range(24):
            assert c.put(i, _big(i))
        time.sleep(0.2)
        out: List[Any] = []
        t = threading.Thread(target=lambda: out.append(c.preserve("while-busy")), daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive() and len(out) == 1
        d = out[0]
    finally:
        _Hasher.done()
    assert c.path is not None
    with open(c.path, "rb") as fh:
        assert str(d) == "blake3:" + blake3.blake3(fh.read()).hexdigest()
    c.close()


def _preserve_in_child(cache: IndexCache, out: Any) -> None:
    out.put(str(cache.preserve("from-a-child")))


def test_preserve_from_a_forked_child_hashes_the_file_itself(store: casstore.Store) -> None:
    ctx = mp.get_context("fork")
    c = IndexCache(store, 40)
    for i in range(40):
        c.put(i, _big(i))
    q = ctx.Queue()
    p = ctx.Process(target=_preserve_in_child, args=(c, q))  # the parent's follower does not exist there
    p.start()
    d = q.get(timeout=JOIN)
    _join([p])
    assert p.exitcode == 0
    o = IndexCache.open(store, "from-a-child", verify="full")  # the whole BLAKE3 matches its name
    assert str(o.digest) == d and o.count == 40
    o.close()
    c.close()
    assert c._follower is not None and c._follower.dfd == -1  # closed with the cache


def test_a_cache_that_is_closed_or_collected_stops_its_follower(store: casstore.Store) -> None:
    import gc

    threads = _threads_named("casstore-cache-follow")
    c = IndexCache(store, 4)
    c.put(0, b"x")
    c.close()
    assert _threads_named("casstore-cache-follow") == threads
    c = IndexCache(store, 4)
    c.put(0, b"x")
    del c
    gc.collect()
    assert _threads_named("casstore-cache-follow") == threads
    assert icache_dirs(store.root) == []


def _put_in_child_and_report(cache: IndexCache, out: Any) -> None:
    inherited = cache._proc
    ok = cache.put(1, b"child")
    p = cache._proc
    out.put((ok, p.pid == os.getpid(), p is not inherited))


def test_a_forked_child_puts_through_descriptors_of_its_own(store: casstore.Store) -> None:
    # The pid a put compares with is kept by a fork hook, not asked of the kernel per put. If the
    # child went on with the parent's lock descriptor, its flock would be the parent's (one open
    # file description) and exclude nothing.
    ctx = mp.get_context("fork")
    c = IndexCache(store, 4)
    assert c.put(0, b"parent")
    q = ctx.Queue()
    p = ctx.Process(target=_put_in_child_and_report, args=(c, q))
    p.start()
    got = q.get(timeout=JOIN)
    _join([p])
    assert got == (True, True, True)
    assert c.get(1) == b"child" and c._proc.pid == os.getpid()
    c.close()


@pytest.mark.parametrize("mode", ["once", "open"])
def test_pool_map_of_a_frozen_caches_get_returns(store: casstore.Store, mode: str) -> None:
    # Bug: the frozen get pickled under a name the worker could not look up; the worker's
    # error never reached the pool, so map() hung forever.  A timeout turns a regression
    # into a failure.
    c = IndexCache(store, 6, verify=mode)
    for i in range(6):
        c.put(i, payload(i))
    c.freeze()
    c.preserve(f"pooled-{mode}")
    opened = IndexCache.open(store, f"pooled-{mode}", verify=mode)
    pool = mp.get_context("fork").Pool(2)
    try:
        for cache in (c, opened):
            assert pool.map_async(cache.get, range(6)).get(timeout=JOIN) == [payload(i) for i in range(6)]
    finally:
        pool.terminate()
        pool.join()
