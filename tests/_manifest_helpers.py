"""Helpers for the manifest / freeze / pin tests (tests/test_manifest_*.py).

Worker functions live here, at module level, so that ``multiprocessing``
'spawn' children can import them (tests/ is on ``sys.path`` under pytest and
spawn passes ``sys.path`` on to its children).  Nothing here mocks storage:
every helper works on a real store directory.
"""

from __future__ import annotations

import errno
import fcntl
import multiprocessing as mp
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import msgpack

import casstore
from casstore.digest import Digest
from casstore.refs import LocalRefs

SPAWN = mp.get_context("spawn")


def open_store(root: str | Path, **kw: Any) -> casstore.Store:
    return casstore.open(root, **kw)


def ref_file(root: str | Path, kind: str, name: str) -> Path:
    """Where docs/format.md puts a ref: ``<root>/refs/<kind>/<name>``."""
    return Path(root, "refs", kind, *name.split("/"))


def lock_file(root: str | Path, name: str) -> Path:
    """The lock file of a name (heads and pins alike), as the refs layer names it."""
    return LocalRefs(Path(root)).lock(name).path


def ref_text(root: str | Path, kind: str, name: str) -> Optional[str]:
    """The raw content of a ref file, or None if it does not exist (read without casstore)."""
    try:
        return ref_file(root, kind, name).read_text("ascii")
    except FileNotFoundError:
        return None


def raw_manifest_bytes(entries: Dict[Any, Any], meta: Dict[str, Any] | None = None,
                       parent: Optional[bytes] = None, v: Any = 1, **extra: Any) -> bytes:
    """Encode a manifest document by hand, following docs/format.md (not casstore's encoder)."""
    doc: Dict[str, Any] = {"casstore": "manifest", "entries": entries, "meta": meta or {}, "parent": parent, "v": v}
    doc.update(extra)
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


def canonical_packb(value: Any) -> bytes:
    """An independent canonical msgpack encoder: every map's keys in code-point order, floats as float64."""

    def norm(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: norm(v[k]) for k in sorted(v)}
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        return v

    return msgpack.packb(norm(value), use_bin_type=True, use_single_float=False)  # type: ignore[no-any-return]


def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.005) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def get_report(q: Any, timeout: float, procs: List[Any]) -> Any:
    """Next report from ``q``; fail fast if a child died without reporting."""
    import queue

    end = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise AssertionError(f"child {dead[0].pid} died with exit code {dead[0].exitcode}") from None
            if time.monotonic() > end:
                raise AssertionError(f"no report from a child within {timeout}s") from None


def wait_event(ev: Any, proc: Any, timeout: float) -> None:
    """Wait for ``ev`` set by child ``proc``; fail fast if the child exits first."""
    end = time.monotonic() + timeout
    while not ev.wait(0.1):
        if proc.exitcode is not None:
            raise AssertionError(f"child {proc.pid} exited with code {proc.exitcode} before it was ready")
        if time.monotonic() > end:
            raise AssertionError(f"child {proc.pid} not ready within {timeout}s")


def stop_process(p: Any) -> None:
    """Kill (by its own pid) and reap a multiprocessing child that is still running."""
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join(10)


# -- child-process workers ------------------------------------------------------


def writer_worker(root: str, name: str, proc: int, n: int, digest: str, q: Any) -> None:
    """Commit ``n`` edits to ``name``, each adding key ``p<proc>/k<i>``."""
    try:
        store = casstore.open(root)
        d = Digest.parse(digest)
        for i in range(n):
            with store.edit(name, timeout=120) as m:
                m[f"p{proc}/k{i}"] = d
        q.put(("ok", proc))
    except BaseException:  # report everything to the parent
        q.put(("error", traceback.format_exc()))


def reader_worker(root: str, name: str, digest: str, stop: Any, q: Any) -> None:
    """Lock-free reads of ``name`` until ``stop`` is set; report (reads, errors, sample errors)."""
    reads = 0
    errors: List[str] = []
    try:
        store = casstore.open(root)
        d = Digest.parse(digest)
        ref = ref_file(root, "heads", name)
        while not ref.exists() and not stop.is_set():  # the writers have not committed yet
            time.sleep(0.001)
        last_len = -1
        while not stop.is_set():
            try:
                try:
                    text = ref.read_text("ascii")
                except OSError as e:  # a filesystem whose renames are not atomic for readers (FUSE, NFS):
                    if e.errno not in (errno.ENOENT, errno.ESTALE):  # the ref file is only a cache there,
                        raise  # and the store.manifest() below must still find the name (refs/local.py)
                    text = f"{'blake3:' + '0' * 64}\n0\n"
                lines = text.split("\n")  # "blake3:<64 hex>\n<claim log position>\n" (docs/format.md)
                if len(lines) != 3 or len(lines[0]) != 71 or not lines[0].startswith("blake3:") \
                        or not lines[1].isdigit() or lines[2]:
                    raise AssertionError(f"torn ref file content {text!r}")
                m = store.manifest(name)
                n = 0
                for k in m:
                    e = m[k]
                    if e.digest != d or e.size != 6:
                        raise AssertionError(f"bad entry {k!r}: {e!r}")
                    n += 1
                if n != len(m) or n < last_len:
                    raise AssertionError(f"saw {n} entries after {last_len}: versions went backwards")
                last_len = n
                reads += 1
            except BaseException:
                errors.append(traceback.format_exc())
            time.sleep(0.003)  # leave the CPUs to the writers (2-core machine)
        q.put(("reader", reads, len(errors), errors[:3]))
    except BaseException:
        q.put(("reader", reads, len(errors) + 1, errors[:3] + [traceback.format_exc()]))


