"""Hostile remote settings and damaged remote refs (docs/security.md, classes 8 and 11).

What must hold:

* ``endpoint_url``, ``region``, ``profile`` and the numeric settings of a remote are checked where
  they enter: :class:`casstore.Remote` and ``add_remote`` raise InvalidTypeError/InvalidInputError
  naming the argument and a valid form; a ``remotes.toml`` holding a bad value (or a bad remote
  name) is a StoreFormatError naming the file, the remote and the key, never a raw
  ValueError/TypeError at first use ("failed unexpectedly" in the CLI);
* credentials in ``endpoint_url`` (``user:pass@``) are refused, never stored and never shown,
  whether given to the API, the CLI or planted in ``remotes.toml``;
* remote URLs with control characters, or bucket names outside S3's rules, are refused with a
  one-line typed error; every URL the other remote tests use is still accepted;
* a damaged remote ref can be repaired the way its error says: a push with force replaces it,
  conditionally on the key still holding the damaged bytes that were read.

Everything talks to a real SeaweedFS (tests/_seaweed.py) or to a real store on disk: no mocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import _seaweed
import pytest
from _seaweed import BUCKET, CallOnRequest, check_remote_consistent, put_key

import casstore
from casstore.sync import add_remote, get_remote, load_remotes, remove_remote

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

SECRET = "supersecret"
USER = "AKIAUSER"
CRED_ENDPOINT = f"http://{USER}:{SECRET}@127.0.0.1:21779"


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "casstore.cli", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120)


def _assert_one_typed_line(r: subprocess.CompletedProcess[str]) -> None:
    """A CLI refusal: exit 1, one line on stderr, a typed error (not "failed unexpectedly", no traceback)."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "failed unexpectedly" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _plant(store: casstore.Store, text: str) -> Path:
    """Write ``remotes.toml`` by hand (a hand edit, another tool, an attacker)."""
    p = store.root / "remotes.toml"
    p.write_text(text)
    return p


# -- 1. endpoint_url, region, profile and numbers are checked at the call ------------------------------


BAD_ENDPOINTS = ["not a url at all", "storage.lab:8333", "ftp://storage.lab", "http://", "http://:8333",
                 "http://host:99999", "http://host:port", "http://ho st:8333", "http://host\n:8333",
                 "http://host:8333/?x=1", "http://host:8333/#frag", "http://bad_host:8333", "http://[::1:8333"]


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_invalid_endpoint_url_is_refused_at_add_and_at_construction(tmp_path: Path, endpoint: str) -> None:
    s = casstore.open(tmp_path / "s")
    with pytest.raises(casstore.InvalidInputError) as ei:
        add_remote(s, "o2", "s3://hunt/p7", endpoint_url=endpoint)
    msg = str(ei.value)
    assert "endpoint_url" in msg and "http(s)://host[:port]" in msg and "\n" not in msg, msg
    assert not (s.root / "remotes.toml").exists()
    with pytest.raises(casstore.InvalidInputError, match="endpoint_url"):
        casstore.Remote("s3://hunt/p7", endpoint_url=endpoint)
    with pytest.raises(casstore.InvalidInputError, match="endpoint_url"):  # a store that caches a remote:
        casstore.open("s3://hunt/p7", endpoint_url=endpoint, cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before its cache directory was made


def test_cli_remote_add_refuses_an_invalid_endpoint_in_one_line(tmp_path: Path) -> None:
    root = casstore.open(tmp_path / "s").root
    r = _cli(root, "remote", "add", "o2", "s3://hunt/p7", "--endpoint-url", "not a url at all")
    _assert_one_typed_line(r)
    assert "--endpoint-url" in r.stderr and "http(s)://host[:port]" in r.stderr, r.stderr  # (CLI words)
    assert not (root / "remotes.toml").exists()


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8333", "https://storage.lab", "http://storage.lab:8333/",
                                      "http://[::1]:8333", "https://s3.eu-west-1.amazonaws.com",
                                      "http://gw.example.org:8080/s3/base", "HTTP://Storage.Lab:9000", ""])
def test_valid_endpoints_are_accepted(tmp_path: Path, endpoint: str) -> None:
    s = casstore.open(tmp_path / "s")
    r = add_remote(s, "origin", "s3://team-bucket/casstore", endpoint_url=endpoint)
    assert r.endpoint_url == (endpoint or None)
    assert get_remote(s, "origin").endpoint_url == (endpoint or None)


