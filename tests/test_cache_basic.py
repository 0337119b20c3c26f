"""IndexCache in one process: put/get, freeze, preserve, open, bad input, canonical layout.

Everything runs on the real filesystem (a store under pytest's tmp_path).
"""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path
from typing import Dict, List, Optional

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casstore
from casstore.cache import ENTRY_KEY, FORMAT, KIND, CacheIndexError, IndexCache


def payload(i: int, n: Optional[int] = None) -> bytes:
    """Deterministic, index-specific bytes (sizes cross the CRC-32 / BLAKE3 boundary at 64 KiB)."""
    if n is None:
        n = (i * 7919) % 3000 if i % 11 else 70_000 + i
    return blake3.blake3(b"rec%d" % i).digest(length=n)


def icache_dirs(store: casstore.Store) -> List[str]:
    return sorted(n for n in os.listdir(store.root / "tmp") if n.endswith(".icache"))


def test_put_get_roundtrip_live_frozen_preserved(store: casstore.Store) -> None:
    sizes = [0, 1, 1024, 64 << 10, (64 << 10) + 1, 3 << 20]  # both checksum kinds, BLAKE3's thread pool
    c = IndexCache(store, length=len(sizes) + 2)
    for i, n in enumerate(sizes):
        assert c.put(i, payload(i, n)) is True
    assert c.count == len(sizes) and c.nbytes == sum(sizes) and len(c) == len(sizes) + 2

    def check(cc: IndexCache) -> None:
        for i, n in enumerate(sizes):
            assert cc.get(i) == payload(i, n)
            assert i in cc
        assert cc.get(len(sizes)) is None and cc.get(len(sizes) + 1) is None
        assert len(sizes) not in cc

    check(c)
    assert not c.frozen
    c.freeze()
    assert c.frozen
    check(c)
    d = c.preserve("runs/cache-a")
    assert c.digest == d and c.name == "runs/cache-a"
    c2 = IndexCache.open(store, "runs/cache-a")
    check(c2)
    assert c2.count == len(sizes) and c2.nbytes == sum(sizes) and c2.length == len(sizes) + 2
    man = store.manifest("runs/cache-a")
    assert man.frozen and dict(man.meta) == {"kind": KIND, "length": len(sizes) + 2, "format": FORMAT}
    assert list(man) == [ENTRY_KEY] and man[ENTRY_KEY].digest == d
    assert man[ENTRY_KEY].size == store.stat(d).size
    # Open by the manifest digest and by the object digest too.
    check(IndexCache.open(store, man.digest))
    check(IndexCache.open(store, str(d)))


def test_first_writer_wins_and_get_missing_is_none(store: casstore.Store) -> None:
    c = IndexCache(store, 4)
    assert c.get(2) is None  # documented: None, never KeyError
    assert c.put(2, b"first") is True
    assert c.put(2, b"second") is False
    assert c.get(2) == b"first"
    assert c.put(3, bytearray(b"ba")) and c.get(3) == b"ba"
    assert c.put(1, memoryview(b"xmvx")[1:3]) and c.get(1) == b"mv"
    c.freeze()
    assert c.get(2) == b"first" and c.get(0) is None


def test_freeze_is_idempotent_and_put_after_freeze_raises(store: casstore.Store) -> None:
    c = IndexCache(store, 3)
    c.put(0, b"a")
    c.freeze()
    c.freeze()
    with pytest.raises(casstore.FrozenError, match=r"put\(1, \.\.\.\) is refused"):
        c.put(1, b"b")
    with pytest.raises(casstore.FrozenError):
        c.put(0, b"a")  # even a duplicate: frozen means frozen
    c.preserve("p")
    opened = IndexCache.open(store, "p")
    with pytest.raises(casstore.FrozenError):
        opened.put(2, b"c")
    assert opened.frozen


