"""Fetch once: a URL downloaded by exactly one process, checked, recorded, and never partially visible.

``store.fetch(url)``: exactly one process downloads a URL (into ``tmp/``,
hashing as it goes and checking any published checksum); every other
process asking at the same time waits on the record's name lock and then
reads the stored object.  The URL -> digest record is the head
``_fetch/<sha256(key)[:40]>`` (:func:`fetch_name`), where the key is the URL
with its secrets redacted (and a presigned URL's signing times left out): a
name computed from the raw URL was an offline oracle for its password or
token to anyone who could list the store or the remote (bug hunt, item 1).

Why this is safe:

* A result becomes visible only as a complete object (the staging file is
  renamed into ``objects/``) and then as a manifest version (ref moved by
  rename).  A downloader killed at any point leaves no named partial output.
* The lock is an fcntl lock, which the kernel drops when its holder dies, so a
  waiter takes over at once; it re-checks for a result before downloading.
* Locks only avoid duplicate work; correctness never depends on them.

Hostile servers and paths (issue 11; the transport is :mod:`casstore.pipelines.http`):
a size limit (the ``Content-Length`` when announced, else ``max_bytes`` or
the ``fetch_max_bytes`` setting, 64 GiB by default), a per-read timeout and an overall deadline,
bodies longer or shorter than announced refused, a redirect limit,
secrets in the URL redacted from every log line, error, progress text and
the stored record, and ``file://`` FIFOs, devices, links and kernel
pseudo-files (procfs, sysfs, ...) refused at once.  Every download also stops
with :class:`~casstore.errors.DiskFullError` before it would leave the store's
filesystem less than :func:`space_floor` free (a source of unknown size must
not fill a shared disk on its way to the cap).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, FrozenSet, Mapping, Optional, Tuple, Union

from .._faults import fault
from .._fs import FLOOR_EXEMPT, free_bytes, space_floor
from .._progress import Progress
from ..codecs import RAW
from ..digest import Digest, new_hasher
from ..errors import (
    BackendError,
    CasstoreError,
    DiskFullError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    NetworkTimeout,
    ObjectNotFoundError,
)
from ..manifests import Entry, Manifest, load_manifest
from ..settings import current
from .common import (
    Scope,
    beat_every,
    check_count,
    check_flag,
    check_scope,
    check_seconds,
    fresh_for_job,
    in_scope,
    lock_seconds,
    producer,
    refuse_pinned,
    write_head,
)
from .http import Response, Source, get, open_file, parse_content_range, parse_source, without_userinfo
from .remote import RemoteShare, adopt_version, run_once_remote

if TYPE_CHECKING:

    from .._fs import Staging
    from ..store import Store

__all__ = ["fetch", "fetch_name"]

log = logging.getLogger("casstore.fetch")

CHUNK = 1 << 20
FLUSH_EVERY = 8 << 20
"""Bytes between background flushes of a download into a durable store (overlaps the disk with the network)."""
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_CHECKSUMS = ("sha256", "md5")


# Presigned URLs: where the scheme's signature parameter is present, these parameters say only
# when the signature is valid -- never what is served -- and change at every signing.  Left in the
# key, each freshly signed URL of the same object would be a new record and a new download.
_SIGNING_TIMES: Tuple[Tuple[str, FrozenSet[str]], ...] = (
    ("x-amz-signature", frozenset({"x-amz-date", "x-amz-expires"})),  # AWS SigV4 (S3, R2, MinIO, ...)
    ("x-goog-signature", frozenset({"x-goog-date", "x-goog-expires"})),  # GCS V4
    ("signature", frozenset({"expires"})),  # S3 SigV2 query auth, GCS V2, CloudFront canned policy
    ("sig", frozenset({"st", "se"})),  # Azure SAS: start and expiry
)


_KEY_SECRETS = frozenset({
    "token", "access_token", "id_token", "refresh_token", "auth", "auth_token", "authorization", "api_key",
    "apikey", "api-key", "password", "passwd", "pwd", "pass", "secret", "client_secret", "signature", "sig",
    "x-amz-signature", "x-amz-credential", "x-amz-security-token", "x-goog-signature", "x-goog-credential",
    "session", "sessionid", "session_id", "cookie", "credential", "credentials",
})
"""Query parameters whose values a record's name never depends on (exact names, any case)."""

