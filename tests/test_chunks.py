"""Content-defined chunks on remotes (issue 16): casstore/objects/chunking.py and the chunked paths of
push, pull and read-through, against a real SeaweedFS server (tests/_seaweed.py) and real processes.

Contracts: a chunked round trip is byte-identical and verified; a tampered chunk or recipe stores
nothing; boundaries are content-defined (>= 95% of a 64 MiB file's chunks survive a 100-byte
insertion at 1 MiB); a changed version moves only the changed chunks both ways; concurrent pushers
sharing chunks both succeed; SIGKILL during a chunked push leaves no recipe naming a missing chunk
and a rerun completes; whole and chunked objects live side by side.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import _seaweed
import msgpack
import pytest
from _seaweed import BUCKET

import casstore
from casstore.errors import IntegrityError, StoreFormatError
from casstore.objects.chunking import DEFAULT_CHUNKING, Chunking, ChunkRef, Recipe, decode_recipe

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote_url = _seaweed.remote_url

MiB = 1 << 20
SMALL = Chunking(min_object=1 * MiB, avg_size=128 * 1024, min_size=32 * 1024, max_size=512 * 1024)


@pytest.fixture
def rem(seaweed: Any, remote_url: str) -> casstore.Remote:
    return casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False, chunking=SMALL)


def _keys(seaweed: Any, rem: casstore.Remote, kind: str) -> Dict[str, int]:
    prefix = rem.url[len(f"s3://{BUCKET}/"):] + "/" + kind + "/"
    out: Dict[str, int] = {}
    for page in seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for c in page.get("Contents", ()):
            out[c["Key"]] = c["Size"]
    return out


def _no_recipe_names_a_missing_chunk(seaweed: Any, rem: casstore.Remote) -> int:
    chunks = {k.rsplit("/", 2)[-2] + k.rsplit("/", 1)[-1] for k in _keys(seaweed, rem, "chunks")}
    n = 0
    for key in _keys(seaweed, rem, "recipes"):
        h = key.rsplit("/", 2)[-2] + key.rsplit("/", 1)[-1]
        data = seaweed.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
        recipe = decode_recipe(data, casstore.Digest(h), key)
        missing = [c.digest for c in recipe.chunks if c.digest.hex not in chunks]
        assert not missing, f"recipe {key} names missing chunks {missing[:3]}"
        n += 1
    return n


def _mutate(data: bytes, seed: int, frac: float = 0.01) -> bytes:
    """``frac`` of the bytes rewritten in one run, as rows of a dataset rewritten in place."""
    rng = random.Random(seed)
    n = int(len(data) * frac)
    off = rng.randrange(0, len(data) - n)
    return data[:off] + rng.randbytes(n) + data[off + n:]


def test_boundaries_are_content_defined() -> None:
    data = random.Random(1).randbytes(64 * MiB)
    edited = data[:MiB] + b"x" * 100 + data[MiB:]
    a = DEFAULT_CHUNKING.recipe(casstore.Digest.of(data), memoryview(data))
    b = DEFAULT_CHUNKING.recipe(casstore.Digest.of(edited), memoryview(edited))
    before = {c.digest for c in a.chunks}
    survived = sum(1 for c in b.chunks if c.digest in before)
    assert survived >= 0.95 * len(a.chunks), (survived, len(a.chunks))
    assert 32 <= len(a.chunks) <= 128  # about 1 MiB on average
    assert sum(c.length for c in a.chunks) == len(data)


def test_round_trip_layout_and_only_changes_move(tmp_path: Path, rem: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    v1 = random.Random(2).randbytes(12 * MiB)
    small = b"tiny" * 100
    with a.edit("ds") as m:
        m["data.bin"] = d1 = a.put(v1)
        m["small"] = a.put(small)
    rep = a.push(rem, "ds")
    recipes, chunks, objects = (_keys(seaweed, rem, k) for k in ("recipes", "chunks", "objects"))
    assert len(recipes) == 1 and not any(k.endswith(d1.hex[2:]) for k in objects)  # chunked, not whole
    assert sum(chunks.values()) == len(v1) and len(chunks) >= 30
    assert rep.bytes <= len(v1) + len(small) + 10_000
    b = casstore.open(tmp_path / "b")
    b.pull(rem, "ds")
    assert b.get(d1) == v1 and b.get(a.manifest("ds")["small"].digest) == small
    # Version 2: 1% of the bytes rewritten in place.
    v2 = _mutate(v1, 3)
    with a.edit("ds") as m:
        m["data.bin"] = d2 = a.put(v2)
    rep = a.push(rem, "ds")
    assert rep.bytes <= 0.05 * len(v2), rep  # the chunks around the edit, not 12 MiB
    rep = b.pull(rem, "ds")
    assert rep.bytes <= 0.05 * len(v2), rep
    assert b.get(d2) == v2
    assert _no_recipe_names_a_missing_chunk(seaweed, rem) == 2


def test_tampered_chunk_or_recipe_stores_nothing(tmp_path: Path, rem: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    data = random.Random(4).randbytes(3 * MiB)
    with a.edit("x") as m:
        m["f"] = d = a.put(data)
    a.push(rem, "x")
    client = seaweed.client()
    chunk_key = sorted(_keys(seaweed, rem, "chunks"))[0]
    good = client.get_object(Bucket=BUCKET, Key=chunk_key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=chunk_key, Body=bytes([good[0] ^ 1]) + good[1:])
    b = casstore.open(tmp_path / "b")
    with pytest.raises(IntegrityError, match="chunk"):
        b.pull(rem, "x")
    assert not b.objects.has(d) and b.heads() == {} and os.listdir(b.root / "tmp") == []
    client.put_object(Bucket=BUCKET, Key=chunk_key, Body=good)
    (recipe_key,) = _keys(seaweed, rem, "recipes")
    good_recipe = client.get_object(Bucket=BUCKET, Key=recipe_key)["Body"].read()
    for bad in (b"\x93garbage", msgpack.packb({"format": "casstore-recipe", "v": 1, "object": d.raw,
                                               "size": len(data) + 1, "chunks": []})):
        client.put_object(Bucket=BUCKET, Key=recipe_key, Body=bad)
        with pytest.raises(StoreFormatError, match="recipe"):
            b.pull(rem, "x")
        assert not b.objects.has(d) and os.listdir(b.root / "tmp") == []
    # A recipe whose chunks are all genuine but belong to another object: the whole is checked.
    other = random.Random(5).randbytes(2 * MiB)
    with a.edit("y") as m:
        m["g"] = d_other = a.put(other)
    a.push(rem, "y")
    other_recipe = client.get_object(Bucket=BUCKET, Key=rem.objects.recipe_key(d_other))["Body"].read()
    doc = msgpack.unpackb(other_recipe)
    doc["object"], doc["size"] = d.raw, sum(n for _, n in doc["chunks"])
    client.put_object(Bucket=BUCKET, Key=recipe_key, Body=msgpack.packb(doc))
    with pytest.raises((IntegrityError, StoreFormatError)):
        b.pull(rem, "x")
    assert not b.objects.has(d)
    client.put_object(Bucket=BUCKET, Key=recipe_key, Body=good_recipe)
    b.pull(rem, "x")
    assert b.get(d) == data


@pytest.mark.parametrize("when", ["before", "during"])
def test_push_refuses_a_local_object_rewritten_before_or_while_its_chunks_go_up(
        tmp_path: Path, rem: casstore.Remote, seaweed: Any, when: str) -> None:
    """A local object rewritten in place (someone made it writable) before the push, or after its
    recipe was cut while its chunks go up: IntegrityError naming it, and no recipe on the remote;
    every chunk that did go up holds the bytes its name says."""
    a = casstore.open(tmp_path / "a")
    data = os.urandom(4 * MiB + 17)  # SMALL: about 32 chunks, sent 8 at a time
    with a.edit("h") as m:
        m["big"] = d = a.put(data)
    p = a.path(d)
    os.chmod(p, 0o644)

    def alter() -> None:
        with open(p, "r+b") as f:  # the last chunk's bytes, same size
            f.seek(-4096, os.SEEK_END)
            f.write(bytes(b ^ 0xFF for b in data[-4096:-4080]))

    if when == "during":
        # The first PUT is the push's marker for remote gc (sync/markers.py); the second, a chunk's.
        rem.objects.connection.requests = _seaweed.CallOnRequest("PutObject", alter, nth=2)
    else:
        alter()
    with pytest.raises(IntegrityError, match="not pushed") as ei:
        a.push(rem, "h")
    assert str(d) in str(ei.value)
    assert _keys(seaweed, rem, "recipes") == {} and _keys(seaweed, rem, "refs") == {}
    if when == "during":
        assert _keys(seaweed, rem, "chunks")  # it was caught mid-upload
    for key in _keys(seaweed, rem, "chunks"):
        body = seaweed.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert casstore.Digest.of(body).hex == key.rsplit("/", 2)[-2] + key.rsplit("/", 1)[-1]


@pytest.mark.parametrize("chunking", [SMALL, DEFAULT_CHUNKING], ids=["small", "default"])
@pytest.mark.parametrize("size", [0, 1, 300_000, 5 * MiB + 3, 23 * MiB + 11])
def test_a_recipe_read_from_a_stream_is_the_recipe_of_the_buffer(tmp_path: Path, chunking: Chunking,
                                                                 size: int) -> None:
    """``recipe_of`` (a file read once, in bounded memory: what a push does) cuts exactly where
    ``recipe`` cuts the same bytes in memory, and refuses a stream shorter, longer or other
    than the object."""
    rng = random.Random(size)
    data = rng.randbytes(size // 2) + bytes(size // 4) + rng.randbytes(size - size // 2 - size // 4)
    d = casstore.Digest.of(data)
    p = tmp_path / "f"
    p.write_bytes(data)
    with open(p, "rb", buffering=0) as f:
        streamed = chunking.recipe_of(d, f, size)
    assert streamed == chunking.recipe(d, memoryview(data))
    assert [c.length for c in streamed.chunks] == [n for _, n in chunking.cut(memoryview(data))]
    if size:
        other = bytearray(data)
        other[-1] ^= 1
        for bad, n in ((data[:-1], size), (data + b"x", size), (bytes(other), size)):
            p.write_bytes(bad)
            with open(p, "rb", buffering=0) as f:
                with pytest.raises(IntegrityError, match=d.hex[:16]):
                    chunking.recipe_of(d, f, n)


@pytest.mark.parametrize("chunking", [SMALL, DEFAULT_CHUNKING], ids=["small", "default"])
def test_a_recipe_of_a_file_that_keeps_growing_is_refused_not_read_forever(chunking: Chunking) -> None:
    """A local object appended to without end while a push cuts it: ``recipe_of`` reads at most
    one byte past the object's size and refuses it (it used to read until the writer stopped)."""

    class Endless:
        read = 0

        def readinto(self, b: memoryview, /) -> int:
            b[:] = bytes(len(b))
            self.read += len(b)
            return len(b)

    data = bytes(3 * chunking.max_size)
    f = Endless()
    with pytest.raises(IntegrityError, match="corrupt"):
        chunking.recipe_of(casstore.Digest.of(data), f, len(data))
    assert f.read == len(data) + 1


