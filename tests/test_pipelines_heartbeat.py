"""Lock heartbeats (issue 13): a waiter never times out on a live, beating producer; it does on a stalled
or dead one, and the LockTimeout says which.  Real processes: SIGSTOP makes a stalled holder, a child that
inherited the locked descriptor keeps the lock of a dead one.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, List

import pytest
from _fetch_helpers import (
    SPAWN,
    clean_settings_env,
    dead_holder,
    derive_job_worker,
    results,
    sleepy_fn,
    wait_until,
)
from conftest import held_elsewhere

import casstore
from casstore._lock import read_holder
from casstore.errors import LockTimeout


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


def runs(counter: Path) -> List[str]:
    return counter.read_text().split()


def _producer(root: Path, name: str, src: str, counter: Path, seconds: float, lock_timeout: str) -> Any:
    q = SPAWN.Queue()
    fn = functools.partial(sleepy_fn, str(counter), seconds)
    p = SPAWN.Process(target=derive_job_worker,
                      args=(str(root), name, src, fn, None, q, {"CASSTORE_LOCK_TIMEOUT": lock_timeout}))
    p.start()
    wait_until(lambda: len(runs(counter)) == 1, timeout=60, what="the producer to start fn")
    return p, q, fn


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    root = tmp_path / "store"
    store = casstore.open(root, durable=False)
    src = str(store.put(os.urandom(10_000)))
    counter = tmp_path / "runs.txt"
    counter.touch()
    return root, store, src, counter


def test_waiter_outlives_a_producer_that_beats(setup: Any) -> None:
    root, store, src, counter = setup
    # lock_timeout 1 s (beats every 0.25 s: a quarter of it), work 3.5 s; a loaded test machine may
    # delay a beat by a fraction of a second, never by the 1 s that would declare a stall.
    producer, q, fn = _producer(root, "long/step", src, counter, 3.5, "1")
    try:
        holder = read_holder(store.refs.lock("long/step").path)
        assert holder is not None and holder.pid == producer.pid and holder.host == socket.gethostname()
        assert holder.every == 0.25 and "long/step" in holder.what  # a quarter of its lock_timeout
        t0 = time.monotonic()
        m = store.derive("long/step", inputs={"src": src}, fn=fn, timeout=1.0)
        waited = time.monotonic() - t0
        assert waited > 2.0  # it waited for the producer (a 3.5x-lock_timeout job) without timing out ...
        (_, pid, (digest, _)), = results(q, 1)
        assert runs(counter) == [str(pid)] and str(m.digest) == digest  # ... and took its result
    finally:
        producer.join(10)
    assert read_holder(store.refs.lock("long/step").path) is None  # the record is cleared at release


def test_waiter_times_out_on_a_stalled_producer(setup: Any) -> None:
    root, store, src, counter = setup
    producer, _q, fn = _producer(root, "stuck/step", src, counter, 60.0, "0.5")
    try:
        time.sleep(0.3)
        os.kill(producer.pid, signal.SIGSTOP)  # alive, but no longer beating: stalled
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as ei:
            store.derive("stuck/step", inputs={"src": src}, fn=fn, timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 10
        msg = str(ei.value)
        assert "stuck/step" in msg and "stalled" in msg and "last beat" in msg
        assert f"pid {producer.pid} on host {socket.gethostname()}" in msg
    finally:
        os.kill(producer.pid, signal.SIGKILL)
        producer.join(10)
    # The kernel dropped the dead producer's lock: the next caller runs fn itself.
    store.derive("stuck/step", inputs={"src": src}, fn=functools.partial(sleepy_fn, str(counter), 0.0))
    assert len(runs(counter)) == 2


def test_waiter_times_out_on_a_dead_holder_whose_lock_lives_on(setup: Any) -> None:
    root, store, src, counter = setup
    q = SPAWN.Queue()
    p = SPAWN.Process(target=dead_holder, args=(str(root), "orphaned", q))
    p.start()
    (_, holder_pid, sleeper), = results(q, 1)
    p.join(10)
    try:
        wait_until(lambda: not os.path.exists(f"/proc/{holder_pid}"), what="the holder to be gone")
        with pytest.raises(LockTimeout) as ei:
            store.derive("orphaned", inputs={"src": src}, fn=functools.partial(sleepy_fn, str(counter), 0.0),
                         timeout=0.3)
        msg = str(ei.value)
        assert "dead" in msg and f"pid {holder_pid} on host {socket.gethostname()} is gone" in msg
    finally:
        os.kill(sleeper, signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{sleeper}") or
                   open(f"/proc/{sleeper}/stat").read().split()[2] == "Z", what="the sleeper to die")
    assert list(store.derive("orphaned", inputs={"src": src},
                             fn=functools.partial(sleepy_fn, str(counter), 0.0))) == ["result.bin"]


def test_holders_without_heartbeat_time_out_as_before(setup: Any) -> None:
    _root, store, src, counter = setup
    with held_elsewhere(store.refs.lock("edited")):  # an edit's lock: held for milliseconds, no heartbeat record
        assert read_holder(store.refs.lock("edited").path) is None
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match="records no heartbeat"):
            store.derive("edited", inputs={"src": src}, fn=lambda i, o: None, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 3
        t0 = time.monotonic()
        with pytest.raises(LockTimeout):
            store.derive("edited", inputs={"src": src}, fn=lambda i, o: None, timeout=0)  # one try
        assert time.monotonic() - t0 < 0.5
    with store.refs.lock("beating", heartbeat=0.05) as lk:
        first = read_holder(lk.path)
        assert first is not None and first.pid == os.getpid()
        wait_until(lambda: (read_holder(lk.path) or first).beat > first.beat, timeout=5, what="a beat")
    assert read_holder(lk.path) is None
