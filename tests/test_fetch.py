"""store.fetch: exactly one download across processes, retries, checksums, clear errors.

Every test talks to a real HTTP server on 127.0.0.1 (tests/_fetch_helpers.py)
that counts requests per path; "exactly one download" is asserted on the
server's count, not on anything casstore reports.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from _fetch_helpers import (
    SPAWN,
    Server,
    assert_objects_valid,
    b3,
    clean_settings_env,
    closed_port,
    fetch_heads,
    fetch_worker,
    holds_open,
    object_files,
    results,
    serve,
    tmp_names,
    wait_until,
)

import casstore
from casstore.errors import (
    BackendError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ObjectNotFoundError,
)
from casstore.pipelines import fetch_name


@pytest.fixture
def server() -> Iterator[Server]:
    with serve() as s:
        yield s


@pytest.fixture
def store(tmp_path: Path) -> casstore.Store:
    return casstore.open(tmp_path / "store", durable=False)


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


def payload(n: int, seed: int = 1) -> bytes:
    return hashlib.shake_256(b"casstore-fetch-%d" % seed).digest(n)


def lock_file(store: casstore.Store, url: str) -> Path:
    return store.refs.lock(fetch_name(url)).path


def head_digest(store: casstore.Store, url: str) -> str:
    m = store.manifest(fetch_name(url))
    assert m.meta["url"] == url
    return str(m["content"].digest)


# -- basics ----------------------------------------------------------------------------


def test_fetch_stores_served_bytes_once(store: casstore.Store, server: Server) -> None:
    data = payload(300_000)
    url = server.add("/data.bin", data)
    d = store.fetch(url)
    assert str(d) == b3(data)
    assert store.get(d) == data
    assert server.count("/data.bin") == 1
    # The URL -> digest record: a head whose metadata names the URL and records a sha256.
    m = store.manifest(fetch_name(url))
    assert m.meta["url"] == url and m.meta["kind"] == "casstore.fetch"
    # Hashed once: BLAKE3 (the address) only; no checksum was asked for, so none is computed (issue 13).
    assert "sha256" not in m.meta and "md5" not in m.meta
    assert m["content"].digest == d and m["content"].size == len(data)
    # Second call (new Store object too): served from the store, no request.
    assert store.fetch(url) == d
    assert casstore.open(store.root).fetch(url) == d
    assert server.count("/data.bin") == 1
    assert tmp_names(store.root) == []
    # Asking for a checksum later checks the stored bytes (no download) and records it.
    assert store.fetch(url, sha256=hashlib.sha256(data).hexdigest()) == d
    assert server.count("/data.bin") == 1
    assert store.manifest(fetch_name(url)).meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert store.fetch(url, sha256=hashlib.sha256(data).hexdigest()) == d
    assert len(store.history(fetch_name(url))) == 2  # the checksum was recorded once
    # A wrong checksum for the stored bytes is a fresh, checked download (the resource may have changed).
    with pytest.raises(IntegrityError):
        store.fetch(url, md5=hashlib.md5(b"other").hexdigest())
    assert server.count("/data.bin") == 2 and store.manifest(fetch_name(url)).meta.get("md5") is None


def test_force_downloads_again(store: casstore.Store, server: Server) -> None:
    data = payload(10_000)
    url = server.add("/f.bin", data)
    d = store.fetch(url)
    assert store.fetch(url, force=True) == d
    assert server.count("/f.bin") == 2
    assert store.fetch(url) == d
    assert server.count("/f.bin") == 2
    # Upstream changed: force picks up the new bytes and the head follows.
    server.routes["/f.bin"].data = new = payload(10_000, seed=2)
    d2 = store.fetch(url, force=True)
    assert str(d2) == b3(new) and head_digest(store, url) == str(d2)
    assert server.count("/f.bin") == 3
    assert store.fetch(url) == d2


def test_force_download_env_setting(store: casstore.Store, server: Server,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url = server.add("/env.bin", payload(5000))
    store.fetch(url)
    monkeypatch.setenv("CASSTORE_FORCE_DOWNLOAD", "1")
    store.fetch(url)
    assert server.count("/env.bin") == 2
    store.fetch(url, force=False)  # an explicit argument beats the setting
    assert server.count("/env.bin") == 2
    monkeypatch.setenv("CASSTORE_FORCE_DOWNLOAD", "0")
    store.fetch(url)
    assert server.count("/env.bin") == 2


def test_file_url(store: casstore.Store, tmp_path: Path) -> None:
    src = tmp_path / "local file.bin"
    data = payload(200_000)
    src.write_bytes(data)
    url = src.as_uri()
    d = store.fetch(url)
    assert str(d) == b3(data) and store.get(d) == data
    assert store.fetch(url) == d
    with pytest.raises(ObjectNotFoundError):
        store.fetch((tmp_path / "missing.bin").as_uri())


def test_progress_bar_only_when_asked_or_on_a_terminal(store: casstore.Store, server: Server,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    url = server.add("/progress.bin", payload(300_000))
    store.fetch(url)  # stderr is not a terminal here: silent
    assert capsys.readouterr().err == ""
    store.fetch(url, force=True, progress=True)
    err = capsys.readouterr().err
    assert "fetch progress.bin" in err and "MiB" in err


def test_empty_body(store: casstore.Store, server: Server) -> None:
    url = server.add("/empty", b"")
    d = store.fetch(url)
    assert str(d) == b3(b"") and store.get(d) == b""


# -- checksums -------------------------------------------------------------------------


def test_correct_checksums_accepted(store: casstore.Store, server: Server) -> None:
    data = payload(50_000)
    sha = hashlib.sha256(data).hexdigest()
    md5 = hashlib.md5(data).hexdigest()
    url = server.add("/ok.bin", data)
    d = store.fetch(url, sha256=sha, md5=md5, digest=b3(data))
    assert str(d) == b3(data)
    assert server.count("/ok.bin") == 1
    # A hit is checked against the recorded checksums: no second download.
    assert store.fetch(url, sha256=sha.upper()) == d
    assert store.fetch(url, md5="md5:" + md5) == d
    assert server.count("/ok.bin") == 1


@pytest.mark.parametrize("kind", ["digest", "sha256", "md5"])
def test_checksum_mismatch_stores_nothing(store: casstore.Store, server: Server, kind: str) -> None:
    data = payload(120_000)
    url = server.add("/bad.bin", data)
    other = payload(120_000, seed=99)
    wrong = {"digest": b3(other), "sha256": hashlib.sha256(other).hexdigest(),
             "md5": hashlib.md5(other).hexdigest()}[kind]
    with pytest.raises(IntegrityError, match=kind if kind != "digest" else "digest"):
        store.fetch(url, **{kind: wrong})
    assert server.count("/bad.bin") == 1
    assert object_files(store.root) == []
    assert fetch_heads(store) == {}
    assert tmp_names(store.root) == []
    assert b3(data) not in store


def test_mismatch_after_good_fetch_keeps_the_good_record(store: casstore.Store, server: Server) -> None:
    data = payload(20_000)
    url = server.add("/x.bin", data)
    d = store.fetch(url)
    before = store.heads()
    with pytest.raises(IntegrityError):
        store.fetch(url, sha256=hashlib.sha256(b"something else").hexdigest())
    assert store.heads() == before and head_digest(store, url) == str(d)


@pytest.mark.parametrize("kw", [{"sha256": "abc"}, {"md5": "z" * 32}, {"sha256": hashlib.md5(b"").hexdigest()}])
def test_malformed_checksum(store: casstore.Store, server: Server, kw: dict[str, str]) -> None:
    url = server.add("/c.bin", b"x")
    with pytest.raises(InvalidInputError):
        store.fetch(url, **kw)
    assert server.count("/c.bin") == 0


# -- bad URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x.bin", "not a url", "http:///no-host", "https://", "file://",
                                 "", "s3://bucket/key", "/just/a/path"])
def test_malformed_or_unsupported_urls(store: casstore.Store, url: str) -> None:
    with pytest.raises(InvalidInputError) as ei:
        store.fetch(url)
    assert repr(url) in str(ei.value) or url in str(ei.value)
    assert object_files(store.root) == [] and tmp_names(store.root) == []


@pytest.mark.parametrize("url", [None, 42, b"http://127.0.0.1/x", Path("/tmp/x")])
def test_non_str_url(store: casstore.Store, url: object) -> None:
    with pytest.raises(InvalidTypeError):
        store.fetch(url)  # type: ignore[arg-type]


def test_404(store: casstore.Store, server: Server) -> None:
    with pytest.raises(ObjectNotFoundError, match="404"):
        store.fetch(server.url("/nope"), retries=2)
    assert server.count("/nope") == 1  # not retried
    assert object_files(store.root) == [] and tmp_names(store.root) == [] and fetch_heads(store) == {}


def test_unreachable_server_gives_backend_error(store: casstore.Store) -> None:
    url = f"http://127.0.0.1:{closed_port()}/x.bin"
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="3 attempts"):
        store.fetch(url, retries=2)
    assert time.monotonic() - t0 < 10  # bounded: back-off 0.5 s + 1 s
    assert object_files(store.root) == [] and tmp_names(store.root) == [] and fetch_heads(store) == {}


def test_transient_503_is_retried(store: casstore.Store, server: Server) -> None:
    data = payload(10_000)
    url = server.add("/flaky", data, fail_first=2)
    assert str(store.fetch(url, retries=3)) == b3(data)
    assert server.count("/flaky") == 3


def test_persistent_503_gives_backend_error(store: casstore.Store, server: Server) -> None:
    url = server.add("/down", b"x", fail_first=100)
    with pytest.raises(BackendError, match="503"):
        store.fetch(url, retries=1)
    assert server.count("/down") == 2
    assert object_files(store.root) == [] and tmp_names(store.root) == []


# -- interrupted transfers ---------------------------------------------------------------


def test_dropped_connection_resumes_with_range(store: casstore.Store, server: Server) -> None:
    data = payload(1_000_000)
    url = server.add("/drop.bin", data, drop_first=1, ranges=True)
    d = store.fetch(url, retries=3, sha256=hashlib.sha256(data).hexdigest())
    assert str(d) == b3(data) and store.get(d) == data
    reqs = server.reqs("/drop.bin")
    assert len(reqs) == 2
    assert reqs[0].range is None
    assert reqs[1].range == f"bytes={len(data) // 2}-" and reqs[1].status == 206  # resumed, not restarted
    m = store.manifest(fetch_name(url))
    assert m.meta["sha256"] == hashlib.sha256(data).hexdigest()  # checksums span both parts
    assert tmp_names(store.root) == []


def test_resume_refuses_to_splice_a_changed_resource(store: casstore.Store, server: Server) -> None:
    """The file changes upstream between the dropped transfer and the retry: no splice."""
    old, new = payload(1_000_000, seed=5), payload(1_000_000, seed=6)
    url = server.add("/moving.bin", old, drop_first=1, ranges=True)
    # Swap the content as soon as the first (dropped) request has been answered.
    def swap() -> None:
        server.wait_for(lambda: any(r.done for r in server.reqs("/moving.bin")), what="first request")
        server.routes["/moving.bin"].data = new

    t = threading.Thread(target=swap)
    t.start()
    d = store.fetch(url, retries=3)
    t.join()
    assert str(d) == b3(new) and store.get(d) == new  # the whole new version, not half of each
    reqs = server.reqs("/moving.bin")
    assert reqs[1].status == 200  # If-Range did not match: the server sent everything again


def test_dropped_connection_without_range_support_restarts(store: casstore.Store, server: Server) -> None:
    data = payload(1_000_000, seed=3)
    url = server.add("/drop2.bin", data, drop_first=2, ranges=False)
    d = store.fetch(url, retries=3, sha256=hashlib.sha256(data).hexdigest())
    assert str(d) == b3(data) and store.get(d) == data
    reqs = server.reqs("/drop2.bin")
    assert len(reqs) == 3 and all(r.status == 200 for r in reqs)
    assert_objects_valid(store)
    assert tmp_names(store.root) == []


def test_dropped_every_time_gives_backend_error(store: casstore.Store, server: Server) -> None:
    url = server.add("/always-drops", payload(100_000), drop_first=100, ranges=False)
    with pytest.raises(BackendError):
        store.fetch(url, retries=1)
    assert server.count("/always-drops") == 2
    assert object_files(store.root) == [] and tmp_names(store.root) == [] and fetch_heads(store) == {}


# -- processes -------------------------------------------------------------------------------


def test_eight_processes_download_once(tmp_path: Path, server: Server) -> None:
    root = tmp_path / "store"
    casstore.open(root)
    data = payload(2_000_000, seed=8)
    # Slow enough (~0.6 s) that all eight are inside fetch() while the first downloads.
    url = server.add("/shared.bin", data, chunk=64 << 10, delay=0.02)
    n = 8
    barrier = SPAWN.Barrier(n)
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=fetch_worker, args=(str(root), url, barrier, q, {})) for _ in range(n)]
    for p in procs:
        p.start()
    out = results(q, n)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert server.count("/shared.bin") == 1
    digests = {r[2] for r in out}
    assert digests == {b3(data)}
    store = casstore.open(root)
    assert store.get(b3(data)) == data
    assert head_digest(store, url) == b3(data)
    assert b3(data) in assert_objects_valid(store)
    assert len(store.history(fetch_name(url))) == 1  # one record, not eight


def _start_slow_download(root: Path, server: Server, path: str, data: bytes) -> tuple[str, object]:
    url = server.add(path, data, chunk=32 << 10, delay=0.05)  # ~6 s for the whole body
    q = SPAWN.Queue()
    p = SPAWN.Process(target=fetch_worker, args=(str(root), url, None, q, {}))
    p.start()
    # Mid-transfer: the server has sent part of the body to this process.
    wait_until(lambda: server.count(path) == 1 and server.reqs(path)[0].sent >= 128 << 10,
               what="the first download to be under way")
    return url, p


def test_killed_downloader_a_waiter_completes(tmp_path: Path, server: Server) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    data = payload(4_000_000, seed=5)
    url, first = _start_slow_download(root, server, "/killme.bin", data)
    # A second process starts fetching and blocks on the URL's lock.
    q = SPAWN.Queue()
    waiter = SPAWN.Process(target=fetch_worker, args=(str(root), url, None, q, {}))
    waiter.start()
    wait_until(lambda: holds_open(waiter.pid, lock_file(store, url)), what="the waiter to wait on the lock")
    time.sleep(0.1)
    assert server.count("/killme.bin") == 1  # still waiting, not downloading
    os.kill(first.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    first.join(10)  # type: ignore[attr-defined]
    server.routes["/killme.bin"].delay = 0.0
    (_, _, got), = results(q, 1)
    waiter.join(10)
    assert got == b3(data)
    assert server.count("/killme.bin") == 2
    assert not server.reqs("/killme.bin")[0].sent == len(data)  # the first transfer really was cut short
    # Nothing named is partial: the head points at the full object, every object hashes to its name.
    store = casstore.open(root)  # opening sweeps the dead writer's staging file
    assert head_digest(store, url) == b3(data)
    assert store.get(b3(data)) == data
    assert assert_objects_valid(store)
    assert tmp_names(root) == []


def test_killed_downloader_leaves_nothing_named(tmp_path: Path, server: Server) -> None:
    root = tmp_path / "store"
    casstore.open(root)
    data = payload(4_000_000, seed=6)
    url, first = _start_slow_download(root, server, "/orphan.bin", data)
    os.kill(first.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    first.join(10)  # type: ignore[attr-defined]
    assert object_files(root) == []
    assert len(tmp_names(root)) == 1  # the dead writer's staging file, never named
    store = casstore.open(root)
    assert fetch_heads(store) == {}
    assert tmp_names(root) == []  # swept on open: its writer is dead
    server.routes["/orphan.bin"].delay = 0.0
    assert str(store.fetch(url)) == b3(data)
    assert server.count("/orphan.bin") == 2


def test_waiter_times_out_with_clear_error(tmp_path: Path, server: Server) -> None:
    root = tmp_path / "store"
    store = casstore.open(root)
    url, first = _start_slow_download(root, server, "/busy.bin", payload(4_000_000, seed=7))
    try:
        # A live downloader beats its heartbeat, so a waiter does not time out on it (issue 13);
        # a stopped one is stalled: the waiter gives up after max(timeout, 3 beats) without a beat.
        os.kill(first.pid, signal.SIGSTOP)  # type: ignore[attr-defined]
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match="busy.bin.*stalled"):
            store.fetch(url, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 10
        assert server.count("/busy.bin") == 1
    finally:
        os.kill(first.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        first.join(10)  # type: ignore[attr-defined]


# -- the CLI -------------------------------------------------------------------------------


def test_cli_fetch(tmp_path: Path, server: Server) -> None:
    data = payload(50_000, seed=11)
    url = server.add("/cli.bin", data)
    cli = str(Path(sys.executable).with_name("casstore"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    root = tmp_path / "store"
    casstore.open(root)  # an explicit --store must exist (issue 12)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([cli, "--store", str(root), "fetch", *args], capture_output=True, text=True,
                              env=env, timeout=60)

    r = run(url, "--sha256", hashlib.sha256(data).hexdigest())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == b3(data)
    assert run(url).stdout.strip() == b3(data) and server.count("/cli.bin") == 1
    assert run(url, "--force").returncode == 0 and server.count("/cli.bin") == 2
    r = run(url, "--md5", hashlib.md5(b"other").hexdigest(), "--force")
    assert r.returncode != 0 and "IntegrityError" in r.stderr and "Traceback" not in r.stderr
    r = run("ftp://example.org/x")
    assert r.returncode != 0 and "unsupported URL" in r.stderr and "Traceback" not in r.stderr
