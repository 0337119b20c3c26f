"""Helpers for the fetch / derive / HDF5 tests: a real HTTP server and process workers.

Nothing is mocked.  :class:`Server` is a ``http.server.ThreadingHTTPServer`` on
127.0.0.1 (an ephemeral port) run in a thread of the test process.  Each path
it serves is a :class:`Route` that can be made slow, can ignore Range requests,
can drop the connection midway for its first N requests (it announces the full
Content-Length, sends half the body, then closes the socket) or answer 503 for
its first N requests.  The server counts requests per path and records each
request's Range header, so tests can assert "exactly one download".

Worker functions live here, at module level, so ``multiprocessing`` 'spawn'
children can import them (tests/ is on ``sys.path`` under pytest and spawn
passes ``sys.path`` on to its children).
"""

from __future__ import annotations

import hashlib
import http.server
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import blake3

import casstore

SPAWN = mp.get_context("spawn")


def b3(data: bytes) -> str:
    """Reference digest string, computed with the blake3 package directly."""
    return "blake3:" + blake3.blake3(data).hexdigest()


# -- the HTTP server ---------------------------------------------------------


@dataclass
class Route:
    """How one path is served (attributes may be changed while the server runs)."""

    data: bytes
    ranges: bool = True  # answer "Range: bytes=N-" with 206
    delay: float = 0.0  # seconds to sleep after each chunk
    chunk: int = 64 << 10
    drop_first: int = 0  # first N requests: full Content-Length, half the body, then close
    fail_first: int = 0  # first N requests: 503 Service Unavailable
    status: int = 200
    etag: bool = True  # send an ETag (of the data) and honour If-None-Match with 304
    last_modified: Optional[str] = None  # send Last-Modified and honour If-Modified-Since (exact match) with 304


@dataclass
class Request:
    path: str
    range: Optional[str]
    status: int = 0
    sent: int = 0  # body bytes written so far
    done: bool = False
    if_none_match: Optional[str] = None
    if_modified_since: Optional[str] = None


