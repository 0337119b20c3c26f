"""derive's memo and records at job scale (issue 13): every result of a name is remembered, a changed fn
is detected by its code fingerprint, inputs keep their names, outputs are moved (not copied) into the store,
and the provenance record names the inputs in the agreed form (docs/pipelines.md, "Provenance metadata").
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _fetch_helpers import SPAWN, clean_settings_env, counting_fn, derive_worker, results, scale_v1, scale_v2

import casstore
from casstore.errors import InvalidInputError
from casstore.pipelines import code_fingerprint


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


def runs(counter: Path) -> List[str]:
    return counter.read_text().split() if counter.exists() else []


def _in_process(root: Path, name: str, src: str, fn: Any, **kw: Any) -> str:
    q = SPAWN.Queue()
    p = SPAWN.Process(target=derive_worker, args=(str(root), name, src, fn, None, q, kw))
    p.start()
    (_, _, (digest, _)), = results(q, 1)
    p.join(30)
    return str(digest)


def test_params_a_b_a_runs_fn_twice(store: casstore.Store, tmp_path: Path) -> None:
    counter = tmp_path / "runs.txt"
    src = str(store.put(b"the input" * 1000))
    fn = functools.partial(counting_fn, str(counter), 0.0)
    # Each step in its own process: the memo is in the store, not in a process.
    a = _in_process(store.root, "step", src, fn, params={"p": "A"})
    b = _in_process(store.root, "step", src, fn, params={"p": "B"})
    a2 = _in_process(store.root, "step", src, fn, params={"p": "A"})
    assert len(runs(counter)) == 2  # A, B; the second A is the first A's result
    head = store.manifest("step")
    assert str(head.digest) == a2 and a2 not in (a, b)  # recorded again as the head (history kept) ...
    first = store.manifest(a)
    assert dict(head) == dict(first) and head.meta["derive"] == first.meta["derive"]  # ... with A's outputs
    assert head.meta["derive.reused"]["from"] == a
    assert [m.meta["derive"]["params"]["p"] for m in store.history("step")] == ["A", "B", "A"]
    # B again, and a fresh Store object in this process: still no work.
    store.derive("step", inputs={"src": src}, fn=fn, params={"p": "B"})
    casstore.open(store.root).derive("step", inputs={"src": src}, fn=fn, params={"p": "A"})
    assert len(runs(counter)) == 2
    # A result whose outputs were removed (gc) is not reused: fn runs again.
    store.objects.delete(first["result.bin"].digest)
    store.derive("step", inputs={"src": src}, fn=fn, params={"p": "A"})
    assert len(runs(counter)) == 3
    # (counting_fn ignores params: B's output is the same object, present again, so B is a hit.)
    store.derive("step", inputs={"src": src}, fn=fn, params={"p": "B"})
    assert len(runs(counter)) == 3


def test_a_b_a_upstream_keeps_downstream_hits(store: casstore.Store) -> None:
    """A manifest input counts by its files: re-recording the same files (a memo reuse) is the same input."""
    src = store.put(b"raw")
    calls: List[str] = []

    def step1(p: str, inputs: Dict[str, Path], out: Path) -> None:
        calls.append("step1")
        (out / "a.txt").write_bytes(inputs["src"].read_bytes() + p.encode())

    def step2(inputs: Dict[str, Path], out: Path) -> None:
        calls.append("step2")
        (out / "b.txt").write_bytes(inputs["a"].read_bytes().upper())

    def run(p: str) -> casstore.Manifest:
        a = store.derive("s1", inputs={"src": src}, params={"p": p}, fn=functools.partial(step1, p))
        return store.derive("s2", inputs={"a": a}, fn=step2)

    first = run("a")
    second = run("b")
    assert calls == ["step1", "step2", "step1", "step2"] and dict(second) != dict(first)
    # A again: step 1 is reused (a new version of s1 with the same files), and so step 2's input is the
    # same as the first time: its first result is reused too.  fn ran twice per step for A -> B -> A.
    again = run("a")
    assert calls == ["step1", "step2", "step1", "step2"] and dict(again) == dict(first)
    assert store.get(again["b.txt"].digest) == b"RAWA"
    # Regenerating step 1 to identical files: step 2 stays a hit.
    store.derive("s1", inputs={"src": src}, params={"p": "a"}, fn=functools.partial(step1, "a"), regenerate=True)
    run("a")
    assert calls == ["step1", "step2", "step1", "step2", "step1"]


def test_changed_fn_is_detected_and_rerun(store: casstore.Store, caplog: pytest.LogCaptureFixture) -> None:
    src = store.put(b"ab")
    m1 = store.derive("scaled", inputs={"src": src}, fn=scale_v1)
    assert store.get(m1["x.bin"].digest) == b"abab"
    code = m1.meta["derive"]["code"]
    assert code == code_fingerprint(scale_v1) and code["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert store.derive("scaled", inputs={"src": src}, fn=scale_v1).digest == m1.digest  # unchanged: a hit
    # fn edited, version not bumped: detected, run again, with a warning saying what to do.
    with caplog.at_level(logging.WARNING, logger="casstore.derive"):
        m2 = store.derive("scaled", inputs={"src": src}, fn=scale_v2)
    assert store.get(m2["x.bin"].digest) == b"ababab"
    assert [r.getMessage() for r in caplog.records if "bump version" in r.getMessage()] != []
    assert sum("changed" in r.getMessage() for r in caplog.records) == 1  # one warning per call
    # Back to the first code: its result is still remembered (same key and fingerprint).
    assert dict(store.derive("scaled", inputs={"src": src}, fn=scale_v1)) == dict(m1)
    # The version is what says "the function changed on purpose": bumping it is a new key, no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="casstore.derive"):
        store.derive("scaled", inputs={"src": src}, fn=scale_v2, version=2)
    assert not caplog.records


def _fingerprint_in_subprocess(source: str, seed: str) -> str:
    prog = textwrap.dedent("""
        import sys
        from casstore.pipelines import code_fingerprint
        ns = {}
        exec(compile(sys.argv[1], "<fn>", "exec"), ns)
        print(code_fingerprint(ns["fn"])["blake3"])
    """)
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", prog, source], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_fingerprint_is_the_code_not_the_text() -> None:
    base = '''
def fn(inputs, out):
    keep = {"energy", "coords", "forces"}   # a set literal: a frozenset constant
    def inner(x):
        return x * 2
    (out / "y").write_text(str(sorted(k for k in keep if inner(len(k)) > 3)))
'''
    moved = "\n\n# a comment and blank lines move every line\n" + base.replace("# a set", "# the set")
    inner_changed = base.replace("x * 2", "x * 3")
    const_changed = base.replace('"forces"', '"charges"')
    # Stable across processes with different string hashing (frozenset order), and across text edits.
    fp = _fingerprint_in_subprocess(base, "1")
    assert _fingerprint_in_subprocess(base, "2") == fp
    assert _fingerprint_in_subprocess(moved, "3") == fp
    assert _fingerprint_in_subprocess(inner_changed, "1") != fp  # a nested function's code counts
    assert _fingerprint_in_subprocess(const_changed, "1") != fp
    # Wrapped callables: a partial and a bound method are fingerprinted by the code they run.
    assert code_fingerprint(functools.partial(scale_v1)) == code_fingerprint(scale_v1)

    class Step:
        def __call__(self, inputs: Dict[str, Path], out: Path) -> None:
            scale_v1(inputs, out)

    assert code_fingerprint(Step()) is not None and code_fingerprint(len) is None


def test_inputs_keep_their_names(store: casstore.Store, tmp_path: Path) -> None:
    gz = store.put(b"\x1f\x8b fake gzip")
    one = store.derive("one", inputs={}, fn=lambda i, o: (o / "data.h5").write_bytes(b"HDF"))
    several = store.derive("several", inputs={}, fn=lambda i, o: [
        (o / "a.npz").write_bytes(b"A"), (o / "sub").mkdir(), (o / "sub" / "b.csv").write_bytes(b"B")])
    seen: Dict[str, Any] = {}

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        for k, p in inputs.items():
            seen[k] = (p.name, p.suffixes, p.is_dir(), os.stat(p).st_ino if p.is_file() else None)
        (out / "done").write_bytes(b"")

    store.derive("uses", inputs={"raw/qm9.hdf5.gz": gz, "h5": one, "many": several}, fn=fn)
    assert seen["raw/qm9.hdf5.gz"][:3] == ("qm9.hdf5.gz", [".hdf5", ".gz"], False)  # the input's name
    assert seen["raw/qm9.hdf5.gz"][3] == os.stat(store.path(gz)).st_ino  # the object itself: no copy
    assert seen["h5"][:3] == ("data.h5", [".h5"], False)  # a one-file result: its file, under its key
    assert seen["many"][:3] == ("many", [], True)  # several files: a directory of them, keys as names
    with pytest.raises(InvalidInputError, match="collide"):
        store.derive("bad", inputs={"a": gz, "a/b": gz}, fn=fn)


@pytest.mark.parametrize("compress", [False, True])
def test_outputs_are_moved_not_copied(tmp_path: Path, compress: bool) -> None:
    store = casstore.open(tmp_path / "store", compress=compress)
    data = os.urandom(3_000_000) if not compress else b"compressible " * 300_000
    inodes: Dict[str, int] = {}

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        (out / "big.bin").write_bytes(data)
        (out / "d").mkdir()
        (out / "d" / "small.txt").write_bytes(b"small")
        inodes.update({k: os.stat(out / k).st_ino for k in ("big.bin", "d/small.txt")})

    m = store.derive("moved", inputs={}, fn=fn)
    assert store.get(m["big.bin"].digest) == data and m["big.bin"].size == len(data)
    assert store.get(m["d/small.txt"].digest) == b"small"
    if not compress:  # renamed from the work directory: the very file fn wrote
        assert os.stat(store.path(m["big.bin"].digest)).st_ino == inodes["big.bin"]
        assert os.stat(store.path(m["d/small.txt"].digest)).st_mode & 0o777 == 0o444
    else:  # a compressing store encodes (a copy is the encoding)
        assert store.stat(m["big.bin"].digest).stored_size < len(data)
    assert os.listdir(store.root / "tmp") == []
    store.verify()


def test_provenance_record(store: casstore.Store) -> None:
    raw = store.put(b"raw bytes")
    mid = store.derive("mid", inputs={"raw": raw}, fn=lambda i, o: (o / "m").write_bytes(i["raw"].read_bytes()))
    top = store.derive("top", inputs={"mid": mid, "raw2": str(raw)}, params={"k": 1},
                       fn=lambda i, o: (o / "t").write_bytes(b"t"))
    assert mid.meta["casstore.inputs"] == {"raw": str(raw)}
    assert top.meta["casstore.inputs"] == {"mid": {"manifest": str(mid.digest)}, "raw2": str(raw)}
    none = store.derive("none", inputs={}, fn=lambda i, o: (o / "n").write_bytes(b"n"))
    assert none.meta["casstore.inputs"] == {}
