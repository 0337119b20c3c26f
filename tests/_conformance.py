"""Conformance suites for the object and refs protocols (not collected: no ``test_`` prefix).

In the style of zarr-python's ``zarr.testing.store.StoreTests``: one class per
protocol, holding every contract as a test; each implementation's test module
subclasses it and provides

* a fixture giving the store under test (``objects`` or ``refs``), empty;
* ``opener(store)``: a picklable, argument-free callable that opens *another
  handle on the same store* -- run in freshly spawned processes for the races
  (real processes, real storage: nothing is mocked);
* for objects, ``tamper(store, digest)``: damage the stored bytes for real
  (rewrite the local file, overwrite the S3 key without the create-only
  condition), keeping the object's size;
* for refs, ``damage(refs, kind, name)``: make an existing ref unreadable for
  real (a local name's newest claim points at garbage and its ref file is gone;
  an S3 ref key holds garbage).

Contracts (issue 10): create-only and idempotent writes; bytes that do not
hash to the digest are refused and nothing is stored; a missing object is
:class:`ObjectNotFoundError` from ``stat``/``open``/``read``; ``has``/``has_many``;
``iter_digests`` lists exactly what was written; ``delete``; N processes
creating the same object all succeed and leave one intact object; a tampered
object is detected on read.  Refs: a missing ref reads as ``None``;
create-if-absent; a stale token loses; N processes racing a compare-and-swap
from the same read, or racing to create, have exactly one winner; listing;
a damaged ref is never dropped from a listing (``list`` raises, ``scan`` names it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from typing import Any, Callable, List, Tuple

import pytest

from casstore.digest import Digest
from casstore.errors import IntegrityError, ObjectNotFoundError, StoreFormatError
from casstore.objects.base import ObjectStore
from casstore.refs.base import RefStore

N_PROCS = 6
_SPAWN = mp.get_context("spawn")  # no fork: the parent has boto3 and blake3 threads running


def digest_of(data: bytes) -> Digest:
    """The digest of ``data`` (through the public Digest API)."""
    return Digest.of(data)


# -- children (module level: spawned processes import them) ----------------------------------


def _child_write(opener: Callable[[], ObjectStore], hexd: str, data: bytes, barrier: Any, out: Any) -> None:
    try:
        store = opener()
        d = Digest(hexd)
        store.has(d)  # warm up (an S3 client, a directory lookup) so the writes race for real
        barrier.wait(120)
        out.put(("ok", store.write(d, data)))
    except BaseException as e:  # reported to the parent, which fails the test with it
        out.put(("error", f"{type(e).__name__}: {e}"))


def _child_cas(opener: Callable[[], RefStore], kind: str, name: str, new_hex: str, from_read: bool,
               barrier: Any, out: Any) -> None:
    try:
        refs = opener()
        expected = refs.read(kind, name) if from_read else None  # every child reads before any writes
        barrier.wait(120)
        out.put(("ok", new_hex, refs.compare_and_swap(kind, name, Digest(new_hex), expected)))
    except BaseException as e:
        out.put(("error", f"{type(e).__name__}: {e}", False))


def run_children(target: Callable[..., None], args: List[Tuple[Any, ...]]) -> List[Tuple[Any, ...]]:
    """Run ``target(*a, barrier, queue)`` in one spawned process per ``a``; their results, in finishing order."""
    barrier = _SPAWN.Barrier(len(args))
    out = _SPAWN.Queue()
    procs = [_SPAWN.Process(target=target, args=(*a, barrier, out)) for a in args]
    for p in procs:
        p.start()
    try:
        results = []
        for _ in procs:
            try:
                results.append(out.get(timeout=180))
            except queue.Empty:
                pytest.fail("a child process never reported (hung or died)")
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, f"child exited with {p.exitcode}"
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# -- objects ------------------------------------------------------------------------------------


class ObjectStoreTests:
    """The object-store protocol's contracts; subclass and provide ``objects``, ``opener`` and ``tamper``."""

    @pytest.fixture
    def objects(self) -> ObjectStore:
        raise NotImplementedError("a subclass provides the store under test")

    def opener(self, objects: ObjectStore) -> Callable[[], ObjectStore]:
        raise NotImplementedError

    def tamper(self, objects: ObjectStore, digest: Digest) -> None:
        raise NotImplementedError

    def test_write_is_create_only_and_idempotent(self, objects: ObjectStore) -> None:
        data = os.urandom(10_000)
        d = digest_of(data)
        assert objects.write(d, data) is True
        assert objects.write(d, data) is False  # already there: success, nothing new
        assert objects.write(d, memoryview(data)) is False
        assert objects.has(d) and d in objects
        assert objects.read(d) == data
        info = objects.stat(d)
        assert info.digest == d and info.size == len(data)
        assert list(objects.iter_digests()) == [d]

    def test_empty_object(self, objects: ObjectStore) -> None:
        d = digest_of(b"")
        assert objects.write(d, b"") is True
        assert objects.read(d) == b"" and objects.stat(d).size == 0
        with objects.open(d) as f:
            assert f.read() == b""

    def test_write_of_wrong_bytes_is_refused_and_stores_nothing(self, objects: ObjectStore) -> None:
        good, bad = b"the bytes the digest names", b"other bytes"
        d = digest_of(good)
        with pytest.raises(IntegrityError):
            objects.write(d, bad)
        assert not objects.has(d)
        assert list(objects.iter_digests()) == []
        with pytest.raises(ObjectNotFoundError):
            objects.read(d)

    def test_missing_object(self, objects: ObjectStore) -> None:
        d = digest_of(b"never written")
        assert not objects.has(d) and d not in objects
        for call in (lambda: objects.stat(d), lambda: objects.open(d), lambda: objects.read(d),
                     lambda: objects.read(d, verify=False)):
            with pytest.raises(ObjectNotFoundError) as ei:
                call()
            assert isinstance(ei.value, LookupError)
            assert d.hex[:12] in str(ei.value)

    def test_prefetch_is_a_hint_that_changes_nothing(self, objects: ObjectStore) -> None:
        data = os.urandom(5000)
        d, missing = digest_of(data), digest_of(b"never written")
        objects.write(d, data)
        objects.prefetch([d, missing, d])  # a missing object is no error: the read after it says so
        objects.prefetch([])
        assert list(objects.iter_digests()) == [d] and objects.read(d) == data and not objects.has(missing)

    def test_has_and_has_many(self, objects: ObjectStore) -> None:
        blobs = [os.urandom(100 + i) for i in range(8)]
        ds = [digest_of(b) for b in blobs]
        for d, b in list(zip(ds, blobs, strict=True))[::2]:
            objects.write(d, b)
        assert [objects.has(d) for d in ds] == [i % 2 == 0 for i in range(8)]
        assert objects.has_many(ds) == set(ds[::2])
        assert objects.has_many([]) == set()

    def test_iter_digests_lists_exactly_what_was_written(self, objects: ObjectStore) -> None:
        blobs = [os.urandom(50 + i) for i in range(20)] + [b""]
        ds = {digest_of(b) for b in blobs}
        for b in blobs:
            objects.write(digest_of(b), b)
        listed = list(objects.iter_digests())
        assert listed == sorted(ds)  # each once, in digest order

    def test_open_streams_the_bytes(self, objects: ObjectStore) -> None:
        data = os.urandom(3 << 20)
        d = digest_of(data)
        objects.write(d, data)
        with objects.open(d) as f:
            parts = []
            while chunk := f.read(1 << 16):
                parts.append(chunk)
        assert b"".join(parts) == data

    def test_delete(self, objects: ObjectStore) -> None:
        if not objects.supports_delete:
            pytest.skip("append-only store")
        data = b"to be deleted"
        d = digest_of(data)
        keep = digest_of(b"to be kept")
        objects.write(d, data)
        objects.write(keep, b"to be kept")
        assert objects.delete(d) is True
        assert not objects.has(d) and objects.has(keep)
        with pytest.raises(ObjectNotFoundError):
            objects.read(d)
        assert objects.delete(d) is False
        assert list(objects.iter_digests()) == [keep]
        assert objects.write(d, data) is True  # and it can be written again

    def test_tampered_object_is_detected_on_read(self, objects: ObjectStore) -> None:
        data = os.urandom(64 << 10)
        d = digest_of(data)
        objects.write(d, data)
        self.tamper(objects, d)
        with pytest.raises(IntegrityError) as ei:
            objects.read(d)
        assert d.hex[:12] in str(ei.value)
        with pytest.raises(IntegrityError):
            with objects.open(d) as f:
                while f.read(1 << 14):
                    pass
        got = objects.read(d, verify=False)  # asked for: the damaged bytes, unverified
        assert len(got) == len(data) and got != data
        assert objects.write(d, data) is False  # create-only: a write never "repairs" by overwriting

    def test_processes_creating_the_same_object_all_succeed(self, objects: ObjectStore) -> None:
        data = os.urandom(2 << 20)
        d = digest_of(data)
        results = run_children(_child_write, [(self.opener(objects), d.hex, data)] * N_PROCS)
        errors = [r for r in results if r[0] != "ok"]
        assert not errors, errors
        assert sum(1 for r in results if r[1] is True) >= 1  # someone created it
        assert list(objects.iter_digests()) == [d]  # one object
        assert objects.read(d) == data  # the right bytes


