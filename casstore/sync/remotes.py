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

import ipaddress
import json
import math
import re
import tomllib
import urllib.parse
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
           "REMOTES_FILE", "load_upstream", "set_upstream", "check_endpoint_url", "check_region", "check_profile",
           "check_remote_name"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# S3's bucket naming rules (the general-purpose bucket rules of AWS, which MinIO and SeaweedFS
# follow): 3-63 characters; lowercase letters, digits, '.' and '-'; a letter or digit first and last.
# Checked at `remote add` so a typo fails there with what a valid name looks like, not later at the
# server with an opaque 400 (bug hunt: 'ab' and 'Hunt_bucket' were accepted).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_RULES = ("3-63 characters: lowercase letters, digits, '.' and '-', starting and ending with a letter "
                 "or digit, e.g. 'team-bucket'")
# C0 and C1 control characters, DEL and lone surrogates (docs/security.md, class 7): a newline in a
# URL broke the one-line error rule of every message naming the remote, an ESC could rewrite the
# terminal, a lone surrogate cannot even be encoded into a request.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# A DNS host name as botocore accepts it (botocore.utils.is_valid_endpoint_url): dot-separated
# labels of letters, digits and '-' (not first or last), an optional final dot.
_HOST_RE = re.compile(r"^((?!-)[A-Za-z0-9-]{1,63}(?<!-)\.)*((?!-)[A-Za-z0-9-]{1,63}(?<!-))\.?$")
# botocore's own region rule (botocore.utils.validate_region_name): the region goes into the endpoint
# host and the signature scope, so anything else fails later with a raw botocore error.
_REGION_RE = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")
_USERINFO_RE = re.compile(r"^([^:/?#]*:)?//[^/?#]*@")
_ENDPOINT_FORM = "http(s)://host[:port][/path], e.g. 'http://storage.lab:8333'"
_SETTINGS = ("url", "endpoint_url", "region", "profile")


def _shown_endpoint(url: str) -> str:
    """``url`` for a message: ``user:pass@`` replaced by ``***@`` (never echo a secret, docs/security.md)."""
    return _USERINFO_RE.sub(lambda m: f"{m.group(1) or ''}//***@", url, count=1)


def check_endpoint_url(value: object) -> Optional[str]:
    """``value`` if it is a valid ``endpoint_url`` (``None`` for ``None`` or ``""``: AWS), else a typed error.

    Valid: ``http(s)://host[:port][/path]`` with a DNS name, an IPv4 address or a bracketed IPv6
    address, no ``user:password@`` (credentials never go in remote settings: they would be stored
    in ``remotes.toml`` and printed in every message naming the remote), no query or fragment.
    :class:`InvalidTypeError` for a non-str, :class:`InvalidInputError` otherwise; a message
    never shows the credentials of the value.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidTypeError(f"endpoint_url must be a str like {_ENDPOINT_FORM} (or None for AWS), "
                               f"not {type(value).__name__}")
    if value == "":
        return None
    shown = _shown_endpoint(value)
    bad = f"invalid endpoint_url {shown!r}"
    if _CONTROL.search(value) or any(c.isspace() for c in value):
        raise InvalidInputError(f"{bad}: it contains whitespace or control characters; use {_ENDPOINT_FORM}")
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port  # raises ValueError for a non-numeric or out-of-range port
        host = parts.hostname
    except ValueError as e:  # a bad IPv6 literal, a bad port
        raise InvalidInputError(f"{bad}: {e}; use {_ENDPOINT_FORM}") from None
    if port == 0:  # urlsplit accepts 0-65535; no server listens on port 0 (bug hunt: it was stored)
        raise InvalidInputError(f"{bad}: port 0 is not a port a server listens on (1-65535); use {_ENDPOINT_FORM}")
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidInputError(f"{bad}: it must start with http:// or https://; use {_ENDPOINT_FORM}")
    if "@" in parts.netloc:
        raise InvalidInputError(
            f"{bad}: it holds credentials (user:password@), which casstore never stores or sends this way; "
            "give them through AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the remote's profile "
            f"(--profile; see docs/remotes.md, 'Set-up'), and the endpoint as {_ENDPOINT_FORM}"
        )
    if not host:
        raise InvalidInputError(f"{bad}: it names no host; use {_ENDPOINT_FORM}")
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        raise InvalidInputError(f"{bad}: an endpoint has no query or fragment; use {_ENDPOINT_FORM}")
    if "[" in parts.netloc:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidInputError(f"{bad}: {host!r} is not an IPv6 address; use {_ENDPOINT_FORM}") from None
    elif not _HOST_RE.fullmatch(host):
        raise InvalidInputError(f"{bad}: {host!r} is not a valid host name; use {_ENDPOINT_FORM}")
    return value


def check_region(value: object) -> Optional[str]:
    """``value`` if it is a valid AWS region name like ``"eu-west-1"`` (``None``/``""``: the default), else raise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidTypeError(f"region must be a str like 'eu-west-1' (or None), not {type(value).__name__}")
    if value and not _REGION_RE.fullmatch(value):
        raise InvalidInputError(f"invalid region {value!r}: use letters, digits and '-' (up to 63), "
                                "like 'eu-west-1' or 'us-east-1'")
    return value or None