def test_bad_input(store: casstore.Store) -> None:
    c = IndexCache(store, 5)
    for bad in (5, -1, 10**30):
        with pytest.raises(CacheIndexError, match=r"valid indices are 0\.\.4"):
            c.put(bad, b"x")
        with pytest.raises(CacheIndexError):
            c.get(bad)
        assert bad not in c
    with pytest.raises(IndexError):  # CacheIndexError is an IndexError too
        c.get(7)
    with pytest.raises(casstore.InvalidInputError):  # ... and an InvalidInputError
        c.get(7)
    for bad_i in ("1", 1.0, None):
        with pytest.raises(casstore.InvalidTypeError, match="an index must be an int"):
            c.get(bad_i)  # type: ignore[arg-type]
        with pytest.raises(casstore.InvalidTypeError):
            c.put(bad_i, b"x")  # type: ignore[arg-type]
    for bad_data in ("text", 5, [1, 2], None):
        with pytest.raises(casstore.InvalidTypeError, match=r"takes bytes, bytearray or memoryview"):
            c.put(0, bad_data)  # type: ignore[arg-type]
    assert c.count == 0
    with pytest.raises(casstore.InvalidTypeError):
        IndexCache(store, "10")  # type: ignore[arg-type]
    with pytest.raises(casstore.InvalidInputError):
        IndexCache(store, -1)
    with pytest.raises(casstore.InvalidInputError, match="max_bytes"):
        IndexCache(store, 3, max_bytes=-5)
    with pytest.raises(casstore.InvalidInputError, match="verify must be one of"):
        IndexCache(store, 3, verify="sometimes")
    with pytest.raises(casstore.InvalidTypeError, match="needs a casstore.Store"):
        IndexCache(42, 3)  # type: ignore[arg-type]
    with pytest.raises(casstore.InvalidTypeError, match=r"casstore.open\(path\)"):
        IndexCache(str(store.root), 3)  # type: ignore[arg-type]  # a path: open the store first
    c.freeze()
    for bad in (5, -1):  # the frozen fast path checks too
        with pytest.raises(CacheIndexError):
            c.get(bad)
    with pytest.raises(casstore.InvalidTypeError):
        c.get("0")  # type: ignore[arg-type]
    with pytest.raises(casstore.InvalidTypeError):
        c.get(0.5)  # type: ignore[arg-type]


def test_open_errors(store: casstore.Store) -> None:
    with pytest.raises(casstore.ObjectNotFoundError, match="no manifest named 'nothing'"):
        IndexCache.open(store, "nothing")
    with store.edit("plain") as m:
        m["weights.bin"] = store.put(b"not a cache")
    store.freeze("plain")
    with pytest.raises(casstore.InvalidInputError, match="'plain' is not an index cache"):
        IndexCache.open(store, "plain")
    d = store.put(b"just some object bytes")
    with pytest.raises(casstore.InvalidInputError, match="not an index cache"):
        IndexCache.open(store, str(d))
    with pytest.raises(casstore.InvalidInputError):
        IndexCache.open(store, "plain", verify="never")
    # A manifest claiming to be a newer cache format is refused with a clear error.
    c = IndexCache(store, 1)
    c.put(0, b"z")
    obj = c.preserve("ok")
    from casstore.manifests.model import Entry, encode_manifest

    md = store.put(encode_manifest({ENTRY_KEY: Entry(obj, store.stat(obj).size)},
                                   {"kind": KIND, "length": 1, "format": FORMAT + 1}, None))
    store.pin("future", md)
    with pytest.raises(casstore.StoreFormatError, match="newer than this casstore"):
        IndexCache.open(store, "future")


