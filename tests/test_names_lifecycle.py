"""Name lifecycle (issue 12): remove, rename, versions addressed as NAME~N / NAME@<hex>, listings.

Real stores and real processes; nothing is mocked.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import PYTHON

import casstore
from casstore import (
    AmbiguousDigestError,
    Digest,
    FrozenError,
    InvalidInputError,
    InvalidTypeError,
    ManifestNotFoundError,
    NameExistsError,
    ObjectNotFoundError,
)
from casstore.manifests import public_url


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "s", durable=False)


def _versions(store: casstore.Store, name: str, n: int) -> List[Digest]:
    """Commit ``n`` versions of ``name`` (key ``k`` -> object i); digests oldest first."""
    out = []
    for i in range(n):
        with store.edit(name) as m:
            m["k"] = store.put(b"%s %d" % (name.encode(), i))
            m.meta["i"] = i
        assert m.result is not None
        out.append(m.result.digest)
    return out


# -- remove ---------------------------------------------------------------------------------


def test_remove_deletes_the_head_and_leaves_its_versions_for_gc(store: casstore.Store) -> None:
    vs = _versions(store, "exp", 3)
    assert store.remove("exp") == vs[-1]
    with pytest.raises(ManifestNotFoundError) as ei:
        store.manifest("exp")
    assert isinstance(ei.value, LookupError) and isinstance(ei.value, ObjectNotFoundError)
    assert "exp" not in store.heads() and store.names() == []
    for v in vs:  # only the name went: every version is still readable by digest
        assert store.manifest(v).digest == v
    # ... and can be brought back under a name until gc collects it
    assert store.pin("exp-restored", vs[-1]) == vs[-1]
    assert [m.digest for m in store.history("exp-restored")] == vs[::-1]
    # a new edit of the removed name starts a fresh head (no parent)
    with store.edit("exp") as m:
        m["new"] = store.put(b"fresh")
    assert m.result is not None and m.result.parent is None and list(m.result) == ["new"]


def test_removing_or_renaming_the_last_name_under_a_prefix_frees_the_prefix(store: casstore.Store) -> None:
    _versions(store, "team/a/b", 1)
    _versions(store, "team/c", 1)
    store.remove("team/a/b")
    assert not (store.root / "refs" / "heads" / "team" / "a").exists()  # left empty: pruned
    _versions(store, "team/a", 1)  # so the prefix can be a name again
    store.rename("team/c", "solo")
    store.rename("team/a", "other/x")
    assert not (store.root / "refs" / "heads" / "team").exists()
    _versions(store, "team", 1)
    store.freeze("team")
    store.rename("team", "p/q", force=True)
    store.remove("p/q", force=True)
    assert not (store.root / "refs" / "pins" / "p").exists()
    assert set(store.heads()) == {"solo", "other/x"} and store.pins() == {}


def test_remove_missing_pin_and_hostile_arguments(store: casstore.Store) -> None:
    with pytest.raises(ManifestNotFoundError, match="no head or pin named 'nope'"):
        store.remove("nope")
    (d,) = _versions(store, "p", 1)
    store.freeze("p")
    with pytest.raises(FrozenError) as ei:
        store.remove("p")
    assert "force=True" in str(ei.value) and "--force" in str(ei.value) and "unpin" in str(ei.value)
    assert store.pins() == {"p": d}
    assert store.remove("p", force=True) == d and store.pins() == {}
    # unpin first, then nothing is left to remove
    _versions(store, "q", 1)
    store.freeze("q")
    store.unpin("q")
    with pytest.raises(ManifestNotFoundError):
        store.remove("q")
    for bad in ("", "../x", "a:b", "x\x00"):
        with pytest.raises(InvalidInputError):
            store.remove(bad)
    with pytest.raises(InvalidTypeError):
        store.remove(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        store.remove("q", force="yes")  # type: ignore[arg-type]


def test_remove_a_name_left_both_head_and_pin_by_a_crashed_freeze(store: casstore.Store) -> None:
    (d,) = _versions(store, "both", 1)
    store.refs.write("pins", "both", d)  # freeze writes the pin, then removes the head: killed in between
    with pytest.raises(FrozenError):
        store.remove("both")
    assert store.remove("both", force=True) == d
    assert store.heads() == {} and store.pins() == {}


def test_gc_collects_a_removed_names_versions_once_past_grace(store: casstore.Store) -> None:
    shared = store.put(b"shared by two names")
    only = store.put(b"only in the removed name")
    with store.edit("gone") as m:
        m["shared"] = shared
        m["only"] = only
    with store.edit("gone") as m:
        m["more"] = store.put(b"second version")
    with store.edit("kept") as m:
        m["shared"] = shared
    versions = [v.digest for v in store.history("gone")]
    store.remove("gone")
    # Within grace nothing goes: an accidental remove can be undone with store.pin(NEW, digest).
    assert store.plan_gc(keep_history=5, grace="1h").files == ()
    # Past grace the removed name's versions and what only they referenced go; keep_history
    # counts versions behind existing heads only, so it keeps none of them.
    store.plan_gc(keep_history=100, grace=0).execute()
    for d in versions + [only]:
        assert d not in store
    assert shared in store and store.manifest("kept")["shared"].digest == shared
    assert store.verify().ok


_EDITOR = """
import json, sys, casstore
s = casstore.open(sys.argv[1]); wid = sys.argv[2]; n = int(sys.argv[3])
d = s.put(b"x")
out = []
for i in range(n):
    with s.edit("race", timeout=120) as m:
        base = None if m.base is None else str(m.base.digest)
        m["w%s/%d" % (wid, i)] = d
    out.append({"base": base, "result": str(m.result.digest), "keys": len(m.result)})
