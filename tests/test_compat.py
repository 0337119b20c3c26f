"""A store written by the previous release (casstore 0.1.0) still opens, reads, verifies and syncs.

The fixture tests/fixtures/store-0.1.0/ was made by tests/fixtures/make_store_0_1_0.py
running the 0.1.0 code (commit dc28c56); everything that code read back is in
tests/fixtures/store-0.1.0.expected.json.  Only the public API is used here
(``casstore.open``, ``Store`` methods, ``casstore.IndexCache.open``, ``casstore.Remote``),
so the test holds across any internal restructuring: if it fails, the on-disk format or
a public behaviour changed, and the fix belongs in casstore, not in this file.

Each test works on a copy in ``tmp_path``: git keeps neither the 0444 modes 0.1.0
gives objects, refs and store.toml nor empty directories (the fixture's ``tmp/`` and
``locks/`` hold a ``.gitkeep`` that the copy leaves out), and the tests write.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any, Dict

import _seaweed
import blake3
import numpy as np
import pytest
from conftest import DROP_PRIVILEGES, PRELOAD, child_json, run_py

import casstore

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE = FIXTURES / "store-0.1.0"
EXPECTED: Dict[str, Any] = json.loads((FIXTURES / "store-0.1.0.expected.json").read_text())

# Fixtures shared by every remote test module (one SeaweedFS server per session).
aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b3(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def copy_old_store(dest: Path) -> Path:
    """Copy the fixture to ``dest`` as 0.1.0 left it: empty tmp/ and locks/, read-only files."""
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns(".gitkeep"))
    os.chmod(dest / "store.toml", 0o444)
    for sub in ("objects", "refs"):
        for p in (dest / sub).rglob("*"):
            if p.is_file():
                os.chmod(p, 0o444)
    return dest


@pytest.fixture
def old_root(tmp_path: Path) -> Path:
    return copy_old_store(tmp_path / "old")


@pytest.fixture
def old(old_root: Path) -> casstore.Store:
    return casstore.open(old_root, create=False)


def manifest_doc(m: casstore.Manifest) -> Dict[str, Any]:
    """The same shape make_store_0_1_0.py recorded (JSON round trip for tuples/lists)."""
    doc = {
        "digest": str(m.digest),
        "name": m.name,
        "frozen": bool(m.frozen),
        "parent": str(m.parent) if m.parent is not None else None,
        "meta": dict(m.meta),
        "entries": {k: {"digest": str(e.digest), "size": e.size, "meta": dict(e.meta)} for k, e in m.items()},
    }
    out: Dict[str, Any] = json.loads(json.dumps(doc))
    return out


def array_doc(a: Any) -> Dict[str, Any]:
    return {"dtype": str(a.dtype), "shape": list(a.shape), "sha256": sha256(np.ascontiguousarray(a).tobytes()),
            "fortran": bool(a.flags.f_contiguous and not a.flags.c_contiguous)}


def assert_same_refs_and_manifests(store: casstore.Store) -> None:
    assert {k: str(v) for k, v in store.heads().items()} == EXPECTED["heads"]
    assert {k: str(v) for k, v in store.pins().items()} == EXPECTED["pins"]
    for name, want in EXPECTED["manifests"].items():
        assert manifest_doc(store.manifest(name)) == want, f"manifest {name!r} reads differently"
    for name, digests in EXPECTED["history"].items():
        hist = store.history(name)
        assert [str(m.digest) for m in hist] == digests, f"history of {name!r}"
        assert json.loads(json.dumps([dict(m.meta) for m in hist])) == EXPECTED["history_meta"][name]


# -- opening ------------------------------------------------------------------------------------


def test_fixture_is_the_old_release() -> None:
    assert EXPECTED["casstore_version"] == "0.1.0"
    assert sha256((FIXTURE / "store.toml").read_bytes()) == EXPECTED["store_toml_sha256"]
    total = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    assert total < 300_000, "the compat fixture must stay small"


def test_open_does_not_rewrite_store_toml(old_root: Path) -> None:
    cfg = old_root / "store.toml"
    before = cfg.read_bytes()
    st = os.stat(cfg)
    s = casstore.open(old_root)  # create=True on an existing store: must only read
    assert s.config.compression == "raw" and s.durable
    casstore.open(old_root, compress=True)  # an open-time option is not a settings change
    with casstore.open(old_root) as s2:
        with s2.edit("experiment") as m:
            m["new.txt"] = s2.put(b"written by the new code")
        assert s2.verify().ok
    after = os.stat(cfg)
    assert cfg.read_bytes() == before
    assert sha256(before) == EXPECTED["store_toml_sha256"]
    assert (after.st_ino, after.st_mtime_ns, after.st_mode & 0o777) == (st.st_ino, st.st_mtime_ns, 0o444), \
        "opening or writing to a 0.1.0 store replaced its store.toml"


def test_verify_clean(old: casstore.Store) -> None:
    rep = old.verify()
    assert rep.ok, rep
    assert rep.checked == len(EXPECTED["objects"])
    assert old.verify(fast=True).ok


# -- reading -------------------------------------------------------------------------------------


def test_every_object_reads_back(old: casstore.Store) -> None:
    assert {str(d) for d in old.iter_objects()} == set(EXPECTED["objects"])
    for ds, want in EXPECTED["objects"].items():
        data = old.get(ds)
        assert b3(data) == ds and sha256(data) == want["sha256"] and len(data) == want["size"]
        with old.open(ds) as f:
            assert f.read() == data
        info = old.stat(ds)
        assert (info.size, info.stored_size, info.codec) == (want["size"], want["stored_size"], want["codec"])
        assert ds in old
    named = EXPECTED["named"]
    assert old.stat(named["text_zstd"]).codec == "zstd"
    assert old.get(named["hello"]) == b"hello casstore 0.1.0\n"
    assert old.get(named["empty"]) == b""
    assert old.resolve(named["random"][: len("blake3:") + 12]) == old.resolve(named["random"])


def test_manifests_history_pins_heads(old: casstore.Store) -> None:
    assert_same_refs_and_manifests(old)
    assert old.manifest("release").frozen and not old.manifest("experiment").frozen
    assert old.manifest("experiment-v1").digest == old.history("experiment")[-1].digest
    d = old.diff("experiment-v1", "experiment")
    assert set(d.added) == {"data/random.bin", "data/text.txt", "array.npy"} and set(d.removed) == {"empty"}


def test_arrays(old: casstore.Store) -> None:
    named = EXPECTED["named"]
    for mmap in (False, True):
        assert array_doc(old.get_array(named["array"], mmap=mmap)) == EXPECTED["array"]
        for target in ("bundle", named["bundle"]):
            got = old.get_arrays(target, mmap=mmap)
            assert {k: array_doc(v) for k, v in got.items()} == EXPECTED["bundle_arrays"]
    a = old.get_array(named["array"])
    assert np.array_equal(a, np.arange(60, dtype=np.float32).reshape(3, 4, 5) * np.float32(0.5))


def test_hdf5(old: casstore.Store) -> None:
    h5 = EXPECTED["hdf5"]
    if not h5:
        pytest.skip("the fixture was made without h5py")
    pytest.importorskip("h5py")
    assert old.manifest("hdf5")["small.h5"].digest == casstore.Digest.parse(h5["digest"])
    with old.open_hdf5(h5["digest"]) as f:
        assert f[h5["dataset"]][()].tolist() == h5["values"]
        assert f[h5["dataset"]].attrs["unit"] == h5["attr_unit"]


def test_preserved_index_cache(old: casstore.Store) -> None:
    want = EXPECTED["cache"]
    for target in (want["name"], want["digest"]):
        for verify in ("full", "record", "open"):
            with casstore.IndexCache.open(old, target, verify=verify) as c:
                assert c.length == want["length"] and c.frozen
                assert c.count == len(want["records"])
                for i in range(want["length"]):
                    rec = want["records"].get(str(i))
                    assert c.get(i) == (bytes.fromhex(rec) if rec is not None else None), (target, verify, i)


def test_checkout(old: casstore.Store, tmp_path: Path) -> None:
    out = tmp_path / "co"
    written = old.checkout("experiment", out)
    files = {p.relative_to(out).as_posix(): sha256(p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert files == EXPECTED["checkout_experiment"]
    assert {Path(p).resolve() for p in written} == {(out / k).resolve() for k in files}


def test_new_code_extends_old_history(old: casstore.Store) -> None:
    head = old.heads()["experiment"]
    assert old.put(b"hello casstore 0.1.0\n") == casstore.Digest.parse(EXPECTED["named"]["hello"])  # dedupe
    with old.edit("experiment") as m:
        m["more.txt"] = old.put(b"more", compress=True)
    new = old.manifest("experiment")
    assert new.parent == head and len(old.history("experiment")) == 4
    with pytest.raises(casstore.FrozenError):
        with old.edit("release") as m:
            m["x"] = old.put(b"x")
    assert old.verify().ok


def test_read_only_open(world_dir: Path) -> None:
    """A 0.1.0 store another user owns (no write permission anywhere) still opens and reads."""
    root = copy_old_store(world_dir / "old")
    for p in [root, *root.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o444)
    named = EXPECTED["named"]
    # numpy is imported before dropping privileges: its lazy stdlib imports may sit where
    # uid 65534 cannot read (the interpreter's own install), which is not what is tested here.
    body = textwrap.dedent("""
        s = casstore.open(sys.argv[1], create=False)
        with casstore.IndexCache.open(s, "cache-v1") as c:
            rec = c.get(19).hex()
        out = {"writable": s.writable, "heads": {k: str(v) for k, v in s.heads().items()},
               "pins": {k: str(v) for k, v in s.pins().items()}, "text": len(s.get(sys.argv[2])),
               "array": s.get_array(sys.argv[3]).tolist() == s.get_array(sys.argv[3], mmap=True).tolist(),
               "rec": rec}
        print(json.dumps(out))
    """)
    code = "import json, sys\nimport numpy\n" + PRELOAD + "import casstore.adapters\n" + DROP_PRIVILEGES + body
    out = child_json(run_py(code, str(root), named["text_zstd"], named["array"]))
    assert out == {"writable": False, "heads": EXPECTED["heads"], "pins": EXPECTED["pins"],
                   "text": EXPECTED["objects"][named["text_zstd"]]["size"], "array": True,
                   "rec": EXPECTED["cache"]["records"]["19"]}


# -- sync ----------------------------------------------------------------------------------------


def test_push_then_pull_into_empty_store_round_trips(old: casstore.Store, remote: casstore.Remote,
                                                     tmp_path: Path) -> None:
    rep = old.push(remote)  # every head and pin
    names = {f"heads/{k}" for k in EXPECTED["heads"]} | {f"pins/{k}" for k in EXPECTED["pins"]}
    assert set(rep.refs) == names and set(rep.refs.values()) == {"created"}

    fresh = casstore.open(tmp_path / "fresh")
    rep = fresh.pull(remote)
    assert set(rep.refs) == names and set(rep.refs.values()) == {"created"}
    assert_same_refs_and_manifests(fresh)
    # Everything in the old store is reachable from a ref (history included), so all of it travels.
    assert {str(d) for d in fresh.iter_objects()} == set(EXPECTED["objects"])
    for ds, want in EXPECTED["objects"].items():
        assert sha256(fresh.get(ds)) == want["sha256"]
    assert fresh.verify().ok
    with casstore.IndexCache.open(fresh, EXPECTED["cache"]["name"]) as c:
        assert c.get(19) == bytes.fromhex(EXPECTED["cache"]["records"]["19"])
    assert array_doc(fresh.get_array(EXPECTED["named"]["array"])) == EXPECTED["array"]

    # And back: the new store moves a head on, the old store pulls the fast-forward.
    with fresh.edit("experiment") as m:
        m["from-new.txt"] = fresh.put(b"from the new store")
    fresh.push(remote, "experiment")
    rep = old.pull(remote, "experiment")
    assert rep.refs == {"heads/experiment": "fast-forward"}
    assert old.manifest("experiment").digest == fresh.manifest("experiment").digest
    assert old.get(old.manifest("experiment")["from-new.txt"].digest) == b"from the new store"
    assert old.verify().ok
    rep = old.pull(remote)
    assert rep.objects == 0 and set(rep.refs.values()) == {"up to date"}