def test_preserve_name_conflicts(store: casstore.Store) -> None:
    a = IndexCache(store, 2)
    a.put(0, b"a")
    da = a.preserve("shared-name")
    assert a.preserve("shared-name") == da  # again: a no-op
    b = IndexCache(store, 2)
    b.put(0, b"b")
    with pytest.raises(casstore.FrozenError, match="already pinned to a different cache"):
        b.preserve("shared-name")
    assert IndexCache.open(store, "shared-name").get(0) == b"a"
    with pytest.raises(casstore.InvalidInputError):
        b.preserve("../escape")
    with store.edit("a-head") as m:
        m["k"] = store.put(b"v")
    with pytest.raises(casstore.InvalidInputError, match="is a head"):
        b.preserve("a-head")


def _frozen_bytes(c: IndexCache) -> bytes:
    assert c.path is not None
    return Path(c.path).read_bytes()


def test_layout_is_order_of_arrival_and_freeze_never_copies(store: casstore.Store) -> None:
    """Records sit in the order they were put; freeze appends the table to the one data file in
    place whatever the order, so identical in-order runs still give one object, and a reversed
    fill gives a different file with the same records."""
    n = 300
    recs = {i: payload(i) for i in range(n) if i % 7}
    in_order = IndexCache(store, n)
    for i in sorted(recs):
        in_order.put(i, recs[i])
    reverse = IndexCache(store, n)
    for i in sorted(recs, reverse=True):
        reverse.put(i, recs[i])
    dup = IndexCache(store, n)
    for i in sorted(recs):
        dup.put(i, recs[i])
        assert not dup.put(i, b"refused before anything is written")
    inodes = {}
    for c in (in_order, reverse, dup):
        assert c._dir is not None
        inodes[id(c)] = os.stat(c._dir / "data.0").st_ino
        c.freeze()
        # The data file *became* the frozen file: same inode, no data file left, no copy made.
        assert c.path is not None and os.stat(c.path).st_ino == inodes[id(c)]
        assert not list(c._dir.glob("data.*"))
        assert os.path.getsize(c.path) == 64 + sum(map(len, recs.values())) + (-sum(map(len, recs.values())) % 8) \
            + 32 * n + 64
    assert _frozen_bytes(in_order) == _frozen_bytes(dup) != _frozen_bytes(reverse)
    assert all(reverse.get(i) == in_order.get(i) for i in range(n))
    before = {p for p in (store.root / "objects").rglob("*") if p.is_file()}
    d1 = in_order.preserve("run-1")
    d2 = reverse.preserve("run-2")
    d3 = dup.preserve("run-1")  # same content, same name: no-op
    assert d1 == d3 != d2
    after = {p for p in (store.root / "objects").rglob("*") if p.is_file()}
    assert len(after - before) == 4  # two cache objects and two manifests, for three caches
    assert IndexCache.open(store, "run-2").get(1) == recs[1]


def test_preserve_does_not_copy_the_data(store: casstore.Store) -> None:
    c = IndexCache(store, 64)
    for i in range(64):
        c.put(i, payload(i, 4096))
    d = c.preserve("nocopy")
    obj = store.path(d)
    assert c.path is not None
    assert os.stat(obj).st_ino == os.stat(c.path).st_ino  # the frozen file is the object (hard link)
    assert os.stat(obj).st_mode & 0o777 == 0o444
    c.close()  # removes the live directory (one of the two names); the object stays
    assert obj.exists() and os.stat(obj).st_nlink == 1
    assert IndexCache.open(store, "nocopy").get(5) == payload(5, 4096)
    assert store.get(d)[:8] == b"CSICACHE"


def test_max_bytes(store: casstore.Store) -> None:
    c = IndexCache(store, 10, max_bytes=1000)
    assert c.put(0, b"x" * 600)
    assert c.put(1, b"y" * 500) is False  # would exceed: refused, nothing stored
    assert c.get(1) is None and c.nbytes == 600
    assert c.put(2, b"z" * 400)  # exactly reaches the limit
    assert c.put(3, b"w") is False
    assert c.put(4, b"") is True  # empty records never exceed it
    c.freeze()
    assert c.count == 3 and c.nbytes == 1000
    assert [c.get(i) for i in range(5)] == [b"x" * 600, None, b"z" * 400, None, b""]
    assert IndexCache(store, 1, max_bytes=0).put(0, b"a") is False


