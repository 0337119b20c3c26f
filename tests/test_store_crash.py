"""Crash safety: SIGKILLed writers never publish bad objects; stale temp files of dead
writers are swept on open, and a live writer's never are."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List, Tuple

import pytest
from conftest import PYTHON, assert_all_objects_valid, b3, run_py, tmp_files

import casstore
from casstore import _fs

_WRITER = textwrap.dedent("""
    import os, sys, time, casstore
    s = casstore.open(sys.argv[1])
    level = int(sys.argv[3]) or None
    print("ready", os.getpid(), flush=True)
    t = time.monotonic()
    d = s.put_path(sys.argv[2], compress=level)
    print("done", d, time.monotonic() - t, flush=True)
""")


def _start_writer(root: Path, src: Path, level: int) -> Tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([PYTHON, "-c", _WRITER, str(root), str(src), str(level)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().split()
    assert line[:1] == ["ready"], (line, p.stderr.read() if p.stderr else "")
    return p, int(line[1])


def _half_random(n: int) -> bytes:
    """Compresses about 2:1 and slowly enough at level 9 to be killed mid-way."""
    a = bytearray(os.urandom(n))
    zeros = bytes(2048)
    for i in range(0, n, 4096):
        a[i : i + 2048] = zeros
    return bytes(a)


@pytest.fixture(scope="module")
def half_random_file(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, str]:
    p = tmp_path_factory.mktemp("zsrc") / "half.bin"
    data = _half_random(128 << 20)
    p.write_bytes(data)
    return p, b3(data)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_sigkill_during_put_path(codec: str, big_file: Tuple[Path, str], half_random_file: Tuple[Path, str],
                                 tmp_path: Path) -> None:
    src, digest = big_file if codec == "raw" else half_random_file
    level = 0 if codec == "raw" else 9
    trials = 6 if codec == "raw" else 4

    # one undisturbed run: the digest is right and we learn how long a put takes
    root = tmp_path / "calibrate"
    p, _ = _start_writer(root, src, level)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    _, got, duration = out.split()
    assert got == digest
    s = casstore.open(root)
    assert s.stat(got).codec == codec
    assert assert_all_objects_valid(root) == [digest]
    shutil.rmtree(root)

    rng = random.Random()
    killed_mid_write = published = 0
    for i in range(trials):
        root = tmp_path / f"trial{i}"
        casstore.open(root)
        # stratified random moments across the whole put (and a little past it)
        delay = float(duration) * 1.1 * (i + rng.random()) / trials
        p, pid = _start_writer(root, src, level)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
        finished = "done" in out
        assert p.returncode in (-signal.SIGKILL, 0)

        # every visible object re-hashes to its name; the only possible object is the right one
        names = assert_all_objects_valid(root)
        assert names in ([], [digest]), names
        if finished:
            assert names == [digest]
        published += bool(names)
        leftovers = tmp_files(root)
        for name in leftovers:
            assert name.startswith(f"{pid}."), f"unexpected temp file {name}"
        if leftovers:
            killed_mid_write += 1
            assert not names  # a staged copy is only left behind if it was never renamed into place

        # reopening sweeps the dead writer's temp files, keeps the objects
        s = casstore.open(root)
        assert tmp_files(root) == []
        assert assert_all_objects_valid(root) == names
        if names:
            assert s.stat(digest).size == src.stat().st_size
        shutil.rmtree(root)
    assert killed_mid_write >= 1, "no trial killed the writer while it was writing"


_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from casstore._fs import Staging
    st = Staging(Path(sys.argv[1]) / "tmp", "obj")
    st.write(b"half-written object")
    print(st.path, flush=True)
    time.sleep(600)
""")


