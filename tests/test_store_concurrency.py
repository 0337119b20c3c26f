"""Many writers (processes and threads) on one store at once: all succeed, nothing lost, nothing torn."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import random
import threading
import traceback
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from conftest import assert_all_objects_valid, b3, compressible, object_files, run_py, tmp_files

import casstore

N_WORKERS = 6
# (key, size, compressible?, compress flag).  The flag is the same in every
# worker, so racing writers of one content all produce the same file name.
SHARED: List[Tuple[str, int, bool, bool]] = [
    ("empty", 0, False, False),
    ("tiny", 100, False, False),
    ("random-1M", 1 << 20, False, True),  # compress asked for, skipped: random
    ("text-2M", 2 << 20, True, True),
    ("text-raw", 300_000, True, False),
    ("random-5M", 5 << 20, False, False),
]
SHARED_CODEC = {"empty": "raw", "tiny": "raw", "random-1M": "raw", "text-2M": "zstd", "text-raw": "raw",
                "random-5M": "raw"}


def _data(key: str, size: int, text: bool) -> bytes:
    seed = sum(key.encode()) * 7919 + size
    if text:
        return compressible(size, seed=seed % 1000)
    return random.Random(key).randbytes(size)


def _unique(wid: int) -> List[Tuple[str, int, bool, bool]]:
    rnd = random.Random(wid)
    return [(f"w{wid}-{i}", rnd.randrange(0, 400_000), i % 2 == 0, i % 3 == 0) for i in range(12)]


def _worker(root: str, wid: int, files: Dict[str, str], barrier: Any, queue: Any) -> None:
    try:
        barrier.wait(60)  # everyone opens (and maybe creates) the store at once
        s = casstore.open(root)
        barrier.wait(60)  # ... and starts writing at once
        out: List[Tuple[str, str]] = []
        how = ["put", "put_many", "put_stream", "put_path"]
        for j, (key, size, text, compress) in enumerate(SHARED):
            data = _data(key, size, text)
            method = how[(wid + j) % len(how)]
            if method == "put":
                d = s.put(data, compress=compress)
            elif method == "put_many":
                (d,) = s.put_many([data], compress=compress)
            elif method == "put_stream":
                d = s.put_stream(io.BytesIO(data), compress=compress)
            else:
                d = s.put_path(files[key], compress=compress)
            out.append((key, str(d)))
        uniq = _unique(wid)
        datas = [_data(k, n, t) for k, n, t, _ in uniq]
        ds = s.put_many(datas[:6])
        out += [(k, str(d)) for (k, _, _, _), d in zip(uniq[:6], ds, strict=True)]
        for (k, _, _, c), data in zip(uniq[6:], datas[6:], strict=True):
            out.append((k, str(s.put(data, compress=c))))
        # read back what this worker wrote, while the others are still writing
        for _key, d in out:
            s.get(d)
        queue.put((wid, "ok", out))
    except BaseException:
        queue.put((wid, "error", traceback.format_exc()))


def _reap(procs: List[Any]) -> None:
    """Kill children still running after a failure (a hung child must not outlive the test)."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


def _all_expected() -> Dict[str, Tuple[bytes, bool]]:
    exp = {k: (_data(k, n, t), c) for k, n, t, c in SHARED}
    for w in range(N_WORKERS):
        exp.update({k: (_data(k, n, t), c) for k, n, t, c in _unique(w)})
    return exp


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_concurrent_writers_same_and_different_objects(method: str, tmp_path: Path) -> None:
    ctx = mp.get_context(method)
    root = tmp_path / "store"  # created by the racing workers themselves
    files = {}
    for key, size, text, _ in SHARED:
        f = tmp_path / f"{key}.bin"
        f.write_bytes(_data(key, size, text))
        files[key] = str(f)
    barrier = ctx.Barrier(N_WORKERS)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(root), w, files, barrier, queue)) for w in range(N_WORKERS)]
    try:
        for p in procs:
            p.start()
        results = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        _reap(procs)
    errors = [r for r in results if r[1] != "ok"]
    assert not errors, errors[0][2]

    expected = _all_expected()
    store = casstore.open(root)
    seen: Dict[str, str] = {}
    for _, _, out in results:
        assert len(out) == len(SHARED) + 12
        for key, d in out:
            data, _ = expected[key]
            assert d == b3(data), key
            seen.setdefault(key, d)
            assert seen[key] == d  # every worker got the same digest for the shared ones
    assert set(seen) == set(expected)  # nothing lost
    for key, d in seen.items():
        data, _ = expected[key]
        assert store.get(d) == data, key
        if key in SHARED_CODEC:
            assert store.stat(d).codec == SHARED_CODEC[key], key
    distinct = set(seen.values())
    assert sorted(str(d) for d in store.iter_objects()) == sorted(distinct)
    # one file per content even though up to 6 processes wrote each shared one at the same moment
    assert len(object_files(root)) == len(distinct)
    assert sorted(assert_all_objects_valid(root)) == sorted(distinct)
    assert tmp_files(root) == []


