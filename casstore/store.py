"""The ``Store`` facade: one object that opens a store and offers every feature.

Layer 5 (docs/design.md): the facade only composes the layers below it --
:class:`~casstore.objects.LocalObjects` for objects, the refs and manifests
layers for names, and the feature packages (maintenance, sync, pipelines,
cache, adapters).  It holds no storage logic of its own beyond creating and
opening a store directory; every method spells out its parameters and its
return type.
"""

from __future__ import annotations

import errno
import os
from datetime import timedelta
from pathlib import Path
from typing import (
    IO,
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
    Union,
    overload,
)

from . import codecs
from ._fs import fsync_dir, path_exists, refuse_planted_links, sweep_stale, write_file_atomic
from ._layout import CONFIG_FILE, FIXED_DIRS, REMOTES_FILE, SUBDIRS, TMP
from ._lock import Filesystem, configure, filesystem
from .codecs import CompressArg
from .config import StoreConfig
from .digest import Digest
from .errors import (
    CasstoreError,
    DiskFullError,
    InvalidInputError,
    InvalidTypeError,
    ReadOnlyError,
    StoreFormatError,
)
from .folders import AddResult, FolderStatus, add_folder, folder_status
from .manifests import CheckedOut, Diff, EditTransaction, Manifest, NameInfo, list_names, read_manifest
from .manifests import checkout as checkout_version
from .manifests import diff as diff_versions
from .manifests import freeze as freeze_head
from .manifests import history as manifest_history
from .manifests import pin as pin_version
from .manifests import remove as remove_name
from .manifests import rename as rename_name
from .manifests import unpin as unpin_name
from .objects import LocalObjects, ObjectInfo
from .objects.base import Buffer
from .refs import LocalRefs

if TYPE_CHECKING:
    import h5py
    import numpy.typing as npt

    from .maintenance import GCPlan, LimitResult, NameRow, Usage, VerifyReport
    from .sync import Remote, RemoteGCPlan, RemoteUsage, S3Share, TransferReport

# The feature packages (maintenance, sync, pipelines, cache, adapters) are imported by the
# methods that use them: a CLI command pays only for what it runs (``casstore status`` of an
# unchanged 10,000-file folder is ~0.1 s; importing every feature was ~0.06 s of it).

__all__ = ["Store", "ObjectInfo", "open_store", "remote_cache_dir", "REMOTE_CACHE_NAME", "DigestLike", "PathLike",
           "Duration"]

DigestLike = Union[Digest, str]
PathLike = Union[str, "os.PathLike[str]"]
Duration = Union[int, float, str, timedelta]
DeriveInput = Union[Digest, str, "Manifest"]
DeriveFn = Callable[[Dict[str, Path], Path], object]
Scope = Union[bool, List[str], "tuple[str, ...]"]  # force_download / regenerate: all, none, or these names


def _load_config(root: Path) -> StoreConfig:
    try:
        return StoreConfig.load(root)
    except NotADirectoryError:  # root (or a parent) is a file
        raise StoreFormatError(f"{root} is not a directory, so not a casstore store") from None


def _as_digest(d: DigestLike) -> Digest:
    return Digest.coerce(d)


def _as_path(p: object, what: str = "store path") -> Path:
    """A user's ``str``/``PathLike`` as an absolute, ``~``-expanded Path; InvalidTypeError otherwise."""
    if not isinstance(p, (str, os.PathLike)):
        raise InvalidTypeError(f"a {what} must be a str or os.PathLike, not {type(p).__name__}")
    raw = os.fspath(p)
    if not isinstance(raw, str):
        raise InvalidTypeError(f"a {what} must be text, not {type(raw).__name__}; decode it first")
    if "\x00" in raw or not raw:
        raise InvalidInputError(f"invalid {what} {raw!r}: it is empty or contains NUL")
    return Path(os.path.expanduser(raw)).absolute()


