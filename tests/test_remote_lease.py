"""The S3 lease primitive (casstore/refs/s3lease.py) against a real SeaweedFS: take, beat, release, take over.

Racing takeovers run in separate processes released together at the
compare-and-swap (a go file), so the server alone picks the winner.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List

import _seaweed
import pytest

import casstore
from casstore.refs import s3lease
from casstore.refs.s3lease import MAX_TTL, LeaseRecord, S3Lease, lease_key

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url


def lease(rem: casstore.Remote, name: str = "step", what: str = "") -> S3Lease:
    return S3Lease(rem.connection, rem.prefix, name, what=what)


def test_create_only_one_of_two_takes_a_free_lease(remote: casstore.Remote) -> None:
    a, b = lease(remote, what="a"), lease(remote, what="b")
    assert a.try_acquire(10.0) is None and a.held
    view = b.try_acquire(10.0)
    assert view is not None and not view.expired and not b.held
    assert view.record is not None and view.record.what == "a"
    assert a.release() and not a.held
    assert remote.connection.head(a.key) is None
    assert b.try_acquire(10.0) is None  # free again: created anew
    assert b.release()


def test_beats_change_the_etag_and_keep_a_live_holder(remote: casstore.Remote) -> None:
    a, b = lease(remote), lease(remote)
    assert a.try_acquire(2.0) is None  # beats every 0.5 s; 2 s of slack on a busy 2-core machine
    a.start_beats()
    try:
        etags = set()
        t = time.monotonic()
        while time.monotonic() - t < 5.0:  # over two ttls: the holder must never look expired
            view = b.try_acquire(2.0)
            assert view is not None and not view.expired, view
            etags.add(view.etag)
            time.sleep(0.1)
        assert len(etags) >= 5  # a beat every ttl/4
        assert not a.lost
    finally:
        assert a.release()


def test_dead_holder_taken_over_by_cas_and_the_old_holder_learns_it(remote: casstore.Remote) -> None:
    dead, waiter = lease(remote, what="dead"), lease(remote, what="waiter")
    assert dead.try_acquire(1.0) is None  # never beats: a SIGKILLed holder
    t = time.monotonic()
    while True:
        view = waiter.try_acquire(1.0)
        if view is None:
            break
        assert time.monotonic() - t < 10, "never taken over"
        time.sleep(0.1)
    assert time.monotonic() - t >= 1.0  # only after one ttl of silence, judged on the waiter's own clock
    # The old holder wakes up: its beat is refused, it knows, and its release removes nothing.
    assert not dead.renew() and dead.lost
    assert not dead.release()
    got = remote.connection.get(waiter.key)
    assert got is not None
    rec = LeaseRecord.decode(got.data)
    assert rec is not None and rec.what == "waiter"
    assert waiter.release()


RACER = r"""
import json, os, sys, time
import casstore
from casstore.refs.s3lease import S3Lease
url, endpoint, ready, go = sys.argv[1:5]
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False)
lease = S3Lease(rem.connection, rem.prefix, "step", what=f"racer {os.getpid()}")
t = time.monotonic()
while True:  # watch the dead holder's lease until this process judges it expired
    v = lease.observe()
    if v is not None and v.expired:
        break
    if time.monotonic() - t > 60:
        raise SystemExit("never expired")
    time.sleep(0.05)
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.0005)
won = lease.try_acquire(1.0) is None
if won:
    lease.start_beats()
    time.sleep(3.0)  # hold it, beating: the losers must not take it over meanwhile
    ok = lease.release()
else:
    ok = True
print(json.dumps({"won": won, "released": ok, "lost": lease.lost}))
"""


def test_racing_takeovers_of_one_expired_lease_only_one_wins(tmp_path: Path, remote: casstore.Remote,
                                                             seaweed: Any) -> None:
    dead = lease(remote, what="dead")
    assert dead.try_acquire(1.0) is None  # and it never beats again
    go = tmp_path / "go"
    readies = [tmp_path / f"ready-{i}" for i in range(4)]
    procs: List[subprocess.Popen[str]] = [
        subprocess.Popen([sys.executable, "-c", RACER, remote.url, seaweed.endpoint, str(r), str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in readies]
    try:
        deadline = time.monotonic() + 90
        while not all(r.exists() for r in readies):
            for p in procs:
                assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        go.touch()
        out = []
        for p in procs:
            so, se = p.communicate(timeout=60)
            assert p.returncode == 0, se
            out.append(json.loads(so.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sum(o["won"] for o in out) == 1, out
    winner = next(o for o in out if o["won"])
    assert winner["released"] and not winner["lost"], out  # nobody took it from the live winner
    assert remote.connection.head(lease_key(remote.prefix, "step")) is None


def test_absurd_ttl_is_capped(remote: casstore.Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    for ttl in (1e300, float("inf"), "inf", -5, 0):
        body = json.dumps({"casstore": "casstore.lease", "v": 1, "host": "h", "pid": 1, "token": "t",
                           "ttl": ttl, "beat": 0, "what": "", "written": 0}).replace("Infinity", "1e999")
        rec = LeaseRecord.decode(body.encode())
        if isinstance(ttl, str):
            assert rec is None  # a ttl of the wrong type: not a record, so expired
        else:
            assert rec is not None and rec.ttl == MAX_TTL
    # A record claiming to be valid for ages is taken over after MAX_TTL without a beat (here made 1 s).
    monkeypatch.setattr(s3lease, "MAX_TTL", 1.0)
    key = lease_key(remote.prefix, "step")
    body = json.dumps({"casstore": "casstore.lease", "v": 1, "host": "h", "pid": 1, "token": "t", "ttl": 1e12,
                       "beat": 0, "what": "forever", "written": 4e12}).encode()
    assert remote.connection.put(key, body, create_only=True) is not None
    w = lease(remote)
    t = time.monotonic()
    while w.try_acquire(1.0) is not None:
        assert time.monotonic() - t < 10
        time.sleep(0.1)
    assert 1.0 <= time.monotonic() - t < 5
    assert w.release()


def test_huge_lease_object_is_read_bounded(remote: casstore.Remote) -> None:
    key = lease_key(remote.prefix, "step")
    assert remote.connection.put(key, b"x" * (8 << 20), create_only=True) is not None
    before = remote.connection.requests.copy()
    w = lease(remote)
    view = w.observe()
    assert view is not None and view.record is None and view.expired
    assert w.try_acquire(1.0) is None  # taken over at once, by compare-and-swap on its ETag
    assert remote.connection.requests["GetObject"] - before["GetObject"] <= 3
    assert w.release()


def test_bad_ttl_argument_is_refused(remote: casstore.Remote) -> None:
    with pytest.raises(casstore.InvalidInputError):
        lease(remote).try_acquire(0.0)
    with pytest.raises(casstore.InvalidInputError):
        lease(remote).try_acquire(float("nan"))
    with pytest.raises(casstore.InvalidInputError):
        S3Lease(remote.connection, remote.prefix, "../x")
