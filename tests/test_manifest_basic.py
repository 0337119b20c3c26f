"""Manifests, heads, pins: the basic behaviour (issue 3).

Real stores on the real filesystem; child interpreters where a claim is about
"any process".
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict

import blake3
import msgpack
import pytest
from _manifest_helpers import canonical_packb, lock_file, ref_file, ref_text

import casstore
from casstore import Digest, Entry, FrozenError, InvalidInputError, ObjectNotFoundError
from casstore.manifests import MANIFEST_FORMAT, encode_manifest


@pytest.fixture
def mstore(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "mstore")


@pytest.fixture
def objs(mstore: casstore.Store) -> Dict[str, Digest]:
    """A few objects, put first (entries must refer to existing objects)."""
    return {name: mstore.put(name.encode() * (i + 1)) for i, name in enumerate(["a", "b", "c", "d"])}


def _compressible(n: int) -> bytes:
    line = b"epoch %d loss 0.%04d accuracy 0.9%03d\n"
    out = bytearray()
    i = 0
    while len(out) < n:
        out += line % (i % 50, i % 9973, i % 1000)
        i += 1
    return bytes(out[:n])


# -- versions are canonical objects ------------------------------------------------


def test_version_is_an_object_whose_digest_is_its_identity(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["x"] = objs["a"]
    man = mstore.manifest("exp")
    data = mstore.get(man.digest)
    assert blake3.blake3(data).hexdigest() == man.digest.hex
    assert mstore.heads() == {"exp": man.digest}
    assert m.result is not None and m.result.digest == man.digest
    info = mstore.stat(man.digest)
    assert info.codec == "raw" and info.size == len(data)  # format.md: manifest versions are raw objects
    doc = msgpack.unpackb(data, raw=False)
    assert doc["v"] == MANIFEST_FORMAT == 1
    assert doc["casstore"] == "manifest"
    assert doc["entries"] == {"x": [objs["a"].raw, 1]}
    assert doc["parent"] is None
    # The digest is the identity: the same version is reachable by digest, string and prefix.
    for target in (man.digest, str(man.digest), str(man.digest)[:20]):
        again = mstore.manifest(target)
        assert again.digest == man.digest and dict(again) == dict(man)
        assert again.frozen and again.name is None  # a version by digest can never change


def test_bytes_follow_the_documented_canonical_format(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    """Compare the stored bytes with an independent encoder written from docs/format.md."""
    with mstore.edit("exp") as m:
        m["z/last"] = Entry(objs["d"], meta={"zeta": [3, {"y": 1, "b": 2}], "alpha": 1.5, "neg": -7})
        m["a/first"] = objs["a"]
        m["M"] = Entry(objs["b"], meta={})
        m["ü/ключ"] = str(objs["c"])
        m.meta["zz"] = {"q": None, "c": b"\x00\xff", "a": True}
        m.meta["aa"] = 0.1
        m.meta["big"] = 2**64 - 1
    first = m.result
    assert first is not None
    with mstore.edit("exp") as m:
        del m["M"]
    man = mstore.manifest("exp")
    sizes = {k: mstore.stat(d).size for k, d in objs.items()}
    expected = canonical_packb({
        "casstore": "manifest",
        "entries": {
            "z/last": [objs["d"].raw, sizes["d"], {"zeta": [3, {"y": 1, "b": 2}], "alpha": 1.5, "neg": -7}],
            "a/first": [objs["a"].raw, sizes["a"]],
            "ü/ключ": [objs["c"].raw, sizes["c"]],
        },
        "meta": {"zz": {"q": None, "c": b"\x00\xff", "a": True}, "aa": 0.1, "big": 2**64 - 1},
        "parent": first.digest.raw,
        "v": 1,
    })
    assert mstore.get(man.digest) == expected
    assert man.digest == Digest.of(expected)
    assert b"\xcb" + msgpack.packb(0.1)[1:] in expected  # float64, never float32

    # Every map in the stored bytes has its keys in code-point order.
    def check(v: object) -> None:
        if isinstance(v, list) and v and all(isinstance(p, tuple) and len(p) == 2 for p in v):
            keys = [k for k, _ in v]
            assert keys == sorted(keys), keys
            for _, x in v:
                check(x)
        elif isinstance(v, list):
            for x in v:
                check(x)

    check(msgpack.unpackb(mstore.get(man.digest), raw=False, object_pairs_hook=list))


_BUILD = """
import json, sys, casstore
from casstore import Entry
root, order = sys.argv[1], json.loads(sys.argv[2])
store = casstore.open(root)
blobs = {k: k.encode() * 3 for k in ["w", "x", "y", "z"]}
ds = {k: store.put(v) for k, v in blobs.items()}
entry_meta = {"epoch": 10, "lr": 0.001, "tags": ["a", "b"], "nested": {"k1": 1, "k0": 0}}
if order == "reverse":
    entry_meta = {"nested": {"k0": 0, "k1": 1}, "tags": ["a", "b"], "lr": 0.001, "epoch": 10}
