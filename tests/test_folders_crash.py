"""``store.add`` of a folder: batched durable publishing, and what a SIGKILL midway leaves.

New objects are staged on the pool and published in batches, one ``syncfs`` before and one after
each batch (not two fsyncs per object); the version is committed only after the last batch.  A
writer killed at any moment leaves only whole objects (each hashes to its name), never a version
naming an object the store lacks, and the next add completes.
"""

from __future__ import annotations

import errno
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from conftest import PYTHON, assert_all_objects_valid

import casstore
from casstore import _faults, folders
from casstore.manifests import model
from casstore.objects import local as objlocal

N_FILES = 120


def _folder(root: Path, n: int = N_FILES, size: int = 3000) -> Dict[str, bytes]:
    files = {f"d{i % 4}/f{i:03d}.bin": os.urandom(size + i) for i in range(n)}
    for k, data in files.items():
        (root / k).parent.mkdir(parents=True, exist_ok=True)
        (root / k).write_bytes(data)
    return files


def test_a_durable_add_syncs_once_per_batch_not_per_object(store: casstore.Store, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert store.durable
    files = _folder(tmp_path / "src")
    syncs: List[str] = []
    fsyncs: List[int] = []
    real_syncfs, real_fsync = objlocal.syncfs, os.fsync
    monkeypatch.setattr(objlocal, "syncfs", lambda p: (syncs.append(str(p)), real_syncfs(p))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(folders, "BATCH_OBJECTS", 32)
    r = store.add("exp", tmp_path / "src")
    assert r.created and len(r.added) == N_FILES
    assert len(syncs) == 2 * math.ceil(N_FILES / 32)  # before and after each batch
    # The manifest commit fsyncs its own few files (its object, the head, their directories); no data
    # object is fsynced on its own (that was two fsyncs per object: 240 here).
    assert len(fsyncs) < N_FILES // 4, len(fsyncs)
    stored = set(assert_all_objects_valid(store.root))
    assert {str(e.digest) for e in store.manifest("exp").entries.values()} <= stored
    assert {k: store.get(e.digest) for k, e in store.manifest("exp").entries.items()} == files
    assert os.listdir(store.root / "tmp") == []


def test_batches_are_bounded_by_bytes_too(store: casstore.Store, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _folder(tmp_path / "src", n=20, size=10_000)
    batches: List[int] = []
    real = objlocal.LocalObjects.publish_batch

    def counting(self: objlocal.LocalObjects, items: List[objlocal.StagedObject]) -> None:
        batches.append(len(items))
        real(self, items)

    monkeypatch.setattr(objlocal.LocalObjects, "publish_batch", counting)
    monkeypatch.setattr(folders, "BATCH_BYTES", 35_000)
    store.add("exp", tmp_path / "src")
    assert sum(batches) == 20 and max(batches) <= 4, batches


def test_duplicates_in_a_folder_are_one_object(store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"same{i}.txt").write_bytes(b"same content")
    store.put(b"already stored")
    (src / "old.txt").write_bytes(b"already stored")
    r = store.add("exp", src)
    assert len(r.added) == 41
    assert len({e.digest for e in r.manifest.entries.values()}) == 2
    assert os.listdir(store.root / "tmp") == []


_ADDER = textwrap.dedent("""
    import os, sys, signal, casstore, casstore._faults as faults, casstore.folders as folders
    folders.BATCH_OBJECTS = 16
    point, nth = sys.argv[3], int(sys.argv[4])
    seen = []
    def hook(p):
        if p == point:
            seen.append(p)
            if len(seen) == nth:
                os.kill(os.getpid(), signal.SIGKILL)
    if point != "none":
        faults.hook = hook
    s = casstore.open(sys.argv[1])
    print("ready", flush=True)
    r = s.add("exp", sys.argv[2])
    print("done", r.digest, flush=True)
""")


def _check_after_crash(root: Path, src: Path, files: Dict[str, bytes]) -> None:
    """Every visible object is whole; the name has no version or a complete one; the next add works."""
    assert_all_objects_valid(root)
    s = casstore.open(root)
    try:
        m = s.manifest("exp")
    except casstore.ManifestNotFoundError:
        m = None
    if m is not None:  # killed after the commit: the version is whole
        for e in m.entries.values():
            assert s.objects.has(e.digest), f"version {m.digest} names a missing object {e.digest}"
    r = s.add("exp", src)
    assert {k: s.get(e.digest) for k, e in r.manifest.entries.items()} == files
    assert s.verify().ok


@pytest.mark.parametrize("point,nth", [("folders.before_batch", 1), ("folders.before_batch", 3),
                                       ("folders.before_commit", 1), ("manifest.before_object", 1)])
def test_sigkill_at_a_batch_or_before_the_commit(tmp_path: Path, point: str, nth: int) -> None:
    src = tmp_path / "src"
    files = _folder(src)
    root = tmp_path / "store"
    casstore.open(root)
    r = subprocess.run([PYTHON, "-c", _ADDER, str(root), str(src), point, str(nth)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)
    s = casstore.open(root)
    with pytest.raises(casstore.ManifestNotFoundError):
        s.manifest("exp")  # killed before the commit: no version at all
    published = assert_all_objects_valid(root)
    if point in ("folders.before_commit", "manifest.before_object"):
        # Every full batch was published before the commit was tried; the last one waits for the
        # commit, which publishes it with the version (and was killed before it could).
        assert len(published) == 16 * (N_FILES // 16)
    else:
        assert len(published) == 16 * (nth - 1)  # whole batches only
    _check_after_crash(root, src, files)


def test_a_tree_commit_publishes_the_last_files_with_its_nodes(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The last batch of files and the version's tree nodes share one pair of syncs: an add that
    # fits one batch syncs the filesystem twice, not four times.
    monkeypatch.setattr(model, "TREE_THRESHOLD", 16)
    src = tmp_path / "src"
    files = _folder(src, n=60)
    s = casstore.open(tmp_path / "store")
    assert s.durable
    s.add("exp", src)
    for i, k in enumerate(sorted(files)[:20]):  # a change touching several leaves
        (src / k).write_bytes(b"new %d" % i)
        files[k] = b"new %d" % i
    syncs: List[str] = []
    real_syncfs = objlocal.syncfs
    monkeypatch.setattr(objlocal, "syncfs", lambda p: (syncs.append(str(p)), real_syncfs(p))[1])
    r = s.add("exp", src)
    assert r.manifest.entries.is_tree and len(r.modified) == 20
    assert len(syncs) == 2  # one before the renames of files, nodes and version together, one after
    assert {k: s.get(e.digest) for k, e in s.manifest("exp").entries.items()} == files
    assert os.listdir(s.root / "tmp") == []
    assert s.verify().ok


@pytest.mark.parametrize("durable", [True, False])
def test_the_held_files_sync_gets_a_head_start_that_replaces_no_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     durable: bool) -> None:
    # folders._Batcher.hold: a durable store's syncfs starts on a thread of its own while the commit
    # builds the version.  Only a head start: it may fail unnoticed, the commit still syncs before and
    # after its renames on its own, and the thread is gone when add returns.  A scratch store syncs nothing.
    monkeypatch.setattr(model, "TREE_THRESHOLD", 16)
    src = tmp_path / "src"
    files = _folder(src, n=60)
    s = casstore.open(tmp_path / "store", durable=durable)
    s.add("exp", src)
    for i, k in enumerate(sorted(files)[:20]):
        (src / k).write_bytes(b"new %d" % i)
        files[k] = b"new %d" % i
    events: List[Tuple[str, str]] = []

    def head_start(p: object) -> None:
        events.append(("head start", threading.current_thread().name))
        time.sleep(0.3)  # (a slow disk: the add still waits for the thread to end)
        raise OSError(errno.EIO, "injected: ignored")

    real_syncfs = objlocal.syncfs
    monkeypatch.setattr(folders, "syncfs", head_start)
    monkeypatch.setattr(objlocal, "syncfs",
                        lambda p: (events.append(("batch", threading.current_thread().name)), real_syncfs(p))[1])
    r = s.add("exp", src)
    assert len(r.modified) == 20
    want = [("head start", "casstore-sync"), ("batch", "MainThread"), ("batch", "MainThread")] if durable else []
    assert sorted(events, reverse=True) == want
    assert not any(t.name == "casstore-sync" for t in threading.enumerate())
    assert {k: s.get(e.digest) for k, e in s.manifest("exp").entries.items()} == files
    assert os.listdir(s.root / "tmp") == []


@pytest.mark.parametrize("durable", [True, False])
def test_only_files_before_the_unhinted_tail_start_their_writeback_as_staged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool) -> None:
    # folders.UNHINTED_TAIL: a durable add asks for each staged file's writeback at once (a system call
    # per file), except for the last bytes, which the held batch's head-start syncfs flushes.  Four
    # files of 600 KiB are read as two runs of two: with a 1 MiB tail only the first run is hinted;
    # a small add none; a scratch store never.  The objects are the same either way.
    from casstore._fs import Staging

    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i}": random.Random(i).randbytes(600 << 10) for i in range(4)}
    for k, v in files.items():
        (src / k).write_bytes(v)
    hinted: List[int] = []
    real = Staging.start_writeback

    def counted(st: Staging, off: int, n: int) -> None:
        hinted.append(n)
        real(st, off, n)

    monkeypatch.setattr(Staging, "start_writeback", counted)
    monkeypatch.setattr(folders, "UNHINTED_TAIL", 1 << 20)
    s = casstore.open(tmp_path / "store", durable=durable, compress=False)
    s.add("exp", src)
    assert hinted == ([600 << 10] * 2 if durable else [])
    assert {k: s.get(e.digest) for k, e in s.manifest("exp").entries.items()} == files
    hinted.clear()
    monkeypatch.setattr(folders, "UNHINTED_TAIL", 16 << 20)
    for k in files:
        files[k] = random.Random(k).randbytes(600 << 10)
        (src / k).write_bytes(files[k])
    s.add("exp", src)
    assert hinted == []
    assert {k: s.get(e.digest) for k, e in s.manifest("exp").entries.items()} == files


def test_a_commit_that_fails_removes_the_files_it_was_to_publish(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    files = _folder(src, n=40)
    s = casstore.open(tmp_path / "store")

    def hook(point: str) -> None:
        if point == "manifest.before_object":
            raise OSError(errno.EIO, "injected commit failure")

    monkeypatch.setattr(_faults, "hook", hook)
    with pytest.raises(OSError, match="injected"):
        s.add("exp", src)
    assert os.listdir(s.root / "tmp") == []  # the held batch's staged copies are gone
    assert assert_all_objects_valid(s.root) == []  # (one batch, held: nothing was published)
    monkeypatch.setattr(_faults, "hook", None)
    r = s.add("exp", src)
    assert {k: s.get(e.digest) for k, e in r.manifest.entries.items()} == files


def test_publish_with_refuses_a_size_the_staged_file_contradicts(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "store")
    src = tmp_path / "f"
    src.write_bytes(b"x" * 100)
    fd = os.open(src, os.O_RDONLY)
    try:
        staged = s.objects.stage_fd(fd, 100)
    finally:
        os.close(fd)
    with pytest.raises(casstore.InvalidInputError, match="holds 100 bytes, not 99"):
        with s.edit("x") as m:
            m.publish_with([staged], {staged.digest: 99})
    with pytest.raises(casstore.InvalidInputError, match="no valid size"):
        with s.edit("x") as m:
            m.publish_with([staged], {})
    with s.edit("x") as m:
        m.publish_with([staged], {staged.digest: 100})
        m["f"] = staged.digest
    assert s.manifest("x")["f"].size == 100 and s.get(staged.digest) == b"x" * 100
    assert os.listdir(s.root / "tmp") == []


def _raise_at_staged(monkeypatch: pytest.MonkeyPatch, nth: int, exc: BaseException) -> List[str]:
    """Make the ``nth`` file the add stages raise ``exc`` (after it was staged); returns the calls seen."""
    calls: List[str] = []

    def hook(point: str) -> None:
        if point == "folders.staged":
            calls.append(point)
            if len(calls) == nth:
                raise exc

    monkeypatch.setattr(_faults, "hook", hook)
    return calls


def test_a_failure_in_the_middle_of_a_run_of_files_leaves_no_staged_copy(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The pool reads files in runs of up to 8 (one task each): a file failing after others of its run were
    # staged must take their staged copies with it, as must the runs still in flight.
    src = tmp_path / "src"
    files = _folder(src)
    s = casstore.open(tmp_path / "store")
    # (the fifth file: the middle of the first run)
    calls = _raise_at_staged(monkeypatch, 5, OSError(errno.EIO, "injected read error"))
    with pytest.raises(OSError, match="injected"):
        s.add("exp", src)
    assert len(calls) >= 5
    assert os.listdir(s.root / "tmp") == []  # every staged copy removed
    assert assert_all_objects_valid(s.root) == []  # nothing published: no batch was full
    monkeypatch.setattr(_faults, "hook", None)
    with pytest.raises(casstore.ManifestNotFoundError):
        s.manifest("exp")
    r = s.add("exp", src)
    assert {k: s.get(e.digest) for k, e in r.manifest.entries.items()} == files


def test_a_file_gone_in_the_middle_of_a_run_is_skipped_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "src"
    files = _folder(src)
    s = casstore.open(tmp_path / "store")
    # (as when the file is removed between the walk and its read)
    _raise_at_staged(monkeypatch, 3, FileNotFoundError(errno.ENOENT, "injected: gone"))
    r = s.add("exp", src)
    assert len(r.manifest) == len(files) - 1  # the others of its run are in the version
    assert sum("removed or replaced while the folder was read" in m for m in caplog.messages) == 1
    assert os.listdir(s.root / "tmp") == []
    assert {k: s.get(e.digest) for k, e in r.manifest.entries.items()}.items() <= files.items()


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = _folder(src, n=400, size=20_000)
    rnd = random.Random(12)
    # One undisturbed run: how long an add takes here.
    cal = tmp_path / "calibrate"
    casstore.open(cal)
    t0 = time.monotonic()
    subprocess.run([PYTHON, "-c", _ADDER, str(cal), str(src), "none", "0"], check=True, capture_output=True,
                   timeout=300)
    duration = time.monotonic() - t0
    for trial in range(6):
        root = tmp_path / f"s{trial}"
        casstore.open(root)
        p = subprocess.Popen([PYTHON, "-c", _ADDER, str(root), str(src), "none", "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rnd.uniform(0.0, max(0.05, duration - 0.3)))
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        _check_after_crash(root, src, files)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