def test_reopen_keeps_live_writers_temp_file_and_sweeps_it_once_dead(store: casstore.Store) -> None:
    p = subprocess.Popen([PYTHON, "-c", _HOLDER, str(store.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        staged = Path(p.stdout.readline().strip())
        assert staged.parent == store.root / "tmp" and staged.name.startswith(f"{p.pid}.")
        for _ in range(2):
            casstore.open(store.root)
            assert staged.exists()
            assert store.sweep_tmp() == []
            assert staged.exists()
        # ... also when another process opens the store
        run_py("import sys, casstore; casstore.open(sys.argv[1])", str(store.root))
        assert staged.exists()
    finally:
        p.kill()
        p.wait()
    casstore.open(store.root)
    assert not staged.exists()
    assert tmp_files(store.root) == []


_SLOW_PUT = textwrap.dedent("""
    import sys, casstore
    s = casstore.open(sys.argv[1])
    d = s.put_stream(sys.stdin.buffer)
    print(d, flush=True)
""")


def test_sweep_does_not_break_a_put_in_progress(store: casstore.Store) -> None:
    p = subprocess.Popen([PYTHON, "-c", _SLOW_PUT, str(store.root)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=False)
    assert p.stdin is not None and p.stdout is not None
    first = os.urandom(3 << 20)
    p.stdin.write(first)
    p.stdin.flush()
    deadline = time.monotonic() + 30
    while not tmp_files(store.root) and time.monotonic() < deadline:
        time.sleep(0.01)
    (staged,) = tmp_files(store.root)
    assert staged.startswith(f"{p.pid}.")
    casstore.open(store.root)  # sweeps: must not touch the live writer's file
    assert store.sweep_tmp() == []
    assert tmp_files(store.root) == [staged]
    rest = os.urandom(1 << 20)
    out, _ = p.communicate(rest, timeout=60)
    assert p.returncode == 0
    assert out.decode().strip() == b3(first + rest)
    assert store.get(out.decode().strip()) == first + rest
    assert tmp_files(store.root) == []


def _token_name(pid: int, start: int, host: str = _fs._HOST, kind: str = "obj") -> str:
    return f"{pid}.{start}.{host}.{os.urandom(8).hex()}.{kind}"


def test_pid_reuse_and_dead_pids_count_as_dead(store: casstore.Store) -> None:
    tmp = store.root / "tmp"
    me = os.getpid()
    my_start = _fs._start_time(me)
    assert my_start
    mine = tmp / f"{_fs.process_token()}.{os.urandom(8).hex()}.obj"
    assert mine.name.startswith(f"{me}.{my_start}.")
    reused = tmp / _token_name(me, my_start + 12345)  # a live pid, but not the process that wrote it
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp / _token_name(dead.pid, 1)
    for f in (mine, reused, gone):
        f.write_bytes(b"staged")
    removed = store.sweep_tmp()
    assert sorted(removed) == sorted([reused, gone])
    assert mine.exists() and not reused.exists() and not gone.exists()
    # and the same through reopening
    reused.write_bytes(b"staged")
    casstore.open(store.root)
    assert not reused.exists() and mine.exists()
    mine.unlink()


def test_temp_files_of_other_hosts_and_strangers_go_by_age(store: casstore.Store) -> None:
    tmp = store.root / "tmp"
    other_new = tmp / _token_name(1, 1, host="some-other-host")
    other_old = tmp / _token_name(1, 1, host="some-other-host")
    stranger_new = tmp / "editor.swp"
    stranger_old = tmp / "leftover.part"
    old_dir = tmp / "old-dir"
    for f in (other_new, other_old, stranger_new, stranger_old):
        f.write_bytes(b"x")
    old_dir.mkdir()
    (old_dir / "inner").write_bytes(b"x")
    old = time.time() - _fs.STALE_AGE - 60
    for f in (other_old, stranger_old, old_dir / "inner", old_dir):  # nothing inside changed either
        os.utime(f, (old, old))
    casstore.open(store.root)
    assert sorted(tmp_files(store.root)) == sorted([other_new.name, stranger_new.name])


_FORKER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import casstore
    from casstore._fs import Staging
    s = casstore.open(sys.argv[1])
    st = Staging(Path(sys.argv[1]) / "tmp", "obj")
    st.write(b"parent's data")
    pid = os.fork()
    if pid == 0:
        # the child inherits the Staging object: abort, context exit and sweeps must not touch it
        st.abort()
        with Staging(Path(sys.argv[1]) / "tmp", "obj") as mine:
            mine.write(b"child's own")
        casstore.open(sys.argv[1]).sweep_tmp()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    print(st.path.exists(), sorted(os.listdir(Path(sys.argv[1]) / "tmp")) == [st.path.name])
    d = s.put(b"after fork")
    st.abort()
    print(os.listdir(Path(sys.argv[1]) / "tmp"), s.get(d) == b"after fork")
""")


def test_forked_child_never_removes_parents_staging_file(store: casstore.Store) -> None:
    r = run_py(_FORKER, str(store.root))
    assert r.stdout.split("\n")[:2] == ["True True", "[] True"]


def test_killed_put_many_leaves_only_whole_objects(tmp_path: Path) -> None:
    """SIGKILL during a large put_many (many renames per batch): whatever is visible is whole."""
    root = tmp_path / "s"
    casstore.open(root)
    code = """
        import os, sys, random, casstore
        s = casstore.open(sys.argv[1])
        rng = random.Random(int(sys.argv[2]))
        while True:
            s.put_many([rng.randbytes(rng.randrange(1, 200_000)) for _ in range(64)], compress=rng.random() < 0.5)
            print("batch", flush=True)
    """
    rng = random.Random()
    survivors: List[str] = []
    for seed in range(3):
        p = subprocess.Popen([PYTHON, "-c", textwrap.dedent(code), str(root), str(seed)], stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "batch"  # one batch is in
        time.sleep(rng.random() * 0.5)
        p.send_signal(signal.SIGKILL)
        p.wait()
        names = assert_all_objects_valid(root)
        assert set(survivors) <= set(names)
        survivors = names
    assert survivors, "nothing was published in any trial"
    casstore.open(root)
    assert tmp_files(root) == []
    s = casstore.open(root)
    assert sorted(str(d) for d in s.iter_objects()) == sorted(set(survivors))


def test_start_times_tell_processes_apart() -> None:
    # the sweep's pid-reuse check relies on /proc/<pid>/stat start times
    assert sys.platform.startswith("linux")
    a = _fs._start_time(os.getpid())
    p = subprocess.Popen(["sleep", "5"])
    try:
        b = _fs._start_time(p.pid)
        assert a and b and b >= a
    finally:
        p.kill()
        p.wait()
    assert _fs._start_time(p.pid) is None


# -- durability: data and directory entry are on disk before put returns ------

_TRACE = r'''
import io, json, os, sys
import casstore
import casstore._fs as fs_mod
import casstore.objects.local as local_mod

# Instrumentation only: every call goes through to the real system call.
events = []
real_fsync, real_rename, real_syncfs = os.fsync, os.rename, fs_mod.syncfs

def where(fd):
    try:
        return os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return "?"

def fsync(fd):
    path = where(fd)
    real_fsync(fd)
    events.append(["fsync", path])

def rename(a, b):
    real_rename(a, b)
    events.append(["rename", os.path.realpath(a), os.path.realpath(b)])

def syncfs(p):
    real_syncfs(p)
    events.append(["syncfs", os.path.realpath(p)])

os.fsync, os.rename = fsync, rename
fs_mod.syncfs = local_mod.syncfs = syncfs

root, method, how = sys.argv[1:4]
kw = {"durable": False} if how == "open-false" else {}
if how == "created-false":
    casstore.open(root, durable=False)  # the setting is stored in store.toml
elif how == "open-false":
    assert casstore.open(root).durable  # a durable store, opened with durable=False for this session
s = casstore.open(root, **kw)
text = b"durable text %d\n" * 20000
rand = os.urandom(300_000)
src = os.path.join(os.path.dirname(root), "src.bin")
events.clear()
if method == "put":
    ds = [s.put(rand)]
elif method == "put-zstd":
    ds = [s.put(text, compress=True)]
elif method == "put_path":
    open(src, "wb").write(rand)
    events.clear()
    ds = [s.put_path(src)]
elif method == "put_path-zstd":
    open(src, "wb").write(text)
    events.clear()
    ds = [s.put_path(src, compress=True)]
elif method == "put_stream":
    ds = [s.put_stream(io.BytesIO(rand))]
elif method == "put_stream-zstd":
    ds = [s.put_stream(io.BytesIO(text), compress=True)]
elif method == "put_many":
    ds = s.put_many([rand, text, os.urandom(1000)], compress=True)
events.append(["return"])
files = []
for d in ds:
    for suffix in ("", ".zst"):
        p = os.path.join(s.root, "objects", d.hex[:2], d.hex[2:] + suffix)
        if os.path.exists(p):
            files.append(os.path.realpath(p))
print(json.dumps({"files": files, "events": events, "objects": os.path.realpath(os.path.join(s.root, "objects"))}))
'''

_SINGLE = ["put", "put-zstd", "put_path", "put_path-zstd", "put_stream", "put_stream-zstd"]


@pytest.mark.parametrize("method", _SINGLE)
def test_put_fsyncs_data_then_directory_before_returning(method: str, tmp_path: Path) -> None:
    r = run_py(_TRACE, str(tmp_path / "s"), method, "default")
    doc = json.loads(r.stdout.splitlines()[-1])
    ev = [tuple(e) for e in doc["events"]]
    (obj,) = doc["files"]
    assert obj.endswith(".zst") == method.endswith("zstd")
    ret = ev.index(("return",))
    (r_i,) = [i for i, e in enumerate(ev) if e[0] == "rename" and e[2] == obj]
    staged = ev[r_i][1]
    assert os.path.dirname(staged) == os.path.realpath(tmp_path / "s" / "tmp")
    # the staged data was fsynced (completed) before it became visible under its name
    assert any(e == ("fsync", staged) for e in ev[:r_i]), ev
    # the new directory entry was fsynced after the rename and before put returned
    assert ("fsync", os.path.dirname(obj)) in ev[r_i + 1 : ret], ev
    # the fan-out directory was new: its creation was made durable too (fsync of objects/)
    assert ("fsync", doc["objects"]) in ev[:r_i], ev


def test_put_many_syncs_filesystem_before_and_after_renames(tmp_path: Path) -> None:
    r = run_py(_TRACE, str(tmp_path / "s"), "put_many", "default")
    doc = json.loads(r.stdout.splitlines()[-1])
    ev = [tuple(e) for e in doc["events"]]
    assert len(doc["files"]) == 3
    ret = ev.index(("return",))
    renames = [i for i, e in enumerate(ev) if e[0] == "rename"]
    assert sorted(ev[i][2] for i in renames) == sorted(doc["files"])
    syncs = [i for i, e in enumerate(ev) if e[0] in ("syncfs", "fsync")]
    assert any(i < min(renames) for i in syncs), ev  # data durable before any becomes visible
    assert any(max(renames) < i < ret for i in syncs), ev  # names durable before returning


@pytest.mark.parametrize("how", ["open-false", "created-false"])
@pytest.mark.parametrize("method", [*_SINGLE, "put_many"])
def test_durable_false_skips_syncs(method: str, how: str, tmp_path: Path) -> None:
    r = run_py(_TRACE, str(tmp_path / "s"), method, how)
    doc = json.loads(r.stdout.splitlines()[-1])
    ev = [tuple(e) for e in doc["events"]]
    assert doc["files"]
    assert [e for e in ev if e[0] in ("fsync", "syncfs")] == []
    assert any(e[0] == "rename" for e in ev)  # still published by rename
