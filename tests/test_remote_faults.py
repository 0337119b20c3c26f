"""Crashes and outages against a real SeaweedFS: pushes and pulls SIGKILLed midway are simply
run again (only what is missing moves, the remote never has a ref to a missing object, the local
store never has a half-written object), and a server that dies mid-transfer gives a bounded
BackendError.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import _seaweed
import msgpack
import pytest
from _seaweed import BUCKET, check_remote_consistent, remote_listing, run_py, start_seaweed

import casstore
import casstore._faults

# Fixtures shared by every remote test module (one SeaweedFS server per session).
aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

KILL_AFTER = r"""
import os, signal, sys
import casstore, casstore._faults
root, url, endpoint, op, point, n = sys.argv[1:7]
store = casstore.open(root)
rem = casstore.Remote(url, endpoint_url=endpoint, workers=4, progress=False)
seen = [0]
def hook(p):
    if p == "remote." + point:
        seen[0] += 1
        if seen[0] >= int(n):
            os.kill(os.getpid(), signal.SIGKILL)
casstore._faults.hook = hook
getattr(store, op)(rem, "h")
print("finished without being killed")
"""


def kill_after(store: casstore.Store, remote: casstore.Remote, endpoint: str, op: str, point: str,
               n: int) -> None:
    r = subprocess.run([sys.executable, "-c", KILL_AFTER, str(store.root), remote.url, endpoint, op, point, str(n)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)


def object_keys(seaweed: Any, remote: casstore.Remote) -> Dict[str, int]:
    return {k: v for k, v in remote_listing(seaweed.client(), remote.url).items() if "/objects/" in k}


def ref_keys(seaweed: Any, remote: casstore.Remote) -> List[str]:
    return [k for k in remote_listing(seaweed.client(), remote.url) if "/refs/" in k]


def make_head(store: casstore.Store, n: int, size: int = 20_000, versions: int = 1) -> None:
    for v in range(versions):
        with store.edit("h") as m:
            for i in range(n if v == 0 else 1):
                m[f"v{v}-k{i}"] = store.put(os.urandom(size))


def test_push_killed_midway_then_rerun_uploads_only_missing(tmp_path: Path, remote: casstore.Remote,
                                                            seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    make_head(a, 60)
    kill_after(a, remote, seaweed.endpoint, "push", "object-uploaded", 15)
    # A PUT whose body was sent before the SIGKILL may still complete on the server: let such
    # requests land before listing (a loaded CI machine once listed 15 and then found 16).
    time.sleep(1.0)
    there = object_keys(seaweed, remote)
    assert 15 <= len(there) < 61
    assert ref_keys(seaweed, remote) == []  # objects first, ref last
    # A PUT cut off by the kill may also leave a short object behind (SeaweedFS kept a 0-byte one
    # under CI load): the rerun replaces it (objects/s3.py, put_content), so it is not "present".
    whole = [k for k, size in there.items() if size == a.stat(k.rsplit("/objects/", 1)[1].replace("/", "")
                                                              .split(".")[0]).stored_size]
    assert len(there) - len(whole) <= 1  # at most the one PUT in flight
    remote.requests.clear()
    rep = a.push(remote, "h")
    assert rep.objects == 61 - len(whole) and rep.present == len(whole)
    # The missing objects, then the ref (+ the push marker); a short one costs its create-only PUT
    # (refused: the key exists) and the replacing one.
    assert remote.requests["PutObject"] == rep.objects + 2 + (len(there) - len(whole))
    assert check_remote_consistent(seaweed.client(), remote.url) == {"heads/h": str(a.heads()["h"])}


def test_push_killed_before_refs_and_history_order(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    make_head(a, 10, versions=6)  # 10 + 5 content objects, 6 versions
    kill_after(a, remote, seaweed.endpoint, "push", "object-uploaded", 15 + 3)  # mid-history
    client = seaweed.client()
    there = object_keys(seaweed, remote)
    assert ref_keys(seaweed, remote) == []
    # A version on the remote implies its ancestors are there too (uploaded oldest first).
    versions = [m.digest for m in a.history("h")]
    present = [v for v in versions if remote.objects.key(v) in there]
    assert 0 < len(present) < len(versions)
    for v in present:
        doc = msgpack.unpackb(client.get_object(Bucket=BUCKET, Key=remote.objects.key(v))["Body"].read())
        if doc["parent"] is not None:
            assert remote.objects.key(casstore.Digest.from_bytes(doc["parent"])) in there
    kill_after(a, remote, seaweed.endpoint, "push", "before-refs", 1)
    assert len(object_keys(seaweed, remote)) == 21 and ref_keys(seaweed, remote) == []
    remote.requests.clear()
    rep = a.push(remote, "h")
    assert rep.objects == 0 and remote.requests["PutObject"] == 2  # the ref and the push marker
    check_remote_consistent(client, remote.url)


def test_push_killed_from_outside_at_a_random_moment(tmp_path: Path, remote: casstore.Remote,
                                                     seaweed: Any, caplog: Any) -> None:
    a = casstore.open(tmp_path / "a", durable=False)
    make_head(a, 300, size=16_000)
    code = ("import sys, casstore; s = casstore.open(sys.argv[1]); "
            "s.push(casstore.Remote(sys.argv[2], endpoint_url=sys.argv[3], workers=2, progress=False), 'h')")
    p = subprocess.Popen([sys.executable, "-c", code, str(a.root), remote.url, seaweed.endpoint],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(object_keys(seaweed, remote)) < 40:
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    there = object_keys(seaweed, remote)
    assert len(there) < 301 and ref_keys(seaweed, remote) == []
    check_remote_consistent(seaweed.client(), remote.url)  # no ref: nothing may point at anything missing
    # Only a key that holds its object's whole size counts as there: a PUT cut off by the kill that the
    # server kept anyway would be replaced (seen once in a loaded full run: 56 present of 57 keys).
    sizes = {remote.objects.key(d): a.stat(d).size for d in a.iter_objects()}
    whole = [k for k, size in there.items() if sizes.get(k) == size]
    remote.requests.clear()
    caplog.clear()
    rep = a.push(remote, "h")
    # An upload in flight at the kill may still have landed after the snapshot above -- whole, or cut
    # short (CI: a 0-byte key that appeared after the snapshot): the push's create-only PUT then
    # finds the key, its HEAD shows the wrong size, and a second PUT replaces it (one warning each).
    assert rep.present >= len(whole) and rep.present + rep.objects == 301, (there, whole)
    replaced = sum("replacing it" in r.getMessage() for r in caplog.records)
    assert remote.requests["PutObject"] == rep.objects + 2 + replaced  # + the push marker
    check_remote_consistent(seaweed.client(), remote.url)


def test_pull_killed_midway_leaves_only_whole_objects(tmp_path: Path, remote: casstore.Remote,
                                                      seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a", durable=False)
    make_head(a, 400, size=5000)
    a.push(remote, "h")
    b = casstore.open(tmp_path / "b")
    kill_after(b, remote, seaweed.endpoint, "pull", "object-downloaded", 100)
    b = casstore.open(tmp_path / "b")  # opening sweeps the dead puller's staging files
    assert b.heads() == {}
    assert os.listdir(b.root / "tmp") == []
    have = list(b.iter_objects())
    assert a.heads()["h"] in have and len(have) < 401
    for d in have:
        b.get(d)  # every published object is whole and verifies
    rep = b.pull(remote, "h")
    assert rep.present == len(have) - 1 and rep.objects == 401 - len(have)
    assert dict(b.manifest("h")) == dict(a.manifest("h"))


def test_server_dies_mid_transfer_bounded_backend_error(tmp_path: Path) -> None:
    srv = start_seaweed()
    try:
        rem = casstore.Remote("s3://dying/x", endpoint_url=srv.endpoint, name="dying", workers=2,
                              connect_timeout=1, read_timeout=3, progress=False)
        rem.create_bucket()
        a = casstore.open(tmp_path / "a", durable=False)
        make_head(a, 300, size=8000)
        a.push(rem, "h")
        b = casstore.open(tmp_path / "b")
        seen = [0]

        def hook(point: str) -> None:
            if point == "remote.object-downloaded":
                seen[0] += 1
                if seen[0] == 1:  # the other downloads are queued or in flight
                    srv.proc.send_signal(signal.SIGKILL)
                    srv.proc.wait()

        casstore._faults.hook = hook
        t = time.monotonic()
        try:
            with pytest.raises(casstore.BackendError, match="remote 'dying'.*unreachable"):
                b.pull(rem, "h")
        finally:
            casstore._faults.hook = None
        assert time.monotonic() - t < 30
        assert b.heads() == {} and os.listdir(b.root / "tmp") == []
        for d in b.iter_objects():
            b.get(d)
        with pytest.raises(casstore.BackendError, match="unreachable"):
            with a.edit("h") as m:
                m["new"] = a.put(b"more")
            a.push(rem, "h")
    finally:
        srv.stop()


def test_run_py_helper_sees_credentials(seaweed: Any, remote_url: str) -> None:
    """Child processes get the test credentials from the environment (the usual AWS way)."""
    r = run_py("import sys, casstore; r = casstore.Remote(sys.argv[1] if len(sys.argv) > 1 else "
               f"{remote_url!r}, endpoint_url={seaweed.endpoint!r}); print(r.refs.read('heads', 'none'))")
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
