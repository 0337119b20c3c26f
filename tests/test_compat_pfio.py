"""casstore.compat.pfio: pfio's FileCache / MultiprocessFileCache / ReadOnlyFileCache semantics on IndexCache.

Our own tests of the behaviour pfio users rely on (pfio's test files are not copied here):
return conventions, the size limit that freezes, preserve/preload round trips between the
classes, forked workers, and the places where casstore is stricter (damaged data raises).
"""

from __future__ import annotations

import errno
import io
import multiprocessing as mp
import os
import pickle
import random
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, List

import blake3
import pytest

import casstore
from casstore.compat.pfio import STORE_DIR, FileCache, MultiprocessFileCache, ReadOnlyFileCache

JOIN = 60.0


def sample(i: int) -> bytes:
    return blake3.blake3(b"pf%d" % i).digest(length=100 + (i * 37) % 3000)


@pytest.fixture
def cdir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_put_get_and_get_and_cache_with_and_without_pickle(cdir: Path) -> None:
    with FileCache(50, dir=str(cdir), do_pickle=True) as c:
        assert len(c) == 50 and c.dir == str(cdir)
        assert not c.multiprocess_safe and not c.multithread_safe and not c.frozen  # as pfio reports
        order = random.Random(1).sample(range(50), 50) * 2
        calls: List[int] = []

        def backend(i: int) -> object:
            calls.append(i)
            return {"i": i, "x": [i] * 3}

        for i in order:
            assert c.get_and_cache(i, backend) == {"i": i, "x": [i] * 3}
        assert sorted(calls) == list(range(50))  # each index fetched from the backend once
        assert c.put(3, "other") is False  # first writer wins
        assert c.get(3) == {"i": 3, "x": [3, 3, 3]}
    assert c.closed and c.get(3) is None  # pfio: a closed cache returns None
    assert c.put(4, "x") is False
    with FileCache(5, multithread_safe=True, dir=str(cdir)) as raw:
        assert raw.multithread_safe
        assert raw.get(0) is None
        assert raw.put(0, b"bytes") is True and raw.get(0) == b"bytes"
        with pytest.raises(IndexError):
            raw.get(5)
        with pytest.raises(IndexError):
            raw.put(-1, b"x")
        with pytest.raises(TypeError):
            raw.put(1, "a str without do_pickle")  # as pfio (os.pwrite refuses a str)


def test_constructor_arguments_are_checked_as_pfio_does(cdir: Path) -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError):
            FileCache(bad, dir=str(cdir))
    for limit in (-1, "10"):
        with pytest.raises(ValueError):
            MultiprocessFileCache(10, dir=str(cdir), cache_size_limit=limit)  # type: ignore[arg-type]
    c = FileCache(3, dir=str(cdir), cache_size_limit=0)  # 0 and None: unlimited
    assert c.put(0, b"x" * 100_000) and c.put(1, b"y" * 100_000)
    assert (cdir / STORE_DIR / "store.toml").exists()  # dir holds a casstore store
    c.close()


@pytest.mark.parametrize("cls", [FileCache, MultiprocessFileCache])
def test_size_limit_counts_like_pfio_and_then_freezes(cdir: Path, cls: Any) -> None:
    # pfio counts 16 bytes per index plus the data; reaching the limit freezes the cache,
    # so even a record that would still fit is refused afterwards.
    with cls(10, dir=str(cdir), cache_size_limit=160 + 120) as c:
        assert c.put(0, b"x" * 50) and c.put(1, b"x" * 50)
        assert not c.frozen
        assert c.put(2, b"x" * 50) is False  # 260 + 50 > 280
        assert c.frozen
        assert c.put(3, b"y" * 20) is False  # would fit, but the cache is frozen now
        assert c.get(0) == b"x" * 50 and c.get(2) is None and c.get(3) is None
        assert c.preload("anything") is False  # pfio: a frozen cache does not preload
    with cls(20, dir=str(cdir), cache_size_limit=320 + 100) as c:  # exactly reaching it is allowed
        assert all(c.put(i, b"z" * 10) for i in range(10))
        assert not any(c.put(i, b"z" * 10) for i in range(10, 20))
        assert c.put(0, b"dup") is False and c.get(0) == b"z" * 10