def lock_everything_worker(root: str, name: str, ready: Any, release: Any, everything: bool = True) -> None:
    """Hold casstore's lock of ``name`` and (``everything``) an exclusive flock on every file in the store."""
    lk = LocalRefs(Path(root)).lock(name, timeout=5)
    lk.acquire()
    fds = []
    for dirpath, _dirs, files in (os.walk(root) if everything else ()):
        for f in files:
            p = os.path.join(dirpath, f)
            if p == str(lk.path) or os.path.islink(p):  # a claim (refs/log) is a symbolic link: no file to lock
                continue
            fd = os.open(p, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fds.append(fd)
    ready.set()
    release.wait(60)
    lk.release()


def timed_read_worker(root: str, name: str, q: Any) -> None:
    """Read manifest ``name`` once (lock-free); report (elapsed, entries, meta) or the error."""
    try:
        store = casstore.open(root)
        t = time.monotonic()
        m = store.manifest(name)
        entries = {k: str(m[k].digest) for k in m}
        q.put(("ok", time.monotonic() - t, entries, dict(m.meta), m.frozen))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def _die(at: str, how: int) -> Any:
    def hook(p: str) -> None:
        if p == at:
            os.kill(os.getpid(), how)

    return hook


def faulty_edit_worker(root: str, name: str, key: str, digest: str, point: str, how: int) -> None:
    """Edit ``name`` (adding ``key``) and send ``how`` (SIGKILL/SIGSTOP) to ourselves at ``point``."""
    import casstore._faults

    store = casstore.open(root)
    casstore._faults.hook = _die(point, how)
    with store.edit(name, timeout=30) as m:
        m[key] = Digest.parse(digest)
    os._exit(3)  # only reached if the hook never fired


def looping_editor_worker(root: str, name: str, digest: str) -> None:
    """Add keys k<len>, k<len+1>, ... to ``name`` forever (until killed)."""
    store = casstore.open(root)
    d = Digest.parse(digest)
    while True:
        with store.edit(name, timeout=30) as m:
            m[f"k{len(m)}"] = d
            m.meta["n"] = len(m)


def freeze_race_editor_worker(root: str, name: str, digest: str, q: Any) -> None:
    """Edit ``name`` until it is frozen; report every committed digest and how it ended."""
    store = casstore.open(root)
    d = Digest.parse(digest)
    committed: List[str] = []
    i = 0
    try:
        while True:
            tx = store.edit(name, timeout=30)
            with tx as m:
                m[f"k{i}"] = d
            assert m.result is not None
            committed.append(str(m.result.digest))
            i += 1
    except casstore.FrozenError:
        q.put(("frozen", committed))
    except BaseException:
        q.put(("error", committed, traceback.format_exc()))


def freeze_race_reader_worker(root: str, names: List[str], current: Any, stop: Any, q: Any) -> None:
    """Read, over and over, the name another process is freezing right now (``names[current.value]``)."""
    store = casstore.open(root)
    reads = 0
    errors: List[str] = []
    while not stop.is_set():
        n = names[current.value]
        try:
            store.manifest(n)
            reads += 1
        except BaseException as e:
            errors.append(f"{n}: {type(e).__name__}: {e}")
    q.put((reads, errors[:5], len(errors)))


def proc_state(pid: int) -> str:
    """Linux process state letter from /proc (R, S, T, Z, ...)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


def history_chain(store: casstore.Store, name: str) -> Tuple[List[casstore.Manifest], List[Digest]]:
    """History of ``name`` and its digests; asserts every parent link points at the next version."""
    h = store.history(name)
    for newer, older in zip(h, h[1:], strict=False):
        assert newer.parent == older.digest
    assert h and h[-1].parent is None
    return h, [m.digest for m in h]
