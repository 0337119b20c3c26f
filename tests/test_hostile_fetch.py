"""fetch against hostile servers, paths and arguments (issue 11: class 9, file:// of class 2, class 10).

Attack style: a real TCP server on 127.0.0.1 (a thread of this process) whose
handlers misbehave byte by byte -- trickling, stalling, sending more or less
than their Content-Length, streaming forever, redirecting in circles --
then the public API (``casstore.pipelines.fetch`` / ``store.fetch``) and the
CLI are called.  Nothing is mocked.  After every refusal: no object, no
staging file, no ``_fetch/`` record.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
from _fetch_helpers import b3, clean_settings_env, closed_port, fetch_heads, object_files, tmp_names

import casstore
from casstore.errors import (
    BackendError,
    CasstoreError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ObjectNotFoundError,
)
from casstore.pipelines import MAX_REDIRECTS, NetworkTimeout, fetch, fetch_name, redact

# -- a server that misbehaves on purpose -----------------------------------------------------------


@dataclass
class Hostile:
    """Request log and route table shared with the handler threads."""

    port: int = 0
    routes: Dict[str, Callable[[socket.socket, Dict[str, str]], None]] = field(default_factory=dict)
    seen: List[Tuple[str, Dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str, auth: str = "") -> str:
        return f"http://{auth}127.0.0.1:{self.port}{path}"

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for p, _ in self.seen if p.split("?")[0] == path)

    def headers(self, path: str) -> List[Dict[str, str]]:
        with self.lock:
            return [h for p, h in self.seen if p.split("?")[0] == path]


def _head(status: str, headers: Dict[str, str]) -> bytes:
    return (f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    state = Hostile()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            try:
                line = self.rfile.readline(8192).decode("latin-1")
                headers: Dict[str, str] = {}
                while True:
                    h = self.rfile.readline(8192).decode("latin-1")
                    if h in ("\r\n", "\n", ""):
                        break
                    k, _, v = h.partition(":")
                    headers[k.strip().lower()] = v.strip()
                path = line.split(" ")[1] if line.count(" ") >= 2 else "/"
                with state.lock:
                    state.seen.append((path, headers))
                route = state.routes.get(path.split("?")[0])
                if route is None:
                    self.connection.sendall(_head("404 Not Found", {"Content-Length": "0", "Connection": "close"}))
                    return
                route(self.connection, headers)
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # the client hung up: expected for most of these

    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    state.port = srv.server_address[1]
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    th.start()
    try:
        yield state
    finally:
        state.stop.set()
        srv.shutdown()
        srv.server_close()
        th.join(10)


def _ok(data: bytes, **extra: str) -> Callable[[socket.socket, Dict[str, str]], None]:
    def route(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head("200 OK", {"Content-Length": str(len(data)), "Connection": "close", **extra}) + data)

    return route


def _redirect(to: str, status: str = "302 Found") -> Callable[[socket.socket, Dict[str, str]], None]:
    def route(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head(status, {"Location": to, "Content-Length": "0", "Connection": "close"}))

    return route


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


def nothing_stored(store: casstore.Store) -> None:
    assert object_files(store.root) == []
    assert tmp_names(store.root) == []
    assert fetch_heads(store) == {}


def payload(n: int) -> bytes:
    return hashlib.shake_256(b"hostile-%d" % n).digest(n)


# -- never hang: deadlines and per-read timeouts ------------------------------------------------------


def test_trickling_body_ends_at_the_deadline(store: casstore.Store, hostile: Hostile) -> None:
    """One byte every 0.25 s never trips a per-read timeout; the overall deadline still ends it."""

    def trickle(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head("200 OK", {"Content-Length": "100000", "Connection": "close"}))
        while not hostile.stop.is_set():
            sock.sendall(b"x")
            time.sleep(0.25)

    hostile.routes["/trickle"] = trickle
    t0 = time.monotonic()
    with pytest.raises(NetworkTimeout, match="deadline") as ei:
        fetch(store, hostile.url("/trickle"), deadline=1.5, connect_timeout=30, retries=3)
    took = time.monotonic() - t0
    assert 1.4 < took < 5, took
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, BackendError)
    assert hostile.count("/trickle") == 1  # the deadline is not reset by retries
    nothing_stored(store)


def test_trickling_headers_end_at_the_deadline(store: casstore.Store, hostile: Hostile) -> None:
    """A status line and headers sent a byte at a time: http.client loops inside readline; the watchdog ends it."""

    def trickle_headers(sock: socket.socket, headers: Dict[str, str]) -> None:
        for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 50:  # ~7 s, then the server gives up
            if hostile.stop.is_set():
                return
            sock.sendall(bytes([b]))
            time.sleep(0.1)

    hostile.routes["/slow-headers"] = trickle_headers
    t0 = time.monotonic()
    with pytest.raises(NetworkTimeout):
        fetch(store, hostile.url("/slow-headers"), deadline=1.5, connect_timeout=30, retries=0)
    assert time.monotonic() - t0 < 5
    nothing_stored(store)


def test_stalled_server_trips_the_per_read_timeout(store: casstore.Store, hostile: Hostile) -> None:
    def stall(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head("200 OK", {"Content-Length": "1000", "Connection": "close"}) + b"x" * 10)
        hostile.stop.wait(30)

    hostile.routes["/stall"] = stall
    t0 = time.monotonic()
    with pytest.raises(NetworkTimeout, match="2 attempts"):
        fetch(store, hostile.url("/stall"), connect_timeout=0.3, retries=1, deadline=15)
    assert time.monotonic() - t0 < 5
    assert hostile.count("/stall") == 2  # a stall is retried like any transient failure
    nothing_stored(store)


# -- sizes: Content-Length is a contract, max_bytes a ceiling --------------------------------------


def test_body_longer_than_content_length_is_refused(store: casstore.Store, hostile: Hostile) -> None:
    data = payload(50_000)

    def longer(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head("200 OK", {"Content-Length": str(len(data)), "Connection": "close"}) + data + b"EXTRA" * 99)

    hostile.routes["/longer"] = longer
    with pytest.raises(IntegrityError, match="more bytes than its Content-Length"):
        fetch(store, hostile.url("/longer"), retries=3)
    assert hostile.count("/longer") == 1  # not retried: the server is broken, not the network
    assert b3(data) not in store  # not even the announced prefix
    nothing_stored(store)


def test_body_shorter_than_content_length_is_refused(store: casstore.Store, hostile: Hostile) -> None:
    data = payload(50_000)

    def shorter(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head("200 OK", {"Content-Length": str(len(data)), "Connection": "close"}) + data[:20_000])

    hostile.routes["/shorter"] = shorter
    with pytest.raises(BackendError, match="IncompleteRead") as ei:
        fetch(store, hostile.url("/shorter"), retries=2)
    assert not isinstance(ei.value, IntegrityError)
    assert hostile.count("/shorter") == 3  # retried (a cut connection), every time short
    assert b3(data[:20_000]) not in store
    nothing_stored(store)


def test_content_length_above_max_bytes_is_refused_before_reading(store: casstore.Store, hostile: Hostile) -> None:
    sent: List[int] = []

    def huge(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head("200 OK", {"Content-Length": str(10 << 30), "Connection": "close"}))
        total = 0
        try:
            while not hostile.stop.is_set() and total < 64 << 20:
                sock.sendall(b"\0" * (1 << 20))
                total += 1 << 20
        finally:
            sent.append(total)

    hostile.routes["/huge"] = huge
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match="max_bytes=1048576"):
        fetch(store, hostile.url("/huge"), max_bytes=1 << 20, deadline=15)
    assert time.monotonic() - t0 < 5
    nothing_stored(store)


@pytest.mark.parametrize("chunked", [False, True], ids=["until-close", "chunked"])
def test_endless_body_without_length_stops_at_max_bytes(store: casstore.Store, hostile: Hostile,
                                                        chunked: bool) -> None:
    def endless(sock: socket.socket, headers: Dict[str, str]) -> None:
        head = {"Transfer-Encoding": "chunked"} if chunked else {}
        sock.sendall(_head("200 OK", {**head, "Connection": "close"}))
        block = b"z" * 65536
        while not hostile.stop.is_set():
            sock.sendall(b"10000\r\n" + block + b"\r\n" if chunked else block)

    hostile.routes["/endless"] = endless
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match="exceeds 1048576 bytes"):
        fetch(store, hostile.url("/endless"), max_bytes=1 << 20, retries=3, deadline=15)
    assert time.monotonic() - t0 < 10
    assert hostile.count("/endless") == 1
    nothing_stored(store)


def test_max_bytes_exactly_met_is_fine(store: casstore.Store, hostile: Hostile) -> None:
    data = payload(4096)
    hostile.routes["/exact"] = _ok(data)
    assert str(fetch(store, hostile.url("/exact"), max_bytes=4096)) == b3(data)
    hostile.routes["/over"] = _ok(data)
    with pytest.raises(IntegrityError):
        fetch(store, hostile.url("/over"), max_bytes=4095)


@pytest.mark.parametrize("lengths", [["10", "20"], ["-5"], ["1e3"], ["12abc"]])
def test_malformed_or_conflicting_content_length(store: casstore.Store, hostile: Hostile, lengths: List[str]) -> None:
    def bad(sock: socket.socket, headers: Dict[str, str]) -> None:
        extra = "".join(f"Content-Length: {v}\r\n" for v in lengths)
        sock.sendall(f"HTTP/1.1 200 OK\r\n{extra}Connection: close\r\n\r\n".encode() + b"x" * 20)

    hostile.routes["/cl"] = bad
    with pytest.raises(BackendError, match="Content-Length"):
        fetch(store, hostile.url("/cl"), retries=0)
    nothing_stored(store)


# -- redirects -------------------------------------------------------------------------------------


def test_redirect_loop_fails_fast(store: casstore.Store, hostile: Hostile) -> None:
    hostile.routes["/a"] = _redirect("/b")
    hostile.routes["/b"] = _redirect(hostile.url("/a"), "301 Moved Permanently")
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="redirect loop"):
        fetch(store, hostile.url("/a"), retries=5)
    assert time.monotonic() - t0 < 2
    assert hostile.count("/a") == 1 and hostile.count("/b") == 1  # detected at once, and not retried
    nothing_stored(store)


def test_redirect_chain_is_limited(store: casstore.Store, hostile: Hostile) -> None:
    for i in range(50):
        hostile.routes[f"/hop{i}"] = _redirect(f"/hop{i + 1}", "307 Temporary Redirect")
    with pytest.raises(BackendError, match=f"more than {MAX_REDIRECTS} redirects"):
        fetch(store, hostile.url("/hop0"))
    assert sum(hostile.count(f"/hop{i}") for i in range(50)) == MAX_REDIRECTS + 1
    nothing_stored(store)


@pytest.mark.parametrize("target", ["file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://x/"])
def test_redirect_to_other_schemes_is_refused(store: casstore.Store, hostile: Hostile, target: str) -> None:
    hostile.routes["/away"] = _redirect(target)
    with pytest.raises(BackendError, match="redirect"):
        fetch(store, hostile.url("/away"))
    nothing_stored(store)


def test_a_good_redirect_is_followed(store: casstore.Store, hostile: Hostile) -> None:
    data = payload(3000)
    hostile.routes["/old"] = _redirect("/new")
    hostile.routes["/new"] = _ok(data)
    assert str(fetch(store, hostile.url("/old"))) == b3(data)


# -- secrets never shown -----------------------------------------------------------------------------

SECRETS = ("alice", "s3cr3t-pw", "tok-1234567", "sigsigsig99", "AKIDSECRETVALUE", "apikey-777")


def secret_url(hostile: Hostile, path: str) -> str:
    return (hostile.url(path, auth="alice:s3cr3t-pw@")
            + "?token=tok-1234567&X-Amz-Signature=sigsigsig99&X-Amz-Credential=AKIDSECRETVALUE"
            + "&api_key=apikey-777&part=visible-part")


def assert_clean(text: str) -> None:
    for s in SECRETS:
        assert s not in text, f"secret {s!r} leaked into: {text}"


def test_credentials_are_used_but_never_stored_or_shown(store: casstore.Store, hostile: Hostile,
                                                        caplog: pytest.LogCaptureFixture,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    data = payload(200_000)
    want = "Basic " + base64.b64encode(b"alice:s3cr3t-pw").decode()

    def guarded(sock: socket.socket, headers: Dict[str, str]) -> None:
        if headers.get("authorization") != want:
            sock.sendall(_head("401 Unauthorized", {"Content-Length": "0", "Connection": "close"}))
            return
        _ok(data)(sock, headers)

    hostile.routes["/private.bin"] = guarded
    url = secret_url(hostile, "/private.bin")
    with caplog.at_level(logging.DEBUG, logger="casstore"):
        d = fetch(store, url, progress=True)
    assert str(d) == b3(data)
    assert hostile.headers("/private.bin")[0]["authorization"] == want  # the credentials were sent
    m = store.manifest(fetch_name(url))
    shown = m.meta["url"]
    assert_clean(shown)
    assert "part=visible-part" in shown and "127.0.0.1" in shown and "***" in shown
    err = capsys.readouterr().err
    assert "private.bin" in err
    assert_clean(err)
    assert_clean(caplog.text)
    # The stored record, byte for byte, holds no secret either.
    assert_clean(store.get(m.digest).decode("latin-1"))


def test_secrets_absent_from_errors_and_retry_logs(store: casstore.Store, hostile: Hostile,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="casstore"):
        with pytest.raises(ObjectNotFoundError) as e404:
            fetch(store, secret_url(hostile, "/missing"))
        url = (f"http://alice:s3cr3t-pw@127.0.0.1:{closed_port()}/x?token=tok-1234567"
               "&X-Amz-Signature=sigsigsig99")
        with pytest.raises(BackendError) as edown:
            fetch(store, url, retries=1)
    assert "***" in str(e404.value) and "***" in str(edown.value)
    assert_clean(str(e404.value))
    assert_clean(str(edown.value))
    assert "retry 1/1" in caplog.text
    assert_clean(caplog.text)
    nothing_stored(store)


def test_secrets_absent_from_lock_timeouts(store: casstore.Store, hostile: Hostile) -> None:
    url = secret_url(hostile, "/busy")
    with store.refs.lock(fetch_name(url)):  # another download of the URL is under way
        with pytest.raises(LockTimeout) as ei:
            fetch(store, url, timeout=0.1)
    assert "/busy" in str(ei.value)
    assert_clean(str(ei.value))
    assert hostile.count("/busy") == 0


def test_secrets_absent_from_malformed_url_errors(store: casstore.Store) -> None:
    with pytest.raises(InvalidInputError) as ei:
        fetch(store, "http://alice:s3cr3t-pw@[::1/x?token=tok-1234567")
    assert_clean(str(ei.value))


@pytest.mark.parametrize(("url", "shown"), [
    ("https://u:p@h/x", "https://***@h/x"),
    ("https://h/x?token=abc&b=1", "https://h/x?token=***&b=1"),
    ("https://h/x?X-Amz-Signature=ab&X-Amz-Date=2024", "https://h/x?X-Amz-Signature=***&X-Amz-Date=2024"),
    ("https://h/x?sv=1&sig=zz%2Bq#access_token=t", "https://h/x?sv=1&sig=***#access_token=***"),
    ("not a url @ all?key=1", "not a url @ all?key=***"),
    ("https://h/plain", "https://h/plain"),
])
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_cli_error_shows_no_secret(tmp_path: Path, hostile: Hostile) -> None:
    cli = str(Path(sys.executable).with_name("casstore"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    casstore.open(tmp_path / "store")  # an explicit --store must exist (issue 12)
    r = subprocess.run([cli, "--store", str(tmp_path / "store"), "fetch", secret_url(hostile, "/nothing-here")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "nothing-here" in r.stderr
    assert_clean(r.stdout + r.stderr)


# -- file:// that is not a regular file -----------------------------------------------------------------


def _fetch_in_thread(store: casstore.Store, url: str) -> Tuple[threading.Thread, List[BaseException]]:
    errs: List[BaseException] = []

    def go() -> None:
        try:
            fetch(store, url)
        except BaseException as e:  # reported to the test thread
            errs.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, errs


def test_fifo_is_refused_at_once(store: casstore.Store, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    t, errs = _fetch_in_thread(store, fifo.as_uri())
    t.join(5)
    if t.is_alive():  # hung: release it (open the other end) before failing
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("fetch of a FIFO hung")
    assert len(errs) == 1 and isinstance(errs[0], InvalidInputError), errs
    assert "FIFO" in str(errs[0])
    nothing_stored(store)


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_devices_are_refused(store: casstore.Store, dev: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(InvalidInputError, match="device"):
        fetch(store, Path(dev).as_uri(), deadline=15)
    assert time.monotonic() - t0 < 2
    nothing_stored(store)


def test_directories_and_links_are_refused(store: casstore.Store, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="directory"):
        fetch(store, tmp_path.as_uri())
    real = tmp_path / "real.bin"
    real.write_bytes(b"real bytes")
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    with pytest.raises(InvalidInputError, match="symbolic link") as ei:
        fetch(store, link.as_uri())
    assert str(real) in str(ei.value)  # says what to fetch instead
    nothing_stored(store)
    assert str(fetch(store, real.as_uri())) == b3(b"real bytes")


def test_file_url_on_another_host_is_refused(store: casstore.Store) -> None:
    with pytest.raises(InvalidInputError, match="local path"):
        fetch(store, "file://otherhost/etc/passwd")


def test_file_larger_than_max_bytes_is_refused(store: casstore.Store, tmp_path: Path) -> None:
    p = tmp_path / "big.bin"
    p.write_bytes(payload(10_000))
    with pytest.raises(IntegrityError, match="exceeds 9999 bytes"):
        fetch(store, p.as_uri(), max_bytes=9999)
    nothing_stored(store)


# -- bad arguments: typed errors, before any request --------------------------------------------------------


@pytest.mark.parametrize("url", [
    "http://[::1/x",
    "http://127.0.0.1:99999/x",
    "http://127.0.0.1:port/x",
    "http://127.0.0.1/x\r\nX-Injected: 1",
    "http://127.0.0.1/a b",
    "http://127.0.0.1/\x00",
    "https://bad\udcffhost/x",
])
def test_malformed_urls(store: casstore.Store, url: str) -> None:
    with pytest.raises(InvalidInputError, match="URL"):
        fetch(store, url)
    nothing_stored(store)


@pytest.mark.parametrize(("kw", "err"), [
    ({"sha256": 5}, InvalidTypeError),
    ({"md5": b"d41d8cd98f00b204e9800998ecf8427e"}, InvalidTypeError),
    ({"digest": 5}, InvalidTypeError),
    ({"digest": "blake3:xyz"}, InvalidDigestError),
    ({"timeout": "10"}, InvalidTypeError),
    ({"timeout": -1}, InvalidInputError),
    ({"timeout": float("nan")}, InvalidInputError),
    ({"connect_timeout": "1"}, InvalidTypeError),
    ({"connect_timeout": 0}, InvalidInputError),
    ({"deadline": "1"}, InvalidTypeError),
    ({"deadline": -1.0}, InvalidInputError),
    ({"retries": "3"}, InvalidTypeError),
    ({"retries": True}, InvalidTypeError),
    ({"retries": -1}, InvalidInputError),
    ({"max_bytes": "1"}, InvalidTypeError),
    ({"max_bytes": 1.5}, InvalidTypeError),
    ({"max_bytes": -1}, InvalidInputError),
    ({"force": "yes"}, InvalidTypeError),
    ({"progress": 1}, InvalidTypeError),
])
def test_bad_arguments_are_typed_errors(store: casstore.Store, hostile: Hostile, kw: Dict[str, Any],
                                        err: type) -> None:
    hostile.routes["/x"] = _ok(b"x")
    with pytest.raises(err) as ei:
        fetch(store, hostile.url("/x"), **kw)
    assert isinstance(ei.value, CasstoreError)
    assert hostile.count("/x") == 0
    nothing_stored(store)


def test_bad_arguments_through_the_store_facade(store: casstore.Store) -> None:
    with pytest.raises(InvalidTypeError):
        store.fetch("http://127.0.0.1/x", sha256=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        store.fetch("http://127.0.0.1/x", timeout="10")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        store.fetch("http://127.0.0.1:99999/x")


# -- record names carry no secret (bug hunt item 1) ------------------------------------------------------


def test_record_name_is_not_derived_from_secrets(store: casstore.Store, hostile: Hostile) -> None:
    """The name was sha256(raw URL): hashing guesses put back into the redacted URL found the password."""
    data = payload(5000)
    hostile.routes["/ok"] = _ok(data)
    url_a = hostile.url("/ok", auth="bob:s3cr3tpass@") + "?api_key=TOPSECRET&part=1"
    url_b = hostile.url("/ok", auth="eve:0therpass@") + "?api_key=REFRESHED&part=1"
    name = fetch_name(url_a)
    assert name == fetch_name(url_b)  # nothing of the secrets is in it
    assert name != "_fetch/" + hashlib.sha256(url_a.encode()).hexdigest()[:40]
    assert fetch_name(hostile.url("/ok") + "?api_key=X&part=2") != name  # a non-secret part still counts
    # Parameters whose names merely contain auth/key/sig are redacted when shown, never left out of the
    # name: naming after the shown URL made these one record, the second fetch returning the first's bytes.
    for param in ("author", "keyword", "design", "monkey"):
        base = hostile.url("/ok")
        assert fetch_name(f"{base}?{param}=a") != fetch_name(f"{base}?{param}=b"), param
    assert str(fetch(store, url_a)) == b3(data)
    assert str(fetch(store, url_b)) == b3(data)  # a refreshed credential: the same record, no download
    assert hostile.count("/ok") == 1
    assert list(fetch_heads(store)) == [name]
    assert store.manifest(name).meta["url"] == redact(url_a)


def test_resigned_presigned_url_is_the_same_record(store: casstore.Store, hostile: Hostile) -> None:
    """A URL signed anew (new date, expiry, credential, signature) names the same object: fetched once."""
    data = payload(3000)
    hostile.routes["/bucket/obj.bin"] = _ok(data)

    def signed(date: str, expires: str, sig: str) -> str:
        return hostile.url("/bucket/obj.bin") + (
            f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKID%2F{date[:8]}%2Fus-east-1%2Fs3%2Faws4_request"
            f"&X-Amz-Date={date}&X-Amz-Expires={expires}&X-Amz-SignedHeaders=host&X-Amz-Signature={sig}")

    first, second = signed("20240101T000000Z", "3600", "ab" * 32), signed("20250606T121212Z", "600", "cd" * 32)
    assert fetch_name(first) == fetch_name(second)
    assert str(fetch(store, first)) == b3(data)
    assert str(fetch(store, second)) == b3(data)
    assert hostile.count("/bucket/obj.bin") == 1
    # Without a signature, Expires and X-Amz-Date are ordinary parameters: they tell records apart.
    plain = hostile.url("/bucket/obj.bin")
    assert fetch_name(plain + "?X-Amz-Date=1") != fetch_name(plain + "?X-Amz-Date=2")
    assert fetch_name(plain + "?Expires=1") != fetch_name(plain + "?Expires=2")
    # Azure SAS: start and expiry (st, se) go, the permissions (sp) stay.
    sas = plain + "?sv=2022-11-02&sp=r&st={}&se={}&sig={}"
    assert fetch_name(sas.format("a", "b", "c")) == fetch_name(sas.format("d", "e", "f"))
    assert fetch_name(sas.format("a", "b", "c")) != fetch_name(sas.replace("sp=r", "sp=rw").format("a", "b", "c"))


def test_record_under_its_old_secret_derived_name_is_renamed(store: casstore.Store, hostile: Hostile) -> None:
    """A store written before the fix keeps its download: the old record moves to the new name (no download)."""
    data = payload(4000)
    hostile.routes["/old.bin"] = _ok(data)
    url = hostile.url("/old.bin", auth="bob:s3cr3tpass@")
    legacy = "_fetch/" + hashlib.sha256(url.encode()).hexdigest()[:40]
    fetch(store, url)
    store.rename(fetch_name(url), legacy)  # what an older casstore left behind
    assert str(fetch(store, url)) == b3(data)
    assert hostile.count("/old.bin") == 1
    assert list(fetch_heads(store)) == [fetch_name(url)]  # the secret-derived name is gone


# -- file:// errors are typed (bug hunt item 2) -----------------------------------------------------------


def test_file_url_with_nul_is_invalid_input(store: casstore.Store, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="%00") as ei:
        fetch(store, f"file://{tmp_path}/%00x?token=tok-1234567")
    assert_clean(str(ei.value))
    nothing_stored(store)


def test_failing_read_of_a_file_is_a_backend_error(store: casstore.Store, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that opens but whose read fails (EIO on a bad disk, /proc/self/mem) names the URL and what to do."""
    import errno

    from casstore import _faults

    p = tmp_path / "flaky.bin"
    p.write_bytes(payload(3 << 20))

    def eio(point: str) -> None:
        if point == "fetch.read":
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_faults, "hook", eio)
    with pytest.raises(BackendError, match="Input/output error") as ei:
        fetch(store, p.as_uri() + "#token=tok-1234567")
    assert "flaky.bin" in str(ei.value) and "EIO" in str(ei.value) and "regular file" in str(ei.value)
    assert_clean(str(ei.value))
    nothing_stored(store)