def test_close_removes_the_live_directory_but_not_the_preserved_object(store: casstore.Store) -> None:
    c = IndexCache(store, 3)
    c.put(0, b"a")
    assert len(icache_dirs(store)) == 1
    c.close()
    assert icache_dirs(store) == []
    with pytest.raises(casstore.InvalidInputError, match="closed"):
        c.get(0)
    with IndexCache(store, 3) as c2:
        c2.put(1, b"b")
        d = c2.preserve("kept")
    assert icache_dirs(store) == []
    assert IndexCache.open(store, "kept").get(1) == b"b"
    assert store.contains(d)
    c3 = IndexCache(store, 3)
    del c3  # garbage collection removes it too (weakref.finalize)
    import gc

    gc.collect()
    assert icache_dirs(store) == []


def test_zero_length_cache(store: casstore.Store) -> None:
    c = IndexCache(store, 0)
    with pytest.raises(CacheIndexError):
        c.put(0, b"x")
    c.freeze()
    c.preserve("empty")
    e = IndexCache.open(store, "empty")
    assert e.length == 0 and e.count == 0
    with pytest.raises(CacheIndexError):
        e.get(0)


def test_pickle_roundtrip_in_process(store: casstore.Store) -> None:
    c = IndexCache(store, 8)
    c.put(0, b"zero")
    twin = pickle.loads(pickle.dumps(c))
    assert twin.get(0) == b"zero"
    assert twin.put(1, b"one")  # a put through the copy is seen by the original
    assert c.get(1) == b"one"
    c.freeze()
    assert twin.frozen and twin.get(1) == b"one"  # the copy notices the freeze
    with pytest.raises(casstore.FrozenError):
        twin.put(2, b"two")
    frozen_twin = pickle.loads(pickle.dumps(c))
    assert frozen_twin.get(0) == b"zero"
    c.preserve("pickled")
    opened = IndexCache.open(store, "pickled")
    assert pickle.loads(pickle.dumps(opened)).get(1) == b"one"
    c.close()
    with pytest.raises(casstore.InvalidInputError, match="closed"):
        pickle.dumps(c)


def test_threads_share_one_cache(store: casstore.Store) -> None:
    n = 4000
    c = IndexCache(store, n)
    won: Dict[int, int] = {}
    lock = threading.Lock()

    def work(t: int) -> None:
        order = range(n) if t % 2 == 0 else range(n - 1, -1, -1)
        for i in order:
            if c.put(i, payload(i, 1 + i % 300)):
                with lock:
                    won[i] = won.get(i, 0) + 1

    ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert won == {i: 1 for i in range(n)}
    assert all(c.get(i) == payload(i, 1 + i % 300) for i in range(n))
    c.freeze()
    assert all(c.get(i) == payload(i, 1 + i % 300) for i in range(n))


def test_verify_modes_all_read_the_same(store: casstore.Store) -> None:
    for mode in ("full", "record", "open"):
        c = IndexCache(store, 20, verify=mode)
        for i in range(0, 20, 2):
            c.put(i, payload(i))
        c.freeze()
        assert [c.get(i) for i in range(20)] == [payload(i) if i % 2 == 0 else None for i in range(20)]
        c.preserve(f"mode-{mode}")
        for m2 in ("full", "record", "open"):
            o = IndexCache.open(store, f"mode-{mode}", verify=m2)
            assert o.verify_mode == m2
            assert [o.get(i) for i in range(20)] == [payload(i) if i % 2 == 0 else None for i in range(20)]
            assert o.verify() == 10


