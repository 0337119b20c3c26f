"""Concurrent pushes from separate processes against a real SeaweedFS: exactly one winner per ref.

Two (or more) machines pushing the same head at once must never lose a version:
the server's conditional PUT (``If-Match`` / ``If-None-Match: *``) lets exactly one
ref update through; every other pusher gets RemoteConflictError, pulls (merging)
and pushes again.  Pins are created once and never move.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import _seaweed
import pytest
from _seaweed import check_remote_consistent

import casstore

# Fixtures shared by every remote test module (one SeaweedFS server per session).
aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

# A pusher process.  With a ready file it stops right before the ref's compare-and-swap
# (after its objects are up and the ref was read) and waits for the go file: so every
# pusher read the same old ref and the server alone picks the winner.  Without one it
# waits for the go file before starting, for a free-running race.
PUSHER = r"""
import json, os, sys, time
from pathlib import Path
import casstore, casstore._faults
root, url, endpoint, name, ready, go = sys.argv[1:7]
store = casstore.open(root)
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False)
def wait_go():
    t = time.monotonic()
    while not os.path.exists(go):
        if time.monotonic() - t > 60:
            raise SystemExit("no go")
        time.sleep(0.0005)
def hook(point):
    if point == "remote.before-ref-cas":
        Path(ready).touch()
        wait_go()
if ready != "-":
    casstore._faults.hook = hook
else:
    wait_go()
try:
    rep = store.push(rem, name)
    print(json.dumps({"ok": True, "refs": rep.refs}))
except casstore.RemoteConflictError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
"""


def start_pushers(stores: List[Path], url: str, endpoint: str, name: str, tmp: Path,
                  barrier: bool) -> List[Dict[str, Any]]:
    go = tmp / f"go-{time.monotonic_ns()}"
    readies = [tmp / f"ready-{i}-{time.monotonic_ns()}" for i in range(len(stores))]
    procs = [subprocess.Popen([sys.executable, "-c", PUSHER, str(s), url, endpoint, name,
                               str(readies[i]) if barrier else "-", str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, s in enumerate(stores)]
    try:
        if barrier:
            deadline = time.monotonic() + 60
            while not all(r.exists() for r in readies):
                for p in procs:
                    assert p.poll() is None, p.communicate()
                assert time.monotonic() < deadline, "pushers never reached the compare-and-swap"
                time.sleep(0.005)
        else:
            time.sleep(1.0)  # let every interpreter import casstore and boto3 first
        go.touch()
        out = []
        for p in procs:
            so, se = p.communicate(timeout=120)
            assert p.returncode == 0, se
            out.append(json.loads(so.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def make_stores(tmp: Path, n: int, remote: casstore.Remote, name: str, *, base: bool) -> List[casstore.Store]:
    """``n`` stores; with ``base``, all start from the same remote version of ``name``, then each edits."""
    first = casstore.open(tmp / "s0")
    if base:
        with first.edit(name) as m:
            m["base"] = first.put(b"common base")
        first.push(remote, name)
    stores = [first] + [casstore.open(tmp / f"s{i}") for i in range(1, n)]
    for i, s in enumerate(stores):
        if base and i:
            s.pull(remote, name)
        with s.edit(name) as m:
            m[f"from-{i}"] = s.put(f"work of machine {i}".encode() + os.urandom(64))
    return stores


@pytest.mark.parametrize("base", [True, False], ids=["existing-head-if-match", "new-head-if-none-match"])
def test_two_processes_push_same_head_exactly_one_wins(tmp_path: Path, remote: casstore.Remote, seaweed: Any,
                                                       base: bool) -> None:
    stores = make_stores(tmp_path, 2, remote, "exp", base=base)
    res = start_pushers([s.root for s in stores], remote.url, seaweed.endpoint, "exp", tmp_path, barrier=True)
    winners = [i for i, r in enumerate(res) if r["ok"]]
    assert len(winners) == 1, res
    w, loser = winners[0], 1 - winners[0]
    assert "moved there while pushing" in res[loser]["error"] or "created" in res[loser]["error"]
    got = remote.refs.read("heads", "exp")
    assert got is not None and got.digest == stores[w].heads()["exp"]
    # The loser pulls (a three-way merge), pushes again, and nothing is lost.
    ls = stores[loser]
    assert ls.pull(remote, "exp").refs["heads/exp"].startswith("merged")
    assert ls.push(remote, "exp").refs == {"heads/exp": "fast-forward"}
    final = ls.manifest("exp")
    want = {"from-0", "from-1"} | ({"base"} if base else set())
    assert set(final) == want
    assert check_remote_consistent(seaweed.client(), remote.url) == {"heads/exp": str(final.digest)}


def test_two_processes_create_same_pin_exactly_one_wins(tmp_path: Path, remote: casstore.Remote,
                                                        seaweed: Any) -> None:
    stores = make_stores(tmp_path, 2, remote, "paper", base=False)
    pins = [s.freeze("paper") for s in stores]
    assert pins[0] != pins[1]
    res = start_pushers([s.root for s in stores], remote.url, seaweed.endpoint, "paper", tmp_path, barrier=True)
    winners = [i for i, r in enumerate(res) if r["ok"]]
    assert len(winners) == 1, res
    loser = 1 - winners[0]
    assert "pins never move" in res[loser]["error"]
    got = remote.refs.read("pins", "paper")
    assert got is not None and got.digest == pins[winners[0]]
    with pytest.raises(casstore.RemoteConflictError):
        stores[loser].push(remote, "paper")  # and it never moves later either
    got = remote.refs.read("pins", "paper")
    assert got is not None and got.digest == pins[winners[0]]


def test_free_running_race_four_processes_no_lost_version(tmp_path: Path, remote: casstore.Remote,
                                                          seaweed: Any) -> None:
    n = 4
    stores = make_stores(tmp_path, n, remote, "shared", base=True)
    res = start_pushers([s.root for s in stores], remote.url, seaweed.endpoint, "shared", tmp_path, barrier=False)
    winners = [i for i, r in enumerate(res) if r["ok"]]
    assert len(winners) == 1, res
    got = remote.refs.read("heads", "shared")
    assert got is not None and got.digest == stores[winners[0]].heads()["shared"]
    # Every loser: pull (merge), push; retry on a new conflict.  All work ends up on the remote.
    for i in range(n):
        if i in winners:
            continue
        for _ in range(5):
            stores[i].pull(remote, "shared")
            try:
                stores[i].push(remote, "shared")
                break
            except casstore.RemoteConflictError:
                continue
        else:
            pytest.fail("could not push after 5 merges")
    last = casstore.open(tmp_path / "reader")
    last.pull(remote, "shared")
    assert set(last.manifest("shared")) == {"base"} | {f"from-{i}" for i in range(n)}
    check_remote_consistent(seaweed.client(), remote.url)
