"""GC against concurrent writers and against being killed: real processes, real SIGKILL.

The mechanism under test (docs/maintenance.md):
(a) ``locks/gc.lock``: commits, pins and freezes hold it shared while they check their objects
    and land the ref; ``execute`` holds it exclusive while it re-reads the roots and deletes;
(b) a grace period on fresh objects, with re-puts refreshing the mtime.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest
from conftest import PYTHON, REPO

import casstore
from casstore.digest import hash_bytes
from casstore.errors import LockTimeout

WRITER = r"""
import json, os, random, sys, time
import casstore
from casstore.errors import ObjectNotFoundError
root, wid, deadline, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
s = casstore.open(root, durable=False)
rng = random.Random(seed)
pool = [b"pool value %d " % i * 20 for i in range(POOL)]  # every writer re-puts these: dedupe hits on garbage
stats = {"commits": 0, "refused": 0, "pins": 0, "unpins": 0}
mine = []
i = 0
while time.time() < deadline:
    name = rng.choice([f"w{wid}", f"w{wid}", "shared"])
    try:
        with s.edit(name, timeout=60) as m:
            for _ in range(rng.randint(1, 3)):
                data = rng.choice(pool) if rng.random() < 0.5 else os.urandom(rng.randint(10, 3000))
                m[f"k{rng.randint(0, 15)}"] = s.put(data, compress=rng.random() < 0.2)
            time.sleep(rng.random() * 0.004)  # "computing": widens the window between put and commit
            if len(m) > 4 and rng.random() < 0.5:
                del m[rng.choice(sorted(m))]
        stats["commits"] += 1
    except ObjectNotFoundError:
        # gc (grace 0) collected an object between our put and our commit: the
        # commit is refused under the gc lock; it never lands a dangling ref.
        stats["refused"] += 1
    if rng.random() < 0.3:  # drop a pool value from "seed": old, now unreferenced, soon re-put by someone
        with s.edit("seed", timeout=60) as m:
            if m:
                del m[rng.choice(sorted(m))]
    if rng.random() < 0.06:
        try:
            s.pin(f"p{wid}-{i}", name)
            mine.append(f"p{wid}-{i}")
            stats["pins"] += 1
        except ObjectNotFoundError:
            pass
    if mine and rng.random() < 0.03:
        s.unpin(mine.pop(rng.randrange(len(mine))))
        stats["unpins"] += 1
    i += 1
print(json.dumps(stats))
"""


POOL = 200
WRITER = WRITER.replace("range(POOL)", f"range({POOL})")


def check_consistent(store: casstore.Store) -> None:
    """Every head and pin resolves and every object any stored version references verifies."""
    names = list(store.heads()) + list(store.pins())
    assert names
    for name in names:
        man = store.manifest(name)
        for key in man:
            e = man[key]
            data = store.get(e.digest)  # re-hashed
            assert e.size is None or len(data) == e.size, (name, key)
    rep = store.verify()
    assert not rep.missing, rep.summary()
    assert not rep.corrupt, rep.summary()
    assert rep.ok, rep.summary()


def run_writers_against_gc(root: Path, *, grace: float, seconds: float) -> Dict[str, Any]:
    store = casstore.open(root, durable=False)
    deadline = time.time() + seconds
    procs = [subprocess.Popen([PYTHON, "-c", WRITER, str(root), str(w), str(deadline), str(w * 7919 + 1)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for w in range(4)]
    rng = random.Random(42)
    rounds = deleted = skipped = 0
    try:
        while any(p.poll() is None for p in procs):
            plan = store.plan_gc(keep_history=rng.choice([0, 1, 2]), grace=grace)
            res = plan.execute(timeout=60)
            rounds += 1
            deleted += len(res.deleted)
            skipped += len(res.skipped)
    finally:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    totals = {k: sum(o[k] for o in outs) for k in outs[0]}
    totals.update(rounds=rounds, deleted=deleted, skipped=skipped)
    # one last collection once everyone is done, then the full check
    store.plan_gc(keep_history=1, grace=0).execute()
    check_consistent(store)
    return totals


@pytest.fixture(params=["flock", "lease"])
def lock_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The store's locks, in this process and in the writers it starts: kernel locks, or lease files
    (shared holder files for commits, an exclusive lease for gc: ``_lock.py`` "Shared leases")."""
    monkeypatch.setenv("CASSTORE_LOCK_MODE", request.param)
    return str(request.param)


def test_gc_concurrent_with_4_writers_lock_alone(tmp_path: Path, lock_mode: str) -> None:
    """grace=0: only the lock protects. Commits may be refused, but no ref ever dangles."""
    t = run_writers_against_gc(tmp_path / "s", grace=0, seconds=7)
    assert casstore.open(tmp_path / "s").filesystem().lock_mode == lock_mode
    assert t["rounds"] >= 10 and t["deleted"] > 100 and t["commits"] > 200, t
    assert t["pins"] > 0 and t["unpins"] > 0, t