def test_gc_keeps_a_preserved_cache_until_unpinned(store: casstore.Store) -> None:
    c = IndexCache(store, 4)
    c.put(0, b"data" * 100)
    d = c.preserve("gc-me")
    c.close()
    assert d not in set(store.plan_gc(grace=0).objects)
    store.unpin("gc-me")
    plan = store.plan_gc(grace=0)
    assert d in set(plan.objects)
    plan.execute()
    assert not store.contains(d)


def test_cli_cache_info_and_verify(store: casstore.Store, capsys: pytest.CaptureFixture[str]) -> None:
    from casstore.cli import main

    c = IndexCache(store, 10)
    for i in range(4):
        c.put(i, payload(i, 100))
    d = c.preserve("cli-cache")
    assert main(["--store", str(store.root), "cache", "info", "cli-cache"]) == 0
    out = capsys.readouterr().out
    assert "4 of 10 indices" in out and str(d) in out
    assert main(["--store", str(store.root), "cache", "info", "cli-cache", "--json"]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    assert info["records"] == 4 and info["digest"] == str(d) and info["length"] == 10
    assert main(["--store", str(store.root), "cache", "verify", "cli-cache"]) == 0
    with store.edit("not-cache") as m:
        m["x"] = store.put(b"x")
    assert main(["--store", str(store.root), "cache", "info", "not-cache"]) == 1
    assert "is not an index cache" in capsys.readouterr().err
    path = store.path(d)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(70)
        b = f.read(1)
        f.seek(70)
        f.write(bytes([b[0] ^ 1]))
    assert main(["--store", str(store.root), "cache", "verify", "cli-cache"]) == 1
    assert "damaged" in capsys.readouterr().err


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 39), st.binary(max_size=300)), max_size=60),
       mode=st.sampled_from(["full", "record", "open"]))
def test_model_hypothesis(tmp_path_factory: pytest.TempPathFactory, ops: List[tuple[int, bytes]],
                          mode: str) -> None:
    store = casstore.open(tmp_path_factory.mktemp("hyp") / "store", durable=False)
    c = IndexCache(store, 40, verify=mode)
    model: Dict[int, bytes] = {}
    for i, data in ops:
        assert c.put(i, data) == (i not in model)
        model.setdefault(i, data)
    assert [c.get(i) for i in range(40)] == [model.get(i) for i in range(40)]
    c.freeze()
    assert [c.get(i) for i in range(40)] == [model.get(i) for i in range(40)]
    assert c.count == len(model) and c.nbytes == sum(len(v) for v in model.values())
    c.preserve("h")
    o = IndexCache.open(store, "h", verify=mode)
    assert [o.get(i) for i in range(40)] == [model.get(i) for i in range(40)]
    assert [i in o for i in range(40)] == [i in model for i in range(40)]
    o.close()
    c.close()


def test_subclasses_keep_their_class_and_read_the_same(store: casstore.Store) -> None:
    class Mine(IndexCache):
        __slots__ = ()

    for mode in ("full", "open"):
        c = Mine(store, 6, verify=mode)
        c.put(1, b"one")
        c.put(4, payload(4, 70_000))
        c.freeze()
        assert type(c) is Mine  # frozen reads work without switching a user's class
        assert [c.get(i) for i in range(6)] == [None, b"one", None, None, payload(4, 70_000), None]
        with pytest.raises(CacheIndexError):
            c.get(6)
        c.close()
    plain = IndexCache(store, 2)
    plain.put(0, b"x")
    plain.freeze()
    assert isinstance(plain, IndexCache)
    plain.close()
    assert type(plain) is IndexCache  # closed: back to the base class, every read refused
    with pytest.raises(casstore.InvalidInputError, match="closed"):
        plain.get(0)


