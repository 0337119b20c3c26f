"""URLs and HTTP(S) GETs for :func:`~casstore.pipelines.fetch`, written for hostile servers (issue 11).

Hazards, and what answers each:

* **A server that never finishes** (it trickles one byte a second, or stalls
  inside its headers).  Every socket read has a timeout, and a watchdog
  thread shuts the socket down at the overall deadline, which also ends a read
  that ``http.client`` loops over internally (a header line).  The caller gets
  :class:`NetworkTimeout` (a ``TimeoutError``) by the deadline, never a hang.
* **A body that disagrees with its Content-Length.**  The body is read with
  our own count: a connection closed early is ``http.client.IncompleteRead``
  (retryable: the transfer resumes), bytes past the announced length are an
  :class:`~casstore.errors.IntegrityError`.  Conflicting or malformed
  ``Content-Length`` headers are refused.
* **Redirects.**  At most :data:`MAX_REDIRECTS`; a URL seen twice is a loop and
  fails at once; only ``http``/``https`` targets are followed (a redirect to
  ``file://`` would read local files).  Credentials from the URL are sent only
  to the origin they were given for.
* **Secrets in URLs.**  ``user:pass@`` and query parameters that look like
  tokens (``token``, ``sig``, ``X-Amz-Signature``, ``access_token``, ``key``,
  ...) never appear in a log line, an error message, progress text or stored
  metadata: everything shown uses :attr:`Source.shown`, and text from foreign
  exceptions passes through :meth:`Source.scrub`.
* **Local files that are not files.**  A ``file://`` URL is opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and must ``fstat`` as a regular file: a FIFO
  (which would block forever), a device (``/dev/zero`` never ends), a
  directory, a symbolic link or a kernel pseudo-file (procfs, sysfs, ...:
  ``/proc/self/pagemap`` reports size 0 and never ends) is refused at once.
  A path no file can have (``%00``) is an :class:`InvalidInputError`.
"""

from __future__ import annotations

import base64
import errno
import os
import re
import socket
import stat
import threading
import time
import urllib.parse
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple, Type

if TYPE_CHECKING:  # imported where used: a warm fetch (a store hit) never loads http.client or ssl (~35 ms)
    import http.client

from ..errors import (
    BackendError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    NetworkTimeout,
    ObjectNotFoundError,
)

__all__ = [
    "Source",
    "Response",
    "parse_source",
    "redact",
    "open_file",
    "get",
    "MAX_REDIRECTS",
    "USER_AGENT",
]

MAX_REDIRECTS = 10
"""Redirects followed before a GET fails (browsers and curl use 20-50; a data URL needs one or two)."""

USER_AGENT = "casstore"

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Parameter names that carry secrets in common schemes: OAuth (access_token), AWS (X-Amz-Signature,
# X-Amz-Credential, X-Amz-Security-Token), GCS (X-Goog-Signature), Azure SAS (sig), API keys (key, api_key).
# A substring match: redacting a harmless parameter costs nothing, leaking a token costs a lot.
_SECRET_NAME = re.compile(r"token|secret|passw|pwd|sig|key|credential|auth|session|cookie", re.IGNORECASE)
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:)?//[^/?#]*@")
_PARAM = re.compile(r"([?&;#])([^=&;#]*)=([^&;#]*)")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)")
_MIN_SECRET = 3  # shorter "secrets" are not scrubbed from foreign text (it would garble every message)
_TRAILER_WAIT = 0.5  # seconds to look for bytes past Content-Length before accepting a body
_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def without_userinfo(url: str, put: str = "") -> str:
    """``url`` with its ``user:pass@`` replaced by ``put`` (``"***@"`` to show it was there)."""
    return _USERINFO.sub(lambda m: f"{m.group(1) or ''}//{put}", url, count=1)


def redact(url: str) -> str:
    """``url`` with ``user:pass@`` and token-like query (and fragment) values replaced by ``***``.

    Works on any string, parseable or not, and never raises: error messages
    about malformed URLs use it too.
    """
    shown = without_userinfo(url, "***@")

    def param(m: re.Match[str]) -> str:
        name = urllib.parse.unquote(m.group(2))
        return f"{m.group(1)}{m.group(2)}=***" if _SECRET_NAME.search(name) and m.group(3) else m.group(0)

    return _PARAM.sub(param, shown)


