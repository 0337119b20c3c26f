"""Heads and pins move by claims, not by trusting locks (issue 17; ``casstore/refs/local.py``).

Where every lock is granted to everyone (some NFS and FUSE mounts), 4 processes x 25 one-key
edits kept 19 of 100 keys before claims.  Here the lie is made for real in each writer process:
``fcntl.flock`` is replaced by a function that grants every lock at once, so nothing excludes
anyone and only the claim log can keep the edits apart.  Real processes, a real filesystem.

* N processes x M one-key edits to one name lose nothing: every key present, one version per
  edit, and the versions form one chain (each claimed position's version has the previous
  position's as its parent);
* writers SIGKILLed at random moments never leave a ref naming a missing version nor a forked
  chain, and a rerun completes;
* a reader racing a writer whose ref replacement is not atomic (the ref file is unlinked, then
  the new one renamed in, as a FUSE passthrough may show it) never sees "not found", for heads
  and pins alike;
* single-process contracts: a crash between claim and ref write, a first claim with no ref file
  (read and listed, so gc keeps its version), removal and re-creation (a writer who read the old
  incarnation loses), ref files from before logs, damaged claims, the link and O_EXCL fallbacks
  where symbolic links are refused, and an edit re-applied on a version another writer made
  meanwhile (entries, metadata, key conflicts, a name removed or frozen meanwhile).
"""

from __future__ import annotations

import errno
import fcntl
import multiprocessing as mp
import os
import queue
import random
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

import casstore
from casstore.digest import Digest
from casstore.errors import FrozenError, InvalidInputError, ManifestNotFoundError, StoreFormatError
from casstore.refs import LocalRefs
from casstore.refs import local as refs_local

_SPAWN = mp.get_context("spawn")


def _granted(fd: object, op: int) -> None:
    """``flock`` as a lying filesystem does it: every lock granted, to everyone, at once."""


def grant_every_lock() -> None:
    """Make this process's locks exclude nobody (called first thing in each child).

    ``lock_mode = "flock"`` is forced too: where a probe at open can tell that locks do not
    exclude, casstore uses lease files instead (issue 17); these tests are about the hosts
    where it cannot tell (locks that hold only within each host of an NFS mount)."""
    os.environ["CASSTORE_LOCK_MODE"] = "flock"
    fcntl.flock = _granted


