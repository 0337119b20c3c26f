"""``pull(lazy=True)`` of a version naming objects the remote does not have (bug hunt, defect B).

The rule (docs/remotes.md, lazy pull): no head or pin ever points at objects that cannot be
had.  A lazy pull brings refs and manifests only and leaves the entries to the store's
upstream, so before a ref moves it asks the remote -- by listing, never one request per
object -- whether it holds every entry object of the version pulled that the store lacks.
If not: ObjectNotFoundError naming the keys and digests missing, and nothing of the pull is
stored (no ref, no version, no node, no staging file).

The hostile remote state is built by hand with a plain boto3 client (tests/_seaweed.py
``put_key`` / ``put_object_bytes``), as in tests/test_hostile_remote.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import _seaweed
import blake3
import msgpack
import pytest
from _seaweed import put_key, put_object_bytes

import casstore
from casstore.errors import ObjectNotFoundError

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

GHOST = b"\x11" * 32  # an object no one ever uploaded
GHOST_HEX = GHOST.hex()


def manifest_bytes(entries: Dict[str, Any], parent: Optional[str] = None) -> bytes:
    """A manifest version built by hand (docs/format.md), keys in canonical order."""
    return msgpack.packb({"casstore": "manifest", "entries": dict(sorted(entries.items())), "meta": {},
                          "parent": bytes.fromhex(parent) if parent else None, "v": 1}, use_bin_type=True)


def entry(data: bytes) -> List[Any]:
    return [blake3.blake3(data).digest(), len(data)]


def plant(seaweed: Any, remote: casstore.Remote, kind: str, name: str, entries: Dict[str, Any],
          uploads: List[bytes]) -> str:
    """Upload ``uploads`` as objects, a version of ``entries``, and ``refs/<kind>/<name>`` naming it; the hex."""
    client = seaweed.client()
    for data in uploads:
        put_object_bytes(client, remote.url, data)
    top = put_object_bytes(client, remote.url, manifest_bytes(entries))
    put_key(client, remote.url, f"refs/{kind}/{name}", f"blake3:{top}\n".encode())
    return top


def object_files(store: casstore.Store) -> List[str]:
    base = store.root / "objects"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


def assert_nothing_stored(store: casstore.Store, before: List[str]) -> None:
    assert object_files(store) == before, "the refused lazy pull stored objects"
    assert store.heads() == {} and store.pins() == {}
    assert os.listdir(store.root / "tmp") == []


@pytest.mark.parametrize("kind", ["heads", "pins"])
def test_lazy_pull_of_a_version_naming_an_object_the_remote_lacks_publishes_nothing(
        tmp_path: Path, remote: casstore.Remote, seaweed: Any, kind: str) -> None:
    """The repro: {'o': [b'\\x11'*32, 6]} as ``missing``.  Before the fix the head was created,
    then checkout raised ObjectNotFoundError and verify reported the object LOST."""
    plant(seaweed, remote, kind, "missing", {"o": [GHOST, 6]}, [])
    b = casstore.open(tmp_path / "b", upstream=remote)
    before = object_files(b)
    with pytest.raises(ObjectNotFoundError) as ei:
        b.pull(remote, "missing", lazy=True)
    msg = str(ei.value)
    assert "'missing'" in msg and "'o'" in msg and GHOST_HEX in msg and "nothing" in msg, msg
    assert_nothing_stored(b, before)
    with pytest.raises(ObjectNotFoundError):
        b.pull(remote, lazy=True)  # every name the remote has: refused the same way
    assert_nothing_stored(b, before)
    # Once the remote has it, the same lazy pull goes through and checkout reads it through the upstream.
    ghost = b"sixsix"
    assert len(ghost) == 6
    put_object_bytes(seaweed.client(), remote.url, ghost)
    plant(seaweed, remote, kind, "missing", {"o": entry(ghost)}, [])
    assert b.pull(remote, "missing", lazy=True).refs == {f"{kind}/missing": "created"}
    b.checkout("missing", tmp_path / "co")
    assert (tmp_path / "co" / "o").read_bytes() == ghost
    assert b.verify().ok


def test_lazy_pull_names_every_missing_entry_and_not_the_present_ones(tmp_path: Path, remote: casstore.Remote,
                                                                      seaweed: Any) -> None:
    here = [b"present %d " % i * 50 for i in range(5)]
    entries: Dict[str, Any] = {f"ok{i}": entry(x) for i, x in enumerate(here)}
    entries["gone-a"] = [GHOST, 6]
    entries["gone-b"] = [b"\x22" * 32, 9]
    plant(seaweed, remote, "heads", "h", entries, here)
    b = casstore.open(tmp_path / "b", upstream=remote)
    before = object_files(b)
    with pytest.raises(ObjectNotFoundError, match=r"2 object\(s\)") as ei:
        b.pull(remote, "h", lazy=True)
    msg = str(ei.value)
    assert "'gone-a'" in msg and "'gone-b'" in msg and "ok0" not in msg, msg
    assert_nothing_stored(b, before)


def test_a_damaged_remote_copy_of_another_size_counts_as_missing(tmp_path: Path, remote: casstore.Remote,
                                                                 seaweed: Any) -> None:
    """A key the server kept cut short (SeaweedFS was seen keeping 0 bytes after a client died mid-PUT)
    cannot be had either: the listing's size must be the one the entry records."""
    data = b"whole object bytes" * 10
    put_object_bytes(seaweed.client(), remote.url, b"", under=blake3.blake3(data).hexdigest())
    plant(seaweed, remote, "heads", "cut", {"x": entry(data)}, [])
    b = casstore.open(tmp_path / "b", upstream=remote)
    before = object_files(b)
    with pytest.raises(ObjectNotFoundError, match="'x'"):
        b.pull(remote, "cut", lazy=True)
    assert_nothing_stored(b, before)


