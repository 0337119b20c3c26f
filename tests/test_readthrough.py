"""Read-through (issue 14): a store with a remote as its upstream fetches a missing object on first read.

Against a real SeaweedFS server (tests/_seaweed.py), real processes.  Contracts:

* every read path (get, open, path, get_array, open_hdf5, checkout, IndexCache.open, manifests)
  fetches a missing object, verified, and keeps it; presence checks (``has``) never fetch;
* many processes reading the same missing objects at once download each exactly once
  (requests counted by the remote's connection, lean GETs included, summed across the processes);
* a tampered remote object is refused exactly as by pull, and nothing of it is kept;
* ``open()`` of a large missing object fetches only the ranges read; a full in-order read is
  verified (IntegrityError before the last bytes if the remote lies) and brings the object home;
* ``pull(lazy=True)`` brings refs and manifests only; ``casstore.open("s3://...")`` gives a
  per-user cache in front of the remote.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import _seaweed
import numpy as np
import pytest
from _seaweed import BUCKET

import casstore
from casstore.errors import IntegrityError, InvalidInputError, ObjectNotFoundError
from casstore.sync import RemoteUpstream

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

MiB = 1 << 20


def _key(remote: casstore.Remote, d: casstore.Digest) -> str:
    return remote.objects.key(d)


def _published(remote: casstore.Remote, tmp_path: Path, n: int = 5,
               size: int = 3000) -> Tuple[casstore.Store, Dict[str, casstore.Digest]]:
    """A store 'a' with head 'exp' of ``n`` objects pushed to ``remote``."""
    a = casstore.open(tmp_path / "a")
    rng = random.Random(7)
    ds: Dict[str, casstore.Digest] = {}
    with a.edit("exp") as m:
        for i in range(n):
            ds[f"f{i}.bin"] = m[f"f{i}.bin"] = a.put(rng.randbytes(size + i))
    a.push(remote, "exp")
    return a, ds


def _reader(tmp_path: Path, remote: casstore.Remote, name: str = "b") -> casstore.Store:
    b = casstore.open(tmp_path / name, upstream=remote)
    return b


def _gets(remote: casstore.Remote) -> int:
    return remote.requests["GetObject"]


def test_get_fetches_once_verifies_and_keeps(tmp_path: Path, remote: casstore.Remote) -> None:
    a, ds = _published(remote, tmp_path)
    b = _reader(tmp_path, remote)
    d = ds["f0.bin"]
    assert not b.objects.has(d) and d not in b  # a presence check never fetches
    before = _gets(remote)
    assert b.get(d) == a.get(d)
    assert _gets(remote) == before + 1
    assert b.objects.has(d)  # kept
    assert b.get(d) == a.get(d) and _gets(remote) == before + 1  # the second read is local
    assert os.listdir(b.root / "tmp") == []


def test_every_read_path_reads_through(tmp_path: Path, remote: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    arr = np.arange(1000, dtype=np.float32)
    import h5py

    h5 = tmp_path / "x.h5"
    with h5py.File(h5, "w") as f:
        f["x"] = np.arange(50)
    with a.edit("exp") as m:
        m["arr.npy"] = da = a.put_array(arr)
        m["x.h5"] = dh = a.put_path(h5)
        m["p.bin"] = dp = a.put(b"path me" * 100)
        m["o.bin"] = do = a.put(b"open me" * 100)
    a.push(remote, "exp")
    b = _reader(tmp_path, remote)
    b.pull(remote, "exp", lazy=True)
    assert not any(b.objects.has(x) for x in (da, dh, dp, do))
    np.testing.assert_array_equal(b.get_array(da), arr)
    with b.open_hdf5(dh) as f:
        assert list(f["x"][:]) == list(range(50))
    assert b.path(dp).read_bytes() == b"path me" * 100
    with b.open(do) as f:
        assert f.read() == b"open me" * 100
    out = tmp_path / "out"
    b2 = _reader(tmp_path, remote, "b2")
    b2.pull(remote, "exp", lazy=True)
    b2.checkout("exp", out)
    assert (out / "p.bin").read_bytes() == b"path me" * 100
    assert (out / "x.h5").read_bytes() == h5.read_bytes()


def test_index_cache_open_reads_through(tmp_path: Path, remote: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    cache = casstore.IndexCache(a, 3)
    for i in range(3):
        cache.put(i, f"rec{i}".encode())
    cache.freeze()
    cache.preserve("cache-1")
    a.push(remote, "cache-1")
    b = _reader(tmp_path, remote)
    b.pull(remote, "cache-1", lazy=True)
    got = casstore.IndexCache.open(b, "cache-1")
    assert [got.get(i) for i in range(3)] == [b"rec0", b"rec1", b"rec2"]


def test_tampered_remote_object_is_refused_and_nothing_kept(tmp_path: Path, remote: casstore.Remote,
                                                            seaweed: Any) -> None:
    _, ds = _published(remote, tmp_path)
    d = ds["f1.bin"]
    seaweed.client().put_object(Bucket=BUCKET, Key=_key(remote, d), Body=b"tampered")
    b = _reader(tmp_path, remote)
    with pytest.raises(IntegrityError):
        b.get(d)
    with pytest.raises(IntegrityError):
        b.path(d)
    assert not b.objects.has(d)
    assert os.listdir(b.root / "tmp") == []
    assert list((b.root / "objects").rglob("*")) == [] or all(p.is_dir() for p in (b.root / "objects").rglob("*"))


def test_missing_everywhere_names_both_places(tmp_path: Path, remote: casstore.Remote) -> None:
    _published(remote, tmp_path)
    b = _reader(tmp_path, remote)
    ghost = casstore.Digest.of(b"not anywhere")
    with pytest.raises(ObjectNotFoundError, match="nor on its upstream"):
        b.get(ghost)
    with pytest.raises(ObjectNotFoundError):
        b.objects.resolve(str(ghost))
    # Without an upstream: the plain message, no remote request.
    c = casstore.open(tmp_path / "c", upstream=False)
    n = sum(remote.requests.values())
    with pytest.raises(ObjectNotFoundError, match="put it first"):
        c.get(ghost)
    assert sum(remote.requests.values()) == n


_READER = r"""
import json, random, sys, time
from pathlib import Path
import casstore
root, url, endpoint, go, out, seed = sys.argv[1:7]
digests = json.loads(Path(sys.argv[7]).read_text())
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False)
store = casstore.open(root, upstream=rem)
order = list(digests)
random.Random(int(seed)).shuffle(order)
while not Path(go).exists():
    time.sleep(0.002)