_TRUNCATE_DURING_PUSH = """
import os, sys
sys.path.insert(0, sys.argv[4])
import _seaweed
import casstore
from casstore.objects.chunking import Chunking
store = casstore.open(sys.argv[1])
small = Chunking(min_object=1 << 20, avg_size=128 * 1024, min_size=32 * 1024, max_size=512 * 1024)
rem = casstore.Remote(sys.argv[2], endpoint_url=sys.argv[3], progress=False, chunking=small)
d = store.heads()["h"]
path = store.path(store.manifest("h")["big"].digest)
os.chmod(path, 0o644)
size = os.stat(path).st_size
rem.objects.connection.requests = _seaweed.CallOnRequest(
    "PutObject", lambda: os.truncate(path, size // 2), nth=2)  # the push's marker, then the first chunk
try:
    store.push(rem, "h")
except casstore.IntegrityError as e:
    print("IntegrityError:", e)
"""


def test_a_local_object_truncated_while_its_chunks_go_up_is_an_error_not_a_crash(
        tmp_path: Path, rem: casstore.Remote, seaweed: Any) -> None:
    """The file is read, never mapped, so a truncation under a push is an IntegrityError ("not
    pushed", no recipe) and not SIGBUS, which killed the process while it read a map (run in a
    child process: a regression would kill it, not the test run)."""
    a = casstore.open(tmp_path / "a")
    with a.edit("h") as m:
        m["big"] = d = a.put(os.urandom(6 * MiB + 5))
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_DURING_PUSH, str(a.root), rem.url, seaweed.endpoint,
                        str(Path(__file__).parent)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "IntegrityError:" in r.stdout and "not pushed" in r.stdout and str(d) in r.stdout, r.stdout
    assert _keys(seaweed, rem, "recipes") == {} and _keys(seaweed, rem, "refs") == {}


