"""Hostile remotes (issue 11): a remote can serve anything under any key; a pull must store none of it.

Each test builds the hostile remote state by hand with a plain boto3 client
(tests/_seaweed.py ``put_key``: no casstore code writes it), then calls the
public API (``Store.pull``, ``Store.fetch_object``, ``Remote.objects`` /
``Remote.refs``) and, where it matters, the CLI.  What must hold:

* a head or pin whose manifest (or any version in its history) has a
  traversal, absolute, empty-segment, ``.``, NUL or non-string key, or a
  malformed entry, is refused with StoreFormatError and nothing of it is
  stored: no ref, no version, no object of its closure (the objects
  directory is compared before and after), no staging file left;
* an object whose bytes do not match its key is refused with IntegrityError,
  and so is one larger than its manifest records (read no further than that);
* a ref key holding garbage is a StoreFormatError naming the key;
* keys that are not casstore keys (in ``objects/`` or ``refs/``) are ignored by listings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import _seaweed
import blake3
import msgpack
import pytest
from _seaweed import put_key, put_object_bytes

import casstore
from casstore.sync import add_remote

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

MiB = 1 << 20


def hexof(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def manifest_bytes(entries: Dict[Any, Any], parent: Optional[str] = None, meta: Optional[Dict[str, Any]] = None,
                   ) -> bytes:
    """A manifest version built by hand (the format of docs/format.md, canonical key order where sortable)."""
    try:
        entries = dict(sorted(entries.items()))
    except TypeError:  # mixed key types: leave the order as given
        pass
    return msgpack.packb({"casstore": "manifest", "entries": entries, "meta": meta or {},
                          "parent": bytes.fromhex(parent) if parent else None, "v": 1}, use_bin_type=True)


def entry(data: bytes) -> List[Any]:
    return [bytes.fromhex(hexof(data)), len(data)]


def object_files(store: casstore.Store) -> List[str]:
    """Every file under the store's objects/ (relative), sorted."""
    base = store.root / "objects"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


def assert_nothing_stored(store: casstore.Store, before: List[str]) -> None:
    assert object_files(store) == before, "the hostile pull stored objects"
    assert store.heads() == {} and store.pins() == {}
    assert os.listdir(store.root / "tmp") == []


def publish_hostile(seaweed: Any, url: str, kind: str, name: str, bad_version: bytes,
                    good_history: bool = False) -> Tuple[str, List[str]]:
    """Upload a version's content objects, the version, and a ref to it (or to a good child of it).

    Returns (hex of the version the ref names, hex of every content object uploaded).
    """
    client = seaweed.client()
    payloads = [b"payload one " * 100, b"payload two " * 100]
    content = [put_object_bytes(client, url, p) for p in payloads]
    top = put_object_bytes(client, url, bad_version)
    if good_history:  # a valid version on top, whose parent is the hostile one
        good = manifest_bytes({"fine.txt": entry(payloads[0])}, parent=top)
        top = put_object_bytes(client, url, good)
    put_key(client, url, f"refs/{kind}/{name}", f"blake3:{top}\n".encode())
    return top, content


PAYLOAD = entry(b"payload one " * 100)
HOSTILE_MANIFESTS = {
    "traversal": {"../outside.txt": PAYLOAD},
    "traversal-inside": {"data/../../outside.txt": PAYLOAD},
    "absolute": {"/etc/cron.d/evil": PAYLOAD},
    "nul": {"data/a\x00b": PAYLOAD},
    "empty-segment": {"data//x": PAYLOAD},
    "dot-segment": {"./x": PAYLOAD},
    "backslash": {"..\\windows": PAYLOAD},
    "bytes-key": {b"bytes-key": PAYLOAD},
    "int-key": {7: PAYLOAD},
    "entry-not-a-list": {"x": "blake3:" + "0" * 64},
    "entry-short-digest": {"x": [b"\x01" * 31, 5]},
    "entry-str-size": {"x": [PAYLOAD[0], "5"]},
    "entry-bool-size": {"x": [PAYLOAD[0], True]},
    "entry-negative-size": {"x": [PAYLOAD[0], -1]},
    "entry-too-long": {"x": [PAYLOAD[0], 5, {}, "extra"]},
    "entry-meta-not-a-map": {"x": [PAYLOAD[0], 5, [1, 2]]},
}