def test_a_preserved_cache_opens_read_only_for_another_user(world_dir: Path) -> None:
    from conftest import run_as_nobody

    store = casstore.open(world_dir / "store")
    c = IndexCache(store, 5)
    for i in range(5):
        c.put(i, payload(i, 100))
    c.preserve("shared/train")
    c.close()
    out = run_as_nobody("""
import casstore.cache
c = casstore.IndexCache.open(casstore.open(sys.argv[1]), "shared/train")
out = {"ok": [c.get(i).hex() for i in range(5)]}
try:
    casstore.IndexCache(casstore.open(sys.argv[1]), 3)
except casstore.ReadOnlyError as e:
    out["live"] = str(e)
""", str(world_dir / "store"))
    assert out["ok"] == [payload(i, 100).hex() for i in range(5)]
    assert "cannot create an index cache" in out["live"]


def test_large_records_are_placed_clear_of_4k_aliasing(store: casstore.Store) -> None:
    """A large record never starts 1-63 bytes past its source buffer modulo 4 KiB (the kernel's
    copy then runs 2x slower here): up to 63 zero bytes go first.  Small records stay back to back."""
    from casstore.cache import _address

    big = [os.urandom((256 << 10) + k) for k in range(5)]
    c = IndexCache(store, 8)
    assert c.put(0, b"small")  # data end 64 + 5
    for k, b in enumerate(big):
        assert c.put(k + 1, memoryview(b) if k % 2 else b)
    assert c.put(6, b"")
    c.freeze()
    offs = [c._qo[i] for i in range(7)]
    assert offs[0] == 64
    for k, b in enumerate(big):
        assert (offs[k + 1] - _address(b)) % 4096 not in range(1, 64)
        assert 0 <= offs[k + 1] - (offs[k] + (5 if k == 0 else len(big[k - 1]))) < 64
    assert c.path is not None
    raw = c.path.read_bytes()
    assert raw[69:offs[1]] == bytes(offs[1] - 69)  # the padding is zeros
    assert (offs[1] > 69) == ((69 - _address(big[0])) % 4096 in range(1, 64))  # padded only when needed
    assert [c.get(i) for i in range(1, 6)] == big and c.get(6) == b"" and c.verify() == 7
    d = c.preserve("aligned")
    o = IndexCache.open(store, d, verify="full")
    assert [o.get(i) for i in range(1, 6)] == big


def test_lock_timeout_is_checked_at_construction(store: casstore.Store) -> None:
    # Bug: accepted as given; "10" was a raw TypeError at the first contended put, NaN waited
    # forever, a negative timed out at once.
    for bad_type in ("10", True, [1], b"1"):
        with pytest.raises(casstore.InvalidTypeError, match="lock_timeout must be a number of seconds"):
            IndexCache(store, 3, lock_timeout=bad_type)  # type: ignore[arg-type]
    for bad_value in (float("nan"), -1, -0.5, float("-inf")):
        with pytest.raises(casstore.InvalidInputError, match="lock_timeout must be a non-negative"):
            IndexCache(store, 3, lock_timeout=bad_value)
    assert icache_dirs(store) == []  # refused before anything was created
    for ok, kept in ((0, 0.0), (2.5, 2.5), (10, 10.0), (None, None), (float("inf"), None)):
        with IndexCache(store, 3, lock_timeout=ok) as c:
            assert c.lock_timeout == kept
            assert c.put(0, b"x") and c.get(0) == b"x"
            assert pickle.loads(pickle.dumps(c)).lock_timeout == kept


def test_put_of_a_released_memoryview_is_a_typed_error(store: casstore.Store) -> None:
    # Bug: a raw ValueError "operation forbidden on released memoryview object".
    c = IndexCache(store, 3)
    for mv in (memoryview(b"abc"), memoryview(b"abcdef")[::2], memoryview(bytearray(8)).cast("Q")):
        mv.release()
        with pytest.raises(casstore.InvalidInputError, match="released memoryview"):
            c.put(1, mv)
    assert c.count == 0 and c.get(1) is None


