"""Remotes: ``s3://bucket/prefix`` on an S3-compatible object store, and a store's ``remotes.toml``.

A :class:`Remote` is a bundle of the two layers a remote consists of, over
one :class:`~casstore.objects.s3.S3Connection` (one client, one request
count):

* ``remote.objects`` -- :class:`~casstore.objects.s3.S3Objects`: raw objects
  under ``<prefix>objects/<2 hex>/<62 hex>``, uploaded create-only;
* ``remote.refs`` -- :class:`~casstore.refs.s3.S3Refs`: ``<prefix>refs/heads/<name>``
  and ``<prefix>refs/pins/<name>``, moved by compare-and-swap.

The layout mirrors a local store, so any S3 tool can list and audit it
(docs/remotes.md).  The remote settings of a store live in
``<root>/remotes.toml`` (written atomically under ``locks/remotes.lock``);
credentials are never stored there.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Tuple, Union

from .._fs import write_file_atomic
from .._layout import LOCKS, REMOTES_FILE, TMP
from .._lock import FileLock
from ..errors import InvalidInputError, InvalidTypeError, ObjectNotFoundError, StoreFormatError
from ..objects.chunking import DEFAULT_CHUNKING, Chunking
from ..objects.s3 import DEFAULT_WORKERS, MiB, S3Connection, S3Objects
from ..refs.s3 import S3Refs

if TYPE_CHECKING:
    import boto3.session

    from ..store import Store

__all__ = ["Remote", "parse_url", "resolve_remote", "load_remotes", "add_remote", "remove_remote", "get_remote",
           "REMOTES_FILE", "load_upstream", "set_upstream"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
_SETTINGS = ("url", "endpoint_url", "region", "profile")


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


class Remote:
    """A casstore remote: ``s3://bucket/prefix`` on an S3-compatible object store.

    ``endpoint_url``: the server for non-AWS stores (MinIO, SeaweedFS, Ceph:
    ``"http://host:8333"``); path-style addressing is used with it.  Credentials
    come the usual AWS ways (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
    ``AWS_PROFILE``, ``~/.aws/credentials``, instance roles), or from
    ``profile`` (or a boto3 ``session``); they are never stored by casstore.
    ``workers``: parallel transfers (network I/O, so more than the CPU count).
    Objects of at least ``multipart_threshold`` bytes go up and down in
    ``multipart_chunksize`` parts.  ``max_attempts``, ``connect_timeout`` and
    ``read_timeout`` bound how long an unreachable server can hold a call
    (botocore's standard retry mode with back-off).  ``progress``: show
    progress bars (``None``: only when stderr is a terminal).  ``chunking``:
    objects at least ``chunking.min_object`` bytes (4 MiB) are pushed as
    content-defined chunks plus a recipe, so a changed file moves only what
    changed (:class:`casstore.objects.chunking.Chunking`; ``None``: whole
    objects only, as before issue 16).

    ``remote.objects`` and ``remote.refs`` are its object and refs layers.
    """

    def __init__(self, url: str, *, endpoint_url: Optional[str] = None, region: Optional[str] = None,
                 profile: Optional[str] = None, name: Optional[str] = None, workers: int = DEFAULT_WORKERS,
                 multipart_threshold: int = 64 * MiB, multipart_chunksize: int = 16 * MiB,
                 max_attempts: int = 3, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 progress: Optional[bool] = None, session: Optional[boto3.session.Session] = None,
                 chunking: Optional[Chunking] = DEFAULT_CHUNKING) -> None:
        self.url = url
        """``s3://bucket/prefix`` as given."""
        self.bucket, self.prefix = parse_url(url)
        self.endpoint_url = endpoint_url or None
        """The server (``None``: AWS)."""
        self.region = region or None
        self.profile = profile or None
        self.name = name
        """The name in ``remotes.toml`` (``None`` for a remote made from a URL)."""
        self.progress = progress
        """Show progress bars (``None``: only when stderr is a terminal)."""
        self.connection = S3Connection(
            self.bucket, where=self.describe(), endpoint_url=self.endpoint_url, region=self.region,
            profile=self.profile, workers=workers, multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize, max_attempts=max_attempts, connect_timeout=connect_timeout,
            read_timeout=read_timeout, session=session)
        """The bucket and client, shared by :attr:`objects` and :attr:`refs`."""
        self.objects = S3Objects(self.connection, self.prefix, chunking=chunking)
        """The remote's objects."""
        self.refs = S3Refs(self.connection, self.prefix)
        """The remote's heads and pins."""

    @property
    def workers(self) -> int:
        """Parallel transfers."""
        return self.connection.workers

    @property
    def requests(self) -> Counter[str]:
        """HTTP requests sent so far, by S3 operation name (``"PutObject"``, ``"ListObjectsV2"`` ...)."""
        return self.connection.requests

    @property
    def list_page_size(self) -> int:
        """Keys per listing page (1000, S3's maximum; smaller only to exercise pagination in tests)."""
        return self.connection.list_page_size

    @list_page_size.setter
    def list_page_size(self, n: int) -> None:
        self.connection.list_page_size = n

    def describe(self) -> str:
        """``remote 'origin' (s3://bucket/prefix at http://host:8333)`` for messages."""
        where = self.url + (f" at {self.endpoint_url}" if self.endpoint_url else "")
        return f"remote {self.name!r} ({where})" if self.name else f"remote {where}"

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist yet (for test servers and first set-up)."""
        self.connection.create_bucket()

    def check(self) -> Dict[str, bool]:
        """Probe that the server honours the conditional writes casstore relies on; raise if not.

        Run once when setting a remote up (``casstore remote check NAME``):
        a server that silently ignores ``If-None-Match``/``If-Match`` would let
        a racing push overwrite a ref.  See :meth:`S3Connection.check`.
        """
        return self.connection.check(self.prefix)

    def __repr__(self) -> str:
        extra = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"Remote({self.url!r}{extra})"


# -- configuration: <root>/remotes.toml ----------------------------------------


def _remotes_path(store: Store) -> Path:
    return store.root / REMOTES_FILE


def _load_doc(store: Store) -> Dict[str, object]:
    p = _remotes_path(store)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise StoreFormatError(f"{p} is not valid TOML ({e}); fix or remove it") from None


def _remotes_of(doc: Dict[str, object], p: Path) -> Dict[str, Dict[str, str]]:
    remotes = doc.get("remotes", {})
    if not isinstance(remotes, dict):
        raise StoreFormatError(f"{p}: [remotes] must be a table")
    out: Dict[str, Dict[str, str]] = {}
    for name, cfg in remotes.items():
        if not isinstance(cfg, dict) or not isinstance(cfg.get("url"), str):
            raise StoreFormatError(f"{p}: remote {name!r} has no url")
        for k in _SETTINGS:
            if k in cfg and not isinstance(cfg[k], str):
                raise StoreFormatError(f"{p}: remote {name!r}: {k} = {cfg[k]!r} must be a string")
        out[name] = {k: cfg[k] for k in _SETTINGS if k in cfg}
    return out


def _upstream_of(doc: Dict[str, object], remotes: Dict[str, Dict[str, str]], p: Path) -> Optional[str]:
    up = doc.get("upstream")
    if up is None:
        return None
    if not isinstance(up, str) or up not in remotes:
        raise StoreFormatError(f"{p}: upstream = {up!r} names no remote of this file; fix or remove that line")
    return up


def load_remotes(store: Store) -> Dict[str, Dict[str, str]]:
    """The remotes configured for ``store``: name -> settings (``url``, ``endpoint_url`` ...)."""
    return _remotes_of(_load_doc(store), _remotes_path(store))


def load_upstream(store: Store) -> Optional[str]:
    """The remote the store reads through (``upstream = "NAME"`` in ``remotes.toml``), or ``None``."""
    doc = _load_doc(store)
    p = _remotes_path(store)
    return _upstream_of(doc, _remotes_of(doc, p), p)


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=True)  # JSON's \\u escapes are valid in a TOML basic string


def _write_remotes(store: Store, remotes: Dict[str, Dict[str, str]], upstream: Optional[str]) -> None:
    lines = ["# casstore remotes of this store (see docs/format.md); credentials are never stored here"]
    if upstream is not None and upstream in remotes:
        lines.append(f"upstream = {_toml_str(upstream)}  # missing objects are fetched from it on first read")
    for name in sorted(remotes):
        lines.append("")
        lines.append(f"[remotes.{_toml_str(name)}]")
        for k in _SETTINGS:
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
        _write_remotes(store, remotes, load_upstream(store))
    return get_remote(store, name)


def remove_remote(store: Store, name: str) -> None:
    """Forget remote ``name`` (nothing on the remote is touched)."""
    with _config_lock(store):
        remotes = load_remotes(store)
        if name not in remotes:
            raise ObjectNotFoundError(f"no remote named {name!r} in {_remotes_path(store)}")
        del remotes[name]
        up = load_upstream(store)
        _write_remotes(store, remotes, None if up == name else up)


def set_upstream(store: Store, name: Optional[str]) -> None:
    """Make remote ``name`` the store's upstream (read-through), or none with ``None``."""
    with _config_lock(store):
        remotes = load_remotes(store)
        if name is not None and name not in remotes:
            known = ", ".join(sorted(remotes)) or "none"
            raise ObjectNotFoundError(f"no remote named {name!r} to read through (configured: {known}); "
                                      f"add it first: `casstore remote add {name} s3://bucket/prefix`")
        _write_remotes(store, remotes, name)


def get_remote(store: Store, name: str, *, workers: int = DEFAULT_WORKERS,
               progress: Optional[bool] = None) -> Remote:
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
                  profile=cfg.get("profile"), name=name, workers=workers, progress=progress)


def resolve_remote(store: Store, remote: Union[Remote, str]) -> Remote:
    """``remote`` itself, a :class:`Remote` for an ``s3://`` URL, or the one configured under that name."""
    if isinstance(remote, Remote):
        return remote
    if isinstance(remote, str):
        return Remote(remote) if remote.startswith("s3://") else get_remote(store, remote)
    raise InvalidTypeError(f"a remote is a casstore.Remote or a configured name, not {type(remote).__name__}")