def _record_key(url: str) -> str:
    """The secret-free form of ``url`` its record is named after.

    Left out: ``user:pass@``, the fragment, the values of the query parameters in
    :data:`_KEY_SECRETS`, and in a presigned URL its signing time and expiry
    (:data:`_SIGNING_TIMES`), so a secret cannot be found by hashing guesses, and a
    re-signed URL of the same resource is the same record.  Matched by *exact*
    name: :func:`~casstore.pipelines.http.redact` (what messages and the record
    show) also hides any parameter whose name merely contains ``auth``, ``key``
    or ``sig``, and naming records after that made ``?author=a`` and
    ``?author=b`` one record, the second fetch returning the first one's bytes.
    """
    head = url.partition("#")[0]
    head = without_userinfo(head)
    base, qmark, query = head.partition("?")
    if not query:
        return head
    params = query.split("&")
    names = [urllib.parse.unquote(p.partition("=")[0]).lower() for p in params]
    drop: FrozenSet[str] = frozenset()
    for signature, times in _SIGNING_TIMES:
        if signature in names:
            drop |= times
    kept = [f"{p.partition('=')[0]}=***" if n in _KEY_SECRETS else p
            for p, n in zip(params, names, strict=True) if n not in drop]
    return f"{base}{qmark}{'&'.join(kept)}"