def test_objects_already_local_need_not_be_on_the_remote(tmp_path: Path, remote: casstore.Remote,
                                                         seaweed: Any) -> None:
    """The rule is about objects that cannot be had: one the store holds can."""
    mine = b"only in the local store"
    plant(seaweed, remote, "heads", "h", {"m": entry(mine)}, [])
    b = casstore.open(tmp_path / "b", upstream=remote)
    b.put(mine)
    assert b.pull(remote, "h", lazy=True).refs == {"heads/h": "created"}
    assert b.get(b.manifest("h")["m"].digest) == mine


def test_lazy_pull_asks_by_listing_not_one_request_per_object(tmp_path: Path, remote: casstore.Remote) -> None:
    """200 entries: no HeadObject, no GetObject of an entry, a few listing pages (cost by fan-out, not entries)."""
    a = casstore.open(tmp_path / "a", durable=False)
    with a.edit("many") as m:
        for i in range(200):
            m[f"f{i:03d}"] = a.put(b"entry %d" % i)
    a.push(remote, "many")
    b = casstore.open(tmp_path / "b", upstream=remote)
    rq = remote.requests
    rq.clear()
    assert b.pull(remote, "many", lazy=True).refs == {"heads/many": "created"}
    assert rq["HeadObject"] == 0, dict(rq)
    assert rq["GetObject"] <= 3, dict(rq)  # the refs (pin, then head) and the version: no entry
    assert 1 <= rq["ListObjectsV2"] <= 260, dict(rq)  # at most one page per fan-out prefix (256), plus refs


@pytest.mark.parametrize("way", ["listing", "heads"])
def test_both_ways_of_asking_find_missing_damaged_and_chunked_objects(tmp_path: Path, seaweed: Any,
                                                                      remote_url: str, way: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote larger than one listing page: the rest is listed, or (when listing would read many
    keys per object asked) asked by HEADs; both count a chunked object's recipe and refuse a missing
    or cut-short one."""
    import importlib

    pull_mod = importlib.import_module("casstore.sync.pull")  # the package exports the function under that name
    rem = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False)  # chunking on
    rem.list_page_size = 7  # the first page is truncated: the estimate decides
    monkeypatch.setattr(pull_mod, "_KEYS_PER_HEAD", 10**9 if way == "listing" else 1e-9, raising=False)
    a = casstore.open(tmp_path / "a", durable=False)
    big = os.urandom(5 << 20)  # chunked on push (min_object 4 MiB): a recipe, no whole-object key
    with a.edit("h") as m:
        for i in range(40):
            m[f"f{i:02d}"] = a.put(b"small %d" % i * 30)
        m["big"] = a.put(big)
    a.push(rem, "h")
    rq = rem.requests
    b = casstore.open(tmp_path / "b", upstream=rem)
    rq.clear()
    assert b.pull(rem, "h", lazy=True).refs == {"heads/h": "created"}
    assert (rq["HeadObject"] > 0) == (way == "heads"), dict(rq)
    assert b.get(b.manifest("h")["big"].digest) == big
    # A version naming one missing and one cut-short object besides the present ones.
    cut = b"cut short" * 9
    put_object_bytes(seaweed.client(), rem.url, cut[:4], under=blake3.blake3(cut).hexdigest())
    entries = {f"f{i:02d}": entry(b"small %d" % i * 30) for i in range(40)}
    entries.update({"gone": [GHOST, 6], "cut": entry(cut)})
    plant(seaweed, rem, "heads", "bad", entries, [])
    c = casstore.open(tmp_path / "c", upstream=rem)
    before = object_files(c)
    with pytest.raises(ObjectNotFoundError, match=r"2 object\(s\)") as ei:
        c.pull(rem, "bad", lazy=True)
    assert "'gone'" in str(ei.value) and "'cut'" in str(ei.value) and "f00" not in str(ei.value)
    assert_nothing_stored(c, before)