print(json.dumps(out))
"""

_REMOVER = """
import json, sys, time, casstore
s = casstore.open(sys.argv[1]); n = int(sys.argv[2])
removed, missing = [], 0
for i in range(n):
    try:
        removed.append(str(s.remove("race", timeout=120)))
    except casstore.ManifestNotFoundError:
        missing += 1
    time.sleep(0.003)
print(json.dumps({"removed": removed, "missing": missing}))
"""


def test_remove_races_edits_in_real_processes_and_one_wins_cleanly(tmp_path: Path) -> None:
    # Contract: edit and remove serialize on the name's lock.  An edit either commits before a
    # remove (and its version is what the remove deletes) or starts after it, as the first
    # version of a fresh head; no edit ever builds on a removed version, nothing crashes.
    root = tmp_path / "s"
    store = casstore.open(root, durable=False)
    editors = [subprocess.Popen([PYTHON, "-c", textwrap.dedent(_EDITOR), str(root), str(w), "120"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(2)]
    remover = subprocess.Popen([PYTHON, "-c", textwrap.dedent(_REMOVER), str(root), "150"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    edits: List[Dict[str, Any]] = []
    for p in editors:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        edits += json.loads(out)
    out, err = remover.communicate(timeout=300)
    assert remover.returncode == 0, err
    rm = json.loads(out)
    removed = rm["removed"]
    results = {e["result"]: e for e in edits}
    assert len(results) == len(edits) == 240
    assert removed and len(removed) + rm["missing"] == 150
    assert len(set(removed)) == len(removed) and set(removed) <= set(results)  # removes delete committed heads
    bases = [e["base"] for e in edits if e["base"] is not None]
    assert not set(bases) & set(removed)  # no edit builds on a removed version
    assert len(set(bases)) == len(bases)  # and no two on the same one: the chain is linear
    for e in edits:  # each version is its base plus one key, or a fresh head of one key
        assert e["keys"] == (1 if e["base"] is None else results[e["base"]]["keys"] + 1)
    head = store.heads().get("race")
    fresh = sum(e["base"] is None for e in edits)
    # every fresh head ends in a remove, except the one still standing
    assert fresh == len(removed) + (head is not None)
    if head is not None:
        assert str(head) in results and str(head) not in bases and str(head) not in removed
    assert 0 < len(bases) < len(edits)  # the race really interleaved


_PRUNE_CHURN = """
import sys, casstore
s = casstore.open(sys.argv[1]); wid = sys.argv[2]
d = s.put(b"x")
for i in range(int(sys.argv[3])):
    name = "shared/dir/w%s-%d" % (wid, i)
    with s.edit(name) as m:
        m["k"] = d
    if i % 2:
        s.rename(name, name + "-moved")
        name += "-moved"
    s.remove(name)  # the last name under shared/dir: its directories go, while the other process makes them
