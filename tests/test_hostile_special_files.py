"""Hostile input, class 2: never hang, never follow.

Any member of a shared store can plant a FIFO, a directory, a device or a
symlink where an object file should be.  Opening a FIFO for reading blocks
forever; following a link reads (or maps, or hands to h5py) a file outside the
store.  Every public read path must answer with a typed error at once:
``get``, ``open``, ``stat``, ``path``, ``raw_path``, ``checkout``,
``get_array`` (copy and memory map), ``open_hdf5``, ``IndexCache.open`` and the
CLI (``casstore get``/``stat``: one line, no traceback).

Each attack builds the hostile state by hand in the test process; the calls
run in a child interpreter with a timeout, so a hang fails the test (naming
the calls that did finish) instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import h5py
import numpy as np
import pytest

import casstore
from casstore.cache import IndexCache

CHILD_TIMEOUT = 60.0
AT_ONCE = 5.0  # seconds; a blocked open never returns, a refused one takes microseconds


def _mknod_works(tmp: Path) -> bool:
    try:
        os.mknod(tmp / "probe", 0o444 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    except (PermissionError, OSError):
        return False
    os.unlink(tmp / "probe")
    return True


def _plant(path: Path, kind: str, outside: Path) -> None:
    """Replace the object file ``path`` by a hostile entry of ``kind``."""
    data = path.read_bytes()
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path, 0o444)
    elif kind == "directory":
        os.mkdir(path)
        (path / "inside").write_bytes(data)
    elif kind == "symlink-dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "device":
        os.mknod(path, 0o444 | stat.S_IFCHR, os.makedev(1, 5))
    elif kind == "symlink-to-copy":  # the right bytes, but outside the store: still never followed
        outside.mkdir(exist_ok=True)
        target = outside / path.name
        target.write_bytes(data)
        os.symlink(target, path)
    else:  # pragma: no cover
        raise AssertionError(kind)


def _object_file(store: casstore.Store, d: casstore.Digest) -> Path:
    loc = store.objects.locate(d)
    return Path(loc.path)


CHILD = textwrap.dedent("""
    import json, subprocess, sys, time
    import numpy as np
    import casstore
    from casstore.cache import IndexCache

    root, arr, hdf, cache_obj, zarr, outdir = sys.argv[1:7]
    store = casstore.open(root, create=False)

    def read_all(d):
        with store.open(d) as f:
            return f.read()

    calls = {
        "get": lambda: store.get(arr),
        "get-no-verify": lambda: store.get(arr, verify=False),
        "open": lambda: read_all(arr),
        "stat": lambda: store.stat(arr),
        "path": lambda: store.path(arr),
        "path-verify": lambda: store.path(arr, verify=True),
        "raw_path": lambda: store.raw_path(arr),
        "checkout": lambda: store.checkout("m", outdir),
        "get_array": lambda: store.get_array(arr),
        "get_array-no-verify": lambda: store.get_array(arr, verify=False),
        "get_array-mmap": lambda: store.get_array(arr, mmap=True),
        "open_hdf5": lambda: store.open_hdf5(hdf),
        "open_hdf5-no-verify": lambda: store.open_hdf5(hdf, verify=False),
        "IndexCache.open-name": lambda: IndexCache.open(store, "cache"),
        "IndexCache.open-digest": lambda: IndexCache.open(store, cache_obj, verify="record"),
        # the same object stored zstd-compressed (its .zst file is the hostile one)
        "zstd-get": lambda: store.get(zarr),
        "zstd-stat": lambda: store.stat(zarr),
        "zstd-open": lambda: read_all(zarr),
        "zstd-raw_path": lambda: store.raw_path(zarr),
        "zstd-get_array": lambda: store.get_array(zarr),
        "zstd-get_array-mmap": lambda: store.get_array(zarr, mmap=True),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            res = {"call": name, "error": None}
        except BaseException as e:
            res = {"call": name, "error": type(e).__name__,
                   "casstore": isinstance(e, casstore.CasstoreError), "msg": str(e)[:300]}
        res["seconds"] = time.monotonic() - t0
        print(json.dumps(res), flush=True)
""")

KINDS = ["fifo", "directory", "symlink-dev-zero", "device", "symlink-to-copy"]


@pytest.mark.parametrize("kind", KINDS)
def test_planted_special_file_is_refused_at_once_everywhere(tmp_path: Path, kind: str) -> None:
    if kind == "device" and not _mknod_works(tmp_path):
        pytest.skip("mknod is not permitted here (the symlink-to-/dev/zero case covers devices)")
    store = casstore.open(tmp_path / "store", durable=False)
    a = np.arange(5000, dtype=np.int64)
    arr = store.put_array(a, compress=False)
    zarr = store.put_array(np.zeros(50_000), compress=True)
    assert store.stat(zarr).codec == "zstd"
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["x"] = a
    hdf = store.put_path(tmp_path / "x.h5", compress=False)
    with store.edit("m") as m:
        m["a.npy"] = arr
    c = IndexCache(store, 4)
    c.put(1, b"one")
    cache_obj = c.preserve("cache")
    c.close()
    for d in (arr, zarr, hdf, cache_obj):
        _plant(_object_file(store, d), kind, tmp_path / "outside")

    try:
        r = subprocess.run([sys.executable, "-c", CHILD, str(store.root), str(arr), str(hdf), str(cache_obj),
                            str(zarr), str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        done = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"a call hung on a planted {kind}; calls that returned:\n{done}")
    assert r.returncode == 0, r.stderr
    results: List[Dict[str, object]] = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(results) == 21, r.stdout
    for res in results:
        assert res["error"] == "IntegrityError", f"{kind}: {res}"
        assert float(res["seconds"]) < AT_ONCE, f"{kind}: {res}"  # type: ignore[arg-type]
    assert not (tmp_path / "out" / "a.npy").exists()  # checkout wrote nothing


PREFETCH_CHILD = textwrap.dedent("""
    import sys, time
    import casstore
    store = casstore.open(sys.argv[1], create=False)
    d = casstore.Digest.parse(sys.argv[2])
    t0 = time.monotonic()
    store.objects.prefetch([d, d])  # a hint: returns at once and raises nothing
    print(time.monotonic() - t0, flush=True)
    try:
        store.get(d)
    except casstore.IntegrityError:
        print("refused", flush=True)
""")


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink-dev-zero", "symlink-to-copy"])
def test_prefetch_of_a_planted_special_file_returns_at_once(tmp_path: Path, kind: str) -> None:
    # The manifest tree names the nodes it is about to read to the store (issue 12); the hint opens
    # each object file like every read does: no following, no blocking on a FIFO.
    store = casstore.open(tmp_path / "store", durable=False)
    d = store.put(os.urandom(3000), compress=False)
    _plant(_object_file(store, d), kind, tmp_path / "outside")
    try:
        r = subprocess.run([sys.executable, "-c", PREFETCH_CHILD, str(store.root), str(d)],
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"prefetch hung on a planted {kind}")
    assert r.returncode == 0, r.stderr
    seconds, verdict = r.stdout.split()
    assert float(seconds) < AT_ONCE and verdict == "refused"


@pytest.mark.parametrize("kind", ["fifo", "symlink-dev-zero", "directory"])
@pytest.mark.parametrize("command", ["get", "stat"])
def test_cli_refuses_a_planted_special_file_in_one_line(tmp_path: Path, kind: str, command: str) -> None:
    store = casstore.open(tmp_path / "store", durable=False)
    d = store.put(b"an ordinary object" * 100, compress=False)
    _plant(_object_file(store, d), kind, tmp_path / "outside")
    try:
        r = subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store.root), command, str(d)],
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`casstore {command}` hung on a planted {kind}")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("casstore: error:"), r.stderr
    # The CLI resolves its argument by scanning objects/ (lstat only), which skips entries that
    # are not regular files: "not found" there, IntegrityError from the open otherwise.
    assert lines[0].endswith(("[IntegrityError]", "[ObjectNotFoundError]")), r.stderr
    assert r.stdout == ""
