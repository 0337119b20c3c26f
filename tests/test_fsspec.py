"""casstore:// through fsspec (casstore/fsspec.py): pandas, xarray and zarr read stored files in place.

Real stores on the real filesystem, the real readers (pandas, xarray + h5netcdf, zarr), the real
entry-point registration in a fresh interpreter; nothing mocked.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import fsspec
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from _corrupt import flip_byte
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import casstore
from casstore.fsspec import AmbiguousPathError, CasstoreFileSystem

CSV1 = b"step,loss\n1,0.9\n2,0.5\n"
CSV2 = b"step,loss\n1,0.8\n2,0.4\n3,0.2\n"


def obj_file(store: casstore.Store, d: casstore.Digest) -> Path:
    """The object's file (raw or .zst), found by name under objects/ (no private API)."""
    hexd = str(d).split(":", 1)[1]
    (hit,) = [p for p in (store.root / "objects" / hexd[:2]).iterdir() if p.name.startswith(hexd[2:])]
    return hit


def snapshot(root: Path) -> Dict[str, int]:
    """Every file under the store except locks and tmp, with its size: a write anywhere changes it."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and p.relative_to(root).parts[0] not in ("locks", "tmp")}


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    s = casstore.open(tmp_path / "store")
    with s.edit("exp") as m:
        m["metrics.csv"] = s.put(CSV1)
        m["logs/run.txt"] = s.put(b"log line\n" * 2000, compress=True)
        m["logs/deep/a.bin"] = s.put(bytes(range(256)) * 64)
    with s.edit("exp") as m:
        m["metrics.csv"] = s.put(CSV2)
    with s.edit("qm9/processed") as m:
        m["data.npz"] = s.put(b"npz bytes")
    return s


@pytest.fixture
def fs(store: casstore.Store) -> CasstoreFileSystem:
    return CasstoreFileSystem(store=store)


# -- the readers ------------------------------------------------------------------------------


def test_pandas_read_csv_by_url(store: casstore.Store) -> None:
    df = pd.read_csv("casstore://exp/metrics.csv", storage_options={"store": str(store.root)})
    assert list(df["step"]) == [1, 2, 3] and df["loss"].iloc[-1] == pytest.approx(0.2)
    old = pd.read_csv("casstore://exp~1/metrics.csv", storage_options={"store": store.root})
    assert list(old["step"]) == [1, 2]


def test_pandas_default_store_follows_casstore_dir(store: casstore.Store, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("CASSTORE_DIR", str(store.root))
    assert len(pd.read_csv("casstore://exp/metrics.csv")) == 3
    # Another default store later in the same process: no cached instance keeps the old one.
    other = casstore.open(tmp_path / "other")
    with other.edit("exp") as m:
        m["metrics.csv"] = other.put(b"step\n7\n")
    monkeypatch.setenv("CASSTORE_DIR", str(other.root))
    assert list(pd.read_csv("casstore://exp/metrics.csv")["step"]) == [7]


def _dataset() -> xr.Dataset:
    return xr.Dataset({"t2m": (("time", "x"), np.arange(12.0).reshape(3, 4))},
                      coords={"time": np.arange(3), "x": np.arange(4) * 0.5}, attrs={"source": "test"})


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
def test_xarray_netcdf_through_fsspec_open(tmp_path: Path, compress: bool) -> None:
    s = casstore.open(tmp_path / "store")
    _dataset().to_netcdf(tmp_path / "t.nc", engine="h5netcdf")
    # Padding that zstd shrinks well, so the zstd case really is a compressed object.
    d = s.put(Path(tmp_path / "t.nc").read_bytes() + bytes(1 << 16), compress=compress)
    assert s.stat(d).codec == ("zstd" if compress else "raw")
    with s.edit("clim") as m:
        m["era5/t.nc"] = d
    # h5py seeks all over the file: the compressed object must be seekable too.
    with fsspec.open("casstore://clim/era5/t.nc", store=s) as f:
        ds = xr.open_dataset(f, engine="h5netcdf")
        assert ds.attrs["source"] == "test"
        np.testing.assert_array_equal(ds["t2m"].values, _dataset()["t2m"].values)
        ds.close()


def _put_tree(s: casstore.Store, name: str, prefix: str, folder: Path) -> None:
    with s.edit(name) as m:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                m[prefix + p.relative_to(folder).as_posix()] = s.put_path(p)


def test_zarr_through_xarray_and_damaged_chunk(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "store")
    _dataset().to_zarr(tmp_path / "t.zarr", zarr_format=3, consolidated=False)
    _put_tree(s, "clim", "t.zarr/", tmp_path / "t.zarr")
    opts = {"store": str(s.root)}
    z = xr.open_zarr("casstore://clim/t.zarr", storage_options=opts, consolidated=False)
    np.testing.assert_array_equal(z["t2m"].values, _dataset()["t2m"].values)
    # Each chunk is a whole object read with cat_file: verified.  Damage the data chunk.
    man = s.manifest("clim")
    (chunk,) = [k for k in man if k.startswith("t.zarr/t2m/c/")]
    flip_byte(obj_file(s, man[chunk].digest), 3)
    z = xr.open_zarr("casstore://clim/t.zarr", storage_options=opts, consolidated=False)
    with pytest.raises(casstore.IntegrityError):
        z["t2m"].values  # noqa: B018 - the read is the test


def test_a_copy_of_a_damaged_object_leaves_no_file_and_caches_nothing(tmp_path: Path) -> None:
    """Found by a bug hunt: ``fs.get`` of a damaged object kept its first 8 MiB at the destination, and
    ``simplecache::`` (which fetches with get_file) then served those bytes without an error."""
    s = casstore.open(tmp_path / "store")
    with s.edit("exp") as m:
        m["b.bin"] = d = s.put(os.urandom(12 << 20))
    flip_byte(obj_file(s, d), 100)
    fs = CasstoreFileSystem(store=s)
    dest = tmp_path / "out" / "b.bin"
    with pytest.raises(casstore.IntegrityError):
        fs.get("exp/b.bin", str(dest))
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []  # no partial file, no temp file
    cache = tmp_path / "cache"
    for _ in range(2):  # the second open must not find a cached copy of the damaged bytes
        with pytest.raises(casstore.IntegrityError):
            with fsspec.open("simplecache::casstore://exp/b.bin", "rb", casstore={"store": str(s.root)},
                             simplecache={"cache_storage": str(cache)}) as f:
                f.read()
    with fs.open("exp/b.bin", cache_type="readahead") as f:  # fsspec's open options (were a TypeError)
        assert len(f.read(10)) == 10
    good = s.put(b"fine bytes")
    with s.edit("ok") as m:
        m["g.bin"] = good
    fs.get("ok/g.bin", str(tmp_path / "g.bin"))
    assert (tmp_path / "g.bin").read_bytes() == b"fine bytes"


# -- ls / info / cat ----------------------------------------------------------------------------


def test_ls_tree_of_names_and_keys(fs: CasstoreFileSystem) -> None:
    assert fs.ls("", detail=False) == ["exp", "qm9"]
    assert fs.ls("casstore://", detail=False) == ["exp", "qm9"]
    assert fs.ls("exp", detail=False) == ["exp/logs", "exp/metrics.csv"]
    assert fs.ls("exp/logs/", detail=False) == ["exp/logs/deep", "exp/logs/run.txt"]
    assert fs.ls("qm9", detail=False) == ["qm9/processed"]
    assert fs.ls("qm9/processed", detail=False) == ["qm9/processed/data.npz"]
    assert fs.find("") == ["exp/logs/deep/a.bin", "exp/logs/run.txt", "exp/metrics.csv", "qm9/processed/data.npz"]
    assert [(e["name"], e["type"]) for e in fs.ls("exp")] == [("exp/logs", "directory"), ("exp/metrics.csv", "file")]
    assert fs.ls("exp/metrics.csv", detail=False) == ["exp/metrics.csv"]  # a file lists itself
    assert fs.glob("exp/**/*.bin") == ["exp/logs/deep/a.bin"]
    for missing in ("nope", "exp/nope", "exp/logs/nope", "qm9/other"):
        with pytest.raises(FileNotFoundError):
            fs.ls(missing)


def test_info_isdir_isfile_exists(fs: CasstoreFileSystem, store: casstore.Store) -> None:
    man = store.manifest("exp")
    info = fs.info("casstore://exp/logs/run.txt")
    d = man["logs/run.txt"].digest
    assert info["type"] == "file" and info["size"] == 9 * 2000 == store.stat(d).size
    assert info["digest"] == str(d) and info["codec"] == "zstd" and info["version"] == str(man.digest)
    assert int(str(info["stored_size"])) < 9 * 2000
    assert fs.info("exp/metrics.csv")["codec"] == "raw" and fs.size("exp/metrics.csv") == len(CSV2)
    assert fs.info("exp")["type"] == "directory" and fs.info("exp")["version"] == str(man.digest)
    assert fs.isdir("exp/logs") and fs.isdir("qm9") and fs.isdir("") and not fs.isfile("exp/logs")
    assert fs.isfile("exp/logs/deep/a.bin") and fs.exists("qm9/processed/data.npz")
    assert not fs.exists("exp/log") and not fs.exists("ex") and not fs.exists("exp/metrics.csv/x")
    assert fs.ukey("exp/metrics.csv") == str(man["metrics.csv"].digest)


def test_cat_and_ranges(fs: CasstoreFileSystem) -> None:
    assert fs.cat("exp/metrics.csv") == CSV2
    assert fs.cat_file("exp/logs/run.txt") == b"log line\n" * 2000
    data = bytes(range(256)) * 64
    assert fs.cat_file("exp/logs/deep/a.bin", 10, 20) == data[10:20]
    assert fs.cat_file("exp/logs/deep/a.bin", -5) == data[-5:]
    assert fs.cat_file("exp/logs/deep/a.bin", 100, -100) == data[100:-100]
    assert fs.cat_file("exp/logs/run.txt", 9 * 1999 + 4, None) == b"line\n"  # a range of a zstd object
    assert fs.cat_file("exp/metrics.csv", 5, 5) == b""
    assert fs.cat(["exp/metrics.csv", "qm9/processed/data.npz"]) == {
        "exp/metrics.csv": CSV2, "qm9/processed/data.npz": b"npz bytes"}
    for d in ("exp/logs", "exp", "qm9", "", "exp//logs"):
        with pytest.raises(IsADirectoryError):
            fs.cat_file(d)


def test_open_text_and_seek_on_compressed(fs: CasstoreFileSystem) -> None:
    with fs.open("exp/metrics.csv", "r") as f:
        assert f.read() == CSV2.decode()
    expect = b"log line\n" * 2000
    with fs.open("exp/logs/run.txt") as f:
        assert f.seekable()
        f.seek(9 * 1000 + 4)
        assert f.read(5) == b"line\n"
        f.seek(-5, io.SEEK_END)
        assert f.read() == b"line\n"
        f.seek(0)  # backwards: reopened
        assert f.read() == expect and f.tell() == len(expect)


# -- versions ---------------------------------------------------------------------------------------


def test_version_addressing(fs: CasstoreFileSystem, store: casstore.Store) -> None:
    first = store.history("exp")[1].digest
    assert fs.cat("exp~1/metrics.csv") == CSV1 and fs.cat("exp~0/metrics.csv") == CSV2
    hexp = str(first).split(":")[1][:10]
    assert fs.cat(f"exp@{hexp}/metrics.csv") == CSV1
    assert fs.cat(f"{first}/metrics.csv") == CSV1
    assert fs.ls("exp~1", detail=False) == ["exp~1/logs", "exp~1/metrics.csv"]
    assert fs.info("exp~1")["version"] == str(first)
    assert pd.read_csv(f"casstore://exp@{hexp}/metrics.csv", storage_options={"store": store}).shape == (2, 2)
    with pytest.raises(FileNotFoundError):
        fs.cat("exp~5/metrics.csv")


# -- verification -------------------------------------------------------------------------------------


def test_flipped_byte_is_integrity_error_on_every_full_read(store: casstore.Store, fs: CasstoreFileSystem) -> None:
    man = store.manifest("exp")
    flip_byte(obj_file(store, man["metrics.csv"].digest), 12)
    with pytest.raises(casstore.IntegrityError):
        fs.cat("exp/metrics.csv")
    with pytest.raises(casstore.IntegrityError):
        with fs.open("exp/metrics.csv") as f:
            f.read()
    with pytest.raises(casstore.IntegrityError):
        pd.read_csv("casstore://exp/metrics.csv", storage_options={"store": store})
    with pytest.raises(casstore.IntegrityError):
        fs.open("exp/metrics.csv", verify="full")  # before any byte is handed out
    with pytest.raises(casstore.IntegrityError):
        CasstoreFileSystem(store, verify="full").cat_file("exp/metrics.csv", 0, 4)
    # Documented: a range / a seek is not verified in the default mode.
    assert len(fs.cat_file("exp/metrics.csv", 1, 5)) == 4
    with fs.open("exp/metrics.csv") as f:
        f.seek(1)
        assert len(f.read()) == len(CSV2) - 1
    # A damaged compressed object too.
    zst = obj_file(store, man["logs/run.txt"].digest)
    assert zst.name.endswith(".zst")
    flip_byte(zst, zst.stat().st_size // 2)
    with pytest.raises(casstore.IntegrityError):
        fs.cat("exp/logs/run.txt")
    with pytest.raises(casstore.IntegrityError):
        with fs.open("exp/logs/run.txt") as f:
            f.read()


def test_verify_full_reads_good_objects(store: casstore.Store) -> None:
    full = CasstoreFileSystem(store, verify="full")
    with full.open("exp/logs/run.txt") as f:
        assert f.tell() == 0 and f.read(8) == b"log line"
    assert full.cat_file("exp/logs/deep/a.bin", 1, 3) == bytes([1, 2])
    with pytest.raises(ValueError, match="verify"):
        CasstoreFileSystem(store, verify="sometimes")  # type: ignore[arg-type]


# -- writes refused ----------------------------------------------------------------------------


def test_writes_are_refused_and_nothing_changes(store: casstore.Store, fs: CasstoreFileSystem,
                                                 tmp_path: Path) -> None:
    before = snapshot(store.root)
    local = tmp_path / "local.txt"
    local.write_text("x")
    attempts = [
        lambda: fs.open("exp/new.csv", "wb"),
        lambda: fs.open("exp/metrics.csv", "w"),
        lambda: fs.open("exp/metrics.csv", "ab"),
        lambda: fs.pipe("exp/new.csv", b"data"),
        lambda: fs.pipe_file("exp/new.csv", b"data"),
        lambda: fs.touch("exp/new.csv"),
        lambda: fs.rm("exp/metrics.csv"),
        lambda: fs.rm("exp", recursive=True),
        lambda: fs.rm_file("exp/metrics.csv"),
        lambda: fs.mkdir("exp/newdir"),
        lambda: fs.makedirs("exp/newdir", exist_ok=True),
        lambda: fs.rmdir("exp/logs"),
        lambda: fs.mv("exp/metrics.csv", "exp/m2.csv"),
        lambda: fs.cp_file("exp/metrics.csv", "exp/m2.csv"),
        lambda: fs.copy("exp/metrics.csv", "exp/m2.csv"),
        lambda: fs.put_file(str(local), "exp/local.txt"),
        lambda: fs.put(str(local), "exp/local.txt"),
    ]
    for i, attempt in enumerate(attempts):
        with pytest.raises(casstore.ReadOnlyError, match="read-only") as e:
            attempt()
        assert isinstance(e.value, PermissionError), i
    with pytest.raises(casstore.ReadOnlyError):
        with fsspec.open("casstore://exp/x.csv", "wb", store=store) as f:
            f.write(b"no")
    assert snapshot(store.root) == before
    assert fs.cat("exp/metrics.csv") == CSV2


# -- hostile paths -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [
    "exp/../exp/metrics.csv", "exp/./metrics.csv", "../exp/metrics.csv", "exp/logs/../../qm9",
    "/exp/metrics.csv", "casstore:///etc/passwd", "exp/metrics.csv\x00.txt", "exp\x00",
    "exp/log\ns", "exp\\metrics.csv", "exp//../x", "exp//a//b", "..//metrics.csv",
])
def test_hostile_paths_refused(fs: CasstoreFileSystem, path: str) -> None:
    for call in (fs.info, fs.cat_file, fs.ls, fs.open):
        with pytest.raises(casstore.InvalidInputError):
            call(path)
    assert not fs.exists(path)


def test_unknown_names_and_keys_are_file_not_found(fs: CasstoreFileSystem) -> None:
    for path in ("nope/metrics.csv", "exp/nope.csv", "exp//nope.csv", "nope//x", "exp/metrics.csv/x",
                 "_fetch/x", "qm9/processed/nope", "qm9/nope/data.npz"):
        for call in (fs.info, fs.cat_file, fs.open):
            with pytest.raises(FileNotFoundError):
                call(path)
    with pytest.raises(casstore.ObjectNotFoundError):
        fs.cat("blake3:" + "0" * 64 + "/x")


def test_pickles_for_other_processes(store: casstore.Store) -> None:
    """dask and multiprocessing ship the filesystem to workers by pickle."""
    for arg in (store, str(store.root)):
        fs2 = pickle.loads(pickle.dumps(CasstoreFileSystem(arg, verify="full")))
        assert fs2.store.root == store.root and fs2.verify == "full" and fs2.cat("exp/metrics.csv") == CSV2


def test_store_argument(tmp_path: Path, store: casstore.Store) -> None:
    with pytest.raises(casstore.StoreFormatError):
        CasstoreFileSystem(tmp_path / "not-a-store")
    assert not (tmp_path / "not-a-store").exists()  # a typo never creates a store
    with pytest.raises(casstore.InvalidTypeError):
        CasstoreFileSystem(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        fsspec.filesystem("casstore", store=store, use_listingz_cache=True)  # a typo'd option is not ignored
    assert CasstoreFileSystem(store.root).cat("exp/metrics.csv") == CSV2
    assert CasstoreFileSystem(str(store.root)).cat("exp/metrics.csv") == CSV2


# -- how a path splits into name and key --------------------------------------------------------


def _plant_pin(s: casstore.Store, name: str, d: casstore.Digest) -> None:
    """A pin ref file written by hand (as releases before the cross-kind name rule could leave one)."""
    p = s.root / "refs" / "pins" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"{d}\n0\n")


@pytest.fixture
def nested(tmp_path: Path) -> casstore.Store:
    """Head 'a' with key 'b/c' and pin 'a/b' with key 'c'.  The store now refuses a name that is the folder
    of another of either kind, but stores made before that rule may hold such a pair: paths stay
    unambiguous for them too."""
    s = casstore.open(tmp_path / "nested")
    with s.edit("ab") as m:
        m["c"] = s.put(b"key c of name a/b")
        m["d"] = s.put(b"key d of name a/b")
    ab = s.remove("ab")
    with s.edit("a") as m:
        m["b/c"] = s.put(b"key b/c of name a")
        m["x"] = s.put(b"key x of name a")
    _plant_pin(s, "a/b", ab)
    return s


def test_ambiguous_path_is_refused_explicit_forms_work(nested: casstore.Store) -> None:
    fs = CasstoreFileSystem(nested)
    with pytest.raises(AmbiguousPathError, match=r"casstore://a/b//c.*casstore://a//b/c"):
        fs.cat("a/b/c")
    with pytest.raises(AmbiguousPathError):
        fs.ls("a/b")  # 'a/b' is both the name a/b and the directory b of name a
    assert fs.cat("a//b/c") == b"key b/c of name a"
    assert fs.cat("a/b//c") == b"key c of name a/b"
    assert fs.ls("a//b", detail=False) == ["a//b/c"] and fs.ls("a/b//", detail=False) == ["a/b//c", "a/b//d"]
    # Unambiguous paths need no '//': only one name can claim them.
    assert fs.cat("a/b/d") == b"key d of name a/b"
    assert fs.cat("a/x") == b"key x of name a"
    assert fs.ls("a", detail=False) == ["a/b", "a/x"]


def test_a_new_name_makes_a_path_fail_never_read_other_bytes(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "s")
    with s.edit("data") as m:
        m["train/x.csv"] = s.put(b"the original")
    fs = CasstoreFileSystem(s)
    assert fs.cat("data/train/x.csv") == b"the original"
    with s.edit("other") as m:  # a version under a name that could claim the path (a store made before
        m["x.csv"] = s.put(b"something else")  # the cross-kind name rule: planted by hand)
    _plant_pin(s, "data/train", s.manifest("other").digest)
    with pytest.raises(AmbiguousPathError):
        fs.cat("data/train/x.csv")
    assert fs.cat("data//train/x.csv") == b"the original"


# -- packaging -----------------------------------------------------------------------------------


def _python(code: str, env_extra: Dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_entry_point_registers_the_protocol(store: casstore.Store) -> None:
    """A fresh interpreter that never imported casstore.fsspec finds casstore:// through the entry point."""
    code = (
        "import sys, fsspec, importlib.metadata as md\n"
        "eps = [e for e in md.entry_points(group='fsspec.specs') if e.name == 'casstore']\n"
        "assert [e.value for e in eps] == ['casstore.fsspec:CasstoreFileSystem'], eps\n"
        "assert 'casstore.fsspec' not in sys.modules\n"
        f"fs = fsspec.filesystem('casstore', store={str(store.root)!r})\n"
        "print(type(fs).__module__, type(fs).__name__)\n"
        f"with fsspec.open('casstore://exp/metrics.csv', store={str(store.root)!r}) as f:\n"
        "    print(f.read().decode().splitlines()[-1])\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["casstore.fsspec CasstoreFileSystem", "3,0.2"]


def test_casstore_imports_without_fsspec() -> None:
    code = (
        "import sys\n"
        "sys.modules['fsspec'] = None  # as if it were not installed\n"
        "import casstore, casstore.cli.app\n"
        "try:\n"
        "    import casstore.fsspec\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert "pip install 'casstore[fsspec]'" in r.stdout


def test_layer_listing_names_only_public(fs: CasstoreFileSystem, store: casstore.Store) -> None:
    names: List[str] = [n.name for n in store.names()]
    assert fs.ls("", detail=False) == sorted({n.split("/")[0] for n in names})


# -- the split rule as a property ----------------------------------------------------------------

_SEG = st.sampled_from(["a", "b", "c"])
_PATHS = st.lists(_SEG, min_size=1, max_size=3).map("/".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(heads=["a"], pins=["a/b"], keys=["b/c", "c"])
@example(heads=["a/b", "c"], pins=["a", "c/a/b"], keys=["b", "a/b/c", "c"])
@given(heads=st.lists(_PATHS, max_size=4), pins=st.lists(_PATHS, max_size=3),
       keys=st.lists(_PATHS, min_size=1, max_size=4))
def test_a_plain_path_reads_what_its_explicit_form_reads_or_is_refused(
        tmp_path_factory: pytest.TempPathFactory, heads: List[str], pins: List[str], keys: List[str]) -> None:
    """Whatever heads and pins nest, ``NAME/KEY`` reads the bytes ``NAME//KEY`` reads, or is an
    AmbiguousPathError: never another name's bytes."""
    s = casstore.open(tmp_path_factory.mktemp("prop") / "s", durable=False)
    made: Dict[str, casstore.Manifest] = {}
    for kind, names in (("head", heads), ("pin", pins)):
        for name in names:
            try:
                with s.edit(f"tmp-{kind}") as m:
                    for k in keys:
                        m[k] = s.put(f"{kind} {name} {k}".encode())
                if kind == "head":
                    s.rename(f"tmp-{kind}", name, force=True)
                else:
                    s.pin(name, s.manifest(f"tmp-{kind}").digest, force=True)
                    s.remove(f"tmp-{kind}")
            # A prefix clash within one kind: the store refuses the name.  (NotADirectoryError: the refs
            # layer in the tree on 2026-12-01 lets a clash two levels deep, 'a' then 'a/b/c', escape
            # untyped; that is the refs layer's to fix, and this test is about paths.)
            except (casstore.InvalidInputError, NotADirectoryError):
                continue
            made[name] = s.manifest(name)
    fs = CasstoreFileSystem(s)
    for name, man in made.items():
        for key in man:
            want = s.get(man[key].digest)
            assert fs.cat(f"{name}//{key}") == want
            try:
                got = fs.cat(f"{name}/{key}")
            except AmbiguousPathError:
                continue
            assert got == want, f"{name}/{key}"