meta_items = [("git", "abc123"), ("seed", 7), ("cfg", {"b": 2, "a": 1}), ("when", None)]
keys = ["data/train.h5", "data/val.h5", "weights.bin", "README"]
if order == "reverse":
    meta_items = [(k, dict(reversed(list(v.items()))) if isinstance(v, dict) else v)
                  for k, v in reversed(meta_items)]
    keys = list(reversed(keys))
with store.edit("exp") as m:
    for k in keys:
        obj = {"data/train.h5": "w", "data/val.h5": "x", "weights.bin": "y", "README": "z"}[k]
        m[k] = Entry(ds[obj], meta=entry_meta) if k == "weights.bin" else ds[obj]
    for k, v in meta_items:
        m.meta[k] = v
print(json.dumps({"digest": str(store.manifest("exp").digest), "pid": __import__("os").getpid()}))
"""


def test_same_content_same_digest_in_any_process_and_order(tmp_path: Path) -> None:
    out = []
    for i, (order, seed) in enumerate([("forward", "1"), ("reverse", "2")]):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(_BUILD), str(tmp_path / f"s{i}"), json.dumps(order)],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert out[0]["pid"] != out[1]["pid"]
    assert out[0]["digest"] == out[1]["digest"]

    # ... and equal to casstore.manifests.encode_manifest called directly (in yet another order).
    blobs = {k: k.encode() * 3 for k in ["w", "x", "y", "z"]}
    ds = {k: Digest.of(v) for k, v in blobs.items()}
    entries = {
        "weights.bin": Entry(ds["y"], 3, {"tags": ["a", "b"], "nested": {"k0": 0, "k1": 1}, "epoch": 10,
                                          "lr": 0.001}),
        "README": Entry(ds["z"], 3),
        "data/val.h5": Entry(ds["x"], 3),
        "data/train.h5": Entry(ds["w"], 3),
    }
    meta = {"when": None, "cfg": {"a": 1, "b": 2}, "seed": 7, "git": "abc123"}
    assert str(Digest.of(encode_manifest(entries, meta, None))) == out[0]["digest"]
    # Different content gives a different digest (the comparison above is not vacuous).
    meta["seed"] = 8
    assert str(Digest.of(encode_manifest(entries, meta, None))) != out[0]["digest"]


# -- edit transactions ----------------------------------------------------------------


def test_edit_fills_sizes_and_keeps_entry_and_manifest_metadata(mstore: casstore.Store,
                                                                objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["plain"] = objs["b"]
        m["as-str"] = str(objs["c"])
        m["with-meta"] = Entry(objs["d"], meta={"epoch": 10, "shape": [2, 3], "ok": True, "note": "ü"})
        m.meta["git_commit"] = "abc123"
        m.meta["lr"] = 3e-4
        m.meta["blob"] = b"\x00\x01"
    man = mstore.manifest("exp")
    assert man.name == "exp" and not man.frozen and man.parent is None
    assert sorted(man) == ["as-str", "plain", "with-meta"] and len(man) == 3
    assert man["plain"] == Entry(objs["b"], 2, {})
    assert man["as-str"].digest == objs["c"] and man["as-str"].size == 3
    assert man["with-meta"].size == 4
    assert dict(man["with-meta"].meta) == {"epoch": 10, "shape": [2, 3], "ok": True, "note": "ü"}
    assert dict(man.meta) == {"git_commit": "abc123", "lr": 3e-4, "blob": b"\x00\x01"}
    with pytest.raises(TypeError):
        man.meta["x"] = 1  # type: ignore[index]

    # The next edit starts from the current version and keeps what it does not touch.
    with mstore.edit("exp") as m:
        assert m.base is not None and m.base.digest == man.digest
        assert dict(m.meta) == dict(man.meta) and m["with-meta"] == man["with-meta"]
        del m["plain"]
        m.meta["lr"] = 1e-4
    man2 = mstore.manifest("exp")
    assert man2.parent == man.digest
    assert sorted(man2) == ["as-str", "with-meta"]
    assert man2.meta["lr"] == 1e-4 and man2.meta["git_commit"] == "abc123"


def test_nested_manifest_metadata_changes_are_committed(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["x"] = objs["a"]
        m.meta["cfg"] = {"lr": 1, "layers": [1, 2]}
    with mstore.edit("exp") as m:
        m.meta["cfg"]["lr"] = 2
        m.meta["cfg"]["layers"].append(3)
    man = mstore.manifest("exp")
    assert man.meta["cfg"] == {"lr": 2, "layers": [1, 2, 3]}
    assert len(mstore.history("exp")) == 2
    assert mstore.history("exp")[1].meta["cfg"] == {"lr": 1, "layers": [1, 2]}  # the old version is untouched


def test_metadata_type_changes_are_changes(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    """1 == 1.0 == True in Python, but they are different metadata values."""
    with mstore.edit("exp") as m:
        m["x"] = objs["a"]
        m.meta["flag"] = 1
        m.meta["rate"] = 1
    with mstore.edit("exp") as m:
        m.meta["flag"] = True
        m.meta["rate"] = 1.0
    man = mstore.manifest("exp")
    assert len(mstore.history("exp")) == 2
    assert man.meta["flag"] is True and isinstance(man.meta["rate"], float)


def test_edit_without_changes_writes_no_version(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("new"):
        pass
    assert "new" not in mstore.heads()
    with mstore.edit("exp") as m:
        m["x"] = objs["a"]
    before = mstore.heads()["exp"]
    n_objects = len(list(mstore.iter_objects()))
    with mstore.edit("exp") as m:
        m.meta["k"] = 1
        del m.meta["k"]
        assert m["x"].digest == objs["a"]
    assert mstore.heads()["exp"] == before
    assert len(list(mstore.iter_objects())) == n_objects


def test_exception_inside_edit_discards_everything(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["keep"] = objs["a"]
    before = mstore.heads()["exp"]
    n_objects = len(list(mstore.iter_objects()))
    with pytest.raises(RuntimeError, match="boom"):
        with mstore.edit("exp") as m:
            m["new"] = objs["b"]
            del m["keep"]
            m.meta["x"] = 1
            raise RuntimeError("boom")
    assert mstore.heads()["exp"] == before
    assert sorted(mstore.manifest("exp")) == ["keep"] and dict(mstore.manifest("exp").meta) == {}
    assert len(list(mstore.iter_objects())) == n_objects  # no version object was written
    assert len(mstore.history("exp")) == 1
    with pytest.raises(KeyError):
        with mstore.edit("fresh") as m:
            m["a"] = objs["a"]
            raise KeyError("nope")
    assert "fresh" not in mstore.heads()
    # The lock was released: a non-waiting edit gets it at once.
    with mstore.edit("exp", timeout=0) as m:
        m["new"] = objs["b"]
    assert sorted(mstore.manifest("exp")) == ["keep", "new"]


def test_refs_move_by_rename_and_lock_files_stay_separate(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("team/exp") as m:
        m["x"] = objs["a"]
    old = mstore.heads()["team/exp"]
    rp = ref_file(mstore.root, "heads", "team/exp")
    assert rp == mstore.root / "refs" / "heads" / "team" / "exp"
    assert rp.read_bytes() == f"{old}\n0\n".encode()  # the version and its claim log position (docs/format.md)
    assert stat.S_IMODE(rp.stat().st_mode) == 0o444
    lp = lock_file(mstore.root, "team/exp")
    assert lp.is_file() and lp.stat().st_size == 0
    lock_ino = lp.stat().st_ino
    with open(rp, "rb") as before:  # a reader that opened the old ref
        ino = os.fstat(before.fileno()).st_ino
        with mstore.edit("team/exp") as m:
            m["y"] = objs["b"]
        new = mstore.heads()["team/exp"]
        assert new != old
        # Replaced by rename: the old inode still holds the old, complete content.
        assert before.read() == f"{old}\n0\n".encode()
    assert rp.read_bytes() == f"{new}\n1\n".encode()
    assert os.stat(rp).st_ino != ino
    assert lp.stat().st_ino == lock_ino  # the lock file is never replaced
    assert os.listdir(mstore.root / "tmp") == []


# -- history and diff -----------------------------------------------------------------


def test_history_is_newest_first_and_follows_parents(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    digests = []
    for i, k in enumerate(["a", "b", "c", "d"]):
        with mstore.edit("exp") as m:
            m[k] = objs[k]
            m.meta["step"] = i
        assert m.result is not None
        digests.append(m.result.digest)
    h = mstore.history("exp")
    assert [v.digest for v in h] == digests[::-1]
    assert [v.meta["step"] for v in h] == [3, 2, 1, 0]
    assert [len(v) for v in h] == [4, 3, 2, 1]
    assert [v.parent for v in h] == digests[::-1][1:] + [None]
    assert [v.digest for v in mstore.history("exp", limit=2)] == digests[::-1][:2]
    # From a version digest: that version and its ancestors.
    assert [v.digest for v in mstore.history(digests[1])] == [digests[1], digests[0]]
    # History survives freezing.
    mstore.freeze("exp")
    assert [v.digest for v in mstore.history("exp")] == digests[::-1]


def test_diff_reports_added_removed_and_changed(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["same"] = objs["a"]
        m["gone"] = objs["b"]
        m["changed"] = objs["c"]
        m["meta-only"] = Entry(objs["d"], meta={"v": 1})
    v1 = mstore.manifest("exp")
    with mstore.edit("exp") as m:
        del m["gone"]
        m["changed"] = objs["d"]
        m["meta-only"] = Entry(objs["d"], meta={"v": 2})
        m["new"] = objs["a"]
    v2 = mstore.manifest("exp")
    for a, b in [(v1.digest, "exp"), (str(v1.digest), v2.digest), (v1, v2)]:
        d = mstore.diff(a, b)
        assert sorted(d.added) == ["new"] and d.added["new"].digest == objs["a"]
        assert sorted(d.removed) == ["gone"] and d.removed["gone"].digest == objs["b"]
        assert sorted(d.changed) == ["changed", "meta-only"]
        assert (d.changed["changed"][0].digest, d.changed["changed"][1].digest) == (objs["c"], objs["d"])
        assert d.changed["meta-only"][1].meta["v"] == 2
        assert d
    back = mstore.diff(v2, v1)
    assert sorted(back.added) == ["gone"] and sorted(back.removed) == ["new"]
    assert not mstore.diff(v2, "exp") and not mstore.diff(v1, v1.digest)


def test_an_entry_whose_metadata_holds_nan_is_not_changed_by_itself(mstore: casstore.Store,
                                                                    objs: Dict[str, Digest]) -> None:
    """NaN != NaN: such an entry was listed as changed in every diff, and a version differed from itself."""
    d = next(iter(objs.values()))
    with mstore.edit("nan") as m:
        m["f"] = casstore.Entry(d, None, {"x": float("nan")})
    with mstore.edit("nan") as m:
        m["g"] = d
    df = mstore.diff("nan~1", "nan")
    assert list(df.added) == ["g"] and not df.changed and not df.entry_meta
    assert not mstore.diff("nan", "nan")


def test_diff_reports_metadata_per_entry_and_manifest(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["w"] = Entry(objs["a"], meta={"lr": 1, "keep": "x", "drop": [1, 2]})
        m.meta.update(owner="ana", epochs=10, flag=1, cfg={"opt": {"lr": 0.1, "b": 2}})
    v1 = mstore.manifest("exp")
    with mstore.edit("exp") as m:
        m["w"] = Entry(objs["a"], meta={"lr": 2, "keep": "x", "new": True})
        m.meta.update(epochs=12, flag=True, cfg={"opt": {"lr": 0.2, "b": 2}}, note="rerun")
        del m.meta["owner"]
    d = mstore.diff(v1, "exp")
    assert not d.added and not d.removed and list(d.changed) == ["w"]
    assert d.a == v1.digest and d.b == mstore.manifest("exp").digest
    em = d.entry_meta["w"]
    assert dict(em.added) == {"new": True} and dict(em.removed) == {"drop": [1, 2]}
    assert dict(em.changed) == {"lr": (1, 2)}
    assert dict(d.meta.added) == {"note": "rerun"} and dict(d.meta.removed) == {"owner": "ana"}
    # 1 -> True is a change (stored differently), compared as encoded
    assert set(d.meta.changed) == {"epochs", "flag", "cfg"} and d.meta.changed["epochs"] == (10, 12)
    assert not d.params and not d.inputs and d
    # Metadata alone makes a diff non-empty; the same version has none.
    with mstore.edit("exp") as m:
        m.meta["note"] = "again"
    only_meta = mstore.diff(d.b, "exp")
    assert only_meta and not only_meta.changed and dict(only_meta.meta.changed) == {"note": ("rerun", "again")}
    assert not mstore.diff("exp", "exp").meta


def test_diff_reports_derive_params_and_inputs(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    from casstore.manifests.provenance import INPUTS_KEY

    def result(params: Dict[str, object], inputs: Dict[str, object]) -> casstore.Manifest:
        with mstore.edit("proc") as m:
            m["out"] = objs["d"]
            m.meta["derive"] = {"params": params, "version": 1}
            m.meta[INPUTS_KEY] = inputs
        assert m.result is not None
        return m.result

    r1 = result({"cutoff": 5.0, "mode": "a"}, {"raw": str(objs["a"]), "cfg": str(objs["b"])})
    r2 = result({"cutoff": 6.0, "seed": 1}, {"raw": str(objs["c"]), "data": {"manifest": str(r1.digest)}})
    d = mstore.diff(r1, r2)
    assert not d.changed and not d.added and not d.removed
    assert dict(d.params.changed) == {"cutoff": (5.0, 6.0)}
    assert dict(d.params.added) == {"seed": 1} and dict(d.params.removed) == {"mode": "a"}
    assert dict(d.inputs.changed) == {"raw": (str(objs["a"]), str(objs["c"]))}
    assert dict(d.inputs.added) == {"data": f"manifest {r1.digest}"} and list(d.inputs.removed) == ["cfg"]
    assert set(d.meta.changed) == {"derive", INPUTS_KEY}


def test_cli_diff_shows_metadata_params_and_inputs(mstore: casstore.Store, objs: Dict[str, Digest],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from casstore.cli import main
    from casstore.manifests.provenance import INPUTS_KEY

    with mstore.edit("proc") as m:
        m["out"] = objs["a"]
        m["w"] = Entry(objs["b"], meta={"lr": 1})
        m.meta.update(derive={"params": {"cutoff": 5.0}, "seconds": 1.5}, owner="ana", blob=b"\x00\x01")
        m.meta[INPUTS_KEY] = {"raw": str(objs["c"])}
    v1 = mstore.manifest("proc").digest
    with mstore.edit("proc") as m:
        m["out"] = objs["d"]
        m["w"] = Entry(objs["b"], meta={"lr": 2})
        m.meta.update(derive={"params": {"cutoff": 6.0}, "seconds": 2.5}, blob=b"\x02", note="\x1b[31mred",
                      **{"\x1b[2J": 1})
        del m.meta["owner"]
        m.meta[INPUTS_KEY] = {"raw": str(objs["a"])}
    assert main(["--store", str(mstore.root), "diff", str(v1), "proc"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"~ out  {objs['a'].short()} -> {objs['d'].short()}" in out
    assert f"~ w  {objs['b'].short()} (metadata only)" in out and "    meta ~ lr: 1 -> 2" in out
    assert "param ~ cutoff: 5.0 -> 6.0" in out
    assert f"input ~ raw: {objs['c'].short()} -> {objs['a'].short()}" in out
    assert "meta ~ derive.seconds: 1.5 -> 2.5" in out and "meta - owner (was 'ana')" in out
    assert "meta + note = '\\x1b[31mred'" in out  # control characters escaped, never sent to the terminal
    assert "meta + '\\x1b[2J' = 1" in out and not any("\x1b" in line for line in out)
    assert not any("derive.params" in line or INPUTS_KEY in line for line in out)  # shown once, as param/input
    assert main(["--store", str(mstore.root), "diff", "--json", str(v1), "proc"]) == 0
    doc = json.loads(capsys.readouterr().out)  # one JSON document
    assert doc["a"] == str(v1) and doc["same"] is False and list(doc["changed"]) == ["out", "w"]
    assert doc["params"]["changed"] == {"cutoff": [5.0, 6.0]}
    assert doc["inputs"]["changed"] == {"raw": [str(objs["c"]), str(objs["a"])]}
    assert doc["entry_meta"] == {"w": {"added": {}, "removed": {}, "changed": {"lr": [1, 2]}}}
    assert doc["meta"]["removed"] == {"owner": "ana"} and doc["meta"]["changed"]["blob"] == ["0001", "02"]
    assert main(["--store", str(mstore.root), "diff", "--json", "proc", "proc"]) == 0
    assert json.loads(capsys.readouterr().out)["same"] is True


# -- checkout ---------------------------------------------------------------------------


def test_checkout_writes_byte_identical_files_raw_and_zstd(mstore: casstore.Store, tmp_path: Path) -> None:
    originals = {
        "raw.bin": os.urandom(300_000),
        "nested/deep/text.txt": _compressible(2_000_000),
        "empty": b"",
        "small.txt": b"hello\n",
    }
    with mstore.edit("exp") as m:
        for k, data in originals.items():
            m[k] = mstore.put(data, compress=k.endswith(".txt"))
    assert mstore.stat(mstore.manifest("exp")["nested/deep/text.txt"].digest).codec == "zstd"
    assert mstore.stat(mstore.manifest("exp")["raw.bin"].digest).codec == "raw"
    out = tmp_path / "out"
    written = mstore.checkout("exp", out)
    assert sorted(written) == sorted(out / k for k in originals)
    for k, data in originals.items():
        assert (out / k).read_bytes() == data
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(originals)  # no temp files left behind
    # Checking out again over identical files is a no-op.
    assert mstore.checkout("exp", out) == []
    mstore.freeze("exp")
    out2 = tmp_path / "out2"
    mstore.checkout("exp", out2)
    assert all((out2 / k).read_bytes() == data for k, data in originals.items())


def test_checkout_refuses_to_overwrite_other_content(mstore: casstore.Store, tmp_path: Path) -> None:
    with mstore.edit("exp") as m:
        m["f.txt"] = mstore.put(b"right\n")
        m["g.txt"] = mstore.put(b"also right\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "f.txt").write_bytes(b"wrong\n")
    with pytest.raises(InvalidInputError, match="overwrite"):
        mstore.checkout("exp", out)
    assert (out / "f.txt").read_bytes() == b"wrong\n"
    (out / "f.txt").write_bytes(b"right\n!")  # same size would not do either
    with pytest.raises(InvalidInputError):
        mstore.checkout("exp", out)
    written = mstore.checkout("exp", out, overwrite=True)
    assert (out / "f.txt").read_bytes() == b"right\n" and (out / "g.txt").read_bytes() == b"also right\n"
    assert out / "f.txt" in written


# -- freeze and pins --------------------------------------------------------------------


def test_freeze_makes_a_name_permanent_and_is_idempotent(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["x"] = objs["a"]
        m.meta["k"] = "v"
    head = mstore.heads()["exp"]
    assert mstore.freeze("exp") == head
    assert "exp" not in mstore.heads() and mstore.pins() == {"exp": head}
    pin_file = ref_file(mstore.root, "pins", "exp")
    st0 = pin_file.stat()
    man = mstore.manifest("exp")
    assert man.frozen and man.digest == head and man.name == "exp"
    assert mstore.freeze("exp") == head  # idempotent
    for _attempt in range(2):
        with pytest.raises(FrozenError, match="frozen"):
            with mstore.edit("exp") as m:
                m["y"] = objs["b"]
    with pytest.raises(FrozenError):
        with mstore.edit("exp") as m:
            m.meta["k"] = "changed"
    st1 = pin_file.stat()
    assert (st1.st_ino, st1.st_mtime_ns) == (st0.st_ino, st0.st_mtime_ns)
    assert ref_text(mstore.root, "pins", "exp").split("\n")[0] == str(head)
    assert dict(mstore.manifest("exp")) == {"x": Entry(objs["a"], 1)} and mstore.manifest("exp").meta["k"] == "v"
    with pytest.raises(ObjectNotFoundError):
        mstore.freeze("never-existed")


def test_pin_needs_force_to_move_and_unpin_keeps_objects(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with mstore.edit("exp") as m:
        m["x"] = objs["a"]
    v1 = mstore.heads()["exp"]
    with mstore.edit("exp") as m:
        m["y"] = objs["b"]
    v2 = mstore.heads()["exp"]
    assert mstore.pin("paper", v1) == v1
    assert mstore.pin("paper", v1) == v1  # same target again: fine
    assert mstore.pin("paper", str(v1)) == v1
    with pytest.raises(FrozenError, match="force"):
        mstore.pin("paper", v2)
    with pytest.raises(FrozenError):
        mstore.pin("paper", "exp")  # by name: exp's current version is v2
    assert mstore.pins() == {"paper": v1} and mstore.manifest("paper").digest == v1
    with pytest.raises(FrozenError):
        with mstore.edit("paper") as m:
            m["z"] = objs["c"]
    assert mstore.pin("paper", v2, force=True) == v2
    assert mstore.pins() == {"paper": v2}
    assert sorted(mstore.manifest("paper")) == ["x", "y"]
    # A pin by name pins that name's current version.
    assert mstore.pin("snap", "exp") == v2
    # A head cannot be pinned over.
    with pytest.raises(InvalidInputError, match="freeze"):
        mstore.pin("exp", v1)
    assert mstore.heads()["exp"] == v2

    assert mstore.unpin("paper") == v2
    assert mstore.pins() == {"snap": v2}
    assert not ref_file(mstore.root, "pins", "paper").exists()
    for d in (v1, v2, objs["a"], objs["b"]):
        assert d in mstore and mstore.get(d)  # the objects remain
    assert sorted(mstore.manifest(v2)) == ["x", "y"]
    with pytest.raises(ObjectNotFoundError):
        mstore.manifest("paper")
    with pytest.raises(ObjectNotFoundError):
        mstore.unpin("paper")
    # The name is free again: editing it starts a new, parentless head.
    with mstore.edit("paper") as m:
        m["fresh"] = objs["c"]
    assert mstore.manifest("paper").parent is None and sorted(mstore.manifest("paper")) == ["fresh"]


def test_pin_targets_must_be_existing_manifests(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    with pytest.raises(casstore.StoreFormatError):
        mstore.pin("p", objs["a"])  # an object, but not a manifest
    with pytest.raises(ObjectNotFoundError):
        mstore.pin("p", Digest.of(b"not stored"))
    with pytest.raises(ObjectNotFoundError):
        mstore.pin("p", "no-such-name")
    assert mstore.pins() == {}


def test_heads_and_pins_listings(mstore: casstore.Store, objs: Dict[str, Digest]) -> None:
    assert mstore.heads() == {} and mstore.pins() == {}
    made = {}
    for name in ["zeta", "alpha", "team/a/exp-1", "team/b"]:
        with mstore.edit(name) as m:
            m["k"] = objs["a"]
            m.meta["name"] = name
        made[name] = mstore.manifest(name).digest
    assert mstore.heads() == dict(sorted(made.items()))
    assert list(mstore.heads()) == ["alpha", "team/a/exp-1", "team/b", "zeta"]
    mstore.freeze("team/a/exp-1")
    mstore.pin("release/v1", made["zeta"])
    assert mstore.heads() == {k: made[k] for k in ["alpha", "team/b", "zeta"]}
    assert mstore.pins() == {"release/v1": made["zeta"], "team/a/exp-1": made["team/a/exp-1"]}
    # A name cannot also be a directory of other names.
    with pytest.raises(InvalidInputError):
        with mstore.edit("team") as m:
            m["k"] = objs["a"]
    with pytest.raises(InvalidInputError):
        with mstore.edit("alpha/sub") as m:
            m["k"] = objs["a"]
    assert "team" not in mstore.heads() and "alpha/sub" not in mstore.heads()
    assert mstore.manifest("alpha").digest == made["alpha"]