@pytest.mark.parametrize("kind", ["heads", "pins"])
@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_pull_refuses_a_hostile_manifest_and_stores_nothing(tmp_path: Path, remote: casstore.Remote,
                                                            seaweed: Any, case: str, kind: str) -> None:
    # A good name on the same remote: a pull of everything must not store it either.
    a = casstore.open(tmp_path / "a")
    with a.edit("good") as m:
        m["k"] = a.put(b"good content")
    a.push(remote, "good")
    entries = dict(HOSTILE_MANIFESTS[case])
    entries.setdefault("ok.txt", entry(b"payload two " * 100))
    bad = manifest_bytes(entries)
    top, _content = publish_hostile(seaweed, remote.url, kind, "evil", bad)
    b = casstore.open(tmp_path / "b")
    before = object_files(b)
    with pytest.raises(casstore.StoreFormatError) as ei:
        b.pull(remote, "evil")
    assert top[:12] in str(ei.value), str(ei.value)  # the message names the version
    assert_nothing_stored(b, before)
    with pytest.raises(casstore.StoreFormatError):
        b.pull(remote)  # everything: the good head is refused with it (nothing of this pull is stored)
    assert_nothing_stored(b, before)


def test_pull_refuses_a_head_whose_history_holds_a_hostile_version(tmp_path: Path, remote: casstore.Remote,
                                                                   seaweed: Any) -> None:
    bad = manifest_bytes({"../../escape": PAYLOAD})
    top, _ = publish_hostile(seaweed, remote.url, "heads", "h", bad, good_history=True)
    b = casstore.open(tmp_path / "b")
    before = object_files(b)
    with pytest.raises(casstore.StoreFormatError, match="escape"):
        b.pull(remote, "h")
    assert_nothing_stored(b, before)
    assert casstore.Digest.parse("blake3:" + top) not in b  # not even the good child version


def test_cli_pull_of_a_hostile_head_is_one_line_and_stores_nothing(tmp_path: Path, remote: casstore.Remote,
                                                                  seaweed: Any) -> None:
    publish_hostile(seaweed, remote.url, "heads", "evil", manifest_bytes({"/abs": PAYLOAD}))
    b = casstore.open(tmp_path / "b")
    add_remote(b, "origin", remote.url, endpoint_url=seaweed.endpoint)
    before = object_files(b)
    r = subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(b.root), "pull", "origin", "evil"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "'/abs'" in r.stderr, r.stderr
    assert_nothing_stored(b, before)


@pytest.mark.parametrize("what", ["content", "version"])
def test_object_bytes_that_do_not_match_the_key_are_refused(tmp_path: Path, remote: casstore.Remote,
                                                             seaweed: Any, what: str) -> None:
    client = seaweed.client()
    good = b"the real bytes " * 50
    version = manifest_bytes({"x": entry(good)})
    vhex = hexof(version)
    if what == "content":
        put_object_bytes(client, remote.url, b"other bytes " * 50, under=hexof(good))
        put_object_bytes(client, remote.url, version)
        wrong = hexof(good)
    else:
        put_object_bytes(client, remote.url, good)
        put_object_bytes(client, remote.url, manifest_bytes({"y": entry(good)}), under=vhex)
        wrong = vhex
    put_key(client, remote.url, "refs/heads/h", f"blake3:{vhex}\n".encode())
    b = casstore.open(tmp_path / "b")
    with pytest.raises(casstore.IntegrityError) as ei:
        b.pull(remote, "h")
    assert wrong in str(ei.value) and remote.objects.key(casstore.Digest(wrong)) in str(ei.value)
    d = casstore.Digest(wrong)
    assert d not in b and b.heads() == {} and os.listdir(b.root / "tmp") == []
    for name in object_files(b):  # whatever did arrive is what its name says
        b.get(casstore.Digest(name.replace("/", "")))
    with pytest.raises(casstore.IntegrityError):
        b.fetch_object(d, remotes=[remote])
    assert d not in b
    with pytest.raises(casstore.IntegrityError):
        remote.objects.read(d)


@pytest.mark.parametrize("recorded", [10, 9 * MiB], ids=["small", "multipart"])
def test_object_larger_than_recorded_is_refused_unread(tmp_path: Path, remote: casstore.Remote, seaweed: Any,
                                                       recorded: int) -> None:
    """The manifest records ``recorded`` bytes; the key holds more (different) bytes: refused, not downloaded."""
    client = seaweed.client()
    good = os.urandom(recorded)
    put_object_bytes(client, remote.url, os.urandom(recorded + 3 * MiB), under=hexof(good))
    version = manifest_bytes({"x": entry(good)})
    put_object_bytes(client, remote.url, version)
    put_key(client, remote.url, "refs/heads/h", f"blake3:{hexof(version)}\n".encode())
    b = casstore.open(tmp_path / "b")
    remote.requests.clear()
    with pytest.raises(casstore.IntegrityError, match=f"larger .* than the {recorded} bytes"):
        b.pull(remote, "h")
    # Two ref reads, the version, and at most one (bounded) read of the object: no ranged download.
    assert remote.requests["GetObject"] <= 4, remote.requests
    d = casstore.Digest(hexof(good))
    assert d not in b and b.heads() == {} and os.listdir(b.root / "tmp") == []