print("ok")
"""


def test_pruning_races_other_processes_creating_names_under_the_same_prefix(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = casstore.open(root, durable=False)
    procs = [subprocess.Popen([PYTHON, "-c", textwrap.dedent(_PRUNE_CHURN), str(root), str(w), "200"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err
    assert store.heads() == {} and store.pins() == {}
    assert store.verify().ok


# -- rename ---------------------------------------------------------------------------------


def test_rename_moves_head_and_history(store: casstore.Store) -> None:
    vs = _versions(store, "old", 3)
    assert store.rename("old", "team/new") == vs[-1]
    assert "old" not in store.heads() and store.heads()["team/new"] == vs[-1]
    with pytest.raises(ManifestNotFoundError):
        store.manifest("old")
    assert [m.digest for m in store.history("team/new")] == vs[::-1]
    assert store.manifest("team/new~2").digest == vs[0]
    with store.edit("team/new") as m:  # editing continues the same chain
        m["more"] = store.put(b"more")
    assert m.result is not None and m.result.parent == vs[-1]


def test_rename_refuses_existing_names_pins_and_bad_names(store: casstore.Store) -> None:
    a = _versions(store, "a", 2)
    b = _versions(store, "b", 1)
    with pytest.raises(NameExistsError) as ei:
        store.rename("a", "b")
    assert isinstance(ei.value, FileExistsError) and "--force" in str(ei.value) and "force=True" in str(ei.value)
    assert store.heads() == {"a": a[-1], "b": b[-1]}  # nothing moved
    assert store.rename("a", "b", force=True) == a[-1]
    assert store.heads() == {"b": a[-1]} and store.history("b")[1].digest == a[0]

    p = _versions(store, "p", 1)[0]
    store.freeze("p")
    with pytest.raises(FrozenError, match="force=True"):
        store.rename("p", "p2")
    assert store.rename("p", "p2", force=True) == p
    assert store.pins() == {"p2": p} and store.manifest("p2").frozen

    # A head moved onto a pin's name with force replaces the pin (pins win in reads: it must go).
    assert store.rename("b", "p2", force=True) == a[-1]
    assert store.pins() == {} and store.heads() == {"p2": a[-1]} and not store.manifest("p2").frozen

    with pytest.raises(ManifestNotFoundError):
        store.rename("missing", "x")
    with pytest.raises(InvalidInputError, match="itself"):
        store.rename("p2", "p2")
    for bad in ("x~1", "x@ab", "../x", "a:b", ""):
        with pytest.raises(InvalidInputError):
            store.rename("p2", bad)
    _versions(store, "team/a", 1)
    with pytest.raises(InvalidInputError, match="prefix"):
        store.rename("p2", "team")  # refs/heads/team is a directory of other names
    with pytest.raises(InvalidInputError, match="prefix"):
        store.rename("p2", "team/a/b")  # team/a is a name: it cannot also be a directory
    assert set(store.heads()) == {"p2", "team/a"}


def test_rename_into_its_own_prefix_and_back(store: casstore.Store) -> None:
    """Found by a bug hunt: `t/x` -> `t` was refused ("a prefix of other names") with no other name left."""
    with store.edit("t/x") as m:
        m["k"] = store.put(b"1")
    with store.edit("t/x") as m:
        m["k"] = store.put(b"2")
    d = store.heads()["t/x"]
    assert store.rename("t/x", "t") == d
    assert store.heads() == {"t": d} and len(store.history("t")) == 2  # history and all
    assert store.rename("t", "t/y/z") == d
    assert store.heads() == {"t/y/z": d}
    with store.edit("t/q") as m:
        m["k"] = store.put(b"3")
    with pytest.raises(casstore.InvalidInputError, match="prefix of other names"):
        store.rename("t/y/z", "t")  # another name under t/: refused, and nothing moved
    assert set(store.heads()) == {"t/q", "t/y/z"}
    assert [n.name for n in store.names(include_internal=True)] == ["t/q", "t/y/z"]  # nothing left midway


def test_rename_that_fails_halfway_puts_back_what_moved(store: casstore.Store) -> None:
    (d,) = _versions(store, "both", 1)
    store.refs.write("pins", "both", d)  # a crashed freeze left head and pin
    _versions(store, "x/y", 1)  # refs/heads/x is a directory (and a pin 'x' would be head x/y's folder)
    with pytest.raises(InvalidInputError, match="prefix|clashes with the head 'x/...'"):
        store.rename("both", "x", force=True)  # neither moves (before the cross-kind rule: the pin moved, then back)
    assert store.pins() == {"both": d} and set(store.heads()) == {"both", "x/y"}


_RENAME_READER = """
import json, sys, casstore
s = casstore.open(sys.argv[1]); n = int(sys.argv[2])
todo = set(range(n)); seen_old = 0; bad = []; first = True
while todo:
    for i in sorted(todo):
        try:
            s.manifest("old/%d" % i)  # old first: if it is gone, the rename happened, so new must exist
            seen_old += 1
            continue
        except casstore.ManifestNotFoundError:
            pass
        try:
            s.manifest("new/%d" % i)
        except casstore.ManifestNotFoundError:
            bad.append(i)
        todo.discard(i)
    if first:
        print("ready", flush=True)
        first = False
