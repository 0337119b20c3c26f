"""Locks that are missing or lie (issue 17): degrade to lease files, never crash; index-cache
first-writer-wins on the lease path; no descriptor leaks from dropped caches.

Every cross-process test runs real processes.  "ENOSYS" is simulated inside a child by
replacing ``fcntl.flock`` (and the OFD ``fcntl`` call) with functions that raise it, before
casstore is imported: the child then sees exactly what a Lustre mount without ``-o flock``
shows.  Forcing ``lock_mode = "lease"`` is what a user does where the probe cannot tell.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _fetch_helpers import serve

import casstore
from casstore import _lock
from casstore._fsprobe import probe
from casstore._lock import FileLock, lease_path
from casstore.cache import IndexCache

ROOT = Path(__file__).resolve().parent.parent
JOIN = 120.0

# Put into every child before casstore is imported: flock and OFD fcntl locks fail with ENOSYS.
ENOSYS_PRELUDE = textwrap.dedent("""
    import errno, fcntl
    _real_fcntl = fcntl.fcntl
    def _flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    def _fcntl(fd, cmd, arg=0):
        if cmd in (fcntl.F_OFD_SETLK, fcntl.F_OFD_SETLKW, fcntl.F_SETLK, fcntl.F_SETLKW):
            raise OSError(errno.ENOSYS, "Function not implemented")
        return _real_fcntl(fd, cmd, arg)
    fcntl.flock = _flock
    fcntl.fcntl = _fcntl
""")


def child_env(tmp_path: Path, **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_")}
    env.update(PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(tmp_path / "xdg"), CASSTORE_CONFIG=os.devnull, **extra)
    return env


def run_children(script: str, n: int, env: Dict[str, str], args: List[str]) -> List[str]:
    """Start ``n`` python children at once; return their stderr (each must exit 0)."""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(k), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(n)]
    errs = []
    for p in procs:
        out, err = p.communicate(timeout=JOIN)
        assert p.returncode == 0, f"child failed ({p.returncode}):\n{out}\n{err}"
        errs.append(err)
    return errs


EDITS = ENOSYS_PRELUDE.replace("fcntl.flock = _flock", "fcntl.flock = _flock if PATCH else fcntl.flock") \
    .replace("fcntl.fcntl = _fcntl", "fcntl.fcntl = _fcntl if PATCH else fcntl.fcntl")
EDITS = "import os, sys\nPATCH = os.environ.get('TEST_ENOSYS') == '1'\n" + EDITS + textwrap.dedent("""
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import casstore
    k, root, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = casstore.open(root)
    for i in range(n):
        with store.edit("shared") as m:
            m[f"w{k}-{i}"] = store.put(b"%d-%d" % (k, i))
    cache = casstore.IndexCache(store, length=4)
    assert cache.put(0, b"x") and not cache.put(0, b"y") and cache.get(0) == b"x"
    cache.close()
    print(store.filesystem().lock_mode)