@pytest.mark.parametrize("kwargs, error, named", [
    ({"endpoint_url": 5}, casstore.InvalidTypeError, "endpoint_url"),
    ({"endpoint_url": b"http://h:1"}, casstore.InvalidTypeError, "endpoint_url"),
    ({"region": 5}, casstore.InvalidTypeError, "region"),
    ({"region": "eu west 1"}, casstore.InvalidInputError, "region"),
    ({"region": "eu-west-1\n"}, casstore.InvalidInputError, "region"),
    ({"profile": 7}, casstore.InvalidTypeError, "profile"),
    ({"profile": "lab\nx"}, casstore.InvalidInputError, "profile"),
    ({"name": 3}, casstore.InvalidTypeError, "name"),
    ({"name": "bad name"}, casstore.InvalidInputError, "name"),
    ({"connect_timeout": -1}, casstore.InvalidInputError, "connect_timeout"),
    ({"connect_timeout": 0}, casstore.InvalidInputError, "connect_timeout"),
    ({"connect_timeout": float("nan")}, casstore.InvalidInputError, "connect_timeout"),
    ({"connect_timeout": "5"}, casstore.InvalidTypeError, "connect_timeout"),
    ({"read_timeout": float("inf")}, casstore.InvalidInputError, "read_timeout"),
    ({"read_timeout": True}, casstore.InvalidTypeError, "read_timeout"),
    ({"max_attempts": 0}, casstore.InvalidInputError, "max_attempts"),
    ({"max_attempts": 2.5}, casstore.InvalidTypeError, "max_attempts"),
    ({"workers": "4"}, casstore.InvalidTypeError, "workers"),
    ({"workers": 0}, casstore.InvalidInputError, "workers"),
    ({"multipart_threshold": -1}, casstore.InvalidInputError, "multipart_threshold"),
    ({"multipart_chunksize": 1.5}, casstore.InvalidTypeError, "multipart_chunksize"),
    ({"progress": "yes"}, casstore.InvalidTypeError, "progress"),
    ({"chunking": 4}, casstore.InvalidTypeError, "chunking"),
], ids=lambda v: "" if not isinstance(v, dict) else "-".join(f"{k}={v[k]!r}" for k in v))
def test_remote_arguments_are_type_and_range_checked(kwargs: Dict[str, Any], error: type, named: str) -> None:
    with pytest.raises(error) as ei:
        casstore.Remote("s3://team-bucket/p", **kwargs)
    assert named in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


@pytest.mark.parametrize("key, value", [("endpoint_url", "not a url at all"), ("region", "eu west 1"),
                                        ("profile", "lab\u0007"), ("url", "s3://ab/p")])
