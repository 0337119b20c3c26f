"""Derive once across machines (issue 14): real processes, separate stores, one SeaweedFS remote.

A "machine" is a local store directory used by its own OS processes; machines
share nothing but the remote (no directory, no lock).  ``fn`` appends one line
to a counter file outside every store (``O_APPEND``: one ``write`` per call,
so lines from racing processes never mix) when it starts, so the file's line
count is how many times it ran, summed over every process of every machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import _seaweed
import blake3
import pytest

import casstore
from casstore.refs.s3lease import S3Lease, lease_key

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

INPUT = b"raw dataset bytes " * 1000

# One deriving process.  argv: store root, counter file, go file (or "-"), timeout, name.
# fn's sleep comes from the environment so every process runs the *same* code (same fingerprint).
WORKER = r"""
import json, os, sys, time
from pathlib import Path
import casstore
root, counter, go, timeout, name = sys.argv[1:6]
store = casstore.open(root)
gz = store.put(os.environ["DERIVE_INPUT"].encode() * 1000)

def build(inputs, out):
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{os.getpid()} {root}\n".encode())
    os.close(fd)
    time.sleep(float(os.environ.get("DERIVE_SLEEP", "0")))
    data = inputs["raw.bin"].read_bytes()
    (out / "sub").mkdir()
    (out / "processed.bin").write_bytes(data[::-1])
    (out / "sub" / "n.txt").write_text(str(len(data)))

if go != "-":
    t = time.monotonic()
    while not os.path.exists(go):
        if time.monotonic() - t > 60:
            raise SystemExit("no go")
        time.sleep(0.001)
t0 = time.monotonic()
try:
    man = store.derive(name, inputs={"raw.bin": gz}, fn=build, params={"k": 1}, timeout=float(timeout),
                       remote="origin")
except casstore.CasstoreError as e:
    print(json.dumps({"ok": False, "error": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}))
    raise SystemExit(0)
entries = {k: str(e.digest) for k, e in man.items()}
for k, e in man.items():
    store.get(e.digest)  # verified read: the bytes are really here
