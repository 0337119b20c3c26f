"""GETs without botocore's client machinery: the per-request CPU of small reads (issue 14).

A ``GetObject`` through a boto3 client costs about 1.1 ms of CPU here whatever
the object's size (event hooks, endpoint rules, parameter validation, response
parsing down to a dateutil parse of ``Last-Modified``); for 64 KiB objects that
is most of the work, and with 4 reader processes on 2 cores it is the
throughput (benchmarks/bench_readthrough.py).  :class:`LeanGetter` sends the
same signed request with botocore's own parts -- the session's credentials
(refreshed as botocore refreshes them), ``S3SigV4Auth`` and an
``URLLib3Session`` with the client's proxies and timeouts -- for about half
that CPU.

Hazards this is built around:

* **It must never be less correct than the client.**  Only two answers are
  taken: ``200`` (the body, read to at most ``limit + 1`` bytes whatever
  ``Content-Length`` says) and ``404 NoSuchKey`` (missing).  Anything else --
  another status, a redirect to another region, an expired token, a TLS or
  proxy setup the client knows and this does not, a dropped connection -- is
  :data:`FALL_BACK`: the caller sends the request again through the boto3
  client, with its retries, its error translation and its timeouts.  A
  stopped server therefore costs one extra attempt, still bounded.
* **A fast path that keeps failing doubles requests.**  After
  :data:`MAX_MISSES` fall-backs in a row it turns itself off for the
  connection.
* **Addressing** (path or virtual-host style, AWS endpoint rules) is not
  re-implemented: the base URL is taken once from a presigned URL the client
  builds for a probe key; keys are quoted the way botocore quotes them.
* Anonymous clients (no credentials) are left to the client.
* **A body that trickles.**  Socket timeouts bound each read, not the whole:
  a server sending one byte every 1.5 s kept a read-through with
  ``read_timeout=2`` going for as long as it liked (found by a bug hunt).
  A body is therefore read (:func:`read_body`) whole within
  :func:`body_seconds` of its size -- a grace of two read timeouts, then at
  least one MiB per read timeout -- or the read raises :class:`BodyTimeout`
  (a ``NetworkTimeout`` to the caller), never a fall-back (the client's read
  would trickle as long).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union
from urllib.parse import quote

__all__ = ["LeanGetter", "LeanBody", "FALL_BACK", "MAX_MISSES", "BodyTimeout", "body_seconds", "read_body"]

MiB = 1 << 20
BODY_GRACE = 2.0
"""Read timeouts a body may take before its transfer rate counts (:func:`body_seconds`)."""


def body_seconds(read_timeout: float, size: int) -> float:
    """Seconds a response body of ``size`` bytes may take in all: :data:`BODY_GRACE` read timeouts,
    plus one read timeout per MiB (the slowest transfer accepted: 1 MiB per ``read_timeout``,
    about 17 KiB/s with the default 60 s)."""
    return read_timeout * (BODY_GRACE + max(0, size) / MiB)


class BodyTimeout(TimeoutError):
    """A response body was not read whole within :func:`body_seconds` (its connection was closed)."""


def read_body(raw: Any, n: Optional[int], seconds: float, what: str) -> bytes:
    """Up to ``n`` bytes (``None``: to the end) of a urllib3 response body, read whole within ``seconds``
    (:class:`BodyTimeout` otherwise).  ``read1`` returns what one socket read brings, so the deadline
    is looked at between reads whatever the server's pace (a plain ``read(n)`` loops inside until
    ``n`` bytes came: a trickle kept it going for ever)."""
    read1 = getattr(raw, "read1", None)
    if read1 is None:  # urllib3 1.x: no read1; per-read timeouts only
        return bytes(raw.read() if n is None else raw.read(n))
    end = time.monotonic() + seconds
    out = bytearray()
    while n is None or len(out) < n:
        if time.monotonic() > end:
            raise BodyTimeout(f"{what}: {len(out)} bytes of the body arrived in {seconds:.1f} s, the most a body "
                              f"of this size may take (at least 1 MiB per read_timeout after a grace of "
                              f"{BODY_GRACE:g} read timeouts)")
        piece = read1(_PIECE if n is None else min(_PIECE, n - len(out)))
        if not piece:
            break
        out += piece
    return bytes(out)


_PIECE = 1 << 20


MAX_MISSES = 3
"""Fall-backs in a row after which a connection stops trying the lean path."""

_PROBE = "casstore-probe-key"


class _FallBack:
    """The lean path did not settle it: send the request through the boto3 client."""

    def __repr__(self) -> str:
        return "FALL_BACK"


FALL_BACK = _FallBack()


@dataclass(frozen=True, slots=True)
class LeanBody:
    """A ``200``/``206`` answer: the bytes (``None``: announced larger than the limit, not read), the
    announced size and the ETag."""

    data: Optional[bytes]
    size: int
    etag: str


class LeanGetter:
    """Signed GETs of one bucket's keys through botocore's HTTP session and signer (module docstring)."""

    def __init__(self, client: Any, credentials: Any, bucket: str, *, connect_timeout: float,
                 read_timeout: float, pool: int, count: Callable[[str], None]) -> None:
        from botocore.httpsession import URLLib3Session
        from botocore.utils import get_environ_proxies

        presigned = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": _PROBE},
                                                  ExpiresIn=60)
        base = str(presigned).split("?", 1)[0]
        if not base.endswith("/" + _PROBE):
            raise ValueError(f"unexpected presigned URL shape: {base}")
        self.base = base[: -len(_PROBE)]
        """The URL a key is appended to (``http://host:port/bucket/`` or ``https://bucket.host/``)."""
        self._creds = credentials
        self._region = client.meta.region_name
        cfg = client.meta.config
        self._http = URLLib3Session(proxies=cfg.proxies or get_environ_proxies(self.base),
                                    timeout=(connect_timeout, read_timeout), max_pool_connections=pool,
                                    proxies_config=cfg.proxies_config)
        self._count = count
        self._read_timeout = read_timeout
        self._misses = 0
        self._lock = threading.Lock()
        self.answered = 0
        """Requests this path settled (a body or "no such key")."""
        self.fallbacks = 0
        """Requests it handed back to the client."""

    @classmethod
    def build(cls, client: Any, session: Any, bucket: str, *, connect_timeout: float, read_timeout: float,
              pool: int, count: Callable[[str], None]) -> Optional[LeanGetter]:
        """A getter for ``client``'s bucket, or ``None`` where the lean path does not apply (no credentials)."""
        try:
            creds = session.get_credentials()
            if creds is None:
                return None
            return cls(client, creds, bucket, connect_timeout=connect_timeout, read_timeout=read_timeout,
                       pool=pool, count=count)
        except Exception:  # any surprise: the client does everything, as before
            return None

    @property
    def enabled(self) -> bool:
        """False once :data:`MAX_MISSES` fall-backs came in a row."""
        return self._misses < MAX_MISSES

    def get(self, key: str, *, limit: Optional[int] = None,
            byte_range: Optional[Tuple[int, int]] = None) -> Union[LeanBody, None, _FallBack]:
        """GET ``key``: a body, ``None`` (no such key) or :data:`FALL_BACK`.

        ``limit``: an object announced larger is not read (``data=None``) and
        no more than ``limit + 1`` bytes are read whatever was announced.
        ``byte_range``: the first and last byte (inclusive); no more than that
        many bytes are read.
        """
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        resp: Any = None
        try:
            headers = {} if byte_range is None else {"Range": f"bytes={byte_range[0]}-{byte_range[1]}"}
            req = AWSRequest(method="GET", url=self.base + quote(key, safe="/~"), headers=headers)
            S3SigV4Auth(self._creds.get_frozen_credentials(), "s3", self._region).add_auth(req)
            prepared = req.prepare()
            prepared.stream_output = True
            resp = self._http.send(prepared)
            self._count("GetObject")
            status = resp.status_code
            if status == 200 or (status == 206 and byte_range is not None):
                size = int(resp.headers.get("Content-Length", "0"))
                etag = str(resp.headers.get("ETag", ""))
                if limit is not None and byte_range is None and size > limit:
                    self._hit()
                    return LeanBody(None, size, etag)
                if byte_range is not None:
                    n: Optional[int] = byte_range[1] - byte_range[0] + 1
                else:
                    n = None if limit is None else limit + 1
                expect = size if n is None else min(size, n) if size else n
                data = read_body(resp.raw, n, body_seconds(self._read_timeout, expect), f"GET {key}")
                if "Content-Length" in resp.headers and len(data) < expect:
                    # The connection ended before the announced body did (a server killed mid-answer):
                    # a network failure for the client's retries to judge, never a short body (it
                    # was reported as a corrupt object; CI, test_server_dies_mid_transfer_...).
                    return self._miss()
                self._hit()
                return LeanBody(bytes(data), size, etag)
            if status == 404 and b"<Code>NoSuchKey</Code>" in resp.raw.read(64 * 1024):
                self._hit()
                return None
            return self._miss()
        except BodyTimeout:
            raise
        except Exception:  # connection, TLS, proxy, credentials...: the client tries, with its retries
            return self._miss()
        finally:
            if resp is not None:
                _finish(resp.raw)

    def _hit(self) -> None:
        with self._lock:
            self._misses = 0
            self.answered += 1

    def _miss(self) -> _FallBack:
        with self._lock:
            self._misses += 1
            self.fallbacks += 1
        return FALL_BACK


def _finish(raw: Any) -> None:
    """Hand a fully read connection back to the pool; drop one with unread bytes (they would be
    read as the next answer)."""
    try:
        if raw.closed:
            raw.release_conn()
        else:
            raw.close()
    except Exception:  # pragma: no cover - closing a broken connection
        pass