@pytest.mark.parametrize("mode", ["once", "full", "record", "open"])
def test_frozen_get_types_its_index_like_the_live_get(store: casstore.Store, mode: str) -> None:
    # Bug: on a frozen cache get(np.array([0, 1])) raised numpy's raw "truth value of an
    # array is ambiguous" ValueError (``i < 0`` ran before any type check).
    np = pytest.importorskip("numpy")
    c = IndexCache(store, 5, verify=mode)
    for i in (0, 1, 3):
        c.put(i, payload(i))
    bad = (np.array([0, 1]), np.array([1]), np.array([], dtype=np.int64), np.array([[0]]), True, False,
           np.True_, 1.0, "1", None, slice(0, 2), [0])
    good = ((np.int64(1), payload(1)), (np.uint8(3), payload(3)), (np.array(0), payload(0)), (np.int32(2), None))

    def check(cache: IndexCache) -> None:
        for x in bad:
            with pytest.raises(casstore.InvalidTypeError, match="an index must be an int"):
                cache.get(x)
            assert x not in cache
        for x, want in good:
            assert cache.get(x) == want
        for x in (np.int64(-1), np.int64(5), -1, 5, 10**30):
            with pytest.raises(CacheIndexError):
                cache.get(x)

    check(c)  # live
    c.freeze()
    check(c)  # frozen in place
    c.preserve(f"typed-{mode}")
    check(IndexCache.open(store, f"typed-{mode}", verify=mode))  # mapped from the preserved object


@pytest.mark.parametrize("mode", ["once", "full", "record", "open"])
def test_a_bound_get_pickles_in_every_state(store: casstore.Store, mode: str) -> None:
    # Bug: a frozen cache's get pickled as getattr(cache, "_frozen_get_once"), which the
    # unpickling side could not find, so Pool().map(cache.get, ...) never got its results.
    c = IndexCache(store, 3, verify=mode)
    c.put(1, b"one")

    def roundtrip(cache: IndexCache) -> None:
        get = pickle.loads(pickle.dumps(cache.get))
        assert get(1) == b"one" and get(0) is None
        with pytest.raises(CacheIndexError):
            get(3)

    roundtrip(c)  # live
    c.freeze()
    roundtrip(c)  # frozen
    c.preserve(f"bound-{mode}")
    roundtrip(c)  # preserved
    roundtrip(IndexCache.open(store, f"bound-{mode}", verify=mode))  # opened again


def test_put_takes_any_c_contiguous_buffer(store: casstore.Store) -> None:
    # Bug: only bytes, bytearray and memoryview were taken; pfio code puts numpy arrays,
    # array.array and mmaps (any buffer), which raised InvalidTypeError after switching.
    import array
    import mmap

    import numpy as np

    c = IndexCache(store, 8)
    grid = np.arange(6, dtype=np.float64).reshape(2, 3)
    m = mmap.mmap(-1, 5)
    m.write(b"hello")
    assert c.put(0, np.arange(3, dtype=np.uint8)) and c.get(0) == b"\x00\x01\x02"
    assert c.put(1, grid) and c.get(1) == grid.tobytes()  # n-dimensional, any item format
    assert c.put(2, array.array("i", [1, 2])) and c.get(2) == array.array("i", [1, 2]).tobytes()
    assert c.put(3, m) and c.get(3) == b"hello"
    m.close()  # the put kept no export of the map: it closes
    assert c.put(4, np.zeros(0)) and c.get(4) == b""
    for strided in (np.arange(10)[::2], np.asfortranarray(grid)):
        with pytest.raises(casstore.InvalidTypeError, match="non-contiguous ndarray.*ascontiguousarray"):
            c.put(5, strided)
    with pytest.raises(casstore.InvalidTypeError, match="or another buffer"):
        c.put(5, {"not": "a buffer"})  # type: ignore[arg-type]
    assert c.get(5) is None
    c.freeze()
    assert c.get(1) == grid.tobytes() and c.get(3) == b"hello"