def test_gc_concurrent_with_4_writers_grace(tmp_path: Path) -> None:
    """grace=3s: writers that put and commit at once never see their objects collected."""
    root = tmp_path / "s"
    # Pool values start old and referenced by head "seed"; writers drop them from it and re-put
    # them: without the re-put refreshing the mtime, gc would collect them under the writers.
    seed = casstore.open(root, durable=False)
    with seed.edit("seed") as m:
        for i in range(POOL):
            m[f"v{i}"] = seed.put(b"pool value %d " % i * 20)
    t0 = time.time() - 3600
    for p in (root / "objects").rglob("*"):
        if p.is_file():
            os.utime(p, (t0, t0))
    t = run_writers_against_gc(root, grace=3, seconds=7)
    assert t["refused"] == 0, t
    assert t["rounds"] >= 10 and t["commits"] > 200, t


SLOW_COMMIT = r"""
import os, sys, time
import casstore, casstore._faults as faults
root, marker, go = sys.argv[1:4]
s = casstore.open(root)
def hook(point):
    if point == "manifest.after_object":  # the version object is written; the ref has not moved yet
        open(marker, "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
faults.hook = hook
with s.edit("slow") as m:
    m["x"] = s.put(b"payload of a slow commit" * 10)
print(m.result.digest)
"""


def test_gc_waits_for_a_commit_in_progress_and_spares_what_it_lands(tmp_path: Path, lock_mode: str) -> None:
    root = tmp_path / "s"
    store = casstore.open(root)
    assert store.filesystem().lock_mode == lock_mode
    marker, go = tmp_path / "in-commit", tmp_path / "go"
    p = subprocess.Popen([PYTHON, "-c", SLOW_COMMIT, str(root), str(marker), str(go)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        t0 = time.time()
        while not marker.exists():
            assert p.poll() is None and time.time() - t0 < 30, p.communicate()
            time.sleep(0.01)
        x = hash_bytes(b"payload of a slow commit" * 10)
        plan = store.plan_gc(grace=0)
        assert x in plan.objects  # not referenced yet: planned
        version = next(d for d in plan.objects if d != x)  # the commit's version object, written, unreferenced
        with pytest.raises(LockTimeout, match="gc.lock"):
            plan.execute(timeout=0.3)  # the commit holds the lock shared
        assert store.contains(x) and store.contains(version)
        box: List[Any] = []
        th = threading.Thread(target=lambda: box.append(plan.execute(timeout=60)))
        th.start()
        time.sleep(0.3)
        assert th.is_alive()  # gc waits for the commit ...
        go.touch()  # ... which now lands its ref
        th.join(60)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    finally:
        if p.poll() is None:
            p.kill()
    res = box[0]
    assert x not in res.deleted and "now referenced" in res.skipped[x]
    assert version not in res.deleted and str(version) == out.strip()
    assert store.manifest("slow")["x"].digest == x and store.get(x)
    check_consistent(store)


KILLED_GC = r"""
import os, signal, sys
import casstore, casstore._faults as faults
root, point, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = casstore.open(root)
count = [0]
def hook(p):
    if p == point:
        count[0] += 1
        if count[0] >= n:
            os.kill(os.getpid(), signal.SIGKILL)
faults.hook = hook
s.plan_gc(keep_history=2, grace=0).execute()
"""


def hexes(root: Path) -> Set[str]:
    return {p.parent.name + p.name.removesuffix(".zst") for p in (root / "objects").rglob("*") if p.is_file()}


@pytest.mark.parametrize("point,n", [("gc.deleted", 3), ("gc.deleted", 30), ("gc.moved", 12)],
                         ids=["among-versions", "among-objects", "between-move-and-unlink"])
def test_gc_killed_midway_leaves_a_consistent_store_and_a_rerun_finishes(tmp_path: Path, point: str, n: int) -> None:
    root = tmp_path / "s"
    store = casstore.open(root)
    for i in range(20):
        with store.edit("exp") as m:
            m[f"k{i % 3}"] = store.put(b"version %d data " % i * 40)
            m["big"] = store.put(os.urandom(2000))
        if i == 5:
            store.pin("p", "exp")
    for i in range(30):
        store.put(b"loose %d" % i * 10, compress=bool(i % 2))
    plan = store.plan_gc(keep_history=2, grace=0)
    n_versions = len({f.hex for f in plan.files if f.kind == "version"})
    assert n_versions > 3 and len(plan.files) > 40
    expected = hexes(root) - {d.hex for d in plan.objects}
    r = subprocess.run([PYTHON, "-c", KILLED_GC, str(root), point, str(n)], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = hexes(root)
    assert expected < left < hexes(root) | {d.hex for d in plan.objects}  # killed part-way
    # consistent right now, before any cleanup
    for name in ("exp", "p"):
        for e in store.manifest(name).values():
            assert store.get(e.digest)
    for m in store.history("exp"):  # every version still stored has all its objects
        for e in m.values():
            assert store.contains(e.digest)
    rep = store.verify()
    assert not rep.missing and not rep.corrupt and rep.ok, rep.summary()
    graves = [x for x in os.listdir(root / "tmp") if x.endswith(".gc")]
    assert len(graves) == (1 if point == "gc.moved" else 0)
    assert {p.name for p in rep.stale_tmp} >= set(graves)
    # a rerun finishes the job
    again = casstore.open(root)
    res = again.plan_gc(keep_history=2, grace=0).execute()
    assert res.deleted
    assert hexes(root) == expected
    assert not [x for x in os.listdir(root / "tmp") if x.endswith(".gc")]
    check_consistent(again)