@pytest.mark.parametrize("path", ["/proc/self/mem", "/proc/self/clear_refs", "/proc/self/pagemap",
                                  "/sys/kernel/mm/transparent_hugepage/enabled"])
def test_kernel_pseudo_files_are_refused_before_reading(store: casstore.Store, path: str) -> None:
    """procfs/sysfs report a size that is not their content; some never end (pagemap filled the disk)."""
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    t0 = time.monotonic()
    with pytest.raises(InvalidInputError, match="pseudo-file") as ei:
        fetch(store, Path(path).as_uri(), max_bytes=1 << 20)  # a cap: the unfixed code stops at 1 MiB
    assert time.monotonic() - t0 < 2
    assert path in str(ei.value) and "put_path" in str(ei.value)
    nothing_stored(store)


def test_cli_file_errors_are_one_typed_line(tmp_path: Path) -> None:
    cli = str(Path(sys.executable).with_name("casstore"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    casstore.open(tmp_path / "store")
    for url in (f"file://{tmp_path}/%00x", "file:///proc/self/mem"):
        r = subprocess.run([cli, "--store", str(tmp_path / "store"), "fetch", url],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert "unexpectedly" not in r.stderr, r.stderr


# -- a source of unknown size never fills the disk (bug hunt item 3) -------------------------------------

_SMALL_FS_FETCH = """
import sys
import casstore
from casstore.errors import DiskFullError
store = casstore.open(sys.argv[1], durable=False)
try:
    store.fetch(sys.argv[2], deadline=60, retries=0)
    print("STORED")
except DiskFullError as e:
    print("DISKFULL", e)
"""


def test_endless_download_stops_before_the_disk_is_full(tmp_path: Path, hostile: Hostile) -> None:
    """No Content-Length, no max_bytes: the 64 GiB cap is no bound for a small disk; the free-space floor is.

    The store lives on a 48 MiB tmpfs mounted in a user namespace, so filling it harms nothing.
    """
    mnt = tmp_path / "small"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            'mount -t tmpfs -o size=1m none "$1"', "sh", str(mnt)],
                           capture_output=True, text=True, timeout=30) if Path("/usr/bin/unshare").exists() else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare --user --mount to mount a small tmpfs")

    def endless(sock: socket.socket, headers: Dict[str, str]) -> None:
        sock.sendall(_head("200 OK", {"Connection": "close"}))
        block = b"z" * 65536
        while not hostile.stop.is_set():
            sock.sendall(block)

    hostile.routes["/endless"] = endless
    script = ('mount -t tmpfs -o size=48m none "$1" && "$2" -c "$3" "$1/store" "$4"; '
              'df -B1 --output=avail "$1" | tail -1')
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", str(mnt),
                        sys.executable, _SMALL_FS_FETCH, hostile.url("/endless?token=tok-1234567")],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout.splitlines()
    assert len(out) >= 2 and out[0].startswith("DISKFULL"), (r.stdout, r.stderr)
    assert "stopped after" in out[0] and "free for everyone else" in out[0], out[0]  # not ENOSPC: it stopped first
    assert_clean(out[0])
    assert int(out[-1]) > 40 << 20  # the staging file is gone: the space is free again