def test_object_smaller_than_recorded_with_wrong_bytes_is_refused(tmp_path: Path, remote: casstore.Remote,
                                                                  seaweed: Any) -> None:
    client = seaweed.client()
    good = os.urandom(5000)
    put_object_bytes(client, remote.url, good[:100], under=hexof(good))
    version = manifest_bytes({"x": entry(good)})
    put_object_bytes(client, remote.url, version)
    put_key(client, remote.url, "refs/pins/p", f"blake3:{hexof(version)}\n".encode())
    b = casstore.open(tmp_path / "b")
    with pytest.raises(casstore.IntegrityError, match="corrupt"):
        b.pull(remote, "p")
    assert casstore.Digest(hexof(good)) not in b and b.pins() == {}


@pytest.mark.parametrize("body", [b"not a digest\n", b"blake3:" + b"z" * 64, b"\xff\xfe binary", b"",
                                  b"blake3:" + b"0" * 64 + b"\n" + b"x" * 1000],
                         ids=["text", "bad-hex", "binary", "empty", "too-long"])
def test_garbage_ref_is_a_store_format_error_naming_the_key(tmp_path: Path, remote: casstore.Remote,
                                                            seaweed: Any, body: bytes) -> None:
    key = put_key(seaweed.client(), remote.url, "refs/heads/junk", body)
    b = casstore.open(tmp_path / "b")
    for call in (lambda: b.pull(remote, "junk"), lambda: b.pull(remote), lambda: remote.refs.read("heads", "junk"),
                 lambda: remote.refs.list("heads")):
        with pytest.raises(casstore.StoreFormatError) as ei:
            call()
        assert f"s3://{_seaweed.BUCKET}/{key}" in str(ei.value)
    assert b.heads() == {} and object_files(b) == []


def test_listings_ignore_keys_that_are_not_casstore_keys(tmp_path: Path, remote: casstore.Remote,
                                                         seaweed: Any) -> None:
    a = casstore.open(tmp_path / "a")
    with a.edit("h") as m:
        m["k"] = a.put(b"real content")
    a.push(remote, "h")
    real_objects = sorted(remote.objects.iter_digests())
    client = seaweed.client()
    h = "ab" + "c" * 62
    strays = ["objects/README", "objects/zz/" + "0" * 62, "objects/ab/short", f"objects/{h[:2]}/{h[2:]}.zst",
              f"objects/{h[:2]}{h[2:]}", f"objects/{h[:2]}/{h[2:]}/more", "objects/AB/" + "c" * 62,
              "refs/other/x", "refs/pins"]
    for rel in strays:
        put_key(client, remote.url, rel, f"blake3:{real_objects[0].hex}\n".encode())
    assert sorted(remote.objects.iter_digests()) == real_objects
    assert [i.digest for i in remote.objects.iter_info()] == real_objects
    assert remote.refs.list("heads") == {"h": a.heads()["h"]}
    assert remote.refs.list("pins") == {}
    assert remote.objects.present([*real_objects, casstore.Digest(h)]) == set(real_objects)
    b = casstore.open(tmp_path / "b")
    rep = b.pull(remote)
    assert rep.refs == {"heads/h": "created"}
    assert sorted(b.iter_objects()) == real_objects


@pytest.mark.parametrize("rel", ["refs/heads/ctl\x01name", "refs/heads/run\t1", "refs/heads/bad:name"])
def test_ref_keys_whose_names_are_not_valid_are_listed_as_damaged(tmp_path: Path, remote: casstore.Remote,
                                                                  seaweed: Any, rel: str) -> None:
    # Hazard (bug hunt): such keys (older releases could write "run\t1") were skipped, so remote gc
    # deleted the closure of the version they name, and pull and `remote ls` hid them.
    a = casstore.open(tmp_path / "a")
    with a.edit("run") as m:
        m["w"] = a.put(b"weights of the old run")
    a.push(remote, "run")
    v = a.heads()["run"]
    client = seaweed.client()
    put_key(client, remote.url, rel, f"{v}\n".encode())
    remote.refs.compare_and_swap("heads", "run", None, remote.refs.read("heads", "run"))
    got = remote.refs.scan("heads")
    bad = rel[len("refs/heads/"):]
    assert got.refs == {} and list(got.damaged) == [bad]
    assert "delete that key, or rename it" in got.damaged[bad] and repr(f"{remote.url}/{rel}") in got.damaged[bad]
    with pytest.raises(casstore.StoreFormatError, match="cannot be read"):
        remote.refs.list("heads")
    with pytest.raises(casstore.StoreFormatError, match="delete that key, or rename it"):
        casstore.open(tmp_path / "g").plan_gc(keep_history=0, grace=0, remote=remote)
    assert remote.objects.has(a.manifest("run")["w"].digest)  # nothing deleted
    with pytest.raises(casstore.StoreFormatError, match="delete that key, or rename it"):
        casstore.open(tmp_path / "b").pull(remote)


