"""Filesystems that do not keep POSIX's promises (issue 17), on the FUSE test filesystem.

First, proof that tests/fusefs/casfs.c lies as designed (and that ``local``, the
control, does not); then the issue's contracts run on each mode by calling the
existing multi-process tests with a directory on the lying mount:

* 8 processes x 200 one-key edits to one name with lock-free readers
  (tests/test_manifest_concurrency.py): 1,600 keys, 1,600 versions, 0 reader errors;
* fetch and derive run once across 8 processes (tests/test_fetch.py, tests/test_derive.py);
* index-cache first-writer-wins across processes (tests/test_cache_procs.py);
* an editor SIGKILLed at random moments and at each commit point (tests/test_manifest_crash.py).

What fails today is marked ``xfail(strict=True)`` with how it fails, so the mark
turns into a failure the moment it is fixed and must then be removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import test_cache_procs
import test_derive
import test_fetch
import test_manifest_concurrency
import test_manifest_crash
import test_pipelines_jobs
from _fetch_helpers import SPAWN, clean_settings_env, serve
from _manifest_helpers import get_report, stop_process

import casstore

FuseDir = Callable[[str], Path]
DELAY = "delay_rename=20"


# -- the lies themselves -------------------------------------------------------------------------


def _try(fn: Callable[[], object]) -> str:
    """"ok", or the errno name the call failed with."""
    try:
        fn()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "ok"


def _ofd_wrlock(fd: int) -> None:
    # struct flock for F_OFD_SETLK (Linux 37): type, whence, start, len, pid (must be 0).
    fcntl.fcntl(fd, 37, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))


def _two_descriptions(d: Path) -> Tuple[int, int]:
    p = d / "lock"
    p.write_bytes(b"")
    return os.open(p, os.O_RDWR), os.open(p, os.O_RDWR)


def _lock_from_another_process(path: Path) -> str:
    """Try an exclusive POSIX lock on ``path`` from a fresh process: "ok" or the errno name."""
    import subprocess
    import sys

    code = ("import errno, fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('ok')\n"
            "except OSError as e:\n    print(errno.errorcode[e.errno])\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_grant_gives_every_open_file_description_the_exclusive_lock(fuse_dir: FuseDir) -> None:
    d = fuse_dir("grant")
    a, b = _two_descriptions(d)
    try:
        assert _try(lambda: fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)) == "ok"
        assert _try(lambda: fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)) == "ok"  # the lie
        assert _try(lambda: _ofd_wrlock(a)) == "ok"
        assert _try(lambda: _ofd_wrlock(b)) == "ok"
        fcntl.lockf(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _lock_from_another_process(d / "lock") == "ok"  # while this process holds it
    finally:
        os.close(a)
        os.close(b)


def test_local_control_excludes(fuse_dir: FuseDir) -> None:
    d = fuse_dir("local")
    a, b = _two_descriptions(d)
    try:
        assert _try(lambda: fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)) == "ok"
        assert _try(lambda: fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)) == "EAGAIN"
        fcntl.lockf(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _lock_from_another_process(d / "lock") in ("EAGAIN", "EACCES")
    finally:
        os.close(a)
        os.close(b)


def test_enosys_refuses_flock_and_fcntl_locks(fuse_dir: FuseDir) -> None:
    d = fuse_dir("enosys")
    a, b = _two_descriptions(d)
    try:
        # ENOSYS reaches the caller: the kernel does not fall back to local locks for a daemon that
        # offered lock handlers at INIT (fs/fuse only does so when it offered none).
        assert _try(lambda: fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)) == "ENOSYS"
        assert _try(lambda: fcntl.flock(b, fcntl.LOCK_SH)) == "ENOSYS"
        assert _try(lambda: fcntl.lockf(a, fcntl.LOCK_EX | fcntl.LOCK_NB)) == "ENOSYS"
        assert _try(lambda: _ofd_wrlock(a)) == "ENOSYS"
        assert _lock_from_another_process(d / "lock") == "ENOSYS"
        # Everything else works.
        os.write(a, b"data")
        assert os.pread(b, 4, 0) == b"data"
    finally:
        os.close(a)
        os.close(b)


def _rename_reader(path: str, stop: Any, q: Any, ready: Any) -> None:
    """Open and read ``path`` until ``stop``; report (reads, times it was missing)."""
    reads = missing = 0
    ready.set()
    while not stop.is_set():
        try:
            with open(path, "rb") as f:
                f.read()
            reads += 1
        except FileNotFoundError:
            missing += 1
    q.put((reads, missing))


def _replace_while_reading(d: Path, n: int) -> Tuple[int, int, float]:
    target = d / "ref"
    target.write_bytes(b"v0")
    stop, q, ready = SPAWN.Event(), SPAWN.Queue(), SPAWN.Event()
    reader = SPAWN.Process(target=_rename_reader, args=(str(target), stop, q, ready))
    reader.start()
    try:
        # A spawned child imports this module (and casstore) first: on a loaded CI machine that
        # took longer than the whole replace loop, and the reader never read (CI: reads == 0).
        assert ready.wait(120), "the reader process did not start"
        time.sleep(0.1)  # the reader is reading
        t0 = time.monotonic()
        for i in range(1, n + 1):
            new = d / f"ref.{i}.tmp"
            new.write_bytes(b"v%d" % i)
            os.rename(new, target)
            time.sleep(0.01)
        elapsed = (time.monotonic() - t0) / n
        stop.set()
        reads, missing = get_report(q, 60, [reader])
        reader.join(30)
    finally:
        stop.set()
        stop_process(reader)
    return reads, missing, elapsed


def test_delay_rename_leaves_the_target_missing_for_a_while(fuse_dir: FuseDir) -> None:
    d = fuse_dir(DELAY)
    target = d / "ref"
    target.write_bytes(b"old")
    (d / "new").write_bytes(b"new")
    t0 = time.monotonic()
    os.rename(d / "new", target)
    assert time.monotonic() - t0 < 0.015  # the call returns at once ...
    assert not target.exists() and sorted(os.listdir(d)) == []  # ... with neither file in place
    time.sleep(0.1)
    assert target.read_bytes() == b"new"  # ... and the new one arrives 20 ms later
    # A directory fsync waits for the pending renames: a durable writer sees its own rename.
    (d / "newer").write_bytes(b"newer")
    os.rename(d / "newer", target)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    assert target.read_bytes() == b"newer"
    # A rename to a new name is atomic (objects are put in place that way).
    (d / "fresh.tmp").write_bytes(b"x")
    os.rename(d / "fresh.tmp", d / "fresh")
    assert (d / "fresh").read_bytes() == b"x"
    # A lock-free reader of a file replaced over and over finds it missing now and then ...
    reads, missing, _ = _replace_while_reading(d, 40)
    assert reads > 0 and missing > 0, (reads, missing)


def test_local_control_renames_atomically(fuse_dir: FuseDir) -> None:
    reads, missing, _ = _replace_while_reading(fuse_dir("local"), 40)
    assert reads > 0 and missing == 0, (reads, missing)


# -- the contracts on every mode --------------------------------------------------------

MODES = ["local", "grant", "enosys", DELAY]


def _modes(fails: Dict[str, str]) -> List[Any]:
    """MODES, those in ``fails`` marked xfail(strict) with how they fail today."""
    return [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=f"issue 17: {fails[m]}")) if m in fails
            else m for m in MODES]


@pytest.fixture
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", _modes({}))
def test_no_lost_update_8_writers_x_200_edits_with_lock_free_readers(fuse_dir: FuseDir, mode: str) -> None:
    test_manifest_concurrency.test_no_lost_update_8_writers_x_200_edits_with_lock_free_readers(fuse_dir(mode))


@pytest.mark.parametrize("mode", _modes({}))
def test_sigkill_at_random_moments_of_a_looping_editor(fuse_dir: FuseDir, mode: str) -> None:
    test_manifest_crash.test_sigkill_at_random_moments_of_a_looping_editor(fuse_dir(mode))


@pytest.mark.parametrize("point", ["manifest.before_object", "manifest.after_object", "manifest.after_ref"])
@pytest.mark.parametrize("mode", _modes({}))
def test_sigkill_at_each_commit_point(fuse_dir: FuseDir, mode: str, point: str) -> None:
    test_manifest_crash.test_sigkill_at_each_commit_point(fuse_dir(mode), point)


@pytest.mark.parametrize("mode", _modes({}))
def test_eight_processes_download_once(fuse_dir: FuseDir, mode: str, _clean_env: None) -> None:
    with serve() as server:
        test_fetch.test_eight_processes_download_once(fuse_dir(mode), server)


@pytest.mark.parametrize("mode", _modes({}))
def test_eight_processes_derive_once(fuse_dir: FuseDir, mode: str, tmp_path: Path, _clean_env: None) -> None:
    counter = tmp_path / "runs.txt"  # counted on an honest disk
    counter.touch()
    test_derive.test_eight_processes_derive_once(fuse_dir(mode), counter)


@pytest.mark.parametrize("mode", _modes({}))
def test_eight_ranks_regenerate_once(fuse_dir: FuseDir, mode: str, _clean_env: None) -> None:
    test_pipelines_jobs.test_eight_ranks_regenerate_once(fuse_dir(mode))


@pytest.mark.parametrize("method", test_cache_procs.METHODS)
@pytest.mark.parametrize("mode", _modes({}))
def test_index_cache_first_writer_wins(fuse_dir: FuseDir, mode: str, method: str) -> None:
    store = casstore.open(fuse_dir(mode) / "store")
    test_cache_procs.test_four_workers_put_disjoint_and_overlapping(store, method)