def _reader(root: str, stop: Any, queue: Any) -> None:
    try:
        s = casstore.open(root)
        checked = set()
        while True:
            done = stop.is_set()
            for d in s.iter_objects():
                if d in checked:
                    continue
                data = s.get(d)  # verifies; raises IntegrityError on a torn object
                assert b3(data) == str(d)
                checked.add(d)
            if done:
                break
        queue.put(("ok", len(checked)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def _writer(root: str, wid: int, queue: Any) -> None:
    try:
        s = casstore.open(root)
        rnd = random.Random(1000 + wid)
        ds = []
        for i in range(8):
            data = rnd.randbytes(rnd.randrange(1 << 20, 4 << 20))
            if i % 2:
                data = compressible(len(data), seed=wid * 10 + i)
            ds.append(str(s.put(data, compress=bool(i % 4 == 1))))
        queue.put(("ok", ds))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def test_readers_never_see_partial_objects(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    root = str(tmp_path / "store")
    casstore.open(root)
    stop = ctx.Event()
    rq, wq = ctx.Queue(), ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(root, stop, rq)) for _ in range(2)]
    writers = [ctx.Process(target=_writer, args=(root, w, wq)) for w in range(4)]
    try:
        for p in readers + writers:
            p.start()
        wres = [wq.get(timeout=120) for _ in writers]
        stop.set()
        rres = [rq.get(timeout=120) for _ in readers]
        for p in readers + writers:
            p.join(60)
    finally:
        _reap(readers + writers)
    assert all(r[0] == "ok" for r in wres), wres
    assert all(r[0] == "ok" for r in rres), rres
    written = {d for _, ds in wres for d in ds}
    assert len(written) == 32
    for _, n in rres:
        assert n == len(written)  # each reader finally verified every object
    assert sorted(assert_all_objects_valid(root)) == sorted(written)


def test_threads_share_a_store(store: casstore.Store) -> None:
    shared = os.urandom(2 << 20)
    errors: List[str] = []
    results: Dict[int, List[str]] = {}
    barrier = threading.Barrier(8)

    def run(t: int) -> None:
        try:
            barrier.wait()
            mine = [os.urandom(1000 + t) for _ in range(20)]
            ds = [store.put(shared)] + store.put_many(mine) + [store.put(compressible(100_000), compress=True)]
            results[t] = [str(d) for d in ds]
            assert [b3(x) for x in mine] == results[t][1:-1]
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert {r[0] for r in results.values()} == {b3(shared)}
    distinct = {d for r in results.values() for d in r}
    assert len(distinct) == 8 * 20 + 2
    assert len(object_files(store.root)) == len(distinct)
    assert sorted(assert_all_objects_valid(store.root)) == sorted(distinct)
    assert tmp_files(store.root) == []


_FORK_AFTER_HASHING = """
import os, signal, sys
import casstore
s = casstore.open(sys.argv[1])
d0 = s.put(os.urandom(8 << 20))  # >= 1 MiB: hashed with blake3's thread pool in this process
s.get(d0)
pids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a deadlocked hash would otherwise hang forever
        try:
            data = bytes([i]) * (4 << 20)
            d = s.put(data)
            assert s.get(d) == data
            s.get(d0)
            os.write(1, f"{d}\\n".encode())  # one write: lines of concurrent children never interleave
            os._exit(0)
        except BaseException:
            os._exit(1)
    pids.append(pid)
print("exit codes", *[os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
"""


def test_forked_children_can_hash_after_parent_used_threads(tmp_path: Path) -> None:
    """blake3's thread pool does not survive fork(): children must still put and get big objects."""
    r = run_py(_FORK_AFTER_HASHING, str(tmp_path / "s"), timeout=120)
    lines = r.stdout.splitlines()
    assert lines[-1] == "exit codes 0 0 0"
    assert sorted(lines[:-1]) == sorted(b3(bytes([i]) * (4 << 20)) for i in range(3))