""")


@pytest.mark.parametrize("how", ["forced", "enosys-auto", "enosys-forced-flock"])
def test_edits_serialize_on_the_lease_path(tmp_path: Path, how: str) -> None:
    """4 processes x 25 one-key edits of one name: 100 keys, 100 versions, on leases however we got there."""
    root = tmp_path / "store"
    casstore.open(root)
    extra = {"forced": {"CASSTORE_LOCK_MODE": "lease"},
             "enosys-auto": {"TEST_ENOSYS": "1"},
             "enosys-forced-flock": {"TEST_ENOSYS": "1", "CASSTORE_LOCK_MODE": "flock"}}[how]
    errs = run_children(EDITS, 4, child_env(tmp_path, **extra), [str(root), "25"])
    store = casstore.open(root)
    man = store.manifest("shared")
    assert sorted(man) == sorted(f"w{k}-{i}" for k in range(4) for i in range(25))
    assert len(store.history("shared")) == 100
    names = os.listdir(root / "locks" / "names")
    assert not [n for n in names if ".lease" in n], names  # every lease released, no claim left behind
    for err in errs:
        warnings = [line for line in err.splitlines() if "lease files" in line]
        if how == "forced":
            assert warnings == []  # asked for: nothing to warn about
        else:
            assert len(warnings) == 1, err  # once per store, never a raw OSError
            assert "Traceback" not in err


def test_enosys_child_reports_lease_mode(tmp_path: Path) -> None:
    """The automatic fallback is visible: the child that saw ENOSYS says it locks with leases."""
    root = tmp_path / "store"
    casstore.open(root)
    script = EDITS.replace("print(store.filesystem().lock_mode)", "print('MODE', store.filesystem().lock_mode)")
    p = subprocess.run([sys.executable, "-c", script, "0", str(root), "2"], env=child_env(tmp_path, TEST_ENOSYS="1"),
                       capture_output=True, text=True, timeout=JOIN)
    assert p.returncode == 0, p.stderr
    assert "MODE lease" in p.stdout
    q = subprocess.run([sys.executable, "-c", script, "0", str(root), "2"], env=child_env(tmp_path),
                       capture_output=True, text=True, timeout=JOIN)
    assert "MODE flock" in q.stdout  # and an honest filesystem keeps the fast path


PIPELINE = ENOSYS_PRELUDE + textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import casstore
    k, root, url, counter = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    store = casstore.open(root)
    d = store.fetch(url, timeout=60)
    def fn(inputs, out):
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.5)
        (out / "r.bin").write_bytes(inputs["src"].read_bytes()[::-1])
    man = store.derive("rev", inputs={"src": d}, fn=fn, timeout=60)
    assert store.get(man["r.bin"].digest) == store.get(d)[::-1]
""")


