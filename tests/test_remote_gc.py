"""Remote gc against a real SeaweedFS server: plans, grace by LastModified, refusals, the push/gc race, CLI.

No mocks: every test talks S3 to ``weed mini`` on 127.0.0.1 (tests/_seaweed.py).  The race test runs
four pushing processes and one collecting process at once and then checks, from a plain boto3
listing, that every ref's closure is on the remote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import _seaweed
import pytest
from _seaweed import check_remote_consistent, put_key, remote_listing, split_url

import casstore
from casstore.sync import markers

# Fixtures shared by every remote test module (one SeaweedFS server per session).
aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url


def objects_on(seaweed: Any, remote: casstore.Remote) -> Dict[str, int]:
    """hex -> size of every object key on the remote (plain boto3 listing)."""
    out: Dict[str, int] = {}
    for key, size in remote_listing(seaweed.client(), remote.url).items():
        parts = key.split("/")
        if len(parts) >= 3 and parts[-3] == "objects":
            out[parts[-2] + parts[-1]] = size
    return out


def marker_keys(seaweed: Any, remote: casstore.Remote) -> List[str]:
    return [k for k in remote_listing(seaweed.client(), remote.url) if "/locks/" in k]


def put(store: casstore.Store, data: bytes) -> casstore.Digest:
    return store.put(data)


def history_setup(tmp: Path, remote: casstore.Remote) -> Tuple[casstore.Store, Dict[str, casstore.Digest]]:
    """Head 'h' pushed after each of 3 versions (key 'x' replaced each time), pin 'p', an orphan object.

    Returns the store and named digests: o1..o3 (x of v1..v3), v1..v3, q (pinned), orphan.
    """
    a = casstore.open(tmp / "a")
    d: Dict[str, casstore.Digest] = {}
    for i in (1, 2, 3):
        with a.edit("h") as m:
            m["x"] = d[f"o{i}"] = a.put(f"object of version {i}".encode() + os.urandom(100))
            m["same"] = a.put(b"in every version")
        d[f"v{i}"] = a.heads()["h"]
        a.push(remote, "h")
    d["same"] = casstore.Digest.of(b"in every version")
    with a.edit("p") as m:
        m["q"] = d["q"] = a.put(b"pinned data" + os.urandom(50))
    d["p"] = a.freeze("p")
    a.push(remote, "p")
    orphan = b"nobody references me" + os.urandom(50)
    d["orphan"] = casstore.Digest.of(orphan)
    assert remote.objects.write(d["orphan"], orphan)
    return a, d


def test_dry_run_deletes_nothing_and_explains(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a, d = history_setup(tmp_path, remote)
    before = remote_listing(seaweed.client(), remote.url)
    plan = a.plan_gc(keep_history=1, grace=0, remote=remote)
    assert isinstance(plan, casstore.RemoteGCPlan)
    assert remote_listing(seaweed.client(), remote.url) == before  # a plan writes nothing, not even a marker
    assert set(plan.objects) == {d["v1"], d["o1"], d["orphan"]}
    assert plan.objects[0] == d["v1"]  # expired versions go first
    assert plan.freed_bytes == sum(objects_on(seaweed, remote)[x.hex] for x in plan.objects)
    assert plan.why(d["o3"]) == "kept: entry 'x' of head 'h'"
    assert plan.why(d["o2"]) == "kept: entry 'x' of head 'h', 1 version back"
    assert plan.why(d["v2"]) == "kept: manifest version of head 'h', 1 version back"
    assert plan.why(d["q"]) == "kept: entry 'q' of pin 'p'"
    assert plan.why(d["o1"]).startswith("deleted: unreferenced")
    assert plan.why(d["v1"]).startswith("deleted: an expired manifest version")
    assert plan.why(d["orphan"]).startswith("deleted: unreferenced")
    assert plan.why(casstore.Digest.of(b"never there")) == "not on the remote when planned"
    assert {k.hex for k in plan.kept} == set(objects_on(seaweed, remote)) - {x.hex for x in plan.objects}
    assert "3 objects (1 expired manifest versions) would be deleted" in plan.summary()
    assert plan.roots == {"head:h": d["v3"], "pin:p": d["p"]}
    doc = plan.to_dict(objects=True)
    assert doc["objects"] == 3 and doc["expired_versions"] == 1 and len(doc["delete"]) == 3
    json.dumps(doc)
    # Nothing was deleted by planning, and a second plan says the same.
    assert set(a.plan_gc(keep_history=1, grace=0, remote=remote).objects) == set(plan.objects)


@pytest.mark.parametrize("keep", [0, 2])
def test_apply_deletes_exactly_the_unreachable(tmp_path: Path, remote: casstore.Remote, seaweed: Any,
                                              keep: int) -> None:
    a, d = history_setup(tmp_path, remote)
    before = set(objects_on(seaweed, remote))
    plan = a.plan_gc(keep_history=keep, grace=0, remote=remote)
    expect = {"orphan"} | ({"v1", "o1", "v2", "o2"} if keep == 0 else set())
    assert {x.hex for x in plan.objects} == {d[k].hex for k in expect}
    res = plan.execute()
    assert set(res.deleted) == {d[k] for k in expect} and not res.skipped and not res.failed
    assert res.freed_bytes == plan.freed_bytes
    after = set(objects_on(seaweed, remote))
    assert after == before - {d[k].hex for k in expect}
    # Pins, heads and the kept history are all there; every ref's closure is complete.
    kept = {"v3", "o3", "same", "p", "q"} | ({"v2", "o2", "v1", "o1"} if keep == 2 else set())
    assert {d[k].hex for k in kept} <= after
    assert check_remote_consistent(seaweed.client(), remote.url) == {"heads/h": str(d["v3"]), "pins/p": str(d["p"])}
    assert marker_keys(seaweed, remote) == []  # the gc marker is removed
    # A fresh store pulls everything back.
    b = casstore.open(tmp_path / "b")
    b.pull(remote)
    assert b.manifest("h")["x"].digest == d["o3"] and b.manifest("p")["q"].digest == d["q"]
    # Nothing is left to collect.
    assert a.plan_gc(keep_history=keep, grace=0, remote=remote).objects == ()


def test_execute_rereads_the_roots_and_spares_what_became_referenced(tmp_path: Path, remote: casstore.Remote,
                                                                      seaweed: Any) -> None:
    a, d = history_setup(tmp_path, remote)
    plan = a.plan_gc(keep_history=0, grace=0, remote=remote)
    assert d["orphan"] in plan.objects and d["o2"] in plan.objects
    # After the plan, a push from another machine names the orphan (deduped: it is old and already there).
    b = casstore.open(tmp_path / "b")
    with b.edit("late") as m:
        m["adopted"] = b.put(remote.objects.read(d["orphan"]))
    rep = b.push(remote, "late")
    assert rep.present >= 1  # the orphan was not uploaded again: the dangerous, deduped case
    res = plan.execute()
    assert res.skipped == {d["orphan"]: "now referenced: entry 'adopted' of head 'late'"}
    assert set(res.deleted) == set(plan.objects) - {d["orphan"]}
    assert d["orphan"].hex in objects_on(seaweed, remote)
    check_remote_consistent(seaweed.client(), remote.url)


def test_grace_keeps_young_objects_by_server_time(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    old = [os.urandom(64) for _ in range(3)]
    for x in old:
        remote.objects.write(casstore.Digest.of(x), x)
    time.sleep(3.2)  # LastModified has one-second resolution on SeaweedFS
    young = [os.urandom(64) for _ in range(3)]
    for x in young:
        remote.objects.write(casstore.Digest.of(x), x)
    store = casstore.open(tmp_path / "s")
    plan = store.plan_gc(grace="2s", remote=remote)
    assert set(plan.objects) == {casstore.Digest.of(x) for x in old}
    for x in young:
        assert plan.why(casstore.Digest.of(x)).startswith("kept: fresh: uploaded ")
    # A long grace keeps everything.
    assert store.plan_gc(grace="1h", remote=remote).objects == ()
    plan.execute()
    assert set(objects_on(seaweed, remote)) == {casstore.Digest.of(x).hex for x in young}


# -- refusals ---------------------------------------------------------------------------------


def test_ref_to_missing_version_makes_gc_refuse(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a, d = history_setup(tmp_path, remote)
    before = remote_listing(seaweed.client(), remote.url)
    plan = a.plan_gc(keep_history=0, grace=0, remote=remote)  # made while the remote was sound
    assert remote.refs.compare_and_swap("heads", "broken", casstore.Digest.of(b"not on the remote"), None)
    before = remote_listing(seaweed.client(), remote.url)
    with pytest.raises(casstore.ObjectNotFoundError, match="refused, nothing was deleted"):
        a.plan_gc(keep_history=0, grace=0, remote=remote)
    with pytest.raises(casstore.ObjectNotFoundError, match="refused, nothing was deleted"):
        plan.execute()  # the roots are read again before any delete
    after = remote_listing(seaweed.client(), remote.url)
    assert {k: v for k, v in after.items() if "/locks/" not in k} == before
    assert marker_keys(seaweed, remote) == []


def test_corrupt_or_undecodable_manifest_makes_gc_refuse(tmp_path: Path, remote: casstore.Remote,
                                                          seaweed: Any) -> None:
    a, d = history_setup(tmp_path, remote)
    client = seaweed.client()
    # A kept version whose bytes were replaced (tampering): they no longer hash to the key.
    key = remote.objects.key(d["v2"])
    bucket, _ = split_url(remote.url)
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=good[:-1] + bytes([good[-1] ^ 1]))
    before = remote_listing(client, remote.url)
    with pytest.raises(casstore.IntegrityError, match="refused, nothing was deleted"):
        a.plan_gc(keep_history=1, grace=0, remote=remote)
    client.put_object(Bucket=bucket, Key=key, Body=good)
    # A ref naming an object that is not a manifest at all.
    junk = b"just some bytes, not msgpack"
    remote.objects.write(casstore.Digest.of(junk), junk)
    assert remote.refs.compare_and_swap("pins", "junk", casstore.Digest.of(junk), None)
    with pytest.raises(casstore.StoreFormatError, match="refused, nothing was deleted"):
        a.plan_gc(keep_history=1, grace=0, remote=remote)
    # A ref key that holds no digest.
    put_key(client, remote.url, "refs/heads/garbled", b"hello\n")
    remote.refs.compare_and_swap("pins", "junk", None, remote.refs.read("pins", "junk"))
    with pytest.raises(casstore.StoreFormatError, match="damaged"):
        a.plan_gc(keep_history=1, grace=0, remote=remote)
    assert set(objects_on(seaweed, remote)) >= {k.split("/")[-2] + k.split("/")[-1]
                                                for k in before if "/objects/" in k}


def test_current_version_missing_an_entry_makes_gc_refuse(tmp_path: Path, remote: casstore.Remote,
                                                          seaweed: Any) -> None:
    a, d = history_setup(tmp_path, remote)
    bucket, _ = split_url(remote.url)
    seaweed.client().delete_object(Bucket=bucket, Key=remote.objects.key(d["q"]))  # deleted by hand
    before = remote_listing(seaweed.client(), remote.url)
    with pytest.raises(casstore.ObjectNotFoundError, match="pin 'p' names version .* missing on the remote"):
        a.plan_gc(keep_history=0, grace=0, remote=remote)
    assert remote_listing(seaweed.client(), remote.url) == before
    # The remedy the message names: pushing the name again uploads what the remote lacks.
    assert a.push(remote, "p").objects == 1
    assert set(a.plan_gc(keep_history=0, grace=0, remote=remote).objects) == {d[k] for k in ("v1", "o1", "v2", "o2",
                                                                                          "orphan")}


# -- markers: a gc waits for pushes, a push waits for a gc ----------------------------------------


def test_gc_waits_for_a_push_in_progress_and_ignores_dead_markers(tmp_path: Path, remote: casstore.Remote,
                                                                  seaweed: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a, d = history_setup(tmp_path, remote)
    client = seaweed.client()
    key = put_key(client, remote.url, "locks/push/live-one", b"{}")
    bucket, _ = split_url(remote.url)
    threading.Timer(1.5, lambda: client.delete_object(Bucket=bucket, Key=key)).start()
    plan = a.plan_gc(keep_history=0, grace=0, remote=remote)
    res = plan.execute()
    assert res.waited_seconds >= 1.0 and set(res.deleted) == set(plan.objects)
    # A marker nobody beats any more (its pusher was killed) stops blocking after STALE_SECONDS.
    monkeypatch.setattr(markers, "STALE_SECONDS", 2.0)
    dead = put_key(client, remote.url, "locks/push/dead-one", b"{}")
    remote.objects.write(casstore.Digest.of(b"another orphan"), b"another orphan")
    time.sleep(1.1)
    res = a.plan_gc(keep_history=0, grace=0, remote=remote).execute()
    assert res.stale_markers == (dead,) and res.deleted == (casstore.Digest.of(b"another orphan"),)
    with pytest.raises(casstore.LockTimeout, match="push"):
        put_key(client, remote.url, "locks/push/busy", b"{}")
        remote.objects.write(casstore.Digest.of(b"third orphan"), b"third orphan")
        a.plan_gc(keep_history=0, grace=0, remote=remote).execute(timeout=0.5)
    assert casstore.Digest.of(b"third orphan").hex in objects_on(seaweed, remote)


def test_push_waits_while_a_gc_is_deleting(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    with a.edit("h") as m:
        m["x"] = a.put(b"x")
    client = seaweed.client()
    key = put_key(client, remote.url, "locks/gc/running", b"{}")
    bucket, _ = split_url(remote.url)
    out: Dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(rep=a.push(remote, "h")))
    t.start()
    time.sleep(1.5)
    assert t.is_alive() and remote.refs.read("heads", "h") is None
    # It backs off while waiting: its marker is up only around each look (announce, list, withdraw), so
    # a gc that starts now is not kept waiting by it (with the marker kept up, the two would wait for
    # each other and this gc would time out). A single listing could catch the marker mid-look.
    orphan = casstore.Digest.of(b"an orphan")
    remote.objects.write(orphan, b"an orphan")
    res = a.plan_gc(keep_history=0, grace=0, remote=remote).execute(timeout=10)
    assert res.deleted == (orphan,) and t.is_alive() and remote.refs.read("heads", "h") is None
    client.delete_object(Bucket=bucket, Key=key)
    t.join(30)
    assert out["rep"].refs == {"heads/h": "created"}
    check_remote_consistent(client, remote.url)
    assert marker_keys(seaweed, remote) == []


def test_push_whose_marker_lapsed_rechecks_its_closure(tmp_path: Path, remote: casstore.Remote, seaweed: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A push stalled past STALE_SECONDS may have been judged dead and had a deduped object collected:
    before its ref moves it announces itself again and uploads what is gone."""
    import casstore._faults

    a = casstore.open(tmp_path / "a")
    old = a.put(b"an old object, already on the remote")
    remote.objects.write(old, b"an old object, already on the remote")
    with a.edit("h") as m:
        m["old"] = old
        m["new"] = a.put(b"new")
    monkeypatch.setattr(markers, "STALE_SECONDS", 1.0)
    bucket, _ = split_url(remote.url)

    def hook(point: str) -> None:
        if point == "remote.before-refs":
            time.sleep(0.8)  # past HELD_MARGIN * STALE_SECONDS: the marker may be judged dead
            seaweed.client().delete_object(Bucket=bucket, Key=remote.objects.key(old))  # ... and a gc ran

    monkeypatch.setattr(casstore._faults, "hook", hook)
    rep = a.push(remote, "h")
    assert rep.refs == {"heads/h": "created"}
    check_remote_consistent(seaweed.client(), remote.url)
    assert old.hex in objects_on(seaweed, remote)