print(json.dumps({"ok": True, "version": str(man.digest), "entries": entries, "seconds": time.monotonic() - t0}))
"""


def machine(tmp: Path, i: int, remote: casstore.Remote, endpoint: str) -> Path:
    root = tmp / f"machine-{i}"
    s = casstore.open(root)
    s.add_remote("origin", remote.url, endpoint_url=endpoint)
    return root


def start(root: Path, counter: Path, go: Optional[Path], *, timeout: float = 30.0, sleep: float = 0.0,
          name: str = "ds/processed") -> subprocess.Popen[str]:
    env = dict(os.environ, DERIVE_SLEEP=str(sleep), DERIVE_INPUT="raw dataset bytes ")
    return subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(counter), str(go) if go else "-",
                             str(timeout), name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result(p: subprocess.Popen[str], timeout: float = 120) -> Dict[str, Any]:
    try:
        so, se = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all([p])
        raise
    assert p.returncode == 0, se[-3000:]
    return dict(json.loads(so.strip().splitlines()[-1]))


def runs(counter: Path) -> List[str]:
    return counter.read_text().splitlines() if counter.exists() else []


def kill_all(procs: List[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def expected_entries(tmp: Path) -> Dict[str, str]:
    """What fn makes from INPUT, computed by a plain local derive in a separate store."""
    s = casstore.open(tmp / "reference")
    gz = s.put(INPUT)

    def build(inputs: Dict[str, Path], out: Path) -> None:
        data = inputs["raw.bin"].read_bytes()
        (out / "sub").mkdir()
        (out / "processed.bin").write_bytes(data[::-1])
        (out / "sub" / "n.txt").write_text(str(len(data)))

    return {k: str(e.digest) for k, e in s.derive("ref", inputs={"raw.bin": gz}, fn=build).items()}


def test_four_processes_on_two_machines_run_fn_once(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    roots = [machine(tmp_path, i, remote, seaweed.endpoint) for i in range(2)]
    counter, go = tmp_path / "runs", tmp_path / "go"
    procs = [start(roots[i % 2], counter, go, sleep=1.0) for i in range(4)]
    try:
        time.sleep(1.5)  # every interpreter has imported casstore and boto3
        go.touch()
        res = [result(p) for p in procs]
    finally:
        kill_all(procs)
    assert all(r["ok"] for r in res), res
    assert len(runs(counter)) == 1, runs(counter)
    assert len({r["version"] for r in res}) == 1, res  # the very same version, on both machines
    assert res[0]["entries"] == expected_entries(tmp_path)
    # The result is on the remote under the same name, complete; the lease is gone.
    assert _seaweed.check_remote_consistent(seaweed.client(), remote.url) == {"heads/ds/processed": res[0]["version"]}
    assert remote.connection.head(lease_key(remote.prefix, "ds/processed")) is None


def test_three_machines_result_identical_everywhere(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    roots = [machine(tmp_path, i, remote, seaweed.endpoint) for i in range(3)]
    counter, go = tmp_path / "runs", tmp_path / "go"
    procs = [start(r, counter, go, sleep=0.5) for r in roots]
    try:
        time.sleep(1.5)
        go.touch()
        res = [result(p) for p in procs]
    finally:
        kill_all(procs)
    assert len(runs(counter)) == 1, runs(counter)
    assert len({r["version"] for r in res}) == 1, res
    # Byte-identical files on every machine.
    files = []
    for r in roots:
        s = casstore.open(r, create=False)
        files.append({k: s.get(e.digest) for k, e in s.manifest("ds/processed").items()})
    assert files[0] == files[1] == files[2]
    assert files[0]["processed.bin"] == INPUT[::-1]


def test_result_already_on_the_remote_is_pulled_not_computed(tmp_path: Path, remote: casstore.Remote,
                                                             seaweed: Any) -> None:
    a, b = (machine(tmp_path, i, remote, seaweed.endpoint) for i in range(2))
    counter = tmp_path / "runs"
    first = result(start(a, counter, None))
    assert len(runs(counter)) == 1
    second = result(start(b, counter, None))
    assert len(runs(counter)) == 1, "machine b computed instead of pulling"
    assert second["version"] == first["version"] and second["entries"] == first["entries"]
    sb = casstore.open(b, create=False)
    assert sb.heads()["ds/processed"] == casstore.Digest.parse(first["version"])
    meta = sb.manifest("ds/processed").meta["derive"]
    assert isinstance(meta, dict) and meta["by"] != ""  # the record of the machine that made it


def test_holder_killed_mid_compute_another_takes_over(tmp_path: Path, remote: casstore.Remote,
                                                      seaweed: Any) -> None:
    roots = [machine(tmp_path, i, remote, seaweed.endpoint) for i in range(3)]
    counter = tmp_path / "runs"
    ttl = 3.0  # beats every 0.75 s: a live holder is never mistaken for a dead one on a busy machine
    holder = start(roots[0], counter, None, timeout=ttl, sleep=120)
    procs = [holder]
    try:
        deadline = time.monotonic() + 60
        while not runs(counter):
            assert holder.poll() is None, holder.communicate()
            assert time.monotonic() < deadline, "the holder never started fn"
            time.sleep(0.05)
        key = lease_key(remote.prefix, "ds/processed")
        assert remote.connection.head(key) is not None  # it holds the remote lease
        waiters = [start(r, counter, None, timeout=ttl, sleep=0.5) for r in roots[1:]]
        procs += waiters
        time.sleep(4.0)  # over one ttl: the waiters wait on the live (beating) holder, they do not take over
        assert len(runs(counter)) == 1, runs(counter)
        t_kill = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        res = [result(p) for p in waiters]
        took = time.monotonic() - t_kill
    finally:
        kill_all(procs)
    assert all(r["ok"] for r in res), res
    assert len(runs(counter)) == 2, runs(counter)  # the dead holder's run and one takeover, not three
    assert res[0]["version"] == res[1]["version"]
    assert res[0]["entries"] == expected_entries(tmp_path)
    assert took < 30, took  # taken over after the lease's ttl of silence, not after a long timeout
    assert _seaweed.check_remote_consistent(seaweed.client(), remote.url) == {"heads/ds/processed": res[0]["version"]}


@pytest.mark.parametrize("garbage", [b"\x00\xffnot json at all", b"{" * 5000, os.urandom(1 << 20),
                                     json.dumps({"casstore": "casstore.lease", "v": 1, "host": 7}).encode()],
                         ids=["binary", "deep-json", "one-mib", "wrong-types"])
def test_garbage_lease_is_treated_as_expired_never_a_hang(tmp_path: Path, remote: casstore.Remote, seaweed: Any,
                                                          garbage: bytes) -> None:
    key = lease_key(remote.prefix, "ds/processed")
    assert remote.connection.put(key, garbage, create_only=True) is not None
    root = machine(tmp_path, 0, remote, seaweed.endpoint)
    counter = tmp_path / "runs"
    t0 = time.monotonic()
    res = result(start(root, counter, None, timeout=5.0), timeout=60)
    assert res["ok"], res
    assert time.monotonic() - t0 < 30
    assert len(runs(counter)) == 1
    assert res["entries"] == expected_entries(tmp_path)
    assert remote.connection.head(key) is None  # our lease replaced the garbage, then was released


def test_timeout_zero_does_not_wait_for_a_live_holder(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    lease = S3Lease(remote.connection, remote.prefix, "ds/processed", what="someone else")
    assert lease.try_acquire(30.0) is None
    lease.start_beats()
    try:
        root = machine(tmp_path, 0, remote, seaweed.endpoint)
        counter = tmp_path / "runs"
        res = result(start(root, counter, None, timeout=0), timeout=60)
    finally:
        assert lease.release()
    assert not res["ok"] and res["error"] == "LockTimeout", res
    assert "someone else" in res["msg"] and "timeout=0" in res["msg"]
    assert runs(counter) == []


def test_local_hit_needs_no_remote(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    """A result already in the local store is returned without touching the remote."""
    root = machine(tmp_path, 0, remote, seaweed.endpoint)
    counter = tmp_path / "runs"
    first = result(start(root, counter, None))
    s = casstore.open(root, create=False)
    s.add_remote("origin", "s3://casstore-tests/unreachable", endpoint_url=f"http://127.0.0.1:{_seaweed.free_port()}",
                 replace=True)
    again = result(start(root, counter, None))
    assert again["ok"] and again["version"] == first["version"]
    assert len(runs(counter)) == 1


# -- fetch(url, remote=...) ------------------------------------------------------------------------

FETCHER = r"""
import json, os, sys, time
import casstore
root, url, go, sha = sys.argv[1:5]
store = casstore.open(root)
if go != "-":
    t = time.monotonic()
    while not os.path.exists(go):
        if time.monotonic() - t > 60:
            raise SystemExit("no go")
        time.sleep(0.001)