class Store:
    """A content-addressed store rooted at a local directory.

    Create or open one with :func:`casstore.open`.  Objects are immutable and
    addressed by the BLAKE3 digest of their uncompressed bytes; see the README
    for a tour.  ``store.objects`` is the object layer
    (:class:`~casstore.objects.LocalObjects`) and ``store.refs`` the refs layer.
    """

    def __init__(self, root: PathLike, *, create: bool = True, compress: CompressArg = None,
                 durable: Optional[bool] = None, shared: bool = False, lock_mode: str = "auto",
                 upstream: Union[None, bool, str, Remote] = None) -> None:
        self.root = _as_path(root)
        """The store directory."""
        if create and not path_exists(self.root / CONFIG_FILE):
            level = codecs.normalize_compress(compress, codecs.DEFAULT_LEVEL)
            self._init_layout(StoreConfig(
                compression="zstd" if level else "raw",
                level=level or codecs.DEFAULT_LEVEL,
                durable=True if durable is None else durable,
                shared=shared,
            ))
        self.config = _load_config(self.root)
        """The settings fixed when the store was created (``store.toml``)."""
        refuse_planted_links(self.root, FIXED_DIRS)
        default: CompressArg = compress if compress is not None else (
            self.config.level if self.config.compression == codecs.ZSTD.name else None)
        self.durable: bool = self.config.durable if durable is None else durable
        """fsync before a write returns."""
        self.objects = LocalObjects(self.root, self.root / TMP, durable=self.durable, level=self.config.level,
                                    compress=default)
        """The object layer."""
        self.refs = LocalRefs(self.root, durable=self.durable)
        """The refs layer (heads and pins)."""
        self._set_upstream(upstream)
        self.lock_mode = lock_mode
        """The ``lock_mode`` setting; :meth:`filesystem` says what is used (probed once per mount)."""
        configure(self.root, lock_mode)
        if self.objects.writable:
            try:
                sweep_stale(self.root / TMP)
            except OSError:  # a read-only bind mount: reading needs no sweep
                pass

    def _set_upstream(self, upstream: Union[None, bool, str, Remote]) -> None:
        if upstream is None:  # the store's own setting: `upstream = "NAME"` in remotes.toml
            name = None
            if os.path.lexists(self.root / REMOTES_FILE):  # (no file: no remote, and nothing to import)
                from .sync import load_upstream

                name = load_upstream(self)
            upstream = name if name is not None else False
        if upstream is True:
            raise InvalidInputError("upstream= takes a remote (a name in remotes.toml, an s3:// URL or a Remote), "
                                    "False for none, or None for the store's setting; not True")
        if upstream is False:
            self.objects.upstream = None
            return
        from .sync import Remote, RemoteUpstream, resolve_remote

        if isinstance(upstream, Remote):
            self.objects.upstream = RemoteUpstream.of(upstream)
        elif isinstance(upstream, str):
            spec = upstream
            self.objects.upstream = RemoteUpstream(lambda: resolve_remote(self, spec), spec)
        else:
            raise InvalidTypeError(f"upstream must be a remote name, an s3:// URL, a Remote, False or None, "
                                   f"not {type(upstream).__name__}")

    def _lazy_pull_if_remote_name(self, target: DigestLike) -> None:
        up = self.objects.upstream
        if up is None:
            return
        from .sync import RemoteUpstream
        from .sync import pull as pull_names

        if not isinstance(up, RemoteUpstream) or not isinstance(target, str) or target.startswith("blake3:"):
            return
        name = target.split("~", 1)[0].split("@", 1)[0]
        if not name or self.refs.get("pins", name) is not None or self.refs.get("heads", name) is not None:
            return
        rem = up.remote
        if rem.refs.read("pins", name) is None and rem.refs.read("heads", name) is None:
            return  # not there either: checkout reports the name as unknown
        pull_names(self, rem, name, lazy=True)

    @property
    def upstream(self) -> Optional[str]:
        """The remote missing objects are fetched from on first read (its name or URL), or ``None``."""
        up = self.objects.upstream
        if up is None:
            return None
        from .sync import RemoteUpstream

        return up.label if isinstance(up, RemoteUpstream) else None

    def set_upstream(self, remote: Optional[str]) -> None:
        """Make configured remote ``remote`` this store's upstream in ``remotes.toml`` (``None``: none).

        Takes effect for this ``Store`` at once and for every later opening of the store.
        """
        from .sync import set_upstream

        set_upstream(self, remote)
        self._set_upstream(remote if remote is not None else False)

    def filesystem(self) -> Filesystem:
        """Probe the store's filesystem (locks, hard links, reflink) and say what casstore does there."""
        return filesystem(self.root, self.lock_mode)

    @property
    def writable(self) -> bool:
        """False on a read-only mount or a store this user may not write."""
        return self.objects.writable

    @property
    def compress(self) -> CompressArg:
        """The default ``compress=`` of puts."""
        return self.objects.compress

    # -- creation ---------------------------------------------------------

    def _init_layout(self, cfg: StoreConfig) -> None:
        try:
            self._make_layout(cfg)
        except CasstoreError:
            raise
        except OSError as e:
            # Found by a bug hunt: each of these was "init failed unexpectedly".
            root = self.root
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise ReadOnlyError(f"cannot create a store at {root}: {e.strerror}") from None
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"cannot create a store at {root}: {e.strerror}; free space first",
                                    e.errno) from None
            why = {errno.ENOTDIR: "a part of the path is a file, not a directory",
                   errno.EEXIST: "it is a symbolic link to a missing directory, or a file",
                   errno.ENAMETOOLONG: "the path is longer than the filesystem allows",
                   errno.ELOOP: "the path is a loop of symbolic links",
                   errno.ENOENT: "no directory can be made there"}.get(e.errno or 0)
            if why is None:
                raise
            raise InvalidInputError(f"cannot create a store at {str(root)[:300]!r}: {why}; choose another "
                                    "directory") from None

    def _make_layout(self, cfg: StoreConfig) -> None:
        root = self.root
        if root.exists():
            if not root.is_dir():
                raise StoreFormatError(f"{root} exists and is not a directory")
            entries = set(os.listdir(root)) - {s.split("/")[0] for s in SUBDIRS}
            if entries == {CONFIG_FILE}:
                return  # another process created this store since our check: use it
            if entries:
                raise StoreFormatError(
                    f"{root} is not empty and is not a casstore store (no {CONFIG_FILE}); "
                    "choose an empty or new directory"
                )
        try:
            for sub in SUBDIRS:
                (root / sub).mkdir(parents=True, exist_ok=True)
            if cfg.shared:  # setgid, group-writable dirs and lock files (docs/maintenance.md)
                from ._shared import share_layout

                share_layout(root)
            # store.toml is written last: its presence marks a complete store.
            # Two processes creating the same store write identical bytes.
            write_file_atomic(root / TMP, root / CONFIG_FILE, cfg.to_toml(), mode=0o444)
            fsync_dir(root)
        except PermissionError as e:
            raise ReadOnlyError(f"cannot create a store at {root}: {e.strerror}") from None

    # -- objects (casstore.objects.LocalObjects) ----------------------------

    def put(self, data: Buffer, *, compress: CompressArg = None) -> Digest:
        """Store ``data``; return its digest.  Idempotent: same bytes, same digest, one object.

        ``compress``: ``None`` (store default), ``False``/``"raw"``, ``True``/``"zstd"`` or a
        zstd level.  Compression is skipped when a sample shows it would not pay.
        """
        return self.objects.put(data, compress=compress)

    def put_parts(self, parts: Iterable[Buffer], *, compress: CompressArg = None) -> Digest:
        """Store the concatenation of ``parts`` without joining them in memory (same digest as ``put``)."""
        return self.objects.put_parts(parts, compress=compress)

    def put_many(self, items: Iterable[Buffer], *, compress: CompressArg = None) -> List[Digest]:
        """Store many small objects with one filesystem sync per batch; digests in input order."""
        return self.objects.put_many(items, compress=compress)

    def put_path(self, path: PathLike, *, compress: CompressArg = None) -> Digest:
        """Store a file of any size by streaming it (in-kernel copy; the staged copy is hashed)."""
        return self.objects.put_path(path, compress=compress)

    def put_stream(self, stream: IO[bytes], *, compress: CompressArg = None) -> Digest:
        """Store everything readable from a binary stream; return its digest."""
        return self.objects.put_stream(stream, compress=compress)

    def get(self, digest: DigestLike, *, verify: bool = True) -> bytes:
        """The object's uncompressed bytes; re-hashed (:class:`IntegrityError`) unless ``verify=False``."""
        return self.objects.read(_as_digest(digest), verify=verify)

    def open(self, digest: DigestLike, *, verify: bool = True) -> BinaryIO:
        """Open an object for streaming, read-only.

        Reading it to the end in order verifies the digest (IntegrityError
        before the last bytes are returned).  Seeking anywhere but the current
        position turns verification off for this reader.
        """
        return self.objects.open(_as_digest(digest), verify=verify)

    def path(self, digest: DigestLike, *, verify: bool = False) -> Path:
        """Read-only path of a *raw* object, for h5py, ``numpy.memmap`` or any tool.

        The path hands out **unverified** bytes (another process or a damaged
        disk could have changed the file); ``verify=True`` hashes the file
        first (once per process while the file is unchanged).  The file is mode
        0o444 and must never be modified.  Compressed objects have no raw path:
        :class:`CompressedObjectError` (see :meth:`raw_path`).
        """
        d = _as_digest(digest)
        p = self.objects.path(d)
        if verify:
            self.objects.verify_file(d)
        return p

    def raw_path(self, digest: DigestLike, *, verify: bool = False) -> Path:
        """Like :meth:`path`, but a compressed object is first materialized raw (once, verified)."""
        d = _as_digest(digest)
        p = self.objects.raw_path(d)
        if verify:
            self.objects.verify_file(d)
        return p

    def stat(self, digest: DigestLike) -> ObjectInfo:
        """Size, stored size and codec of an object, without reading its content."""
        return self.objects.stat(_as_digest(digest))

    def __contains__(self, digest: object) -> bool:
        if isinstance(digest, str):
            try:
                digest = Digest.parse(digest)
            except ValueError:
                return False
        return isinstance(digest, Digest) and self.objects.has(digest)

    def contains(self, digest: DigestLike) -> bool:
        """``digest in store``."""
        return self.objects.has(_as_digest(digest))

    def resolve(self, prefix: DigestLike) -> Digest:
        """Turn a unique digest prefix (``"blake3:9f2c"`` or ``"9f2c"``) into a Digest."""
        return self.objects.resolve(prefix)

    def iter_objects(self) -> Iterator[Digest]:
        """Every object's digest, in digest order (each once, whatever its codec)."""
        return self.objects.iter_digests()

    def iter_info(self) -> Iterator[ObjectInfo]:
        """``stat`` of every object."""
        return self.objects.iter_info()

    def sweep_tmp(self) -> List[Path]:
        """Remove staging files of dead writers now (also done on open)."""
        return sweep_stale(self.root / TMP)

    # -- manifests, heads and pins (casstore.manifests) ----------------------

    def edit(self, name: str, *, timeout: Optional[float] = 600.0,
             allow_missing: bool = False) -> EditTransaction:
        """Edit manifest ``name`` in a transaction: ``with store.edit("exp") as m: m["k"] = d``.

        Takes the lock of this name only; commits a new version on a clean
        exit (version object first, then the ref by atomic rename) and discards
        everything on an exception.  Raises :class:`FrozenError` for a pin and
        :class:`LockTimeout` after ``timeout`` seconds.  Entries must refer to
        objects in the store unless ``allow_missing``.
        """
        return EditTransaction(self, name, timeout=timeout, allow_missing=allow_missing)

    def manifest(self, target: DigestLike) -> Manifest:
        """Lock-free read of a name's current version (pins first), or a version: by digest,
        ``NAME~N`` (N versions back) or ``NAME@<hex prefix>``."""
        return read_manifest(self, target)

    def history(self, target: DigestLike, limit: Optional[int] = None) -> List[Manifest]:
        """Versions of a name (or from a version digest), newest first."""
        return manifest_history(self, target, limit)

    def freeze(self, name: str, *, timeout: Optional[float] = 600.0) -> Digest:
        """Make head ``name`` a pin: it never changes again.  Returns the version digest."""
        return freeze_head(self, name, timeout=timeout)

    def pin(self, name: str, target: DigestLike, *, force: bool = False,
            timeout: Optional[float] = 600.0, allow_missing: bool = False) -> Digest:
        """Name a manifest version (digest or another name) with a pin; moving one needs ``force``.

        GC keeps what the pin names and, through its provenance record, the derive inputs
        it was made from (transitively); see docs/maintenance.md, "Provenance".
        """
        return pin_version(self, name, target, force=force, timeout=timeout, allow_missing=allow_missing)

    def unpin(self, name: str, *, timeout: Optional[float] = 600.0) -> Digest:
        """Remove a pin's name; its objects are collected later by GC if nothing else holds them."""
        return unpin_name(self, name, timeout=timeout)

    def remove(self, name: str, *, force: bool = False, timeout: Optional[float] = 600.0) -> Digest:
        """Delete head ``name`` (a pin needs ``force=True`` or :meth:`unpin`); return the version it named.

        Its versions become unreferenced: gc collects them once older than its
        grace period; until then ``store.pin(NEW, digest)`` brings one back.
        A missing name raises :class:`ManifestNotFoundError`.  See docs/manifests.md.
        """
        return remove_name(self, name, force=force, timeout=timeout)

    def rename(self, old: str, new: str, *, force: bool = False, timeout: Optional[float] = 600.0) -> Digest:
        """Rename head ``old`` to ``new`` with its history (one atomic rename); return its version.

        An existing ``new`` (:class:`NameExistsError`) or a pin ``old``
        (:class:`FrozenError`) needs ``force=True``.
        """
        return rename_name(self, old, new, force=force, timeout=timeout)

    def names(self, *, include_internal: bool = False) -> List[NameInfo]:
        """Every head and pin (:class:`NameInfo`), sorted; internal records (``_fetch/...``,
        shown with their URL) only with ``include_internal=True``."""
        return list_names(self, include_internal=include_internal)

    def name_rows(self, *, include_internal: bool = False, filters: Iterable[str] = (), sort: str = "name",
                  reverse: bool = False, max_versions: int = 1000) -> List[NameRow]:
        """Each head and pin with its versions, logical size and last change (what ``casstore ls`` shows).

        ``filters``: ``"size>1GB"``, ``"time<7d"``, ``"name=exp-*"``, ``"kind=pin"``, ... (all must hold;
        a bad one is an InvalidInputError naming the allowed forms).  ``sort``: ``name``, ``size``,
        ``time`` or ``versions`` (largest, newest, most first; ``reverse`` flips).  History walks stop
        after ``max_versions`` (``NameRow.versions_capped``).  See docs/manifests.md, "Listing names".
        """
        from .maintenance import name_rows, select_rows

        filters = list(filters)
        select_rows([], filters=filters, sort=sort)  # bad filters and sorts fail before any history is read
        rows = name_rows(self, include_internal=include_internal, max_versions=max_versions, filters=filters)
        return select_rows(rows, filters=filters, sort=sort, reverse=reverse)

    def pins(self) -> Dict[str, Digest]:
        """Every pin: name -> frozen manifest digest (internal ones included; see :meth:`names`)."""
        return self.refs.list("pins")

    def heads(self) -> Dict[str, Digest]:
        """Every head: name -> current manifest version digest (internal ``_fetch/...`` ones included;
        see :meth:`names`)."""
        return self.refs.list("heads")

    def diff(self, a: Union[DigestLike, Manifest], b: Union[DigestLike, Manifest]) -> Diff:
        """Entries, metadata, derive params and inputs changed from ``a`` to ``b`` (names, digests or Manifests)."""
        return diff_versions(self, a, b)

    def checkout(self, target: DigestLike, outdir: PathLike, *, overwrite: bool = False, sync: bool = False,
                 link: str = "copy", force: bool = False, progress: Optional[bool] = None,
                 rehash: bool = False) -> CheckedOut:
        """Write a manifest's files under ``outdir`` (verified; reflinked where possible); return those written
        (a list of paths; its ``removed`` and ``kept`` say which files ``sync`` removed or left).

        ``link``: ``"copy"`` | ``"reflink"`` | ``"hardlink"`` | ``"symlink"``.  ``sync=True`` also removes
        the files the previous checkout of this name into ``outdir`` wrote that this version lacks (never
        a file casstore did not write; never one changed since, unless ``force=True``).  Links are made
        to objects hashed now or, unchanged since, by casstore within the last hour; ``rehash=True``
        hashes every one.  ``progress``: a bar on stderr (``None``: on a terminal).  See
        docs/manifests.md, "Checkout: sync and link modes", and docs/folders.md.

        With an upstream (read-through), a name that is not here but is a pin or head on the
        upstream is pulled lazily first (refs and manifests); the files' objects are then fetched.
        """
        self._lazy_pull_if_remote_name(target)
        return checkout_version(self, target, outdir, overwrite=overwrite, sync=sync, link=link, force=force,
                                progress=progress, rehash=rehash)

    # -- folders as snapshots (casstore.folders) ------------------------------------

    def add(self, name: str, folder: PathLike, *, message: Optional[str] = None,
            meta: Optional[Mapping[str, Any]] = None, exclude: Optional[Iterable[str]] = None,
            progress: Optional[bool] = None) -> AddResult:
        """Snapshot a whole folder as ONE new version of ``name`` (keys: relative POSIX paths).

        Symlinks and special files are skipped with a warning (never followed);
        ``exclude``: glob patterns matched against each relative path and each
        of its segments.  Files are stored on a small thread pool; a stat cache
        under the store means an unchanged file is not read again.  A folder
        equal to the head makes no new version (``result.created`` is False).
        A file name that is not a valid key raises :class:`InvalidInputError`
        and a file that keeps changing :class:`FileChangedError`, both before
        anything is committed.  ``message`` is kept as ``meta["message"]``.
        See docs/folders.md.
        """
        return add_folder(self, name, folder, message=message, meta=meta, exclude=exclude, progress=progress)

    def status(self, name: str, folder: PathLike, *, version: Optional[str] = None,
               exclude: Optional[Iterable[str]] = None, progress: Optional[bool] = None) -> FolderStatus:
        """Added / modified / deleted / unchanged keys of ``folder`` against ``name``'s head (or ``version``,
        e.g. ``"NAME~2"``); reads only files the stat cache cannot vouch for.  See docs/folders.md."""
        return folder_status(self, name, folder, version=version, exclude=exclude, progress=progress)

    # -- pipelines: fetch once, derive once (casstore.pipelines) ------------------

    def fetch(self, url: str, *, digest: Optional[DigestLike] = None, sha256: Optional[str] = None,
              md5: Optional[str] = None, force: Optional[Scope] = None, timeout: Optional[float] = None,
              retries: int = 5, progress: Optional[bool] = None, connect_timeout: float = 30.0,
              max_bytes: Optional[int] = None, deadline: Optional[float] = None, refresh: bool = False,
              remote: Optional[Union[Remote, str]] = None) -> Digest:
        """Download ``url`` once across processes; see :func:`casstore.pipelines.fetch`.

        ``max_bytes`` caps the download (default: the expected size when known, else
        the ``fetch_max_bytes`` setting); ``deadline`` bounds the whole transfer in seconds
        (``fetch_deadline``), besides the per-read ``connect_timeout``.  ``force`` (True, or
        URLs / fetch names) downloads again once per job; ``refresh`` revalidates with the server.
        ``remote`` (a :class:`Remote` or a configured name): once across machines sharing it --
        a download recorded there is pulled, else one process downloads and pushes it
        (docs/pipelines.md, "Across machines").
        """
        from .pipelines import fetch as fetch_url  # lazy: http.client and ssl at import

        return fetch_url(self, url, digest=digest, sha256=sha256, md5=md5, force=force, timeout=timeout,
                         retries=retries, progress=progress, connect_timeout=connect_timeout,
                         max_bytes=max_bytes, deadline=deadline, refresh=refresh, remote=self._shared(remote))

    def derive(self, name: str, *, inputs: Mapping[str, DeriveInput], fn: DeriveFn,
               params: Optional[Mapping[str, object]] = None, version: object = None,
               regenerate: Optional[Scope] = None, timeout: Optional[float] = None,
               compress: CompressArg = None, remote: Optional[Union[Remote, str]] = None) -> Manifest:
        """Compute ``fn`` once per (name, inputs, params, version); see :func:`casstore.pipelines.derive`.

        ``remote`` (a :class:`Remote` or a configured name such as ``"origin"``): once across
        machines that share only that remote -- a result already there is pulled, else one
        process computes under a lease on the remote and pushes, the others wait and pull
        (docs/pipelines.md, "Across machines").
        """
        from .pipelines import derive as derive_step  # lazy: http.client and ssl at import

        return derive_step(self, name, inputs=inputs, fn=fn, params=params, version=version,
                           regenerate=regenerate, timeout=timeout, compress=compress, remote=self._shared(remote))

    def _shared(self, remote: Optional[Union[Remote, str]]) -> Optional[S3Share]:
        # casstore.sync (remotes, S3, pull, read-through: ~20 ms of imports) only when a remote
        # is asked for: every rank of a job pays a cache hit's imports (bench_jobs "warm").
        if remote is None:
            return None
        from .sync import share

        return share(self, remote)

    # -- numpy and HDF5 adapters (casstore.adapters) -------------------------------

    def put_array(self, a: npt.NDArray[Any], *, compress: CompressArg = None) -> Digest:
        """Store a numpy array as a ``.npy`` object."""
        from .adapters import put_array  # lazy: numpy costs ~130 ms and 13 MiB at import

        return put_array(self, a, compress=compress)

    def get_array(self, digest: DigestLike, *, mmap: bool = False,
                  verify: Optional[bool] = None) -> npt.NDArray[Any]:
        """Read an array (verified); ``mmap=True`` memory-maps a raw object read-only, no copy.

        ``verify`` defaults to True for reads and False for maps; ``mmap=True, verify=True``
        hashes the file once per process while it is unchanged, then maps it.
        """
        from .adapters import get_array  # lazy: numpy costs ~130 ms and 13 MiB at import

        return get_array(self, digest, mmap=mmap, verify=verify)

    def put_arrays(self, arrays: Mapping[str, npt.NDArray[Any]], *,
                   compress: CompressArg = None) -> Digest:
        """Store a dict of arrays; returns the digest of a manifest bundle."""
        from .adapters import put_arrays  # lazy: numpy costs ~130 ms and 13 MiB at import

        return put_arrays(self, arrays, compress=compress)

    def get_arrays(self, digest: DigestLike, *, mmap: bool = False,
                   verify: Optional[bool] = None) -> Dict[str, npt.NDArray[Any]]:
        """Read a bundle written by :meth:`put_arrays`."""
        from .adapters import get_arrays  # lazy: numpy costs ~130 ms and 13 MiB at import

        return get_arrays(self, digest, mmap=mmap, verify=verify)

    def open_hdf5(self, digest: DigestLike, *, verify: Optional[bool] = True,
                  rdcc_nbytes: Optional[int] = None) -> h5py.File:
        """A read-only ``h5py.File`` on an object, safe with many concurrent readers.

        The object is verified before h5py sees it (``verify=False`` skips that; ``None`` is the
        default, True).  A file that would make h5py read another file (external raw storage,
        external links, virtual datasets with other sources) is refused (docs/security.md).
        """
        from .adapters import open_hdf5  # lazy: numpy costs ~130 ms and 13 MiB at import

        return open_hdf5(self, digest, verify=verify, rdcc_nbytes=rdcc_nbytes)

    # -- remotes on an S3-compatible object store (casstore.sync) -------------------

    def push(self, remote: Union[Remote, str], *names: str, force: bool = False) -> TransferReport:
        """Upload pins/heads and their closures to ``remote`` (objects the remote lacks first, refs last).

        ``remote`` is a :class:`casstore.Remote` or the name of one in ``remotes.toml``.
        Refs move by compare-and-swap: a lost race raises :class:`RemoteConflictError`
        (pull, then push again).
        """
        from .sync import push as push_names

        return push_names(self, remote, *names, force=force)

    def pull(self, remote: Union[Remote, str], *names: str, merge: Union[bool, str] = True,
             lazy: bool = False) -> TransferReport:
        """Download pins/heads from ``remote``: each object verified as it arrives, refs created last.

        A head that diverged from the local one is merged three-way by key
        unless ``merge=False``; ``merge="ours"``/``"theirs"`` settles conflicts.
        ``lazy=True`` brings refs and manifests only: the objects arrive as they
        are read, through the store's upstream (which must be ``remote``).
        """
        from .sync import pull as pull_names

        return pull_names(self, remote, *names, merge=merge, lazy=lazy)

    def remotes(self) -> Dict[str, Dict[str, str]]:
        """The remotes configured in ``<root>/remotes.toml``: name -> settings (url, endpoint_url ...)."""
        from .sync import load_remotes

        return load_remotes(self)

    def add_remote(self, name: str, url: str, *, endpoint_url: Optional[str] = None, region: Optional[str] = None,
                   profile: Optional[str] = None, replace: bool = False) -> Remote:
        """Record remote ``name`` (``s3://bucket/prefix``) in ``remotes.toml``; return it."""
        from .sync import add_remote

        return add_remote(self, name, url, endpoint_url=endpoint_url, region=region, profile=profile,
                          replace=replace)

    def remove_remote(self, name: str) -> None:
        """Forget remote ``name`` (nothing on the remote is touched)."""
        from .sync import remove_remote

        remove_remote(self, name)

    def remote(self, name: str, *, workers: Optional[int] = None, progress: Optional[bool] = None) -> Remote:
        """The :class:`~casstore.Remote` configured as ``name`` (``workers``: parallel transfers)."""
        from .sync import get_remote

        if workers is None:
            return get_remote(self, name, progress=progress)
        return get_remote(self, name, workers=workers, progress=progress)

    def fetch_object(self, digest: DigestLike, *, remotes: Optional[Iterable[Union[Remote, str]]] = None,
                     verify: bool = True) -> bytes:
        """``get``, but a local miss downloads the object (verified) from the first remote holding it."""
        from .sync import fetch_object as fetch_remote_object

        return fetch_remote_object(self, digest, remotes=remotes, verify=verify)

    # -- maintenance: gc, verify, usage, size limits (casstore.maintenance) -------

    @overload
    def plan_gc(self, keep_history: int = 5, grace: Duration = "1h", *, remote: None = None) -> GCPlan: ...

    @overload
    def plan_gc(self, keep_history: int = 5, grace: Duration = "1h", *,
                remote: Union[Remote, str]) -> RemoteGCPlan: ...

    def plan_gc(self, keep_history: int = 5, grace: Duration = "1h", *,
                remote: Optional[Union[Remote, str]] = None) -> Union[GCPlan, RemoteGCPlan]:
        """Plan a garbage collection; nothing is deleted until ``plan.execute()``.

        Keeps every pin, each head's current version and its last
        ``keep_history`` versions (and everything they reference), and every
        object written or re-put within ``grace`` (seconds, timedelta or
        ``"90s"``/``"10m"``/``"1h"``).  Reads no data object.  See docs/maintenance.md.

        ``remote`` (a :class:`Remote`, a configured name or an ``s3://`` URL):
        plan a gc of that remote instead -- its pins and heads are the roots,
        ages are the server's ``LastModified``, and ``execute()`` waits for
        pushes in progress (a :class:`RemoteGCPlan`; docs/remotes.md, "Remote gc").
        """
        if remote is None:
            from .maintenance import plan_gc

            return plan_gc(self, keep_history=keep_history, grace=grace)
        from .maintenance import parse_duration
        from .sync import plan_remote_gc, resolve_remote

        return plan_remote_gc(resolve_remote(self, remote), keep_history=keep_history,
                              grace=parse_duration(grace))

    def plan_limit(self, max_bytes: Union[int, str], *, keep_history: int = 5, grace: Duration = "1h") -> GCPlan:
        """Plan evicting least-recently-used unreferenced objects until the objects fit ``max_bytes``."""
        from .maintenance import plan_limit

        return plan_limit(self, max_bytes, keep_history=keep_history, grace=grace)

    def verify(self, *, fast: bool = False, repair: bool = False, incremental: bool = False,
               recheck_after: Duration = "30d", workers: int = 2, progress: Optional[bool] = None) -> VerifyReport:
        """Re-hash every object and resolve every reference; see docs/maintenance.md.

        ``fast``: sizes and headers only.  ``incremental``: skip files unchanged
        since a verification younger than ``recheck_after``.  ``repair``: move
        corrupt and stray files to ``bad/`` and remove stale staging files
        (never deletes data).  ``workers``: hashing threads.  ``progress``: a
        bar on stderr (default: only on a terminal).
        """
        from .maintenance import verify as verify_store

        return verify_store(self, fast=fast, repair=repair, incremental=incremental, recheck_after=recheck_after,
                      workers=workers, progress=progress)

    def usage(self, *, shares: Iterable[str] = ()) -> Usage:
        """Objects, bytes, compression, honest dedupe (live names only), history, per head and pin.

        ``shares``: names whose ``shared_with`` (what they share with each other
        live name) is computed; see docs/maintenance.md, "Usage".
        """
        from .maintenance import usage as store_usage

        return store_usage(self, shares=shares)

    def remote_usage(self, remote: Union[Remote, str]) -> RemoteUsage:
        """What a remote stores against what its pins and heads reference (``casstore du --remote``).

        Reads every remote ref and current version and lists the objects once;
        reads no data object.  See docs/remotes.md, "Remote gc".
        """
        from .sync import remote_usage, resolve_remote

        return remote_usage(resolve_remote(self, remote))

    def limit(self, max_bytes: Union[int, str], *, keep_history: int = 5, grace: Duration = "1h",
              dry_run: bool = False) -> LimitResult:
        """Evict least-recently-used *unreferenced* objects until the objects fit in ``max_bytes``.

        Pinned and head-referenced objects are never evicted; when the limit
        cannot be met the result says so (``met`` is False, ``message`` why).
        """
        from .maintenance import limit as limit_store

        return limit_store(self, max_bytes, keep_history=keep_history, grace=grace, dry_run=dry_run)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def open_store(path: Optional[PathLike] = None, *, create: bool = True, compress: CompressArg = None,
               durable: Optional[bool] = None, shared: bool = False,
               upstream: Union[None, bool, str, Remote] = None, endpoint_url: Optional[str] = None,
               cache: Optional[PathLike] = None) -> Store:
    """Open the store at ``path``; create it there on first use unless ``create=False``.

    ``compress``: default codec for puts (``None``/``False`` raw, ``True`` zstd
    level 3, or a level); ``durable=False`` skips fsyncs (scratch stores:
    faster, but a power loss may lose recent puts -- never corrupt them, since
    visibility still goes through rename, but a file may be empty after a
    crash of the machine, which ``verify`` reports).

    ``upstream``: a remote (name in ``remotes.toml``, ``s3://`` URL or
    :class:`Remote`) from which missing objects are fetched, verified, on first
    read; ``None`` takes the store's own setting (``upstream = "NAME"`` in
    ``remotes.toml``), ``False`` turns it off (docs/remotes.md, "Read-through").

    ``path="s3://bucket/prefix"`` opens a per-user local cache in front of that
    remote (under ``cache``, default ``$XDG_CACHE_HOME/casstore-remotes/``): the
    remote is configured there as ``origin`` (with ``endpoint_url``) and is
    its upstream.
    """
    from .settings import current

    cfg = current()
    if path is None:
        path = cfg.store
    if compress is None and cfg.compression is not None:
        compress = int(cfg.compression) if cfg.compression.isdigit() else cfg.compression
    if durable is None:
        durable = cfg.durable
    if isinstance(path, str) and path.startswith("s3://"):
        return _open_remote_cache(path, endpoint_url=endpoint_url, cache=cache, compress=compress,
                                  durable=durable, lock_mode=cfg.lock_mode)
    if endpoint_url is not None or cache is not None:
        raise InvalidInputError("endpoint_url= and cache= belong to casstore.open('s3://bucket/prefix', ...); "
                                "for a local store, configure the remote with store.add_remote()")
    p = _as_path(path)
    if not create and not (p / CONFIG_FILE).exists():
        _load_config(p)  # raises StoreFormatError with the reason
    return Store(p, create=create, compress=compress, durable=durable, shared=shared, lock_mode=cfg.lock_mode,
                 upstream=upstream)