def check_profile(value: object) -> Optional[str]:
    """``value`` if it is a usable AWS profile name (``None``/``""``: none), else raise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidTypeError(f"profile must be the str name of an AWS profile (or None), not {type(value).__name__}")
    # A profile name goes into remotes.toml and into messages: one line, printable (docs/security.md, class 7).
    if _CONTROL.search(value) or len(value) > 256 or (value and value.strip() != value):
        raise InvalidInputError(f"invalid profile {value[:80]!r}: use the name of a profile in ~/.aws/config "
                                "or ~/.aws/credentials, like 'lab' (printable, no surrounding spaces)")
    return value or None


def _check_int(value: object, what: str, minimum: int) -> int:
    # bool is an int to Python; workers=True is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise InvalidInputError(f"{what} must be at least {minimum}, not {value}")
    return value


def _check_seconds(value: object, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be a number of seconds (int or float), not {type(value).__name__}")
    # botocore passes it to the socket: 0 would mean non-blocking, a negative one or NaN raises a raw ValueError.
    if not math.isfinite(value) or value <= 0:
        raise InvalidInputError(f"{what} must be a positive, finite number of seconds, like 5.0, not {value!r}")
    return float(value)


def parse_url(url: str) -> Tuple[str, str]:
    """``"s3://bucket/some/prefix"`` -> ``("bucket", "some/prefix/")`` (prefix ``""`` for the bucket root).

    :class:`InvalidTypeError` for a non-str; :class:`InvalidInputError` (one line: the URL is shown
    escaped) for another scheme, a control character anywhere, a bucket name outside S3's rules,
    or a ``.``/``..`` prefix segment.
    """
    if not isinstance(url, str):
        raise InvalidTypeError(f"a remote URL is a str like 's3://bucket/prefix', not {type(url).__name__}")
    if not url.startswith("s3://"):
        raise InvalidInputError(f"remote URL {url!r} must start with 's3://' (s3://bucket/prefix)")
    m = _CONTROL.search(url)
    if m is not None:
        raise InvalidInputError(f"remote URL {url!r} contains the control character U+{ord(m.group()):04X}; "
                                "use a URL like 's3://bucket/prefix' without it")
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket or _is_ipv4(bucket):
        raise InvalidInputError(f"remote URL {url!r}: {bucket!r} is not a valid S3 bucket name ({_BUCKET_RULES})")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise InvalidInputError(f"remote URL {url!r}: the prefix may not contain '.' or '..' segments")
    return bucket, "".join(p + "/" for p in parts)


def _is_ipv4(name: str) -> bool:
    """S3 refuses bucket names formatted as an IP address (``192.168.5.4``)."""
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return True


def check_remote_name(name: object) -> str:
    """``name`` if it is a valid remote name (``origin``, ``lab-2``), else a typed error."""
    if not isinstance(name, str):
        raise InvalidTypeError(f"a remote name must be a str like 'origin', not {type(name).__name__}")
    if not _NAME_RE.fullmatch(name):
        raise InvalidInputError(
            f"invalid remote name {name!r}: use letters, digits, '.', '_' and '-' (up to 64), e.g. 'origin'"
        )
    return name


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

    Every argument is checked here (docs/remotes.md, "What a remote's settings may be"):
    :class:`~casstore.errors.InvalidTypeError` for a wrong type,
    :class:`~casstore.errors.InvalidInputError` for a wrong value (a bucket name outside S3's
    rules, a control character in the URL, an ``endpoint_url`` that is not
    ``http(s)://host[:port][/path]`` or holds credentials, a non-positive timeout ...), each
    naming the argument; nothing is sent to the server.
    """

    def __init__(self, url: str, *, endpoint_url: Optional[str] = None, region: Optional[str] = None,
                 profile: Optional[str] = None, name: Optional[str] = None, workers: int = DEFAULT_WORKERS,
                 multipart_threshold: int = 64 * MiB, multipart_chunksize: int = 16 * MiB,
                 max_attempts: int = 3, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 progress: Optional[bool] = None, session: Optional[boto3.session.Session] = None,
                 chunking: Optional[Chunking] = DEFAULT_CHUNKING) -> None:
        # Every argument is checked here, where it enters (docs/security.md, class 11): a bad value
        # used to surface at the first request as a raw ValueError/TypeError from botocore
        # ("Invalid endpoint: ..."), and credentials in endpoint_url were printed by describe().
        self.bucket, self.prefix = parse_url(url)
        self.url = url
        """``s3://bucket/prefix`` as given."""
        self.endpoint_url = check_endpoint_url(endpoint_url)
        """The server (``None``: AWS)."""
        self.region = check_region(region)
        self.profile = check_profile(profile)
        if name is not None:
            check_remote_name(name)
        for what, v, least in (("workers", workers, 1), ("multipart_threshold", multipart_threshold, 0),
                               ("multipart_chunksize", multipart_chunksize, 1), ("max_attempts", max_attempts, 1)):
            _check_int(v, what, least)
        connect_timeout = _check_seconds(connect_timeout, "connect_timeout")
        read_timeout = _check_seconds(read_timeout, "read_timeout")
        if progress is not None and not isinstance(progress, bool):
            raise InvalidTypeError(f"progress must be True, False or None (only on a terminal), "
                                   f"not {type(progress).__name__}")
        if chunking is not None and not isinstance(chunking, Chunking):
            raise InvalidTypeError(f"chunking must be a casstore.objects.chunking.Chunking or None (whole objects), "
                                   f"not {type(chunking).__name__}")
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