def test_read_through_and_ranged_reads_of_a_chunked_object(tmp_path: Path, rem: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    data = random.Random(6).randbytes(5 * MiB + 7)
    with a.edit("x") as m:
        m["f"] = d = a.put(data)
    a.push(rem, "x")
    b = casstore.open(tmp_path / "b", upstream=False)
    b.objects.upstream = casstore.sync.RemoteUpstream.of(rem, ranged_min=1 * MiB)
    with b.open(d) as f:
        f.seek(3 * MiB + 5)
        assert f.read(1000) == data[3 * MiB + 5:3 * MiB + 1005]
    assert not b.objects.has(d)
    assert b.get(d) == data and b.objects.has(d)


_PUSHER = r"""
import os, random, sys
import casstore
from casstore.objects.chunking import Chunking
root, url, endpoint, seed, name = sys.argv[1:6]
SMALL = Chunking(min_object=1 << 20, avg_size=128 * 1024, min_size=32 * 1024, max_size=512 * 1024)
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False, chunking=SMALL)
s = casstore.open(root)
base = random.Random(7).randbytes(8 << 20)
mine = bytearray(base)
rng = random.Random(int(seed))
for _ in range(10):
    off = rng.randrange(0, len(mine) - 4096)
    mine[off:off + 4096] = rng.randbytes(4096)
with s.edit(name) as m:
    m["data"] = s.put(bytes(mine))
s.push(rem, name)
print("pushed")
"""


def test_concurrent_pushers_sharing_chunks_both_succeed(tmp_path: Path, rem: casstore.Remote, seaweed: Any) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", _PUSHER, str(tmp_path / f"s{i}"), rem.url, seaweed.endpoint,
                               str(i), f"exp{i}"], stdout=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and all("pushed" in o for o in outs)
    assert _no_recipe_names_a_missing_chunk(seaweed, rem) == 2
    chunk_keys = _keys(seaweed, rem, "chunks")
    b = casstore.open(tmp_path / "b")
    b.pull(rem)
    recipes = [rem.objects.read_recipe(b.manifest(f"exp{i}")["data"].digest) for i in range(2)]
    assert all(r is not None for r in recipes)
    unique: Set[casstore.Digest] = {c.digest for r in recipes if r is not None for c in r.chunks}
    assert len(chunk_keys) == len(unique)  # each shared chunk stored once
    assert len(unique) < sum(len(r.chunks) for r in recipes if r is not None)  # and they did share