@dataclass(frozen=True, slots=True)
class Source:
    """A checked fetch URL (:func:`parse_source`).  Show only :attr:`shown`; :attr:`url` may hold secrets."""

    url: str
    """The URL as given (credentials and tokens included: never log it)."""
    shown: str
    """The URL with secrets redacted: the only form that may be logged, raised or stored."""
    scheme: str
    """``"http"``, ``"https"`` or ``"file"``."""
    host: str
    """The host (ASCII, IDNA-encoded; ``""`` for ``file``)."""
    port: int
    """The TCP port (``0`` for ``file``)."""
    target: str
    """The request target: path and query, percent-encoded ASCII."""
    path: str
    """The local path of a ``file`` URL (``""`` otherwise)."""
    auth: Optional[str]
    """``Authorization`` header value from ``user:pass@``, sent only to this origin."""
    secrets: Tuple[str, ...]
    """Substrings that must never be shown (user, password, token values)."""

    @property
    def origin(self) -> Tuple[str, str, int]:
        """(scheme, host, port): where credentials from the URL may be sent."""
        return self.scheme, self.host, self.port

    @property
    def basename(self) -> str:
        """The last path segment (no query), for progress text."""
        tail = urllib.parse.urlsplit(self.shown).path.rstrip("/").rsplit("/", 1)[-1]
        return tail or self.host or self.shown

    def scrub(self, text: str) -> str:
        """``text`` (a foreign exception's message) with every secret of this URL replaced by ``***``."""
        for s in sorted(self.secrets, key=len, reverse=True):
            if len(s) >= _MIN_SECRET:
                text = text.replace(s, "***")
        return text


def _ascii(text: str) -> str:
    # Percent-encode non-ASCII characters (an IRI path) so the request line is ASCII; '%' stays as given.
    return "".join(c if ord(c) < 128 else urllib.parse.quote(c, safe="") for c in text)


def parse_source(url: object) -> Source:
    """Check a fetch URL: ``http://``, ``https://`` or ``file://`` with a host or a path.

    :class:`InvalidTypeError` for a non-str, :class:`InvalidInputError` for a
    malformed or unsupported URL (the message shows it redacted).
    """
    if not isinstance(url, str):
        raise InvalidTypeError(f"a URL must be a str, not {type(url).__name__}")
    shown = redact(url)
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        # Whitespace and control characters: a CR/LF would inject request headers.
        raise InvalidInputError(f"malformed URL {shown!r}: it contains whitespace or control characters; "
                                "percent-encode them (%20)")
    try:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        port = parts.port
        hostname = parts.hostname
        user, password = parts.username, parts.password
    except ValueError as e:  # a bad IPv6 literal, a non-numeric or out-of-range port
        raise InvalidInputError(f"malformed URL {shown!r}: {e}") from None
    if scheme not in ("http", "https", "file"):
        raise InvalidInputError(f"unsupported URL {shown!r}: casstore fetches http://, https:// and file:// URLs")
    secrets: List[str] = []
    for name, value in urllib.parse.parse_qsl(f"{parts.query}&{parts.fragment}", keep_blank_values=True):
        if _SECRET_NAME.search(name) and value:
            secrets += [value, urllib.parse.quote(value, safe="")]
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidInputError(f"malformed URL {shown!r}: a file URL names a local path (file:///path)")
        path = urllib.parse.unquote(parts.path)  # urllib.request.url2pathname on POSIX
        if not path or not path.startswith("/"):
            raise InvalidInputError(f"malformed URL {shown!r}: no path")
        if "\0" in path:
            # %00 decodes to NUL, which no POSIX path can hold: os.open would raise a bare ValueError
            # ("embedded null byte") that escaped as "fetch failed unexpectedly" (bug hunt, item 2).
            raise InvalidInputError(f"malformed URL {shown!r}: %00 (a NUL byte) cannot be part of a file's path; "
                                    "check how the URL was built")
        return Source(url, shown, scheme, "", 0, "", path, None, tuple(secrets))
    if not hostname:
        raise InvalidInputError(f"malformed URL {shown!r}: no host")
    try:
        host = hostname if hostname.isascii() else hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise InvalidInputError(f"malformed URL {shown!r}: the host name is not valid") from None
    auth = None
    if user is not None or password is not None:
        raw_userinfo = parts.netloc.rpartition("@")[0]
        u, p = urllib.parse.unquote(user or ""), urllib.parse.unquote(password or "")
        secrets += [raw_userinfo, u, p, user or "", password or ""]
        token = base64.b64encode(f"{u}:{p}".encode()).decode("ascii")
        auth = f"Basic {token}"
        secrets.append(token)
    target = _ascii(parts.path or "/") + (f"?{_ascii(parts.query)}" if parts.query else "")
    default_port = 443 if scheme == "https" else 80
    return Source(url, shown, scheme, host, port or default_port, target, "", auth,
                  tuple(s for s in secrets if s))