@pytest.mark.parametrize("cls", [FileCache, MultiprocessFileCache])
def test_preserve_and_preload_round_trips(cdir: Path, cls: Any) -> None:
    c = cls(10, dir=str(cdir), do_pickle=True)
    for i in range(10):
        assert c.put(i, str(i))
    assert c.preload("kept") is False  # nothing by that name yet
    assert c.preserve("kept") is True
    assert c.frozen and c.multiprocess_safe
    assert c.put(0, "late") is False  # frozen: refused, as pfio
    assert [c.get(i) for i in range(10)] == [str(i) for i in range(10)]
    assert c.preserve("kept") is False  # the name exists: nothing done (pfio)
    assert c.preserve("kept-2") is True  # the same cache under a second name
    c.close()
    store = casstore.open(cdir / STORE_DIR)
    assert {"kept", "kept-2"} <= set(store.pins())
    assert store.manifest("kept").digest == store.manifest("kept-2").digest
    for other in (FileCache, MultiprocessFileCache):  # a preserved cache preloads into either class
        with other(10, dir=str(cdir), do_pickle=True) as d:
            assert d.preload("kept") is True
            assert d.frozen and [d.get(i) for i in range(10)] == [str(i) for i in range(10)]
            assert d.put(1, "x") is False
            assert d.preload("kept") is False  # already frozen
            assert d.preserve(f"kept-{other.__name__}") is True  # a preloaded cache preserves under one more name
    # overwrite=True moves the name to a different cache.
    e = cls(10, dir=str(cdir), do_pickle=True)
    e.put(0, "new")
    assert e.preserve("kept") is False
    assert e.preserve("kept", overwrite=True) is True
    e.close()
    with FileCache(10, dir=str(cdir), do_pickle=True) as f:
        assert f.preload("kept") and f.get(0) == "new" and f.get(1) is None
    with FileCache(10, dir=str(cdir), do_pickle=True) as f:
        assert f.preload("kept-2") and f.get(1) == "1"


def test_read_only_file_cache(cdir: Path) -> None:
    roc = ReadOnlyFileCache(8, dir=str(cdir), do_pickle=True)
    assert roc.frozen and roc.closed and roc.get(0) is None
    with pytest.raises(FileNotFoundError):
        roc.preload("nothing")  # pfio: open() of a missing file
    c = FileCache(8, dir=str(cdir), do_pickle=True)
    for i in range(8):
        c.put(i, [i])
    c.preserve("full")
    part = FileCache(8, dir=str(cdir))
    part.put(0, b"only one")
    part.preserve("partial")
    with pytest.raises(io.UnsupportedOperation):
        roc.put(0, b"x")
    with pytest.raises(io.UnsupportedOperation):
        roc.preserve("x")
    with pytest.raises(RuntimeError, match="Incomplete"):
        roc.preload("partial")  # pfio's ReadOnlyFileCache needs every index
    assert roc.preload("full") is True and not roc.closed
    assert [roc.get(i) for i in range(8)] == [[i] for i in range(8)]
    with pytest.raises(IndexError):
        roc.get(8)
    roc.close()
    assert roc.closed and roc.get(0) is None


def test_damaged_data_raises_instead_of_being_returned(cdir: Path) -> None:
    c = FileCache(4, dir=str(cdir))
    for i in range(4):
        c.put(i, sample(i))
    c.preserve("d")
    c.close()
    f = FileCache(4, dir=str(cdir))
    assert f.preload("d")
    path = f.index_cache.path
    assert path is not None
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:  # flip one byte of record 2 after preload, before its first read
        fh.seek(64 + len(sample(0)) + len(sample(1)) + 5)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x40]))
    assert f.get(1) == sample(1)
    with pytest.raises(casstore.IntegrityError, match="record 2"):
        f.get(2)


# -- processes ---------------------------------------------------------------------------


