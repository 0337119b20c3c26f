"""The lean GET path (casstore/objects/s3lean.py): GETs signed with botocore's parts, sent without its client.

Contracts, against a real SeaweedFS server (and a raw socket server that lies):

* object reads (whole, bounded, ranged) go through it, counted like client requests, and a
  missing key is settled there (no second request through the client);
* prefixes that need quoting (spaces, unicode, ``+``) are signed right: no fall-back;
* anything it cannot settle (no such bucket, refused credentials) falls back to the client
  and gives the client's typed error; after ``MAX_MISSES`` fall-backs in a row it turns off;
* a server announcing more than the limit is not read (no waiting for bytes it never sends).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List

import _seaweed
import pytest

import casstore
from casstore.objects.s3 import S3Connection
from casstore.objects.s3lean import MAX_MISSES

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote = _seaweed.remote
remote_url = _seaweed.remote_url

MiB = 1 << 20


def _lean(rem: casstore.Remote) -> Any:
    lean = rem.objects.connection.lean
    assert lean is not None, "credentials are set: the lean path applies"
    return lean


def test_reads_take_the_lean_path_and_count_as_gets(tmp_path: Path, remote: casstore.Remote) -> None:
    a = casstore.open(tmp_path / "a")
    blobs = [os.urandom(1000 * (i + 1)) for i in range(5)]
    with a.edit("x") as m:
        for i, blob in enumerate(blobs):
            m[str(i)] = a.put(blob)
    a.push(remote, "x")
    reader = casstore.Remote(remote.url, endpoint_url=remote.endpoint_url, progress=False, chunking=None)
    lean = _lean(reader)
    before = lean.answered
    for blob in blobs:
        assert reader.objects.read(casstore.Digest.of(blob)) == blob
    d0 = casstore.Digest.of(blobs[4])
    assert reader.objects.read_range(d0, 100, 50) == blobs[4][100:150]
    assert lean.answered - before == 6 and lean.fallbacks == 0
    assert reader.requests["GetObject"] == 6
    with pytest.raises(casstore.ObjectNotFoundError):
        reader.objects.read(casstore.Digest.of(b"never pushed"))
    assert lean.fallbacks == 0  # "no such key" settled by the lean path
    assert reader.requests["GetObject"] >= 7


@pytest.mark.parametrize("prefix", ["with space", "ünï/cødé", "a+b=c&d", "tilde~x/semi;colon"])
def test_prefixes_that_need_quoting_are_signed_right(tmp_path: Path, seaweed: Any, remote_url: str,
                                                      prefix: str) -> None:
    rem = casstore.Remote(f"{remote_url}/{prefix}", endpoint_url=seaweed.endpoint, progress=False, chunking=None)
    a = casstore.open(tmp_path / "a")
    blob = os.urandom(3000)
    with a.edit("x") as m:
        m["f"] = a.put(blob)
    a.push(rem, "x")
    b = casstore.open(tmp_path / "b", upstream=rem)
    assert b.get(casstore.Digest.of(blob)) == blob
    lean = _lean(rem)
    assert lean.answered >= 1 and lean.fallbacks == 0


def test_missing_bucket_falls_back_to_the_clients_error_then_turns_off(seaweed: Any) -> None:
    rem = casstore.Remote("s3://no-such-bucket-here/p", endpoint_url=seaweed.endpoint, progress=False)
    lean = _lean(rem)
    d = casstore.Digest.of(b"x")
    for i in range(MAX_MISSES):
        with pytest.raises(casstore.BackendError, match="does not exist"):
            rem.objects.read(d)
        assert lean.fallbacks == i + 1
    assert not lean.enabled
    with pytest.raises(casstore.BackendError, match="does not exist"):
        rem.objects.read(d)  # through the client alone now
    assert lean.fallbacks == MAX_MISSES


def test_refused_credentials_fall_back_to_the_clients_error(seaweed: Any, remote_url: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    rem = casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, progress=False, max_attempts=1)
    with pytest.raises(casstore.BackendError, match="credentials|denied|Signature"):
        rem.objects.read(casstore.Digest.of(b"x"))
    assert _lean(rem).fallbacks == 1


class _LyingServer:
    """Answers every request with a 200 announcing ``announce`` bytes, then sends nothing and waits."""

    def __init__(self, announce: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.announce = announce
        self.conns: List[socket.socket] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(conn)
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nETag: \"x\"\r\n\r\n" % self.announce)

    def close(self) -> None:
        self._stop.set()
        self.thread.join()
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def lying() -> Iterator[_LyingServer]:
    srv = _LyingServer(announce=5 * MiB)
    yield srv
    srv.close()


def test_an_object_announced_larger_than_the_limit_is_not_read(lying: _LyingServer, aws_credentials: Any) -> None:
    conn = S3Connection("bucket", where="test", endpoint_url=f"http://127.0.0.1:{lying.port}", read_timeout=20,
                        max_attempts=1)
    t0 = time.monotonic()
    got = conn.get("some/key", limit=1 * MiB)
    assert got is not None and got.data is None and got.size == 5 * MiB
    assert time.monotonic() - t0 < 10  # no wait for the 5 MiB the server never sends (read timeout: 20 s)
    lean = conn.lean
    assert lean is not None and lean.answered == 1 and lean.fallbacks == 0