# -- file:// ---------------------------------------------------------------------------------


# Kernel pseudo-filesystems (statfs f_type, linux/magic.h).  Their "regular files" are views of
# kernel state: st_size says nothing about what a read returns (procfs reports 0, sysfs 4096),
# some never end (/proc/self/pagemap: a read to the end filled the disk before the 64 GiB cap,
# bug hunt item 3), some block forever (tracefs trace_pipe) or fail at once (/proc/self/mem: EIO).
_PSEUDO_FS: Dict[int, str] = {
    0x9FA0: "procfs",
    0x62656572: "sysfs",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0x62656570: "configfs",
    0x0027E0EB: "cgroupfs",
    0x63677270: "cgroup2fs",
    0xCAFE4A11: "bpffs",
    0xDE5E81E4: "efivarfs",
}


def _fs_type(fd: int) -> Optional[int]:
    """The ``f_type`` of the filesystem holding ``fd`` (``fstatfs(2)``); ``None`` where unknown (not Linux)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fstatfs = libc.fstatfs
    except (OSError, AttributeError):  # pragma: no cover - a libc without fstatfs
        return None
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux, 84 on 32-bit
    if fstatfs(fd, buf) != 0:
        return None
    # f_type is the first member (__fsword_t: a C long) on every Linux ABI.
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def open_file(src: Source) -> Tuple[int, int]:
    """Open a ``file://`` source without following a link or blocking: ``(fd, size)``.

    A FIFO, a device, a directory, a symbolic link or a kernel pseudo-file
    (procfs, sysfs, debugfs, ...: :data:`_PSEUDO_FS`) is refused at once with
    :class:`InvalidInputError`; a missing file is :class:`ObjectNotFoundError`,
    any other failure to open it :class:`BackendError` naming the URL.
    """
    try:
        fd = os.open(src.path, _FILE_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise ObjectNotFoundError(f"{src.shown}: no such file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidInputError(
                f"{src.shown} is a symbolic link; fetch reads regular files only -- "
                f"fetch its target ({os.path.realpath(src.path)}) instead"
            ) from None
        if e.errno == errno.ENXIO:  # a UNIX socket (or a device without a driver): nothing to read
            raise InvalidInputError(f"{src.shown} is a socket or a special file, not a regular file; "
                                    "fetch reads regular files only") from None
        raise BackendError(f"cannot open {src.shown}: {e.strerror} [{errno.errorcode.get(e.errno or 0, '?')}]; "
                           "check that the file exists and that you may read it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a special file")
            raise InvalidInputError(f"{src.shown} is {kind}, not a regular file; fetch reads regular files only")
        pseudo = _PSEUDO_FS.get(_fs_type(fd) or 0)
        if pseudo is not None:
            raise InvalidInputError(
                f"{src.shown} is a {pseudo} pseudo-file (kernel state, not stored bytes: its size is not "
                "known and a read may never end); fetch reads regular files only -- to keep a snapshot, "
                "store.put_path() it or copy it to a regular file and fetch that"
            )
        os.set_blocking(fd, True)  # a regular file: reads never block anyway
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


# -- HTTP ----------------------------------------------------------------------------------------


class _Watchdog:
    """Shuts a socket down at the deadline, ending any read blocked on it (fired -> the caller times out)."""

    __slots__ = ("fired", "_timer", "_sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.fired = False
        self._sock = sock
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.name = "casstore-fetch-deadline"
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        try:
            # socket.socket.shutdown, not SSLSocket.shutdown: the latter also drops the TLS
            # object under the reading thread's feet.
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def cancel(self) -> None:
        """Stop the timer (the response is done)."""
        self._timer.cancel()


def _content_length(headers: http.client.HTTPMessage, shown: str) -> Optional[int]:
    values = headers.get_all("Content-Length") or []
    parsed = set()
    for v in values:
        for item in str(v).split(","):
            item = item.strip()
            if not item.isascii() or not item.isdigit() or len(item) > 19:
                raise BackendError(f"{shown} answered a malformed Content-Length {item[:40]!r}")
            parsed.add(int(item))
    if len(parsed) > 1:
        raise BackendError(f"{shown} answered conflicting Content-Length headers {sorted(parsed)}")
    return parsed.pop() if parsed else None


class Response:
    """One HTTP response, its body read with per-read timeouts and an overall deadline.

    Use as a context manager.  :meth:`read` returns body bytes (``b""`` at the
    end), :meth:`finish` checks that nothing follows the announced length.
    """

    def __init__(self, src: Source, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                 sock: socket.socket, dog: _Watchdog, deadline: float, read_timeout: float) -> None:
        self.source = src
        """Where this response came from (after redirects)."""
        self.status: int = resp.status
        """The HTTP status code."""
        self.reason: str = resp.reason
        """The status text (server-controlled: shown as a repr)."""
        self.headers: http.client.HTTPMessage = resp.headers
        """The response headers."""
        self._conn = conn
        self._resp = resp
        self._sock = sock
        self._dog = dog
        self._deadline = deadline
        self._read_timeout = read_timeout
        te = (resp.headers.get("Transfer-Encoding") or "").strip().lower()
        if te and te != "chunked":
            raise BackendError(f"{src.shown} answered an unsupported Transfer-Encoding {te[:40]!r}")
        self.chunked = te == "chunked"
        """The body comes in chunks (no Content-Length)."""
        no_body = self.status in (204, 304) or 100 <= self.status < 200
        self.length: Optional[int] = 0 if no_body else None if self.chunked else _content_length(
            resp.headers, src.shown)
        """Body bytes announced by Content-Length; ``None`` when chunked or delimited by the connection's end."""
        self._left = self.length

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0 or self._dog.fired:
            raise NetworkTimeout(f"download of {self.source.shown} did not finish by its deadline")
        self._sock.settimeout(min(self._read_timeout, left))

    def read(self, n: int) -> bytes:
        """Up to ``n`` body bytes from at most one socket read; ``b""`` at the end of the body.

        Raises ``http.client.IncompleteRead`` if the connection ends before the
        announced length, ``TimeoutError`` if one read waits longer than the
        per-read timeout and :class:`NetworkTimeout` at the deadline.
        """
        import http.client

        if self._left == 0:
            return b""
        self._arm()
        try:
            if self.chunked:
                data = self._resp.read1(n)
            else:
                fp = self._resp.fp
                data = fp.read1(n if self._left is None else min(n, self._left)) if fp is not None else b""
        except (OSError, http.client.HTTPException, ValueError):
            if self._dog.fired or time.monotonic() >= self._deadline:
                raise NetworkTimeout(f"download of {self.source.shown} did not finish by its deadline") from None
            raise
        if self._dog.fired:
            raise NetworkTimeout(f"download of {self.source.shown} did not finish by its deadline")
        if self._left is not None:
            if not data:
                raise http.client.IncompleteRead(b"", self._left)
            self._left -= len(data)
        return data

    def finish(self) -> None:
        """After the announced body: refuse a server that sent more (IntegrityError)."""
        if self.chunked or self.length is None or self._resp.fp is None:
            return
        left = self._deadline - time.monotonic()
        self._sock.settimeout(max(0.001, min(_TRAILER_WAIT, left)))
        try:
            extra = self._resp.fp.read1(1)
        except (OSError, ValueError):
            extra = b""  # quiet (timeout) or closed: nothing more was sent
        if extra:
            raise IntegrityError(
                f"{self.source.shown} sent more bytes than its Content-Length ({self.length}); "
                "the server is broken or hostile, nothing was stored"
            )

    def close(self) -> None:
        """Close the connection and stop the watchdog."""
        self._dog.cancel()
        try:
            self._resp.close()
        finally:
            self._conn.close()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()