d = store.fetch(url, sha256=sha if sha != "-" else None, timeout=30, remote="origin")
print(json.dumps({"digest": str(d), "bytes": len(store.get(d))}))
"""


def fetch_proc(root: Path, url: str, go: Optional[Path], sha: str = "-") -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", FETCHER, str(root), url, str(go) if go else "-", sha],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_fetch_four_processes_on_two_machines_download_once(tmp_path: Path, remote: casstore.Remote,
                                                            seaweed: Any) -> None:
    import hashlib

    from _fetch_helpers import b3, serve

    data = os.urandom(3 << 20)
    roots = [machine(tmp_path, i, remote, seaweed.endpoint) for i in range(2)]
    go = tmp_path / "go"
    with serve() as srv:
        url = srv.add("/data.bin", data, delay=0.01)  # ~0.5 s: the others arrive while it downloads
        procs = [fetch_proc(roots[i % 2], url, go, hashlib.sha256(data).hexdigest()) for i in range(4)]
        try:
            time.sleep(1.5)
            go.touch()
            res = [result(p) for p in procs]
        finally:
            kill_all(procs)
        assert srv.count("/data.bin") == 1, srv.requests
        assert {r["digest"] for r in res} == {b3(data)}
        assert all(r["bytes"] == len(data) for r in res)
        # A third machine later: pulled from the remote, the server is not asked (its route is gone).
        del srv.routes["/data.bin"]
        late = result(fetch_proc(machine(tmp_path, 2, remote, seaweed.endpoint), url, None))
        assert late["digest"] == b3(data)
        # ... and from the command line on a fourth.
        cli = subprocess.run([sys.executable, "-m", "casstore", "--store", str(machine(tmp_path, 3, remote,
                              seaweed.endpoint)), "fetch", url, "--remote", "origin", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["digest"] == b3(data)
        assert srv.count("/data.bin") == 1


# -- in one process: the remote side's decisions ------------------------------------------------------


def _builder(calls: List[str], tag: str, fail: bool = False) -> Any:
    def build(inputs: Dict[str, Path], out: Path) -> None:
        calls.append(tag)
        if fail:
            raise RuntimeError("fn failed")
        (out / "processed.bin").write_bytes(inputs["raw.bin"].read_bytes()[::-1])

    return build


def test_local_history_of_its_own_keeps_it_and_records_the_pulled_result_on_top(
        tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(machine(tmp_path, 0, remote, seaweed.endpoint))
    b = casstore.open(machine(tmp_path, 1, remote, seaweed.endpoint))
    calls: List[str] = []
    made = a.derive("step", inputs={"raw.bin": a.put(INPUT)}, fn=_builder(calls, "a"), remote="origin")
    # b made a result of other params earlier, without the remote: a local history of its own.
    gb = b.put(INPUT)
    own = b.derive("step", inputs={"raw.bin": gb}, fn=_builder(calls, "b-local"), params={"other": 1})
    got = b.derive("step", inputs={"raw.bin": gb}, fn=_builder(calls, "b"), remote="origin")
    assert calls == ["a", "b-local"]  # pulled, not computed
    assert dict(got) == dict(made)  # the same files
    assert got.parent == own.digest  # on top of b's own history, which is kept
    pulled = got.meta["remote.pulled"]
    assert isinstance(pulled, dict) and pulled["from"] == str(made.digest)
    # Asked again: a local hit, no remote needed.
    assert b.derive("step", inputs={"raw.bin": gb}, fn=_builder(calls, "b"), remote="origin").digest == got.digest
    assert calls == ["a", "b-local"]


def test_fn_that_raises_releases_the_lease_and_records_nothing(tmp_path: Path, remote: casstore.Remote,
                                                               seaweed: Any) -> None:
    a = casstore.open(machine(tmp_path, 0, remote, seaweed.endpoint))
    b = casstore.open(machine(tmp_path, 1, remote, seaweed.endpoint))
    calls: List[str] = []
    with pytest.raises(RuntimeError, match="fn failed"):
        a.derive("step", inputs={"raw.bin": a.put(INPUT)}, fn=_builder(calls, "a", fail=True), remote="origin")
    assert remote.connection.head(lease_key(remote.prefix, "step")) is None  # released, not left to expire
    assert remote.refs.read("heads", "step") is None
    t0 = time.monotonic()
    got = b.derive("step", inputs={"raw.bin": b.put(INPUT)}, fn=_builder(calls, "b"), remote="origin", timeout=30)
    assert time.monotonic() - t0 < 5  # no waiting for a lease to expire
    assert calls == ["a", "b"] and got["processed.bin"].size == len(INPUT)
    assert remote.refs.get("heads", "step") == got.digest


def test_changed_params_compute_again_and_move_the_remote_head(tmp_path: Path, remote: casstore.Remote,
                                                               seaweed: Any) -> None:
    a = casstore.open(machine(tmp_path, 0, remote, seaweed.endpoint))
    b = casstore.open(machine(tmp_path, 1, remote, seaweed.endpoint))
    calls: List[str] = []
    first = a.derive("step", inputs={"raw.bin": a.put(INPUT)}, fn=_builder(calls, "a1"), remote="origin")
    pulled = b.derive("step", inputs={"raw.bin": b.put(INPUT)}, fn=_builder(calls, "b1"), remote="origin")
    assert pulled.digest == first.digest
    second = b.derive("step", inputs={"raw.bin": b.put(INPUT)}, fn=_builder(calls, "b2"), params={"v": 2},
                      remote="origin")
    assert calls == ["a1", "b2"]
    assert second.parent == first.digest  # a fast-forward of the remote head: history kept there too
    assert remote.refs.get("heads", "step") == second.digest
    again = a.derive("step", inputs={"raw.bin": a.put(INPUT)}, fn=_builder(calls, "a2"), params={"v": 2},
                     remote="origin")
    assert again.digest == second.digest and calls == ["a1", "b2"]


def test_damaged_remote_head_is_a_typed_error(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(machine(tmp_path, 0, remote, seaweed.endpoint))
    remote.connection.put(f"{remote.prefix}refs/heads/step", b"not a digest at all\n")
    with pytest.raises(casstore.StoreFormatError):
        a.derive("step", inputs={"raw.bin": a.put(INPUT)}, fn=_builder([], "a"), remote="origin", timeout=5)
    # A head naming a version that is no manifest: refused by the decoder, nothing computed or pulled.
    d = casstore.Digest.parse("blake3:" + blake3.blake3(b"junk").hexdigest())
    remote.objects.write(d, b"junk")
    remote.connection.put(f"{remote.prefix}refs/heads/step", f"{d}\n".encode())
    calls: List[str] = []
    with pytest.raises(casstore.StoreFormatError):
        a.derive("step", inputs={"raw.bin": a.put(INPUT)}, fn=_builder(calls, "a"), remote="origin", timeout=5)
    assert calls == []