def test_an_empty_folder_marker_under_refs_is_not_a_ref(remote: casstore.Remote, seaweed: Any) -> None:
    d = casstore.Digest.of(b"x")
    put_key(seaweed.client(), remote.url, "refs/heads/dir/", b"")  # what S3 consoles create for a folder
    put_key(seaweed.client(), remote.url, "refs/heads/ok", f"{d}\n".encode())
    assert remote.refs.scan("heads") == casstore.refs.base.RefListing({"ok": d}, {})


def test_endpoint_port_0_is_refused(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "s")
    for ep in ("http://storage.lab:0", "http://127.0.0.1:0"):
        with pytest.raises(casstore.InvalidInputError, match="port 0"):
            s.add_remote("o", "s3://hunt/x", endpoint_url=ep)
        with pytest.raises(casstore.InvalidInputError, match="port 0"):
            casstore.Remote("s3://hunt/x", endpoint_url=ep)
    assert s.remotes() == {}


def test_pull_refuses_remote_names_that_clash_by_prefix_before_moving_any_ref(tmp_path: Path,
                                                                              remote: casstore.Remote,
                                                                              seaweed: Any) -> None:
    # Hazard (bug hunt): a full pull moved some refs, then stopped at "x/y" with "choose another".
    s1, s2 = casstore.open(tmp_path / "s1"), casstore.open(tmp_path / "s2")
    with s1.edit("x") as m:
        m["a"] = s1.put(b"1")
    with s2.edit("x/y") as m:
        m["a"] = s2.put(b"2")
    with s2.edit("a") as m:
        m["a"] = s2.put(b"3")
    s1.push(remote, "x")
    s2.push(remote, "a")
    # As two racing pushes (or releases before the push check) could leave it; the version need not be
    # there: the pull refuses before it reads any.
    put_key(seaweed.client(), remote.url, "refs/heads/x/y", f"{s2.heads()['x/y']}\n".encode())
    b = casstore.open(tmp_path / "b")
    with pytest.raises(casstore.NameExistsError, match=r"heads 'x' and 'x/y' there cannot both exist.*nothing was "
                                                      r"pulled.*casstore mv x/y NEW"):
        b.pull(remote)
    assert b.heads() == {}
    with pytest.raises(casstore.NameExistsError, match=r"head 'x/y' there clashes with the local head 'x'"):
        s1.pull(remote, "x/y")
    assert sorted(s1.heads()) == ["x"]
    assert sorted(b.pull(remote, "a").refs) == ["heads/a"]


def test_push_refuses_a_name_that_clashes_by_prefix_with_a_remote_name(tmp_path: Path, remote: casstore.Remote,
                                                                       ) -> None:
    s1, s2 = casstore.open(tmp_path / "s1"), casstore.open(tmp_path / "s2")
    with s1.edit("x") as m:
        m["a"] = s1.put(b"1")
    with s2.edit("x/y") as m:
        m["a"] = s2.put(b"2")
    with s1.edit("w/v") as m:
        m["a"] = s1.put(b"3")
    with s2.edit("w") as m:
        m["a"] = s2.put(b"4")
    s1.push(remote, "x", "w/v")
    with pytest.raises(casstore.NameExistsError, match=r"head 'x' there and your head 'x/y' cannot both exist"):
        s2.push(remote, "x/y")
    with pytest.raises(casstore.NameExistsError, match=r"head 'w/v' there and your head 'w' cannot both exist"):
        s2.push(remote, "w")
    assert remote.refs.names("heads") == ["w/v", "x"]