def test_fetch_and_derive_once_across_4_processes_on_the_lease_path(tmp_path: Path) -> None:
    root = tmp_path / "store"
    casstore.open(root)
    counter = tmp_path / "derived"
    with serve() as srv:
        url = srv.add("/data.bin", os.urandom(1 << 20), delay=0.05)  # slow: the others must wait, not fetch
        run_children(PIPELINE, 4, child_env(tmp_path), [str(root), url, str(counter)])
        assert srv.count("/data.bin") == 1
    assert len(counter.read_text().split()) == 1


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from casstore import _lock
    path, beat, shared = Path(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["shared"]
    _lock.configure(path.parent, "lease")
    lk = _lock.FileLock(path, timeout=5, heartbeat=float(beat) if beat != "none" else None, shared=shared).acquire()
    print("held", flush=True)
    sys.stdin.readline()
    lk.release()
    print("released", flush=True)
""")


def _start_holder(path: Path, beat: str, tmp_path: Path, *extra: str, script: str = HOLDER) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", script, str(path), beat, *extra], env=child_env(tmp_path),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_sigkilled_lease_holder_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "x.lock"
    path.parent.mkdir()
    _lock.configure(path.parent, "lease")
    p = _start_holder(path, "none", tmp_path)
    assert lease_path(path).exists()
    with pytest.raises(casstore.LockTimeout):
        FileLock(path, timeout=0.3).acquire()  # a live holder is waited for
    p.kill()
    p.wait()
    t = time.monotonic()
    with FileLock(path, timeout=10) as lk:  # dead pid on this host: taken over at once
        assert lk.kind == "lease"
        assert time.monotonic() - t < 2.0
    assert not lease_path(path).exists()
    assert [n for n in os.listdir(path.parent) if ".end." in n or ".new." in n] == []


def test_stopped_beating_holder_is_taken_over_after_expiry_and_knows_it(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "y.lock"
    path.parent.mkdir()
    _lock.configure(path.parent, "lease")
    p = _start_holder(path, "0.1", tmp_path)  # beats every 0.1 s: stale after 3 missed beats
    _take_over_while_stopped(p, path, 0.2, 5.0)


def _take_over_while_stopped(p: subprocess.Popen[str], path: Path, least: float, most: float) -> None:
    """Stop the holder ``p``, take its lease over (in ``least`` to ``most`` seconds), resume it and let
    it release: it must leave our lease alone and warn that it was taken over."""
    try:
        os.kill(p.pid, signal.SIGSTOP)
        t = time.monotonic()
        lk = FileLock(path, timeout=30).acquire()
        took = time.monotonic() - t
        assert least <= took < most, took
        mine = os.stat(lease_path(path)).st_ino
        os.kill(p.pid, signal.SIGCONT)
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "released"
        assert os.stat(lease_path(path)).st_ino == mine  # the old holder did not remove our lease
        lk.release()
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        _, err = p.communicate(timeout=JOIN)
    assert "was taken over while this process held it" in err


def _stealer(path: str, barrier: Any, log: str) -> None:
    _lock.configure(Path(path).parent, "lease")
    barrier.wait(JOIN)
    with FileLock(Path(path), timeout=30):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"in\n")
        time.sleep(0.002)
        os.write(fd, b"out\n")
        os.close(fd)


def test_racing_stealers_one_wins(tmp_path: Path) -> None:
    """Many rounds: a dead holder's lease, 4 processes racing to take it over; never two inside."""
    path = tmp_path / "locks" / "z.lock"
    path.parent.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    log = tmp_path / "log"
    ctx = mp.get_context("fork")
    for _ in range(25):
        rec = {"pid": dead_pid, "host": _lock._HOST, "started": time.time(), "every": 10.0, "what": "x",
               "beats": False}
        lease_path(path).write_text(json.dumps(rec))
        log.write_text("")
        barrier = ctx.Barrier(4)
        ps = [ctx.Process(target=_stealer, args=(str(path), barrier, str(log))) for _ in range(4)]
        for q in ps:
            q.start()
        for q in ps:
            q.join(JOIN)
            assert q.exitcode == 0
        lines = log.read_text().split()
        assert lines == ["in", "out"] * 4, lines
        assert not lease_path(path).exists()
    assert [n for n in os.listdir(path.parent) if ".end." in n or ".new." in n] == []


SHORT_EXPIRY_HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from casstore import _lock
    _lock.LEASE_EXPIRY, _lock._QUICK_RELEASE = 1.0, 0.5  # its record says: stale after 1 s unchanged
    path = Path(sys.argv[1])  # (argv[2], the beat, is "none")
    _lock.configure(path.parent, "lease")
    lk = _lock.FileLock(path, timeout=5).acquire()
    print("held", flush=True)
    sys.stdin.readline()
    lk.release()
    print("released", flush=True)
""")


def test_a_short_hold_ends_without_an_end_claim_an_old_or_beating_one_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit's lease (milliseconds) is released with a stat and an unlink: no waiter can be ending a
    lease younger than half the expiry.  Older or beating leases still win the end claim first."""
    path = _lease_dir(tmp_path, "q.lock")
    claims: List[int] = []
    real = _lock._claim

    def spy(lease: Path, ino: int) -> Any:
        claims.append(ino)
        return real(lease, ino)

    monkeypatch.setattr(_lock, "_claim", spy)
    for _ in range(3):
        with FileLock(path, timeout=5) as lk:
            assert lease_path(path).exists() and lk.kind == "lease"
        assert not lease_path(path).exists()
    assert claims == []
    monkeypatch.setattr(_lock, "_QUICK_RELEASE", 0.05)
    with FileLock(path, timeout=5):
        time.sleep(0.1)
    assert len(claims) == 1 and not lease_path(path).exists()
    monkeypatch.setattr(_lock, "_QUICK_RELEASE", 100.0)
    with FileLock(path, timeout=5, heartbeat=0.05):
        pass
    assert len(claims) == 2 and not lease_path(path).exists()
    assert [n for n in os.listdir(path.parent) if ".end." in n or ".new." in n] == []


def test_a_stopped_non_beating_holder_taken_over_knows_it_and_leaves_the_new_lease(tmp_path: Path) -> None:
    # Its record says it does not beat and goes stale after 1 s unchanged; it holds for longer than
    # its quick-release age, so its release takes the end claim and finds the lease replaced.
    path = _lease_dir(tmp_path, "s.lock")
    p = _start_holder(path, "none", tmp_path, script=SHORT_EXPIRY_HOLDER)
    _take_over_while_stopped(p, path, 0.9, 10.0)


def test_a_waiter_polls_with_an_lstat_and_reads_the_lease_only_to_judge_its_holder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full look is four round trips on FUSE or NFS; waiters polling with it slowed every holder."""
    path = _lease_dir(tmp_path, "p.lock")
    p = _start_holder(path, "none", tmp_path)
    looks: List[Path] = []
    real = _lock._look

    def spy(lease: Path) -> Any:
        looks.append(lease)
        return real(lease)

    monkeypatch.setattr(_lock, "_look", spy)
    t = time.monotonic()
    with pytest.raises(casstore.LockTimeout):
        FileLock(path, timeout=0.6).acquire()  # ~150 polls in 0.6 s at the back-off's 5 ms
    assert time.monotonic() - t >= 0.6
    assert 1 <= len(looks) <= 5, len(looks)  # one after the failed create, then one per CHECK_EVERY
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "released"
    t = time.monotonic()
    with FileLock(path, timeout=5):
        assert time.monotonic() - t < 1.0
    p.wait(JOIN)


# -- shared leases (the GC lock that commits hold shared): holder files beside the lease --------------


def _lease_dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "locks" / name
    path.parent.mkdir()
    _lock.configure(path.parent, "lease")
    return path


def test_shared_holds_admit_each_other_and_exclude_an_exclusive_one(tmp_path: Path) -> None:
    path = _lease_dir(tmp_path, "g.lock")
    a = FileLock(path, timeout=1, shared=True).acquire()
    t = time.monotonic()
    b = FileLock(path, timeout=1, shared=True).acquire()  # no wait for the other shared holder
    assert time.monotonic() - t < 0.5 and a.kind == b.kind == "lease"
    assert len(os.listdir(_lock.shared_dir(path))) == 2 and not lease_path(path).exists()
    with pytest.raises(casstore.LockTimeout, match="g.lock"):
        FileLock(path, timeout=0.3).acquire()  # waits for both; a non-beating holder does not stretch it
    assert not lease_path(path).exists()  # the timed-out acquirer left no lease to block the next ones
    a.release()
    with pytest.raises(casstore.LockTimeout):
        FileLock(path, timeout=0.3).acquire()
    b.release()
    assert os.listdir(_lock.shared_dir(path)) == []
    with FileLock(path, timeout=1):
        assert lease_path(path).exists()
        with pytest.raises(casstore.LockTimeout):  # an exclusive holder keeps new shared holders out
            FileLock(path, timeout=0.3, shared=True).acquire()
        assert os.listdir(_lock.shared_dir(path)) == []  # the one that met the lease removed its file
    with FileLock(path, timeout=1, shared=True):
        pass


def test_sigkilled_shared_holder_is_cleared_by_the_exclusive_acquirer(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = _lease_dir(tmp_path, "g.lock")
    p = _start_holder(path, "none", tmp_path, "shared")
    with pytest.raises(casstore.LockTimeout):
        FileLock(path, timeout=0.3).acquire()  # a live shared holder is waited for
    p.kill()
    p.wait()
    t = time.monotonic()
    with FileLock(path, timeout=10):  # its pid is dead on this host: its file is removed at once
        assert time.monotonic() - t < 1.0
    assert os.listdir(_lock.shared_dir(path)) == []
    assert "removed the stale shared hold" in caplog.text


def test_planted_entries_among_shared_holders(tmp_path: Path) -> None:
    """Only regular files are holders: a directory, FIFO or symlink is never opened nor waited for; a
    file without a record (a holder killed between create and write, or junk) is stale after 2 s."""
    path = _lease_dir(tmp_path, "g.lock")
    d = _lock.shared_dir(path)
    d.mkdir()
    (d / "adir").mkdir()
    os.mkfifo(d / "afifo")
    (d / "alink").symlink_to("/dev/zero")
    t = time.monotonic()
    with FileLock(path, timeout=5):
        assert time.monotonic() - t < 0.5
    (d / "junk").write_bytes(b"not a record")
    t = time.monotonic()
    with FileLock(path, timeout=10):
        assert 1.5 < time.monotonic() - t < 5.0
    assert not (d / "junk").exists() and (d / "afifo").exists()


SHARED_OR_NOT = textwrap.dedent(r"""
    import os, sys, time
    from pathlib import Path
    from casstore import _lock
    path, log, shared, rounds = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "shared", int(sys.argv[4])
    _lock.configure(path.parent, "lease")
    tag = b"S" if shared else b"X"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    for _ in range(rounds):
        with _lock.FileLock(path, timeout=60, shared=shared):
            os.write(fd, tag + b"+\n")
            time.sleep(0.001)
            os.write(fd, tag + b"-\n")
""")


def test_exclusive_never_overlaps_a_shared_hold_across_processes(tmp_path: Path) -> None:
    path = _lease_dir(tmp_path, "g.lock")
    log = tmp_path / "log"
    log.write_text("")
    env = child_env(tmp_path)
    # Two of each: exclusive acquirers racing shared ones at their create-then-look step.
    procs = [subprocess.Popen([sys.executable, "-c", SHARED_OR_NOT, str(path), str(log), kind, "300"], env=env,
                              stderr=subprocess.PIPE, text=True)
             for kind in ("shared", "exclusive", "shared", "exclusive")]
    for q in procs:
        _, err = q.communicate(timeout=JOIN)
        assert q.returncode == 0, err
    inside = {"S": 0, "X": 0}
    overlapped_shared = False
    for line in log.read_text().split():
        kind, sign = line[0], line[1]
        inside[kind] += 1 if sign == "+" else -1
        assert inside["X"] in (0, 1) and not (inside["X"] and inside["S"]), "exclusive overlapped a holder"
        overlapped_shared |= inside["S"] > 1
    assert inside == {"S": 0, "X": 0}
    assert overlapped_shared  # shared holders did run side by side (else this proves little)
    assert len(log.read_text().split()) == 4 * 300 * 2


def _cache_writer(cache: IndexCache, barrier: Any, q: Any) -> None:
    won = []
    pad = b"." * 4096  # a wider window between a writer's slot check and its commit
    for start in range(0, cache.length, 25):
        barrier.wait(JOIN)  # every 25 indices all writers start together: they collide on each block
        won += [i for i in range(start, min(start + 25, cache.length))
                if cache.put(i, b"%d:%d:" % (os.getpid(), i) + pad)]
    q.put((os.getpid(), won))


def test_index_cache_first_writer_wins_across_processes_on_the_lease_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASSTORE_LOCK_MODE", "lease")
    monkeypatch.setenv("CASSTORE_CONFIG", os.devnull)
    store = casstore.open(tmp_path / "store")
    assert store.filesystem().lock_mode == "lease"
    cache = IndexCache(store, length=2000)
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(4), ctx.Queue()
    ps = [ctx.Process(target=_cache_writer, args=(cache, barrier, q)) for _ in range(4)]
    for p in ps:
        p.start()
    got = [q.get(timeout=JOIN) for _ in ps]
    for p in ps:
        p.join(JOIN)
        assert p.exitcode == 0
    wins = {i: pid for pid, won in got for i in won}
    assert sum(len(won) for _, won in got) == 2000 and len(wins) == 2000
    for i in range(2000):
        assert cache.get(i) == b"%d:%d:" % (wins[i], i) + b"." * 4096
    assert cache.count == 2000
    cache.freeze()
    assert cache.get(1999) == b"%d:%d:" % (wins[1999], 1999) + b"." * 4096
    cache.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_dropped_caches_close_their_descriptors(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "store")
    gc.collect()
    before = _fds()
    for k in range(20):
        c = IndexCache(store, length=8)
        c.put(0, b"a" * 100)
        c.get(0)
        if k % 2:
            c.freeze()
            c.get(0)
        del c
    gc.collect()
    assert _fds() == before
    assert [n for n in os.listdir(store.root / "tmp") if n.endswith(".icache")] == []
    c = IndexCache(store, length=4)
    c.put(1, b"b")
    c.freeze()
    d = c.preserve("kept")
    del c
    gc.collect()
    assert _fds() == before
    for _ in range(5):
        r = IndexCache.open(store, "kept")
        assert r.get(1) == b"b" and r.digest == d
        del r
    gc.collect()
    assert _fds() == before


def test_probe_and_doctor(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "store")
    info = probe(store.root / "locks")
    assert info.flock == "enforced" and info.lock_mode == "flock"  # this test machine's filesystem is honest
    fs = store.filesystem()
    assert fs.lock_mode == "flock" and fs.hardlinks == "ok" and fs.actions
    assert [n for n in os.listdir(store.root / "locks") if n.startswith(".probe")] == []
    env = child_env(tmp_path, CASSTORE_LOCK_MODE="lease")
    r = subprocess.run([sys.executable, "-m", "casstore", "--store", str(store.root), "doctor", "--json"],
                       env=env, capture_output=True, text=True, timeout=JOIN)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["lock_mode"] == "lease" and doc["setting"] == "lease" and doc["flock"] == "enforced"
    r = subprocess.run([sys.executable, "-m", "casstore", "--store", str(store.root), "doctor"],
                       env=child_env(tmp_path), capture_output=True, text=True, timeout=JOIN)
    assert r.returncode == 0, r.stderr
    assert "flock" in r.stdout and "enforced" in r.stdout


def _die_mid_put(cache: IndexCache, i: int) -> None:
    import casstore._faults as faults

    def hook(point: str) -> None:
        if point == "cache.put_after_data":
            os.kill(os.getpid(), signal.SIGKILL)

    faults.hook = hook
    cache.put(i, b"never committed")


def test_lease_path_writer_killed_mid_put_leaves_the_index_usable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its lease (dead pid) is taken over and its slot claim too: the index is put again, once."""
    monkeypatch.setenv("CASSTORE_LOCK_MODE", "lease")
    monkeypatch.setenv("CASSTORE_CONFIG", os.devnull)
    store = casstore.open(tmp_path / "store")
    cache = IndexCache(store, length=4, lock_timeout=10)
    p = mp.get_context("fork").Process(target=_die_mid_put, args=(cache, 2))
    p.start()
    p.join(JOIN)
    assert p.exitcode == -signal.SIGKILL
    assert cache._dir is not None and (cache._dir / "claim.2").exists() and (cache._dir / "lock.lease").exists()
    assert cache.get(2) is None
    t = time.monotonic()
    assert cache.put(2, b"two") and not cache.put(2, b"again")
    assert time.monotonic() - t < 5.0
    assert cache.get(2) == b"two" and cache.count == 1
    cache.close()


def _put_and_exit(cache: IndexCache, i: int) -> None:
    assert cache.put(i, b"first")
    os._exit(0)


def test_lease_path_committed_claim_of_an_exited_writer_is_never_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI on the lock-granting FUSE mount: one index won twice.  A writer committed it and exited;
    another's map still showed the slot empty, found the claim's pid dead and took it over.  The
    claim now says "committed", so a map that lags (simulated: the slot cleared in the file) never
    leads to a second record -- put answers False, as for any taken index."""
    monkeypatch.setenv("CASSTORE_LOCK_MODE", "lease")
    monkeypatch.setenv("CASSTORE_CONFIG", os.devnull)
    store = casstore.open(tmp_path / "store")
    cache = IndexCache(store, length=4, lock_timeout=10)
    p = mp.get_context("fork").Process(target=_put_and_exit, args=(cache, 1))
    p.start()
    p.join(JOIN)
    assert p.exitcode == 0
    assert cache._dir is not None
    claim = (cache._dir / "claim.1").read_text().split()
    assert claim[0] == str(p.pid) and claim[-1] == "committed", claim
    assert cache.get(1) == b"first"
    # The lagging view: this process's map shows slot 1 empty (its bytes zeroed).
    slot_at = casstore.cache._HDR + casstore.cache._SLOT_SIZE * 1
    with open(cache._dir / "index", "r+b") as f:
        f.seek(slot_at)
        f.write(bytes(casstore.cache._SLOT_SIZE))
    assert cache.get(1) is None
    assert not cache.put(1, b"second")  # the dead writer's pid alone no longer frees the slot
    assert cache.put(2, b"two") and cache.get(2) == b"two"
    cache.close()