_KILLED_PUSH = r"""
import os, random, sys
import casstore
from casstore.objects.chunking import Chunking
root, url, endpoint = sys.argv[1:4]
SMALL = Chunking(min_object=1 << 20, avg_size=64 * 1024, min_size=16 * 1024, max_size=256 * 1024)
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False, chunking=SMALL, workers=2)
s = casstore.open(root)
print("go", flush=True)
s.push(rem, "big")
print("done", flush=True)
"""


TINY = Chunking(min_object=1 * MiB, avg_size=64 * 1024, min_size=16 * 1024, max_size=256 * 1024)


def _store_of_blobs(root: Path, seed: int, size: int) -> Tuple[casstore.Store, List[bytes]]:
    """A store whose head ``big`` holds four random blobs of ``size`` bytes."""
    a = casstore.open(root)
    blobs = [random.Random(seed + i).randbytes(size) for i in range(4)]
    with a.edit("big") as m:
        for i, blob in enumerate(blobs):
            m[f"f{i}"] = a.put(blob)
    return a, blobs


def _run_and_kill(script: str, args: List[str], delay: float) -> None:
    """Start ``script`` in a process, wait for its "go", let it run ``delay`` s, SIGKILL it."""
    p = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "go"
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_sigkill_during_chunked_push_then_rerun(tmp_path: Path, seaweed: Any, remote_url: str) -> None:
    rem = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False, chunking=TINY)
    a, blobs = _store_of_blobs(tmp_path / "a", 10, 4 * MiB)
    killed_midway = 0
    completed = False  # on a slow or fast machine one of the later runs may finish before its kill
    for delay in (0.4, 0.8, 1.2):
        _run_and_kill(_KILLED_PUSH, [str(tmp_path / "a"), remote_url, seaweed.endpoint], delay)
        _no_recipe_names_a_missing_chunk(seaweed, rem)
        if len(_keys(seaweed, rem, "recipes")) < 4:
            killed_midway += 1
        if _keys(seaweed, rem, "refs"):
            completed = True
            break
    assert killed_midway >= 1, "no kill landed before the push finished; the test proved nothing"
    rep = a.push(rem, "big")
    assert rep.refs == {"heads/big": "up to date" if completed else "created"}
    assert _no_recipe_names_a_missing_chunk(seaweed, rem) == 4
    b = casstore.open(tmp_path / "b")
    b.pull(rem, "big")
    assert [b.get(e.digest) for _, e in sorted(b.manifest("big").items())] == blobs


