"""Remotes on an S3-compatible object store: push, pull and share pins between machines.

A :class:`Remote` is a bucket and key prefix on any S3-compatible object store
(AWS S3, MinIO, Ceph RGW, SeaweedFS, GCS's S3 API).  Its layout mirrors a local
store, so any S3 tool can list and audit it (docs/remotes.md)::

    <prefix>/objects/<2 hex>/<62 hex>   an object's *uncompressed* bytes (always raw)
    <prefix>/refs/heads/<name>          "blake3:<64 hex>\\n": a head's current version
    <prefix>/refs/pins/<name>           "blake3:<64 hex>\\n": a pin (never moves)

Consistency rests on two conditional writes the server checks atomically:

* objects are uploaded **create-only** (``If-None-Match: *``).  A 412 answer
  means the key exists; since the key is the digest of the content, the
  object there is the same object, so that is success.  Objects never change.
* refs move by **compare-and-swap**: a new ref is created with
  ``If-None-Match: *``, an existing one replaced with ``If-Match: <ETag read
  before>``.  Of two machines pushing the same head at once exactly one wins;
  the other gets :class:`RemoteConflictError`, pulls (a three-way merge for
  heads) and pushes again.  Pins are only ever created, never replaced.

A push uploads every object of a closure before the ref that names it (and a
head's older versions oldest first), so the remote never has a ref pointing at
a missing object, and a killed push is simply run again: a listing (one
``ListObjectsV2`` probe, then one round trip per 2-hex fan-out prefix still
needed) tells it what is already there.  A pull verifies each object's BLAKE3
digest as it arrives, before it becomes visible in the local store, and writes
local refs last.  Remote settings of a store live in ``<root>/remotes.toml``.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import time
import tomllib
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from ._fs import Staging, fsync_dir, syncfs, write_file_atomic
from ._gclock import commit_lock
from ._layout import LOCKS, TMP
from .codecs import RAW
from ._lock import FileLock
from ._progress import Progress
from .digest import Digest, hash_bytes
from .errors import (
    BackendError,
    CasstoreError,
    FrozenError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
    RemoteConflictError,
    StoreFormatError,
)
from .refs import lock_path, read_ref, validate_name, write_ref

if TYPE_CHECKING:
    from .store import Store

__all__ = [
    "Remote",
    "TransferReport",
    "push",
    "pull",
    "fetch_object",
    "merge_versions",
    "load_remotes",
    "add_remote",
    "remove_remote",
    "get_remote",
    "REMOTES_FILE",
]

REMOTES_FILE = "remotes.toml"
DEFAULT_WORKERS = 16
MiB = 1 << 20
# A pull into a durable store publishes verified objects in batches: one
# filesystem sync per batch instead of an fsync per object and per directory.
_PULL_BATCH = 256  # staged files per batch (each holds an open fd until published)
_PULL_BATCH_BYTES = 256 * MiB
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")

# Test-only fault injection: called with a point name at the steps of a push or
# pull (tests SIGKILL the process, or hold it at a barrier, there).
_fault_hook: Optional[Callable[[str], None]] = None


def _fault(point: str) -> None:
    if _fault_hook is not None:
        _fault_hook(point)


def _progress(total: int, desc: str, enabled: Optional[bool]) -> Progress:
    """A byte progress bar on stderr (only when it is a terminal, unless ``enabled``)."""
    return Progress(total, desc=desc, unit="B", enabled=enabled)


# -- the remote -----------------------------------------------------------------


def parse_url(url: str) -> Tuple[str, str]:
    """``"s3://bucket/some/prefix"`` -> ``("bucket", "some/prefix/")`` (prefix ``""`` for the bucket root)."""
    if not isinstance(url, str):
        raise InvalidTypeError(f"a remote URL is a str like 's3://bucket/prefix', not {type(url).__name__}")
    if not url.startswith("s3://"):
        raise InvalidInputError(f"remote URL {url!r} must start with 's3://' (s3://bucket/prefix)")
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.fullmatch(bucket):
        raise InvalidInputError(f"remote URL {url!r}: {bucket!r} is not a valid bucket name")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise InvalidInputError(f"remote URL {url!r}: the prefix may not contain '.' or '..' segments")
    return bucket, "".join(p + "/" for p in parts)


def _is_ref_missing(e: Any) -> bool:
    err = getattr(e, "response", {}) or {}
    code = str(err.get("Error", {}).get("Code", ""))
    status = err.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("NoSuchKey", "404", "NotFound") or status == 404 and code != "NoSuchBucket"


def _is_precondition_failed(e: Any) -> bool:
    err = getattr(e, "response", {}) or {}
    code = str(err.get("Error", {}).get("Code", ""))
    status = err.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "412") or status == 412


def _is_conditional_conflict(e: Any) -> bool:
    """AWS answers 409 ConditionalRequestConflict when a concurrent conditional write is in flight."""
    err = getattr(e, "response", {}) or {}
    code = str(err.get("Error", {}).get("Code", ""))
    status = err.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code == "ConditionalRequestConflict" or status == 409


class Remote:
    """A casstore remote: ``s3://bucket/prefix`` on an S3-compatible object store.

    ``endpoint_url``: the server for non-AWS stores (MinIO, SeaweedFS, Ceph:
    ``"http://host:8333"``); path-style addressing is used with it.  Credentials
    come the usual AWS ways (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
    ``AWS_PROFILE``, ``~/.aws/credentials``, instance roles), or from
    ``profile``; they are never stored by casstore.  ``workers``: parallel
    transfers (network I/O, so more than the CPU count).  Objects of at least
    ``multipart_threshold`` bytes go up and down in ``multipart_chunksize``
    parts.  ``max_attempts``, ``connect_timeout`` and ``read_timeout`` bound
    how long an unreachable server can hold a call (botocore's standard retry
    mode with back-off).  ``progress``: show progress bars (``None``: only when
    stderr is a terminal).
    """

    def __init__(self, url: str, *, endpoint_url: Optional[str] = None, region: Optional[str] = None,
                 profile: Optional[str] = None, name: Optional[str] = None, workers: int = DEFAULT_WORKERS,
                 multipart_threshold: int = 64 * MiB, multipart_chunksize: int = 16 * MiB,
                 max_attempts: int = 3, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 progress: Optional[bool] = None, session: Any = None) -> None:
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        self.endpoint_url = endpoint_url or None
        self.region = region or None
        self.profile = profile or None
        self.name = name
        if workers < 1:
            raise InvalidInputError(f"workers must be at least 1, not {workers}")
        if multipart_chunksize < 5 * MiB:
            raise InvalidInputError("multipart_chunksize must be at least 5 MiB (the S3 minimum part size)")
        self.workers = workers
        self.multipart_threshold = max(multipart_threshold, multipart_chunksize)
        self.multipart_chunksize = multipart_chunksize
        self.max_attempts = max(1, max_attempts)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.progress = progress
        self._session = session
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        """HTTP requests sent, by S3 operation name (``"PutObject"``, ``"ListObjectsV2"`` ...)."""
        self.list_page_size = 1000
        """Keys per listing page (S3's maximum; smaller only to exercise pagination in tests)."""

    # -- description and keys --

    def describe(self) -> str:
        """``remote 'origin' (s3://bucket/prefix at http://host:8333)`` for messages."""
        where = self.url + (f" at {self.endpoint_url}" if self.endpoint_url else "")
        return f"remote {self.name!r} ({where})" if self.name else f"remote {where}"

    def __repr__(self) -> str:
        extra = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"Remote({self.url!r}{extra})"

    def object_key(self, digest: Digest) -> str:
        """``<prefix>objects/ab/cdef...``: where an object lives on the remote."""
        h = digest.hex
        return f"{self.prefix}objects/{h[:2]}/{h[2:]}"

    def ref_key(self, kind: str, name: str) -> str:
        """``<prefix>refs/heads/<name>`` or ``<prefix>refs/pins/<name>``."""
        if kind not in ("heads", "pins"):
            raise InvalidInputError(f"ref kind must be 'heads' or 'pins', not {kind!r}")
        return f"{self.prefix}refs/{kind}/{validate_name(name)}"

    def s3_url(self, key: str) -> str:
        """``s3://bucket/key`` (for messages and for other S3 tools)."""
        return f"s3://{self.bucket}/{key}"

    # -- client --

    @property
    def client(self) -> Any:
        """The boto3 S3 client (created on first use; thread-safe, shared by the transfer threads)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        try:
            import boto3  # noqa: F401 - the 's3' extra; fail here with an install hint
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError
        except ImportError:
            raise BackendError(
                f"{self.describe()}: remotes need boto3; install it with pip install 'casstore[s3]'"
            ) from None
        try:
            session = self._session if self._session is not None else _default_session(self.profile)
            region = self.region or session.region_name or "us-east-1"
            kwargs: Dict[str, Any] = dict(
                region_name=region,
                retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
                connect_timeout=self.connect_timeout,
                read_timeout=self.read_timeout,
                max_pool_connections=self.workers * 2 + 8,
                signature_version="s3v4",
                s3={"addressing_style": "path" if self.endpoint_url else "auto"},
                # Checksums beyond MD5/SigV4 cost CPU and are not understood by every
                # S3-compatible server; BLAKE3 verification on pull covers integrity.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
            try:
                cfg = Config(**kwargs)
            except TypeError:  # botocore < 1.36 has no checksum settings
                kwargs.pop("request_checksum_calculation")
                kwargs.pop("response_checksum_validation")
                cfg = Config(**kwargs)
            with _sessions_lock:  # a boto3 session is not thread-safe
                client = session.client("s3", endpoint_url=self.endpoint_url, config=cfg)
        except BotoCoreError as e:
            raise self._translate(e, "connecting to", self.url) from None
        members = client.meta.service_model.operation_model("PutObject").input_shape.members
        if "IfMatch" not in members or "IfNoneMatch" not in members:
            raise BackendError(
                f"{self.describe()}: this boto3/botocore is too old for conditional writes (If-Match); "
                "upgrade with pip install -U 'boto3>=1.36'"
            )
        client.meta.events.register("before-parameter-build.s3.CompleteMultipartUpload", _create_only)
        client.meta.events.register("before-send.s3", self._count)
        return client

    def _count(self, **kwargs: Any) -> None:
        op = str(kwargs.get("event_name", "")).rsplit(".", 1)[-1]
        with self._count_lock:
            self.requests[op] += 1

    def _translate(self, e: BaseException, action: str, key: str) -> CasstoreError:
        """A casstore error for a boto3/botocore exception, naming the remote, the key and what to do."""
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ProfileNotFound,
            ReadTimeoutError,
        )

        where = self.describe()
        target = self.s3_url(key) if key != self.url else key
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            msg = str(err.get("Message", "")) or str(e)
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                        "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidSecurity"):
                return BackendError(
                    f"{where}: the server refused the credentials ({code}) while {action} {target}; "
                    "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the remote's profile "
                    "for this endpoint"
                )
            if code == "AccessDenied" or status == 403:
                return BackendError(
                    f"{where}: access denied ({code or status}) while {action} {target}; the credentials "
                    "in use lack permission on this bucket/prefix -- check them and the bucket policy"
                )
            if code == "NoSuchBucket":
                return BackendError(
                    f"{where}: bucket {self.bucket!r} does not exist; create it (Remote.create_bucket(), "
                    f"`aws s3 mb s3://{self.bucket}`) or fix the remote's URL"
                )
            return BackendError(f"{where}: {action} {target} failed: {code or status} {msg}")
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return BackendError(
                f"{where}: no AWS credentials found while {action} {target}; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the remote's profile"
            )
        if isinstance(e, ProfileNotFound):
            return BackendError(f"{where}: {e}; define it in ~/.aws/credentials or ~/.aws/config")
        if isinstance(e, (EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError, ReadTimeoutError)):
            return BackendError(
                f"{where} is unreachable while {action} {target} (gave up after {self.max_attempts} "
                f"attempts): {e}; check that the server runs and that endpoint_url is right, then run again"
            )
        return BackendError(f"{where}: {action} {target} failed: {type(e).__name__}: {e}")

    def _call(self, action: str, key: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except (BotoCoreError, ClientError) as e:
            raise self._translate(e, action, key) from None

    # -- buckets --

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist yet (for test servers and first set-up)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.create_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            raise self._translate(e, "creating bucket", self.url) from None
        except BotoCoreError as e:
            raise self._translate(e, "creating bucket", self.url) from None

    def check(self) -> Dict[str, bool]:
        """Probe that the server honours the conditional writes casstore relies on; raise if not.

        Writes a scratch key under ``<prefix>tmp/``: a create-only PUT must
        succeed once and then be refused (412), a PUT with a wrong ``If-Match``
        must be refused, one with the right ETag must succeed.  The key is
        deleted afterwards.  Run once when setting a remote up
        (``casstore remote check NAME``): a server that silently ignores these
        headers would let a racing push overwrite a ref.
        """
        import uuid

        from botocore.exceptions import BotoCoreError, ClientError

        key = f"{self.prefix}tmp/casstore-check-{uuid.uuid4().hex}"
        c = self.client
        out = {"create_only": False, "compare_and_swap": False}

        def put(**cond: Any) -> Optional[str]:
            try:
                r = c.put_object(Bucket=self.bucket, Key=key, Body=os.urandom(16), **cond)
                return str(r["ETag"])
            except ClientError as e:
                if _is_precondition_failed(e):
                    return None
                raise

        try:
            etag = put(IfNoneMatch="*")
            if etag is None:
                raise BackendError(f"{self.describe()}: a create-only PUT of a new key {key} was refused")
            out["create_only"] = put(IfNoneMatch="*") is None
            stale = put(IfMatch='"00000000000000000000000000000000"') is None
            out["compare_and_swap"] = stale and put(IfMatch=etag) is not None
        except (BotoCoreError, ClientError) as e:
            raise self._translate(e, "checking conditional writes on", key) from None
        finally:
            try:
                c.delete_object(Bucket=self.bucket, Key=key)
            except Exception:  # best effort: a leftover probe key is harmless
                pass
        missing = [k for k, ok in out.items() if not ok]
        if missing:
            names = {"create_only": "If-None-Match: * (create-only)", "compare_and_swap": "If-Match (compare-and-swap)"}
            what = " and ".join(names[k] for k in missing)
            raise BackendError(
                f"{self.describe()}: the server ignores {what} on PutObject, so concurrent pushes could lose "
                "versions; use a server release that supports conditional writes (see docs/remotes.md)"
            )
        return out

    # -- refs --

    def read_ref(self, kind: str, name: str) -> Optional[Tuple[Digest, str]]:
        """``(digest, etag)`` of a remote ref, or ``None`` if it does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.ref_key(kind, name)
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
            body = r["Body"].read()
        except ClientError as e:
            if _is_ref_missing(e):
                return None
            raise self._translate(e, "reading ref", key) from None
        except BotoCoreError as e:
            raise self._translate(e, "reading ref", key) from None
        try:
            d = Digest.parse(body.decode("ascii").strip())
        except (UnicodeDecodeError, InvalidDigestError):
            raise StoreFormatError(
                f"{self.describe()}: ref {self.s3_url(key)} is damaged (content {body[:80]!r}); "
                "push the name again with force, or delete the key"
            ) from None
        return d, str(r["ETag"])

    def write_ref(self, kind: str, name: str, digest: Digest, *, etag: Optional[str]) -> bool:
        """Compare-and-swap a remote ref; ``False`` if it moved (or appeared) since it was read.

        ``etag=None`` creates the ref only if it does not exist (``If-None-Match: *``);
        otherwise it is replaced only if it still has that ETag (``If-Match``).
        """
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.ref_key(kind, name)
        cond = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=f"{digest}\n".encode(),
                                   ContentType="text/plain", **cond)
        except ClientError as e:
            if _is_precondition_failed(e) or _is_conditional_conflict(e):
                return False
            if etag is not None and _is_ref_missing(e):  # If-Match on a deleted key: 404 on some servers
                return False
            raise self._translate(e, "writing ref", key) from None
        except BotoCoreError as e:
            raise self._translate(e, "writing ref", key) from None
        return True

    def list_refs(self) -> Dict[str, Dict[str, Digest]]:
        """``{"pins": {name: digest}, "heads": {name: digest}}`` as the remote has them now."""
        base = f"{self.prefix}refs/"
        names: List[Tuple[str, str]] = []
        for key, _size in self._list(base):
            rest = key[len(base):]
            kind, _, name = rest.partition("/")
            if kind in ("heads", "pins") and name:
                try:
                    names.append((kind, validate_name(name)))
                except CasstoreError:
                    continue  # not a casstore ref
        out: Dict[str, Dict[str, Digest]] = {"pins": {}, "heads": {}}
        with ThreadPoolExecutor(min(self.workers, max(1, len(names)))) as ex:
            for (kind, name), got in zip(names, ex.map(lambda kn: self.read_ref(*kn), names), strict=True):
                if got is not None:
                    out[kind][name] = got[0]
        return {k: dict(sorted(v.items())) for k, v in out.items()}

    # -- objects --

    def _list(self, prefix: str, *, start_after: str = "", stop_after: str = "") -> Iterator[Tuple[str, int]]:
        """``(key, size)`` under ``prefix`` in key order (paginated; stops past ``stop_after``)."""
        token: Optional[str] = None
        while True:
            kw: Dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": self.list_page_size}
            if token:
                kw["ContinuationToken"] = token
            elif start_after:
                kw["StartAfter"] = start_after
            r = self._call("listing", prefix, self.client.list_objects_v2, **kw)
            last = ""
            for c in r.get("Contents", ()):
                last = c["Key"]
                yield last, int(c.get("Size", 0))
            if not r.get("IsTruncated") or (stop_after and last >= stop_after):
                return
            token = r.get("NextContinuationToken")
            if not token:
                return

    def _parse_object_key(self, key: str) -> Optional[Digest]:
        base = f"{self.prefix}objects/"
        if not key.startswith(base):
            return None
        rest = key[len(base):]
        if len(rest) != 65 or rest[2] != "/":
            return None
        try:
            return Digest(rest[:2] + rest[3:])
        except InvalidDigestError:
            return None

    def present(self, digests: Iterable[Digest], *, executor: Optional[ThreadPoolExecutor] = None) -> Set[Digest]:
        """Which of ``digests`` the remote has, by listing (never one request per object).

        One ``ListObjectsV2`` page over all of ``objects/`` first: on a small
        remote that is the whole answer.  Otherwise the fan-out prefixes that
        page did not cover are listed, in parallel, one round trip each
        (more only for prefixes holding over 1,000 keys between the smallest
        and largest digest asked for).
        """
        want: Dict[str, Set[str]] = {}
        for d in digests:
            want.setdefault(d.hex[:2], set()).add(d.hex[2:])
        if not want:
            return set()
        base = f"{self.prefix}objects/"
        found: Set[Digest] = set()
        first_fan = min(want)
        probe_start = f"{base}{first_fan}/{min(want[first_fan])[:-1]}"
        r = self._call("listing", base, self.client.list_objects_v2, Bucket=self.bucket, Prefix=base,
                       MaxKeys=self.list_page_size, StartAfter=probe_start)
        last = ""
        for c in r.get("Contents", ()):
            last = c["Key"]
            listed = self._parse_object_key(last)
            if listed is not None:
                found.add(listed)
        top_fan = max(want)
        if r.get("IsTruncated") and last < f"{base}{top_fan}/{max(want[top_fan])}":
            last_fan = last[len(base):len(base) + 2]
            todo = sorted(f for f in want if f > last_fan or (f == last_fan and f"{base}{f}/{max(want[f])}" > last))

            def list_fan(fan: str) -> Set[Digest]:
                lo, hi = min(want[fan]), max(want[fan])
                start = f"{base}{fan}/{lo[:-1]}"
                if fan == last_fan:
                    start = max(start, last)
                got: Set[Digest] = set()
                for key, _ in self._list(f"{base}{fan}/", start_after=start, stop_after=f"{base}{fan}/{hi}"):
                    d = self._parse_object_key(key)
                    if d is not None:
                        got.add(d)
                return got

            if executor is not None and len(todo) > 1:
                for got in executor.map(list_fan, todo):
                    found |= got
            else:
                for fan in todo:
                    found |= list_fan(fan)
        return {d for d in found if d.hex[2:] in want.get(d.hex[:2], ())}

    def iter_objects(self) -> Iterator[Tuple[Digest, int]]:
        """Every object on the remote: ``(digest, size)`` in digest order."""
        for key, size in self._list(f"{self.prefix}objects/"):
            d = self._parse_object_key(key)
            if d is not None:
                yield d, size

    def put_bytes(self, digest: Digest, data: Union[bytes, memoryview]) -> bool:
        """Upload one object create-only; ``False`` if it was already there (412: same content)."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.object_key(digest)
        for attempt in range(self.max_attempts + 2):
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data), IfNoneMatch="*")
                return True
            except ClientError as e:
                if _is_precondition_failed(e):
                    return False
                if _is_conditional_conflict(e) and attempt <= self.max_attempts:
                    time.sleep(0.05 * (attempt + 1))  # another writer of the same object is finishing
                    continue
                raise self._translate(e, "uploading object", key) from None
            except BotoCoreError as e:
                raise self._translate(e, "uploading object", key) from None
        return False  # pragma: no cover

    def _transfer_config(self) -> Any:
        """boto3's multipart settings for this remote (uploads and ranged downloads)."""
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold,
                              multipart_chunksize=self.multipart_chunksize,
                              max_concurrency=min(8, self.workers), use_threads=True)

    def upload_stream(self, digest: Digest, stream: Any) -> bool:
        """Upload a large object in parts (create-only: the completion carries ``If-None-Match: *``)."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.object_key(digest)
        cfg = self._transfer_config()
        try:
            self.client.upload_fileobj(stream, self.bucket, key, Config=cfg)
            return True
        except ClientError as e:
            if _is_precondition_failed(e) or _is_conditional_conflict(e):
                return False  # someone completed the same object first: identical content
            raise self._translate(e, "uploading object", key) from None
        except BotoCoreError as e:
            raise self._translate(e, "uploading object", key) from None

    def get_bytes(self, digest: Digest, *, max_size: Optional[int] = None) -> Optional[bytes]:
        """The object's bytes as stored on the remote (unverified); ``None`` if absent.

        With ``max_size``, a larger object is not read (returns ``None`` after
        closing the stream) -- callers then use :meth:`download_to`.
        """
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.object_key(digest)
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
            body = r["Body"]
            if max_size is not None and int(r.get("ContentLength", 0)) > max_size:
                body.close()
                raise _TooLarge(int(r["ContentLength"]))
            data: bytes = body.read()
            return data
        except ClientError as e:
            if _is_ref_missing(e):
                return None
            raise self._translate(e, "downloading object", key) from None
        except BotoCoreError as e:
            raise self._translate(e, "downloading object", key) from None

    def download_to(self, digest: Digest, fileobj: Any) -> bool:
        """Download an object into a seekable binary file in parallel ranged parts; ``False`` if absent."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.object_key(digest)
        cfg = self._transfer_config()
        try:
            self.client.download_fileobj(self.bucket, key, fileobj, Config=cfg)
            return True
        except ClientError as e:
            if _is_ref_missing(e):
                return False
            raise self._translate(e, "downloading object", key) from None
        except BotoCoreError as e:
            raise self._translate(e, "downloading object", key) from None