# -- the race: 4 pushing processes and a collecting one -------------------------------------------

PUSHER = r"""
import json, os, random, sys, time
import casstore, casstore._faults
from casstore.objects.chunking import Chunking
root, url, endpoint, me, rounds, stop, chunked = sys.argv[1:8]
rng = random.Random(int(me))
# chunked: the pool objects are stored as recipes + chunks on the remote (issue 16), so the deduped
# pieces a push counts on are recipes and chunks.
chunking = Chunking(min_object=1 << 20, avg_size=64 << 10, min_size=16 << 10, max_size=256 << 10)
pool_size = (1 << 20) + 4096 if chunked == "1" else 200
# Widen the window between "the remote has it, skip it" and the ref write: this is where a gc
# that does not wait for pushes would delete a deduped object.
casstore._faults.hook = lambda p: time.sleep(rng.random() * 0.15) if p == "remote.before-refs" else None
store = casstore.open(root, durable=False)
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False, workers=4, chunking=chunking)
pool = [store.put(b"pool %s %d " % (me.encode(), k) + os.urandom(pool_size)) for k in range(3)]
pins = []
for r in range(int(rounds)):
    with store.edit(f"h{me}") as m:
        m["cycled"] = pool[r % 3]          # old on the remote, unreferenced since 2 rounds: deduped
        m["fresh"] = store.put(os.urandom(300))
        m["round"] = store.put(b"round %d of %s" % (r, me.encode()))
    store.push(rem, f"h{me}")
    if r % 4 == 3:
        p = f"p{me}-{r}"
        store.pin(p, store.heads()[f"h{me}"])
        store.push(rem, p)
        pins.append(p)
print(json.dumps({"pins": pins}))
"""