REMOTE_CACHE_NAME = "origin"
"""The name the remote of ``casstore.open("s3://...")`` has in its local cache's ``remotes.toml``."""


def remote_cache_dir(url: str, *, endpoint_url: Optional[str] = None, cache: Optional[PathLike] = None) -> Path:
    """Where ``casstore.open(url, endpoint_url=..., cache=...)`` keeps its local cache.

    One directory per (URL, endpoint): a readable slug of the bucket and
    prefix plus a hash, so the same bucket on two servers never shares a cache.
    """
    import hashlib
    import re

    from .sync.remotes import parse_url

    bucket, prefix = parse_url(url)
    base = _as_path(cache, "cache directory") if cache is not None else Path(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "casstore-remotes"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{bucket}-{prefix}".strip("-/"))[:80].strip("-.") or "remote"
    tag = hashlib.sha256(f"{bucket}\0{prefix}\0{endpoint_url or ''}".encode()).hexdigest()[:12]
    return base / f"{slug}-{tag}"


def _open_remote_cache(url: str, *, endpoint_url: Optional[str], cache: Optional[PathLike],
                       compress: CompressArg, durable: Optional[bool], lock_mode: str) -> Store:
    from .sync import check_endpoint_url, load_upstream, parse_url

    parse_url(url)  # both checked before the cache directory is made (a refused one left it behind)
    check_endpoint_url(endpoint_url)
    root = remote_cache_dir(url, endpoint_url=endpoint_url, cache=cache)
    root.parent.mkdir(parents=True, exist_ok=True)

    store = Store(root, compress=compress, durable=durable, lock_mode=lock_mode, upstream=False)
    want = {"url": url, **({"endpoint_url": endpoint_url} if endpoint_url else {})}
    if store.remotes().get(REMOTE_CACHE_NAME) != want:
        store.add_remote(REMOTE_CACHE_NAME, url, endpoint_url=endpoint_url, replace=True)
    if load_upstream(store) != REMOTE_CACHE_NAME:
        store.set_upstream(REMOTE_CACHE_NAME)
    else:
        store._set_upstream(REMOTE_CACHE_NAME)
    return store