# -- refs ---------------------------------------------------------------------------------------


class RefStoreTests:
    """The refs protocol's contracts; subclass and provide ``refs`` and ``opener``."""

    @pytest.fixture
    def refs(self) -> RefStore:
        raise NotImplementedError("a subclass provides the refs under test")

    def opener(self, refs: RefStore) -> Callable[[], RefStore]:
        raise NotImplementedError

    def damage(self, refs: RefStore, kind: str, name: str) -> None:
        raise NotImplementedError("a subclass damages a ref of its implementation for real")

    d1, d2, d3 = (digest_of(x) for x in (b"one", b"two", b"three"))

    def test_read_missing_is_none(self, refs: RefStore) -> None:
        assert refs.read("heads", "nope") is None
        assert refs.get("pins", "nope") is None
        assert refs.list("heads") == {} and refs.list("pins") == {}

    def test_create_if_absent(self, refs: RefStore) -> None:
        assert refs.compare_and_swap("heads", "x", self.d1, None) is True
        assert refs.compare_and_swap("heads", "x", self.d2, None) is False  # exists now
        got = refs.read("heads", "x")
        assert got is not None and got.digest == self.d1
        assert refs.read("pins", "x") is None  # kinds are separate

    def test_stale_token_loses(self, refs: RefStore) -> None:
        assert refs.compare_and_swap("heads", "x", self.d1, None)
        first = refs.read("heads", "x")
        assert first is not None
        assert refs.compare_and_swap("heads", "x", self.d2, first) is True
        assert refs.compare_and_swap("heads", "x", self.d3, first) is False  # read before the move
        now = refs.read("heads", "x")
        assert now is not None and now.digest == self.d2
        assert refs.compare_and_swap("heads", "x", self.d3, now) is True
        assert refs.get("heads", "x") == self.d3

    def test_remove_by_compare_and_swap(self, refs: RefStore) -> None:
        assert refs.compare_and_swap("heads", "x", self.d1, None)
        first = refs.read("heads", "x")
        assert first is not None
        assert refs.compare_and_swap("heads", "x", self.d2, first)
        assert refs.compare_and_swap("heads", "x", None, first) is False  # stale: not removed
        assert refs.get("heads", "x") == self.d2
        now = refs.read("heads", "x")
        assert refs.compare_and_swap("heads", "x", None, now) is True
        assert refs.read("heads", "x") is None
        assert refs.compare_and_swap("heads", "x", self.d1, None) is True  # and it can be created again

    def test_list(self, refs: RefStore) -> None:
        for name, d in (("b", self.d2), ("a", self.d1), ("dir/c", self.d3)):
            assert refs.compare_and_swap("heads", name, d, None)
        assert refs.compare_and_swap("pins", "p", self.d1, None)
        heads = refs.list("heads")
        assert heads == {"a": self.d1, "b": self.d2, "dir/c": self.d3}
        assert list(heads) == ["a", "b", "dir/c"]  # sorted by name
        assert refs.list("pins") == {"p": self.d1}

    def test_a_damaged_ref_is_never_dropped_from_a_listing(self, refs: RefStore) -> None:
        # Hazard: a listing that skipped it hid the name from ls and verify, and gc (whose roots are
        # the listing) deleted every object the name held.
        for name, d in (("a", self.d1), ("bad", self.d2), ("z", self.d3)):
            assert refs.compare_and_swap("heads", name, d, None)
        self.damage(refs, "heads", "bad")
        with pytest.raises(StoreFormatError, match="head 'bad' cannot be read"):
            refs.list("heads")
        got = refs.scan("heads")
        assert got.refs == {"a": self.d1, "z": self.d3}
        assert list(got.damaged) == ["bad"] and got.damaged["bad"]
        assert refs.list("pins") == {}  # the other kind is unaffected

    def test_processes_racing_a_compare_and_swap_one_winner(self, refs: RefStore) -> None:
        assert refs.compare_and_swap("heads", "race", self.d1, None)
        news = [digest_of(f"writer {i}".encode()) for i in range(N_PROCS)]
        results = run_children(_child_cas, [(self.opener(refs), "heads", "race", n.hex, True) for n in news])
        errors = [r for r in results if r[0] != "ok"]
        assert not errors, errors
        winners = [r[1] for r in results if r[2] is True]
        assert len(winners) == 1, results
        assert refs.get("heads", "race") == Digest(winners[0])

    def test_processes_racing_to_create_one_winner(self, refs: RefStore) -> None:
        news = [digest_of(f"creator {i}".encode()) for i in range(N_PROCS)]
        results = run_children(_child_cas, [(self.opener(refs), "pins", "new", n.hex, False) for n in news])
        errors = [r for r in results if r[0] != "ok"]
        assert not errors, errors
        winners = [r[1] for r in results if r[2] is True]
        assert len(winners) == 1, results
        assert refs.get("pins", "new") == Digest(winners[0])