def test_planted_remotes_toml_with_a_bad_setting_is_a_store_format_error(tmp_path: Path, key: str,
                                                                        value: str) -> None:
    s = casstore.open(tmp_path / "s")
    cfg = {"url": "s3://hunt/p7", key: value}
    p = _plant(s, "[remotes.o2]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items()))
    for call in (lambda: load_remotes(s), lambda: get_remote(s, "o2"), lambda: s.remotes(),
                 lambda: add_remote(s, "other", "s3://team-bucket/x")):
        with pytest.raises(casstore.StoreFormatError) as ei:
            call()
        msg = str(ei.value)
        assert str(p) in msg and "'o2'" in msg and key in msg and "\n" not in msg, msg


def test_cli_on_a_planted_bad_endpoint_prints_one_typed_line(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "s")
    _plant(s, '[remotes.o2]\nurl = "s3://hunt/p7"\nendpoint_url = "not a url at all"\n')
    for args in (["remote", "ls"], ["remote", "ls", "o2"], ["remote", "check", "o2"], ["pull", "o2"],
                 ["gc", "--remote", "o2"]):
        r = _cli(s.root, *args)
        _assert_one_typed_line(r)
        assert "remotes.toml" in r.stderr and "endpoint_url" in r.stderr and "'o2'" in r.stderr, (args, r.stderr)


def test_a_planted_bad_remote_can_be_removed(tmp_path: Path) -> None:
    """The error says to remove the entry: ``remote rm`` must still work on it (and keep the rest)."""
    s = casstore.open(tmp_path / "s")
    _plant(s, '[remotes.o2]\nurl = "s3://hunt/p7"\nendpoint_url = "not a url at all"\n'
              '[remotes.ok]\nurl = "s3://team-bucket/x"\n')
    remove_remote(s, "o2")
    assert load_remotes(s) == {"ok": {"url": "s3://team-bucket/x"}}


# -- 2. credentials in endpoint_url: refused, never stored, never shown ---------------------------------


@pytest.mark.parametrize("endpoint", [CRED_ENDPOINT, f"http://{USER}@127.0.0.1:21779",
                                      f"https://{USER}:{SECRET}@storage.lab/base"])
def test_credentials_in_endpoint_url_are_refused_and_not_echoed(tmp_path: Path, endpoint: str) -> None:
    s = casstore.open(tmp_path / "s")
    for call in (lambda: add_remote(s, "o2", "s3://hunt/p7", endpoint_url=endpoint),
                 lambda: casstore.Remote("s3://hunt/p7", endpoint_url=endpoint)):
        with pytest.raises(casstore.InvalidInputError) as ei:
            call()
        msg = str(ei.value)
        assert SECRET not in msg and USER not in msg, msg
        assert "credentials" in msg and "AWS_ACCESS_KEY_ID" in msg and "docs/remotes.md" in msg, msg
    assert not (s.root / "remotes.toml").exists()


def test_cli_refuses_credentials_in_endpoint_without_echoing_them(tmp_path: Path) -> None:
    root = casstore.open(tmp_path / "s").root
    r = _cli(root, "remote", "add", "o2", "s3://hunt/p7", "--endpoint-url", CRED_ENDPOINT)
    _assert_one_typed_line(r)
    assert SECRET not in r.stderr + r.stdout and USER not in r.stderr + r.stdout, r.stderr
    assert not (root / "remotes.toml").exists()


def test_planted_credentials_in_remotes_toml_are_refused_without_echo(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "s")
    p = _plant(s, f'[remotes.o2]\nurl = "s3://hunt/p7"\nendpoint_url = "{CRED_ENDPOINT}"\n')
    for call in (lambda: load_remotes(s), lambda: get_remote(s, "o2")):
        with pytest.raises(casstore.StoreFormatError) as ei:
            call()
        msg = str(ei.value)
        assert str(p) in msg and "'o2'" in msg and "endpoint_url" in msg and "credentials" in msg, msg
        assert SECRET not in msg and USER not in msg, msg
    for args in (["remote", "ls"], ["remote", "check", "o2"], ["push", "o2"]):
        r = _cli(s.root, *args)
        _assert_one_typed_line(r)
        assert SECRET not in r.stderr + r.stdout and USER not in r.stderr + r.stdout, r.stderr


# -- 3. remote URLs: control characters and bucket names ------------------------------------------------


BAD_URLS = ["s3://hunt/nl\nx", "s3://hunt/tab\tx", "s3://hunt/cr\rx", "s3://hunt/esc\x1b[31mx", "s3://hunt/del\x7f",
            "s3://hunt/c1\x85x", "s3://hunt/nul\x00x", "s3://hunt/sur\udcffx", "s3://hu\nnt/x",
            "s3://ab/p", "s3://Hunt_bucket/p", "s3://UPPER/p", "s3://" + "a" * 64 + "/p", "s3://-abc/p",
            "s3://abc-/p", "s3://a..b/p", "s3://.abc/p", "s3://192.168.1.1/p", "s3:///p", "s3://"]


@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_remote_urls_are_refused_in_one_line(tmp_path: Path, url: str) -> None:
    s = casstore.open(tmp_path / "s")
    for call in (lambda: add_remote(s, "r1", url), lambda: casstore.Remote(url)):
        with pytest.raises(casstore.InvalidInputError) as ei:
            call()
        assert "\n" not in str(ei.value) and "\r" not in str(ei.value), str(ei.value)
    assert not (s.root / "remotes.toml").exists()


def test_cli_refuses_a_url_with_a_newline_in_one_line(tmp_path: Path) -> None:
    root = casstore.open(tmp_path / "s").root
    for url in ("s3://hunt/nl\nx", "s3://hunt/tab\tx", "s3://ab/p", "s3://Hunt_bucket/p"):
        r = _cli(root, "remote", "add", "r1", url)
        _assert_one_typed_line(r)
    assert not (root / "remotes.toml").exists()


GOOD_URLS = ["s3://casstore-tests/t-0123456789ab", "s3://bucket/prefix", "s3://team-bucket/casstore",
             "s3://team-bucket", "s3://other-bucket", "s3://no-such-bucket-here/x", "s3://rt-dying/x",
             "s3://dying/x", "s3://team/shared", "s3://bucket/team/x", "s3://bucket/some/prefix/",
             "s3://casstore-tests/t-1/with space", "s3://casstore-tests/t-1/ünï/cødé",
             "s3://casstore-tests/t-1/a+b=c&d", "s3://casstore-tests/t-1/tilde~x/semi;colon",
             "s3://my.dotted.bucket-1/p", "s3://abc", "s3://" + "a" * 63]


@pytest.mark.parametrize("url", GOOD_URLS)
def test_urls_in_use_are_still_accepted(tmp_path: Path, url: str) -> None:
    s = casstore.open(tmp_path / "s")
    assert add_remote(s, "r1", url).url == url
    assert casstore.Remote(url).url == url


@pytest.mark.parametrize("table", ['"../../evil"', '"bad name"', '"nl\\nname"', '""', '"-dash"'])
def test_planted_remote_names_are_validated_on_load(tmp_path: Path, table: str) -> None:
    s = casstore.open(tmp_path / "s")
    p = _plant(s, f'[remotes.{table}]\nurl = "s3://team-bucket/x"\n')
    for call in (lambda: load_remotes(s), lambda: s.remotes()):
        with pytest.raises(casstore.StoreFormatError) as ei:
            call()
        assert str(p) in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


def test_planted_url_with_a_newline_is_refused_on_load(tmp_path: Path) -> None:
    s = casstore.open(tmp_path / "s")
    p = _plant(s, '[remotes.r1]\nurl = "s3://hunt/nl\\nx"\n')
    with pytest.raises(casstore.StoreFormatError) as ei:
        get_remote(s, "r1")
    assert str(p) in str(ei.value) and "'r1'" in str(ei.value) and "url" in str(ei.value)
    assert "\n" not in str(ei.value)


# -- 4. a damaged remote ref is repaired by a push with force ---------------------------------------------


GARBAGE = b"\x00\xffnot a digest"


def _store_with_head(tmp_path: Path, name: str) -> casstore.Store:
    s = casstore.open(tmp_path / "a")
    with s.edit(name) as m:
        m["k"] = s.put(b"the version that repairs the ref")
    return s


@pytest.mark.parametrize("kind", ["heads", "pins"])
def test_push_with_force_replaces_a_damaged_remote_ref(tmp_path: Path, remote: casstore.Remote, seaweed: Any,
                                                       kind: str) -> None:
    s = _store_with_head(tmp_path, "garbage")
    if kind == "pins":
        s.freeze("garbage")
    key = put_key(seaweed.client(), remote.url, f"refs/{kind}/garbage", GARBAGE)
    with pytest.raises(casstore.StoreFormatError) as ei:
        s.push(remote, "garbage")
    msg = str(ei.value)
    assert f"s3://{BUCKET}/{key}" in msg and "force=True" in msg and "--force" in msg, msg
    rep = s.push(remote, "garbage", force=True)
    assert rep.refs == {f"{kind}/garbage": "forced (replaced a damaged ref)"}, rep.refs
    local = (s.pins() if kind == "pins" else s.heads())["garbage"]
    assert remote.refs.get(kind, "garbage") == local
    assert check_remote_consistent(seaweed.client(), remote.url) == {f"{kind}/garbage": str(local)}
    assert s.push(remote, "garbage").refs == {f"{kind}/garbage": "up to date"}


def test_cli_push_force_replaces_a_damaged_remote_head(tmp_path: Path, remote: casstore.Remote,
                                                       seaweed: Any) -> None:
    s = _store_with_head(tmp_path, "garbage")
    add_remote(s, "origin", remote.url, endpoint_url=seaweed.endpoint)
    put_key(seaweed.client(), remote.url, "refs/heads/garbage", GARBAGE)
    r = _cli(s.root, "push", "origin", "garbage")
    _assert_one_typed_line(r)
    assert "--force" in r.stderr, r.stderr
    r = _cli(s.root, "push", "origin", "garbage", "--force")
    assert r.returncode == 0, r.stderr
    assert remote.refs.get("heads", "garbage") == s.heads()["garbage"]


@pytest.mark.parametrize("meanwhile", ["other garbage", "a valid ref"])
def test_forced_repair_is_conditional_on_the_damaged_bytes_read(tmp_path: Path, remote: casstore.Remote,
                                                                seaweed: Any, meanwhile: str) -> None:
    """Someone rewrites the damaged key between our read and our write: our forced write must lose."""
    s = _store_with_head(tmp_path, "garbage")
    s.push(remote, "garbage")  # the closure is on the remote: the forced push's only PUTs are marker and ref
    client = seaweed.client()
    put_key(client, remote.url, "refs/heads/garbage", GARBAGE)
    other = casstore.Digest.of(b"someone else's version")
    body = b"other garbage \xfe" if meanwhile == "other garbage" else f"{other}\n".encode()
    written: List[bytes] = []

    def rewrite() -> None:  # as our ref PUT (the 2nd PutObject, after the push marker) is about to go out
        put_key(client, remote.url, "refs/heads/garbage", body)
        written.append(body)

    remote.connection.requests = CallOnRequest("PutObject", rewrite, nth=2)
    with pytest.raises(casstore.RemoteConflictError, match="garbage"):
        s.push(remote, "garbage", force=True)
    assert written == [body]
    bucket, prefix = _seaweed.split_url(remote.url)
    assert client.get_object(Bucket=bucket, Key=f"{prefix}refs/heads/garbage")["Body"].read() == body