def test_whole_and_chunked_objects_live_side_by_side(tmp_path: Path, seaweed: Any, remote_url: str) -> None:
    whole = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False, chunking=None)
    chunked = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False, chunking=SMALL)
    a = casstore.open(tmp_path / "a")
    old, new = random.Random(20).randbytes(3 * MiB), random.Random(21).randbytes(3 * MiB)
    with a.edit("old") as m:
        m["f"] = d_old = a.put(old)
    a.push(whole, "old")  # written before issue 16: a whole object
    with a.edit("new") as m:
        m["f"] = d_new = a.put(new)
    a.push(chunked, "new")
    b = casstore.open(tmp_path / "b")
    b.pull(chunked)
    assert b.get(d_old) == old and b.get(d_new) == new
    assert chunked.objects.present([d_old, d_new]) == {d_old, d_new}
    # A client that pushes whole objects still reads both forms.
    c = casstore.open(tmp_path / "c")
    c.pull(whole)
    assert c.get(d_old) == old and c.get(d_new) == new


def test_hostile_recipes_are_refused() -> None:
    d = casstore.Digest.of(b"x" * 10)
    ok = Recipe(d, 10, (ChunkRef(casstore.Digest.of(b"x" * 10), 0, 10),))
    assert decode_recipe(ok.encode(), d, "here") == ok
    bad: List[bytes] = [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"format": "casstore-recipe", "v": 2, "object": d.raw, "size": 10, "chunks": []}),
        msgpack.packb({"format": "casstore-recipe", "v": 1, "object": b"\0" * 32, "size": 10, "chunks": []}),
        msgpack.packb({"format": "casstore-recipe", "v": 1, "object": d.raw, "size": 10,
                       "chunks": [[d.raw, 5], [d.raw, 4]]}),
        msgpack.packb({"format": "casstore-recipe", "v": 1, "object": d.raw, "size": 10,
                       "chunks": [[d.raw, 0], [d.raw, 10]]}),
        msgpack.packb({"format": "casstore-recipe", "v": 1, "object": d.raw, "size": 1 << 40,
                       "chunks": [[d.raw, 1 << 40]]}),
        msgpack.packb({"format": "casstore-recipe", "v": 1, "object": d.raw, "size": 10,
                       "chunks": [["nope", 10]]}),
        msgpack.packb({"format": "casstore-recipe", "v": 1, "object": d.raw, "size": True,
                       "chunks": [[d.raw, True]]}),
    ]
    for data in bad:
        with pytest.raises(StoreFormatError):
            decode_recipe(data, d, "here")
    with pytest.raises(StoreFormatError, match="upgrade casstore"):
        decode_recipe(bad[3], d, "here")


