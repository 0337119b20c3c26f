"""store.derive: memoized, recorded, run once across processes, never partially visible.

``fn`` counts its runs by appending a line to a counter file, so "no work" and
"ran once" are asserted on what actually ran.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import h5py
import numpy as np
import pytest
from _fetch_helpers import (
    SPAWN,
    Server,
    assert_objects_valid,
    b3,
    clean_settings_env,
    counting_fn,
    derive_worker,
    holds_open,
    object_files,
    results,
    serve,
    slow_fn,
    tmp_names,
    wait_until,
)

import casstore
from casstore.errors import InvalidDigestError, InvalidInputError, InvalidTypeError, LockTimeout, ObjectNotFoundError
from casstore.pipelines import derive_key


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


@pytest.fixture
def counter(tmp_path: Path) -> Path:
    p = tmp_path / "runs.txt"
    p.touch()
    return p


def runs(counter: Path) -> List[str]:
    return counter.read_text().split()


def lock_file(store: casstore.Store, name: str) -> Path:
    return store.refs.lock(name).path


# -- memoization ----------------------------------------------------------------------


def test_same_key_is_memoized_and_recorded(store: casstore.Store, counter: Path) -> None:
    src = store.put(b"abcdef" * 1000)
    fn = functools.partial(counting_fn, str(counter), 0.0)
    t0 = time.time()
    m = store.derive("rev", inputs={"src": src}, params={"n": 1, "tags": ["a", "b"]}, fn=fn, version=2)
    assert runs(counter) == [str(os.getpid())]
    assert isinstance(m, casstore.Manifest) and list(m) == ["result.bin"]
    assert store.get(m["result.bin"].digest) == (b"abcdef" * 1000)[::-1]
    assert m["result.bin"].size == 6000
    # Same key: no work, the same recorded result (also through a fresh Store object).
    m2 = store.derive("rev", inputs={"src": src}, params={"tags": ["a", "b"], "n": 1}, fn=fn, version=2)
    m3 = casstore.open(store.root).derive("rev", inputs={"src": str(src)}, params={"n": 1, "tags": ["a", "b"]},
                                          fn=fn, version=2)
    assert runs(counter) == [str(os.getpid())]
    assert m2.digest == m.digest == m3.digest and dict(m2) == dict(m)
    # The record answers "which inputs and parameters made this?"
    rec = store.manifest("rev").meta["derive"]
    assert store.manifest("rev").digest == m.digest
    assert rec["inputs"] == {"src": str(src)}
    assert rec["params"] == {"n": 1, "tags": ["a", "b"]}
    assert rec["version"] == 2
    assert rec["key"] == derive_key("rev", {"src": ("object", src)}, {"n": 1, "tags": ["a", "b"]}, 2)
    assert isinstance(rec["seconds"], float) and 0 <= rec["seconds"] < 60
    assert t0 - 1 <= rec["started"] <= time.time()
    assert "counting_fn" in rec["fn"]
    assert tmp_names(store.root) == []


def test_changes_recompute(store: casstore.Store, counter: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = store.put(b"first input")
    b = store.put(b"second input")
    fn = functools.partial(counting_fn, str(counter), 0.0)

    def go(src: Any = a, params: Any = None, **kw: Any) -> casstore.Manifest:
        return store.derive("job", inputs={"src": src}, params=params or {"p": 1}, fn=fn, **kw)

    m = go()
    assert len(runs(counter)) == 1
    go()
    assert len(runs(counter)) == 1
    mb = go(src=b)  # changed input
    assert len(runs(counter)) == 2 and store.get(mb["result.bin"].digest) == b"second input"[::-1]
    assert store.manifest("job").meta["derive"]["inputs"] == {"src": str(b)}
    go(src=b)
    assert len(runs(counter)) == 2
    go(src=b, params={"p": 2})  # changed params
    assert len(runs(counter)) == 3
    go(src=b, params={"p": 2.0})  # a float is not an int: different canonical params
    assert len(runs(counter)) == 4
    go(src=b, params={"p": 2.0}, version="v2")  # bumped version
    assert len(runs(counter)) == 5
    go(src=b, params={"p": 2.0}, version="v2", regenerate=True)  # forced
    assert len(runs(counter)) == 6
    go(src=b, params={"p": 2.0}, version="v2")
    assert len(runs(counter)) == 6
    monkeypatch.setenv("CASSTORE_REGENERATE", "1")  # the runtime setting forces it too
    go(src=b, params={"p": 2.0}, version="v2")
    assert len(runs(counter)) == 7
    go(src=b, params={"p": 2.0}, version="v2", regenerate=False)  # an explicit argument beats the setting
    assert len(runs(counter)) == 7
    monkeypatch.delenv("CASSTORE_REGENERATE")
    # Every result of a name is memoized, not only the head's: going back reuses the first one
    # (issue 13) by recording it again as a new version of the head, without running fn.
    assert go().digest != m.digest  # a new version of the head ...
    assert dict(go()) == dict(m)  # ... with the same outputs
    assert len(runs(counter)) == 7
    assert len(store.history("job")) == 8
    assert store.manifest("job").meta["derive"] == m.meta["derive"]


def test_cache_hit_needs_outputs_present(store: casstore.Store, counter: Path) -> None:
    src = store.put(b"xyz" * 100)
    fn = functools.partial(counting_fn, str(counter), 0.0)
    m = store.derive("h", inputs={"src": src}, fn=fn)
    out = m["result.bin"].digest
    p = store.path(out)
    os.chmod(p.parent, 0o755)
    p.unlink()  # the output object vanished (e.g. collected): recompute instead of returning a dangling result
    m2 = store.derive("h", inputs={"src": src}, fn=fn)
    assert len(runs(counter)) == 2 and m2["result.bin"].digest == out and store.get(out) == b"zyx" * 100


def test_manifest_inputs_dirs_and_subdirectory_outputs(store: casstore.Store, tmp_path: Path) -> None:
    with store.edit("raw") as ed:
        ed["a.txt"] = casstore.Entry(store.put(b"A"))
        ed["sub/b.txt"] = casstore.Entry(store.put(b"BB"))
        ed["sub/deep/c.txt"] = casstore.Entry(store.put(b"CCC"))
    with store.edit("single") as ed:
        ed["only.txt"] = casstore.Entry(store.put(b"just one"))
    raw, single = store.manifest("raw"), store.manifest("single")
    seen: Dict[str, Any] = {}

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        seen.update(inputs)
        d = inputs["many"]
        assert d.is_dir()
        files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
        seen["files"] = files
        assert inputs["one"].is_file() and inputs["one"].read_bytes() == b"just one"
        assert not os.stat(inputs["one"]).st_mode & 0o222  # inputs are the read-only objects
        assert inputs["obj"].read_bytes() == b"plain object"
        (out / "x" / "y").mkdir(parents=True)
        (out / "x" / "y" / "z.bin").write_bytes(b"".join((d / f).read_bytes() for f in files))
        (out / "top.txt").write_text(",".join(files))

    obj = store.put(b"plain object")
    m = store.derive("combine", inputs={"many": raw, "one": single, "obj": obj}, fn=fn)
    assert seen["files"] == ["a.txt", "sub/b.txt", "sub/deep/c.txt"]
    assert sorted(m) == ["top.txt", "x/y/z.bin"]
    assert store.get(m["x/y/z.bin"].digest) == b"ABBCCC"
    assert store.get(m["top.txt"].digest) == b"a.txt,sub/b.txt,sub/deep/c.txt"
    rec = store.manifest("combine").meta["derive"]
    assert rec["inputs"] == {"many": str(raw.digest), "one": str(single.digest), "obj": str(obj)}
    # checkout reproduces the tree with the relative paths
    store.checkout("combine", tmp_path / "co")
    assert (tmp_path / "co" / "x" / "y" / "z.bin").read_bytes() == b"ABBCCC"
    assert tmp_names(store.root) == []  # the work dir (with its hard links) is gone


@pytest.mark.parametrize("bad", ["../../../escaped", "/abs", "a/../b", "", "x//y"])
def test_input_names_cannot_escape_the_work_dir(store: casstore.Store, bad: str) -> None:
    with store.edit("two") as ed:
        ed["a"] = casstore.Entry(store.put(b"A"))
        ed["b"] = casstore.Entry(store.put(b"B"))
    before = sorted(os.listdir(store.root))

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        raise AssertionError("must not run")

    with pytest.raises(InvalidInputError, match="derive input name"):
        store.derive("esc", inputs={bad: store.manifest("two")}, fn=fn)
    with pytest.raises(InvalidTypeError):
        store.derive("esc", inputs={3: store.manifest("two")}, fn=fn)
    assert sorted(os.listdir(store.root)) == before and tmp_names(store.root) == []
    assert "esc" not in store.heads()


def test_empty_manifest_input_is_an_empty_directory(store: casstore.Store) -> None:
    empty = store.manifest(store.put_arrays({}))  # a manifest with no entries
    seen: List[Path] = []

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        seen.append(inputs["nothing"])
        assert inputs["nothing"].is_dir() and list(inputs["nothing"].iterdir()) == []

    store.derive("from-empty", inputs={"nothing": empty}, fn=fn)
    assert len(seen) == 1


def test_fn_exception_records_nothing(store: casstore.Store, counter: Path) -> None:
    src = store.put(b"input bytes")
    before = set(object_files(store.root))

    class Boom(RuntimeError):
        pass

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        (out / "partial.bin").write_bytes(b"half of something")
        (out / "d").mkdir()
        (out / "d" / "more.bin").write_bytes(b"more")
        raise Boom("fn failed")

    with pytest.raises(Boom):
        store.derive("fails", inputs={"src": src}, fn=fn)
    assert "fails" not in store.heads()
    assert set(object_files(store.root)) == before
    assert tmp_names(store.root) == []
    # A later good run works and is the first version.
    m = store.derive("fails", inputs={"src": src}, fn=functools.partial(counting_fn, str(counter), 0.0))
    assert list(m) == ["result.bin"] and len(store.history("fails")) == 1


def test_symlink_output_is_refused(store: casstore.Store, tmp_path: Path) -> None:
    src = store.put(b"s")
    (tmp_path / "target").write_bytes(b"outside")

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        (out / "link").symlink_to(tmp_path / "target")

    with pytest.raises(InvalidInputError, match="link"):
        store.derive("sym", inputs={"src": src}, fn=fn)
    assert "sym" not in store.heads() and tmp_names(store.root) == []


def test_empty_output_is_a_result(store: casstore.Store, counter: Path) -> None:
    src = store.put(b"e")
    calls: List[int] = []

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        calls.append(1)

    assert len(store.derive("nothing", inputs={"src": src}, fn=fn)) == 0
    assert len(store.derive("nothing", inputs={"src": src}, fn=fn)) == 0
    assert calls == [1]


def test_bad_arguments(store: casstore.Store) -> None:
    src = store.put(b"q")

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        raise AssertionError("must not run")

    with pytest.raises(InvalidTypeError):
        store.derive("x", inputs={"src": src}, fn="not callable")
    with pytest.raises(InvalidTypeError):
        store.derive("x", inputs={"src": 42}, fn=fn)
    with pytest.raises(InvalidTypeError):
        store.derive("x", inputs=[src], fn=fn)
    with pytest.raises(InvalidTypeError):
        store.derive("x", inputs={"src": src}, params=[1, 2], fn=fn)
    with pytest.raises(InvalidInputError):
        store.derive("x", inputs={"src": src}, params={"s": {1, 2}}, fn=fn)
    with pytest.raises(InvalidInputError):
        store.derive("bad:name", inputs={"src": src}, fn=fn)
    with pytest.raises(InvalidDigestError):
        store.derive("x", inputs={"src": "blake3:nothex"}, fn=fn)
    with pytest.raises(ObjectNotFoundError):  # a well-formed digest of nothing in the store
        store.derive("x", inputs={"src": b3(b"never stored")}, fn=fn)
    assert store.heads() == {} and tmp_names(store.root) == []


def test_derive_key_is_canonical() -> None:
    d = casstore.Digest.parse(b3(b"k"))
    e = casstore.Digest.parse(b3(b"l"))
    base = derive_key("n", {"a": ("object", d), "b": ("object", e)}, {"x": 1, "y": {"q": [1, 2], "p": None}}, None)
    assert base == derive_key("n", {"b": ("object", e), "a": ("object", d)},
                              {"y": {"p": None, "q": [1, 2]}, "x": 1}, None)
    assert base != derive_key("m", {"a": ("object", d), "b": ("object", e)},
                              {"x": 1, "y": {"q": [1, 2], "p": None}}, None)
    assert base != derive_key("n", {"a": ("object", e), "b": ("object", d)},
                              {"x": 1, "y": {"q": [1, 2], "p": None}}, None)
    assert base != derive_key("n", {"a": ("manifest", d), "b": ("object", e)},
                              {"x": 1, "y": {"q": [1, 2], "p": None}}, None)
    assert base != derive_key("n", {"a": ("object", d), "b": ("object", e)},
                              {"x": 1, "y": {"q": [1, 2], "p": None}}, 1)


# -- the download -> unzip -> preprocess chain ------------------------------------------


def gunzip_fn(inputs: Dict[str, Path], out: Path) -> None:
    with gzip.open(inputs["gz"], "rb") as src, open(out / "data.h5", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)


def make_build_npz(calls: List[Dict[str, Any]], params: Dict[str, Any]) -> Any:
    def build_npz(inputs: Dict[str, Path], out: Path) -> None:
        calls.append({**inputs, "h5_ino": os.stat(inputs["h5"]).st_ino})
        with h5py.File(inputs["h5"], "r", locking=False) as f:
            arrays = {k: f[k][...] for k in params["keys"]}
        keep = arrays["energy"] > params["min_energy"]
        np.savez(out / "processed.npz", **{k: v[keep] for k, v in arrays.items()})

    return build_npz


@pytest.fixture
def server() -> Iterator[Server]:
    with serve() as s:
        yield s


def test_fetch_gunzip_build_chain(store: casstore.Store, server: Server, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    energy = rng.normal(size=500)
    coords = rng.normal(size=(500, 3)).astype(np.float32)
    h5 = tmp_path / "qm9.h5"
    with h5py.File(h5, "w") as f:
        f["energy"] = energy
        f["coords"] = coords
        f["unused"] = np.arange(10)
    gz_bytes = gzip.compress(h5.read_bytes())
    url = server.add("/qm9.hdf5.gz", gz_bytes)

    def pipeline(min_energy: float) -> casstore.Manifest:
        d = store.fetch(url, sha256=hashlib.sha256(gz_bytes).hexdigest())
        h5m = store.derive("qm9/unzipped", inputs={"gz": d}, params={}, fn=gunzip_fn)
        params = {"keys": ["energy", "coords"], "min_energy": min_energy}
        return store.derive("qm9/processed", inputs={"h5": h5m}, params=params,
                            fn=make_build_npz(calls, params))

    calls: List[Dict[str, Any]] = []
    npz = pipeline(0.0)
    assert server.count("/qm9.hdf5.gz") == 1 and len(calls) == 1
    h5m = store.manifest("qm9/unzipped")
    assert store.get(h5m["data.h5"].digest) == h5.read_bytes()
    # A one-file manifest input is passed as that file, under its own name (a suffix-picking tool works),
    # and it is the stored object itself (a hard link: no copy).
    assert calls[0]["h5"].name == "data.h5"
    assert calls[0]["h5_ino"] == os.stat(store.path(h5m["data.h5"].digest)).st_ino
    with np.load(store.path(npz["processed.npz"].digest)) as z:
        keep = energy > 0.0
        np.testing.assert_array_equal(z["energy"], energy[keep])
        np.testing.assert_array_equal(z["coords"], coords[keep])
        assert set(z.files) == {"energy", "coords"}
    # Provenance: processed <- unzipped (manifest) <- the fetched object <- the URL.
    rec = store.manifest("qm9/processed").meta["derive"]
    assert rec["inputs"] == {"h5": str(h5m.digest)} and rec["params"]["min_energy"] == 0.0
    fetched = store.manifest("qm9/unzipped").meta["derive"]["inputs"]["gz"]
    assert any(m.meta["url"] == url and str(m["content"].digest) == fetched
               for n, m in ((n, store.manifest(n)) for n in store.heads() if n.startswith("_fetch/")))
    # Rerun: nothing downloaded, nothing recomputed.
    assert pipeline(0.0).digest == npz.digest
    assert server.count("/qm9.hdf5.gz") == 1 and len(calls) == 1
    # A changed parameter recomputes only the last step.
    before_unzip = store.manifest("qm9/unzipped").digest
    npz2 = pipeline(0.5)
    assert len(calls) == 2 and store.manifest("qm9/unzipped").digest == before_unzip
    with np.load(store.path(npz2["processed.npz"].digest)) as z:
        np.testing.assert_array_equal(z["energy"], energy[energy > 0.5])
    assert_objects_valid(store)


# -- processes ---------------------------------------------------------------------------


def test_eight_processes_derive_once(tmp_path: Path, counter: Path) -> None:
    root = tmp_path / "store"
    src = str(casstore.open(root).put(b"shared input" * 1000))
    fn = functools.partial(counting_fn, str(counter), 0.5)  # long enough that all eight meet
    n = 8
    barrier = SPAWN.Barrier(n)
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=derive_worker, args=(str(root), "shared/job", src, fn, barrier, q, {}))
             for _ in range(n)]
    for p in procs:
        p.start()
    out = results(q, n)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(runs(counter)) == 1
    assert len({r[2][0] for r in out}) == 1  # the same manifest digest for all eight
    store = casstore.open(root)
    m = store.manifest("shared/job")
    assert str(m.digest) == out[0][2][0] and len(store.history("shared/job")) == 1
    assert store.get(m["result.bin"].digest) == (b"shared input" * 1000)[::-1]
    assert tmp_names(root) == []


def _start_slow_producer(root: Path, name: str, src: str, counter: Path, marker: Path) -> Any:
    marker.touch()
    q = SPAWN.Queue()
    fn = functools.partial(slow_fn, str(counter), str(marker))
    p = SPAWN.Process(target=derive_worker, args=(str(root), name, src, fn, None, q, {}))
    p.start()
    wait_until(lambda: len(runs(counter)) == 1, what="the producer to start fn")
    return p, fn


def test_killed_producer_a_waiter_takes_over(tmp_path: Path, counter: Path) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    data = os.urandom(300_000)
    src = str(store.put(data))
    marker = tmp_path / "hold"
    producer, fn = _start_slow_producer(root, "slow/job", src, counter, marker)
    q = SPAWN.Queue()
    waiter = SPAWN.Process(target=derive_worker, args=(str(root), "slow/job", src, fn, None, q, {}))
    waiter.start()
    wait_until(lambda: holds_open(waiter.pid, lock_file(store, "slow/job")), what="the waiter to wait on the lock")
    time.sleep(0.1)
    assert len(runs(counter)) == 1  # fn still runs once: the waiter waits
    assert "slow/job" not in store.heads()  # nothing visible while fn runs
    os.kill(producer.pid, signal.SIGKILL)
    producer.join(10)
    marker.unlink()
    (_, pid, (mdigest, outputs)), = results(q, 1)
    waiter.join(10)
    assert runs(counter) == [str(producer.pid), str(waiter.pid)]  # the waiter ran fn itself
    store = casstore.open(root)  # sweeps the dead producer's work dir
    m = store.manifest("slow/job")
    assert str(m.digest) == mdigest and len(store.history("slow/job")) == 1
    assert store.get(m["result.bin"].digest) == data[::-1]
    names = assert_objects_valid(store)
    assert b3(data[::-1][: len(data) // 2]) not in names  # the half-written output never became an object
    assert tmp_names(root) == []


def test_killed_producer_leaves_nothing_named(tmp_path: Path, counter: Path) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    data = os.urandom(100_000)
    src = str(store.put(data))
    before = set(object_files(root))
    producer, fn = _start_slow_producer(root, "orphan", src, counter, tmp_path / "hold")
    # Another caller with a short timeout waits while the producer beats its heartbeat; once the
    # producer is stopped it gets a clear LockTimeout naming the derive and the stalled holder.
    os.kill(producer.pid, signal.SIGSTOP)
    with pytest.raises(LockTimeout, match=f"orphan.*stalled.*pid {producer.pid}"):
        store.derive("orphan", inputs={"src": src}, fn=fn, timeout=0.2)
    os.kill(producer.pid, signal.SIGKILL)
    producer.join(10)
    assert "orphan" not in store.heads()
    assert set(object_files(root)) == before
    assert len(tmp_names(root)) == 1 and tmp_names(root)[0].endswith(".derive")  # the dead work dir
    store = casstore.open(root)
    assert tmp_names(root) == []
    (tmp_path / "hold").unlink()
    m = store.derive("orphan", inputs={"src": src}, fn=fn)
    assert store.get(m["result.bin"].digest) == data[::-1]
    assert len(runs(counter)) == 2


# -- fn must leave its output directory where it is (found by a bug hunt) ---------------------------------


def test_an_output_directory_replaced_by_a_link_is_refused_and_nothing_outside_moves(store: casstore.Store,
                                                                                      tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("user data")

    def swap(inputs: Dict[str, Path], out: Path) -> None:
        out.rmdir()
        out.symlink_to(victim, target_is_directory=True)

    with pytest.raises(casstore.InvalidInputError, match="replaced or removed .*a symbolic link"):
        store.derive("sw", inputs={}, fn=swap)
    assert (victim / "precious.txt").read_text() == "user data"  # not moved into the store
    assert store.refs.get("heads", "sw") is None


def test_an_output_directory_removed_by_fn_is_not_an_empty_result(store: casstore.Store) -> None:
    def remove(inputs: Dict[str, Path], out: Path) -> None:
        out.rmdir()

    with pytest.raises(casstore.InvalidInputError, match="replaced or removed .*gone"):
        store.derive("rm", inputs={}, fn=remove)
    assert store.refs.get("heads", "rm") is None  # never cached as a hit with no outputs


def test_an_output_hard_linked_to_a_file_outside_the_store_is_copied(store: casstore.Store, tmp_path: Path) -> None:
    """Found by a bug hunt: `os.link(own_file, out / "data.bin")` in fn made the user's own file the object
    (mode 0444, two links); the user's later edit of it corrupted the recorded result."""
    own = tmp_path / "mine.bin"
    own.write_bytes(b"the user's own file")
    os.chmod(own, 0o644)

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        os.link(own, out / "data.bin")

    res = store.derive("passthru", inputs={}, fn=fn)
    d = res["data.bin"].digest
    assert os.stat(own).st_mode & 0o777 == 0o644 and os.stat(own).st_nlink == 1  # not taken over
    own.write_bytes(b"edited by its owner")  # legitimate: it is the user's file
    assert store.get(d) == b"the user's own file"
    assert store.verify().ok