_sessions: Dict[Tuple[Optional[str], ...], Any] = {}
_sessions_lock = threading.RLock()
_SESSION_ENV = ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_DEFAULT_REGION")


def _default_session(profile: Optional[str]) -> Any:
    """A boto3 session per (profile, AWS environment), reused: a new one costs ~50 ms of model loading."""
    import boto3

    key = (profile, *(os.environ.get(k) for k in _SESSION_ENV))
    with _sessions_lock:
        s = _sessions.get(key)
        if s is None:
            s = boto3.session.Session(profile_name=profile) if profile else boto3.session.Session()
            _sessions[key] = s
        return s


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def _create_only(params: Dict[str, Any], **kwargs: Any) -> None:
    """botocore hook: every multipart completion of an object is create-only."""
    params.setdefault("IfNoneMatch", "*")


class _NoSeek(io.RawIOBase):
    """A read-only, non-seekable view of a stream (so verifying readers keep verifying)."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self._f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        data = self._f.read(len(mv))
        mv[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        return bytes(self._f.read(size))

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            super().close()


# -- configuration: <root>/remotes.toml ----------------------------------------


def _remotes_path(store: Store) -> Path:
    return store.root / REMOTES_FILE


def load_remotes(store: Store) -> Dict[str, Dict[str, str]]:
    """The remotes configured for ``store``: name -> settings (``url``, ``endpoint_url`` ...)."""
    p = _remotes_path(store)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise StoreFormatError(f"{p} is not valid TOML ({e}); fix or remove it") from None
    remotes = doc.get("remotes", {})
    if not isinstance(remotes, dict):
        raise StoreFormatError(f"{p}: [remotes] must be a table")
    out: Dict[str, Dict[str, str]] = {}
    for name, cfg in remotes.items():
        if not isinstance(cfg, dict) or not isinstance(cfg.get("url"), str):
            raise StoreFormatError(f"{p}: remote {name!r} has no url")
        out[name] = {k: str(v) for k, v in cfg.items() if isinstance(v, (str, int))}
    return out


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=True)  # JSON's \\u escapes are valid in a TOML basic string


def _write_remotes(store: Store, remotes: Dict[str, Dict[str, str]]) -> None:
    lines = ["# casstore remotes of this store (see docs/format.md); credentials are never stored here"]
    for name in sorted(remotes):
        lines.append("")
        lines.append(f"[remotes.{_toml_str(name)}]")
        for k in ("url", "endpoint_url", "region", "profile"):
            v = remotes[name].get(k)
            if v:
                lines.append(f"{k} = {_toml_str(v)}")
    write_file_atomic(store.root / TMP, _remotes_path(store), ("\n".join(lines) + "\n").encode(),
                      durable=store.durable, mode=0o444)


def _config_lock(store: Store) -> FileLock:
    return FileLock(store.root / LOCKS / "remotes.lock", timeout=60.0, what=f"{store.root / REMOTES_FILE}")


def add_remote(store: Store, name: str, url: str, *, endpoint_url: Optional[str] = None,
               region: Optional[str] = None, profile: Optional[str] = None, replace: bool = False) -> Remote:
    """Record remote ``name`` in ``<root>/remotes.toml`` (atomically); return it."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidInputError(
            f"invalid remote name {name!r}: use letters, digits, '.', '_' and '-' (up to 64), e.g. 'origin'"
        )
    parse_url(url)
    with _config_lock(store):
        remotes = load_remotes(store)
        if name in remotes and not replace and remotes[name].get("url") != url:
            raise InvalidInputError(
                f"remote {name!r} already exists ({remotes[name]['url']}); remove it first or pass replace=True"
            )
        cfg = {"url": url}
        for k, v in (("endpoint_url", endpoint_url), ("region", region), ("profile", profile)):
            if v:
                cfg[k] = v
        remotes[name] = cfg
        _write_remotes(store, remotes)
    return get_remote(store, name)


