"""Objects on an S3-compatible object store (AWS S3, MinIO, Ceph RGW, SeaweedFS, GCS's S3 API).

Two classes, so that objects and refs share one client:

:class:`S3Connection`
    One bucket on one server: the boto3 session and client (created on first
    use, thread-safe), the translation of every boto3/botocore failure into a
    :class:`~casstore.errors.BackendError` that names the remote, the key and
    what to do, a count of the HTTP requests sent by operation, list
    pagination, and typed operations (``put``, ``get``, ``head``, ``delete``,
    ``list``, multipart ``upload``/``download``).  ``casstore.refs.s3`` builds
    the refs on the same connection.
:class:`S3Objects`
    The :class:`~casstore.objects.base.ObjectStore` protocol over a key
    prefix: ``<prefix>objects/<2 hex>/<62 hex>`` (:func:`casstore._layout.object_key`,
    the layout local stores use), always the object's *uncompressed* bytes.

Hazards:

* Objects are uploaded **create-only** (``If-None-Match: *``, multipart
  completions too, by a botocore hook).  A 412 answer means the key exists;
  as the key is the digest of the content, that is success -- and a key that
  holds other bytes of the same size is never overwritten by a push.  A key of
  another size is a damaged copy (SeaweedFS keeps a 0-byte object when a
  client dies mid-PUT): listings with sizes do not count it and
  :meth:`S3Objects.put_content` replaces it, with a warning.
  ``409 ConditionalRequestConflict`` (AWS: another conditional write to the
  key is in flight) is retried with back-off, then treated like a 412.
* A server may serve anything under a key.  Every verified read hashes what
  arrived before returning it; bounded reads (:meth:`S3Objects.read_at_most`)
  never read more than asked for, whatever ``Content-Length`` claims.
* Listings may hold keys casstore did not write; :func:`casstore._layout.parse_object_key`
  decides, and anything else is ignored.
* Every call is bounded by botocore's retries (standard mode, ``max_attempts``)
  and the connect/read timeouts: an unreachable server gives a BackendError, never a hang.
* GETs of objects, ranges and chunks go first through the lean path
  (:mod:`casstore.objects.s3lean`: half the CPU per request); it takes only
  ``200``/``206``/``404 NoSuchKey`` and hands anything else back to the client
  above, so errors, retries and bounds stay the client's.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    TypeVar,
    Union,
)

from .._layout import OBJECTS, object_key, parse_object_key
from ..codecs import RAW
from ..digest import Digest, hash_bytes, new_hasher
from ..errors import (
    BackendError,
    CasstoreError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    NetworkTimeout,
    ObjectNotFoundError,
    StoreFormatError,
)
from .base import Buffer, ObjectInfo, ObjectStore
from .chunking import DEFAULT_CHUNKING, MAX_RECIPE_BYTES, Chunking, ChunkRef, Recipe, decode_recipe
from .s3lean import BodyTimeout, LeanBody, LeanGetter

log = logging.getLogger("casstore.remote")

if TYPE_CHECKING:
    import boto3.session

__all__ = ["S3Connection", "S3Objects", "S3Body", "ListedKey", "ListedObject", "is_missing", "is_precondition_failed",
           "is_conditional_conflict", "MiB", "DEFAULT_WORKERS", "Readable"]

MiB = 1 << 20
DEFAULT_WORKERS = 16
T = TypeVar("T")
Readable = Union[BinaryIO, io.RawIOBase]
"""A binary stream to upload from."""


# -- error classification (botocore ClientError responses) ---------------------------------------



def _check_complete(data: bytes, announced: int, limit: Optional[int]) -> None:
    """Raise botocore's ``IncompleteReadError`` for a body that ended before its announced length.

    Hazard (CI, a server SIGKILLed mid-pull): ``StreamingBody.read(n)`` checks the length only
    when it reads nothing, so a connection cut after 3,697 of 8,000 bytes gave a short body, and
    its hash reported the remote object corrupt.  A cut is a network failure (the caller's
    ``BotoCoreError`` handler words it so).  ``limit``: at most ``limit + 1`` bytes were asked for.
    """
    want = announced if limit is None else min(announced, limit + 1)
    if announced and len(data) < want:
        from botocore.exceptions import IncompleteReadError

        raise IncompleteReadError(actual_bytes=len(data), expected_bytes=want)

def _code_status(e: BaseException) -> Tuple[str, Optional[int]]:
    err = getattr(e, "response", None) or {}
    code = str(err.get("Error", {}).get("Code", ""))
    status = err.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status if isinstance(status, int) else None


def is_missing(e: BaseException) -> bool:
    """Is this botocore error "no such key" (and not "no such bucket")?"""
    code, status = _code_status(e)
    return code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket")


def is_precondition_failed(e: BaseException) -> bool:
    """Is this botocore error a failed ``If-Match`` / ``If-None-Match`` (412)?"""
    code, status = _code_status(e)
    return code in ("PreconditionFailed", "412") or status == 412


def is_conditional_conflict(e: BaseException) -> bool:
    """AWS answers 409 ConditionalRequestConflict while another conditional write to the key is in flight."""
    code, status = _code_status(e)
    return code == "ConditionalRequestConflict" or status == 409


_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                               "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidSecurity"})

# boto3 sessions: a new one costs ~50 ms of model loading, and one is not thread-safe.
_sessions: Dict[Tuple[Optional[str], ...], Any] = {}
_sessions_lock = threading.RLock()
_SESSION_ENV = ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_DEFAULT_REGION")


def _default_session(profile: Optional[str]) -> Any:
    """A boto3 session per (profile, AWS environment), reused."""
    import boto3

    key = (profile, *(os.environ.get(k) for k in _SESSION_ENV))
    with _sessions_lock:
        s = _sessions.get(key)
        if s is None:
            s = boto3.session.Session(profile_name=profile) if profile else boto3.session.Session()
            _sessions[key] = s
        return s


def _create_only(params: Dict[str, Any], **kwargs: object) -> None:
    """botocore hook: every multipart completion of an object is create-only."""
    params.setdefault("IfNoneMatch", "*")


@dataclass(frozen=True, slots=True)
class ListedKey:
    """One key of a listing with its size and server-side ``LastModified``."""

    key: str
    size: int
    modified: float
    """``LastModified`` as POSIX seconds (the server's clock; 0.0 if the server sent none)."""


@dataclass(frozen=True, slots=True)
class ListedObject:
    """One object of a remote listing: digest, size and ``LastModified`` (server clock, POSIX seconds)."""

    digest: Digest
    size: int
    modified: float


@dataclass(frozen=True, slots=True)
class S3Body:
    """What a GET returned: the bytes (``None`` when larger than the limit asked for), size and ETag."""

    data: Optional[bytes]
    size: int
    """The size the server announced (``Content-Length``)."""
    etag: str


class S3Connection:
    """One bucket on an S3-compatible server, shared by the objects and the refs of a remote.

    ``where`` describes the remote in messages.  The other settings are those
    of :class:`casstore.Remote` (which builds this).
    """

    def __init__(self, bucket: str, *, where: str, endpoint_url: Optional[str] = None,
                 region: Optional[str] = None, profile: Optional[str] = None, workers: int = DEFAULT_WORKERS,
                 multipart_threshold: int = 64 * MiB, multipart_chunksize: int = 16 * MiB, max_attempts: int = 3,
                 connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 session: Optional[boto3.session.Session] = None) -> None:
        if workers < 1:
            raise InvalidInputError(f"workers must be at least 1, not {workers}")
        if multipart_chunksize < 5 * MiB:
            raise InvalidInputError("multipart_chunksize must be at least 5 MiB (the S3 minimum part size)")
        self.bucket = bucket
        """The bucket name."""
        self.where = where
        """The remote, as messages name it."""
        self.endpoint_url = endpoint_url
        """The server (``None``: AWS)."""
        self.region = region
        self.profile = profile
        self.workers = workers
        """Parallel transfers (network I/O, so more than the CPU count)."""
        self.multipart_chunksize = multipart_chunksize
        self.multipart_threshold = max(multipart_threshold, multipart_chunksize)
        """Objects at least this large go up and down in parts."""
        self.max_attempts = max(1, max_attempts)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.requests: Counter[str] = Counter()
        """HTTP requests sent, by S3 operation name (``"PutObject"``, ``"ListObjectsV2"`` ...)."""
        self.list_page_size = 1000
        """Keys per listing page (S3's maximum; smaller only to exercise pagination in tests)."""
        self._session = session
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._lean: Optional[LeanGetter] = None
        self._lean_built = False

    # -- messages --

    def s3_url(self, key: str) -> str:
        """``s3://bucket/key`` (for messages and for other S3 tools)."""
        return f"s3://{self.bucket}/{key}"

    def translate(self, e: BaseException, action: str, key: str) -> CasstoreError:
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

        where = self.where
        target = self.s3_url(key)
        if isinstance(e, ClientError):
            code, status = _code_status(e)
            msg = str(e.response.get("Error", {}).get("Message", "")) or str(e)
            if code in _CREDENTIAL_CODES:
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

    # -- the client --

    @property
    def _c(self) -> Any:
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
                f"{self.where}: remotes need boto3; install it with pip install 'casstore[s3]'"
            ) from None
        try:
            session = self._session if self._session is not None else _default_session(self.profile)
            region = self.region or session.region_name or "us-east-1"
            settings: Dict[str, Any] = dict(
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
            cfg = Config(**settings)
            with _sessions_lock:  # a boto3 session is not thread-safe
                client = session.client("s3", endpoint_url=self.endpoint_url, config=cfg)
        except BotoCoreError as e:
            raise self.translate(e, "connecting to", "") from None
        members = client.meta.service_model.operation_model("PutObject").input_shape.members
        if "IfMatch" not in members or "IfNoneMatch" not in members:
            raise BackendError(
                f"{self.where}: this boto3/botocore is too old for conditional writes (If-Match); "
                "upgrade with pip install -U 'boto3>=1.36'"
            )
        client.meta.events.register("before-parameter-build.s3.CompleteMultipartUpload", _create_only)
        client.meta.events.register("before-send.s3", self._count)
        return client

    def _count(self, **kwargs: object) -> None:
        self._count_op(str(kwargs.get("event_name", "")).rsplit(".", 1)[-1])

    def _count_op(self, op: str) -> None:
        with self._count_lock:
            self.requests[op] += 1

    @property
    def lean(self) -> Optional[LeanGetter]:
        """The lean GET path (:mod:`casstore.objects.s3lean`) of this connection, built on first use;
        ``None`` where it does not apply (anonymous access)."""
        self._lean_getter()
        return self._lean

    def _lean_getter(self) -> Optional[LeanGetter]:
        """The lean GET path if it applies and has not turned itself off."""
        if not self._lean_built:
            client = self._c
            with self._client_lock:
                if not self._lean_built:
                    session = self._session if self._session is not None else _default_session(self.profile)
                    self._lean = LeanGetter.build(client, session, self.bucket,
                                                  connect_timeout=self.connect_timeout,
                                                  read_timeout=self.read_timeout, pool=self.workers * 2 + 8,
                                                  count=self._count_op)
                    self._lean_built = True
        lean = self._lean
        return lean if lean is not None and lean.enabled else None

    def call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (boto3 calls), translating every boto3/botocore failure (see :meth:`translate`)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (BotoCoreError, ClientError) as e:
            raise self.translate(e, action, key) from None

    def _transfer_config(self) -> Any:
        """boto3's multipart settings (uploads and ranged downloads)."""
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold,
                              multipart_chunksize=self.multipart_chunksize,
                              max_concurrency=min(8, self.workers), use_threads=True)

    # -- typed operations --

    def put(self, key: str, body: bytes, *, create_only: bool = False, if_match: Optional[str] = None,
            content_type: Optional[str] = None, action: str = "writing") -> Optional[str]:
        """PUT ``body`` at ``key``; the new ETag, or ``None`` when the condition did not hold.

        ``create_only``: only if the key does not exist (``If-None-Match: *``);
        ``if_match``: only if the key still has that ETag.  A 409 (a concurrent
        conditional write in flight) is retried, then counts as a failed condition.
        """
        from botocore.exceptions import BotoCoreError, ClientError

        params: Dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": body}
        if create_only:
            params["IfNoneMatch"] = "*"
        if if_match is not None:
            params["IfMatch"] = if_match
        if content_type is not None:
            params["ContentType"] = content_type
        conditional = create_only or if_match is not None
        for attempt in range(self.max_attempts + 2):
            try:
                r = self._c.put_object(**params)
                return str(r["ETag"])
            except ClientError as e:
                if conditional and is_precondition_failed(e):
                    return None
                if conditional and is_conditional_conflict(e):
                    if attempt <= self.max_attempts:
                        time.sleep(0.05 * (attempt + 1))  # the other writer is finishing: ask again
                        continue
                    return None
                if if_match is not None and is_missing(e):  # If-Match on a deleted key: 404 on some servers
                    return None
                raise self.translate(e, action, key) from None
            except BotoCoreError as e:
                raise self.translate(e, action, key) from None
        return None  # pragma: no cover

    def get(self, key: str, *, limit: Optional[int] = None, action: str = "reading") -> Optional[S3Body]:
        """GET ``key``; ``None`` if it does not exist.

        With ``limit``, at most ``limit`` bytes are read: a larger object (as
        announced, or as it turns out while reading) comes back with ``data=None``.
        """
        from botocore.exceptions import BotoCoreError, ClientError

        lean = self._lean_getter()
        if lean is not None:
            got = self._lean_get(lean, action, key, limit=limit)
            if got is None:
                return None
            if isinstance(got, LeanBody):
                if got.data is not None and limit is not None and len(got.data) > limit:
                    return S3Body(None, max(got.size, len(got.data)), got.etag)  # more than announced
                return S3Body(got.data, got.size, got.etag)
        try:
            r = self._c.get_object(Bucket=self.bucket, Key=key)
            body = r["Body"]
            size = int(r.get("ContentLength", 0))
            etag = str(r.get("ETag", ""))
            try:
                if limit is not None and size > limit:
                    return S3Body(None, size, etag)
                # Read at most limit + 1 bytes whatever Content-Length said: one more proves "too large".
                data: bytes = body.read() if limit is None else body.read(limit + 1)
                _check_complete(data, size, limit)
                if limit is not None and len(data) > limit:
                    return S3Body(None, max(size, len(data)), etag)
                return S3Body(data, size, etag)
            finally:
                body.close()
        except ClientError as e:
            if is_missing(e):
                return None
            raise self.translate(e, action, key) from None
        except BotoCoreError as e:
            raise self.translate(e, action, key) from None

    def get_range(self, key: str, start: int, length: int, *, action: str = "reading") -> Optional[bytes]:
        """Bytes ``[start, start + length)`` of ``key`` (fewer at its end); ``None`` if it does not exist.

        Never more than ``length`` bytes are read, whatever the server sends.
        """
        from botocore.exceptions import BotoCoreError, ClientError

        if length <= 0:
            return b""
        lean = self._lean_getter()
        if lean is not None:
            got = self._lean_get(lean, action, key, byte_range=(start, start + length - 1))
            if got is None:
                return None
            if isinstance(got, LeanBody) and got.data is not None:
                return got.data
        try:
            r = self._c.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")
            body = r["Body"]
            try:
                data: bytes = body.read(length)
                _check_complete(data, int(r.get("ContentLength", 0)), length - 1)
            finally:
                body.close()
            return data
        except ClientError as e:
            if is_missing(e):
                return None
            if _code_status(e)[1] == 416:  # range past the end: nothing there
                return b""
            raise self.translate(e, action, key) from None
        except BotoCoreError as e:
            raise self.translate(e, action, key) from None

    def _lean_get(self, lean: LeanGetter, action: str, key: str, *, limit: Optional[int] = None,
                  byte_range: Optional[Tuple[int, int]] = None) -> Union[LeanBody, None, object]:
        """``lean.get``, its :class:`BodyTimeout` a :class:`NetworkTimeout`."""
        try:
            return lean.get(key, limit=limit, byte_range=byte_range)
        except BodyTimeout as e:
            raise self._body_timeout(action, key, e) from None

    def _body_timeout(self, action: str, key: str, e: BodyTimeout) -> NetworkTimeout:
        # Hazard (found by a bug hunt): per-read socket timeouts never fire for a server that sends a
        # byte just before each one, so a body had no bound at all; the deadline is s3lean.body_seconds.
        return NetworkTimeout(f"{self.where} is too slow while {action} {self.s3_url(key)}: {e}; check the "
                              "server and the network (or raise read_timeout), then run again")

    def open(self, key: str, *, action: str = "reading") -> Optional[Tuple[io.RawIOBase, int]]:
        """A streaming GET of ``key``: ``(body, announced size)``, or ``None`` if it does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self._c.get_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if is_missing(e):
                return None
            raise self.translate(e, action, key) from None
        except BotoCoreError as e:
            raise self.translate(e, action, key) from None
        return _TranslatedBody(r["Body"], self, action, key), int(r.get("ContentLength", 0))

    def head(self, key: str) -> Optional[Tuple[int, str]]:
        """``(size, ETag)`` of ``key``, or ``None`` if it does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self._c.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if is_missing(e):
                return None
            raise self.translate(e, "inspecting", key) from None
        except BotoCoreError as e:
            raise self.translate(e, "inspecting", key) from None
        return int(r.get("ContentLength", 0)), str(r.get("ETag", ""))

    def delete(self, key: str, *, if_match: Optional[str] = None) -> bool:
        """DELETE ``key`` (S3 deletes are idempotent); ``False`` when ``if_match`` did not hold."""
        from botocore.exceptions import BotoCoreError, ClientError

        params: Dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if if_match is not None:
            params["IfMatch"] = if_match
        try:
            self._c.delete_object(**params)
        except ClientError as e:
            if if_match is not None and (is_precondition_failed(e) or is_missing(e) or is_conditional_conflict(e)):
                return False
            raise self.translate(e, "deleting", key) from None
        except BotoCoreError as e:
            raise self.translate(e, "deleting", key) from None
        return True

    def list_page(self, prefix: str, *, start_after: str = "") -> Tuple[List[Tuple[str, int]], bool]:
        """One ``ListObjectsV2`` page: ``([(key, size)], truncated)`` in key order."""
        params: Dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": self.list_page_size}
        if start_after:
            params["StartAfter"] = start_after
        r = self.call("listing", prefix, lambda: self._c.list_objects_v2(**params))
        return [(str(c["Key"]), int(c.get("Size", 0))) for c in r.get("Contents", ())], bool(r.get("IsTruncated"))

    def list(self, prefix: str, *, start_after: str = "", stop_after: str = "") -> Iterator[Tuple[str, int]]:
        """``(key, size)`` of every key under ``prefix`` in key order (paginated; stops past ``stop_after``)."""
        token: Optional[str] = None
        while True:
            params: Dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": self.list_page_size}
            if token:
                params["ContinuationToken"] = token
            elif start_after:
                params["StartAfter"] = start_after
            r = self.call("listing", prefix, functools.partial(self._c.list_objects_v2, **params))
            last = ""
            for c in r.get("Contents", ()):
                last = str(c["Key"])
                yield last, int(c.get("Size", 0))
            if not r.get("IsTruncated") or (stop_after and last >= stop_after):
                return
            token = r.get("NextContinuationToken")
            if not token:
                return

    def list_modified(self, prefix: str) -> Iterator[ListedKey]:
        """Every key under ``prefix`` with its size and ``LastModified`` (server time), in key order.

        Remote gc judges an object's age by this server timestamp, never by a
        client clock (clients and the server may disagree by minutes).
        """
        token: Optional[str] = None
        while True:
            params: Dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": self.list_page_size}
            if token:
                params["ContinuationToken"] = token
            r = self.call("listing", prefix, functools.partial(self._c.list_objects_v2, **params))
            for c in r.get("Contents", ()):
                lm = c.get("LastModified")
                modified = lm.timestamp() if hasattr(lm, "timestamp") else 0.0
                yield ListedKey(str(c["Key"]), int(c.get("Size", 0)), float(modified))
            if not r.get("IsTruncated"):
                return
            token = r.get("NextContinuationToken")
            if not token:
                return

    def server_time(self, prefix: str) -> float:
        """The server's clock now (POSIX seconds, from the ``Date`` header of a one-key listing of ``prefix``).

        Ages of keys are compared with this, not with ``time.time()``: a client
        whose clock runs an hour late would otherwise call every object young
        (harmless) or, an hour early, call fresh uploads old (the hazard).
        Falls back to the local clock if the server sends no usable ``Date``.
        """
        from email.utils import parsedate_to_datetime

        r = self.call("listing", prefix, functools.partial(self._c.list_objects_v2, Bucket=self.bucket,
                                                           Prefix=prefix, MaxKeys=1))
        date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            return float(parsedate_to_datetime(str(date)).timestamp())
        except (TypeError, ValueError, IndexError):
            return time.time()

    def delete_many(self, keys: Iterable[str]) -> Dict[str, str]:
        """DELETE many keys, 1,000 per ``DeleteObjects`` request; ``{key: error}`` for those that failed.

        Unconditional (S3 deletes are idempotent: a key already gone counts as
        deleted).  The caller decides what may go; this only sends it.
        """
        todo = list(keys)
        failed: Dict[str, str] = {}
        for i in range(0, len(todo), 1000):
            chunk = todo[i:i + 1000]
            req = {"Objects": [{"Key": k} for k in chunk], "Quiet": True}
            r = self.call("deleting", chunk[0], functools.partial(self._c.delete_objects, Bucket=self.bucket,
                                                                  Delete=req))
            for e in r.get("Errors", ()):
                failed[str(e.get("Key", ""))] = f"{e.get('Code', '')} {e.get('Message', '')}".strip()
        return failed

    def upload(self, key: str, stream: Readable, *, create_only: bool = True) -> bool:
        """Upload a stream in parts (multipart from ``multipart_threshold``); ``False`` if the key existed.

        Create-only: the completion carries ``If-None-Match: *`` (a botocore hook).
        """
        from botocore.exceptions import BotoCoreError, ClientError

        if not create_only:
            raise InvalidInputError("multipart uploads are create-only")
        try:
            self._c.upload_fileobj(stream, self.bucket, key, Config=self._transfer_config())
            return True
        except ClientError as e:
            if is_precondition_failed(e) or is_conditional_conflict(e):
                return False  # someone completed the same object first: identical content
            raise self.translate(e, "uploading", key) from None
        except BotoCoreError as e:
            raise self.translate(e, "uploading", key) from None

    def download(self, key: str, f: BinaryIO) -> bool:
        """Download ``key`` into a seekable binary file in parallel ranged parts; ``False`` if absent."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._c.download_fileobj(self.bucket, key, f, Config=self._transfer_config())
            return True
        except ClientError as e:
            if is_missing(e):
                return False
            raise self.translate(e, "downloading", key) from None
        except BotoCoreError as e:
            raise self.translate(e, "downloading", key) from None

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist yet (for test servers and first set-up)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._c.create_bucket(Bucket=self.bucket)
        except ClientError as e:
            code, _ = _code_status(e)
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            raise self.translate(e, "creating bucket", "") from None
        except BotoCoreError as e:
            raise self.translate(e, "creating bucket", "") from None

    def check(self, prefix: str) -> Dict[str, bool]:
        """Probe that the server honours conditional writes; raise :class:`BackendError` if not.

        Writes a scratch key under ``<prefix>tmp/``: a create-only PUT must
        succeed once and then be refused (412), a PUT with a wrong ``If-Match``
        must be refused, one with the right ETag must succeed.  The key is
        deleted afterwards.  A server that silently ignored these headers would
        let a racing push overwrite a ref.
        """
        key = f"{prefix}tmp/casstore-check-{uuid.uuid4().hex}"
        out = {"create_only": False, "compare_and_swap": False}
        try:
            etag = self.put(key, os.urandom(16), create_only=True, action="checking conditional writes on")
            if etag is None:
                raise BackendError(f"{self.where}: a create-only PUT of a new key {key} was refused")
            out["create_only"] = self.put(key, os.urandom(16), create_only=True) is None
            stale = self.put(key, os.urandom(16), if_match='"00000000000000000000000000000000"') is None
            out["compare_and_swap"] = stale and self.put(key, os.urandom(16), if_match=etag) is not None
        finally:
            try:
                self.delete(key)
            except CasstoreError:  # best effort: a leftover probe key is harmless
                pass
        missing = [k for k, ok in out.items() if not ok]
        if missing:
            names = {"create_only": "If-None-Match: * (create-only)", "compare_and_swap": "If-Match (compare-and-swap)"}
            what = " and ".join(names[k] for k in missing)
            raise BackendError(
                f"{self.where}: the server ignores {what} on PutObject, so concurrent pushes could lose "
                "versions; use a server release that supports conditional writes (see docs/remotes.md)"
            )
        return out

    def __repr__(self) -> str:
        return f"S3Connection({self.bucket!r}, endpoint_url={self.endpoint_url!r})"


class _TranslatedBody(io.RawIOBase):
    """A GET body whose read errors (timeouts, a server gone mid-body) become BackendError."""

    def __init__(self, body: Any, conn: S3Connection, action: str, key: str) -> None:
        super().__init__()
        self._body = body
        self._conn = conn
        self._action = action
        self._key = key

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        try:
            data = self._body.read(len(mv))
        except Exception as e:  # urllib3/botocore read errors
            raise self._conn.translate(e, self._action, self._key) from None
        mv[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._body.close()
            finally:
                super().close()


class _VerifyingReader(io.RawIOBase):
    """A stream of one remote object that checks size and digest when its last byte is read.

    Like the local :class:`~casstore.objects.reader.ObjectReader`: the check
    runs before the final chunk is handed out, and more bytes than announced
    is an error at once (never buffered).
    """

    def __init__(self, src: io.RawIOBase, size: int, digest: Digest, what: str, verify: bool) -> None:
        super().__init__()
        self._src = src
        self._size = size
        self._digest = digest
        self._what = what
        self._hasher = new_hasher() if verify else None
        self._seen = 0
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        want = min(len(mv), self._size - self._seen + 1)  # one byte past the end proves a lie
        n = (self._src.readinto(mv[:want]) or 0) if want else 0
        self._seen += n
        if self._seen > self._size:
            raise IntegrityError(f"{self._what} is longer than the {self._size} bytes announced; refused")
        if self._hasher is not None and not self._checked:
            self._hasher.update(mv[:n])
            if self._seen == self._size or n == 0:
                self._check()
        return n

    def _check(self) -> None:
        assert self._hasher is not None
        self._checked = True
        got = Digest(self._hasher.hexdigest())
        if got != self._digest or self._seen != self._size:
            raise IntegrityError(
                f"{self._what} is corrupt: its {self._seen} bytes hash to {got}, not {self._digest}. "
                "Delete that key and push the object again from a good copy"
            )

    def close(self) -> None:
        if not self.closed:
            try:
                self._src.close()
            finally:
                super().close()


def _parse_fan_key(base: str, key: str) -> Optional[Digest]:
    """``<base>ab/cdef...`` -> the digest (``None`` for any other key)."""
    if not key.startswith(base):
        return None
    rest = key[len(base):]
    if len(rest) != 65 or rest[2] != "/":
        return None
    try:
        return Digest(rest[:2] + rest[3:])
    except (InvalidDigestError, ValueError):
        return None


CHUNKS = "chunks"
RECIPES = "recipes"


class S3Objects(ObjectStore):
    """The objects of a remote: raw bytes under ``<prefix>objects/<2 hex>/<62 hex>`` (see the module docstring)."""

    def __init__(self, connection: S3Connection, prefix: str, *,
                 chunking: Optional[Chunking] = DEFAULT_CHUNKING) -> None:
        self.connection = connection
        """The bucket and client (shared with the remote's refs)."""
        self.prefix = prefix
        """Key prefix (``""`` or ending in ``/``)."""
        self.chunking = chunking
        """How large objects are pushed as content-defined chunks (``None``: always whole; issue 16).
        Chunked objects are read whatever this says."""
        self._bad_recipes: Set[Digest] = set()  # found damaged by present(): the next upload replaces them
        self._bad_lock = threading.Lock()

    # Capabilities: the protocol's defaults hold (no local paths; a PUT is visible
    # whole or not at all; keys can be deleted by whoever holds the permission).

    # -- keys and messages --

    def key(self, digest: Digest) -> str:
        """``<prefix>objects/ab/cdef...``: where an object lives on the remote."""
        return object_key(self.prefix, digest)

    def url(self, digest: Digest) -> str:
        """``s3://bucket/<prefix>objects/ab/cdef...`` for messages and other S3 tools."""
        return self.connection.s3_url(self.key(digest))

    def missing_error(self, digest: Digest) -> ObjectNotFoundError:
        """The error for an object this remote lacks."""
        return ObjectNotFoundError(
            f"{self.connection.where} has no object {digest} (key {self.url(digest)}); the remote is "
            "incomplete -- push it again from a machine that has it"
        )

    def corrupt_error(self, digest: Digest, got: Digest, n: int) -> IntegrityError:
        """The error for remote bytes that do not hash to their key."""
        return IntegrityError(
            f"{self.connection.where}: object {self.url(digest)} is corrupt: its {n} bytes hash to {got}, "
            f"not {digest}; it was not stored. Delete that key and push the object again from a good copy"
        )

    # -- primitives --

    def has(self, digest: Digest) -> bool:
        """Is the object there, whole or as a recipe?  (``HeadObject``s; use :meth:`present` for many.)"""
        if self.connection.head(self.key(digest)) is not None:
            return True
        return self.connection.head(self.recipe_key(digest)) is not None

    def stat(self, digest: Digest) -> ObjectInfo:
        """Size of a remote object (always stored raw); :class:`ObjectNotFoundError` if absent."""
        got = self.connection.head(self.key(digest))
        if got is None:
            recipe = self.read_recipe(digest)
            if recipe is None:
                raise self.missing_error(digest)
            return ObjectInfo(digest, recipe.size, recipe.size, "chunked")
        return ObjectInfo(digest, got[0], got[0], RAW.name)

    def open(self, digest: Digest, *, verify: bool = True) -> BinaryIO:
        """A streaming read; the digest (and size) is checked when the last byte is read."""
        key = self.key(digest)
        got = self.connection.open(key, action="downloading object")
        if got is None:
            raise self.missing_error(digest)
        body, size = got
        raw = _VerifyingReader(body, size, digest, f"{self.connection.where}: object {self.url(digest)}", verify)
        return io.BufferedReader(raw, buffer_size=1 << 20)

    def read(self, digest: Digest, *, verify: bool = True) -> bytes:
        """The object's bytes, hashed before they are returned unless ``verify=False``."""
        data = self.read_at_most(digest, None, verify=verify, chunked=True)
        assert data is not None
        return data

    def read_at_most(self, digest: Digest, limit: Optional[int], *, verify: bool = True,
                     chunked: bool = False) -> Optional[bytes]:
        """The object's bytes if it holds at most ``limit`` bytes, else ``None`` (no more than that is read).

        :class:`ObjectNotFoundError` if absent; :class:`IntegrityError` if the
        bytes do not hash to ``digest`` (unless ``verify=False``).  ``chunked``:
        an object stored as chunks is reassembled in memory too (each chunk and
        the whole verified); otherwise only a whole object counts (a pull
        reassembles chunked ones itself, reusing local chunks).
        """
        got = self.connection.get(self.key(digest), limit=limit, action="downloading object")
        if got is None:
            recipe = self.read_recipe(digest) if chunked else None
            if recipe is None:
                raise self.missing_error(digest)
            if limit is not None and recipe.size > limit:
                return None
            data = b"".join(self.read_chunk(c) for c in recipe.chunks)
            h = hash_bytes(data)
            if h != digest:
                raise self.corrupt_error(digest, h, len(data))
            return data
        if got.data is None:
            return None
        if verify:
            h = hash_bytes(got.data)
            if h != digest:
                raise self.corrupt_error(digest, h, len(got.data))
        return got.data

    def read_range(self, digest: Digest, start: int, length: int) -> bytes:
        """Up to ``length`` bytes of the object from ``start`` (unverified: the caller hashes them).

        Of a chunked object, the chunks covering the range are fetched whole and each is verified.
        """
        got = self.connection.get_range(self.key(digest), start, length, action="reading a range of object")
        if got is not None:
            return got
        recipe = self.read_recipe(digest)
        if recipe is None:
            raise self.missing_error(digest)
        end = min(start + length, recipe.size)
        out = bytearray()
        for c in recipe.chunks:
            if c.offset + c.length <= start or c.offset >= end:
                continue
            data = self.read_chunk(c)
            out += data[max(0, start - c.offset):end - c.offset]
        return bytes(out)

    # -- chunked objects (issue 16; casstore/objects/chunking.py) --

    def chunk_key(self, chunk: Digest) -> str:
        """``<prefix>chunks/ab/cdef...``: where a chunk lives."""
        return f"{self.prefix}{CHUNKS}/{chunk.hex[:2]}/{chunk.hex[2:]}"

    def recipe_key(self, digest: Digest) -> str:
        """``<prefix>recipes/ab/cdef...``: where the recipe of a chunked object lives."""
        return f"{self.prefix}{RECIPES}/{digest.hex[:2]}/{digest.hex[2:]}"

    def read_recipe(self, digest: Digest) -> Optional[Recipe]:
        """The recipe of ``digest`` if it is stored chunked (checked: :func:`decode_recipe`), else ``None``."""
        key = self.recipe_key(digest)
        got = self.connection.get(key, limit=MAX_RECIPE_BYTES, action="reading recipe")
        if got is None:
            return None
        if got.data is None:
            raise StoreFormatError(f"{self.connection.s3_url(key)}: the recipe of object {digest} is larger than "
                                   f"{MAX_RECIPE_BYTES} bytes; refused, nothing was stored")
        return decode_recipe(got.data, digest, self.connection.s3_url(key))

    def recipe_fits(self, digest: Digest, size: Optional[int]) -> bool:
        """Whether the recipe of ``digest`` is there, decodes (:func:`decode_recipe`) and, with ``size``,
        describes an object of exactly ``size`` bytes (one bounded GET).  A recipe that is there but
        does not is remembered: the next upload of ``digest`` replaces it (:meth:`upload_chunked`)."""
        try:
            recipe = self.read_recipe(digest)
        except StoreFormatError as e:
            log.warning("%s", e)
            recipe = None
            ok, there = False, True
        else:
            there = recipe is not None
            ok = recipe is not None and (size is None or recipe.size == size)
        if there and not ok:
            with self._bad_lock:
                self._bad_recipes.add(digest)
        return ok

    def read_chunk(self, c: ChunkRef, *, verify: bool = True) -> bytes:
        """One chunk's bytes (exactly its length), verified against its name unless ``verify=False``
        (:class:`IntegrityError`: nothing to keep).

        ``verify=False`` is for callers that hash the whole object they reassemble
        and name a bad chunk with :meth:`bad_chunk_error` when it does not match.
        """
        key = self.chunk_key(c.digest)
        got = self.connection.get(key, limit=c.length, action="downloading chunk")
        if got is None:
            raise ObjectNotFoundError(f"{self.connection.where} has no chunk {c.digest} (key "
                                      f"{self.connection.s3_url(key)}); push the object again")
        if got.data is None or len(got.data) != c.length or (
                verify and hash_bytes(got.data, threaded=False) != c.digest):
            raise self.bad_chunk_error(c)
        return got.data

    def bad_chunk_error(self, c: ChunkRef) -> IntegrityError:
        """The error for a chunk whose bytes are not the ones its name says."""
        return IntegrityError(f"{self.connection.where}: chunk {self.connection.s3_url(self.chunk_key(c.digest))} "
                              f"is corrupt (not the {c.length} bytes named {c.digest}); nothing was stored. Delete "
                              "it and push the object again from a good copy")

    def upload_chunked(self, recipe: Recipe, read_at: Callable[[int, int], bytes], *,
                       executor: Optional[Executor] = None) -> int:
        """Upload the chunks of ``recipe`` the remote lacks, then the recipe.

        ``read_at(offset, length)`` returns the object's bytes there (fewer at a file that
        shrank).  Each chunk read is hashed again before it is sent (:class:`IntegrityError`
        if it no longer matches, and the recipe is not written).  Create-only throughout; the
        recipe goes last, so a recipe never names a missing chunk.  Returns the chunk bytes uploaded.
        """
        lengths = {c.digest: c.length for c in recipe.chunks}
        have = self.listed(CHUNKS, lengths, executor=executor, size_ok=lambda d, n: lengths.get(d, n) == n)
        todo: Dict[Digest, ChunkRef] = {}
        for c in recipe.chunks:
            if c.digest not in have:
                todo.setdefault(c.digest, c)

        def send(c: ChunkRef) -> int:
            # The bytes sent are hashed again: the local file may have been rewritten since the
            # recipe was cut, and a chunk key, create-only, would keep other bytes for good.
            body = read_at(c.offset, c.length)
            if len(body) != c.length or hash_bytes(body, threaded=False) != c.digest:
                raise IntegrityError(f"chunk {c.digest} of object {recipe.digest} changed after it was cut "
                                     "(its local file was rewritten meanwhile); nothing more was sent")
            self.put_content(self.chunk_key(c.digest), body, action="uploading chunk")
            return c.length

        items = list(todo.values())
        sent = sum(executor.map(send, items)) if executor is not None and len(items) > 1 else sum(map(send, items))
        key, body = self.recipe_key(recipe.digest), recipe.encode()
        with self._bad_lock:
            damaged = recipe.digest in self._bad_recipes
            self._bad_recipes.discard(recipe.digest)
        if damaged:  # read and found undecodable or of another object size (present): ours replaces it
            log.warning("%s: recipe %s does not decode or describes another size (a PUT cut off on a server that "
                        "kept what it got?); replacing it", self.connection.where, self.connection.s3_url(key))
            self.connection.put(key, body, action="replacing a damaged recipe")
        else:
            self.put_content(key, body, action="uploading recipe")
        return sent

    def put_content(self, key: str, body: bytes, *, action: str) -> bool:
        """PUT a content-addressed ``body`` create-only; ``False`` if the key held it already.

        A key already there with another size is a damaged copy (a PUT cut off
        on a server that keeps what it got; see :meth:`listed`): as the key
        names the content, replacing it with ``body`` is safe, and it is.
        """
        if self.connection.put(key, body, create_only=True, action=action) is not None:
            return True
        there = self.connection.head(key)
        if there is not None and there[0] == len(body):
            return False
        log.warning("%s: %s held %s bytes, not the %d its name says (a PUT cut off on a server that kept "
                    "what it got?); replacing it", self.connection.where, self.connection.s3_url(key),
                    "no" if there is None else there[0], len(body))
        self.connection.put(key, body, action=action)
        return True

    def write(self, digest: Digest, data: Buffer) -> bool:
        """Upload an object create-only; ``False`` if it was there already (412: same content).

        Bytes that do not hash to ``digest`` raise :class:`IntegrityError` and nothing is sent.
        """
        body = bytes(data)
        got = hash_bytes(body)
        if got != digest:
            raise IntegrityError(f"refusing to store bytes hashing to {got} as object {digest} on "
                                 f"{self.connection.where}")
        return self.put_content(self.key(digest), body, action="uploading object")

    def upload(self, digest: Digest, stream: Readable) -> bool:
        """Upload a large object from a stream, create-only, in parts; ``False`` if it was there.

        The stream is not hashed here: pass a verifying one (a local
        ``objects.open(d)`` raises before its last part is read if the bytes
        are wrong, and the upload is then never completed).
        """
        return self.connection.upload(self.key(digest), stream)

    def download_to(self, digest: Digest, f: BinaryIO) -> None:
        """Download an object into a seekable file in parallel ranged parts (unverified: hash the file).

        :class:`ObjectNotFoundError` if absent.
        """
        if not self.connection.download(self.key(digest), f):
            raise self.missing_error(digest)

    def delete(self, digest: Digest) -> bool:
        """Remove the object (whole, or its recipe: its chunks are left to remote gc); ``False`` if absent."""
        for key in (self.key(digest), self.recipe_key(digest)):
            if self.connection.head(key) is not None:
                return self.connection.delete(key)
        return False

    def iter_info(self) -> Iterator[ObjectInfo]:
        """Every object on the remote, in digest order, from the listing (keys that are not objects skipped)."""
        for key, size in self.connection.list(f"{self.prefix}{OBJECTS}/"):
            d = parse_object_key(self.prefix, key)
            if d is not None:
                yield ObjectInfo(d, size, size, RAW.name)

    def iter_listed(self) -> Iterator[ListedObject]:
        """Every object with its size and ``LastModified``, in digest order (keys that are not objects skipped)."""
        for k in self.connection.list_modified(f"{self.prefix}{OBJECTS}/"):
            d = parse_object_key(self.prefix, k.key)
            if d is not None:
                yield ListedObject(d, k.size, k.modified)

    def iter_listed_under(self, kind: str) -> Iterator[ListedObject]:
        """Every key under ``<prefix><kind>/`` (``objects``, ``recipes``, ``chunks``) as a digest with its size
        and ``LastModified``, in digest order (keys of any other shape skipped)."""
        base = f"{self.prefix}{kind}/"
        for k in self.connection.list_modified(base):
            d = _parse_fan_key(base, k.key)
            if d is not None:
                yield ListedObject(d, k.size, k.modified)

    def delete_many(self, digests: Iterable[Digest]) -> Dict[Digest, str]:
        """Delete many objects in batched requests; ``{digest: error}`` for those that failed.

        Only for remote gc, which decides what is garbage and guards against
        concurrent pushes (docs/remotes.md, "Remote gc").
        """
        by_key = {self.key(d): d for d in digests}
        return {by_key[k]: err for k, err in self.connection.delete_many(by_key).items() if k in by_key}

    def iter_digests(self) -> Iterator[Digest]:
        """Every object's digest, in digest order."""
        for info in self.iter_info():
            yield info.digest

    def has_many(self, digests: Iterable[Digest]) -> Set[Digest]:
        """Which of ``digests`` are there (by listing: see :meth:`present`)."""
        return self.present(digests)

    def present(self, digests: Iterable[Digest], *, executor: Optional[Executor] = None,
                sizes: Optional[Mapping[Digest, int]] = None,
                recipes_known: Optional[Callable[[Set[Digest]], Mapping[Digest, int]]] = None) -> Set[Digest]:
        """Which of ``digests`` the remote has, whole or as a recipe of chunks, by listing (never one
        request per object).  See :meth:`listed`; with ``sizes``, a whole object of another size, or an
        empty recipe, does not count (a damaged copy that a push must replace).

        ``recipes_known`` (with ``sizes``): given the digests listed as recipes, digest -> the encoded
        length of a recipe known good (the local chunk index's; ``{}``: none).  A listed recipe of
        any other length is read (:meth:`recipe_fits`: one GET each) and counts only if it decodes to
        an object of the size ``sizes`` records; one that does not is replaced by the next upload.
        Hazard (found by a bug hunt): a recipe cut off mid-PUT (a server keeping what it got) counted as
        present, so no push ever repaired it and every pull failed; reading every recipe would cost a
        GET per object.
        """
        want = set(digests)
        found = self.listed(OBJECTS, want, executor=executor,
                            size_ok=None if sizes is None else lambda d, n: sizes.get(d, n) == n)
        rest = want - found
        if rest:  # reading chunked objects needs no chunker: every client finds and reads them
            listed: Dict[Digest, int] = {}

            def recipe_ok(d: Digest, n: int) -> bool:
                listed[d] = n
                return n > 0

            recipes = self.listed(RECIPES, rest, executor=executor, size_ok=None if sizes is None else recipe_ok)
            if sizes is not None and recipes_known is not None:
                known = recipes_known(recipes) if recipes else {}
                doubt = [d for d in recipes if known.get(d) != listed.get(d)]
                if doubt:
                    fits = (executor.map if executor is not None else map)(
                        lambda d: self.recipe_fits(d, sizes.get(d)), doubt)
                    recipes -= {d for d, ok in zip(doubt, fits, strict=True) if not ok}
            found |= recipes
        return found

    def listed(self, kind: str, digests: Iterable[Digest], *, executor: Optional[Executor] = None,
               size_ok: Optional[Callable[[Digest, int], bool]] = None) -> Set[Digest]:
        """Which of ``digests`` have a key under ``<prefix><kind>/`` (``objects``, ``chunks``, ``recipes``).

        ``size_ok(digest, listed size)``: a key it rejects does not count (a
        damaged copy: some servers keep an empty or cut-off object when a client
        dies mid-PUT -- SeaweedFS was seen keeping 0 bytes).  The write that
        replaces it is :meth:`put_content`.

        One ``ListObjectsV2`` page over all of ``objects/`` first: on a small
        remote that is the whole answer.  Otherwise the fan-out prefixes that
        page did not cover are listed (in parallel on ``executor``), one round
        trip each (more only for prefixes holding over a page of keys between
        the smallest and largest digest asked for).
        """
        want: Dict[str, Set[str]] = {}
        for d in digests:
            want.setdefault(d.hex[:2], set()).add(d.hex[2:])
        if not want:
            return set()
        conn = self.connection
        base = f"{self.prefix}{kind}/"

        def parse(key: str) -> Optional[Digest]:
            return _parse_fan_key(base, key)

        def fits(d: Digest, size: int) -> bool:
            return size_ok is None or size_ok(d, size)

        found: Set[Digest] = set()
        first_fan = min(want)
        page, truncated = conn.list_page(base, start_after=f"{base}{first_fan}/{min(want[first_fan])[:-1]}")
        last = ""
        for key, size in page:
            last = key
            got_d = parse(key)
            if got_d is not None and fits(got_d, size):
                found.add(got_d)
        top_fan = max(want)
        if truncated and last < f"{base}{top_fan}/{max(want[top_fan])}":
            last_fan = last[len(base):len(base) + 2]
            todo = sorted(f for f in want if f > last_fan or (f == last_fan and f"{base}{f}/{max(want[f])}" > last))

            def list_fan(fan: str) -> Set[Digest]:
                lo, hi = min(want[fan]), max(want[fan])
                start = f"{base}{fan}/{lo[:-1]}"
                if fan == last_fan:
                    start = max(start, last)
                got: Set[Digest] = set()
                for key, size in conn.list(f"{base}{fan}/", start_after=start, stop_after=f"{base}{fan}/{hi}"):
                    d = parse(key)
                    if d is not None and fits(d, size):
                        got.add(d)
                return got

            if executor is not None and len(todo) > 1:
                for got in executor.map(list_fan, todo):
                    found |= got
            else:
                for fan in todo:
                    found |= list_fan(fan)
        return {d for d in found if d.hex[2:] in want.get(d.hex[:2], ())}

    def __repr__(self) -> str:
        return f"S3Objects('s3://{self.connection.bucket}/{self.prefix}')"
