"""Fetch once, derive once: coordinated downloads and derived datasets across processes.

``store.fetch(url)``: exactly one process downloads a URL (into ``tmp/``,
hashing as it goes and checking any published checksum); every other
process asking at the same time waits on the URL's fcntl lock and then reads
the stored object.  ``store.derive(name, inputs, params, fn)``: the same for a
function of stored inputs; the result is memoized on (name, input digests,
canonical params, version) and recorded in the manifest ``name``.

Why this is safe:

* A result becomes visible only as a complete object (the staging file is
  renamed into ``objects/``) and then as a manifest version (ref moved by
  rename).  A producer killed at any point leaves no named partial output.
* The lock is an fcntl lock, which the kernel drops when its holder dies, so a
  waiter takes over at once; it re-checks for a result before producing one.
* Locks only avoid duplicate work; correctness never depends on them.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple, Union

import msgpack

from ._fs import process_token
from ._layout import LOCKS, TMP
from .codecs import RAW
from ._lock import FileLock
from ._progress import Progress
from .digest import Digest, new_hasher
from .errors import (
    BackendError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
)
from .manifest import Entry, Manifest, _canonical
from .refs import lock_path, read_ref, validate_key, validate_name

if TYPE_CHECKING:
    from .store import Store

__all__ = ["fetch", "derive", "DeriveFn"]

log = logging.getLogger("casstore.fetch")

DeriveFn = Callable[[Dict[str, Path], Path], Any]
CHUNK = 1 << 20
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


def _url_key(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:40]


def _check_url(url: object) -> str:
    if not isinstance(url, str):
        raise InvalidTypeError(f"a URL must be a str, not {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https", "file"):
        raise InvalidInputError(
            f"unsupported URL {url!r}: casstore fetches http://, https:// and file:// URLs"
        )
    if parts.scheme in ("http", "https") and not parts.netloc:
        raise InvalidInputError(f"malformed URL {url!r}: no host")
    if parts.scheme == "file" and not parts.path:
        raise InvalidInputError(f"malformed URL {url!r}: no path")
    return url


def _expected(digest: Optional[Union[Digest, str]], sha256: Optional[str],
              md5: Optional[str]) -> Tuple[Optional[Digest], Dict[str, str]]:
    want: Dict[str, str] = {}
    for algo, value in (("sha256", sha256), ("md5", md5)):
        if value is not None:
            v = value.lower().split(":", 1)[-1]
            size = hashlib.new(algo).digest_size * 2
            if len(v) != size or any(c not in "0123456789abcdef" for c in v):
                raise InvalidInputError(f"{algo}={value!r} is not a {size}-hex-digit checksum")
            want[algo] = v
    d = Digest.parse(digest) if isinstance(digest, str) else digest
    return d, want


def fetch(store: Store, url: str, *, digest: Optional[Union[Digest, str]] = None,
          sha256: Optional[str] = None, md5: Optional[str] = None, force: Optional[bool] = None,
          timeout: Optional[float] = None, retries: int = 5, progress: Optional[bool] = None,
          connect_timeout: float = 30.0) -> Digest:
    """Download ``url`` into the store exactly once across processes; return its digest.

    ``digest`` (BLAKE3), ``sha256`` or ``md5`` are checked as the bytes arrive;
    a mismatch raises :class:`IntegrityError` and stores nothing.  Other
    processes fetching the same URL wait on a lock (logging every ~10 s) for
    at most ``timeout`` seconds (default: the runtime setting ``lock_timeout``)
    and then return the stored result.  ``force=True`` downloads again.
    Transient network errors are retried ``retries`` times with exponential
    back-off; an interrupted transfer resumes with an HTTP Range request when
    the server supports it.  The URL -> digest record is the head
    ``_fetch/<sha256(url)[:40]>`` (its metadata holds the URL), which also keeps
    the object from garbage collection.
    """
    from .settings import current

    url = _check_url(url)
    want_digest, want = _expected(digest, sha256, md5)
    cfg = current()
    force = cfg.force_download if force is None else force
    timeout = cfg.lock_timeout if timeout is None else timeout
    name = f"_fetch/{_url_key(url)}"
    if not force:
        hit = _fetch_hit(store, name, want_digest, want)
        if hit is not None:
            return hit
    lock = FileLock(store.root / LOCKS / "fetch" / f"{_url_key(url)}.lock", timeout=timeout,
                    what=f"download of {url}")
    with lock:
        if not force:
            hit = _fetch_hit(store, name, want_digest, want)
            if hit is not None:
                return hit
        d, sums, size = _download(store, url, want_digest, want, retries=retries, progress=progress,
                                  connect_timeout=connect_timeout)
        with store.edit(name, timeout=timeout) as m:
            m.clear()
            m["content"] = Entry(d, size, {})
            m.meta.clear()
            m.meta.update({"kind": "casstore.fetch", "url": url, "fetched": time.time(), **sums})
        return d


def _fetch_hit(store: Store, name: str, want_digest: Optional[Digest], want: Dict[str, str]) -> Optional[Digest]:
    if want_digest is not None and want_digest in store and not want:
        return want_digest
    head = read_ref(store.root, "heads", name)
    if head is None:
        return None
    man = store.manifest(head)
    if "content" not in man:
        return None
    d = man["content"].digest
    if want_digest is not None and d != want_digest:
        return None
    if any(man.meta.get(algo) != v for algo, v in want.items()):
        return None
    return d if d in store else None


def _download(store: Store, url: str, want_digest: Optional[Digest], want: Dict[str, str], *,
              retries: int, progress: Optional[bool], connect_timeout: float) -> Tuple[Digest, Dict[str, str], int]:
    hasher = new_hasher(threaded=True)
    extra: Dict[str, Any] = {algo: hashlib.new(algo) for algo in ("sha256", "md5") if algo in want}
    if "sha256" not in extra:
        extra["sha256"] = hashlib.sha256()  # recorded, so users can compare with upstream
    st = store.objects.stage("dl")
    got = 0
    attempt = 0
    validator: Optional[str] = None  # ETag or Last-Modified of the first response
    bar = Progress(None, desc=f"fetch {url.rsplit('/', 1)[-1] or url}", enabled=progress)
    try:
        while True:
            try:
                req = urllib.request.Request(url, headers={"User-Agent": "casstore"})
                if got and validator is not None:
                    # Resume only the same version of the resource: with If-Range a
                    # server whose file changed answers 200 with all of it.
                    req.add_header("Range", f"bytes={got}-")
                    req.add_header("If-Range", validator)
                with urllib.request.urlopen(req, timeout=connect_timeout) as resp:
                    status = getattr(resp, "status", 200) or 200
                    if validator is None:
                        validator = resp.headers.get("ETag") or resp.headers.get("Last-Modified")
                    crange = resp.headers.get("Content-Range", "")
                    if got and (status != 206 or not crange.startswith(f"bytes {got}-")):
                        # The server ignored Range (or resumed elsewhere): start over.
                        os.ftruncate(st.fd, 0)
                        os.lseek(st.fd, 0, os.SEEK_SET)
                        got = 0
                        hasher = new_hasher(threaded=True)
                        extra = {k: hashlib.new(k) for k in extra}
                        bar.done = 0
                    length = resp.headers.get("Content-Length")
                    if bar.total is None and length is not None and status == 200:
                        bar.total = int(length)
                    expect_end = got + int(length) if length is not None else None
                    buf = bytearray(CHUNK)
                    mv = memoryview(buf)
                    while True:
                        n = resp.readinto(mv)
                        if not n:
                            break
                        chunk = mv[:n]
                        hasher.update(chunk)
                        for h in extra.values():
                            h.update(chunk)
                        st.write(chunk)
                        got += n
                        bar.update(n)
                    if expect_end is not None and got != expect_end:
                        raise http.client.IncompleteRead(b"", expect_end - got)
                break
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    raise ObjectNotFoundError(f"{url} answered 404 Not Found") from None
                if e.code == 416 and got:
                    break  # nothing left to fetch
                if e.code not in _RETRY_STATUS or attempt >= retries:
                    raise BackendError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
                if isinstance(e, urllib.error.URLError) and isinstance(e.reason, FileNotFoundError):
                    raise ObjectNotFoundError(f"{url}: no such file") from None
                if attempt >= retries:
                    raise BackendError(
                        f"download of {url} failed after {attempt + 1} attempts: {type(e).__name__}: {e}"
                    ) from None
            attempt += 1
            delay = min(0.25 * 2**attempt, 8.0)
            log.warning("download of %s interrupted at %d bytes; retry %d/%d in %.1fs",
                        url, got, attempt, retries, delay)
            time.sleep(delay)
        bar.close()
        d = Digest(hasher.hexdigest())
        sums: Dict[str, str] = {k: h.hexdigest() for k, h in extra.items()}
        if want_digest is not None and d != want_digest:
            raise IntegrityError(f"download of {url} has digest {d}, expected {want_digest}; nothing was stored")
        for algo, v in want.items():
            if sums[algo] != v:
                raise IntegrityError(
                    f"download of {url} has {algo} {sums[algo]}, expected {v}; nothing was stored"
                )
        if store.objects.touch(d):  # present: refreshed, so GC's grace covers the edit that follows
            st.abort()
        else:
            store.objects.publish(st, d, RAW)
        return d, sums, got
    except BaseException:
        st.abort()
        raise


# -- derive -----------------------------------------------------------------


def _input_key(store: Store, value: Any, what: str) -> Tuple[str, Any]:
    """(kind, digest) of an input: an object digest or a manifest (outputs of a derive)."""
    if isinstance(value, Manifest):
        return "manifest", value.digest
    if isinstance(value, (Digest, str)):
        return "object", Digest.parse(value) if isinstance(value, str) else value
    raise InvalidTypeError(
        f"derive input {what!r} must be a Digest or a Manifest (the result of fetch/derive), "
        f"not {type(value).__name__}"
    )


def derive_key(name: str, inputs: Mapping[str, Tuple[str, Digest]], params: Mapping[str, Any],
               version: Any) -> str:
    """The memo key: BLAKE3 of canonical msgpack of name, input digests, params and version."""
    doc = {
        "inputs": {k: [kind, d.raw] for k, (kind, d) in sorted(inputs.items())},
        "name": name,
        "params": _canonical(dict(params), f"params of derive {name!r}"),
        "version": _canonical(version, f"version of derive {name!r}"),
    }
    h = new_hasher()
    h.update(msgpack.packb(doc, use_bin_type=True))
    return str(h.hexdigest())


def derive(store: Store, name: str, *, inputs: Mapping[str, Any], fn: DeriveFn,
           params: Optional[Mapping[str, Any]] = None, version: Any = None,
           regenerate: Optional[bool] = None, timeout: Optional[float] = None,
           compress: Any = None) -> Manifest:
    """Run ``fn(inputs, out)`` once for this (name, inputs, params, version); return its outputs.

    ``inputs`` maps names to object digests or Manifests (earlier results);
    ``fn`` receives read-only paths (a Manifest with one file is passed as that
    file's path, with several as a directory of them) and an empty output
    directory; every regular file it writes there becomes an output.  The
    result is the head ``name``: a Manifest of relative path -> Entry whose
    ``meta["derive"]`` records the key, inputs, params, version, start time and
    duration.  Same key -> the stored result, no work; ``regenerate=True``
    forces a rerun.  Concurrent callers with the same key wait (logging every
    ~10 s) and then get the same result; if the producer dies, a waiter runs
    ``fn`` instead.
    """
    from .settings import current

    name = validate_name(name)
    if not callable(fn):
        raise InvalidTypeError(f"derive fn must be callable, not {type(fn).__name__}")
    params = {} if params is None else params
    if not isinstance(params, Mapping) or not isinstance(inputs, Mapping):
        raise InvalidTypeError("derive inputs and params must be mappings")
    cfg = current()
    regenerate = cfg.regenerate if regenerate is None else regenerate
    timeout = cfg.lock_timeout if timeout is None else timeout
    # Input names become paths under the work dir (a several-file Manifest is a directory named
    # after its input): they must be normalized relative paths, never '..' or absolute.
    keyed = {validate_key(k, "derive input name"): _input_key(store, v, k) for k, v in inputs.items()}
    key = derive_key(name, keyed, params, version)
    if not regenerate:
        hit = _derive_hit(store, name, key)
        if hit is not None:
            return hit
    with FileLock(lock_path(store.root, "derive", name), timeout=timeout,
                  what=f"derive {name!r} (key {key[:12]})"):
        if not regenerate:
            hit = _derive_hit(store, name, key)
            if hit is not None:
                return hit
        return _run_derive(store, name, key, keyed, params, version, fn, compress, timeout)


def _derive_hit(store: Store, name: str, key: str) -> Optional[Manifest]:
    head = read_ref(store.root, "heads", name) or read_ref(store.root, "pins", name)
    if head is None:
        return None
    man = store.manifest(name)
    rec = man.meta.get("derive")
    if isinstance(rec, Mapping) and rec.get("key") == key and all(e.digest in store for e in man.values()):
        return man
    return None


def _run_derive(store: Store, name: str, key: str, keyed: Mapping[str, Tuple[str, Digest]],
                params: Mapping[str, Any], version: Any, fn: DeriveFn, compress: Any,
                timeout: Optional[float]) -> Manifest:
    # The work directory is named like a staging file, so if this process
    # dies, sweep_stale() removes it; nothing in it is ever named.
    work = store.root / TMP / f"{process_token()}.{os.urandom(8).hex()}.derive"
    work.mkdir()
    try:
        in_dir = work / "in"
        out_dir = work / "out"
        in_dir.mkdir()
        out_dir.mkdir()
        paths = {k: _materialize_input(store, k, kind, d, in_dir) for k, (kind, d) in keyed.items()}
        started = time.time()
        t0 = time.monotonic()
        fn(dict(paths), out_dir)
        seconds = time.monotonic() - t0
        outputs: Dict[str, Entry] = {}
        for dirpath, _dirs, files in os.walk(out_dir):
            for f in sorted(files):
                p = Path(dirpath) / f
                rel = p.relative_to(out_dir).as_posix()
                if p.is_symlink() or not p.is_file():
                    raise InvalidInputError(f"derive {name!r}: output {rel!r} is not a regular file")
                outputs[rel] = Entry(store.put_path(p, compress=compress), p.stat().st_size)
        record = {
            "key": key,
            "inputs": {k: str(d) for k, (_kind, d) in keyed.items()},
            "params": _canonical(dict(params), "params"),
            "version": version,
            "started": started,
            "seconds": round(seconds, 6),
            "fn": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}",
        }
        with store.edit(name, timeout=timeout) as m:
            m.clear()
            for rel, e in outputs.items():
                m[rel] = e
            m.meta["derive"] = record
        assert m.result is not None
        return m.result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _materialize_input(store: Store, key: str, kind: str, d: Digest, in_dir: Path) -> Path:
    if kind == "object":
        return store.raw_path(d)
    man = store.manifest(d)
    if len(man) == 1:
        return store.raw_path(next(iter(man.values())).digest)
    # Several files: a directory of hard links to the (read-only) raw objects.
    base = in_dir / key
    base.mkdir(parents=True, exist_ok=True)  # exists even for an empty manifest
    for rel in man:
        dst = base / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        src = store.raw_path(man[rel].digest)
        try:
            os.link(src, dst)
        except OSError:
            os.symlink(src, dst)
    return base