def remove_remote(store: Store, name: str) -> None:
    """Forget remote ``name`` (nothing on the remote is touched)."""
    with _config_lock(store):
        remotes = load_remotes(store)
        if name not in remotes:
            raise ObjectNotFoundError(f"no remote named {name!r} in {_remotes_path(store)}")
        del remotes[name]
        _write_remotes(store, remotes)


def get_remote(store: Store, name: str, **kwargs: Any) -> Remote:
    """The :class:`Remote` configured as ``name`` in ``<root>/remotes.toml``."""
    remotes = load_remotes(store)
    if name not in remotes:
        known = ", ".join(sorted(remotes)) or "none"
        raise ObjectNotFoundError(
            f"no remote named {name!r} in {_remotes_path(store)} (configured: {known}); "
            f"add it with `casstore remote add {name} s3://bucket/prefix --endpoint-url ...`"
        )
    cfg = remotes[name]
    return Remote(cfg["url"], endpoint_url=cfg.get("endpoint_url"), region=cfg.get("region"),
                  profile=cfg.get("profile"), name=name, **kwargs)


def _as_remote(store: Store, remote: Union[Remote, str]) -> Remote:
    if isinstance(remote, Remote):
        return remote
    if isinstance(remote, str):
        return Remote(remote) if remote.startswith("s3://") else get_remote(store, remote)
    raise InvalidTypeError(f"a remote is a casstore.Remote or a configured name, not {type(remote).__name__}")