_CHECKS = {"url": parse_url, "endpoint_url": check_endpoint_url, "region": check_region, "profile": check_profile}


def _remotes_of(doc: Dict[str, object], p: Path, *, check: bool = True) -> Dict[str, Dict[str, str]]:
    """The ``[remotes]`` tables of ``doc``, each setting checked as ``Remote(...)`` checks it.

    Hazard: ``remotes.toml`` may be edited by hand, by another tool or by someone else (a shared
    store): a value ``remote add`` would refuse (a malformed endpoint, credentials in it, a URL
    with a newline, a name like ``../../evil``) is a :class:`StoreFormatError` naming the file, the
    remote and the key (docs/security.md, class 8), never a raw error at first use.  ``check=False``
    only checks the types (``remove_remote``: the way out of a damaged entry must not be blocked by it).
    """
    remotes = doc.get("remotes", {})
    if not isinstance(remotes, dict):
        raise StoreFormatError(f"{p}: [remotes] must be a table")
    out: Dict[str, Dict[str, str]] = {}
    for name, cfg in remotes.items():
        if check and not _NAME_RE.fullmatch(name):
            raise StoreFormatError(f"{p}: [remotes.{name!r}] is not a valid remote name (letters, digits, '.', '_' "
                                   "and '-', up to 64, e.g. 'origin'); rename that table or remove it")
        if not isinstance(cfg, dict) or not isinstance(cfg.get("url"), str):
            raise StoreFormatError(f"{p}: remote {name!r} has no url")
        for k in _SETTINGS:
            if k in cfg and not isinstance(cfg[k], str):
                shown = repr(cfg[k]) if k != "endpoint_url" else type(cfg[k]).__name__
                raise StoreFormatError(f"{p}: remote {name!r}: {k} = {shown} must be a string")
            if check and k in cfg:
                try:
                    _CHECKS[k](cfg[k])
                except (InvalidInputError, InvalidTypeError) as e:
                    # The checkers' messages never echo credentials (an endpoint is shown redacted).
                    raise StoreFormatError(f"{p}: remote {name!r}: {k}: {e}; fix that line, or remove the remote "
                                           f"(`casstore remote rm {name}`) and add it again") from None
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
    """Record remote ``name`` in ``<root>/remotes.toml`` (atomically); return it.

    Every setting is checked first, as :class:`Remote` checks it (nothing is written for a bad
    one): a URL outside ``s3://bucket/prefix`` or with control characters, an ``endpoint_url``
    that is not ``http(s)://host[:port][/path]`` or that holds credentials, a malformed region
    or profile.
    """
    check_remote_name(name)
    parse_url(url)
    endpoint_url = check_endpoint_url(endpoint_url)
    region = check_region(region)
    profile = check_profile(profile)
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
    """Forget remote ``name`` (nothing on the remote is touched).

    Works on an entry that fails the checks of :func:`load_remotes` (the errors of a damaged
    ``remotes.toml`` point here); the other entries are written back as they were.
    """
    with _config_lock(store):
        doc = _load_doc(store)
        p = _remotes_path(store)
        remotes = _remotes_of(doc, p, check=False)
        if name not in remotes:
            raise ObjectNotFoundError(f"no remote named {name!r} in {p}")
        del remotes[name]
        up = doc.get("upstream")
        _write_remotes(store, remotes, up if isinstance(up, str) and up != name else None)


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