@dataclass
class Server:
    """State shared with the handler threads."""

    host: str = "127.0.0.1"
    port: int = 0
    routes: Dict[str, Route] = field(default_factory=dict)
    requests: List[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def add(self, path: str, data: bytes, **opts: Any) -> str:
        self.routes[path] = Route(data, **opts)
        return self.url(path)

    def reqs(self, path: str) -> List[Request]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def count(self, path: str) -> int:
        """Requests received for ``path`` (GET only; each one is a download attempt)."""
        return len(self.reqs(path))

    def wait_for(self, pred: Any, timeout: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; requests: {self.requests}")
            time.sleep(0.01)


def _make_handler(state: Server) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server naming
            req = Request(self.path, self.headers.get("Range"), if_none_match=self.headers.get("If-None-Match"),
                          if_modified_since=self.headers.get("If-Modified-Since"))
            with state.lock:
                state.requests.append(req)
                n_before = sum(1 for r in state.requests if r.path == self.path) - 1
            route = state.routes.get(self.path)
            try:
                self._serve(req, route, n_before)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (killed): that is what some tests do
            finally:
                req.done = True

        def _serve(self, req: Request, route: Optional[Route], n_before: int) -> None:
            self.close_connection = True
            if route is None or route.status == 404:
                req.status = 404
                self.send_error(404)
                return
            if n_before < route.fail_first:
                req.status = 503
                self.send_error(503, "try again")
                return
            data = route.data
            etag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'
            start = 0
            status = 200
            if ((route.etag and req.if_none_match == etag)
                    or (route.etag is False and route.last_modified is not None
                        and req.if_modified_since == route.last_modified)):
                req.status = 304
                self.send_response(304)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            # If-Range: resume only if the resource is still the version the client has.
            same = self.headers.get("If-Range") in (None, etag)
            if (route.ranges and same and req.range and req.range.startswith("bytes=")
                    and req.range.endswith("-")):
                start = int(req.range[len("bytes="):-1])
                if start >= len(data):
                    req.status = 416
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
            body = data[start:]
            req.status = status
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            if route.etag:
                self.send_header("ETag", etag)
            if route.last_modified is not None:
                self.send_header("Last-Modified", route.last_modified)
            self.send_header("Connection", "close")
            if route.ranges:
                self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            limit = len(body)
            if n_before < route.drop_first:
                limit = len(body) // 2
            pos = 0
            while pos < limit:
                n = min(route.chunk, limit - pos)
                self.wfile.write(body[pos:pos + n])
                self.wfile.flush()
                pos += n
                req.sent = pos
                if route.delay:
                    time.sleep(route.delay)
            if limit < len(body):
                # Drop the connection: the client was promised len(body) bytes.
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    return Handler


@contextmanager
def serve() -> Iterator[Server]:
    """Run a counting HTTP server on 127.0.0.1 in a thread for the duration of the block."""
    state = Server()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    th = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    th.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        th.join(10)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


# -- store inspection ----------------------------------------------------------


def object_files(root: Path) -> List[Path]:
    objdir = Path(root) / "objects"
    return sorted(p for p in objdir.rglob("*") if p.is_file()) if objdir.exists() else []


def tmp_names(root: Path) -> List[str]:
    return sorted(os.listdir(Path(root) / "tmp"))


def assert_objects_valid(store: casstore.Store) -> List[str]:
    """Every object file (raw or zstd) decodes to bytes that hash to its name; returns the names."""
    names = []
    for p in object_files(store.root):
        stem = p.name.removesuffix(".zst")
        assert len(p.parent.name) == 2 and len(stem) == 62, f"stray file {p}"
        name = "blake3:" + p.parent.name + stem
        data = store.get(name, verify=False)
        assert b3(data) == name, f"object file {p} does not hash to its name"
        names.append(name)
    return names


def fetch_heads(store: casstore.Store) -> Dict[str, Any]:
    """Every ``_fetch/...`` head: name -> its manifest."""
    return {n: store.manifest(n) for n in store.heads() if n.startswith("_fetch/")}


def holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (from /proc/<pid>/fd)."""
    target = str(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def wait_until(pred: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- derive functions (module level: picklable by reference for spawn) --------------


def counting_fn(counter: str, delay: float, inputs: Dict[str, Path], out: Path) -> None:
    """Append this pid to ``counter``; write out/result.bin = reversed bytes of input 'src'."""
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(delay)
    (out / "result.bin").write_bytes(inputs["src"].read_bytes()[::-1])


def slow_fn(counter: str, marker: str, inputs: Dict[str, Path], out: Path) -> None:
    """Like :func:`counting_fn`, but writes half the output, then waits while ``marker`` exists."""
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    data = inputs["src"].read_bytes()[::-1]
    with open(out / "result.bin", "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        while os.path.exists(marker):
            time.sleep(0.02)
        f.write(data[len(data) // 2:])


def sleepy_fn(counter: str, seconds: float, inputs: Dict[str, Path], out: Path) -> None:
    """Like :func:`counting_fn`, but takes ``seconds`` (a long, live, progressing producer)."""
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    (out / "result.bin").write_bytes(inputs["src"].read_bytes()[::-1])


def scale_v1(inputs: Dict[str, Path], out: Path) -> None:
    """A derive fn; :func:`scale_v2` is the same function edited (another constant)."""
    (out / "x.bin").write_bytes(inputs["src"].read_bytes() * 2)


def scale_v2(inputs: Dict[str, Path], out: Path) -> None:
    """:func:`scale_v1` edited: repeats three times."""
    (out / "x.bin").write_bytes(inputs["src"].read_bytes() * 3)


# -- process workers ---------------------------------------------------------------


def _report(q: Any, fn: Any) -> None:
    try:
        q.put(("ok", os.getpid(), fn()))
    except BaseException as e:  # report every failure to the parent
        q.put(("err", os.getpid(), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def fetch_worker(root: str, url: str, barrier: Any, q: Any, kwargs: Dict[str, Any]) -> None:
    store = casstore.open(root)
    if barrier is not None:
        barrier.wait(30)
    _report(q, lambda: str(store.fetch(url, **kwargs)))


def derive_worker(root: str, name: str, src: str, fn: Any, barrier: Any, q: Any,
                  kwargs: Dict[str, Any]) -> None:
    store = casstore.open(root)
    if barrier is not None:
        barrier.wait(30)

    def go() -> Tuple[str, Dict[str, str]]:
        m = store.derive(name, inputs={"src": src}, fn=fn, **kwargs)
        return str(m.digest), {k: str(e.digest) for k, e in m.items()}

    _report(q, go)


def fetch_job_worker(root: str, url: str, barrier: Any, q: Any, env: Dict[str, str]) -> None:
    """One rank of a job: the settings come from ``env`` (set before casstore reads them)."""
    os.environ.update(env)
    fetch_worker(root, url, barrier, q, {})


def derive_job_worker(root: str, name: str, src: str, fn: Any, barrier: Any, q: Any,
                      env: Dict[str, str]) -> None:
    """One rank of a job running ``derive(name)``; the settings come from ``env``."""
    os.environ.update(env)
    derive_worker(root, name, src, fn, barrier, q, {})


def dead_holder(root: str, name: str, q: Any) -> None:
    """Take ``name``'s lock with a heartbeat, hand the locked descriptor to a ``sleep`` child, and die.

    The lock stays held (by the child, which shares the open file description)
    while the process that wrote the heartbeat record is gone.
    """
    import subprocess

    store = casstore.open(root)
    lk = store.refs.lock(name, heartbeat=0.1, what=f"test {name}")
    lk.acquire()
    target = str(lk.path)
    fd = next(int(f) for f in os.listdir("/proc/self/fd")
              if os.path.realpath(f"/proc/self/fd/{f}") == target)
    child = subprocess.Popen(["sleep", "60"], pass_fds=[fd])
    q.put(("ok", os.getpid(), child.pid))
    q.close()
    q.join_thread()  # the queue's feeder thread must deliver before the hard exit
    os._exit(0)


def hdf5_holder(root: str, digest: str, dataset: str, ready: Any, release: Any, q: Any) -> None:
    """Open the object with store.open_hdf5, read it, signal ``ready``, keep it open until ``release``."""
    store = casstore.open(root)

    def go() -> float:
        f = store.open_hdf5(digest)
        total = float(f[dataset][...].sum())
        ready.set()
        if not release.wait(60):
            raise TimeoutError("never released")
        total2 = float(f[dataset][...].sum())  # still readable after the others came and went
        f.close()
        assert total == total2
        return total

    _report(q, go)


def results(q: Any, n: int, timeout: float = 60.0) -> List[Tuple[str, int, Any]]:
    """Collect ``n`` results from worker queue ``q``; fail with the child's traceback on an error."""
    out = [q.get(timeout=timeout) for _ in range(n)]
    errs = [r for r in out if r[0] != "ok"]
    assert not errs, "\n".join(str(e[2]) for e in errs)
    return out


def hdf5_reader(root: str, digest: str, dataset: str, q: Any) -> None:
    """Read through store.open_hdf5 while others hold the object open; report whether the object is flock-free.

    Returns (sum of the dataset, whether an exclusive flock on the object file
    could be taken, the /proc/locks lines for its inode).  HDF5's own locking
    would hold a flock for as long as a file is open.
    """
    import fcntl

    store = casstore.open(root)

    def go() -> Tuple[float, bool, List[str]]:
        path = store.path(digest)
        ino = os.stat(path).st_ino
        with open("/proc/locks") as f:
            locks = [ln.strip() for ln in f if f":{ino} " in ln]
        with store.open_hdf5(digest) as f:
            total = float(f[dataset][...].sum())
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                exclusive = True
            except BlockingIOError:
                exclusive = False
            finally:
                os.close(fd)
        return total, exclusive, locks

    _report(q, go)


def flock_holder(path: str, mode: str, ready: Any, release: Any, q: Any) -> None:
    """Hold ``path`` open: mode 'flock-ex' takes an exclusive flock; any other mode opens it with h5py."""
    import fcntl

    def go() -> str:
        if mode == "flock-ex":
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            ready.set()
            release.wait(60)
            os.close(fd)
        else:
            import h5py

            f = h5py.File(path, mode)
            ready.set()
            release.wait(60)
            f.close()
        return "released"

    _report(q, go)


def clean_settings_env(monkeypatch: Any, tmp_path: Path) -> None:
    """Runtime settings must not leak in from the environment or a user config file."""
    from casstore.settings import KNOBS

    for var in [knob.env for knob in KNOBS.values()] + ["CASSTORE_CONFIG"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