def test_a_manifest_version_stored_as_chunks_is_pulled(tmp_path: Path, rem: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    with a.edit("big-meta") as m:
        m["f"] = a.put(b"payload")
        m.meta["notes"] = "n" * (2 * MiB)  # the version object itself is over SMALL.min_object
    v = a.heads()["big-meta"]
    assert a.stat(v).size >= SMALL.min_object
    a.push(rem, "big-meta")
    assert rem.objects.read_recipe(v) is not None  # the version went up as chunks
    b = casstore.open(tmp_path / "b")
    b.pull(rem, "big-meta")
    assert b.manifest("big-meta").meta["notes"] == "n" * (2 * MiB)


def test_push_replaces_empty_keys_a_killed_put_left(tmp_path: Path, seaweed: Any, remote_url: str) -> None:
    """SeaweedFS keeps a 0-byte object when a client dies mid-PUT (seen with SIGKILLed pushes): the
    next push must not count such a chunk, recipe or whole object as present, and replaces it."""
    rem = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False, chunking=SMALL)
    a = casstore.open(tmp_path / "a")
    big, small = random.Random(30).randbytes(3 * MiB), random.Random(31).randbytes(5000)
    with a.edit("x") as m:
        m["big"] = d_big = a.put(big)
        m["small"] = d_small = a.put(small)
    recipe = SMALL.recipe(d_big, memoryview(big))
    client = seaweed.client()
    for key in (rem.objects.chunk_key(recipe.chunks[1].digest), rem.objects.recipe_key(d_big),
                rem.objects.key(d_small)):
        client.put_object(Bucket=BUCKET, Key=key, Body=b"")  # what a cut-off PUT left behind
    a.push(rem, "x")
    assert _no_recipe_names_a_missing_chunk(seaweed, rem) == 1
    b = casstore.open(tmp_path / "b")
    b.pull(rem, "x")
    assert b.get(d_big) == big and b.get(d_small) == small
    # A chunk cut off to a few bytes, seen by a pusher of the same object before any recipe names it.
    key = rem.objects.chunk_key(recipe.chunks[0].digest)
    client.put_object(Bucket=BUCKET, Key=key, Body=b"cut")
    rem.objects.upload_chunked(recipe, lambda off, n: big[off:off + n])
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == big[:recipe.chunks[0].length]


