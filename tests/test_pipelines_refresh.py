"""fetch without a checksum trusts the first download; fetch(refresh=True) revalidates (issue 13).

Against a real HTTP server on 127.0.0.1 that honours If-None-Match (ETag) or If-Modified-Since
(Last-Modified) with 304 Not Modified.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Iterator

import pytest
from _fetch_helpers import Server, b3, clean_settings_env, serve

import casstore
from casstore.errors import IntegrityError, InvalidTypeError
from casstore.pipelines import fetch_name


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


@pytest.fixture
def server() -> Iterator[Server]:
    with serve() as s:
        yield s


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


def test_first_download_is_trusted_until_refresh(store: casstore.Store, server: Server) -> None:
    v1, v2 = os.urandom(100_000), os.urandom(120_000)
    url = server.add("/data.bin", v1)
    assert str(store.fetch(url)) == b3(v1)
    rec = store.manifest(fetch_name(url)).meta
    assert rec["etag"].startswith('"') and "last_modified" not in rec
    server.routes["/data.bin"].data = v2  # the resource changes on the server
    assert str(store.fetch(url)) == b3(v1)  # no checksum asked: the first download is trusted ...
    assert server.count("/data.bin") == 1  # ... without asking the server
    # refresh=True asks, conditionally: unchanged -> 304, nothing downloaded, nothing recorded.
    server.routes["/data.bin"].data = v1
    assert str(store.fetch(url, refresh=True)) == b3(v1)
    req = server.reqs("/data.bin")[-1]
    assert req.if_none_match == rec["etag"] and req.status == 304
    assert len(store.history(fetch_name(url))) == 1
    # Changed -> 200: the new bytes are downloaded, checked and recorded as a new version of the record.
    server.routes["/data.bin"].data = v2
    assert str(store.fetch(url, refresh=True)) == b3(v2)
    assert server.reqs("/data.bin")[-1].status == 200 and len(store.history(fetch_name(url))) == 2
    assert str(store.fetch(url)) == b3(v2) and server.count("/data.bin") == 3
    # A checksum still applies to a refreshed download.
    server.routes["/data.bin"].data = v1
    with pytest.raises(IntegrityError):
        store.fetch(url, refresh=True, sha256=hashlib.sha256(v2).hexdigest())
    assert str(store.fetch(url)) == b3(v2)  # nothing was recorded by the failed refresh
    with pytest.raises(InvalidTypeError):
        store.fetch(url, refresh=1)  # type: ignore[arg-type]


def test_refresh_with_last_modified_and_without_validators(store: casstore.Store, server: Server) -> None:
    v1, v2 = os.urandom(50_000), os.urandom(50_000)
    stamp = "Tue, 01 Dec 2026 06:00:00 GMT"
    url = server.add("/lm.bin", v1, etag=False, last_modified=stamp)
    assert str(store.fetch(url)) == b3(v1)
    assert store.manifest(fetch_name(url)).meta["last_modified"] == stamp
    assert str(store.fetch(url, refresh=True)) == b3(v1)
    assert server.reqs("/lm.bin")[-1].if_modified_since == stamp and server.reqs("/lm.bin")[-1].status == 304
    server.routes["/lm.bin"].data = v2
    server.routes["/lm.bin"].last_modified = "Wed, 02 Dec 2026 06:00:00 GMT"
    assert str(store.fetch(url, refresh=True)) == b3(v2)
    # A server with no validators at all: refresh is an unconditional download.
    url2 = server.add("/none.bin", v1, etag=False)
    store.fetch(url2)
    server.routes["/none.bin"].data = v2
    assert str(store.fetch(url2, refresh=True)) == b3(v2)
    req = server.reqs("/none.bin")[-1]
    assert req.if_none_match is None and req.if_modified_since is None and server.count("/none.bin") == 2


def test_refresh_file_url(store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "local.bin"
    src.write_bytes(b"one")
    url = src.as_uri()
    assert str(store.fetch(url)) == b3(b"one")
    assert store.fetch(url, refresh=True) == store.fetch(url)
    assert len(store.history(fetch_name(url))) == 1  # unchanged size and mtime: not re-read
    src.write_bytes(b"two!")
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 5_000_000))
    assert str(store.fetch(url)) == b3(b"one")  # trusted until asked
    assert str(store.fetch(url, refresh=True)) == b3(b"two!")
    assert len(store.history(fetch_name(url))) == 2


def test_cli_fetch_refresh(tmp_path: Path, server: Server) -> None:
    import subprocess
    import sys

    v1, v2 = os.urandom(10_000), os.urandom(10_000)
    url = server.add("/cli.bin", v1)
    cli = str(Path(sys.executable).with_name("casstore"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    casstore.open(tmp_path / "store")  # an explicit --store must exist (issue 12)

    def run(*args: str) -> str:
        r = subprocess.run([cli, "--store", str(tmp_path / "store"), "fetch", url, *args], capture_output=True,
                           text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert run() == b3(v1)
    server.routes["/cli.bin"].data = v2
    assert run() == b3(v1) and run("--refresh") == b3(v2)
    assert [r.status for r in server.reqs("/cli.bin")] == [200, 200]
    assert run("--refresh") == b3(v2) and server.reqs("/cli.bin")[-1].status == 304