def test_a_fn_that_derives_or_edits_its_own_name_raises_instead_of_waiting_forever(store: casstore.Store) -> None:
    """Found by a bug hunt: the lock's holder was this very process, alive and beating, so the wait never ended."""
    from casstore.errors import LockCycleError

    def inner(_i: Dict[str, Path], out: Path) -> None:
        (out / "x").write_text("x")

    def same(_i: Dict[str, Path], out: Path) -> None:
        store.derive("same", inputs={}, fn=inner, params={"inner": 1})

    def edits(_i: Dict[str, Path], out: Path) -> None:
        with store.edit("edits"):
            pass

    def a(_i: Dict[str, Path], out: Path) -> None:
        store.derive("b", inputs={}, fn=b)

    def b(_i: Dict[str, Path], out: Path) -> None:
        store.derive("a", inputs={}, fn=a)

    t0 = time.monotonic()
    for name, fn in (("same", same), ("edits", edits), ("a", a)):
        with pytest.raises(LockCycleError, match="wait for itself forever"):
            store.derive(name, inputs={}, fn=fn, timeout=600)
    assert time.monotonic() - t0 < 30
    with pytest.raises(LockCycleError):  # a nested edit of one name in one thread, likewise
        with store.edit("n"):
            with store.edit("n"):
                pass
    # The name is free again afterwards, and other names inside fn are fine.
    assert store.derive("same", inputs={}, fn=inner)["x"].size == 1
    with store.edit("n") as m:
        m["k"] = store.put(b"k")