def _mp_writer(c: MultiprocessFileCache, worker: int, n: int, out: Any) -> None:
    stored = 0
    for i in range(n):
        if i % 4 == worker or i % 10 == 0:  # disjoint shares plus indices every worker races for
            stored += bool(c.put(i, sample(i)))
    for call in (c.preserve, c.preload):  # only the creating process may (pfio raises RuntimeError)
        try:
            call("from-a-worker")
        except RuntimeError:
            pass
        else:  # pragma: no cover - reported below
            stored = -1_000_000
    out.put(stored)
    c.close()  # a worker's close leaves the cache to the others


def _mp_reader(c: MultiprocessFileCache, worker: int, n: int, out: Any) -> None:
    ok = all(c.get(i) == sample(i) for i in range(worker, n, 4))
    out.put(ok and c.preload("again") is False)  # frozen: False, as pfio (before the worker check)


def test_multiprocess_file_cache_with_four_forked_workers(cdir: Path) -> None:
    ctx = mp.get_context("fork")
    n = 400
    c = MultiprocessFileCache(n, dir=str(cdir))
    assert c.multiprocess_safe and c.multithread_safe
    q = ctx.Queue()
    ps = [ctx.Process(target=_mp_writer, args=(c, w, n, q)) for w in range(4)]
    for p in ps:
        p.start()
    stored = [q.get(timeout=JOIN) for _ in ps]
    for p in ps:
        p.join(JOIN)
        assert p.exitcode == 0
    assert sum(stored) == n  # every index stored exactly once, however the races went
    assert all(c.get(i) == sample(i) for i in range(n))
    assert c.preserve("mp") is True
    c.close()
    # The next run: preload in the main process, then forked readers.
    d = MultiprocessFileCache(n, dir=str(cdir))
    assert d.preload("mp") is True
    ps = [ctx.Process(target=_mp_reader, args=(d, w, n, q)) for w in range(4)]
    for p in ps:
        p.start()
    results = [q.get(timeout=JOIN) for _ in ps]
    for p in ps:
        p.join(JOIN)
    assert results == [True] * 4
    d.close()
    assert not [x for x in os.listdir(cdir / STORE_DIR / "tmp") if x.endswith(".icache")]


def _spawned_put(c: MultiprocessFileCache, i: int) -> None:
    c.put(i, pickle.dumps(i))


def test_multiprocess_file_cache_pickles_to_a_spawned_worker(cdir: Path) -> None:
    c = MultiprocessFileCache(4, dir=str(cdir))
    p = mp.get_context("spawn").Process(target=_spawned_put, args=(c, 3))
    p.start()
    p.join(JOIN)
    assert p.exitcode == 0
    assert c.get(3) == pickle.dumps(3)
    c.close()


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = tmp_path / "tiny"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()})")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_disk_warns_and_returns_false_as_pfio_does(tiny_fs: Path) -> None:
    c = FileCache(100, dir=str(tiny_fs))
    results = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(100):
            results.append(c.put(i, os.urandom(100_000)))
    assert False in results and True in results
    assert any(issubclass(x.category, RuntimeWarning) for x in w)
    stored = [i for i, ok in enumerate(results) if ok]
    assert all(c.get(i) is not None for i in stored)
    c.close()


# -- close() leaves dir as it found it (pfio's test_cleanup), and only when that is safe ----------


def _child_close(c: MultiprocessFileCache, q: Any) -> None:
    c.close()
    q.put(sorted(os.listdir(c.dir)))


@pytest.mark.parametrize("cls", [FileCache, MultiprocessFileCache])
def test_close_of_a_cache_that_kept_nothing_empties_dir_again(cdir: Path, cls: Any) -> None:
    c = cls(10, dir=str(cdir), do_pickle=True)
    for i in range(10):
        c.put(i, str(i))
    assert os.listdir(cdir) == [STORE_DIR]
    c.close()
    assert os.listdir(cdir) == []
    c.close()  # idempotent
    # The next cache makes the store again, and so can any number of rounds.
    with cls(3, dir=str(cdir)) as c2:
        assert c2.put(0, b"x") and c2.get(0) == b"x"
    assert os.listdir(cdir) == []


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_close_in_a_worker_removes_nothing(cdir: Path, method: str) -> None:
    ctx = mp.get_context(method)
    c = MultiprocessFileCache(10, dir=str(cdir), do_pickle=True)
    c.put(1, "one")
    q = ctx.Queue()
    p = ctx.Process(target=_child_close, args=(c, q))
    p.start()
    assert q.get(timeout=JOIN) == [STORE_DIR]
    p.join(JOIN)
    assert p.exitcode == 0
    assert os.listdir(cdir) == [STORE_DIR]
    assert c.get(1) == "one" and c.put(2, "two")  # the parent's cache still works
    c.close()
    assert os.listdir(cdir) == []