sizes = {d: len(store.get(d)) for d in order}
Path(out).write_text(json.dumps({"requests": dict(rem.requests), "sizes": sizes}))
"""


def test_four_processes_read_through_the_same_20_objects_once(tmp_path: Path, remote: casstore.Remote,
                                                              seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    rng = random.Random(3)
    blobs = [rng.randbytes(50_000 + 1000 * i) for i in range(20)]
    with a.edit("data") as m:
        for i, blob in enumerate(blobs):
            m[f"{i}"] = a.put(blob)
    a.push(remote, "data")
    digests = [str(casstore.Digest.of(x)) for x in blobs]
    (tmp_path / "digests.json").write_text(json.dumps(digests))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _READER, str(tmp_path / "b"), remote.url, seaweed.endpoint,
                               str(go), str(tmp_path / f"out{i}.json"), str(i), str(tmp_path / "digests.json")])
             for i in range(4)]
    import time

    time.sleep(1.5)  # every process has imported and opened the store
    go.touch()
    assert all(p.wait(120) == 0 for p in procs)
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(4)]
    gets = sum(o["requests"].get("GetObject", 0) for o in outs)
    assert gets == 20, f"each object must be downloaded once across the 4 processes, saw {gets} GETs: {outs}"
    for o in outs:
        assert o["sizes"] == {d: len(blobs[digests.index(d)]) for d in digests}
    b = casstore.open(tmp_path / "b", upstream=False)
    for d, blob in zip(digests, blobs, strict=True):
        assert b.get(d) == blob


def _ranged(tmp_path: Path, remote: casstore.Remote, name: str = "b") -> casstore.Store:
    b = casstore.open(tmp_path / name, upstream=False)
    b.objects.upstream = RemoteUpstream.of(remote, ranged_min=1 * MiB)
    return b


def test_ranged_open_fetches_only_the_ranges_read(tmp_path: Path, remote: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    big = os.urandom(24 * MiB + 5)
    d = a.put(big)
    with a.edit("big") as m:
        m["big"] = d
    a.push(remote, "big")
    b = _ranged(tmp_path, remote)
    before = _gets(remote)
    with b.open(d) as f:
        f.seek(10 * MiB)
        assert f.read(100) == big[10 * MiB:10 * MiB + 100]
        f.seek(20 * MiB)
        assert f.read(1000) == big[20 * MiB:20 * MiB + 1000]
    assert _gets(remote) - before == 2  # two ranged GETs of a few MiB, not a 24 MiB download
    assert not b.objects.has(d)  # partial, unverified reads keep nothing
    with b.open(d) as f:  # a full read in order: verified, and kept
        assert f.read() == big
    assert b.objects.has(d)
    assert b.get(d, verify=True) == big
    assert os.listdir(b.root / "tmp") == []


def _pushed_big(tmp_path: Path, remote: casstore.Remote) -> Tuple[bytes, casstore.Digest]:
    """6 MiB of random bytes put in store ``a`` as head 'big' and pushed: (bytes, digest)."""
    a = casstore.open(tmp_path / "a")
    big = os.urandom(6 * MiB)
    d = a.put(big)
    with a.edit("big") as m:
        m["big"] = d
    a.push(remote, "big")
    return big, d


def _tamper_last_byte(seaweed: Any, remote: casstore.Remote, d: casstore.Digest, big: bytes) -> None:
    bad = bytearray(big)
    bad[-1] ^= 1
    seaweed.client().put_object(Bucket=BUCKET, Key=_key(remote, d), Body=bytes(bad))


def test_ranged_full_read_of_a_tampered_object_raises_before_the_end(tmp_path: Path, remote: casstore.Remote,
                                                                     seaweed: Any) -> None:
    big, d = _pushed_big(tmp_path, remote)
    _tamper_last_byte(seaweed, remote, d, big)
    b = _ranged(tmp_path, remote)
    got = bytearray()
    with pytest.raises(IntegrityError, match="corrupt"):
        with b.open(d) as f:
            while chunk := f.read(1 * MiB):
                got += chunk
    assert len(got) < len(big)  # the last bytes were never handed out
    assert not b.objects.has(d)
    assert os.listdir(b.root / "tmp") == []


def test_ranged_seek_back_to_the_start_verifies_again(tmp_path: Path, remote: casstore.Remote,
                                                     seaweed: Any) -> None:
    """Size by seek(0, SEEK_END), seek(0), read it all: the tampered object raises, as ObjectReader does."""
    big, d = _pushed_big(tmp_path, remote)
    b = _ranged(tmp_path, remote)
    with b.open(d) as f:  # the genuine object: verified and kept after the seeks
        f.read(100)
        assert f.seek(0, os.SEEK_END) == len(big)
        f.seek(0)
        assert f.read() == big
    assert b.objects.has(d)  # kept: the full read after the seek back was verified
    _tamper_last_byte(seaweed, remote, d, big)
    c = _ranged(tmp_path, remote, "c")
    with pytest.raises(IntegrityError, match="corrupt"):
        with c.open(d) as f:
            f.read(100)
            f.seek(0, os.SEEK_END)
            f.seek(0)
            f.read()
    assert not c.objects.has(d)
    assert os.listdir(c.root / "tmp") == []


def test_pull_lazy_brings_refs_and_manifests_only(tmp_path: Path, remote: casstore.Remote) -> None:
    _, ds = _published(remote, tmp_path, n=8)
    c = casstore.open(tmp_path / "c", upstream=False)
    with pytest.raises(InvalidInputError, match="upstream"):
        c.pull(remote, "exp", lazy=True)
    b = _reader(tmp_path, remote)
    rep = b.pull(remote, "exp", lazy=True)
    assert rep.refs == {"heads/exp": "created"} and rep.objects == 0
    man = b.manifest("exp")
    assert dict(man.items()).keys() == ds.keys()
    assert not any(b.objects.has(d) for d in ds.values())
    assert b.get(ds["f3.bin"]) == casstore.open(tmp_path / "a").get(ds["f3.bin"])
    assert sum(b.objects.has(d) for d in ds.values()) == 1


def test_upstream_setting_in_remotes_toml_and_cli(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    _, ds = _published(remote, tmp_path)
    root = tmp_path / "b"
    env = dict(os.environ)
    cli = [sys.executable, "-m", "casstore", "--store", str(root)]
    subprocess.run([sys.executable, "-m", "casstore", "init", str(root)], check=True, env=env, capture_output=True)
    r = subprocess.run(cli + ["remote", "add", "origin", remote.url, "--endpoint-url", seaweed.endpoint, "--upstream",
                              "--json"], check=True, env=env, capture_output=True, text=True)
    assert json.loads(r.stdout)["upstream"] is True
    r = subprocess.run(cli + ["remote", "upstream", "--json"], check=True, env=env, capture_output=True, text=True)
    assert json.loads(r.stdout) == {"upstream": "origin"}
    assert casstore.open(root).upstream == "origin"  # read back from remotes.toml by a new Store
    r = subprocess.run(cli + ["pull", "origin", "exp", "--lazy", "--json"], check=True, env=env, capture_output=True,
                       text=True)
    assert json.loads(r.stdout)["objects"] == 0
    out = tmp_path / "f0.bin"
    subprocess.run(cli + ["get", str(ds["f0.bin"]), "-o", str(out)], check=True, env=env, capture_output=True)
    assert casstore.Digest.of(out.read_bytes()) == ds["f0.bin"]
    subprocess.run(cli + ["remote", "upstream", "--none"], check=True, env=env, capture_output=True)
    assert casstore.open(root).upstream is None
    r = subprocess.run(cli + ["get", str(ds["f1.bin"]), "-o", str(tmp_path / "x")], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "not in the store" in r.stderr


def test_open_s3_url_is_a_local_cache_in_front_of_the_remote(tmp_path: Path, remote: casstore.Remote,
                                                             seaweed: Any) -> None:
    _, ds = _published(remote, tmp_path)
    cache = tmp_path / "cache"
    s = casstore.open(remote.url, endpoint_url=seaweed.endpoint, cache=cache)
    assert s.upstream == "origin" and s.root.parent == cache
    assert s.root == casstore.remote_cache_dir(remote.url, endpoint_url=seaweed.endpoint, cache=cache)
    assert s.get(ds["f2.bin"]) == casstore.open(tmp_path / "a").get(ds["f2.bin"])
    again = casstore.open(remote.url, endpoint_url=seaweed.endpoint, cache=cache)
    assert again.root == s.root and again.objects.has(ds["f2.bin"])
    other = casstore.open(remote.url, endpoint_url="http://127.0.0.1:1", cache=cache)
    assert other.root != s.root  # another server's bucket never shares a cache
    with pytest.raises(InvalidInputError):
        casstore.open(tmp_path / "plain", endpoint_url=seaweed.endpoint)


def test_upstream_argument_is_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError):
        casstore.open(tmp_path / "s", upstream=True)
    with pytest.raises(casstore.errors.InvalidTypeError):
        casstore.open(tmp_path / "s", upstream=3)  # type: ignore[arg-type]
    s = casstore.open(tmp_path / "s", upstream="nope")  # resolved on first use, not at open
    with pytest.raises(ObjectNotFoundError, match="no remote named 'nope'"):
        s.get(casstore.Digest.of(b"x"))


def test_verify_counts_upstream_objects_as_not_fetched_yet_not_missing(tmp_path: Path, remote: casstore.Remote,
                                                                       seaweed: Any) -> None:
    a, ds = _published(remote, tmp_path, n=4)
    b = _reader(tmp_path, remote)
    b.pull(remote, "exp", lazy=True)
    rep = b.verify()
    assert rep.ok and not rep.missing and not rep.lost
    assert set(rep.upstream) == set(ds.values())
    # Really missing everywhere: still reported missing and lost.
    seaweed.client().delete_object(Bucket=BUCKET, Key=_key(remote, ds["f0.bin"]))
    rep = b.verify()
    assert rep.missing == (ds["f0.bin"],) and ds["f0.bin"] in rep.lost and not rep.ok
    # A corrupt local copy of an object the upstream holds: not lost; after repair a read fetches a good copy.
    d = ds["f1.bin"]
    p = b.path(d)
    os.chmod(p, 0o644)
    p.write_bytes(b"rotten")
    rep = b.verify(repair=True)
    assert d in rep.corrupt and d not in rep.lost
    assert b.get(d) == a.get(d)
    # The same store without an upstream: the lazily pulled objects are missing (no remote is asked).
    c = casstore.open(tmp_path / "b", upstream=False)
    assert set(c.verify().missing) >= {ds["f2.bin"], ds["f3.bin"]}


def test_server_stopped_mid_read_bounded_backend_error_local_reads_work_offline(tmp_path: Path,
                                                                              aws_credentials: Any) -> None:
    import signal
    import time

    from _seaweed import start_seaweed

    srv = start_seaweed()
    try:
        rem = casstore.Remote("s3://rt-dying/x", endpoint_url=srv.endpoint, name="dying", workers=2,
                              connect_timeout=1, read_timeout=2, max_attempts=2, progress=False)
        rem.create_bucket()
        a = casstore.open(tmp_path / "a", durable=False)
        blobs = [os.urandom(20_000 + i) for i in range(6)]
        with a.edit("h") as m:
            for i, blob in enumerate(blobs):
                m[f"k{i}"] = a.put(blob)
        a.push(rem, "h")
        ds = [casstore.Digest.of(x) for x in blobs]
        b = casstore.open(tmp_path / "b", upstream=rem)
        b.pull(rem, "h", lazy=True)
        assert b.get(ds[0]) == blobs[0]  # fetched while the server runs
        # A hung server (stopped, its socket still accepting): a typed error within a bounded time.
        srv.proc.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(casstore.BackendError, match="remote 'dying'"):
            b.get(ds[1])
        assert time.monotonic() - t < 30
        # A dead server: the same, at once.
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        t = time.monotonic()
        with pytest.raises(casstore.BackendError, match="unreachable"):
            b.checkout("h", tmp_path / "out")
        assert time.monotonic() - t < 30
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written
        assert os.listdir(b.root / "tmp") == [] and not b.objects.has(ds[1])
        # Offline: what is local still reads, manifests included.
        assert b.get(ds[0]) == blobs[0]
        assert set(b.manifest("h")) == {f"k{i}" for i in range(6)}
    finally:
        try:
            srv.proc.send_signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
        srv.stop()


def test_pandas_reads_a_lazily_pulled_file_through_casstore_urls(tmp_path: Path, remote: casstore.Remote,
                                                                  seaweed: Any) -> None:
    import pandas as pd

    a = casstore.open(tmp_path / "a")
    with a.edit("exp") as m:
        m["metrics.csv"] = d = a.put(b"step,loss\n1,0.5\n2,0.25\n")
    a.push(remote, "exp")
    b = casstore.open(tmp_path / "b")
    b.add_remote("origin", remote.url, endpoint_url=seaweed.endpoint)
    b.set_upstream("origin")  # remotes.toml: every later open of this store reads through
    b.pull("origin", "exp", lazy=True)
    assert not b.objects.has(d)
    df = pd.read_csv("casstore://exp/metrics.csv", storage_options={"store": str(b.root)})
    assert list(df["loss"]) == [0.5, 0.25]
    assert b.objects.has(d)


def test_checkout_of_a_remote_name_pulls_it_lazily(tmp_path: Path, remote: casstore.Remote) -> None:
    a, ds = _published(remote, tmp_path, n=3)
    b = _reader(tmp_path, remote)
    assert b.heads() == {}
    b.checkout("exp", tmp_path / "out")  # not a local name: refs and manifests come first, then the objects
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(ds)
    assert "exp" in b.heads() and all(b.objects.has(d) for d in ds.values())
    with pytest.raises(casstore.errors.CasstoreError):
        b.checkout("nowhere", tmp_path / "out2")
    c = casstore.open(tmp_path / "c", upstream=False)
    with pytest.raises(casstore.errors.CasstoreError):
        c.checkout("exp", tmp_path / "out3")  # without an upstream a remote name is not looked up


def test_a_damaged_local_copy_heals_from_the_upstream_on_a_verified_read(tmp_path: Path,
                                                                          remote: casstore.Remote) -> None:
    a, ds = _published(remote, tmp_path, n=2)
    b = _reader(tmp_path, remote)
    d = ds["f0.bin"]
    good = b.get(d)
    p = b.path(d)
    os.chmod(p, 0o644)
    p.write_bytes(b"\0" * 10)  # what a power loss can leave of a copy that was never fsynced
    assert b.get(d) == good == a.get(d)  # set aside, fetched again, verified
    assert [x.name.split(".")[0] for x in (b.root / "bad").iterdir()] == [d.hex[2:]]
    assert b.verify().ok
    c = casstore.open(tmp_path / "b", upstream=False)  # without an upstream: the damage is an error, as always
    p = c.path(d)
    os.chmod(p, 0o644)
    p.write_bytes(b"\0" * 10)
    with pytest.raises(IntegrityError):
        c.get(d)