def _proxy_for(src: Source) -> Optional[Source]:
    """The proxy for ``src`` from the environment (``http_proxy``, ``https_proxy``, ``no_proxy``), if any."""
    import urllib.request

    proxies = urllib.request.getproxies()
    proxy = proxies.get(src.scheme)
    if not proxy or urllib.request.proxy_bypass(src.host):
        return None
    if "://" not in proxy:
        proxy = f"http://{proxy}"
    p = parse_source(proxy)
    if p.scheme != "http":
        raise InvalidInputError(f"unsupported proxy {p.shown!r} for {src.shown}: casstore uses http:// proxies")
    return p


def _connection(src: Source, timeout: float) -> Tuple[http.client.HTTPConnection, str, Dict[str, str]]:
    """(connection, request target, extra headers), through a proxy when the environment names one."""
    import http.client
    import ssl

    proxy = _proxy_for(src)
    extra: Dict[str, str] = {}
    if proxy is None:
        if src.scheme == "https":
            return http.client.HTTPSConnection(src.host, src.port, timeout=timeout,
                                               context=ssl.create_default_context()), src.target, extra
        return http.client.HTTPConnection(src.host, src.port, timeout=timeout), src.target, extra
    proxy_auth = {"Proxy-Authorization": proxy.auth} if proxy.auth else {}
    if src.scheme == "https":
        conn = http.client.HTTPSConnection(proxy.host, proxy.port, timeout=timeout,
                                           context=ssl.create_default_context())
        conn.set_tunnel(src.host, src.port, headers=proxy_auth)
        return conn, src.target, extra
    netloc = f"[{src.host}]" if ":" in src.host else src.host
    extra.update(proxy_auth)
    return http.client.HTTPConnection(proxy.host, proxy.port, timeout=timeout), \
        f"http://{netloc}:{src.port}{src.target}", extra


