"""Manifests and crashes: SIGKILL in the middle of edit(), dead and live lock holders (issue 3).

Children are real processes killed with SIGKILL (or stopped with SIGSTOP), at
the commit's fault points and at random moments.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from _manifest_helpers import (
    SPAWN,
    faulty_edit_worker,
    history_chain,
    lock_file,
    looping_editor_worker,
    proc_state,
    stop_process,
    wait_for,
)

import casstore
from casstore import Digest, Entry, LockTimeout
from casstore.manifests import encode_manifest


def _expected_next(store: casstore.Store, name: str, key: str, d: Digest) -> Digest:
    """Digest of the version an edit adding ``key`` to ``name`` would commit (computed independently)."""
    cur = store.manifest(name)
    entries = {k: cur[k] for k in cur}
    entries[key] = Entry(d, store.stat(d).size)
    return Digest.of(encode_manifest(entries, dict(cur.meta), cur.digest))


def _timed_edit(store: casstore.Store, name: str, key: str, d: Digest, timeout: float) -> float:
    t = time.monotonic()
    with store.edit(name, timeout=timeout) as m:
        m[key] = d
    return time.monotonic() - t


@pytest.mark.parametrize("point", ["manifest.before_object", "manifest.after_object", "manifest.after_ref"])
def test_sigkill_at_each_commit_point(tmp_path: Path, point: str) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    old_obj, new_obj = store.put(b"old"), store.put(b"new")
    with store.edit("exp") as m:
        m["old"] = old_obj
        m.meta["run"] = 1
    old = store.heads()["exp"]
    new = _expected_next(store, "exp", "new", new_obj)
    assert new not in store

    child = SPAWN.Process(target=faulty_edit_worker,
                          args=(str(root), "exp", "new", str(new_obj), point, signal.SIGKILL))
    child.start()
    child.join(60)
    stop_process(child)
    assert child.exitcode == -signal.SIGKILL  # it died at the fault point (3 if the hook never ran)

    # The name reads as the previous or the new version, never broken.
    man = store.manifest("exp")
    if point == "manifest.after_ref":
        assert man.digest == new and sorted(man) == ["new", "old"] and man.parent == old
    else:
        assert man.digest == old and sorted(man) == ["old"]
    # The version object is written before the ref moves.
    assert (new in store) == (point != "manifest.before_object")
    if new in store:
        assert store.get(new) and store.manifest(new).parent == old
    assert man.meta["run"] == 1
    history_chain(store, "exp")

    # The kernel released the dead child's lock: the next edit does not wait for the timeout.
    waited = _timed_edit(store, "exp", "after", old_obj, timeout=2)
    assert waited < 1.0, f"edit after a crash waited {waited:.2f}s"
    final = store.manifest("exp")
    assert final.parent == man.digest
    assert sorted(final) == sorted(set(man) | {"after"})
    # Staging files of the dead writer are swept when the store is opened.
    casstore.open(root)
    assert not any(n.startswith(f"{child.pid}.") for n in os.listdir(root / "tmp"))


def test_sigkill_at_random_moments_of_a_looping_editor(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    d = store.put(b"data")
    with store.edit("exp") as m:
        m["k0"] = d
        m.meta["n"] = 1
    rng = random.Random(20240611)
    progressed = 0
    for _trial in range(8):
        start = len(store.manifest("exp"))
        child = SPAWN.Process(target=looping_editor_worker, args=(str(root), "exp", str(d)))
        child.start()
        try:
            wait_for(lambda: len(store.manifest("exp")) > start, 60, "the child's first commit")  # noqa: B023
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        finally:
            stop_process(child)
        assert child.exitcode == -signal.SIGKILL

        man = store.manifest("exp")
        n = len(man)
        progressed += n - start
        # Every committed version is complete: keys k0..k<n-1>, metadata in step with them.
        assert set(man) == {f"k{i}" for i in range(n)}
        assert man.meta["n"] == n
        assert all(man[k] == Entry(d, 4) for k in man)
        h, _ = history_chain(store, "exp")
        assert [len(v) for v in h] == list(range(n, 0, -1))
        # The dead child's lock is gone at once.
        t = time.monotonic()
        with store.edit("exp", timeout=2) as m:
            m[f"k{n}"] = d
            m.meta["n"] = n + 1
        waited = time.monotonic() - t
        assert waited < 1.0, f"edit after a crash waited {waited:.2f}s"
        casstore.open(root)  # sweeps the dead writer's staging files
        assert not any(f.startswith(f"{child.pid}.") for f in os.listdir(root / "tmp"))
    assert progressed > 8


def test_live_lock_holder_makes_edit_time_out_naming_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    old_obj, new_obj = store.put(b"old"), store.put(b"new")
    with store.edit("exp") as m:
        m["old"] = old_obj
    old = store.heads()["exp"]
    new = _expected_next(store, "exp", "new", new_obj)
    # The child stops itself in the middle of its commit (version written, ref not moved): alive, lock held.
    child = SPAWN.Process(target=faulty_edit_worker,
                          args=(str(root), "exp", "new", str(new_obj), "manifest.after_object", signal.SIGSTOP))
    child.start()
    try:
        wait_for(lambda: child.exitcode is not None or proc_state(child.pid) == "T", 60, "the child to stop")
        assert child.exitcode is None
        assert new in store and store.heads()["exp"] == old
        lp = lock_file(root, "exp")
        for timeout in (0.3, 1.0):
            t = time.monotonic()
            with pytest.raises(LockTimeout) as ei:
                with store.edit("exp", timeout=timeout) as m:
                    m["mine"] = old_obj
            waited = time.monotonic() - t
            assert timeout <= waited < timeout + 0.5, (timeout, waited)
            assert str(lp) in str(ei.value) and f"{timeout:g}s" in str(ei.value)
        # Readers are not blocked by the stuck writer, and see the old version.
        assert store.manifest("exp").digest == old
        # Other names are not blocked either.
        assert _timed_edit(store, "other", "k", old_obj, timeout=0.5) < 0.5
        os.kill(child.pid, signal.SIGKILL)  # kills a stopped process too
        child.join(30)
    finally:
        stop_process(child)
    assert child.exitcode == -signal.SIGKILL
    waited = _timed_edit(store, "exp", "mine", old_obj, timeout=2)
    assert waited < 1.0
    man = store.manifest("exp")
    assert sorted(man) == ["mine", "old"] and man.parent == old  # the orphan version never became the head