COLLECTOR = r"""
import json, os, sys, time
import casstore
root, url, endpoint, stop = sys.argv[1:5]
store = casstore.open(root, durable=False)
rem = casstore.Remote(url, endpoint_url=endpoint, progress=False)
runs = deleted = skipped = 0
while not os.path.exists(stop):
    plan = store.plan_gc(keep_history=0, grace=0, remote=rem)
    res = plan.execute(timeout=120)
    runs += 1
    deleted += len(res.deleted)
    skipped += len(res.skipped)
print(json.dumps({"runs": runs, "deleted": deleted, "skipped": skipped}))
"""


def closures_on_remote(client: Any, url: str) -> Tuple[Dict[str, str], Set[str], Set[str], Set[str]]:
    """Like check_remote_consistent, but an entry may be stored chunked: its recipe and every chunk it
    names must be there, and the reassembled bytes must hash to the entry.  Returns the refs and the
    objects/, recipes/ and chunks/ keys (as hex) the refs' closures need."""
    import blake3
    import msgpack

    from casstore.objects.chunking import decode_recipe

    bucket, prefix = split_url(url)
    keys = remote_listing(client, url)
    get = lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read()  # noqa: E731
    fan = lambda kind, h: f"{prefix}{kind}/{h[:2]}/{h[2:]}"  # noqa: E731
    refs: Dict[str, str] = {}
    need_o: Set[str] = set()
    need_r: Set[str] = set()
    need_c: Set[str] = set()
    for key in keys:
        if not key.startswith(prefix + "refs/"):
            continue
        v = get(key).decode().strip()[len("blake3:"):]
        refs[key[len(prefix + "refs/"):]] = "blake3:" + v
        assert fan("objects", v) in keys, f"{key}: version {v} missing"
        need_o.add(v)
        for entry in msgpack.unpackb(get(fan("objects", v)), raw=False)["entries"].values():
            h = entry[0].hex()
            if fan("objects", h) in keys:
                assert blake3.blake3(get(fan("objects", h))).hexdigest() == h
                need_o.add(h)
                continue
            assert fan("recipes", h) in keys, f"{key}: entry {h} missing (neither whole nor chunked)"
            need_r.add(h)
            recipe = decode_recipe(get(fan("recipes", h)), casstore.Digest(h), "test")
            data = b""
            for c in recipe.chunks:
                assert fan("chunks", c.digest.hex) in keys, f"{key}: chunk {c.digest.hex} of {h} missing"
                need_c.add(c.digest.hex)
                data += get(fan("chunks", c.digest.hex))
            assert blake3.blake3(data).hexdigest() == h
    return refs, need_o, need_r, need_c


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_gc_racing_four_pushers_never_leaves_a_dangling_ref(tmp_path: Path, remote: casstore.Remote,
                                                            seaweed: Any, chunked: bool) -> None:
    n, rounds = 4, 12
    stop = tmp_path / "stop"
    gc_store = casstore.open(tmp_path / "gc")
    collector = subprocess.Popen([sys.executable, "-c", COLLECTOR, str(gc_store.root), remote.url,
                                  seaweed.endpoint, str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    pushers = [subprocess.Popen([sys.executable, "-c", PUSHER, str(tmp_path / f"s{i}"), remote.url,
                                 seaweed.endpoint, str(i), str(rounds), str(stop), "1" if chunked else "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(n)]
    pins: List[str] = []
    try:
        for p in pushers:
            so, se = p.communicate(timeout=600)
            assert p.returncode == 0, se[-3000:]
            pins += json.loads(so.strip().splitlines()[-1])["pins"]
    finally:
        stop.touch()
        so, se = collector.communicate(timeout=300)
        for p in pushers:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert collector.returncode == 0, se[-3000:]
    stats = json.loads(so.strip().splitlines()[-1])
    assert stats["runs"] >= 2 and stats["deleted"] > 0, stats  # the gc really ran and collected during the race
    # Every ref on the remote names a complete closure (checked with plain boto3, re-hashed).
    client = seaweed.client()
    refs, *_ = closures_on_remote(client, remote.url)
    assert {f"pins/{p}" for p in pins} <= set(refs) and len(pins) == n * (rounds // 4)
    assert {f"heads/h{i}" for i in range(n)} <= set(refs)
    # Pins survive, naming what their machine pinned.
    s0 = casstore.open(tmp_path / "s0")
    for p in (x for x in pins if x.startswith("p0-")):
        assert refs[f"pins/{p}"] == str(s0.pins()[p])
    # One last gc: exactly the closures of the refs stay (every expired version and what only it named go).
    gc_store.plan_gc(keep_history=0, grace=0, remote=remote).execute()
    refs, need_o, need_r, need_c = closures_on_remote(client, remote.url)
    bucket, prefix = split_url(remote.url)
    on: Dict[str, Set[str]] = {"objects": set(), "recipes": set(), "chunks": set()}
    for key in remote_listing(client, remote.url):
        kind, _, rest = key[len(prefix):].partition("/")
        if kind in on:
            on[kind].add(rest.replace("/", ""))
    assert on["objects"] == need_o and on["recipes"] == need_r and on["chunks"] == need_c
    assert bool(need_r) == chunked
    assert marker_keys(seaweed, remote) == []


# -- CLI --------------------------------------------------------------------------------------


def cli(*args: str, store: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "casstore", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_gc_and_du_remote_json(tmp_path: Path, remote: casstore.Remote, seaweed: Any) -> None:
    a, d = history_setup(tmp_path, remote)
    r = cli("remote", "add", "origin", remote.url, "--endpoint-url", seaweed.endpoint, store=a.root)
    assert r.returncode == 0, r.stderr
    before = remote_listing(seaweed.client(), remote.url)
    r = cli("gc", "--remote", "origin", "--keep-history", "1", "--grace", "0s", "--json", "--why",
            str(d["o2"]), store=a.root)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # one JSON document, nothing else on stdout
    assert doc["dry_run"] is True and doc["objects"] == 3 and "result" not in doc
    assert doc["why"] == {str(d["o2"]): "kept: entry 'x' of head 'h', 1 version back"}
    assert remote_listing(seaweed.client(), remote.url) == before
    r = cli("gc", "--remote", "origin", "--keep-history", "1", "--grace", "0s", store=a.root)
    assert r.returncode == 0 and "dry run: nothing deleted" in r.stdout, r.stderr
    # du before: the remote stores more than the live names need.
    r = cli("du", "--remote", "origin", "--json", store=a.root)
    assert r.returncode == 0, r.stderr
    du = json.loads(r.stdout)
    on = objects_on(seaweed, remote)
    assert du["objects"] == len(on) and du["stored_bytes"] == sum(on.values())
    names = {n["name"]: n for n in du["names"]}
    assert set(names) == {"h", "p"} and names["h"]["kind"] == "head" and names["h"]["entries"] == 2
    live = {d[k].hex for k in ("v3", "o3", "same", "p", "q")}
    assert du["live_stored_bytes"] == sum(on[h] for h in live)
    assert du["other_bytes"] == du["stored_bytes"] - du["live_stored_bytes"] > 0
    r = cli("gc", "--remote", "origin", "--keep-history", "0", "--grace", "0s", "--yes", "--json", store=a.root)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dry_run"] is False and doc["result"]["deleted"] == 5
    r = cli("du", "--remote", "origin", "--json", store=a.root)
    du = json.loads(r.stdout)
    assert du["other_bytes"] == 0 and du["live_missing"] == 0
    r = cli("du", "--remote", "origin", store=a.root)
    assert r.returncode == 0 and "live names reference" in r.stdout
    r = cli("gc", "--remote", "origin", "--max-size", "1G", store=a.root)
    assert r.returncode != 0 and "--max-size" in r.stderr


# -- chunked objects (issue 16): recipes are objects, chunks go when no remaining recipe names them ----


def test_chunked_objects_recipes_and_unshared_chunks_are_collected(tmp_path: Path, seaweed: Any,
                                                                    remote_url: str) -> None:
    from casstore.objects.chunking import Chunking

    rem = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False,
                          chunking=Chunking(min_object=1 << 20, avg_size=64 * 1024, min_size=16 * 1024,
                                            max_size=256 * 1024))
    a = casstore.open(tmp_path / "a")
    old = bytearray(os.urandom(3 << 20))
    with a.edit("big") as m:
        m["w"] = d_old = a.put(bytes(old))
    a.push(rem, "big")
    old[1 << 20:(1 << 20) + 10] = b"0123456789"  # a few changed bytes: most chunks shared
    with a.edit("big") as m:
        m["w"] = d_new = a.put(bytes(old))
    a.push(rem, "big")
    objs = rem.objects

    def keys(kind: str) -> Set[str]:
        pre = f"{split_url(rem.url)[1]}{kind}/"
        return {k[len(pre):].replace("/", "") for k in remote_listing(seaweed.client(), rem.url) if k.startswith(pre)}

    recipe_old, recipe_new = objs.read_recipe(d_old), objs.read_recipe(d_new)
    assert recipe_old is not None and recipe_new is not None
    new_chunks = {c.digest.hex for c in recipe_new.chunks}
    only_old = {c.digest.hex for c in recipe_old.chunks} - new_chunks
    assert only_old and len(only_old) < len(recipe_old.chunks)  # shared chunks exist, and exclusive ones
    assert keys("recipes") == {d_old.hex, d_new.hex}
    plan = a.plan_gc(keep_history=0, grace=0, remote=rem)
    assert d_old in plan.objects and d_new not in plan.objects
    assert {c.hex for c in plan.chunks} == only_old
    assert plan.why(next(iter(recipe_new.chunks)).digest).startswith("kept: a chunk")
    res = plan.execute()
    assert not res.failed and not res.skipped
    assert keys("recipes") == {d_new.hex}
    assert keys("chunks") == new_chunks
    b = casstore.open(tmp_path / "b")
    b.pull(rem, "big")
    assert b.get(b.manifest("big")["w"].digest) == bytes(old)
    du = casstore.open(tmp_path / "c").remote_usage(rem)
    assert du.other_bytes == 0 and du.live_missing == 0
    assert du.live_stored_bytes == du.stored_bytes