# -- reports ----------------------------------------------------------------------


@dataclass
class TransferReport:
    """What a push or pull did."""

    remote: str
    """The remote's description."""
    refs: Dict[str, str] = field(default_factory=dict)
    """``"pins/NAME"`` or ``"heads/NAME"`` -> what happened (``"created"``, ``"fast-forward"`` ...)."""
    objects: int = 0
    """Objects transferred."""
    bytes: int = 0
    """Content bytes transferred."""
    present: int = 0
    """Objects of the closures that the other side already had."""
    seconds: float = 0.0

    def __str__(self) -> str:
        mib = self.bytes / MiB
        refs = ", ".join(f"{k}: {v}" for k, v in self.refs.items()) or "no refs"
        return (f"{self.remote}: {refs}; {self.objects} object(s), {mib:.1f} MiB transferred, "
                f"{self.present} already there, {self.seconds:.1f} s")


# -- manifest helpers -------------------------------------------------------------


def _manifest_doc(store: Store, d: Digest) -> Dict[str, Any]:
    from .manifest import decode_manifest

    return decode_manifest(store.get(d), d)


def _parent(doc: Dict[str, Any]) -> Optional[Digest]:
    p = doc.get("parent")
    return Digest.from_bytes(p) if p is not None else None


def _entry_digests(doc: Dict[str, Any], version: Digest) -> Dict[Digest, Optional[int]]:
    out: Dict[Digest, Optional[int]] = {}
    for key, raw in doc["entries"].items():
        try:
            d = Digest.from_bytes(raw[0])
            size = raw[1] if isinstance(raw[1], int) else None
        except (TypeError, IndexError, InvalidDigestError, AttributeError):
            raise StoreFormatError(f"manifest {version}: entry {key!r} is malformed") from None
        out[d] = size
    return out