def test_repeated_chunks_and_a_stale_chunk_index(tmp_path: Path, rem: casstore.Remote) -> None:
    """Chunks that repeat inside an object are downloaded once and copied; a chunk the local index
    names in an object that is gone since is downloaded instead (and counted as moved)."""
    rng = random.Random(40)
    v1 = rng.randbytes(1 * MiB) + bytes(3 * MiB) + rng.randbytes(1 * MiB)  # zeros: the same chunk, repeated
    recipe = SMALL.recipe(casstore.Digest.of(v1), memoryview(v1))
    assert len({c.digest for c in recipe.chunks}) < len(recipe.chunks)
    a = casstore.open(tmp_path / "a")
    with a.edit("x") as m:
        m["f"] = d1 = a.put(v1)
    a.push(rem, "x")
    b = casstore.open(tmp_path / "b")
    rep = b.pull(rem, "x")
    assert b.get(d1) == v1
    unique = {c.digest: c.length for c in recipe.chunks}
    assert rep.bytes == sum(unique.values())  # each distinct chunk moved once
    # v2 shares most chunks with v1; b's copy of v1 disappears (gc, a hand) but its index entries stay.
    v2 = v1[:2 * MiB] + rng.randbytes(4096) + v1[2 * MiB:]
    with a.edit("x") as m:
        m["f"] = d2 = a.put(v2)
    a.push(rem, "x")
    c = casstore.open(tmp_path / "c")
    c.pull(rem, "x")  # c holds v2: its index names v2's chunks
    os.chmod(c.objects.locate(d2).path, 0o644)
    os.unlink(c.objects.locate(d2).path)
    with a.edit("y") as m:
        m["f"] = d1
    a.push(rem, "y")
    rep = c.pull(rem, "y")  # the index says v1's chunks are in v2, which is gone: all downloaded
    assert c.get(d1) == v1
    assert rep.bytes == sum(unique.values())


_KILLED_PULL = r"""
import sys
import casstore
root, url, endpoint = sys.argv[1:4]
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False, workers=2)
s = casstore.open(root)
print("go", flush=True)
s.pull(rem, "big")
print("done", flush=True)
"""


def test_sigkill_during_chunked_pull_then_rerun(tmp_path: Path, seaweed: Any, remote_url: str) -> None:
    rem = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False, chunking=TINY)
    a, blobs = _store_of_blobs(tmp_path / "a", 50, 6 * MiB)
    a.push(rem, "big")
    killed_midway = 0
    for delay in (0.3, 0.6, 0.9):
        _run_and_kill(_KILLED_PULL, [str(tmp_path / "b"), remote_url, seaweed.endpoint], delay)
        b = casstore.open(tmp_path / "b")  # opening sweeps the dead puller's staging files
        assert os.listdir(b.root / "tmp") == []
        have = [d for d in b.iter_objects() if b.objects.stat(d).size > 1 * MiB]
        for d in have:
            assert b.get(d) in blobs  # only whole, verified objects were published
        if b.heads() == {}:
            killed_midway += 1
        else:
            break
    assert killed_midway >= 1, "no kill landed before the pull finished; the test proved nothing"
    b = casstore.open(tmp_path / "b")
    b.pull(rem, "big")
    assert [b.get(e.digest) for _, e in sorted(b.manifest("big").items())] == blobs


def _counted(rem: casstore.Remote) -> Dict[str, int]:
    return dict(rem.objects.connection.requests)