@contextmanager
def _reading_through(tmp_path: Path, length: int, body: Callable[[Any], None],
                     read_timeout: float) -> Iterator[casstore.Store]:
    """A store reading through a loopback HTTP server whose every GET answers 200 announcing
    ``length`` bytes, then calls ``body(handler)`` to send what it sends."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(length))
            self.send_header("ETag", '"x"')
            self.end_headers()
            body(self)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = casstore.Remote("s3://fake/x", endpoint_url=f"http://127.0.0.1:{srv.server_address[1]}",
                            read_timeout=read_timeout, connect_timeout=2, max_attempts=1, progress=False)
        yield casstore.open(tmp_path / "s", upstream=r)
    finally:
        srv.shutdown()


def test_a_body_that_trickles_fails_in_bounded_time(tmp_path: Path, aws_credentials: Any) -> None:
    # Hazard (bug hunt): per-read timeouts never fire for a server sending a byte every 1.5 s, so a
    # read-through get with read_timeout=2 ran as long as the server liked.
    import threading
    import time

    stop = threading.Event()

    def drip(h: Any) -> None:
        try:
            for _ in range(40):
                if stop.is_set():
                    return
                h.wfile.write(b"a")
                h.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass

    try:
        with _reading_through(tmp_path, 40, drip, 0.7) as s:
            t0 = time.monotonic()
            with pytest.raises(casstore.NetworkTimeout, match="too slow"):
                s.get(casstore.Digest("ab" * 32))
            assert time.monotonic() - t0 < 8  # 2 read timeouts + 40 bytes; the trickle takes 20 s
    finally:
        stop.set()


def test_a_body_cut_short_is_a_network_failure_not_a_corrupt_object(tmp_path: Path, aws_credentials: Any) -> None:
    # Hazard (CI, a server SIGKILLed mid-pull): the connection closed after 3,697 of 8,000 announced
    # bytes, the short body was hashed, and the remote object was reported corrupt.
    def cut(h: Any) -> None:
        h.wfile.write(b"a" * 3697)
        h.wfile.flush()
        h.close_connection = True

    with _reading_through(tmp_path, 8000, cut, 2) as s:
        with pytest.raises(casstore.BackendError) as ei:
            s.get(casstore.Digest("ab" * 32))
        assert not isinstance(ei.value, casstore.IntegrityError), ei.value
        assert "corrupt" not in str(ei.value)


def test_a_pulled_version_with_a_key_that_is_also_a_directory_is_refused(tmp_path: Path, remote: casstore.Remote,
                                                                         seaweed: Any) -> None:
    """Found by a bug hunt: keys "a" and "a/b" (edit refuses the pair) came in by pull as a head that
    could never be checked out."""
    client = seaweed.client()
    obj = b"payload"
    oh = bytes.fromhex(put_object_bytes(client, remote.url, obj))
    for keys in (["a", "a/b"], ["a", "a-b", "a/b/c"]):  # (not neighbours in key order)
        man = msgpack.packb({"casstore": "manifest", "entries": {k: [oh, len(obj)] for k in keys}, "meta": {},
                             "parent": None, "v": 1}, use_bin_type=True)
        h = put_object_bytes(client, remote.url, man)
        put_key(client, remote.url, "refs/heads/exp", f"blake3:{h}\n".encode())
        s = casstore.open(tmp_path / f"s{len(keys)}")
        with pytest.raises(casstore.StoreFormatError, match=r"key 'a' and the key 'a/b.*' under it"):
            s.pull(remote, "exp")
        assert s.heads() == {}


def test_file_dir_clash_finds_the_pair_wherever_it_is() -> None:
    from casstore.manifests.model import file_dir_clash

    assert file_dir_clash(["a", "a-b", "a.c", "a/b"]) == ("a", "a/b")
    assert file_dir_clash(["x/y/z", "x/y"]) == ("x/y", "x/y/z")
    assert file_dir_clash(["a/b", "a/c", "ab", "b/a"]) is None
    assert file_dir_clash([]) is None


def test_pull_refuses_a_name_that_would_be_the_folder_of_a_local_name_of_the_other_kind(
        tmp_path: Path, remote: casstore.Remote) -> None:
    """A head 'x' pulled beside a local pin 'x/y' (refs refuses the pair now): refused before any ref moves."""
    s1, s2 = casstore.open(tmp_path / "s1"), casstore.open(tmp_path / "s2")
    with s1.edit("x") as m:
        m["a"] = s1.put(b"1")
    with s1.edit("other") as m:
        m["a"] = s1.put(b"2")
    s1.push(remote)
    with s2.edit("x/y") as m:
        m["a"] = s2.put(b"3")
    s2.freeze("x/y")
    with pytest.raises(casstore.NameExistsError, match=r"head 'x' there clashes with the local pin 'x/y'.*nothing was"):
        s2.pull(remote)
    assert s2.heads() == {} and list(s2.pins()) == ["x/y"]
