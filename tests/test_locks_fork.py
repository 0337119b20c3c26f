"""A child forked while a casstore lock is held never keeps that lock alive.

Hazard: flock belongs to the open file description, which fork() shares.  A
DataLoader worker or pool process started inside ``store.edit()`` (or inside
a ``derive`` fn) would otherwise keep the name locked after its parent left
the block -- or after the parent was SIGKILLed -- so "the kernel frees the
lock of a dead holder" would silently stop being true.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import casstore

OTHER = """
import sys, time, casstore
s = casstore.open(sys.argv[1])
t = time.monotonic()
with s.edit("exp", timeout=3) as m:
    m["b"] = s.put(b"y")
print(f"{time.monotonic() - t:.2f}")
"""


def _edit_elsewhere(root: Path) -> float:
    """Edit ``exp`` from a fresh process; return how long taking the lock took."""
    r = subprocess.run([sys.executable, "-c", OTHER, str(root)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr  # a LockTimeout here is the bug
    return float(r.stdout.strip())


def _reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def test_child_forked_inside_edit_does_not_keep_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "store"
    s = casstore.open(root)
    with s.edit("exp") as m:
        m["a"] = s.put(b"x")
        child = os.fork()
        if child == 0:  # a worker pool started inside the block, outliving it
            time.sleep(30)
            os._exit(0)
    try:
        assert _edit_elsewhere(root) < 1.0
        assert sorted(s.manifest("exp")) == ["a", "b"]
    finally:
        _reap(child)


def test_killed_editor_with_a_live_forked_child_frees_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "store"
    casstore.open(root)
    r, w = os.pipe()
    editor = os.fork()
    if editor == 0:
        os.close(r)
        s = casstore.open(root)
        with s.edit("exp") as m:
            m["a"] = s.put(b"x")
            worker = os.fork()
            if worker == 0:
                time.sleep(30)
                os._exit(0)
            os.write(w, str(worker).encode())
            os.close(w)
            os.kill(os.getpid(), signal.SIGKILL)  # the editor crashes mid-edit
        os._exit(1)  # pragma: no cover
    os.close(w)
    worker = int(os.read(r, 32) or b"0")
    os.close(r)
    os.waitpid(editor, 0)
    try:
        os.kill(worker, 0)  # the worker is alive, holding a copy of the editor's descriptors
        assert _edit_elsewhere(root) < 1.0
        s = casstore.open(root)
        assert sorted(s.manifest("exp")) == ["b"]  # the killed edit never committed
    finally:
        _reap(worker)