def _url_key(url: str) -> str:
    return hashlib.sha256(_record_key(url).encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _legacy_name(url: str) -> str:
    """The name casstore < this version gave the record: the hash of the raw URL, secrets and all."""
    return f"_fetch/{hashlib.sha256(url.encode('utf-8', 'surrogatepass')).hexdigest()[:40]}"


def fetch_name(url: str) -> str:
    """The head recording a URL's download: ``_fetch/<sha256(key)[:40]>``.

    The key is the URL without ``user:pass@``, its fragment and the values of
    well-known secret parameters, and in a presigned URL without the signing
    time and expiry (:func:`_record_key`).  So the name reveals nothing about
    those secrets, the same resource fetched with a refreshed token or
    signature is the same record, and two URLs that differ only in them name
    the same record.
    """
    if not isinstance(url, str):
        raise InvalidTypeError(f"a URL must be a str, not {type(url).__name__}")
    return f"_fetch/{_url_key(url)}"


def _adopt_legacy(store: Store, src: Source, name: str, timeout: Optional[float]) -> None:
    """Rename a record of this URL under its pre-redaction name (:func:`_legacy_name`) to ``name``.

    Keeps a download made by an older casstore usable without downloading it
    again, and removes the secret-derived name from this store.  Best effort:
    any failure (a race, a read-only store, a pin) leaves it, and the URL is
    downloaded once more under the new name.  Only this store: a record on a
    remote keeps its old name (docs/pipelines.md says how to remove it).
    """
    old = _legacy_name(src.url)
    if old == name or store.refs.get("heads", old) is None or store.refs.get("heads", name) is not None:
        return
    try:
        store.rename(old, name, timeout=timeout)
        log.info("fetch %s: renamed its record %s to %s (names no longer depend on secrets)", src.shown, old, name)
    except CasstoreError as e:
        log.debug("fetch %s: left the old record %s (%s)", src.shown, old, type(e).__name__)


def _expected(digest: object, sha256: object, md5: object) -> Tuple[Optional[Digest], Dict[str, str]]:
    want: Dict[str, str] = {}
    for algo, value in (("sha256", sha256), ("md5", md5)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidTypeError(f"{algo}= must be a hex str, not {type(value).__name__} {value!r:.40}")
        v = value.lower().split(":", 1)[-1]
        size = hashlib.new(algo).digest_size * 2
        if len(v) != size or any(c not in "0123456789abcdef" for c in v):
            raise InvalidInputError(f"{algo}={value[:80]!r} is not a {size}-hex-digit checksum")
        want[algo] = v
    return (None if digest is None else Digest.coerce(digest)), want


def fetch(store: Store, url: str, *, digest: Optional[Union[Digest, str]] = None,
          sha256: Optional[str] = None, md5: Optional[str] = None, force: Optional[Scope] = None,
          timeout: Optional[float] = None, retries: int = 5, progress: Optional[bool] = None,
          connect_timeout: float = 30.0, max_bytes: Optional[int] = None,
          deadline: Optional[float] = None, refresh: bool = False,
          remote: Optional[RemoteShare] = None) -> Digest:
    """Download ``url`` into the store exactly once across processes; return its digest.

    ``digest`` (BLAKE3), ``sha256`` or ``md5`` are checked as the bytes arrive
    (one pass: BLAKE3 for the address plus only the checksums asked for); a
    mismatch raises :class:`IntegrityError` and stores nothing.  Without any
    of them the first download is trusted: later calls return it without
    asking the server again (``refresh=True`` revalidates; see below).  Other
    processes fetching the same URL wait on a lock (logging every ~10 s) while
    the downloader works and beats its heartbeat; ``timeout`` (default: the
    runtime setting ``lock_timeout``) applies only once it shows no sign of
    life for that long.  ``force=True`` -- or a list of URLs / fetch names
    (patterns) that matches; default the setting ``force_download`` --
    downloads again *once per job*: a download another process recorded after
    this one started is taken as the forced one.

    ``refresh=True`` revalidates a stored download with the server: a
    conditional GET with the recorded ``ETag`` (``If-None-Match``) and
    ``Last-Modified`` (``If-Modified-Since``); ``304 Not Modified`` keeps the
    stored object, ``200`` downloads the new content (checked, recorded as a
    new version of the record).  A ``file://`` URL is re-read when its size or
    modification time changed.  A record without validators is downloaded again.

    Transient network errors are retried ``retries`` times with exponential
    back-off; an interrupted transfer resumes with an HTTP Range request when
    the server supports it (and the resource is unchanged: ``If-Range``).
    ``connect_timeout`` bounds connecting and every single read; ``deadline``
    (seconds, default: the ``fetch_deadline`` setting, a day) bounds the whole download,
    retries included (:class:`~casstore.pipelines.NetworkTimeout`).  The body may
    be at most ``max_bytes`` (default: its ``Content-Length``, or
    the ``fetch_max_bytes`` setting, 64 GiB by default when none is announced); a longer body, or one
    longer than its ``Content-Length``, is an :class:`IntegrityError` and
    stores nothing.  At most 10 redirects, only to ``http(s)``.

    ``file://`` URLs must name a regular file (not a FIFO, device, directory,
    symbolic link or kernel pseudo-file such as ``/proc/...``).  A download
    stops with :class:`~casstore.errors.DiskFullError` before it would leave
    less than 1% (at most 1 GiB) of the store's filesystem free.  Credentials (``user:pass@``, sent as HTTP Basic auth)
    and token-like query parameters never appear in logs, errors, progress
    text or the record.  The record is the head :func:`fetch_name`; its
    metadata holds the (redacted) URL, the time, who fetched it, the
    checksums computed and the server's validators, and it keeps the object
    from garbage collection.

    ``remote`` (a :class:`~casstore.pipelines.remote.RemoteShare`; the facade
    makes one from ``remote="origin"``): once across machines sharing only
    that remote -- a download recorded there (same URL, matching checksums) is
    pulled (verified) instead; otherwise one process downloads under the
    record's lease on the remote and pushes the record, while the others wait
    and pull it (docs/pipelines.md, "Across machines").  ``refresh=True``
    revalidates this machine's copy with the server, as without a remote.
    """

    src = parse_source(url)
    want_digest, want = _expected(digest, sha256, md5)
    scope = check_scope(force, "force")
    refresh = bool(check_flag(refresh, "refresh"))
    check_flag(progress, "progress")
    retries = check_count(retries, "retries")
    connect = check_seconds(connect_timeout, "connect_timeout", positive=True)
    if max_bytes is not None:
        max_bytes = check_count(max_bytes, "max_bytes")
    cfg = current()
    limit_s = cfg.fetch_deadline if deadline is None else check_seconds(deadline, "deadline", positive=True)
    name = fetch_name(src.url)
    forced = in_scope(cfg.force_download if scope is None else scope, src.url, src.shown, name)
    lock_timeout = lock_seconds(timeout, cfg.lock_timeout, "timeout")
    _adopt_legacy(store, src, name, lock_timeout)
    if not refresh:
        hit = _fetch_hit(store, name, want_digest, want, forced=forced)
        if isinstance(hit, Digest):
            return hit
    with store.refs.lock(name, timeout=lock_timeout, what=f"download of {src.shown}",
                         heartbeat=beat_every(lock_timeout)):
        hit = _fetch_hit(store, name, want_digest, want, forced=forced)
        if isinstance(hit, _Record):
            # The stored bytes lack a checksum asked for now (the first fetch asked for none):
            # hash them locally, once, and record it -- a download is not needed to check them.
            hit = _add_checksums(store, name, hit, want, lock_timeout)
        refuse_pinned(store, name, f"fetch of {src.shown}")
        conditional: Dict[str, str] = {}
        if hit is not None:
            if not refresh:
                return hit
            rec = store.manifest(name).meta
            conditional = _validators(rec)
            if src.scheme == "file" and _file_unchanged(src, rec):
                return hit

        def work() -> Digest:
            end = time.monotonic() + min(limit_s, 1e9)  # finite: inf would overflow timer arithmetic
            got = _download(store, src, want_digest, want, retries=retries, progress=progress,
                            connect_timeout=min(connect, 1e9), max_bytes=max_bytes, end=end,
                            conditional=conditional if src.scheme != "file" else {})
            if got is None:  # 304 Not Modified
                assert hit is not None
                log.info("fetch %s: not modified since %s; keeping %s", src.shown, conditional, hit)
                return hit
            d, sums, size, validators = got
            meta: Dict[str, object] = {"kind": "casstore.fetch", "url": src.shown, "fetched": time.time(),
                                       "by": producer(), **sums, **validators}
            write_head(store, name, {"content": Entry(d, size, {})}, meta, timeout=lock_timeout)
            return d

        if remote is None or hit is not None:  # a refresh revalidates this machine's copy with the server
            return work()
        share = remote

        def ready() -> Optional[Digest]:
            return _remote_fetch_hit(store, share, name, want_digest, want, forced=forced, timeout=lock_timeout)

        return run_once_remote(share, name, what=f"download of {src.shown}", ready=ready, work=work,
                               lock_timeout=lock_timeout)


def _remote_fetch_hit(store: Store, share: RemoteShare, name: str, want_digest: Optional[Digest],
                      want: Dict[str, str], *, forced: bool, timeout: Optional[float]) -> Optional[Digest]:
    """A download of this URL recorded on the remote that fits what is asked, brought home; else ``None``.

    The remote record is judged by its metadata (read size-bounded, hashed,
    decoded) before any object is pulled; a checksum asked for that the remote
    record lacks is then computed locally from the verified bytes, as for a
    local record.
    """
    d = share.head(name)
    if d is None:
        return None
    man = Manifest(d, share.read_version(d), name=name)
    if "content" not in man or (want_digest is not None and man["content"].digest != want_digest):
        return None
    if forced and not fresh_for_job(man.meta.get("fetched"), man.meta.get("by")):
        return None
    if any(man.meta.get(algo) not in (None, v) for algo, v in want.items()):
        return None
    share.bring_home(d)
    adopt_version(store, name, d, share, timeout=timeout)
    hit = _fetch_hit(store, name, want_digest, want, forced=False)
    if isinstance(hit, _Record):
        hit = _add_checksums(store, name, hit, want, timeout)
    if hit is not None:
        log.info("fetch: pulled %s from %s (downloaded elsewhere; no download here)", hit, share.describe())
    return hit


@dataclass(frozen=True, slots=True)
class _Record:
    """A stored download that matches all but the checksums in ``missing`` (never computed for it)."""

    digest: Digest
    missing: Tuple[str, ...]


def _fetch_hit(store: Store, name: str, want_digest: Optional[Digest], want: Dict[str, str], *,
               forced: bool) -> Union[Digest, _Record, None]:
    if want_digest is not None and not want and not forced and store.objects.has(want_digest):
        return want_digest
    head = store.refs.get("heads", name)  # a pin of the name is a miss: refuse_pinned says why
    if head is None:
        return None
    try:
        man = Manifest(head, load_manifest(store.objects, head), name=name)  # one ref read on the warm path
    except ObjectNotFoundError:  # removed meanwhile
        return None
    if "content" not in man:
        return None
    d = man["content"].digest
    if want_digest is not None and d != want_digest:
        return None
    if forced and not fresh_for_job(man.meta.get("fetched"), man.meta.get("by")):
        return None
    if not store.objects.has(d):
        return None
    if any(man.meta.get(algo) not in (None, v) for algo, v in want.items()):
        return None  # a recorded checksum differs: the resource changed, or the caller is wrong
    missing = tuple(algo for algo in want if man.meta.get(algo) is None)
    return _Record(d, missing) if missing else d


def _add_checksums(store: Store, name: str, rec: _Record, want: Dict[str, str],
                   timeout: Optional[float]) -> Optional[Digest]:
    """Check the stored object against checksums never computed for it; record them.  ``None``: mismatch."""
    sums = {a: hashlib.new(a) for a in rec.missing}
    with store.objects.open(rec.digest, verify=True) as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            for h in sums.values():
                h.update(chunk)
    got = {a: h.hexdigest() for a, h in sums.items()}
    if any(got[a] != want[a] for a in got):
        return None  # the stored download is not what the caller expects: download again (and check)
    man = store.manifest(name)
    write_head(store, name, dict(man), {**man.meta, **got}, timeout=timeout)
    return rec.digest


def _validators(meta: Mapping[str, object]) -> Dict[str, str]:
    """Conditional-GET headers from a record's validators (none: an unconditional download)."""
    headers: Dict[str, str] = {}
    etag, modified = meta.get("etag"), meta.get("last_modified")
    if isinstance(etag, str) and etag.isprintable():
        headers["If-None-Match"] = etag
    if isinstance(modified, str) and modified.isprintable():
        headers["If-Modified-Since"] = modified
    return headers


def _file_unchanged(src: Source, meta: Mapping[str, object]) -> bool:
    try:
        st = os.stat(src.path, follow_symlinks=False)
    except OSError:
        return False  # gone or unreadable: the download says why
    return meta.get("mtime_ns") == st.st_mtime_ns and meta.get("size") == st.st_size


class _Sink:
    """The staging file and the running hashes of one download.

    Each chunk is hashed as it arrives -- BLAKE3 (single-threaded: its thread
    pool cost more than it saved on 1 MiB chunks, measured 0.9 against 2.3 GB/s
    on a busy 2-core machine) plus only the checksums asked for -- and written.
    Hashing on a helper thread beside the network was measured too: slower
    here (2 cores: the server, the reader and the hasher compete).  A durable
    store has the staging file flushed every :data:`FLUSH_EVERY` bytes by a
    helper thread (I/O, not CPU), so the fsync before the rename only writes
    the tail.

    Free space is checked as bytes arrive (:meth:`_check_space`): the
    download stops with :class:`DiskFullError` before it would leave less
    than :func:`space_floor` free.  Checks are spaced at half the headroom
    left, so a large disk costs a handful of ``statvfs`` calls, a nearly full
    one a check every chunk.
    """

    def __init__(self, st: Staging, algos: Tuple[str, ...], bar: Progress, *, durable: bool = False) -> None:
        self.st = st
        self.algos = algos
        self.bar = bar
        self.got = 0
        self._flushed = 0
        self._flush = threading.Event()
        self._flusher: Optional[threading.Thread] = None
        self._done = False
        self._where = str(st.path.parent)
        self._floor = space_floor(self._where)
        self._check_at = 0  # the byte count at which free space is looked at next
        self.reset(truncate=False)
        if durable:
            self._flusher = threading.Thread(target=self._flush_loop, name="casstore-fetch-flush", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            self._flush.wait()
            self._flush.clear()
            if self._done:
                return
            try:
                os.fdatasync(self.st.fd)
            except OSError:  # pragma: no cover - the final fsync reports it
                return

    def reset(self, *, truncate: bool = True) -> None:
        """Start over from byte 0 (the server ignored or broke a Range request)."""
        if truncate:
            os.ftruncate(self.st.fd, 0)
            os.lseek(self.st.fd, 0, os.SEEK_SET)
        self.got = 0
        self._flushed = 0
        self._check_at = 0
        self.blake = new_hasher()
        self.sums = {a: hashlib.new(a) for a in self.algos}
        self.bar.done = 0

    def add(self, chunk: bytes, cap: int, src: Source) -> None:
        """Append ``chunk``; IntegrityError (before writing) if the download would pass ``cap`` bytes."""
        if self.got + len(chunk) > cap:
            raise IntegrityError(
                f"download of {src.shown} exceeds {cap} bytes (its Content-Length, max_bytes or the default "
                "limit); nothing was stored -- pass max_bytes= to allow a larger download"
            )
        if self.got + len(chunk) >= self._check_at:
            self._check_space(len(chunk), src)
        self.blake.update(chunk)
        for h in self.sums.values():
            h.update(chunk)
        self.st.write(chunk)
        self.got += len(chunk)
        self.bar.update(len(chunk))
        if self._flusher is not None and self.got - self._flushed >= FLUSH_EVERY:
            self._flushed = self.got
            self._flush.set()

    def _check_space(self, n: int, src: Source) -> None:
        """DiskFullError (before writing) if ``n`` more bytes would leave less than the floor free."""
        free = free_bytes(self._where)
        if free is None:  # unknown (statvfs failed): ENOSPC on write is still a DiskFullError
            self._check_at = self.got + n + FLUSH_EVERY
            return
        headroom = free - self._floor
        if n > headroom and self.got + n > FLOOR_EXEMPT:
            raise DiskFullError(
                f"download of {src.shown} stopped after {self.got} bytes: only {free:,} bytes are free under "
                f"{self._where}, and a download leaves {self._floor:,} free for everyone else; nothing was "
                "stored -- free space (casstore gc, store.limit), or pass max_bytes= if the source may be "
                "larger than expected",
                errno.ENOSPC,
            )
        self._check_at = self.got + n + (max(n, (headroom - n) // 2) if headroom > n else 0)

    def finish(self) -> Tuple[Digest, Dict[str, str]]:
        """(BLAKE3 digest, checksums asked for) of everything written; stops the flusher."""
        self.close()
        return Digest(self.blake.hexdigest()), {a: h.hexdigest() for a, h in self.sums.items()}

    def close(self) -> None:
        """Stop the flusher thread (idempotent)."""
        if not self._done:
            self._done = True
            if self._flusher is not None:
                self._flush.set()
                self._flusher.join()


def _download(store: Store, src: Source, want_digest: Optional[Digest], want: Dict[str, str], *,
              retries: int, progress: Optional[bool], connect_timeout: float, max_bytes: Optional[int],
              end: float, conditional: Mapping[str, str]
              ) -> Optional[Tuple[Digest, Dict[str, str], int, Dict[str, object]]]:
    """Download into a staging file and publish it: (digest, checksums, size, validators); ``None``: 304."""
    # Only the checksums asked for: each costs a pass over the bytes at ~0.5-2 GB/s (BLAKE3 ~7 GB/s).
    algos = tuple(a for a in _CHECKSUMS if a in want)
    bar = Progress(None, desc=f"fetch {src.basename}", enabled=progress)
    st = store.objects.stage("dl")
    sink: Optional[_Sink] = None
    try:
        sink = _Sink(st, algos, bar, durable=store.objects.durable)
        validators: Dict[str, object]
        if src.scheme == "file":
            validators = _read_file(src, sink, max_bytes, end)
        else:
            got = _read_http(src, sink, retries=retries, connect_timeout=connect_timeout, max_bytes=max_bytes,
                             end=end, conditional=conditional)
            if got is None:
                st.abort()
                bar.close()
                return None
            validators = dict(got)
        bar.close()
        d, sums = sink.finish()
        if want_digest is not None and d != want_digest:
            raise IntegrityError(f"download of {src.shown} has digest {d}, expected {want_digest}; nothing was stored")
        for algo, v in want.items():
            if sums[algo] != v:
                raise IntegrityError(
                    f"download of {src.shown} has {algo} {sums[algo]}, expected {v}; nothing was stored"
                )
        if store.objects.touch(d):  # present: refreshed, so GC's grace covers the record that follows
            st.abort()
        else:
            store.objects.publish(st, d, RAW)
        return d, sums, sink.got, validators
    except BaseException:
        if sink is not None:
            sink.close()
        st.abort()
        raise


def _read_file(src: Source, sink: _Sink, max_bytes: Optional[int], end: float) -> Dict[str, object]:
    """Read a ``file://`` source into ``sink``; its validators (mtime_ns, size at open) for ``refresh``.

    A failing read (EIO, EINVAL: a file that opens but cannot be read front to
    back) is a :class:`BackendError` naming the (redacted) URL, never a bare
    ``OSError`` (bug hunt item 2).
    """
    fd, size = open_file(src)
    try:
        validators: Dict[str, object] = {"mtime_ns": 0, "size": size}
        try:
            fst = os.fstat(fd)
            validators = {"mtime_ns": fst.st_mtime_ns, "size": fst.st_size}
            sink.bar.total = size
            # A file that grows while read is read to its end (what is hashed is what is stored), up to the cap.
            cap = max_bytes if max_bytes is not None else max(size, current().fetch_max_bytes)
            while True:
                if time.monotonic() >= end:
                    raise NetworkTimeout(f"reading {src.shown} did not finish by its deadline")
                fault("fetch.read")  # tests: a read that fails (EIO) on a file that opened fine
                chunk = os.read(fd, CHUNK)
                if not chunk:
                    return validators
                sink.add(chunk, cap, src)
        except CasstoreError:
            raise  # the sink's own errors (cap, disk full) are already typed
        except OSError as e:
            code = errno.errorcode.get(e.errno or 0, "?")
            raise BackendError(
                f"reading {src.shown} failed after {sink.got} bytes: {src.scrub(e.strerror or str(e))} [{code}]; "
                "nothing was stored -- fetch reads regular files front to back: copy this one to a regular "
                "file and fetch that"
            ) from None
    finally:
        os.close(fd)


def _read_http(src: Source, sink: _Sink, *, retries: int, connect_timeout: float, max_bytes: Optional[int],
               end: float, conditional: Mapping[str, str]) -> Optional[Dict[str, str]]:
    """Download into ``sink``: the validators of the full response (etag, last_modified); ``None``: 304."""
    import http.client  # here, not at import: a store hit never loads it

    attempt = 0
    validator: Optional[str] = None  # ETag or Last-Modified of the latest full response
    found: Dict[str, str] = {}
    total: Optional[int] = None  # the resource's full size, once announced
    while True:
        headers: Dict[str, str] = {}
        if sink.got and validator is not None:
            # Resume only the same version of the resource: with If-Range a
            # server whose file changed answers 200 with all of it.
            headers["Range"] = f"bytes={sink.got}-"
            headers["If-Range"] = validator
        elif not sink.got:
            headers.update(conditional)  # refresh: 304 if the stored version is current
        try:
            with get(src, headers, connect_timeout=connect_timeout, deadline=end) as resp:
                if resp.status == 304 and conditional and not sink.got:
                    return None
                if resp.status == 200:  # a full answer: what a later Range request must match
                    total = resp.length
                    found = _response_validators(resp)
                    validator = found.get("etag") or found.get("last_modified")
                _take_response(resp, sink, max_bytes, total)
            return found
        except CasstoreError:
            raise
        except (OSError, http.client.HTTPException, _Retry) as e:
            what = f"{type(e).__name__}: {src.scrub(str(e))}" if str(e) else type(e).__name__
            if attempt >= retries:
                err = NetworkTimeout if isinstance(e, TimeoutError) else BackendError
                raise err(f"download of {src.shown} failed after {attempt + 1} attempts: {what}") from None
            attempt += 1
            delay = min(0.25 * 2**attempt, 8.0)
            if time.monotonic() + delay >= end:
                raise NetworkTimeout(f"download of {src.shown} did not finish by its deadline ({what})") from None
            log.warning("download of %s interrupted at %d bytes (%s); retry %d/%d in %.1fs",
                        src.shown, sink.got, what, attempt, retries, delay)
            time.sleep(delay)


def _response_validators(resp: Response) -> Dict[str, str]:
    """ETag / Last-Modified of a response, if short and printable (server-controlled, stored in the record)."""
    out: Dict[str, str] = {}
    for header, key in (("ETag", "etag"), ("Last-Modified", "last_modified")):
        v = resp.headers.get(header)
        if isinstance(v, str) and 0 < len(v) <= 256 and v.isprintable():
            out[key] = v
    return out


class _Retry(Exception):
    """A response worth trying again (a transient status, or an unusable partial answer)."""


def _take_response(resp: Response, sink: _Sink, max_bytes: Optional[int], total: Optional[int]) -> None:
    """Read one response into ``sink``; returns when the download is complete, raises otherwise."""
    import http.client

    src = resp.source
    status = resp.status
    if status in (404, 410):
        raise ObjectNotFoundError(f"{src.shown} answered {status} Not Found")
    if status == 416 and sink.got:
        if total is None or sink.got == total:
            return  # nothing left to fetch
        at = sink.got
        sink.reset()
        raise _Retry(f"416 at byte {at} of {total}")
    if status in _RETRY_STATUS:
        raise _Retry(f"HTTP {status} {resp.reason[:80]!r}")
    if status == 206:
        rng = parse_content_range(resp.headers.get("Content-Range"))
        if not sink.got or rng is None or rng[0] != sink.got or (total is not None and rng[2] not in (None, total)):
            # Not the range asked for: start over with a plain GET.
            sink.reset()
            raise _Retry(f"the server resumed at the wrong place ({resp.headers.get('Content-Range')!r:.80})")
        full = total if total is not None else rng[2]
    elif status == 200:
        if sink.got:
            sink.reset()  # the server ignored Range (or the resource changed): start over
        full = resp.length
    else:
        raise BackendError(f"download of {src.shown} failed: HTTP {status} {resp.reason[:80]!r}")
    if full is not None and max_bytes is not None and full > max_bytes:
        raise IntegrityError(
            f"{src.shown} announces {full} bytes, more than max_bytes={max_bytes}; nothing was downloaded"
        )
    if sink.bar.total is None and full is not None:
        sink.bar.total = full
    cap = full if full is not None else (max_bytes if max_bytes is not None else current().fetch_max_bytes)
    if resp.length is not None and sink.got + resp.length > cap:
        raise IntegrityError(f"{src.shown} answered a {resp.length}-byte body that does not fit its announced size")
    while True:
        chunk = resp.read(CHUNK)
        if not chunk:
            break
        sink.add(chunk, cap, src)
    resp.finish()
    if full is not None and sink.got != full and status == 206:
        raise http.client.IncompleteRead(b"", full - sink.got)

