"""Tree nodes stored in bundles (format 3, docs/format.md "Node bundles"), on a real store.

Contracts:

* a commit writes its new nodes to a few bundle objects (one for a small edit), and the tree read back
  is the same tree (same root digest as format 2 would give: node bytes are unchanged);
* format-2 trees (a node object each) still read, and an edit of one keeps its unchanged nodes where
  they are (gc keeps them);
* the same node stored in two bundles is two nodes to gc and the caches: gc never deletes one copy's
  bundle because it walked the other;
* every hostile bundle (not a bundle, wrong shape, a location out of range or naming a node that hashes
  to something else, a loop, a leaf with children) is refused with StoreFormatError naming the
  bundle; a missing one is a MissingNodeError, and verify reports it missing, root or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import msgpack
import pytest

import casstore
from casstore.errors import MissingNodeError, ObjectNotFoundError, StoreFormatError
from casstore.manifests import model
from casstore.manifests.model import EntryMap, build_tree, clear_node_cache, walk_tree

SMALL = 16


@pytest.fixture(autouse=True)
def small_trees(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(model, "TREE_THRESHOLD", SMALL)
    yield
    clear_node_cache()


def key(i: int) -> str:
    return f"d{i % 7}/f{i:05d}"


def fill(store: casstore.Store, name: str, keys: List[str]) -> List[casstore.Digest]:
    ds = [store.put(bytes([i])) for i in range(5)]
    with store.edit(name) as m:
        for i, k in enumerate(keys):
            m[k] = ds[i % 5]
    return ds


def objects_of(entries: EntryMap) -> List[str]:
    """Hex digests of the objects holding the tree's nodes, as gc and push see them."""
    return [h for k, h, _s in walk_tree(entries, {}) if not k]


def header(store: casstore.Store, version: casstore.Digest) -> List[Any]:
    doc = msgpack.unpackb(store.get(version), raw=False)
    assert doc["v"] == 3
    return list(doc["tree"])


def fresh(path: Path) -> casstore.Store:
    """The store opened again, nothing decoded in memory (a new process, as far as reads go)."""
    clear_node_cache()
    model._VALIDATED.clear()
    return casstore.open(path)


# -- writing ----------------------------------------------------------------------------------------