def _request(src: Source, headers: Mapping[str, str], *, connect_timeout: float, deadline: float) -> Response:
    import ssl

    left = deadline - time.monotonic()
    if left <= 0:
        raise NetworkTimeout(f"download of {src.shown} did not finish by its deadline")
    conn, target, extra = _connection(src, min(connect_timeout, left))
    try:
        try:
            conn.connect()
        except ssl.SSLCertVerificationError as e:
            raise BackendError(f"{src.shown}: TLS certificate check failed ({src.scrub(str(e.verify_message))})"
                               ) from None
        sock = conn.sock
        assert sock is not None
        dog = _Watchdog(sock, deadline)
    except BaseException:
        conn.close()
        raise
    try:
        sock.settimeout(min(connect_timeout, max(0.001, deadline - time.monotonic())))
        conn.request("GET", target, headers={**headers, **extra})
        resp = conn.getresponse()
        return Response(src, conn, resp, sock, dog, deadline, connect_timeout)
    except BaseException as e:
        dog.cancel()
        conn.close()
        if dog.fired and not isinstance(e, (BackendError, InvalidInputError)):
            raise NetworkTimeout(f"download of {src.shown} did not finish by its deadline") from None
        raise


def get(src: Source, headers: Mapping[str, str], *, connect_timeout: float, deadline: float,
        max_redirects: int = MAX_REDIRECTS) -> Response:
    """GET ``src`` following redirects; the final response (any status), its body unread.

    ``connect_timeout`` bounds connecting and every single read; ``deadline``
    (a ``time.monotonic()`` value) bounds everything.  Redirect loops, too many
    redirects and redirects to anything but ``http``/``https`` are
    :class:`BackendError` at once.
    """
    origin = src.origin
    seen = {src.url}
    cur = src
    for _hop in range(max_redirects + 1):
        h = {"User-Agent": USER_AGENT, "Connection": "close", **headers}
        auth = cur.auth if cur.auth is not None else (src.auth if cur.origin == origin else None)
        if auth is not None:
            h["Authorization"] = auth
        resp = _request(cur, h, connect_timeout=connect_timeout, deadline=deadline)
        if resp.status not in _REDIRECTS:
            return resp
        location = resp.headers.get("Location")
        resp.close()
        if not location:
            raise BackendError(f"{cur.shown} answered {resp.status} (a redirect) without a Location")
        try:
            nxt = parse_source(urllib.parse.urljoin(cur.url, location.strip()))
        except InvalidInputError:
            raise BackendError(f"{cur.shown} redirected to a malformed URL {redact(location)[:200]!r}") from None
        if nxt.scheme not in ("http", "https"):
            raise BackendError(f"{cur.shown} redirected to {nxt.shown!r}; fetch follows only http(s) redirects")
        if nxt.url in seen:
            raise BackendError(f"redirect loop: {cur.shown} redirected back to {nxt.shown}")
        seen.add(nxt.url)
        cur = nxt
    raise BackendError(f"{src.shown}: more than {max_redirects} redirects; giving up")


def parse_content_range(value: Optional[str]) -> Optional[Tuple[int, int, Optional[int]]]:
    """``"bytes 10-99/100"`` -> ``(10, 99, 100)`` (total ``None`` for ``*``); ``None`` if malformed."""
    m = _CONTENT_RANGE.fullmatch((value or "").strip())
    if m is None:
        return None
    start, end = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    if end < start or (total is not None and end >= total):
        return None
    return start, end, total