def _local_chain(store: Store, d: Digest) -> List[Digest]:
    """``d`` and its ancestors, newest first, as far as they are in the local store."""
    out: List[Digest] = []
    seen: Set[Digest] = set()
    cur: Optional[Digest] = d
    while cur is not None and cur not in seen and store.objects.has(cur):
        out.append(cur)
        seen.add(cur)
        cur = _parent(_manifest_doc(store, cur))
    return out


def _is_ancestor(store: Store, a: Digest, *, of: Digest) -> bool:
    """Whether version ``a`` is ``of`` or one of its (locally present) ancestors."""
    return a in _local_chain(store, of)


def _packed(v: Any) -> bytes:
    import msgpack

    return msgpack.packb(v, use_bin_type=True)  # type: ignore[no-any-return]


def merge_versions(store: Store, ours: Digest, theirs: Digest, *, prefer: Optional[str] = None) -> Digest:
    """Three-way merge of two manifest versions; returns the new version's digest (no ref moves).

    The base is the newest version in ``ours``'s history that is also in
    ``theirs``'s.  A key (entry or metadata) changed on one side only takes
    that side's value; changed on both sides to different values is a
    conflict: :class:`RemoteConflictError` listing the keys, unless
    ``prefer="ours"`` or ``"theirs"`` picks a side.  The merged version's
    parent is ``theirs``, so pushing it afterwards is a fast-forward
    (rebase-style: the local versions after the base drop out of history).
    """
    from .manifest import encode_manifest

    if prefer not in (None, "ours", "theirs"):
        raise InvalidInputError(f"prefer must be None, 'ours' or 'theirs', not {prefer!r}")
    theirs_chain = _local_chain(store, theirs)
    tset = set(theirs_chain)
    base: Optional[Digest] = next((v for v in _local_chain(store, ours) if v in tset), None)
    o, t = _manifest_doc(store, ours), _manifest_doc(store, theirs)
    b = _manifest_doc(store, base) if base is not None else {"entries": {}, "meta": {}}
    conflicts: List[str] = []

    def merge_map(bm: Dict[str, Any], om: Dict[str, Any], tm: Dict[str, Any], what: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        missing = object()
        for k in sorted(set(bm) | set(om) | set(tm)):
            bv, ov, tv = bm.get(k, missing), om.get(k, missing), tm.get(k, missing)
            bp, op, tp = (None if v is missing else _packed(v) for v in (bv, ov, tv))
            if op == tp:
                val = ov
            elif op == bp:
                val = tv
            elif tp == bp:
                val = ov
            elif prefer == "ours":
                val = ov
            elif prefer == "theirs":
                val = tv
            else:
                conflicts.append(f"{what}{k!r}")
                continue
            if val is not missing:
                out[k] = val
        return out

    entries = merge_map(b["entries"], o["entries"], t["entries"], "")
    meta = merge_map(b["meta"], o["meta"], t["meta"], "meta ")
    if conflicts:
        shown = ", ".join(conflicts[:10]) + (", ..." if len(conflicts) > 10 else "")
        raise RemoteConflictError(
            f"cannot merge {ours} (local) with {theirs} (remote): both changed {len(conflicts)} key(s) "
            f"differently since {base or 'the empty manifest'}: {shown}; pull with merge='ours' or "
            "merge='theirs' to pick a side, or edit the local head to agree and pull again"
        )
    return store.put(encode_manifest(entries, meta, theirs), compress=False)


# -- push -----------------------------------------------------------------------------


@dataclass
class _RefPlan:
    kind: str
    name: str
    digest: Digest
    etag: Optional[str] = None
    action: str = ""
    write: bool = True


def _resolve_local(store: Store, names: Sequence[str]) -> List[Tuple[str, str, Digest]]:
    if not names:
        pins = store.pins()
        out = [("pins", n, d) for n, d in pins.items()]
        out += [("heads", n, d) for n, d in store.heads().items() if n not in pins]
        return out
    res = []
    for name in names:
        name = validate_name(name)
        pin = read_ref(store.root, "pins", name)
        if pin is not None:
            res.append(("pins", name, pin))
            continue
        head = read_ref(store.root, "heads", name)
        if head is None:
            raise ObjectNotFoundError(
                f"no pin or head named {name!r} in the store at {store.root}; see `casstore pins --heads`"
            )
        res.append(("heads", name, head))
    return res


def _plan_ref(store: Store, remote: Remote, kind: str, name: str, d: Digest, force: bool) -> _RefPlan:
    plan = _RefPlan(kind, name, d)
    rpin = remote.read_ref("pins", name)
    if kind == "pins":
        if rpin is None:
            plan.action = "created"
        elif rpin[0] == d:
            plan.action, plan.write = "up to date", False
        else:
            raise RemoteConflictError(
                f"{remote.describe()}: pin {name!r} there names {rpin[0]}, not {d}; pins never move -- "
                "pin this version under another name and push that"
            )
        return plan
    if rpin is not None:
        raise RemoteConflictError(
            f"{remote.describe()}: {name!r} is a pin there ({rpin[0]}), so head {name!r} cannot be pushed; "
            f"pull the pin (store.pull(remote, {name!r})) or push the head under another name"
        )
    rhead = remote.read_ref("heads", name)
    if rhead is None:
        plan.action = "created"
        return plan
    r, plan.etag = rhead
    if r == d:
        plan.action, plan.write = "up to date", False
    elif _is_ancestor(store, r, of=d):
        plan.action = "fast-forward"
    elif store.objects.has(r) and _is_ancestor(store, d, of=r):
        plan.action, plan.write = "remote is ahead (pull to update)", False
    elif force:
        plan.action = "forced"
    else:
        raise RemoteConflictError(
            f"{remote.describe()}: head {name!r} there is at {r}, which is not in the history of your {d}; "
            f"pull it (store.pull(remote, {name!r}) merges), then push again -- or push with force=True "
            "to overwrite it"
        )
    return plan


def _run_parallel(fn: Callable[[Any], Any], items: Sequence[Any], on_done: Callable[[Any, Any], None],
                  executor: ThreadPoolExecutor, *, window: Optional[int] = None) -> None:
    """Run ``fn`` over ``items`` on the pool; ``on_done(item, result)`` in this thread as each finishes.

    ``window``: at most that many items submitted and not yet handed to
    ``on_done`` (bounds what finished results hold, e.g. open staging files).
    The first failure (or an interrupt) cancels what has not started, waits
    for what has (each worker cleans up after itself) and is raised.  Calls
    are bounded by the client's retries and timeouts.
    """
    if window is None or window >= len(items):
        futs: Dict[Future[Any], Any] = {executor.submit(fn, it): it for it in items}
        try:
            for f in as_completed(futs):
                on_done(futs[f], f.result())  # raises the worker's exception
        except BaseException:
            for f in futs:
                f.cancel()
            wait(list(futs))
            raise
        return
    todo = iter(items)
    running: Dict[Future[Any], Any] = {}
    try:
        for it in todo:
            running[executor.submit(fn, it)] = it
            if len(running) >= window:
                break
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for f in done:
                it = running.pop(f)
                on_done(it, f.result())  # raises the worker's exception
                nxt = next(todo, _END)
                if nxt is not _END:
                    running[executor.submit(fn, nxt)] = nxt
    except BaseException:
        for f in running:
            f.cancel()
        wait(list(running))
        raise


_END = object()


def push(store: Store, remote: Union[Remote, str], *names: str, force: bool = False) -> TransferReport:
    """Upload pins/heads (all of them if no names) with their closures; see :meth:`Store.push`."""
    t0 = time.perf_counter()
    rem = _as_remote(store, remote)
    report = TransferReport(rem.describe())
    targets = _resolve_local(store, names)
    if not targets:
        report.seconds = time.perf_counter() - t0
        return report
    with ThreadPoolExecutor(rem.workers, thread_name_prefix="casstore-push") as ex:
        # 1. Which refs can move, and how (early conflict detection; the CAS at the end decides).
        plans = list(ex.map(lambda t: _plan_ref(store, rem, t[0], t[1], t[2], force), targets))
        # 2. The closures: version chains (heads carry their history) and entry objects.
        chains: Dict[Digest, List[Digest]] = {}
        content: Dict[Digest, Optional[int]] = {}
        for p in plans:
            chain = _local_chain(store, p.digest) if p.kind == "heads" else [p.digest]
            if not chain:
                raise ObjectNotFoundError(f"manifest version {p.digest} of {p.kind[:-1]} {p.name!r} is "
                                          f"missing from the store at {store.root}; nothing was pushed")
            chains[p.digest] = chain
            content.update(_entry_digests(_manifest_doc(store, p.digest), p.digest))
        versions = {v for c in chains.values() for v in c}
        for v in versions:
            content.pop(v, None)
        # 3. What the remote already has: a listing, never one request per object.
        remote_has = rem.present(set(content) | versions, executor=ex)
        missing = [d for d in content if d not in remote_has]
        absent = [d for d in missing if not store.objects.has(d)]
        if absent:
            raise ObjectNotFoundError(
                f"cannot push: {len(absent)} object(s) of the closure are neither in the store at {store.root} "
                f"nor on {rem.describe()} (first: {absent[0]}); pull or put them first. Nothing was pushed"
            )
        report.present = len(content) - len(missing) + len(versions & remote_has)
        sizes = {d: store.stat(d).size for d in missing}
        bar = _progress(sum(sizes.values()), f"push {rem.name or rem.url}", rem.progress)
        try:
            # 4. Objects first (parallel, create-only) ...
            def up(d: Digest) -> int:
                return _upload_object(store, rem, d, sizes[d])

            def sent(d: Digest, n: int) -> None:
                report.objects += 1
                report.bytes += sizes[d]
                bar.update(sizes[d])
                _fault("object-uploaded")

            _run_parallel(up, sorted(missing, key=lambda d: -sizes[d]), sent, ex)
            # ... then manifest versions, oldest first, so a version on the remote implies its ancestors.
            done_versions: Set[Digest] = set()
            for chain in chains.values():
                for v in reversed(chain):
                    if v in remote_has or v in done_versions:
                        continue
                    size = store.stat(v).size
                    _upload_object(store, rem, v, size)
                    done_versions.add(v)
                    report.objects += 1
                    report.bytes += size
                    bar.update(size)
                    _fault("object-uploaded")
        finally:
            bar.close()
    # 5. Refs last, by compare-and-swap.
    _fault("before-refs")
    for p in plans:
        label = f"{p.kind}/{p.name}"
        if not p.write:
            report.refs[label] = p.action
            continue
        _fault("before-ref-cas")
        if rem.write_ref(p.kind, p.name, p.digest, etag=p.etag):
            report.refs[label] = p.action
            continue
        now = rem.read_ref(p.kind, p.name)
        if now is not None and now[0] == p.digest:
            report.refs[label] = "up to date"  # someone pushed the same version meanwhile
            continue
        if p.kind == "pins":
            raise RemoteConflictError(
                f"{rem.describe()}: pin {p.name!r} was created there by someone else meanwhile "
                f"({now[0] if now else 'gone'}); pins never move -- pull it or pin under another name"
            )
        raise RemoteConflictError(
            f"{rem.describe()}: head {p.name!r} moved there while pushing (now {now[0] if now else 'deleted'}); "
            f"another push won. Pull it (store.pull(remote, {p.name!r}) merges), then push again"
        )
    report.seconds = time.perf_counter() - t0
    return report


def _upload_object(store: Store, rem: Remote, d: Digest, size: int) -> int:
    """Upload one local object, verified, as raw bytes; returns its size."""
    if size >= rem.multipart_threshold:
        from .store import _hash_fd

        info = store.stat(d)
        if info.codec == RAW:
            path = store.path(d)
            with open(path, "rb") as f:
                got = _hash_fd(f.fileno(), info.size)
                if got != d:
                    raise IntegrityError(
                        f"object {d} in the store at {store.root} is corrupt (hashes to {got}); not pushed. "
                        "Run `casstore verify --repair` and put the data again"
                    )
                f.seek(0)
                rem.upload_stream(d, f)
        else:
            with _NoSeek(store.open(d)) as f:  # the reader verifies at EOF, before the last part goes up
                rem.upload_stream(d, f)
    else:
        rem.put_bytes(d, _read_local(store, d))
    return size


def _read_local(store: Store, d: Digest) -> bytes:
    """A small local object's bytes, verified (inline hash: no helper thread for a few KiB)."""
    _loc = store.objects.locate(d)
    path, codec = _loc.path, _loc.codec
    if codec != RAW:
        return store.get(d)
    with open(path, "rb", buffering=0) as f:
        data = f.readall()
    got = hash_bytes(data)
    if got != d:
        raise IntegrityError(
            f"object {d} in the store at {store.root} is corrupt (hashes to {got}); not pushed. "
            "Run `casstore verify --repair` and put the data again"
        )
    return data


# -- pull -----------------------------------------------------------------------------


def _download(store: Store, rem: Remote, d: Digest, size_hint: Optional[int], dirs: Set[Path],
              batch: Optional[_Batch] = None) -> int:
    """Download one object, verify it, then publish it; returns its size.

    The bytes are hashed before anything is written under ``objects/``: a
    corrupt object raises :class:`IntegrityError` and leaves nothing behind.
    Without ``batch``, a verified object is staged, fsynced (durable stores)
    and renamed into place by this worker thread; the directories it lands in
    are added to ``dirs`` and fsynced once by :func:`_sync_dirs` (before any
    ref).  With ``batch`` (a durable pull), the verified object is only
    staged (written, not synced) and handed to it: :class:`_Batch` syncs the
    filesystem once per batch before renaming the batch into place.
    """
    from ._layout import object_path

    level = store.objects.level_for(None)
    durable = store.durable
    data: Optional[bytes] = None
    if size_hint is None or size_hint < rem.multipart_threshold:
        try:
            data = rem.get_bytes(d, max_size=rem.multipart_threshold - 1)
        except _TooLarge:
            data = None
        else:
            if data is None:
                raise _missing(rem, d)
    if data is not None:
        got = hash_bytes(data)
        if got != d:
            raise _corrupt(rem, d, got, len(data))
        staged = store.objects.stage_bytes(d, data, level)
        st, _, codec = staged
        if batch is not None:
            batch.add(staged, len(data))
            return len(data)
        try:
            store.objects.publish(st, d, codec, durable=durable, sync_dir=False)
        except BaseException:
            st.abort()
            raise
        dirs.add(object_path(store.root, d, codec).parent)
        return len(data)
    # Large: parallel ranged download into a staging file, then hash the staged bytes.
    from .digest import hash_fd as _hash_fd

    st = store.objects.stage("pull")
    try:
        with io.FileIO(st.fd, "r+b", closefd=False) as f:
            if not rem.download_to(d, f):
                raise _missing(rem, d)
            size = os.fstat(st.fd).st_size
        got = _hash_fd(st.fd, size)
        if got != d:
            raise _corrupt(rem, d, got, size)
        if level is not None:
            store.put_path(st.path)  # compressed as the store's default says (re-hashed, durable)
            st.abort()
            return size
        if batch is not None:
            batch.add((st, d, RAW), size)
            return size
        store.objects.publish(st, d, RAW, durable=durable, sync_dir=False)
        dirs.add(object_path(store.root, d, RAW).parent)
        return size
    except BaseException:
        st.abort()
        raise


class _Batch:
    """Publishes a durable pull's verified, staged objects with one filesystem sync per batch.

    Workers :meth:`add` each object once it is verified and written to its
    staging file (not fsynced).  :meth:`flush` hands what has accumulated to a
    publisher thread, which runs ``syncfs`` (every staged byte durable), then
    renames each file into place (no per-object fsync) -- like
    :meth:`Store.put_many`.  Downloads go on meanwhile; one batch is in
    flight at a time.  :meth:`finish` publishes the rest, then syncs once more
    so every rename and new fan-out directory is durable before a ref names
    them.  Only verified bytes are ever renamed under ``objects/``.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._staged: List[Tuple[Staging, Digest, str]] = []
        self._bytes = 0
        self._published = 0
        self._inflight: Optional[Future[None]] = None
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="casstore-publish")

    def add(self, item: Tuple[Staging, Digest, str], size: int) -> None:
        """Take a verified, staged object (any thread); its fan-out directory is created now."""
        from ._layout import object_path

        st, d, codec = item
        try:
            os.mkdir(object_path(self.store.root, d, codec).parent)  # made durable by the batch's syncs
        except FileExistsError:
            pass
        except BaseException:
            st.abort()
            raise
        with self._lock:
            self._staged.append(item)
            self._bytes += size

    def due(self) -> bool:
        """Whether enough has accumulated for a batch."""
        return len(self._staged) >= _PULL_BATCH or self._bytes >= _PULL_BATCH_BYTES

    def _take(self) -> List[Tuple[Staging, Digest, str]]:
        with self._lock:
            items, self._staged, self._bytes = self._staged, [], 0
        return items

    def _publish(self, items: List[Tuple[Staging, Digest, str]]) -> None:
        store = self.store
        try:
            if store.durable:
                syncfs(store.objects.tmp)  # the staged bytes are durable before any of them is renamed
            for st, d, codec in items:
                store.objects.publish(st, d, codec, durable=False)
                self._published += 1
        finally:
            for st, _, _ in items:
                st.abort()  # no-op once committed

    def _wait(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is not None:
            fut.result()  # raises the publisher's error

    def flush(self) -> None:
        """Start publishing what has accumulated (after the batch in flight is done)."""
        self._wait()
        items = self._take()
        if items:
            self._inflight = self._ex.submit(self._publish, items)

    def finish(self) -> None:
        """Publish everything staged, then sync the renames; on error, remove what is left staged."""
        try:
            self._wait()
            items = self._take()
            if items:
                self._publish(items)
            if self._published and self.store.durable:
                syncfs(self.store.objects.tmp)  # renames and new directories durable before any ref
        finally:
            self._ex.shutdown(wait=True)
            for st, _, _ in self._take():
                st.abort()


def _sync_dirs(store: Store, dirs: Set[Path], executor: Optional[ThreadPoolExecutor] = None) -> None:
    """fsync each directory objects were renamed into (once), so the renames survive a power loss."""
    if not store.durable or not dirs:
        return
    todo = sorted(dirs)
    if executor is not None and len(todo) > 1:
        list(executor.map(fsync_dir, todo))
    else:
        for d in todo:
            fsync_dir(d)
    dirs.clear()


def _missing(rem: Remote, d: Digest) -> ObjectNotFoundError:
    return ObjectNotFoundError(
        f"{rem.describe()} has no object {d} (key {rem.s3_url(rem.object_key(d))}); the remote is "
        "incomplete -- push it again from a machine that has it"
    )


def _corrupt(rem: Remote, d: Digest, got: Digest, n: int) -> IntegrityError:
    return IntegrityError(
        f"{rem.describe()}: object {rem.s3_url(rem.object_key(d))} is corrupt: its {n} bytes hash to {got}, "
        f"not {d}; it was not stored. Delete that key and push the object again from a good copy"
    )


def _fetch_versions(store: Store, rem: Remote, d: Digest, *, history: bool) -> None:
    """Make version ``d`` (and, with ``history``, its ancestors the remote has) local, verified."""
    cur: Optional[Digest] = d
    first = True
    while cur is not None:
        if store.objects.has(cur):
            if not first or not history:
                return
            cur = _parent(_manifest_doc(store, cur))
            first = False
            continue
        data = rem.get_bytes(cur)
        if data is None:
            if first:
                raise _missing(rem, cur)
            return  # older history is not on the remote (collected, or never pushed)
        got = hash_bytes(data)
        if got != cur:
            raise _corrupt(rem, cur, got, len(data))
        store.put(data, compress=False)
        if not history:
            return
        from .manifest import decode_manifest

        cur = _parent(decode_manifest(data, cur))
        first = False


def pull(store: Store, remote: Union[Remote, str], *names: str, merge: Union[bool, str] = True) -> TransferReport:
    """Download pins/heads (all the remote has if no names); see :meth:`Store.pull`.

    ``merge``: ``True`` merges a diverged head three-way (conflicting keys
    raise :class:`RemoteConflictError`), ``"ours"``/``"theirs"`` settle
    conflicts for that side, ``False`` refuses to merge (conflict error).
    """
    t0 = time.perf_counter()
    rem = _as_remote(store, remote)
    if merge not in (True, False, "ours", "theirs"):
        raise InvalidInputError(f"merge must be True, False, 'ours' or 'theirs', not {merge!r}")
    report = TransferReport(rem.describe())
    targets: List[Tuple[str, str, Digest]] = []
    if not names:
        refs = rem.list_refs()
        targets += [("pins", n, d) for n, d in refs["pins"].items()]
        targets += [("heads", n, d) for n, d in refs["heads"].items() if n not in refs["pins"]]
    else:
        for name in names:
            name = validate_name(name)
            got = rem.read_ref("pins", name)
            kind = "pins"
            if got is None:
                got, kind = rem.read_ref("heads", name), "heads"
            if got is None:
                raise ObjectNotFoundError(f"{rem.describe()} has no pin or head named {name!r}; "
                                          f"see `casstore remote ls {rem.name or rem.url}`")
            targets.append((kind, name, got[0]))
    # 1. Manifest versions (heads with their history, for merges), verified.
    content: Dict[Digest, Optional[int]] = {}
    versions: Set[Digest] = set()
    for kind, _name, d in targets:
        _fetch_versions(store, rem, d, history=kind == "heads")
        versions.add(d)
        content.update(_entry_digests(_manifest_doc(store, d), d))
    for v in versions:
        content.pop(v, None)
    missing = [d for d in content if not store.objects.has(d)]
    report.present = len(content) - len(missing)
    # 2. Objects, in parallel, each verified before it is written; then their directories synced.
    known = sum(s for d in missing if (s := content[d]) is not None)
    bar = _progress(known, f"pull {rem.name or rem.url}", rem.progress)
    dirs: Set[Path] = set()
    # Durable stores: objects are published in batches, one filesystem sync each (_Batch).
    batch = _Batch(store) if missing else None
    try:
        with ThreadPoolExecutor(rem.workers, thread_name_prefix="casstore-pull") as ex:
            def stored(d: Digest, n: int) -> None:
                report.objects += 1
                report.bytes += n
                bar.update(n)
                _fault("object-downloaded")
                if batch is not None and batch.due():
                    batch.flush()

            try:
                # The window bounds the staged files (open fds) waiting for a batch.
                _run_parallel(lambda d: _download(store, rem, d, content[d], dirs, batch),
                              sorted(missing, key=lambda d: -(content[d] or 0)), stored, ex,
                              window=None if batch is None else 2 * rem.workers)
            except BaseException:
                if batch is not None:
                    try:
                        batch.finish()  # what did arrive (verified) stays, durably
                    except Exception:
                        pass  # the first error is the one to report; what is left staged was removed
                raise
            finally:
                _sync_dirs(store, dirs, ex)  # objects published without a batch: their directories
            if batch is not None:
                batch.finish()
    finally:
        bar.close()
    # 3. Local refs last.
    _fault("before-refs")
    for kind, name, d in targets:
        report.refs[f"{kind}/{name}"] = _update_local_ref(store, rem, kind, name, d, merge)
    report.seconds = time.perf_counter() - t0
    return report


def _require_closure(store: Store, d: Digest, name: str, rem: Remote) -> None:
    """The pulled version and its entries must all be here before a ref names them."""
    man = store.manifest(d)
    missing = [k for k in man if not store.objects.has(man[k].digest)]
    if missing:
        raise ObjectNotFoundError(
            f"pull of {name!r} from {rem.describe()}: {len(missing)} object(s) of {d.short()} vanished locally "
            f"before the ref was written (a gc ran meanwhile?), e.g. {missing[0]!r}; pull again"
        )


def _update_local_ref(store: Store, rem: Remote, kind: str, name: str, d: Digest,
                      merge: Union[bool, str]) -> str:
    from .manifest import _remove_ref

    root = store.root
    # The GC lock, shared, as for any commit: a gc cannot delete the pulled
    # objects between the check below and the ref landing (docs/maintenance.md).
    with FileLock(lock_path(root, "names", name), what=f"manifest {name!r}"), commit_lock(store):
        _require_closure(store, d, name, rem)
        pin = read_ref(root, "pins", name)
        head = read_ref(root, "heads", name)
        if kind == "pins":
            if pin == d:
                return "up to date"
            if pin is not None:
                raise FrozenError(
                    f"local pin {name!r} names {pin}, but on {rem.describe()} it names {d}; pins never move. "
                    f"Pull nothing, or pin {d} under another name locally (store.pin('other', '{d}'))"
                )
            if head is not None and not _is_ancestor(store, head, of=d):
                raise FrozenError(
                    f"{name!r} was frozen on {rem.describe()} at {d}, but the local head {head} has changes "
                    f"that version lacks; save them under another name (store.pin('{name}-local', '{head}')), "
                    "then pull again"
                )
            write_ref(root, "pins", name, d, durable=store.durable)
            if head is not None:
                _remove_ref(store, "heads", name)
            return "created"
        if pin is not None:
            raise FrozenError(
                f"{name!r} is a pin in the store at {root} ({pin}) but a head on {rem.describe()}; "
                "pins never change -- pull the head under another name"
            )
        if head is None:
            write_ref(root, "heads", name, d, durable=store.durable)
            return "created"
        if head == d:
            return "up to date"
        if _is_ancestor(store, head, of=d):
            write_ref(root, "heads", name, d, durable=store.durable)
            return "fast-forward"
        if _is_ancestor(store, d, of=head):
            return "local is ahead (push it)"
        if merge is False:
            raise RemoteConflictError(
                f"local head {name!r} ({head}) and the one on {rem.describe()} ({d}) have diverged; "
                "pull with merge=True (or 'ours'/'theirs') to merge them"
            )
        merged = merge_versions(store, head, d, prefer=merge if isinstance(merge, str) else None)
        write_ref(root, "heads", name, merged, durable=store.durable)
        return f"merged ({merged.short()})"


# -- fetch_object -------------------------------------------------------------------------


def fetch_object(store: Store, digest: Union[Digest, str], *, remotes: Optional[Iterable[Union[Remote, str]]] = None,
                 verify: bool = True) -> bytes:
    """``store.get(digest)``; on a local miss, download it (verified) from the first remote that has it.

    ``remotes=None`` tries the store's configured remotes (``remotes.toml``) in name order.
    """
    d = Digest.coerce(digest)
    if store.objects.has(d):
        return store.get(d, verify=verify)
    rems = [_as_remote(store, r) for r in (remotes if remotes is not None else sorted(load_remotes(store)))]
    errors: List[str] = []
    for rem in rems:
        dirs: Set[Path] = set()
        try:
            _download(store, rem, d, None, dirs)
        except ObjectNotFoundError:
            errors.append(f"not on {rem.describe()}")
            continue
        except BackendError as e:
            errors.append(str(e))
            continue
        _sync_dirs(store, dirs)
        return store.get(d, verify=verify)
    tried = "; ".join(errors) or "no remotes configured"
    raise ObjectNotFoundError(f"object {d} is not in the store at {store.root} and no remote has it ({tried})")