def test_a_cut_off_recipe_is_replaced_by_the_next_push(tmp_path: Path, rem: casstore.Remote, seaweed: Any) -> None:
    """Hazard (bug hunt): a recipe key cut off mid-PUT counted as present (not empty), so no push ever
    repaired it and every pull failed with advice ("push the object again") that did nothing."""
    a = casstore.open(tmp_path / "a")
    big = random.Random(40).randbytes(3 * MiB)
    with a.edit("m") as m:
        m["big"] = d = a.put(big)
    a.push(rem, "m")
    key = rem.objects.recipe_key(d)
    client = seaweed.client()
    good = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    # A re-push of what this store pushed reads no recipe: the chunk index knows its length.
    gets = _counted(rem).get("GetObject", 0)
    a.push(rem, "m")
    assert _counted(rem).get("GetObject", 0) - gets == 2  # the pin and head refs, no recipe
    client.put_object(Bucket=BUCKET, Key=key, Body=good[: len(good) // 2])  # what a server keeping a cut PUT holds
    with pytest.raises(StoreFormatError, match="Push the object again"):
        casstore.open(tmp_path / "b").pull(rem, "m")
    a.push(rem, "m")
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == good
    c = casstore.open(tmp_path / "c")
    c.pull(rem, "m")
    assert c.get(d) == big


def _bomb(seaweed: Any, rem: casstore.Remote, d: casstore.Digest, n: int) -> None:
    """A recipe naming one 1 MiB chunk ``n`` times as the object ``d`` (a few dozen bytes per MiB)."""
    chunk = random.Random(41).randbytes(MiB)
    c = casstore.Digest.of(chunk)
    _seaweed.put_key(seaweed.client(), rem.url, f"chunks/{c.hex[:2]}/{c.hex[2:]}", chunk)
    recipe = Recipe(d, n * MiB, tuple(ChunkRef(c, i * MiB, MiB) for i in range(n)))
    _seaweed.put_key(seaweed.client(), rem.url, f"recipes/{d.hex[:2]}/{d.hex[2:]}", recipe.encode())


def test_a_lazy_pull_refuses_a_recipe_of_another_size_than_recorded(tmp_path: Path, rem: casstore.Remote,
                                                                    seaweed: Any) -> None:
    """Hazard (bug hunt): a 7-byte entry whose object the remote replaced by a recipe claiming 500 MiB (one
    chunk repeated) was accepted by a lazy pull; checkout's read-through then wrote 500 MiB."""
    a = casstore.open(tmp_path / "a")
    with a.edit("exp") as m:
        m["tiny.txt"] = d = a.put(b"payload")
    a.push(rem, "exp")
    seaweed.client().delete_object(Bucket=BUCKET, Key=rem.objects.key(d))
    _bomb(seaweed, rem, d, 20)
    s = casstore.open(tmp_path / "s", upstream=rem)
    with pytest.raises(casstore.ObjectNotFoundError, match="another size than recorded"):
        s.pull(rem, "exp", lazy=True)
    assert s.heads() == {}


def test_a_recipe_larger_than_the_disk_can_take_is_refused_before_a_byte_is_written(
        tmp_path: Path, rem: casstore.Remote, seaweed: Any) -> None:
    """Without a recorded size (a read-through get), a download stops before it would leave the store's
    filesystem less than its free-space floor (a 36 KB recipe made a get write 900 MiB, up to ~100 TB)."""
    import shutil

    d = casstore.Digest.of(b"whatever the attacker names")
    free = shutil.disk_usage(tmp_path).free
    _bomb(seaweed, rem, d, free // MiB + 16)
    s = casstore.open(tmp_path / "s", upstream=rem)
    with pytest.raises(casstore.DiskFullError, match="more than the store"):
        s.get(d)
    assert os.listdir(s.root / "tmp") == []
    assert shutil.disk_usage(tmp_path).free > free - 64 * MiB
    # An eager pull: the size the entry records (7 bytes) refuses the recipe before anything is written.
    a = casstore.open(tmp_path / "a")
    with a.edit("exp") as m:
        m["tiny.txt"] = tiny = a.put(b"payload")
    a.push(rem, "exp")
    seaweed.client().delete_object(Bucket=BUCKET, Key=rem.objects.key(tiny))
    _bomb(seaweed, rem, tiny, free // MiB + 16)
    t = casstore.open(tmp_path / "t")
    with pytest.raises(casstore.IntegrityError, match="larger"):
        t.pull(rem, "exp")
    assert os.listdir(t.root / "tmp") == [] and t.heads() == {}
