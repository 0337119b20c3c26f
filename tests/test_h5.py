"""store.open_hdf5: read-only h5py access to objects that any number of processes may hold open.

HDF5 keeps an flock on a file for as long as it is open (shared for 'r',
exclusive for 'r+'/'a'/'w'), so plain ``h5py.File`` fails with "unable to lock
file" whenever modes conflict.  Objects never change, so ``open_hdf5`` opens
them with ``locking=False``; these tests check the flock really is absent
(not just that two shared locks happen to coexist).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Tuple

import h5py
import numpy as np
import pytest
from _corrupt import flip_byte
from _fetch_helpers import SPAWN, assert_objects_valid, flock_holder, hdf5_holder, hdf5_reader, results

import casstore
from casstore.errors import (
    CompressedObjectError,
    IntegrityError,
    InvalidTypeError,
    ObjectNotFoundError,
    StoreFormatError,
)

DATA = np.tile(np.arange(100, dtype=np.float64), 2000)  # 1.6 MB, very compressible
TOTAL = float(DATA.sum())


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


@pytest.fixture
def h5file(tmp_path: Path) -> Path:
    p = tmp_path / "src.h5"
    with h5py.File(p, "w") as f:
        f["x"] = DATA
        f["group/y"] = np.arange(12, dtype=np.int32).reshape(3, 4)
        f.attrs["title"] = "test file"
    return p


def test_open_hdf5_reads_read_only(store: casstore.Store, h5file: Path) -> None:
    d = store.put_path(h5file, compress=False)
    with store.open_hdf5(d) as f:
        assert f.mode == "r"
        np.testing.assert_array_equal(f["x"][...], DATA)
        np.testing.assert_array_equal(f["group/y"][...], np.arange(12).reshape(3, 4))
        assert f.attrs["title"] == "test file"
        assert Path(f.filename) == store.path(d)
        with pytest.raises((OSError, ValueError, KeyError)):
            f["new"] = np.zeros(3)  # read-only handle
    with store.open_hdf5(str(d), rdcc_nbytes=1 << 20) as f:  # other h5py keyword arguments pass through
        assert f["x"].shape == DATA.shape
    assert_objects_valid(store)


def test_open_hdf5_errors(store: casstore.Store, h5file: Path) -> None:
    d = store.put_path(h5file, compress=False)
    with pytest.raises(TypeError):
        store.open_hdf5(d, mode="r+")
    with pytest.raises(TypeError):
        store.open_hdf5(d, locking=True)
    not_h5 = store.put(b"this is not an HDF5 file" * 100)
    with pytest.raises(StoreFormatError, match="HDF5"):
        store.open_hdf5(not_h5)
    with pytest.raises(ObjectNotFoundError):
        store.open_hdf5("blake3:" + "0" * 64)


def test_compressed_object_is_materialized_once(store: casstore.Store, h5file: Path) -> None:
    d = store.put_path(h5file, compress=True)
    assert store.stat(d).codec == "zstd"
    assert store.stat(d).stored_size < store.stat(d).size // 4
    with pytest.raises(CompressedObjectError):
        store.path(d)
    with store.open_hdf5(d) as f:
        np.testing.assert_array_equal(f["x"][...], DATA)
    raw = store.path(d)  # now it has a raw path
    assert raw.read_bytes() == h5file.read_bytes()
    st1 = os.stat(raw)
    with store.open_hdf5(d) as f:
        assert float(f["x"][...].sum()) == TOTAL
    st2 = os.stat(raw)
    assert (st1.st_ino, st1.st_mtime_ns) == (st2.st_ino, st2.st_mtime_ns)  # cached, not re-materialized
    assert not st2.st_mode & 0o222  # read-only like every object
    assert store.get(d) == h5file.read_bytes()
    assert assert_objects_valid(store).count(str(d)) == 2  # both forms exist and both are valid
    assert os.listdir(store.root / "tmp") == []


def _start_holders(root: Path, d: str, n: int) -> Tuple[Any, Any, list[Any]]:
    release = SPAWN.Event()
    q = SPAWN.Queue()
    procs = []
    for _ in range(n):
        ready = SPAWN.Event()
        p = SPAWN.Process(target=hdf5_holder, args=(str(root), d, "x", ready, release, q))
        p.start()
        procs.append((p, ready))
    for _p, ready in procs:
        assert ready.wait(30), "a holder never opened the file"
    return release, q, [p for p, _ in procs]


@pytest.mark.parametrize("compress", [False, True])
def test_two_holders_and_a_reader(tmp_path: Path, h5file: Path, compress: bool) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    d = str(store.put_path(h5file, compress=compress))
    # Two processes open the object through open_hdf5 (materializing a compressed one concurrently) ...
    release, q, holders = _start_holders(root, d, 2)
    try:
        # ... and a third reads it while they keep it open.
        rq = SPAWN.Queue()
        reader = SPAWN.Process(target=hdf5_reader, args=(str(root), d, "x", rq))
        reader.start()
        (_, _, (total, exclusive_ok, locks)), = results(rq, 1)
        reader.join(30)
        assert total == TOTAL
        # No process holds an HDF5 flock on the object: an exclusive flock is free to take.
        assert locks == [] and exclusive_ok
        # Even plain h5py in a conflicting mode is not blocked by our readers.
        with h5py.File(store.path(d), "r", locking=True) as f:
            assert float(f["x"][...].sum()) == TOTAL
    finally:
        release.set()
    out = results(q, 2)
    assert [r[2] for r in out] == [TOTAL, TOTAL]
    for p in holders:
        p.join(30)
        assert p.exitcode == 0
    assert assert_objects_valid(store)


def test_open_hdf5_works_next_to_an_exclusive_lock(tmp_path: Path, h5file: Path) -> None:
    """Someone holds an exclusive flock on the object (as HDF5 does for a writer): open_hdf5 still reads it."""
    root = tmp_path / "store"
    store = casstore.open(root)
    d = store.put_path(h5file, compress=False)
    ready, release, q = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    p = SPAWN.Process(target=flock_holder, args=(str(store.path(d)), "flock-ex", ready, release, q))
    p.start()
    try:
        assert ready.wait(30)
        with store.open_hdf5(d) as f:
            assert float(f["x"][...].sum()) == TOTAL
        with pytest.raises(OSError, match="lock"):  # what open_hdf5 avoids
            h5py.File(store.path(d), "r")
    finally:
        release.set()
    results(q, 1)
    p.join(30)


@pytest.mark.parametrize("holder_mode,other_mode", [("a", "r"), ("r+", "r"), ("r", "r+")])
def test_plain_h5py_locking_hazard(tmp_path: Path, h5file: Path, holder_mode: str, other_mode: str) -> None:
    """The hazard itself, on a plain (non-store) copy: conflicting modes make h5py fail with a lock error."""
    plain = tmp_path / "plain.h5"
    shutil.copyfile(h5file, plain)
    ready, release, q = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    p = SPAWN.Process(target=flock_holder, args=(str(plain), holder_mode, ready, release, q))
    p.start()
    try:
        assert ready.wait(30)
        with pytest.raises(OSError, match="unable to lock file"):
            h5py.File(plain, other_mode)
        with h5py.File(plain, "r", locking=False) as f:  # what open_hdf5 does
            assert float(f["x"][...].sum()) == TOTAL
    finally:
        release.set()
    results(q, 1)
    p.join(30)


# -- verified before h5py sees it (issue 11) ---------------------------------------------


def _data_offset(path: Path) -> int:
    with h5py.File(path, "r") as f:
        off = f["x"].id.get_offset()  # contiguous layout: where the dataset's bytes start
    assert off is not None
    return int(off) + 8 * 101 + 7  # the exponent byte of x[101] == 1.0 (far from any metadata)


def test_flipped_byte_in_an_hdf5_object_is_integrity_error(store: casstore.Store, h5file: Path) -> None:
    d = store.put_path(h5file, compress=False)
    with store.open_hdf5(d) as f:  # verified once (and remembered while the file is unchanged)
        assert float(f["x"][...].sum()) == TOTAL
    flip_byte(store.path(d), _data_offset(h5file))
    with pytest.raises(IntegrityError, match=str(d)[:20]):
        store.open_hdf5(d)
    # verify=False skips the hash: h5py opens the damaged bytes (documented: unverified).
    with store.open_hdf5(d, verify=False) as f:
        assert float(f["x"][...].sum()) != TOTAL


def test_damaged_compressed_hdf5_object_is_never_materialized(store: casstore.Store, h5file: Path) -> None:
    d = store.put_path(h5file, compress=True)
    info = store.stat(d)
    assert info.codec == "zstd"
    zst = store.root / "objects" / d.hex[:2] / (d.hex[2:] + ".zst")
    flip_byte(zst, info.stored_size // 2)
    for verify in (True, False):  # materializing always verifies
        with pytest.raises(IntegrityError):
            store.open_hdf5(d, verify=verify)
    assert not (store.root / "objects" / d.hex[:2] / d.hex[2:]).exists()
    assert os.listdir(store.root / "tmp") == []


def test_damaged_raw_copy_of_a_compressed_object_is_caught(store: casstore.Store, h5file: Path) -> None:
    d = store.put_path(h5file, compress=True)
    with store.open_hdf5(d) as f:  # materializes the raw copy
        assert float(f["x"][...].sum()) == TOTAL
    flip_byte(store.path(d), _data_offset(h5file))  # the raw copy, changed after it was verified
    with pytest.raises(IntegrityError):
        store.open_hdf5(d)


# -- nothing outside the store (docs/security.md, classes 2 and 4) -------------------------
#
# A verified HDF5 file can still point at other files, and h5py follows the pointer on read:
# the hash covers the pointer, not its target, and a FIFO target blocks the read forever.


def _outside_target(tmp_path: Path, kind: str) -> str:
    """A file outside the store the hostile object points at: absolute, relative, a FIFO or not HDF5."""
    h5 = tmp_path / "outside.h5"
    if not h5.exists():
        with h5py.File(h5, "w") as f:
            f["secret"] = np.arange(64, dtype=np.uint8)
        (tmp_path / "outside.txt").write_bytes(b"SECRET" * 20)
        os.mkfifo(tmp_path / "fifo")
    return {"abs": str(h5), "rel": "outside.h5", "fifo": str(tmp_path / "fifo"),
            "not-h5": str(tmp_path / "outside.txt")}[kind]


def _hostile(tmp_path: Path, build: Any) -> Path:
    p = tmp_path / "hostile.h5"
    with h5py.File(p, "w") as f:
        f["fine"] = np.arange(4)
        build(f)
    return p


def _assert_refused(store: casstore.Store, src: Path, what: str) -> None:
    d = store.put_path(src, compress=False)
    for verify in (True, False):  # never following a pointer does not depend on verification
        with pytest.raises(StoreFormatError, match=what):
            store.open_hdf5(d, verify=verify)


@pytest.mark.parametrize("kind", ["abs", "rel", "fifo"])
def test_dataset_with_external_raw_storage_is_refused(store: casstore.Store, tmp_path: Path, kind: str) -> None:
    target = _outside_target(tmp_path, kind)
    src = _hostile(tmp_path, lambda f: f.create_dataset("grp/x", shape=(16,), dtype="u1", external=[(target, 0, 16)]))
    _assert_refused(store, src, r"dataset '/grp/x' with external raw storage")


@pytest.mark.parametrize("kind", ["abs", "rel", "fifo", "not-h5"])
def test_external_link_is_refused(store: casstore.Store, tmp_path: Path, kind: str) -> None:
    target = _outside_target(tmp_path, kind)

    def build(f: h5py.File) -> None:
        f["grp/link"] = h5py.ExternalLink(target, "/secret")

    _assert_refused(store, _hostile(tmp_path, build), r"external link '/grp/link' to ")


@pytest.mark.parametrize("kind", ["abs", "rel", "fifo"])
def test_virtual_dataset_with_another_source_file_is_refused(store: casstore.Store, tmp_path: Path,
                                                            kind: str) -> None:
    target = _outside_target(tmp_path, kind)

    def build(f: h5py.File) -> None:
        lay = h5py.VirtualLayout(shape=(64,), dtype="u1")
        lay[:] = h5py.VirtualSource(target, "secret", shape=(64,))
        f.create_virtual_dataset("v", lay, fillvalue=0)

    _assert_refused(store, _hostile(tmp_path, build), r"virtual dataset '/v' with source file")


def test_links_and_virtual_datasets_within_the_file_are_fine(store: casstore.Store, tmp_path: Path) -> None:
    def build(f: h5py.File) -> None:
        f["grp/a"] = np.arange(6)
        f["soft"] = h5py.SoftLink("/grp/a")
        f["dangling"] = h5py.SoftLink("/nowhere")
        f["grp/hard"] = f["fine"]  # a second hard link to one dataset
        lay = h5py.VirtualLayout(shape=(6,), dtype=np.int64)
        lay[:] = h5py.VirtualSource(".", "grp/a", shape=(6,))  # "." is this very file
        f.create_virtual_dataset("v", lay, fillvalue=-1)

    d = store.put_path(_hostile(tmp_path, build), compress=False)
    for verify in (True, True, False):  # the second verified open uses the memo
        with store.open_hdf5(d, verify=verify) as f:
            np.testing.assert_array_equal(f["soft"][...], np.arange(6))
            np.testing.assert_array_equal(f["v"][...], np.arange(6))
            np.testing.assert_array_equal(f["grp/hard"][...], np.arange(4))


def _unlinked_but_kept(f: h5py.File, obj: Any) -> None:
    """Raise ``obj``'s header reference count (H5Oincr_refcount: h5py has no wrapper), then remove its
    only link: HDF5 keeps the object, reachable through references only (no link names it)."""
    import ctypes
    import ctypes.util
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(h5py.__file__) + ".libs", "libhdf5-*"))
    lib = ctypes.CDLL(libs[0] if libs else ctypes.util.find_library("hdf5") or "libhdf5.so")
    lib.H5Oincr_refcount.argtypes = [ctypes.c_int64]
    assert lib.H5Oincr_refcount(obj.id.id) >= 0
    del f[obj.name]


@pytest.mark.parametrize("where", ["attribute", "dataset", "compound", "group"])
def test_an_object_reached_only_through_a_reference_is_walked(store: casstore.Store, tmp_path: Path,
                                                               where: str) -> None:
    """Found by a bug hunt: a dataset with external raw storage that no link names (its reference count
    raised, then unlinked), reached through a reference, read /etc/hostname through open_hdf5."""
    target = _outside_target(tmp_path, "abs")

    def build(f: h5py.File) -> None:
        if where == "group":  # a hidden group that holds an external link
            hidden = f.create_group("hidden")
            hidden["link"] = h5py.ExternalLink(target, "/secret")
        else:
            hidden = f.create_dataset("hidden", shape=(16,), dtype="u1", external=[(target, 0, 16)])
        ref = hidden.ref
        _unlinked_but_kept(f, hidden)
        del hidden
        if where in ("attribute", "group"):
            f["fine"].attrs["ptr"] = ref
        elif where == "dataset":
            f.create_dataset("refs", data=np.array([h5py.Reference(), ref], dtype=h5py.ref_dtype))
        else:
            dt = np.dtype([("n", "i4"), ("r", h5py.ref_dtype)])
            f.create_dataset("table", data=np.array([(1, ref)], dtype=dt))

    src = _hostile(tmp_path, build)
    with h5py.File(src, "r") as f:  # (the hidden object is there: plain h5py reads outside)
        assert "hidden" not in f
    what = "external link" if where == "group" else "external raw storage"
    _assert_refused(store, src, rf"referenced object.*{what}|{what}.*")


def test_references_within_the_file_are_fine(store: casstore.Store, tmp_path: Path) -> None:
    def build(f: h5py.File) -> None:
        g = f.create_group("grp")
        g["a"] = np.arange(6)
        f["fine"].attrs["to_group"] = g.ref
        f["fine"].attrs["to_self"] = f["fine"].ref
        f["fine"].attrs["plain"] = 1.5
        f.create_dataset("refs", data=np.array([g["a"].ref, h5py.Reference()], dtype=h5py.ref_dtype))
        f.create_dataset("regions", data=np.array([g["a"].regionref[1:3]], dtype=h5py.regionref_dtype))

    d = store.put_path(_hostile(tmp_path, build), compress=False)
    for verify in (True, True, False):
        with store.open_hdf5(d, verify=verify) as f:
            np.testing.assert_array_equal(f[f["refs"][0]][...], np.arange(6))
            assert f[f["fine"].attrs["to_group"]].name == "/grp"


def test_a_remembered_walk_never_covers_other_bytes(store: casstore.Store, h5file: Path, tmp_path: Path) -> None:
    """The walk's memo is for verified bytes of one file: bytes rewritten under the same digest are walked again."""
    d = store.put_path(h5file, compress=False)
    with store.open_hdf5(d) as f:  # walked and remembered
        assert float(f["x"][...].sum()) == TOTAL
    target = _outside_target(tmp_path, "fifo")
    hostile = _hostile(tmp_path, lambda f: f.create_dataset("x", shape=(16,), dtype="u1", external=[(target, 0, 16)]))
    obj = store.path(d)
    os.chmod(obj, 0o644)
    obj.write_bytes(hostile.read_bytes())  # a member of a shared store rewrites the object in place
    os.chmod(obj, 0o444)
    with pytest.raises(IntegrityError):
        store.open_hdf5(d)
    with pytest.raises(StoreFormatError, match="external raw storage"):
        store.open_hdf5(d, verify=False)  # unverified bytes are still never allowed to reach outside


# -- verify must be a bool (None: the default) -----------------------------------------------


def test_open_hdf5_verify_none_is_the_default_and_other_types_are_refused(store: casstore.Store,
                                                                          h5file: Path) -> None:
    d = store.put_path(h5file, compress=False)
    with store.open_hdf5(d, verify=None) as f:
        assert float(f["x"][...].sum()) == TOTAL
    flip_byte(store.path(d), _data_offset(h5file))
    with pytest.raises(IntegrityError):
        store.open_hdf5(d, verify=None)  # None means the default (verify), as for get_array
    for bad in (0, 1, "", "yes", 0.0):  # a bare `if verify:` let 0 and "" skip the hash silently
        with pytest.raises(InvalidTypeError, match="verify must be a bool"):
            store.open_hdf5(d, verify=bad)