def test_a_commit_writes_its_nodes_to_one_bundle_and_reads_back_the_same_tree(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    keys = [key(i) for i in range(2000)]
    fill(store, "x", keys)
    first = store.manifest("x")
    n_objects = len(objects_of(first.entries))
    assert 1 <= n_objects <= 4  # ~300 nodes in a few bundles of <= 128 KiB, not ~300 objects
    before = set(store.objects.iter_digests())
    with store.edit("x") as m:
        for i in range(0, 2000, 40):  # 50 keys spread over the tree
            m[key(i)] = store.put(f"new {i}".encode())
    after = set(store.objects.iter_digests()) - before
    assert len(after) == 50 + 2  # the new data, ONE bundle of every new node, the version object
    head = header(store, store.manifest("x").digest)
    assert casstore.Digest(head[4].hex()) in after
    # The same tree as a rebuild from scratch: node bytes and digests are format 2's.
    again = fresh(tmp_path / "s").manifest("x")
    expect = {k: again[k] for k in keys}
    rebuilt = build_tree(iter(EntryMap.from_entries(expect).raw_items()), None)
    assert rebuilt.tree_header() == head[:4]
    assert dict(again.items()) == expect and again.entries.ceiling("d3/") == min(k for k in keys if k >= "d3/")


def test_bundles_are_bounded(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s", durable=False)
    d = store.put(b"x")
    with store.edit("x") as m:
        for i in range(12000):
            m[f"some/longer/prefix/to/fill/bundles/key{i:06d}"] = d
    sizes = [len(store.get(casstore.Digest(h))) for h in objects_of(store.manifest("x").entries)]
    assert len(sizes) >= 5
    assert max(sizes) <= model.BUNDLE_BYTES + 64 << 10  # one node may overflow the mark, not more
    for h in objects_of(store.manifest("x").entries):
        doc = msgpack.unpackb(store.get(casstore.Digest(h)), raw=False)
        assert doc["casstore"] == "manifest-bundle" and len(doc["nodes"]) <= model.BUNDLE_NODES


# -- format 2 beside format 3 -----------------------------------------------------------------------


def _format2(store: casstore.Store, n: int) -> Tuple[casstore.Digest, List[bytes]]:
    """A two-level format-2 tree made by hand: n leaves of 4 entries, each a node object of its own."""
    e = [store.put(b"a").raw, 1]
    refs: List[List[Any]] = []
    leaves: List[bytes] = []
    for j in range(n):
        entries = {f"k{j:03d}/{i}": e for i in range(4)}
        data = bytes(msgpack.packb({"casstore": "manifest-node", "entries": entries, "level": 0}, use_bin_type=True))
        leaves.append(store.put(data, compress=False).raw)
        refs.append([list(entries)[-1], leaves[-1], 4, 4])
    root = bytes(msgpack.packb({"casstore": "manifest-node", "children": refs, "level": 1}, use_bin_type=True))
    rd = store.put(root, compress=False)
    ver = {"casstore": "manifest", "meta": {}, "parent": None, "tree": [rd.raw, 1, 4 * n, 4 * n], "v": 2}
    return store.put(bytes(msgpack.packb(ver, use_bin_type=True)), compress=False), leaves


def _aged(path: Path, commits: int = 60) -> Tuple[casstore.Store, List[str]]:
    """A 3,000-key tree after ``commits`` edits of 10 keys spread over the key range: its nodes end up
    in the bundles of the commits that last touched them (as a folder's after many adds)."""
    store = casstore.open(path, durable=False)
    keys = [key(i) for i in range(3000)]
    ds = fill(store, "x", keys)
    order = sorted(keys)
    for c in range(commits):
        with store.edit("x") as m:
            for j in range(10):
                m[order[(j * 300 + c * 7) % 3000]] = ds[(c + j) % 5]
    return store, order


def test_a_whole_read_of_an_aged_tree_reads_each_bundle_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Hazard: with 32 decoded bundles kept, a walk in key order over nodes spread across more bundles
    # went through them in turn and read and decoded each about three times (10,000 entries: 102 ms
    # against 36 ms).  Kept by bytes (32 MiB), each is read once.
    store, order = _aged(tmp_path / "s")
    bundles = set(objects_of(store.manifest("x").entries))
    assert len(bundles) > 40  # (more than the 32 kept before: else this test could not fail)
    store = fresh(tmp_path / "s")
    m = store.manifest("x")
    reads: List[str] = []
    real = store.objects.read

    def counted(d: casstore.Digest, *, verify: bool = True) -> bytes:
        reads.append(d.hex)
        return real(d, verify=verify)

    monkeypatch.setattr(store.objects, "read", counted)
    assert [k for k, _raw in m.entries.raw_items()] == order
    # (the root's bundle was read when the version was opened, before the count began)
    assert len(reads) == len(set(reads)) and set(reads) <= bundles and len(reads) >= len(bundles) - 1


def test_decoded_bundles_are_bounded_by_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cap holds whatever a walk reads (here 150 KB: one full bundle, or a few small ones), and the walk
    # is still right.
    store, order = _aged(tmp_path / "s", commits=20)
    monkeypatch.setattr(model, "_BUNDLE_CACHE_BYTES", 150_000)
    store = fresh(tmp_path / "s")
    m = store.manifest("x")
    assert [k for k, _raw in m.entries.raw_items()] == order
    cache = m.entries._reader.bundles
    assert 0 < cache.nbytes <= 150_000 and cache.nbytes == sum(n for _b, n in cache.items.values())


def test_a_format2_tree_reads_and_an_edit_keeps_its_unchanged_nodes_where_they_are(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    v2, leaves = _format2(store, 10)
    store.refs.write("heads", "old", v2)
    assert len(store.manifest("old")) == 40
    with store.edit("old") as m:
        m["k003/0"] = store.put(b"b")
    v3 = store.manifest("old")
    objs = set(objects_of(v3.entries))
    assert {d.hex() for d in leaves if d != leaves[3]} <= objs  # nine leaves still objects of their own
    assert len(objs) == 9 + 1  # and one bundle: the new leaf and the new root
    store.remove("old")
    store.refs.write("heads", "new", v3.digest)
    store.plan_gc(keep_history=0, grace=0).execute()
    again = fresh(tmp_path / "s")
    assert len(list(again.manifest("new").items())) == 40 and again.manifest("new")["k003/0"].digest == store.put(b"b")
    assert again.verify().ok


# -- the same node in two bundles -------------------------------------------------------------------


def test_gc_keeps_both_copies_of_a_node_stored_in_two_bundles(tmp_path: Path) -> None:
    """Name b reaches the same tree as name a by another edit history: the same nodes, in bundles of its
    own.  Walks keyed by node digest alone skipped b's copies after walking a's, and gc deleted b's
    bundles; keyed by node and location, removing a leaves b whole."""
    store = casstore.open(tmp_path / "s")
    keys = [key(i) for i in range(3000)]
    ds = fill(store, "a", keys)
    with store.edit("b") as m:
        for i, k in enumerate(keys[1:], 1):
            m[k] = ds[i % 5]
    with store.edit("b") as m:
        m[keys[0]] = ds[0]
    a, b = store.manifest("a"), store.manifest("b")
    assert a.entries.root == b.entries.root  # the same tree...
    assert not set(objects_of(a.entries)) & set(objects_of(b.entries))  # ...stored twice
    store.plan_gc(keep_history=0, grace=0).execute()  # walks a first, then b
    store.remove("a")
    store.plan_gc(keep_history=0, grace=0).execute()
    again = fresh(tmp_path / "s")
    assert dict(again.manifest("b").items()) == dict(b.items())
    assert again.verify().ok


# -- hostile bundles --------------------------------------------------------------------------------


def _one_bundle_tree(store: casstore.Store) -> Tuple[casstore.Digest, Dict[str, Any]]:
    """A committed 200-entry tree whose nodes are all in one bundle: (version, that bundle decoded)."""
    fill(store, "x", [key(i) for i in range(200)])
    v = store.manifest("x").digest
    objs = objects_of(store.manifest("x").entries)
    assert len(objs) == 1
    return v, msgpack.unpackb(store.get(casstore.Digest(objs[0])), raw=False)


def _with_bundle(store: casstore.Store, version: casstore.Digest, doc: Dict[str, Any],
                 at: Optional[int] = None) -> casstore.Digest:
    """``version`` again, its root in ``doc`` (stored as a bundle) at ``at`` (default: where it was)."""
    head = header(store, version)
    bd = store.put(bytes(msgpack.packb(doc, use_bin_type=True)), compress=False)
    head[4], head[5] = bd.raw, head[5] if at is None else at
    ver = msgpack.unpackb(store.get(version), raw=False)
    ver["tree"] = head
    return store.put(bytes(msgpack.packb(ver, use_bin_type=True)), compress=False)


def _last_internal(doc: Dict[str, Any]) -> int:
    return max(i for i, x in enumerate(doc["locs"]) if x is not None)


def _leaf(doc: Dict[str, Any]) -> int:
    return next(i for i, x in enumerate(doc["locs"]) if x is None)


def _set(doc: Dict[str, Any], field: str, value: Any) -> None:
    doc[field] = value


HOSTILE: Dict[str, Tuple[Callable[[Dict[str, Any]], None], str]] = {
    "not a bundle": (lambda d: _set(d, "casstore", "manifest-node"), "not a tree node bundle"),
    "extra field": (lambda d: _set(d, "extra", 1), "has fields"),
    "nodes not bytes": (lambda d: d["nodes"].__setitem__(0, "text"), "encoded nodes"),
    "no nodes": (lambda d: (_set(d, "nodes", []), _set(d, "locs", [])), "encoded nodes"),
    "locs too short": (lambda d: d["locs"].pop(), "child locations"),
    "table not digests": (lambda d: _set(d, "bundles", [b"short"]), "32-byte bundle digests"),
    "child at or after itself": (lambda d: d["locs"][_last_internal(d)].__setitem__(0, _last_internal(d)),
                                 "malformed location"),
    "table index out of range": (lambda d: d["locs"][_last_internal(d)].__setitem__(0, [5, 0]),
                                 "malformed location"),
    "location of the wrong node": (lambda d: d["locs"][_last_internal(d)].__setitem__(
        0, d["locs"][_last_internal(d)][1]), "where a parent names"),
    "a leaf with locations": (lambda d: d["locs"].__setitem__(_leaf(d), []), "is a leaf"),
    "too few locations": (lambda d: d["locs"][_last_internal(d)].pop(), "locations for them"),
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_hostile_bundle_is_refused_naming_it(tmp_path: Path, what: str) -> None:
    store = casstore.open(tmp_path / "s")
    v, doc = _one_bundle_tree(store)
    change, message = HOSTILE[what]
    change(doc)
    bad = _with_bundle(store, v, doc)
    reader = fresh(tmp_path / "s")
    with pytest.raises(StoreFormatError, match=message):
        m = reader.manifest(bad)
        for _ in m.items():
            pass


def test_a_root_index_past_the_bundle_is_refused(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    v, doc = _one_bundle_tree(store)
    bad = _with_bundle(store, v, doc, at=len(doc["nodes"]))
    with pytest.raises(StoreFormatError, match=f"has {len(doc['nodes'])} nodes"):
        fresh(tmp_path / "s").manifest(bad)


@pytest.mark.parametrize("tree", [
    lambda h: h[:5],  # a format-3 header without the root's index
    lambda h: h[:4],  # or without its bundle
    lambda h: h[:4] + [b"x" * 31, 0],
    lambda h: h[:5] + [model.MAX_BUNDLE_NODES],
    lambda h: h[:5] + ["0"],
])
def test_a_malformed_format3_header_is_refused(tmp_path: Path, tree: Callable[[List[Any]], List[Any]]) -> None:
    store = casstore.open(tmp_path / "s")
    v, _doc = _one_bundle_tree(store)
    ver = msgpack.unpackb(store.get(v), raw=False)
    ver["tree"] = tree(ver["tree"])
    bad = store.put(bytes(msgpack.packb(ver, use_bin_type=True)), compress=False)
    with pytest.raises(StoreFormatError, match="tree header"):
        fresh(tmp_path / "s").manifest(bad)


def test_a_format2_version_cannot_claim_a_bundled_root(tmp_path: Path) -> None:
    store = casstore.open(tmp_path / "s")
    v, _doc = _one_bundle_tree(store)
    ver = msgpack.unpackb(store.get(v), raw=False)
    ver["v"] = 2
    bad = store.put(bytes(msgpack.packb(ver, use_bin_type=True)), compress=False)
    with pytest.raises(StoreFormatError, match="tree header"):
        fresh(tmp_path / "s").manifest(bad)


@pytest.mark.parametrize("which", ["root", "below the root"])
def test_a_missing_bundle_is_a_missing_node_and_verify_reports_it(tmp_path: Path, which: str) -> None:
    store = casstore.open(tmp_path / "s")
    keys = [key(i) for i in range(2000)]
    fill(store, "x", keys)
    with store.edit("x") as m:
        m[keys[7]] = store.put(b"changed")  # a second bundle, holding the new root and path
    head = header(store, store.manifest("x").digest)
    root_bundle = head[4].hex()
    others = [h for h in objects_of(store.manifest("x").entries) if h != root_bundle]
    assert others
    victim = casstore.Digest(root_bundle if which == "root" else others[0])
    (store.objects.path(victim)).unlink()
    again = fresh(tmp_path / "s")
    with pytest.raises(MissingNodeError, match=victim.hex) as got:
        m = again.manifest("x")
        for _ in m.items():
            pass
    assert isinstance(got.value, ObjectNotFoundError) and got.value.digest == victim.hex
    report = fresh(tmp_path / "s").verify()
    assert not report.ok and victim in report.missing
    with pytest.raises(MissingNodeError):
        fresh(tmp_path / "s").plan_gc(keep_history=0, grace=0)  # gc cannot tell what the head needs: stops