@pytest.fixture
def lying(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks that exclude nobody in this (test) process too."""
    monkeypatch.setenv("CASSTORE_LOCK_MODE", "flock")
    monkeypatch.setattr(fcntl, "flock", _granted)


def _log_chain(root: Path, kind: str, name: str) -> List[Optional[Digest]]:
    """The values of every claimed position of a name's log, oldest first (``None``: removed)."""
    ld = refs_local._log_dir(root, kind, name)
    out: List[Optional[Digest]] = []
    while True:
        ok, v = refs_local._read_claim(ld, len(out))
        if not ok:
            return out
        out.append(v)


def _assert_one_chain(store: casstore.Store, name: str) -> List[Digest]:
    """Every position's version has the previous position's version as parent: no fork."""
    chain = _log_chain(store.root, "heads", name)
    assert chain and all(d is not None for d in chain), chain
    prev: Optional[Digest] = None
    for i, d in enumerate(chain):
        assert d is not None
        assert d in store, f"position {i}: version {d} missing"
        m = store.manifest(d)
        assert m.parent == prev, f"position {i} forks: parent {m.parent}, expected {prev}"
        prev = d
    assert store.refs.get("heads", name) == chain[-1]
    return [d for d in chain if d is not None]


# -- children (module level: spawned processes import them) -------------------------------------


def _edit_child(root: str, proc: int, n: int, start: Any, out: Any) -> None:
    try:
        grant_every_lock()
        store = casstore.open(root)
        d = store.put(f"value {proc}".encode())
        start.wait(120)
        for i in range(n):
            with store.edit("exp") as m:
                m[f"p{proc}/k{i}"] = d
        out.put(("ok", proc))
    except BaseException as e:
        out.put(("error", f"{type(e).__name__}: {e}"))


def _endless_edit_child(root: str, proc: int) -> None:
    grant_every_lock()
    store = casstore.open(root)
    d = store.put(f"value {proc}".encode())
    i = 0
    while True:
        with store.edit("exp") as m:
            m[f"p{proc}/k{i}"] = d
        i += 1


def _nonatomic_write_file(tmpdir: Path, dest: Path, data: bytes, *, durable: bool = True,
                          mode: int = 0o444) -> None:
    """A ref replacement as a FUSE passthrough may show it to readers: gone, then empty, then whole."""
    try:
        os.unlink(dest)
    except FileNotFoundError:
        pass
    time.sleep(0.0005)
    with open(dest, "wb"):
        pass
    time.sleep(0.0005)
    os.unlink(dest)
    _real_write_file(tmpdir, dest, data, durable=durable, mode=mode)


_real_write_file = refs_local.write_file_atomic


def _replacing_child(root: str, kind: str, n: int, start: Any, out: Any) -> None:
    try:
        grant_every_lock()
        refs_local.write_file_atomic = _nonatomic_write_file
        store = casstore.open(root)
        digests = [store.put(f"v{i}".encode()) for i in range(3)]
        start.wait(120)
        for i in range(n):
            if kind == "heads":
                with store.edit("exp") as m:
                    m[f"k{i % 7}"] = digests[i % 3]
            else:
                store.pin("frozen", f"exp~{i % 2}", force=True)
        out.put(("ok", n))
    except BaseException as e:
        out.put(("error", f"{type(e).__name__}: {e}"))


def _reading_child(root: str, name: str, stop_after: float, start: Any, out: Any) -> None:
    try:
        store = casstore.open(root)
        start.wait(120)
        reads = missing = 0
        end = time.monotonic() + stop_after
        while time.monotonic() < end:
            try:
                store.manifest(name)
            except ManifestNotFoundError as e:
                missing += 1
                if missing == 1:
                    out.put(("first-miss", str(e)))
            reads += 1
        out.put(("ok", reads, missing))
    except BaseException as e:
        out.put(("error", f"{type(e).__name__}: {e}"))


def _run(targets: List[Tuple[Any, Tuple[Any, ...]]], timeout: float = 300) -> List[Tuple[Any, ...]]:
    start = _SPAWN.Barrier(len(targets))  # every child is ready (spawned, imported) before any starts
    out = _SPAWN.Queue()
    procs = [_SPAWN.Process(target=t, args=(*a, start, out)) for t, a in targets]
    for p in procs:
        p.start()
    try:
        results: List[Tuple[Any, ...]] = []
        deadline = time.monotonic() + timeout
        while sum(1 for r in results if r[0] in ("ok", "error")) < len(procs):
            try:
                results.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"a child never reported (hung or died); so far: {results}")
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, f"child exited with {p.exitcode}"
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# -- processes -----------------------------------------------------------------------------------