def test_store_stays_while_another_cache_uses_it_or_once_something_was_preserved(cdir: Path) -> None:
    a = FileCache(5, dir=str(cdir))
    b = FileCache(5, dir=str(cdir))  # same store, opened (not created) by this second cache
    a.put(0, b"a")
    a.close()
    assert os.listdir(cdir) == [STORE_DIR]  # b holds it open: a leaves it
    assert b.put(0, b"b") and b.get(0) == b"b"
    b.close()  # the last user in the creating process removes it
    assert os.listdir(cdir) == []
    # Another process that holds the store open (its own flock) keeps it too.
    c = FileCache(5, dir=str(cdir))
    code = ("import sys; from casstore.compat.pfio import FileCache; "
            "c = FileCache(5, dir=sys.argv[1]); print('open', flush=True); sys.stdin.read(); c.close()")
    other = subprocess.Popen([sys.executable, "-c", code, str(cdir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "open"
        c.close()
        assert os.listdir(cdir) == [STORE_DIR]
    finally:
        other.communicate("", timeout=JOIN)
    assert other.returncode == 0
    assert os.listdir(cdir) == [STORE_DIR]  # the other process did not create it


def test_a_store_that_was_preserved_into_or_already_existed_is_never_removed(cdir: Path) -> None:
    c = FileCache(5, dir=str(cdir))
    c.put(0, b"x")
    assert c.preserve("kept")
    c.close()
    assert os.listdir(cdir) == [STORE_DIR]
    # Unpinned later: its object is still there until gc, so the store stays.
    st = casstore.open(cdir / STORE_DIR)
    st.unpin("kept")
    with FileCache(5, dir=str(cdir)) as d:
        d.put(0, b"y")
    assert os.listdir(cdir) == [STORE_DIR]
    # A store made by someone else (casstore.open) in dir: never ours to remove, even empty.
    other = cdir.parent / "other"
    casstore.open(other / STORE_DIR)
    with FileCache(5, dir=str(other)) as e:
        e.put(0, b"z")
    assert os.listdir(other) == [STORE_DIR]


@pytest.mark.parametrize("cls", [FileCache, MultiprocessFileCache])
def test_a_removed_cache_directory_is_an_oserror_as_pfio_enoent(cdir: Path, cls: Any) -> None:
    # pfio's test_enoent patches os.pread to raise ENOENT; here the files are really gone.
    c = cls(10, dir=str(cdir))
    import shutil

    shutil.rmtree(cdir / STORE_DIR)
    with pytest.raises(OSError) as e:
        c.put(4, b"4")
    assert e.value.errno == errno.ENOENT
    assert c.get(4) is None  # nothing was stored
    c.close()


# -- do_pickle unpickles what the cache holds (docs/security.md, "Pickled caches") -----------


class _RunsCode:
    """A record that runs code when unpickled, as an attacker's would (here: harmless os.getpid)."""

    def __reduce__(self) -> Any:
        return (os.getpid, ())


def test_do_pickle_runs_what_a_preserved_cache_holds_even_verified_as_pfio_does(cdir: Path) -> None:
    c = FileCache(2, dir=str(cdir), do_pickle=True)
    c.put(0, _RunsCode())
    c.preserve("shared")
    c.close()
    with FileCache(2, dir=str(cdir), do_pickle=True, verify="full") as f:
        assert f.preload("shared")
        assert f.get(0) == os.getpid()  # the hash covered these bytes: integrity, not intent


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the preserved file another owner")
def test_preloading_another_users_cache_with_do_pickle_warns_once(cdir: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    c = FileCache(2, dir=str(cdir), do_pickle=True)
    c.put(0, [1, 2])
    c.put(1, "b")
    c.preserve("theirs")
    c.close()
    with FileCache(2, dir=str(cdir)) as f:
        assert f.preload("theirs")
        path = f.index_cache.path
    assert path is not None
    with caplog.at_level("WARNING", logger="casstore.compat.pfio"):
        for cls in (FileCache, MultiprocessFileCache):  # our own file: no warning
            with cls(2, dir=str(cdir), do_pickle=True) as f:
                assert f.preload("theirs")
        assert caplog.records == []
        os.chown(path, 54321, -1)  # as if another member of a shared store had preserved it
        with FileCache(2, dir=str(cdir)) as f:  # no do_pickle: bytes only, nothing to warn about
            assert f.preload("theirs")
        assert caplog.records == []
        for _ in range(2):
            with FileCache(2, dir=str(cdir), do_pickle=True) as f:
                assert f.preload("theirs") and f.get(0) == [1, 2]  # pfio behaviour is unchanged
        roc = ReadOnlyFileCache(2, dir=str(cdir), do_pickle=True)
        assert roc.preload("theirs") and roc.get(0) == [1, 2]
        roc.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs  # once per file and process, not per preload
    assert "'theirs'" in msgs[0] and "uid 54321" in msgs[0] and "trust" in msgs[0]


# -- pfio code that worked keeps working (bugs found by a bug hunt) ----------------------


@pytest.mark.parametrize("cls", [FileCache, MultiprocessFileCache])
@pytest.mark.parametrize("do_pickle", [False, True])
def test_get_pickles_in_every_state_and_pool_map_returns(cdir: Path, cls: Any, do_pickle: bool) -> None:
    # Bug: pool.map(cache.get, ...) hung once the cache was preserved or preloaded (the frozen
    # get pickled under a name the worker could not find), and with do_pickle=True get was a
    # closure that did not pickle at all.  pfio returns the values in every state.
    value = (lambda i: {"i": i}) if do_pickle else (lambda i: b"v%d" % i)
    c = cls(4, dir=str(cdir), do_pickle=do_pickle)
    for i in range(3):
        c.put(i, value(i))

    def check(cache: Any) -> None:
        get = pickle.loads(pickle.dumps(cache.get))
        assert [get(i) for i in range(4)] == [value(0), value(1), value(2), None]

    check(c)  # live
    c.preserve("pooled")
    check(c)  # preserved (frozen)
    c.close()
    assert pickle.loads(pickle.dumps(c.get))(0) is None  # closed: None, as pfio
    d = cls(4, dir=str(cdir), do_pickle=do_pickle)
    assert d.preload("pooled")
    check(d)  # preloaded
    pool = mp.get_context("fork").Pool(2)
    try:
        assert pool.map_async(d.get, range(4)).get(timeout=60) == [value(0), value(1), value(2), None]
    finally:
        pool.terminate()
        pool.join()
    d.close()


@pytest.mark.parametrize("cls", [FileCache, MultiprocessFileCache])
def test_put_takes_numpy_arrays_and_other_buffers_as_pfio_does(cdir: Path, cls: Any) -> None:
    # Bug: np.ndarray, array.array and mmap (pfio writes any buffer) raised InvalidTypeError.
    import array

    import numpy as np

    with cls(4, dir=str(cdir)) as c:
        assert c.put(0, np.arange(3, dtype=np.uint8)) is True and c.get(0) == b"\x00\x01\x02"
        assert c.put(1, array.array("h", [7])) is True and c.get(1) == array.array("h", [7]).tobytes()
        with pytest.raises(TypeError):  # InvalidTypeError; pfio: a strided array cannot be written either
            c.put(2, np.arange(8)[::2])
        with pytest.raises(TypeError):
            c.put(2, "a str")  # as pfio


@pytest.mark.parametrize("cls", [FileCache, MultiprocessFileCache])
@pytest.mark.parametrize("length", [10, 2])
def test_preload_of_a_cache_of_another_length_is_refused(cdir: Path, cls: Any, length: int) -> None:
    # Bug: preload returned True and served the old cache: get(5) raised while len() said 10,
    # and a shorter cache served indices past its length.  (pfio returns True; see the docs.)
    c = FileCache(3, dir=str(cdir))
    for i in range(3):
        c.put(i, b"v%d" % i)
    c.preserve("three")
    c.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with cls(length, dir=str(cdir)) as f:
                assert f.preload("three") is False
                assert not f.frozen and len(f) == length and f.get(1) is None
                assert f.put(length - 1, b"new") is True  # still this cache: fill it and preserve anew
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs  # once, naming both lengths
    assert "'three'" in msgs[0] and "length 3" in msgs[0] and f"length {length}" in msgs[0]
    with FileCache(3, dir=str(cdir)) as f:
        assert f.preload("three") is True and f.get(2) == b"v2"


@pytest.mark.parametrize("length", [10, 2])
def test_read_only_preload_of_a_cache_of_another_length_raises(cdir: Path, length: int) -> None:
    # Bug: as above; ReadOnlyFileCache reports a failed preload by raising, as pfio's does.
    c = FileCache(3, dir=str(cdir))
    for i in range(3):
        c.put(i, b"v%d" % i)
    c.preserve("three")
    c.close()
    roc = ReadOnlyFileCache(length, dir=str(cdir))
    with pytest.raises(RuntimeError, match=f"preserved with length 3, this cache has length {length}"):
        roc.preload("three")
    assert roc.closed and roc.get(1) is None
    roc = ReadOnlyFileCache(3, dir=str(cdir))
    assert roc.preload("three") and roc.get(2) == b"v2"
    roc.close()


PFIO_NAMES = ["cache-2024-01-01T12:00:00", "train:v1", "~tilde", "with\\backslash", "model@v2",
              "50%", "50%25", "a%3Ab", "a:b", "tab\there", "blake3:abc"]


def test_names_pfio_takes_round_trip_and_never_collide(cdir: Path) -> None:
    # Bug: names pfio takes (':' in a timestamp, '~', '\\') raised InvalidInputError.  They are
    # percent-encoded into pin names; '%' too, so "a:b" and "a%3Ab" stay two caches.
    for k, name in enumerate(PFIO_NAMES):
        c = FileCache(2, dir=str(cdir))
        c.put(0, b"%d" % k)
        assert c.preserve(name) is True
        assert c.preserve(name) is False  # it exists now
        c.close()
    for k, name in enumerate(PFIO_NAMES):
        with MultiprocessFileCache(2, dir=str(cdir)) as f:
            assert f.preload(name) is True and f.get(0) == b"%d" % k, name
        roc = ReadOnlyFileCache(2, dir=str(cdir))
        with pytest.raises(RuntimeError, match="Incomplete"):  # found (it has one of two indices)
            roc.preload(name)
    pins = set(casstore.open(cdir / STORE_DIR).pins())
    assert {"cache-2024-01-01T12%3A00%3A00", "train%3Av1", "a%3Ab", "a%253Ab", "50%25", "50%2525"} <= pins
    assert "my-cache" not in pins and len(pins) == len(PFIO_NAMES)


def test_a_name_that_would_leave_dir_is_not_found_and_not_preserved(cdir: Path) -> None:
    # Bug: preload("../escape") raised InvalidInputError; pfio returns False for a name it cannot find.
    with FileCache(2, dir=str(cdir)) as c:
        c.put(0, b"x")
        for bad in ("../escape", "/abs", "a//b", "", "x/.."):
            assert c.preload(bad) is False
            with pytest.raises(FileNotFoundError):
                ReadOnlyFileCache(2, dir=str(cdir)).preload(bad)
            with pytest.raises(casstore.InvalidInputError, match="cannot preserve a cache named"):
                c.preserve(bad)  # never outside the store (pfio would write outside dir)
        assert not c.frozen and c.preserve("fine") is True


def test_a_dropped_do_pickle_cache_is_freed_without_the_cycle_collector(cdir: Path) -> None:
    # The picklable get (above) is bound to a helper, not to the cache: a cycle through the
    # cache's own get would keep a dropped cache's descriptors open until a gc pass.
    import gc
    import weakref

    c = FileCache(3, dir=str(cdir), do_pickle=True)
    c.put(0, [0])
    c.preserve("dropped")
    ref = weakref.ref(c)
    gc.disable()
    try:
        del c
        assert ref() is None
    finally:
        gc.enable()