print(json.dumps({"seen_old": seen_old, "bad": bad}))
"""


def test_rename_is_atomic_for_lock_free_readers_in_another_process(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = casstore.open(root, durable=False)
    n = 150
    d = store.put(b"v")
    for i in range(n):
        with store.edit(f"old/{i}") as m:
            m["k"] = d
    reader = subprocess.Popen([PYTHON, "-c", textwrap.dedent(_RENAME_READER), str(root), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert reader.stdout is not None
    assert reader.stdout.readline() == "ready\n"  # it has read every old name once and keeps reading
    for i in range(n):
        store.rename(f"old/{i}", f"new/{i}")
    out, err = reader.communicate(timeout=300)
    assert reader.returncode == 0, err
    doc = json.loads(out)
    assert doc["bad"] == [] and doc["seen_old"] > n  # never neither name; it read while renames ran
    assert sorted(store.heads()) == sorted(f"new/{i}" for i in range(n))


# -- versions: NAME~N and NAME@<hex> --------------------------------------------------------


def test_tilde_and_at_address_versions_everywhere_a_name_is_read(store: casstore.Store, tmp_path: Path) -> None:
    vs = _versions(store, "exp", 4)
    head = store.manifest("exp")
    zero = store.manifest("exp~0")
    assert (zero.digest, zero.name, zero.frozen) == (head.digest, head.name, head.frozen) == (vs[3], "exp", False)
    for n in range(4):
        m = store.manifest(f"exp~{n}")
        assert m.digest == vs[3 - n] and m.meta["i"] == 3 - n
        assert m.name == "exp" and m.frozen == (n > 0)
    with pytest.raises(ManifestNotFoundError, match="has 4 version"):
        store.manifest("exp~4")
    assert [m.digest for m in store.history("exp~1")] == vs[2::-1]
    assert store.history("exp~3", limit=5)[0].digest == vs[0]
    df = store.diff("exp~1", "exp")
    assert (df.a, df.b) == (vs[2], vs[3]) and set(df.changed) == {"k"}
    store.checkout("exp~3", tmp_path / "co")
    assert (tmp_path / "co" / "k").read_bytes() == b"exp 0"
    assert store.pin("best", "exp~2") == vs[1]
    assert store.manifest("best~1").digest == vs[0]  # a pin's history is addressable too

    for spelled in (vs[1].hex[:8], vs[1].hex[:8].upper(), "blake3:" + vs[1].hex[:10], vs[1].hex):
        m = store.manifest(f"exp@{spelled}")
        assert m.digest == vs[1] and m.frozen and m.name == "exp"
    assert store.diff(f"exp@{vs[0].hex[:12]}", "exp~0").a == vs[0]
    # Only that name's history counts: another name's version is not found through `exp@`.
    other = _versions(store, "other", 1)[0]
    with pytest.raises(ManifestNotFoundError, match="no version of 'exp'"):
        store.manifest(f"exp@{other.hex[:16]}")


def test_at_prefix_of_several_versions_is_ambiguous(store: casstore.Store) -> None:
    vs = _versions(store, "many", 17)  # 17 digests, 16 possible first hex digits: two share one
    firsts = [d.hex[0] for d in vs]
    dup = next(c for c in firsts if firsts.count(c) > 1)
    with pytest.raises(AmbiguousDigestError, match="give more hex digits"):
        store.manifest(f"many@{dup}")
    unique = next(d for d in vs if firsts.count(d.hex[0]) == 1) if any(firsts.count(c) == 1 for c in firsts) else None
    if unique is not None:
        assert store.manifest(f"many@{unique.hex[0]}").digest == unique


@pytest.mark.parametrize("target", [
    "exp~-1", "exp~x", "exp~", "exp~1.5", "exp~\u0661", "exp~ 1", "exp~" + "9" * 200, "exp~99999999999999999",
    "exp@", "exp@zz", "exp@" + "a" * 65, "exp~1~1", "exp@ab@cd", "~1", "@ab", "nope~1", "nope@ab",
])
def test_hostile_version_suffixes_are_typed_and_quick(store: casstore.Store, target: str) -> None:
    _versions(store, "exp", 2)
    t = time.perf_counter()
    with pytest.raises(ManifestNotFoundError):
        store.manifest(target)
    with pytest.raises(ManifestNotFoundError):
        store.history(target)
    assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize("target", ["exp@blake3:zz", "exp~1:", "x\x00~1", "../x~1", "a//b@ab", "exp@ab/../..",
                                    "exp~" + "9" * 4000, "exp@blake3:"])
def test_malformed_names_and_versions_are_invalid_input(store: casstore.Store, target: str) -> None:
    _versions(store, "exp", 2)
    with pytest.raises((InvalidInputError, ManifestNotFoundError)) as ei:
        store.manifest(target)
    if ":" in target or "\x00" in target or ".." in target or "//" in target or len(target) > 255:
        assert isinstance(ei.value, InvalidInputError)


def test_names_with_tilde_or_at_made_before_keep_working_but_new_ones_are_refused(store: casstore.Store) -> None:
    d = _versions(store, "exp", 3)[-1]
    # A store written before the version syntax may hold such names: the literal name wins.
    store.refs.write("heads", "exp~1", d)
    store.refs.write("heads", "me@host", d)
    assert store.manifest("exp~1").name == "exp~1" and store.manifest("exp~1").digest == d
    assert store.manifest("me@host").digest == d and not store.manifest("me@host").frozen
    with store.edit("exp~1") as m:  # an existing head stays editable
        m["x"] = d
    assert store.manifest("exp~1").parent == d
    assert store.manifest("exp~1~1").digest == d  # and its own versions are addressable
    for new in ("exp~2", "a@b", "x~"):
        with pytest.raises(InvalidInputError, match="addresses a version"):
            with store.edit(new):
                pass
        with pytest.raises(InvalidInputError, match="addresses a version"):
            store.pin(new, d)
        with pytest.raises(InvalidInputError, match="addresses a version"):
            store.rename("exp", new)
    assert "exp~2" not in store.heads() and "exp~2" not in store.pins()


# -- listings -------------------------------------------------------------------------------


def test_listings_hide_internal_names_and_show_fetch_urls(store: casstore.Store, tmp_path: Path) -> None:
    d = _versions(store, "exp", 1)[0]
    store.pin("paper", d)
    with store.edit("_fetch/handmade") as m:
        m["data"] = d
        m.meta.update(kind="casstore.fetch", url="https://user:tok@example.org/a/b.bin?X-Amz-Signature=s3cr3t#frag")
    with store.edit("_scratch") as m:  # internal, but not a fetch record: no URL
        m["data"] = d
    with store.edit("_fetch/hostile") as m:
        m["data"] = d
        m.meta.update(kind="casstore.fetch", url=12)
    src = tmp_path / "data.bin"
    src.write_bytes(b"fetched bytes")
    fetched = store.fetch(f"file://{src}")
    names = store.names()
    assert [(n.name, n.kind, n.digest, n.internal, n.url) for n in names] == [
        ("exp", "head", d, False, None), ("paper", "pin", d, False, None)]
    full = {n.name: n for n in store.names(include_internal=True)}
    assert full["_fetch/handmade"].url == "https://example.org/a/b.bin" and full["_fetch/handmade"].internal
    assert full["_scratch"].url is None and full["_fetch/hostile"].url is None
    real = [n for n in full.values() if n.internal and n.url == f"file://{src}"]
    assert len(real) == 1 and [e.digest for e in store.manifest(real[0].name).values()] == [fetched]
    assert "s3cr3t" not in repr(store.names(include_internal=True)) and "tok" not in repr(full)
    # heads()/pins() stay the raw ref listing, internal records included
    assert "_fetch/handmade" in store.heads()
    with pytest.raises(InvalidTypeError):
        store.names(include_internal="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("url, shown", [
    ("https://u:p@h.org/x?tok=1#f", "https://h.org/x"),
    ("https://***@h.org/x", "https://h.org/x"),
    ("s3://bucket/key?versionId=3", "s3://bucket/key"),
    ("file:///data/a.bin", "file:///data/a.bin"),
    ("http://a@b@c/d", "http://c/d"),
    ("//user@host/p", "//host/p"),
    ("no url at all?x", "no url at all"),
    ("http://[::1/x?y", "http://[::1/x"),
    ("", ""),
])
def test_public_url_strips_userinfo_query_and_fragment(url: str, shown: str) -> None:
    assert public_url(url) == shown