def test_processes_with_lying_locks_lose_no_edit(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    casstore.open(root)
    procs, n = 6, 30
    results = _run([(_edit_child, (root, p, n)) for p in range(procs)])
    assert [r for r in results if r[0] != "ok"] == []
    store = casstore.open(root)
    m = store.manifest("exp")
    assert sorted(m) == sorted(f"p{p}/k{i}" for p in range(procs) for i in range(n))
    chain = _assert_one_chain(store, "exp")
    assert len(chain) == procs * n  # one version per edit: none lost, none doubled
    assert len(store.history("exp")) == procs * n


def test_sigkill_at_random_moments_leaves_one_chain_and_a_rerun_completes(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    casstore.open(root)
    rng = random.Random(17)
    for _round in range(4):
        procs = [_SPAWN.Process(target=_endless_edit_child, args=(root, p)) for p in range(4)]
        for p in procs:
            p.start()
        time.sleep(1.0)  # spawn and import
        for p in procs:
            time.sleep(rng.uniform(0.0, 0.3))
            assert p.pid is not None
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(30)
        store = casstore.open(root)
        if store.refs.get("heads", "exp") is None:
            continue  # killed before a first commit (a slow spawn): nothing to check yet
        chain = _assert_one_chain(store, "exp")
        head = store.manifest("exp")
        seen = set()
        for d in chain:  # edits only add keys: the head holds every key any committed version held
            seen.update(store.manifest(d))
        assert set(head) == seen
    results = _run([(_edit_child, (root, 10 + p, 10)) for p in range(4)])
    assert [r for r in results if r[0] != "ok"] == []
    store = casstore.open(root)
    _assert_one_chain(store, "exp")
    assert {f"p{10 + p}/k{i}" for p in range(4) for i in range(10)} <= set(store.manifest("exp"))
    report = store.verify(fast=True)
    assert report.missing == () and report.corrupt == ()


@pytest.mark.parametrize("kind", ["heads", "pins"])
def test_reader_racing_a_non_atomic_replacement_never_sees_not_found(tmp_path: Path, kind: str) -> None:
    root = str(tmp_path / "store")
    store = casstore.open(root)
    with store.edit("exp") as m:
        m["k"] = store.put(b"v0")
    with store.edit("exp") as m:
        m["k"] = store.put(b"v1")
    name = "exp"
    if kind == "pins":
        store.pin("frozen", "exp")
        name = "frozen"
    results = _run([(_replacing_child, (root, kind, 150)), (_reading_child, (root, name, 6.0)),
                    (_reading_child, (root, name, 6.0))])
    assert [r for r in results if r[0] in ("error", "first-miss")] == []
    reads = [r for r in results if r[0] == "ok" and len(r) == 3]
    assert len(reads) == 2 and all(r[1] > 100 for r in reads), reads
    assert sum(r[2] for r in reads) == 0


def test_the_non_atomic_replacement_does_show_readers_a_missing_ref(tmp_path: Path) -> None:
    """The simulation above is real: without the log, a reader of the ref file alone misses it."""
    store = casstore.open(tmp_path / "store")
    with store.edit("exp") as m:
        m["k"] = store.put(b"v0")
    p = tmp_path / "store" / "refs" / "heads" / "exp"
    gone: List[bool] = []
    orig = refs_local.write_file_atomic

    def spying(tmpdir: Path, dest: Path, data: bytes, *, durable: bool = True, mode: int = 0o444) -> None:
        os.unlink(dest)
        gone.append(not p.exists())  # what a reader of the ref file alone would see now
        orig(tmpdir, dest, data, durable=durable, mode=mode)

    refs_local.write_file_atomic = spying  # type: ignore[assignment]
    try:
        with store.edit("exp") as m:
            m["k2"] = store.put(b"v1")
    finally:
        refs_local.write_file_atomic = orig  # type: ignore[assignment]
    assert gone == [True]
    os.unlink(p)  # and with the ref file gone, the name still resolves from its log
    assert set(store.manifest("exp")) == {"k", "k2"}


# -- one process ---------------------------------------------------------------------------------


d1, d2, d3 = (Digest.of(x) for x in (b"one", b"two", b"three"))


def test_crash_between_claim_and_ref_write_is_followed(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "x", d1, None)
    # The claim of position 1 lands, the ref file is never written (the writer died).
    assert refs_local._claim(refs.root, "heads", "x", 1, d2, True)
    assert (refs.root / "refs/heads/x").read_text().startswith(f"{d1}\n")
    got = refs.read("heads", "x")
    assert got is not None and got.digest == d2
    assert refs.list("heads") == {"x": d2}
    assert refs.compare_and_swap("heads", "x", d3, got) is True
    assert _log_chain(refs.root, "heads", "x") == [d1, d2, d3]


def test_first_claim_without_ref_file_is_read_and_listed(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    with store.edit("base") as m:
        m["k"] = store.put(b"x")
    v = store.refs.get("heads", "base")
    assert v is not None
    refs_local._make_log(store.root, refs_local._log_dir(store.root, "heads", "new/name"), "new/name", True)
    assert refs_local._claim(store.root, "heads", "new/name", 0, v, True)
    assert not (store.root / "refs/heads/new/name").exists()
    assert store.refs.get("heads", "new/name") == v
    assert store.refs.list("heads") == {"base": v, "new/name": v}  # gc's roots see it
    assert store.manifest("new/name").digest == v


def test_removed_and_made_again_stale_writer_loses(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "x", d1, None)
    old = refs.read("heads", "x")
    assert refs.compare_and_swap("heads", "x", None, old)
    assert refs.read("heads", "x") is None and not (refs.root / "refs/heads/x").exists()
    assert refs.compare_and_swap("heads", "x", d1, None)  # the same digest again, a new incarnation
    assert refs.compare_and_swap("heads", "x", d2, old) is False  # read in the old incarnation
    assert refs.get("heads", "x") == d1
    assert _log_chain(refs.root, "heads", "x") == [d1, None, d1]


def test_removal_racing_a_recreation_keeps_the_ref_file(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "x", d1, None)
    # A remover claimed position 1 (removed); before it deletes the ref file, a re-creator claims 2
    # and writes its ref file; then the remover's unlink runs.
    assert refs_local._claim(refs.root, "heads", "x", 1, None, True)
    assert refs_local._claim(refs.root, "heads", "x", 2, d2, True)
    refs_local._write_ref(refs.root, "heads", "x", d2, 2)
    refs._uncache("heads", "x")
    assert (refs.root / "refs/heads/x").exists()
    assert refs.list("heads") == {"x": d2}


def test_ref_file_from_before_logs(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    (refs.root / "refs/heads/old").write_text(f"{d1}\n")
    got = refs.read("heads", "old")
    assert got is not None and got.digest == d1
    assert refs.compare_and_swap("heads", "old", d2, got)
    assert _log_chain(refs.root, "heads", "old") == [d2]
    assert refs.get("heads", "old") == d2


def test_damaged_ref_file_of_a_name_without_log_is_reported(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    (refs.root / "refs/heads/bad").write_text("garbage\n")
    with pytest.raises(StoreFormatError, match="damaged"):
        refs.read("heads", "bad")


def test_damaged_ref_file_with_a_log_is_read_from_the_log(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "x", d1, None)
    p = refs.root / "refs/heads/x"
    os.chmod(p, 0o644)
    p.write_text("")  # empty, as a power loss can leave an unsynced replacement
    assert refs.get("heads", "x") == d1


def test_damaged_claim_is_reported(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "x", d1, None)
    os.symlink("../../../../etc/passwd", refs_local._log_dir(refs.root, "heads", "x") / "1")
    with pytest.raises(StoreFormatError, match="claim .* is damaged"):
        refs.read("heads", "x")


@pytest.mark.parametrize("refuse", ["symlink", "symlink+link"])
def test_fallbacks_where_links_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse: str) -> None:
    def no(*_a: object, **_k: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no)
    if "link" in refuse.split("+")[1:]:
        monkeypatch.setattr(os, "link", no)
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "x", d1, None)
    assert refs.compare_and_swap("heads", "x", d2, None) is False
    first = refs.read("heads", "x")
    assert refs.compare_and_swap("heads", "x", d2, first) is True
    assert refs.compare_and_swap("heads", "x", d3, first) is False
    assert _log_chain(refs.root, "heads", "x") == [d1, d2]
    entry = refs_local._log_dir(refs.root, "heads", "x") / "0"
    assert entry.is_file() and not entry.is_symlink()


def test_incomplete_claim_file_is_reported_not_waited_for_forever(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "x", d1, None)
    (refs_local._log_dir(refs.root, "heads", "x") / "1").write_bytes(b"")  # created, never written
    monkeypatch.setattr(refs_local, "_INCOMPLETE_WAIT", 0.05)
    with pytest.raises(StoreFormatError, match="incomplete"):
        refs.read("heads", "x")


def test_prefix_conflict_is_refused_before_any_claim(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    assert refs.compare_and_swap("heads", "team/a", d1, None)
    with pytest.raises(InvalidInputError, match="prefix"):
        refs.compare_and_swap("heads", "team", d1, None)
    assert _log_chain(refs.root, "heads", "team") == []
    assert refs.list("heads") == {"team/a": d1}


def test_rename_and_pins_move_by_claims(tmp_path: Path) -> None:
    refs = casstore.open(tmp_path / "s").refs
    refs.write("heads", "a", d1)
    assert refs.rename("heads", "a", "b")
    assert refs.get("heads", "a") is None and refs.get("heads", "b") == d1
    assert _log_chain(refs.root, "heads", "a") == [d1, None]
    refs.write("pins", "p", d1)
    refs.write("pins", "p", d2)
    assert refs.remove("pins", "p") and refs.get("pins", "p") is None
    assert _log_chain(refs.root, "pins", "p") == [d1, d2, None]
    assert refs.remove("pins", "p") is False


def test_a_working_lock_means_no_claim_is_lost(tmp_path: Path) -> None:
    """The fast path: under a real lock an edit reads the newest position, so its claim wins first time."""
    store = casstore.open(tmp_path / "s")
    lost: List[int] = []
    orig = LocalRefs.swap

    def counting(self: LocalRefs, kind: str, name: str, new: Optional[Digest], expected: Any) -> bool:
        ok = orig(self, kind, name, new, expected)
        if not ok:
            lost.append(1)
        return ok

    LocalRefs.swap = counting  # type: ignore[method-assign]
    try:
        d = store.put(b"x")
        for i in range(20):
            with store.edit("exp") as m:
                m[f"k{i}"] = d
    finally:
        LocalRefs.swap = orig  # type: ignore[method-assign]
    assert lost == []


# -- an edit re-applied on another writer's version ----------------------------------------------


def test_edit_is_reapplied_on_a_version_made_meanwhile(tmp_path: Path, lying: None) -> None:
    store = casstore.open(tmp_path / "s")
    a, b = store.put(b"a"), store.put(b"b")
    with store.edit("exp") as m:
        m["base"] = a
        m.meta.update({"keep": 1, "drop": 2, "ours": 0})
    first = store.edit("exp")
    mine = first.__enter__()
    mine["mine"] = a
    del mine["base"]
    mine.meta["ours"] = 1
    del mine.meta["drop"]
    with store.edit("exp") as theirs:  # granted the same lock: commits in the middle of our edit
        theirs["theirs"] = b
        theirs.meta["their"] = True
    first.__exit__(None, None, None)
    head = store.manifest("exp")
    assert set(head) == {"mine", "theirs"}
    assert dict(head.meta) == {"keep": 1, "ours": 1, "their": True}
    assert mine.result is not None and mine.result.digest == head.digest
    assert len(store.history("exp")) == 3
    _assert_one_chain(store, "exp")


def test_reapplied_edit_rechecks_key_conflicts(tmp_path: Path, lying: None) -> None:
    store = casstore.open(tmp_path / "s")
    a = store.put(b"a")
    with store.edit("exp") as m:
        m["x"] = a
    first = store.edit("exp")
    mine = first.__enter__()
    mine["dir/file"] = a
    with store.edit("exp") as theirs:
        theirs["dir"] = a
    with pytest.raises(InvalidInputError, match="dir"):
        first.__exit__(None, None, None)
    assert set(store.manifest("exp")) == {"x", "dir"}


@pytest.mark.parametrize("meanwhile", ["remove", "freeze"])
def test_name_removed_or_frozen_during_an_edit_commits_nothing(tmp_path: Path, lying: None,
                                                                  meanwhile: str) -> None:
    store = casstore.open(tmp_path / "s")
    a = store.put(b"a")
    with store.edit("exp") as m:
        m["x"] = a
    first = store.edit("exp")
    mine = first.__enter__()
    mine["y"] = a
    if meanwhile == "remove":
        store.remove("exp")
        with pytest.raises(ManifestNotFoundError, match="removed or renamed"):
            first.__exit__(None, None, None)
        assert store.refs.get("heads", "exp") is None
    else:
        store.freeze("exp")
        with pytest.raises(FrozenError, match="frozen"):
            first.__exit__(None, None, None)
        assert set(store.manifest("exp")) == {"x"}


def test_two_creators_of_a_new_name_both_land(tmp_path: Path, lying: None) -> None:
    store = casstore.open(tmp_path / "s")
    a = store.put(b"a")
    first = store.edit("new")
    mine = first.__enter__()
    mine["mine"] = a
    with store.edit("new") as theirs:
        theirs["theirs"] = a
    first.__exit__(None, None, None)
    assert set(store.manifest("new")) == {"mine", "theirs"}
    counts: Dict[str, int] = {"versions": len(store.history("new"))}
    assert counts == {"versions": 2}
