"""Remotes against a real SeaweedFS server: layout, push/pull round trips, listing economy,
create-only objects, CAS refs, pins that never move, verification on pull, merges, config and CLI.

No mocks: every test talks S3 to ``weed mini`` on 127.0.0.1 (tests/_seaweed.py).
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
import blake3
import pytest
from _seaweed import BUCKET, CallOnRequest, check_remote_consistent, free_port, remote_listing

import casstore
from casstore.sync import add_remote, get_remote, load_remotes, remove_remote

# Fixtures shared by every remote test module (one SeaweedFS server per session).
aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

MiB = 1 << 20


def b3(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def fill(store: casstore.Store, name: str, n: int, size: int = 4096, seed: int = 0) -> Dict[str, bytes]:
    """Commit ``n`` random objects to head ``name``; return key -> bytes."""
    import random

    rng = random.Random(seed)
    data = {f"k{i:04d}": rng.randbytes(size + i) for i in range(n)}
    with store.edit(name) as m:
        for k, v in data.items():
            m[k] = store.put(v)
    return data


def tmp_files(store: casstore.Store) -> List[str]:
    return sorted(os.listdir(store.root / "tmp"))


# -- round trips and layout ---------------------------------------------------------------------


def test_push_pull_round_trip_layout_and_raw_objects(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    small = os.urandom(5000)
    text = b"compress me " * 50_000  # stored zstd locally, must be raw on the remote
    big = os.urandom(20 * MiB + 123)  # multipart up and down (threshold 8 MiB in the fixture)
    with a.edit("exp-1") as m:
        m["small.bin"] = a.put(small)
        m["text.txt"] = a.put(text, compress=True)
        m["big.bin"] = a.put(big)
        m["empty"] = a.put(b"")
        m.meta["lr"] = 0.1
    assert a.stat(b3(text)).codec == "zstd"
    pin = a.freeze("exp-1")
    rep = a.push(remote, "exp-1")
    assert rep.refs == {"pins/exp-1": "created"}
    assert rep.objects == 5 and rep.bytes == len(small) + len(text) + len(big) + a.stat(pin).size

    client = seaweed.client()
    keys = remote_listing(client, remote.url)
    prefix = remote.url[len(f"s3://{BUCKET}/"):]
    for data in (small, text, big, b""):
        h = b3(data)[len("blake3:"):]
        key = f"{prefix}/objects/{h[:2]}/{h[2:]}"
        assert keys[key] == len(data)  # raw bytes, even for the zstd object
    text_key = f"{prefix}/objects/{b3(text)[7:9]}/{b3(text)[9:]}"
    assert client.get_object(Bucket=BUCKET, Key=text_key)["Body"].read() == text
    ref = client.get_object(Bucket=BUCKET, Key=f"{prefix}/refs/pins/exp-1")["Body"].read()
    assert ref == f"{pin}\n".encode()
    assert check_remote_consistent(client, remote.url) == {"pins/exp-1": str(pin)}

    b = casstore.open(tmp_path / "b")
    rep = b.pull(remote, "exp-1")
    assert rep.refs == {"pins/exp-1": "created"} and rep.objects == 4
    assert b.pins() == {"exp-1": pin}
    man = b.manifest("exp-1")
    assert man.frozen and man.meta["lr"] == 0.1
    assert b.get(man["big.bin"].digest) == big
    assert b.get(man["text.txt"].digest) == text
    assert b.get(man["empty"].digest) == b""
    assert tmp_files(b) == []
    # Pulling again transfers nothing.
    rep = b.pull(remote, "exp-1")
    assert rep.objects == 0 and rep.refs == {"pins/exp-1": "up to date"}


def test_pull_compressing_store_and_all_refs(tmp_path: Path, remote: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    fill(a, "h1", 5)
    text = b"abc" * 4 * MiB  # 12 MiB: the large-object path, then compressed by the store's default
    with a.edit("h2") as m:
        m["t"] = a.put(text)
    a.freeze("h2")
    a.push(remote)  # no names: every pin and head
    b = casstore.open(tmp_path / "b", compress=True)
    rep = b.pull(remote)  # no names: everything the remote has
    assert rep.refs == {"pins/h2": "created", "heads/h1": "created"}
    d = b.manifest("h2")["t"].digest
    assert b.stat(d).codec == "zstd" and b.get(d) == text
    assert dict(b.manifest("h1")) == dict(a.manifest("h1"))
    assert tmp_files(b) == []


def test_head_history_travels_and_fast_forwards(tmp_path: Path, remote: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    for i in range(3):
        with a.edit("h") as m:
            m[f"v{i}"] = a.put(f"version {i}".encode())
    a.push(remote, "h")
    b = casstore.open(tmp_path / "b")
    b.pull(remote, "h")
    assert [m.digest for m in b.history("h")] == [m.digest for m in a.history("h")]
    with a.edit("h") as m:
        m["v3"] = a.put(b"version 3")
    assert a.push(remote, "h").refs == {"heads/h": "fast-forward"}
    assert b.pull(remote, "h").refs == {"heads/h": "fast-forward"}
    assert b.heads()["h"] == a.heads()["h"]
    # b is now ahead locally; pulling changes nothing, pushing fast-forwards.
    with b.edit("h") as m:
        m["v4"] = b.put(b"version 4")
    assert b.pull(remote, "h").refs == {"heads/h": "local is ahead (push it)"}
    assert b.push(remote, "h").refs == {"heads/h": "fast-forward"}
    # a is behind and has not seen the new version: a conflict that a pull resolves (fast-forward).
    with pytest.raises(casstore.RemoteConflictError, match="pull it"):
        a.push(remote, "h")
    assert a.pull(remote, "h").refs == {"heads/h": "fast-forward"}
    assert a.push(remote, "h").refs == {"heads/h": "up to date"}
    # Once a knows the remote version, being behind is no error.
    with b.edit("h") as m:
        m["v5"] = b.put(b"version 5")
    b.push(remote, "h")
    old = a.heads()["h"]
    a.pull(remote, "h")
    a.refs.write("heads", "h", old)  # a's head back to the older version it still has
    assert a.push(remote, "h").refs == {"heads/h": "remote is ahead (pull to update)"}


# -- only what is missing, by listing ---------------------------------------------------------


def test_push_uploads_only_missing_and_lists_per_prefix(tmp_path: Path, remote: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a", durable=False)
    fill(a, "h", 120, size=512)
    rep = a.push(remote, "h")
    assert rep.objects == 121  # 120 objects + the version
    # Already there: one listing request (small remote: the probe page covers it), no uploads.
    remote.requests.clear()
    rep = a.push(remote, "h")
    assert rep.objects == 0 and rep.present == 121
    assert remote.requests["PutObject"] == 0 and remote.requests["ListObjectsV2"] == 1
    assert remote.requests["HeadObject"] == 0
    # Three new objects: exactly those and the new version go up.
    with a.edit("h") as m:
        for i in range(3):
            m[f"new{i}"] = a.put(f"new object {i}".encode())
    remote.requests.clear()
    rep = a.push(remote, "h")
    assert rep.objects == 4
    assert remote.requests["PutObject"] == 4 + 1 + 1  # 3 objects + version + the ref + the push marker
    assert remote.requests["DeleteObject"] == 1  # the push marker, removed (docs/remotes.md, "Remote gc")
    # A remote larger than one listing page: the probe, then one round trip per fan-out prefix needed.
    remote.list_page_size = 20
    remote.requests.clear()
    rep = a.push(remote, "h")
    assert rep.objects == 0
    fans = {d.hex[:2] for d in [*(e.digest for e in a.manifest("h").values()), *(m.digest for m in a.history("h"))]}
    assert 2 <= remote.requests["ListObjectsV2"] <= 1 + len(fans)
    assert remote.requests["PutObject"] == 0


def test_present_matches_ground_truth(tmp_path: Path, remote: casstore.Remote) -> None:
    import random

    rng = random.Random(7)
    blobs = [rng.randbytes(64 + i) for i in range(300)]
    ds = [casstore.Digest.of(b) for b in blobs]
    on_remote = set(rng.sample(range(300), 180))
    for i in on_remote:
        assert remote.objects.write(ds[i], blobs[i])
    for page in (1000, 7, 1):
        remote.list_page_size = page
        ask = set(rng.sample(range(300), 120)) | {0, 299}
        got = remote.objects.present([ds[i] for i in ask])
        assert got == {ds[i] for i in ask & on_remote}, page


# -- create-only objects, CAS refs, pins ----------------------------------------------------------


def test_objects_are_create_only(seaweed: Any, remote: casstore.Remote) -> None:
    client = seaweed.client()
    data = b"the real content"
    d = casstore.Digest.of(data)
    assert remote.objects.write(d, data) is True
    assert remote.objects.write(d, data) is False  # 412: already there, which is success
    key = remote.objects.key(d)
    client.put_object(Bucket=BUCKET, Key=key, Body=b"the fake content")  # same size: cannot be told apart
    assert remote.objects.write(d, data) is False  # If-None-Match: the existing key is not overwritten
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"the fake content"
    # Another size is a damaged copy (a PUT cut off on a server that kept what it got): replaced.
    client.put_object(Bucket=BUCKET, Key=key, Body=b"")
    assert remote.objects.write(d, data) is True
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data
    # Multipart completion is create-only too.
    big = os.urandom(11 * MiB)
    db = casstore.Digest.of(big)
    import io

    assert remote.objects.upload(db, io.BytesIO(big)) is True
    keyb = remote.objects.key(db)
    client.put_object(Bucket=BUCKET, Key=keyb, Body=b"short")
    remote.requests.clear()
    assert remote.objects.upload(db, io.BytesIO(big)) is False
    assert remote.requests["CompleteMultipartUpload"] == 1
    assert client.get_object(Bucket=BUCKET, Key=keyb)["Body"].read() == b"short"


def test_server_check_probes_conditional_writes(remote: casstore.Remote, seaweed: Any) -> None:
    assert remote.check() == {"create_only": True, "compare_and_swap": True}
    assert remote_listing(seaweed.client(), remote.url) == {}  # the probe key is gone
    remote.requests.clear()
    remote.check()
    assert remote.requests["PutObject"] == 4 and remote.requests["DeleteObject"] == 1


def test_ref_compare_and_swap(remote: casstore.Remote) -> None:
    d1, d2, d3 = (casstore.Digest.of(x) for x in (b"1", b"2", b"3"))
    assert remote.refs.read("heads", "x") is None
    assert remote.refs.compare_and_swap("heads", "x", d1, None) is True
    assert remote.refs.compare_and_swap("heads", "x", d2, None) is False  # exists: create-only refused
    got = remote.refs.read("heads", "x")
    assert got is not None and got.digest == d1
    ref1 = got
    assert remote.refs.compare_and_swap("heads", "x", d2, ref1) is True
    assert remote.refs.compare_and_swap("heads", "x", d3, ref1) is False  # stale ETag
    got = remote.refs.read("heads", "x")
    assert got is not None and got.digest == d2


def test_pins_on_the_remote_never_move(tmp_path: Path, remote: casstore.Remote) -> None:
    a, b = casstore.open(tmp_path / "a"), casstore.open(tmp_path / "b")
    fill(a, "p", 3, seed=1)
    fill(b, "p", 3, seed=2)
    pa, pb = a.freeze("p"), b.freeze("p")
    assert pa != pb
    a.push(remote, "p")
    with pytest.raises(casstore.RemoteConflictError, match="pins never move"):
        b.push(remote, "p")
    with pytest.raises(casstore.RemoteConflictError):
        b.push(remote, "p", force=True)  # force is for heads only
    got = remote.refs.read("pins", "p")
    assert got is not None and got.digest == pa
    # A head cannot be pushed over a remote pin of the same name.
    fill(b, "p2", 1)
    b.pin("p-other", b.heads()["p2"])
    fill(a, "q", 1)
    a.freeze("q")
    a.push(remote, "q")
    fill(b, "q", 1, seed=5)
    with pytest.raises(casstore.RemoteConflictError, match="is a pin there"):
        b.push(remote, "q")
    # Pulling a pin that names another version locally is refused too.
    with pytest.raises(casstore.FrozenError):
        b.pull(remote, "p")
    assert b.pins()["p"] == pb


def test_diverged_heads_conflict_then_merge(tmp_path: Path, remote: casstore.Remote) -> None:
    a, b = casstore.open(tmp_path / "a"), casstore.open(tmp_path / "b")
    with a.edit("h") as m:
        m["shared"] = a.put(b"base")
        m["edited"] = a.put(b"base value")
    a.push(remote, "h")
    b.pull(remote, "h")
    with a.edit("h") as m:
        m["from-a"] = a.put(b"a")
        m.meta["a"] = 1
    with b.edit("h") as m:
        m["from-b"] = b.put(b"b")
        del m["shared"]
    a.push(remote, "h")
    with pytest.raises(casstore.RemoteConflictError, match="pull it"):
        b.push(remote, "h")
    with pytest.raises(casstore.RemoteConflictError, match="diverged"):
        b.pull(remote, "h", merge=False)
    rep = b.pull(remote, "h")
    assert rep.refs["heads/h"].startswith("merged")
    merged = b.manifest("h")
    assert sorted(merged) == ["edited", "from-a", "from-b"] and merged.meta["a"] == 1
    assert merged.parent == a.heads()["h"]
    assert b.push(remote, "h").refs == {"heads/h": "fast-forward"}
    assert a.pull(remote, "h").refs == {"heads/h": "fast-forward"}
    assert sorted(a.manifest("h")) == ["edited", "from-a", "from-b"]
    # Both sides change the same key differently: a real conflict.
    with a.edit("h") as m:
        m["edited"] = a.put(b"a's value")
    with b.edit("h") as m:
        m["edited"] = b.put(b"b's value")
    a.push(remote, "h")
    before = b.heads()["h"]
    with pytest.raises(casstore.RemoteConflictError, match="'edited'"):
        b.pull(remote, "h")
    assert b.heads()["h"] == before
    b.pull(remote, "h", merge="theirs")
    assert b.get(b.manifest("h")["edited"].digest) == b"a's value"
    # force overwrites a diverged remote head (compare-and-swap still guards the write).
    with a.edit("h") as m:
        m["a-again"] = a.put(b"a again")
    a.push(remote, "h")
    with b.edit("h") as m:
        m["b-again"] = b.put(b"b again")
    with pytest.raises(casstore.RemoteConflictError):
        b.push(remote, "h")
    assert b.push(remote, "h", force=True).refs == {"heads/h": "forced"}
    got = remote.refs.read("heads", "h")
    assert got is not None and got.digest == b.heads()["h"]


def test_push_refuses_closure_missing_everywhere(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    ghost = casstore.Digest.of(b"never stored anywhere")
    with a.edit("h", allow_missing=True) as m:
        m["ghost"] = casstore.Entry(ghost, 21)
        m["real"] = a.put(b"real")
    with pytest.raises(casstore.ObjectNotFoundError, match="Nothing was pushed"):
        a.push(remote, "h")
    assert remote_listing(seaweed.client(), remote.url) == {}
    # Remote-only objects are fine: once the remote has it, the push goes through.
    remote.objects.write(ghost, b"never stored anywhere")
    a.push(remote, "h")
    check_remote_consistent(seaweed.client(), remote.url)


@pytest.mark.parametrize("when", ["flipped-before", "truncated-before", "truncated-during", "rewritten-during"])
def test_push_refuses_a_local_object_altered_before_or_during_its_upload(tmp_path: Path, remote: casstore.Remote,
                                                                       seaweed: Any, when: str) -> None:
    """A large local object damaged, cut short or rewritten (by someone who made it writable) before
    or while its parts go up: IntegrityError naming it, and the upload is never completed: no
    object and no ref on the remote, nothing partial left behind."""
    a = casstore.open(tmp_path / "a")
    during = when.endswith("during")
    big = os.urandom((12 if during else 2) * 5 * MiB + 123)  # 5 MiB parts: more than boto3 reads ahead
    with a.edit("h") as m:
        m["big"] = d = a.put(big)
        m["other"] = a.put(b"fine")
    path = a.path(d)
    os.chmod(path, 0o644)

    def alter() -> None:
        if when.startswith("truncated"):
            os.truncate(path, len(big) - 4096)
        else:  # same size, other bytes: only the hash can tell
            with open(path, "r+b") as f:
                f.seek(-4096 if during else len(big) // 2, os.SEEK_END if during else os.SEEK_SET)
                f.write(os.urandom(16))

    if during:
        # boto3 reads at most 10 parts ahead of those sent: the tail is still unread here
        remote.objects.connection.requests = CallOnRequest("UploadPart", alter)
    else:
        alter()
    with pytest.raises(casstore.IntegrityError, match="not pushed") as ei:
        a.push(remote, "h")
    assert str(d) in str(ei.value)
    if during:
        assert remote.objects.connection.requests["UploadPart"] >= 1  # it was caught mid-upload
    client = seaweed.client()
    keys = remote_listing(client, remote.url)
    assert remote.objects.key(d) not in keys
    assert not any("/refs/" in k for k in keys), keys
    bucket_prefix = remote.url[len(f"s3://{BUCKET}/"):]
    assert client.list_multipart_uploads(Bucket=BUCKET, Prefix=bucket_prefix).get("Uploads", []) == []


# -- pull verifies -------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["small", "large", "version"])
def test_pull_refuses_altered_objects(tmp_path: Path, remote: casstore.Remote, seaweed: Any, which: str) -> None:
    a = casstore.open(tmp_path / "a")
    small, large = os.urandom(3000), os.urandom(9 * MiB)
    with a.edit("h") as m:
        m["small"] = a.put(small)
        m["large"] = a.put(large)
        m["other"] = a.put(b"fine")
    a.push(remote, "h")
    target = {"small": b3(small), "large": b3(large), "version": str(a.heads()["h"])}[which]
    d = casstore.Digest.parse(target)
    client = seaweed.client()
    key = remote.objects.key(d)
    good = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01  # one flipped bit, same length
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(bad))
    b = casstore.open(tmp_path / "b")
    with pytest.raises(casstore.IntegrityError) as ei:
        b.pull(remote, "h")
    assert key in str(ei.value) and str(d) in str(ei.value)
    assert d not in b
    assert b.heads() == {} and b.pins() == {}
    assert tmp_files(b) == []
    for info in b.iter_info():  # whatever did arrive is intact
        b.get(info.digest)
    with pytest.raises(casstore.IntegrityError):
        b.fetch_object(d, remotes=[remote])
    assert d not in b


# -- fetch_object -------------------------------------------------------------------------------


def test_fetch_object_falls_back_to_remotes(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    data = os.urandom(10_000)
    d = a.put(data)
    with a.edit("h") as m:
        m["x"] = d
    a.push(remote, "h")
    b = casstore.open(tmp_path / "b")
    assert d not in b
    empty = casstore.Remote(f"s3://{BUCKET}/empty-{os.getpid()}", endpoint_url=seaweed.endpoint)
    assert b.fetch_object(d, remotes=[empty, remote]) == data
    assert d in b and b.get(d) == data
    remote.requests.clear()
    assert b.fetch_object(d, remotes=[remote]) == data  # local hit: no request
    assert sum(remote.requests.values()) == 0
    missing = casstore.Digest.of(b"nowhere")
    with pytest.raises(casstore.ObjectNotFoundError, match="no remote has it"):
        b.fetch_object(missing, remotes=[remote])
    # remotes=None: the store's configured remotes.
    c = casstore.open(tmp_path / "c")
    add_remote(c, "origin", remote.url, endpoint_url=seaweed.endpoint)
    assert c.fetch_object(str(d)) == data


# -- configuration and CLI --------------------------------------------------------------------------


def test_remotes_toml(tmp_path: Path) -> None:
    import tomllib

    s = casstore.open(tmp_path / "s")
    assert load_remotes(s) == {}
    add_remote(s, "origin", "s3://bucket/team/x", endpoint_url="http://127.0.0.1:1", profile="lab")
    add_remote(s, "aws", "s3://other-bucket", region="eu-west-1")
    doc = tomllib.loads((s.root / "remotes.toml").read_text())
    assert doc["remotes"]["origin"] == {"url": "s3://bucket/team/x", "endpoint_url": "http://127.0.0.1:1",
                                        "profile": "lab"}
    r = get_remote(s, "origin")
    assert (r.bucket, r.prefix, r.endpoint_url, r.profile, r.name) == ("bucket", "team/x/", "http://127.0.0.1:1",
                                                                       "lab", "origin")
    assert get_remote(s, "aws").prefix == ""
    with pytest.raises(casstore.InvalidInputError, match="already exists"):
        add_remote(s, "origin", "s3://bucket/elsewhere")
    with pytest.raises(casstore.InvalidInputError):
        add_remote(s, "bad name", "s3://bucket/x")
    with pytest.raises(casstore.InvalidInputError):
        add_remote(s, "x", "http://not-s3")
    remove_remote(s, "aws")
    assert list(load_remotes(s)) == ["origin"]
    with pytest.raises(casstore.ObjectNotFoundError, match="casstore remote add"):
        get_remote(s, "aws")
    assert (s.root / "store.toml").read_text().startswith("# casstore store settings")  # untouched
    assert not [f for f in os.listdir(s.root / "tmp")]


def _cli(store: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store), *args],
                       capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_cli_remote_push_pull(tmp_path: Path, remote_url: str, seaweed: Any) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    sa = casstore.open(a)
    casstore.open(b)  # an explicit --store must exist (issue 12)
    fill(sa, "exp", 4)
    sa.freeze("exp")
    _cli(a, "remote", "add", "origin", remote_url, "--endpoint-url", seaweed.endpoint)
    _cli(b, "remote", "add", "origin", remote_url, "--endpoint-url", seaweed.endpoint)
    r = _cli(a, "push", "origin", "exp")
    assert "pins/exp: created" in r.stdout
    r = _cli(a, "remote", "ls", "origin", "--json", "--objects")
    doc = json.loads(r.stdout)
    assert doc["pins"] == {"exp": str(sa.pins()["exp"])} and doc["objects"] == 5
    r = _cli(a, "remote", "ls")
    assert r.stdout.startswith("origin\t" + remote_url)
    r = _cli(a, "remote", "check", "origin")
    assert "compare-and-swap (If-Match) work" in r.stdout
    r = _cli(b, "pull", "origin", "exp", "--json")
    assert json.loads(r.stdout)["refs"] == {"pins/exp": "created"}
    assert casstore.open(b).pins() == sa.pins()
    r = _cli(b, "pull", "origin", "nope", check=False)
    assert r.returncode == 1 and "no pin or head named 'nope'" in r.stderr
    r = _cli(b, "push", "nowhere", check=False)
    assert r.returncode == 1 and "no remote named 'nowhere'" in r.stderr


# -- failures: unreachable server, wrong credentials, missing bucket ---------------------------------


def test_server_down_is_a_bounded_backend_error(tmp_path: Path) -> None:
    a = casstore.open(tmp_path / "a")
    fill(a, "h", 3)
    port = free_port()
    dead = casstore.Remote("s3://bucket/x", endpoint_url=f"http://127.0.0.1:{port}", name="dead",
                           connect_timeout=1, read_timeout=2)
    t = time.monotonic()
    with pytest.raises(casstore.BackendError, match="remote 'dead'.*unreachable") as ei:
        a.push(dead, "h")
    assert not isinstance(ei.value, casstore.RemoteConflictError)
    b = casstore.open(tmp_path / "b")
    with pytest.raises(casstore.BackendError, match="unreachable"):
        b.pull(dead, "h")
    with pytest.raises(casstore.ObjectNotFoundError, match="unreachable"):
        b.fetch_object(a.heads()["h"], remotes=[dead])
    assert time.monotonic() - t < 30
    assert b.heads() == {} and list(b.iter_objects()) == [] and tmp_files(b) == []
    # The default settings are bounded too (3 attempts with back-off).
    t = time.monotonic()
    with pytest.raises(casstore.BackendError):
        casstore.Remote("s3://bucket/x", endpoint_url=f"http://127.0.0.1:{port}").refs.read("heads", "h")
    assert time.monotonic() - t < 15


def test_wrong_credentials_and_missing_bucket(tmp_path: Path, seaweed: Any, remote_url: str) -> None:
    a = casstore.open(tmp_path / "a")
    fill(a, "h", 2)
    wrong = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, profile="casstore-wrong", name="team")
    with pytest.raises(casstore.BackendError, match="remote 'team'.*credentials") as ei:
        a.push(wrong, "h")
    assert "SignatureDoesNotMatch" in str(ei.value)
    b = casstore.open(tmp_path / "b")
    with pytest.raises(casstore.BackendError, match="remote 'team'.*credentials"):
        b.pull(wrong, "h")
    import boto3

    unknown = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, name="team",
                              session=boto3.session.Session(aws_access_key_id="nobody", aws_secret_access_key="x"))
    with pytest.raises(casstore.BackendError, match="remote 'team'.*credentials.*InvalidAccessKeyId"):
        unknown.refs.read("heads", "h")
    # The right profile works (the wrong one failed above although the environment's keys are right).
    assert casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, profile="casstore-test").refs.read("heads", "h") \
        is None
    nobucket = casstore.Remote("s3://no-such-bucket-here/x", endpoint_url=seaweed.endpoint, name="nb")
    with pytest.raises(casstore.BackendError, match="bucket 'no-such-bucket-here' does not exist"):
        a.push(nobucket, "h")
    with pytest.raises(casstore.BackendError, match="profile"):
        casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, profile="no-such-profile").refs.read("heads", "h")
    assert b.heads() == {} and tmp_files(b) == []
